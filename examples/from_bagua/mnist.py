"""Bagua's MNIST example, redone as a Bagua user would write it, on scikit-learn's digits (no download).

Written against Bagua's own API (``import bagua.torch_api as bagua``). To run it with this
project, change that one line to ``import bagua_torch.torch_api as bagua`` and start it with
``bagua-launch --nproc-per-node 2 mnist.py --algorithm bytegrad``;
``tests/test_bagua_migration_torch.py`` does exactly that.
"""

import argparse
import logging

import bagua.torch_api as bagua
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def digits():
    data = load_digits()
    x = data.data.astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    order = np.random.default_rng(0).permutation(len(x))
    x = torch.from_numpy(x[order]).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(data.target[order]).long()
    train = torch.utils.data.TensorDataset(x[:1400], y[:1400])
    test = torch.utils.data.TensorDataset(x[1400:], y[1400:])
    return train, test


def train(args, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        if args.fuse_optimizer:
            optimizer.fuse_step()
        else:
            optimizer.step()
        if batch_idx % args.log_interval == 0:
            logging.info("Train Epoch: %d [%d/%d]\tLoss: %.6f", epoch, batch_idx, len(train_loader), loss.item())


def test(model, test_loader):
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    return correct / len(test_loader.dataset)


def main():
    parser = argparse.ArgumentParser(description="Bagua digits example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--algorithm", type=str, default="gradient_allreduce")
    parser.add_argument("--async-sync-interval", type=int, default=20)
    parser.add_argument("--fuse-optimizer", action="store_true", default=False)
    args = parser.parse_args()

    torch.manual_seed(666 + bagua.get_rank())  # different initial weights: wrapping must broadcast rank 0's
    bagua.init_process_group()
    logging.basicConfig(format="%(levelname)s:%(message)s", level=logging.ERROR)
    if bagua.get_rank() == 0:
        logging.getLogger().setLevel(logging.INFO)

    dataset1, dataset2 = digits()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        dataset1, num_replicas=bagua.get_world_size(), rank=bagua.get_rank()
    )
    train_loader = torch.utils.data.DataLoader(
        dataset1, sampler=train_sampler, batch_size=args.batch_size // bagua.get_world_size()
    )
    test_loader = torch.utils.data.DataLoader(dataset2, batch_size=1000)

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    if args.algorithm == "gradient_allreduce":
        algorithm = bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm()
    elif args.algorithm == "decentralized":
        algorithm = bagua.algorithms.decentralized.DecentralizedAlgorithm()
    elif args.algorithm == "low_precision_decentralized":
        algorithm = bagua.algorithms.decentralized.LowPrecisionDecentralizedAlgorithm()
    elif args.algorithm == "bytegrad":
        algorithm = bagua.algorithms.bytegrad.ByteGradAlgorithm()
    elif args.algorithm == "qadam":
        optimizer = bagua.algorithms.q_adam.QAdamOptimizer(
            model.parameters(), lr=3e-3, warmup_steps=20, weight_decay=1e-4
        )
        algorithm = bagua.algorithms.q_adam.QAdamAlgorithm(optimizer)
    elif args.algorithm == "async":
        algorithm = bagua.algorithms.async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=args.async_sync_interval,
        )
    else:
        raise NotImplementedError

    model = model.with_bagua([optimizer], algorithm, do_flatten=not args.fuse_optimizer)

    if args.fuse_optimizer:
        optimizer = bagua.contrib.fuse_optimizer(optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        if args.algorithm == "async":
            model.bagua_algorithm.resume(model)

        train(args, model, train_loader, optimizer, epoch)

        if args.algorithm == "async":
            model.bagua_algorithm.abort(model)

        accuracy = test(model, test_loader)
        logging.info("Test set: accuracy %.4f", accuracy)
        scheduler.step()

    accuracies = torch.zeros(bagua.get_world_size(), dtype=torch.float64)
    bagua.allgather(torch.tensor([accuracy], dtype=torch.float64), accuracies)
    if bagua.get_rank() == 0:
        print("test accuracy per rank: " + ", ".join(f"{a:.4f}" for a in accuracies.tolist()), flush=True)


if __name__ == "__main__":
    main()

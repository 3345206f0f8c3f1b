"""Rank bodies for test_bagua_compat_torch.py: Bagua's API points, each next to plain torch.distributed.

``every_api_point`` returns, per name, ``(bagua_result, reference)`` pairs as NumPy arrays (or
plain values); the reference is computed with ``torch.distributed`` (gloo) or plain torch on
the same data, on the same rank.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return torch.softmax(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))), dim=1)


BAGUA_VALUES = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BOR": 7, "BAND": 8, "BXOR": 9, "AVG": 10}
"""Bagua's ``ReduceOp`` (an IntEnum in bagua/torch_api/communication.py): callers may pass these integers."""


def _primitives(bagua, out: dict, seed: int) -> None:
    rank, n = bagua.get_rank(), bagua.get_world_size()
    gen = torch.Generator().manual_seed(seed + 100 + rank)
    comm = bagua.communication._get_default_group().get_global_communicator()

    ops = {
        "SUM": dist.ReduceOp.SUM,
        "PRODUCT": dist.ReduceOp.PRODUCT,
        "MIN": dist.ReduceOp.MIN,
        "MAX": dist.ReduceOp.MAX,
        "BAND": dist.ReduceOp.BAND,
        "BOR": dist.ReduceOp.BOR,
        "BXOR": dist.ReduceOp.BXOR,
    }
    for name, torch_op in ops.items():
        bitwise = name in ("BAND", "BOR", "BXOR")
        x = torch.randint(0, 1 << 20, (6,), generator=gen) if bitwise else torch.rand(6, generator=gen) + 0.5
        expected = x.clone()
        dist.all_reduce(expected, op=torch_op)
        recv = torch.zeros_like(x)
        bagua.allreduce(x, recv, op=bagua.ReduceOp[name], comm=comm)
        inplace = x.clone()
        bagua.allreduce_inplace(inplace, op=bagua.ReduceOp[name])
        by_value = torch.zeros_like(x)
        bagua.allreduce(x, by_value, op=BAGUA_VALUES[name], comm=comm)
        out[f"allreduce {name}"] = (_np(recv), _np(expected))
        out[f"allreduce_inplace {name}"] = (_np(inplace), _np(expected))
        out[f"allreduce {name} by Bagua's value"] = (_np(by_value), _np(expected))
    x = torch.rand(2, 3, generator=gen)
    expected = x.clone()
    dist.all_reduce(expected)
    recv = torch.zeros(2, 3)
    bagua.allreduce(x, recv, op=bagua.ReduceOp.AVG)
    out["allreduce AVG"] = (_np(recv), _np(expected / n))
    bagua.allreduce(x, recv, op=BAGUA_VALUES["AVG"])
    out["allreduce AVG by Bagua's value"] = (_np(recv), _np(expected / n))
    try:
        bagua.allreduce(x, recv, op=4)  # no member of Bagua's has the value 4
    except ValueError as e:
        out["unknown reduction refused"] = (str(e).startswith("unknown reduction 4;"), True)

    x = torch.rand(5, generator=gen)
    expected = x.clone()
    dist.broadcast(expected, 1)
    bagua.broadcast(x, 1, comm=comm)
    out["broadcast"] = (_np(x), _np(expected))

    for dst in range(n):
        x = torch.rand(4, generator=gen)
        expected = x.clone()
        dist.reduce(expected, dst, op=dist.ReduceOp.MAX)
        recv = torch.full((4,), -7.0)
        bagua.reduce(x, recv, dst, op=bagua.ReduceOp.MAX)
        inplace = x.clone()
        bagua.reduce_inplace(inplace, dst, op=bagua.ReduceOp.MAX)
        out[f"reduce to {dst}"] = (_np(recv), _np(expected if rank == dst else torch.full((4,), -7.0)))
        out[f"reduce_inplace to {dst}"] = (_np(inplace), _np(expected if rank == dst else x))

    x = torch.rand(2, 2, generator=gen)
    parts = [torch.zeros(2, 2) for _ in range(n)]
    dist.all_gather(parts, x)
    recv = torch.zeros(n, 4)
    bagua.allgather(x, recv)
    out["allgather"] = (_np(recv.reshape(-1)), _np(torch.cat(parts).reshape(-1)))
    whole = torch.zeros(n * 3)
    whole[rank * 3 : rank * 3 + 3] = torch.arange(3) + 10.0 * rank
    bagua.allgather_inplace(whole)
    out["allgather_inplace"] = (_np(whole), _np(torch.cat([torch.arange(3) + 10.0 * r for r in range(n)])))

    x = torch.rand(3, generator=gen)
    parts = [torch.zeros(3) for _ in range(n)] if rank == 1 else None
    dist.gather(x, parts, dst=1)
    recv = torch.full((3 * n,), -1.0)
    bagua.gather(x, recv, 1)
    out["gather"] = (_np(recv), _np(torch.cat(parts) if rank == 1 else torch.full((3 * n,), -1.0)))
    buffer = torch.full((3 * n,), -2.0) if rank == 1 else x.clone()
    if rank == 1:
        buffer[3:6] = x
    bagua.gather_inplace(buffer, 3, 1)
    out["gather_inplace"] = (_np(buffer), _np(torch.cat(parts) if rank == 1 else x))

    rows = torch.rand(n * 2, generator=gen)
    expected = torch.zeros(2)
    dist.scatter(expected, list(rows.view(n, 2).unbind(0)) if rank == 0 else None, src=0)
    recv = torch.zeros(2)
    bagua.scatter(rows, recv, 0)
    out["scatter"] = (_np(recv), _np(expected))
    buffer = rows.clone() if rank == 0 else torch.zeros(2)
    bagua.scatter_inplace(buffer, 2, 0)
    out["scatter_inplace"] = (_np(buffer), _np(rows if rank == 0 else expected))

    x = torch.rand(n * 3, generator=gen)
    reduced = x.clone()
    dist.all_reduce(reduced)
    recv = torch.zeros(3)
    bagua.reduce_scatter(x, recv)
    out["reduce_scatter"] = (_np(recv), _np(reduced.view(n, 3)[rank]))
    inplace = x.clone()
    bagua.reduce_scatter_inplace(inplace, op=bagua.ReduceOp.SUM)
    expected = x.clone()
    expected.view(n, 3)[rank] = reduced.view(n, 3)[rank]
    out["reduce_scatter_inplace"] = (_np(inplace), _np(expected))

    x = torch.rand(n * 2, generator=gen)
    expected = torch.zeros(n * 2)
    dist.all_to_all_single(expected, x)
    recv = torch.zeros(n * 2)
    bagua.alltoall(x, recv)
    inplace = x.clone()
    bagua.alltoall_inplace(inplace)
    out["alltoall"] = (_np(recv), _np(expected))
    out["alltoall_inplace"] = (_np(inplace), _np(expected))

    # alltoall_v: rank r sends 1 + r + j elements from offset 3j to rank j; receives into gaps of 2.
    send_counts = [1 + rank + j for j in range(n)]
    recv_counts = [1 + r + rank for r in range(n)]
    send_displs = [3 * j for j in range(n)]
    recv_displs = [sum(recv_counts[:r]) + 2 * r for r in range(n)]
    x = torch.arange(20, dtype=torch.float32) + 100 * rank
    packed = torch.cat([x[send_displs[j] : send_displs[j] + send_counts[j]] for j in range(n)])
    received = torch.zeros(sum(recv_counts))
    dist.all_to_all_single(received, packed, recv_counts, send_counts)
    expected = torch.full((sum(recv_counts) + 2 * n,), -5.0)
    offset = 0
    for r in range(n):
        expected[recv_displs[r] : recv_displs[r] + recv_counts[r]] = received[offset : offset + recv_counts[r]]
        offset += recv_counts[r]
    recv = torch.full_like(expected, -5.0)
    bagua.alltoall_v(x, send_counts, send_displs, recv, recv_counts, recv_displs)
    out["alltoall_v"] = (_np(recv), _np(expected))
    counts, displs = [2] * n, [4 * j for j in range(n)]
    x = torch.arange(4.0 * n) + 100 * rank
    expected = x.clone()
    for j in range(n):
        expected[4 * j : 4 * j + 2] = torch.arange(4.0 * rank, 4.0 * rank + 2) + 100 * j
    bagua.alltoall_v_inplace(x, counts, displs)
    out["alltoall_v_inplace"] = (_np(x), _np(expected))

    # A tensor of n + 1 elements does not split into one equal part per rank: refused before communicating.
    uneven = torch.arange(n + 1.0)
    calls = {
        "allgather_inplace": lambda: bagua.allgather_inplace(uneven),
        "reduce_scatter_inplace": lambda: bagua.reduce_scatter_inplace(uneven),
        "alltoall": lambda: bagua.alltoall(uneven, uneven.clone()),
    }
    refusals = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            refusals[name] = str(e)
    out["uneven parts refused"] = (
        refusals,
        {name: f"{name}: {n + 1} elements do not split into {n} equal parts" for name in calls},
    )

    if rank == 0:
        bagua.send(torch.arange(3.0) + 0.25, 1)
    elif rank == 1:
        got = torch.zeros(3)
        bagua.recv(got, 0)
        out["send/recv"] = (_np(got), _np(torch.arange(3.0) + 0.25))
    bagua.barrier()

    singles = bagua.communication.new_group([0])
    x = torch.ones(2) * (rank + 1)
    bagua.allreduce_inplace(x, comm=singles.get_global_communicator())
    out["new_group member/non-member"] = (_np(x), _np(torch.ones(2) * (rank + 1)))
    pair = bagua.communication.new_group()
    x = torch.ones(2) * (rank + 1)
    bagua.allreduce_inplace(x, comm=pair.get_global_communicator())
    out["new_group all ranks"] = (_np(x), _np(torch.ones(2) * sum(range(1, n + 1))))
    outside = [bagua.communication._rank_not_in_group(g) for g in (singles, pair, None)]
    out["new_group _rank_not_in_group"] = (outside, [rank != 0, False, False])
    torch_group = dist.new_group(list(range(n)))
    from_torch = bagua.communication.from_torch_group(torch_group)
    x = torch.ones(2) * (rank + 1)
    bagua.allreduce_inplace(x, op=bagua.ReduceOp.MAX, comm=from_torch.get_global_communicator())
    out["from_torch_group"] = (_np(x), _np(torch.ones(2) * n))
    out["group ranks"] = (
        [singles.ranks, pair.ranks, from_torch.ranks, from_torch.get_global_communicator().nranks()],
        [[0], list(range(n)), list(range(n)), n],
    )


def _optimizer_state(bagua, out: dict, seed: int) -> None:
    """Bagua's test_broadcast_state: train locally apart, wrap, every optimizer's state is rank 0's; with Bagua's
    spelling, the project's ``with_bagua`` and its ``DistributedDataParallel``."""
    import bagua_torch

    rank = bagua.get_rank()
    spellings = {
        "bagua": lambda model, opt: model.with_bagua(
            [opt], bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm()
        ),
        "own": lambda model, opt: bagua_torch.with_bagua(model, [opt], "gradient_allreduce"),
        "ddp": lambda model, opt: bagua_torch.DistributedDataParallel(model, optimizers=[opt]),
    }
    for name, cls, options in [
        ("SGD", torch.optim.SGD, {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1}),
        ("Adam", torch.optim.Adam, {"lr": 0.02 * (rank + 1)}),
        ("Rprop", torch.optim.Rprop, {"lr": 0.2}),
    ]:
        for spelling, wrap in spellings.items():
            torch.manual_seed(seed + rank)
            model = Net()
            optimizer = cls(model.parameters(), **options)
            for _ in range(5):
                optimizer.zero_grad()
                nn.functional.mse_loss(model(torch.randn(4, 2)), torch.randn(4, 4)).backward()
                optimizer.step()
            before = optimizer.state_dict()
            model = wrap(model, optimizer)
            after = optimizer.state_dict()
            flat_before = [np.asarray(v).ravel() for s in before["state"].values() for _, v in sorted(s.items())]
            flat_after = [np.asarray(v).ravel() for s in after["state"].values() for _, v in sorted(s.items())]
            lrs = [g["lr"] for g in after["param_groups"]]
            out[f"optimizer state {name} {spelling}"] = (
                np.concatenate(flat_after + [np.asarray(lrs, dtype=np.float64)]),
                np.concatenate(flat_before + [np.asarray([g["lr"] for g in before["param_groups"]], dtype=np.float64)]),
            )
            out[f"model state {name} {spelling}"] = np.concatenate(
                [_np(v).ravel() for v in model.module.state_dict().values()]
            )
            model.close()


def _train(model, optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 2, generator=gen)), torch.randn(4, 4, generator=gen)).backward()
        optimizer.step()


def _model_switch(bagua, out: dict, seed: int) -> None:
    """Bagua's test_model_switch, then a check that only the last algorithm acts on the gradients."""
    rank = bagua.get_rank()
    algorithms = bagua.algorithms
    torch.manual_seed(seed + rank)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, kind in enumerate(["bytegrad", "decentralized", "gradient_allreduce", "qadam", "async", "low_prec"]):
        if kind == "bytegrad":
            algorithm = algorithms.bytegrad.ByteGradAlgorithm(hierarchical=False)
        elif kind == "decentralized":
            algorithm = algorithms.decentralized.DecentralizedAlgorithm(hierarchical=False)
        elif kind == "gradient_allreduce":
            algorithm = algorithms.gradient_allreduce.GradientAllReduceAlgorithm()
        elif kind == "qadam":
            optimizer = algorithms.q_adam.QAdamOptimizer(model.parameters(), warmup_steps=3)
            algorithm = algorithms.q_adam.QAdamAlgorithm(optimizer, hierarchical=False)
        elif kind == "async":
            algorithm = algorithms.async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=5)
        else:
            algorithm = algorithms.decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)
        model = model.with_bagua([optimizer], algorithm)
        if kind == "async":
            model.bagua_algorithm.resume(model)  # before any abort: nothing to do, as in Bagua
        _train(model, optimizer, 8, seed=seed + 10 * step + rank)
        if kind == "async":
            model.bagua_algorithm.abort(model)
            model.bagua_algorithm.abort(model)
            model.bagua_algorithm.resume(model)
            _train(model, optimizer, 4, seed=seed + 99 + rank)
            model.bagua_algorithm.abort(model)
    # Back to gradient allreduce: the gradients must be exactly the mean of the ranks' own.
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    model = model.with_bagua([sgd], algorithms.gradient_allreduce.GradientAllReduceAlgorithm())
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed + rank))
    reference = Net()
    reference.load_state_dict(model.state_dict())
    nn.functional.mse_loss(reference(x), torch.zeros(4, 4)).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    dist.all_reduce(expected)
    sgd.zero_grad()
    nn.functional.mse_loss(model(x), torch.zeros(4, 4)).backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    out["switch: gradients after switching"] = (_np(got), _np(expected / bagua.get_world_size()))
    out["switch: bagua_optimizers"] = (model.bagua_optimizers == [sgd], True)
    model.close()


def _custom_algorithm(bagua, out: dict, seed: int) -> None:
    base = bagua.algorithms.base

    class DoubledAverageImpl(base.AlgorithmImpl):
        def __init__(self, process_group, compression):
            super().__init__(process_group)
            self.compression = compression
            self.steps = 0

        def init_operations(self, bagua_ddp, bucket):
            def double(name):
                for tensor in bucket.tensors:
                    tensor.mul_(2.0)

            bucket.clear_ops()
            bucket.append_python_op(double)
            bucket.append_centralized_synchronous_op(average=True, compression=self.compression)

        def init_post_optimizer_step_hook(self, bagua_ddp):
            def hook(optimizer):
                self.steps += 1

            return hook

    class DoubledAverage(base.Algorithm):
        def __init__(self, compression=None):
            self.compression = compression

        def reify(self, process_group):
            return DoubledAverageImpl(process_group, self.compression)

    rank = bagua.get_rank()
    for compression in (None, "MinMaxUInt8"):
        torch.manual_seed(seed)
        model = Net()
        reference = Net()
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = model.with_bagua([optimizer], DoubledAverage(compression))
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed + rank))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), torch.ones(4, 4)).backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        optimizer.step()
        nn.functional.mse_loss(reference(x), torch.ones(4, 4)).backward()
        expected = torch.cat([2.0 * p.grad.reshape(-1) for p in reference.parameters()])
        dist.all_reduce(expected)
        out[f"custom algorithm {compression}"] = (_np(got), _np(expected / bagua.get_world_size()))
        out[f"custom algorithm {compression} step hook"] = (model.bagua_algorithm.bagua_impl.steps, 1)
        model.close()


def _own_interface_algorithm(bagua, out: dict, seed: int) -> None:
    """An algorithm in the project's own interface, as a class and as an instance, through the project's with_bagua."""
    import bagua_torch
    from bagua_torch.algorithms.base import Algorithm, AlgorithmImpl

    class DoubledAverageImpl(AlgorithmImpl):
        def reduce_bucket(self, bucket):
            return self.world.allreduce_async(bucket.grad * 2.0, "avg")

    class DoubledAverage(Algorithm):
        name = "doubled_average"

        def reify(self, context):
            return DoubledAverageImpl(context)

    rank = bagua.get_rank()
    for how, algorithm in (("class", DoubledAverage), ("instance", DoubledAverage())):
        torch.manual_seed(seed)
        model = Net()
        reference = Net()
        reference.load_state_dict(model.state_dict())
        model = bagua_torch.with_bagua(model, [], algorithm)
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed + rank))
        nn.functional.mse_loss(model(x), torch.ones(4, 4)).backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
        nn.functional.mse_loss(reference(x), torch.ones(4, 4)).backward()
        expected = torch.cat([2.0 * p.grad.reshape(-1) for p in reference.parameters()])
        dist.all_reduce(expected)
        out[f"own-interface algorithm {how}"] = (_np(got), _np(expected / bagua.get_world_size()))
        model.close()


def _data_parallel_and_checkpoint(bagua, out: dict, seed: int, checkpoint_dir: str) -> None:
    rank = bagua.get_rank()
    torch.manual_seed(seed + rank)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp = bagua.data_parallel.DistributedDataParallel(
        model,
        optimizers=[optimizer],
        algorithm=bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm(average=False),
    )
    reference = torch.nn.parallel.DistributedDataParallel(Net())
    reference.module.load_state_dict(ddp.state_dict())
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(seed + rank))
    optimizer.zero_grad()
    nn.functional.mse_loss(ddp(x), torch.ones(8, 4)).backward()
    nn.functional.mse_loss(reference(x), torch.ones(8, 4)).backward()
    got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    out["data_parallel summing vs torch DDP"] = (_np(got), _np(expected * bagua.get_world_size()))
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    scheduler.step()
    bagua.checkpoint.save_checkpoint(7, checkpoint_dir, ddp, optimizer, scheduler)
    saved = [_np(v).copy() for v in ddp.state_dict().values()]
    fresh = Net()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, 1, gamma=0.5)
    iteration = bagua.checkpoint.load_checkpoint(checkpoint_dir, fresh, fresh_optimizer, fresh_scheduler)
    out["checkpoint iteration"] = (iteration, 7)
    out["checkpoint model"] = (
        np.concatenate([_np(v).ravel() for v in fresh.state_dict().values()]),
        np.concatenate([v.ravel() for v in saved]),
    )
    out["checkpoint optimizer lr"] = (fresh_optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["lr"])
    out["checkpoint optimizer step"] = (
        float(fresh_optimizer.state_dict()["state"][0]["step"]),
        float(optimizer.state_dict()["state"][0]["step"]),
    )
    out["model face: attribute of the model"] = (ddp.fc1 is model.fc1, True)
    ddp.close()


def _reference_compress(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bagua's test compressor (tests/internal/compressor.py), written out again."""
    lo, hi = torch.min(t), torch.max(t)
    scale = 255.0 / (hi - lo + 1e-7)
    upper = torch.round(hi * scale)
    level = torch.clamp(torch.round(t * scale), max=upper)
    return torch.stack([lo, hi]), (level - (upper - 255.0)).to(torch.uint8)


def _reference_decompress(minmax: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    scale = 255.0 / (minmax[1] - minmax[0] + 1e-7)
    return (codes.float() + torch.round(minmax[1] * scale) - 255.0) / scale


def _exchange_with_neighbours(tensor: torch.Tensor, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    left, right = torch.zeros_like(tensor), torch.zeros_like(tensor)
    requests = [
        dist.isend(tensor, (rank - 1) % n),
        dist.isend(tensor, (rank + 1) % n),
        dist.irecv(left, (rank - 1) % n),
        dist.irecv(right, (rank + 1) % n),
    ]
    for request in requests:
        request.wait()
    return left, right


def _low_precision_against_baguas_reference(bagua, out: dict, seed: int) -> None:
    """Bagua's test_compare: the algorithm next to its test's reference (ring exchange by isend/irecv)."""
    rank, n = bagua.get_rank(), bagua.get_world_size()
    for interval in (1, 2):
        torch.manual_seed(seed + rank)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        algorithm = bagua.algorithms.decentralized.LowPrecisionDecentralizedAlgorithm(
            hierarchical=False, communication_interval=interval, codec="bagua"
        )
        model = model.with_bagua([optimizer], algorithm)
        reference = Net()
        reference.load_state_dict(model.state_dict())
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
        params = [p.data for p in reference.parameters()][::-1]
        weight = torch.cat([p.reshape(-1) for p in params])
        left, right = weight.clone(), weight.clone()
        gen = torch.Generator().manual_seed(seed + 1000 * interval + rank)
        for step in range(10):
            data, target = torch.randn(4, 2, generator=gen), torch.randn(4, 4, generator=gen)
            for m, o in ((model, optimizer), (reference, reference_optimizer)):
                o.zero_grad()
                nn.functional.mse_loss(m(data), target).backward()
                o.step()
            if step % interval == 0:
                x = torch.cat([p.reshape(-1) for p in params])
                x += 1 / 3 * left
                x += 1 / 3 * right
                x -= 5 / 3 * weight
                minmax, codes = _reference_compress(x)
                left_codes, right_codes = _exchange_with_neighbours(codes, rank, n)
                left_minmax, right_minmax = _exchange_with_neighbours(minmax, rank, n)
                left += _reference_decompress(left_minmax, left_codes)
                right += _reference_decompress(right_minmax, right_codes)
                weight = weight + _reference_decompress(minmax, codes)
                offset = 0
                for p in params:
                    p.copy_(weight[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        out[f"low precision decentralized, Bagua's codec, interval {interval}"] = (
            _np(torch.cat([p.reshape(-1) for p in model.parameters()])),
            _np(torch.cat([p.reshape(-1) for p in reference.parameters()])),
        )
        model.close()


def _fused_optimizer_keeps_the_algorithm(bagua, out: dict, seed: int) -> None:
    """contrib.fuse_optimizer after with_bagua: the weight algorithm's step hooks move to the fused optimizer."""
    torch.manual_seed(seed + bagua.get_rank())
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = bagua.algorithms.decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    model = model.with_bagua([optimizer], algorithm, do_flatten=False)
    optimizer = bagua.contrib.fuse_optimizer(optimizer)
    _train_fused(model, optimizer, 3)
    out["fused optimizer: algorithm rounds"] = (model.bagua_algorithm.step, 3)
    model.close()


def _train_fused(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 2)), torch.randn(4, 4)).backward()
        optimizer.fuse_step()


def every_api_point(seed: int, checkpoint_dir: str) -> dict:
    import bagua_torch.torch_api as bagua

    bagua.init_process_group()
    out: dict = {
        "rank": bagua.get_rank(),
        "env": (
            [bagua.get_rank(), bagua.get_world_size(), bagua.get_local_rank(), bagua.get_local_size()],
            [dist.get_rank(), dist.get_world_size(), dist.get_rank(), dist.get_world_size()],
        ),
    }
    _primitives(bagua, out, seed)
    _optimizer_state(bagua, out, seed)
    _model_switch(bagua, out, seed)
    _custom_algorithm(bagua, out, seed)
    _own_interface_algorithm(bagua, out, seed)
    _low_precision_against_baguas_reference(bagua, out, seed)
    _fused_optimizer_keeps_the_algorithm(bagua, out, seed)
    _data_parallel_and_checkpoint(bagua, out, seed, checkpoint_dir)
    return out

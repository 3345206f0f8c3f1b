"""The fused optimizer against plain torch optimizers: bitwise equal, or a clear refusal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bagua_torch.fused_optimizer import fuse_optimizer, fuse_step

# Every elementwise torch optimizer, with a second param group that changes lr and, where the
# class has one, weight decay.
ELEMENTWISE = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, {"lr": 0.01, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}, {"lr": 3e-3, "weight_decay": 0.0}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2}, {"lr": 3e-3, "weight_decay": 0.3}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}, {"lr": 2e-2, "weight_decay": 0.1}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}, {"lr": 2e-3, "weight_decay": 0.1}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}, {"lr": 2e-3, "weight_decay": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-3, "centered": True, "momentum": 0.5}, {"lr": 1e-2}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}, {"lr": 3e-3}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}, {"lr": 3e-2, "weight_decay": 0.1}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}, {"lr": 0.5, "weight_decay": 0.1}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2}, {"lr": 3e-2, "weight_decay": 0.1}),
}


class Mixed(nn.Module):
    """float32 and float64 layers, a frozen parameter and one the forward pass never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 5)
        self.second = nn.Linear(5, 3).double()
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)).double()) + self.frozen


def _groups(model: Mixed, second: dict) -> list[dict]:
    return [
        {"params": list(model.first.parameters())},
        {"params": [*model.second.parameters(), model.frozen, model.unused], **second},
    ]


def _train(name: str, fused: bool, steps: int, set_to_none: bool, seed: int = 0):
    cls, defaults, second = ELEMENTWISE[name]
    torch.manual_seed(seed)
    model = Mixed()
    optimizer = cls(_groups(model, second), **defaults)
    if fused:
        optimizer = fuse_optimizer(optimizer)
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=data)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad(set_to_none=set_to_none)
        loss.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.filterwarnings("ignore:fuse_optimizer. some parameters have no gradient")
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_bitwise_equal_to_the_unfused_optimizer(name, set_to_none):
    plain, plain_opt = _train(name, fused=False, steps=50, set_to_none=set_to_none)
    fused, fused_opt = _train(name, fused=True, steps=50, set_to_none=set_to_none)
    for (key, a), b in zip(plain.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {key} differs"
    plain_state, fused_state = plain_opt.state_dict(), fused_opt.state_dict()
    assert plain_state["param_groups"] == fused_state["param_groups"]
    assert plain_state["state"].keys() == fused_state["state"].keys()
    for index, entry in plain_state["state"].items():
        for key, value in entry.items():
            other = fused_state["state"][index][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (name, index, key)
    stats = fused_opt.stats()
    # The unused parameter never has a gradient: its chunk steps parameter by parameter.
    assert stats["fused_steps"] == 50 and stats["unfused_chunk_steps"] == 50
    # Fresh gradients are copied in at every step, or only at the first (4 used tensors).
    assert stats["gradient_copies"] == (4 * 50 if set_to_none else 4)


def test_gradients_accumulate_into_the_flat_buffer_without_copies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    copies = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=False)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        copies.append(optimizer.stats()["gradient_copies"])
    # The first backward allocates the gradients (copied in once); later ones accumulate in place.
    assert copies == [4, 4, 4]
    assert optimizer.stats()["chunks"] == 1
    flat = optimizer.inner.param_groups[0]["params"][0]
    for p in model.parameters():
        assert p.data_ptr() >= flat.data_ptr() and p.grad.data_ptr() >= flat.grad.data_ptr()


def test_state_dict_round_trip_fused_plain_fused_continues_equally():
    torch.manual_seed(0)
    reference = nn.Linear(5, 3)
    model = nn.Linear(5, 3)
    model.load_state_dict(reference.state_dict())
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    data = [torch.randn(4, 5) for _ in range(12)]

    def one_step(net, optimizer, x):
        optimizer.zero_grad()
        (net(x) ** 2).sum().backward()
        optimizer.step()

    for x in data[:4]:
        one_step(reference, plain, x)
        one_step(model, fused, x)
    # fused -> plain: a new plain optimizer continues from the fused state.
    moved = torch.optim.Adam(model.parameters(), lr=1e-2)
    moved.load_state_dict(fused.state_dict())
    for x in data[4:8]:
        one_step(reference, plain, x)
        one_step(model, moved, x)
    # plain -> fused again.
    refused = fuse_optimizer(moved)
    for x in data[8:]:
        one_step(reference, plain, x)
        one_step(model, refused, x)
    assert torch.equal(reference.weight, model.weight) and torch.equal(reference.bias, model.bias)
    assert torch.equal(plain.state_dict()["state"][0]["exp_avg_sq"], refused.state_dict()["state"][0]["exp_avg_sq"])


def test_scheduler_and_grad_scaler_with_bf16_autocast():
    def run(fused: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if fused:
            optimizer = fuse_optimizer(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        data = torch.Generator().manual_seed(3)
        for _ in range(10):
            x = torch.randn(16, 8, generator=data)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        return model, optimizer

    plain, plain_opt = run(False)
    fused, fused_opt = run(True)
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(a, b)
    assert plain_opt.param_groups[0]["lr"] == fused_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**10)


class ToyLamb(torch.optim.Optimizer):
    """SGD scaled per tensor by ||p|| / ||g|| (LAMB's trust ratio): not elementwise."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


class PlainPythonAdam(torch.optim.Optimizer):
    """An elementwise optimizer written by a user, with no foreach or fused kernel."""

    def __init__(self, params, lr: float = 1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.addcdiv_(state["m"], state["v"].sqrt().add_(1e-8), value=-group["lr"])


def test_a_per_tensor_optimizer_is_caught_at_the_first_step_and_undone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = fuse_optimizer(ToyLamb(model.parameters()), elementwise=True)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="ToyLamb .* not elementwise"):
        optimizer.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_known_non_elementwise_optimizers_are_refused_by_name():
    with pytest.raises(TypeError, match="ToyLamb does not step elementwise"):
        fuse_optimizer(ToyLamb(nn.Linear(2, 2).parameters()))
    with pytest.raises(TypeError, match="LBFGS"):
        fuse_optimizer(torch.optim.LBFGS(nn.Linear(2, 2).parameters()))


def test_a_plain_python_optimizer_fuses_bitwise():
    def run(fused: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
        optimizer = PlainPythonAdam(model.parameters())
        if fused:
            optimizer = fuse_step(optimizer)
        for _ in range(20):
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
            optimizer.step()
        return model

    for a, b in zip(run(False).parameters(), run(True).parameters()):
        assert torch.equal(a, b)


def test_bad_inputs_raise_clear_errors():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not contiguous"):
        fuse_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1))
    embedding = nn.Embedding(10, 3, sparse=True)
    optimizer = fuse_optimizer(torch.optim.SGD(embedding.parameters(), lr=0.1))
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        optimizer.step()
    with pytest.raises(TypeError, match="already fused"):
        fuse_optimizer(optimizer)
    with pytest.raises(RuntimeError, match="before fusing"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


ALGORITHMS = [
    "gradient_allreduce",
    "bytegrad",
    "powersgd",
    "decentralized",
    "low_precision_decentralized",
    "async",
    "qadam",
    "onebit_adam",
    "diloco",
]
REFUSED = {"qadam": "QAdamOptimizer", "onebit_adam": "OneBitAdamOptimizer"}
IDENTICAL_REPLICAS = ("gradient_allreduce", "bytegrad", "powersgd")


@pytest.fixture(scope="module")
def fused_runs(seed):
    """One 2-rank gloo job: every algorithm wrapped with Adam (two groups cutting a bucket) over an MLP, trained
    unfused and then fused on the model's buckets."""
    from multiprocess import run_ranks

    return run_ranks(
        "fused_optimizer_workers_torch:every_algorithm_fused_and_unfused", 2, seed, ALGORITHMS, timeout=300
    )


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a not in REFUSED and a != "async"])
def test_fused_on_the_buckets_equals_unfused_with_as_many_collectives(fused_runs, algorithm):
    """Bitwise the unfused parameters after every step and the same collectives, with the algorithm's step hooks
    on the fused optimizer (decentralized averaging ran 0 rounds fused before)."""
    from fused_optimizer_workers_torch import STEPS

    for result in fused_runs:
        unfused, fused = result.value[algorithm]["False"], result.value[algorithm]["True"]
        assert fused["buckets"] == 3 and fused["grads_are_bucket_views"]
        assert len(fused["steps"]) == STEPS
        for step, (a, b) in enumerate(zip(unfused["steps"], fused["steps"])):
            for name in a:
                assert a[name].tobytes() == b[name].tobytes(), (algorithm, step, name)
        assert any(not np.array_equal(unfused["steps"][0][n], unfused["steps"][-1][n]) for n in unfused["steps"][0])
        assert fused["calls"] == unfused["calls"] and sum(fused["calls"].values()) > 0
        if algorithm in ("decentralized", "low_precision_decentralized"):
            assert fused["rounds"] == unfused["rounds"] == STEPS
        stats = fused["stats"]
        assert stats["fused_steps"] == STEPS and stats["unfused_chunk_steps"] == 0
        assert stats["chunks"] == 4  # 3 buckets, the first cut by the groups
        if algorithm in ("gradient_allreduce", "bytegrad"):  # they hand their result over: nothing is copied
            assert stats["bytes_copied"] == 0 and stats["model_bytes_copied"] == 0, stats
    if algorithm in IDENTICAL_REPLICAS:
        for name, value in fused_runs[0].value[algorithm]["True"]["steps"][-1].items():
            assert value.tobytes() == fused_runs[1].value[algorithm]["True"]["steps"][-1][name].tobytes()


def test_fused_asynchronous_averaging_leaves_the_warm_up_and_averages(fused_runs):
    """The rounds run on a clock, so the weights are not compared; the step count, the end of the warm-up and a
    completed round are (fused, the step hooks never ran: the warm-up never ended)."""
    from fused_optimizer_workers_torch import STEPS

    for result in fused_runs:
        for run in result.value["async"].values():
            assert run["async_steps"] == STEPS and run["warm"] and run["rounds"] >= 1


@pytest.mark.parametrize("algorithm", sorted(REFUSED))
def test_fusing_the_adam_family_is_refused_by_name(fused_runs, algorithm):
    for result in fused_runs:
        assert result.value[algorithm]["True"] == {
            "refused": f"fuse_optimizer: {REFUSED[algorithm]} does not step elementwise (its update of a tensor "
            "depends on the whole tensor), so fusing would change its math; pass elementwise=True only if you "
            "know it is"
        }
        assert len(result.value[algorithm]["False"]["steps"]) == 6


class WarmupSGD(torch.optim.Optimizer):
    """SGD whose step grows to ``lr`` over ``warmup`` steps; ``warmup`` is kept as an attribute, not a default."""

    def __init__(self, params, lr: float = 0.1, warmup: int = 2):
        super().__init__(params, {"lr": lr})
        self.warmup = warmup

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["t"] = state.get("t", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] * min(1.0, state["t"] / self.warmup))


def test_a_constructor_argument_kept_outside_the_defaults_survives_fusing(rng):
    """Rebuilt from its defaults alone, the fused copy would warm up over 2 steps instead of 8 (the first-step
    check cannot see it: it rebuilds the same way)."""
    data = [torch.from_numpy(rng.standard_normal((4, 6)).astype(np.float32)) for _ in range(6)]

    def run(fused: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
        optimizer = WarmupSGD(model.parameters(), lr=0.1, warmup=8)
        if fused:
            optimizer = fuse_optimizer(optimizer)
        for x in data:
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
        return list(model.parameters())

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)

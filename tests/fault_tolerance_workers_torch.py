"""A rank of a fault-tolerant torch job (started by test_fault_tolerance_torch.py), printing JSON lines.

Environment: the launcher's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; BAGUA_FT_JOIN=1 for a
joiner), ``FT_ALGORITHM`` (a registry name, then optionally its options as JSON), ``FT_STEPS``
(stop after this step once ``FT_WORLD`` members train together), ``FT_FAULTS`` (JSON list of
``{"rank", "step", "where", "kind"}``). At that step, in ``forward``, ``backward`` (in a gradient
hook), ``before_vote`` (the optimizer's step begins), ``vote`` (the step's collectives done, about
to vote), ``recovery`` (entering the next epoch) or ``exchange`` (inside DiLoCo's outer exchange),
or at step 0 in ``formation`` (before it registers with the others), ``state`` (before it sends a
joiner the state), ``state_tensors`` (connected to the joiner, before the tensors) or
``joiner_forward`` (a joiner's first step; rank null), the rank ``kill``s itself (SIGKILL), ``stop``s
(SIGSTOP), ``raise``s, is ``slow`` (``seconds``, default 0.3), is cut off by a ``partition`` (run in the network
harness's namespaces: it takes its link down, for good or for ``seconds``) or, at a vote, ``late`` (it votes after
its epoch closed). It does so ``after`` seconds (default 0), and once the marks listed in ``once`` are in
``FT_MARKS``: other faults that fired (``"rank-step-where"``) or ``joiner-asked`` (a joiner asked to be admitted).
``FT_STEP_SECONDS``: each step also computes for that long (a model that takes time); ``FT_FUSED=1``: the optimizer
is fused over the model's buckets (:func:`bagua_torch.fuse_optimizer`); ``FT_LOOP_ALLREDUCE=1``: each step ends with
a collective of the loop's own (``bagua_torch.torch_api.allreduce`` of a one, on the default group), and its step
report gives the sum as ``summed``; ``FT_REPORT_PARAMS=1``: each step report gives the parameters after it
(``params``) and, under SGD, its momentum (``momentum``), and each DiLoCo exchange report this rank's
pseudo-gradient and the mean (``values``, ``mean``).
``FT_SLOW_EXIT`` (seconds): the process takes that much longer to end once its program ended (an exit handler that
runs after the library's, as a GPU runtime's teardown may; a rank started as a process of its own, not forked).
``FT_CHECKPOINTS``: a folder where the
members save a checkpoint (``FaultTolerance.save``) after each step in ``FT_SAVE_AT`` (comma-separated; the fault
point ``save``: its part written, before the commit), and from which the first members restart when it holds one
(``FaultTolerance.restore``, printing ``restored``). A fault fires once per rank and
place (a file in ``FT_MARKS`` remembers it): a rank started again as the same rank goes on; one with ``"every": true``
fires at every attempt of its step.
Printed: ``start``, one ``step`` per committed step (world, this rank's sample indices; at DiLoCo's exchange
steps the round start after it), ``state_loaded`` (a joiner weighed out of its first step loaded the state),
``entered`` (each epoch that admitted a joiner: digests of the parameters and of the stepping optimizers' state as
the epoch begins, and its state holder), ``retry``
per abandoned attempt, and ``end`` (a digest of the parameters and of the algorithm's replicated
state, that state's values, the recoveries, a joiner's seconds from asking to be admitted to being ready, and
asynchronous averaging's rounds completed in the last epoch).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from harness.links import cut_own_link
from ring_copies import ring_digests
from stack_dumps import dump_on_request

import bagua_torch
from bagua_common.fault_tolerance import DataPosition, Membership
from bagua_common.job.checkpoint import latest
from bagua_torch import checkpoint, state_transfer
from bagua_torch.algorithms import get_algorithm
from bagua_torch.algorithms.diloco import DiLoCoImpl
from bagua_torch.algorithms.onebit_adam import OneBitAdamAlgorithm
from bagua_torch.algorithms.qadam import QAdamAlgorithm
from bagua_torch.fault_tolerance import FaultTolerance
from bagua_torch.torch_api import allreduce_inplace

SAMPLES, FEATURES = 96, 6
LEARNING_RATE, MOMENTUM = 0.05, 0.9  # the SGD the ranks train with (but under QAdam and 1-bit Adam)


def regression_net() -> torch.nn.Module:
    """The ranks' model, with the parameters torch's global generator gives it."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """The job's inputs and targets, indexed by the samplers' indices."""
    x = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
    return x, x.sum(dim=1, keepdim=True).sin()


_REPORTING = threading.Lock()  # reports come from the exchange's thread too: one line at a time


def report(**fields) -> None:
    with _REPORTING:
        print(json.dumps({"pid": os.getpid(), "t": round(time.time(), 3), **fields}), flush=True)


def fault(faults: list[dict], rank: int | None, step: int, where: str, epoch=None) -> None:
    for f in faults:
        if f["rank"] == rank and f["step"] == step and f["where"] == where:
            fired = Path(os.environ["FT_MARKS"]) / f"{rank}-{step}-{where}"
            if fired.exists() and not f.get("every"):
                continue
            fired.touch()
            kind = f["kind"]
            report(event="fault", kind=kind, where=where, step=step, time=time.time())
            wait_for_marks(f.get("once", []))
            time.sleep(f.get("after", 0.0))
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "raise":
                raise RuntimeError(f"rank {rank} fails on purpose at step {step} ({where})")
            elif kind == "slow":
                time.sleep(f.get("seconds", 0.3))
            elif kind == "partition":  # this rank's link goes down, for good or a while
                cut_own_link(f.get("seconds"))
            elif kind == "late":  # once this member saw the epoch close (and told the next one what it applied)
                epoch.closed.wait(60)
                time.sleep(0.5)


def wait_for_marks(marks: list[str], timeout: float = 60.0) -> None:
    """Wait until each of ``marks`` is in ``FT_MARKS``: other faults fired (``rank-step-where``), or
    ``joiner-asked``."""
    folder, deadline = Path(os.environ["FT_MARKS"]), time.monotonic() + timeout
    while not all((folder / mark).exists() for mark in marks) and time.monotonic() < deadline:
        time.sleep(0.05)


def digest_of(net: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()


def optimizer_digest(optimizers) -> tuple[str, int]:
    """A digest of ``optimizers``' state (in the unfused per-parameter layout) and how many tensors it holds."""
    tensors = [
        value
        for optimizer in optimizers
        for _, state in sorted(optimizer.state_dict()["state"].items())
        for _, value in sorted(state.items())
        if torch.is_tensor(value)
    ]
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest(), len(tensors)


def main() -> None:
    dump_on_request()
    if "FT_SLOW_EXIT" in os.environ:  # registered before the library's exit handlers: runs after them
        atexit.register(time.sleep, float(os.environ["FT_SLOW_EXIT"]))
    torch.set_num_threads(1)
    joiner = os.environ.get("BAGUA_FT_JOIN") == "1"
    rank = None if joiner else int(os.environ["RANK"])
    faults = json.loads(os.environ.get("FT_FAULTS", "[]"))
    steps, world_wanted = int(os.environ["FT_STEPS"]), int(os.environ["FT_WORLD"])
    step_seconds = float(os.environ.get("FT_STEP_SECONDS", "0"))

    original_change = FaultTolerance._change_epoch

    def change_epoch(self: FaultTolerance, lost_step: bool, alone: int | None = None) -> None:
        fault(faults, rank, self.step + 1, "recovery")
        original_change(self, lost_step, alone)

    FaultTolerance._change_epoch = change_epoch  # the "mid-recovery" fault point
    original_send = state_transfer.send_state

    def send_state(*args) -> None:
        fault(faults, rank, 0, "state")
        original_send(*args)

    state_transfer.send_state = send_state  # a joiner's state over a slow link
    original_tensors = state_transfer.broadcast_tensors

    def broadcast_tensors(group, tensors, root=0) -> None:
        fault(faults, rank, 0, "state_tensors")
        original_tensors(group, tensors, root)

    state_transfer.broadcast_tensors = broadcast_tensors  # the holder lost once connected to the joiner
    original_join = Membership.join

    def join(*args, **kwargs):
        (Path(os.environ["FT_MARKS"]) / "joiner-asked").touch()
        return original_join(*args, **kwargs)

    Membership.join = join  # the mark a fault can wait for
    original_load = state_transfer.IncomingState.load

    def load(self: state_transfer.IncomingState) -> None:
        original_load(self)
        report(event="state_loaded", step=self.position["step"])

    state_transfer.IncomingState.load = load  # a joiner weighed out of its first step has its state now
    original_enter = FaultTolerance._enter

    def enter(self: FaultTolerance, epoch) -> None:
        original_enter(self, epoch)
        if epoch.joined:  # the state every member, and the joiner given it, holds as the epoch begins
            (module,) = self.modules
            optimizer, tensors = optimizer_digest(module.stepping_optimizers)
            params = digest_of(module.module)
            report(
                event="entered",
                epoch=epoch.number,
                holder=epoch.state_holder,
                rank=epoch.rank,
                params=params,
                optimizer=optimizer,
                optimizer_tensors=tensors,
            )

    FaultTolerance._enter = enter
    original_average = DiLoCoImpl._average

    def average(self: DiLoCoImpl, p: int, flat: torch.Tensor) -> torch.Tensor:
        # Streaming DiLoCo's overlapped exchange runs on a thread while the loop's next step may have begun: it is
        # the exchange started after the last step that exchanges fragment p.
        step = next(s for s in range(self.step, 0, -1) if p in self.config.exchanges_after(s))
        fault(faults, rank, step, "exchange")
        momenta = [
            s["momentum_buffer"] for o in self.context.optimizers for s in o.state.values() if "momentum_buffer" in s
        ]
        inner = hashlib.sha256(b"".join(m.numpy().tobytes() for m in momenta)).hexdigest()  # the inner optimizer's
        values = {"values": flat[: self.sizes[p]].tolist()} if os.environ.get("FT_REPORT_PARAMS") == "1" else {}
        report(
            event="exchange",
            step=step,
            pseudo_gradient=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            inner=inner,
            **values,
        )
        mean = original_average(self, p, flat)
        if values:
            report(event="exchanged", step=step, mean=mean.tolist())
        return mean

    DiLoCoImpl._average = average  # the "mid-exchange" fault point
    original_commit, original_commit_step = FaultTolerance.commit, FaultTolerance.commit_step

    def commit(self: FaultTolerance) -> bool:
        fault(faults, rank, self.step + 1, "vote", self.epoch)
        return original_commit(self)

    def commit_step(self: FaultTolerance) -> None:
        if not self._voted_this_attempt:
            fault(faults, rank, self.step + 1, "vote", self.epoch)
        original_commit_step(self)

    # the "collectives done, state changed, vote not cast" fault point, of an exchange and of a step
    FaultTolerance.commit, FaultTolerance.commit_step = commit, commit_step

    original_save = checkpoint.save_committed

    def save_committed(root, model, step, write, *args, **kwargs):
        def writing(directory, rank_of_shard):
            write(directory, rank_of_shard)
            fault(faults, rank, step, "save")

        return original_save(root, model, step, writing, *args, **kwargs)

    checkpoint.save_committed = save_committed  # the "mid-checkpoint" fault point

    fault(faults, rank, 0, "formation")
    group = bagua_torch.init_process_group(fault_tolerance=True)
    job = group.fault_tolerance
    report(event="start", joiner=joiner, rank=rank)
    torch.manual_seed(0)
    net = regression_net()
    name, _, options = os.environ["FT_ALGORITHM"].partition(" ")
    options = json.loads(options or "{}")
    exchange_every = options.get("sync_every", 100) if name == "diloco" else 0
    adam = {"onebit_adam": OneBitAdamAlgorithm, "qadam": QAdamAlgorithm}.get(name)
    if adam:  # an optimizer of its own, whose momentum the algorithm averages after a warm-up
        optimizer = adam.optimizer_class(net.parameters(), lr=0.01, warmup_steps=options.pop("warmup_steps"))
        algorithm = adam(optimizer, **options)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        algorithm = get_algorithm(name, **options)
    step_hook = {"step": 0}
    # registered first: runs before the wrapper's pre-hooks, after the backward's collectives, before the vote
    optimizer.register_step_pre_hook(lambda *_: fault(faults, rank, step_hook["step"], "before_vote"))
    model = bagua_torch.with_bagua(net, [optimizer], algorithm)
    if os.environ.get("FT_FUSED") == "1":  # stepped over the model's buckets, whose layout follows the epochs
        optimizer = bagua_torch.fuse_optimizer(optimizer, module=model)
        # the fused optimizer takes the wrapper's pre-hooks first: its "before_vote" point runs after them
        optimizer.register_step_pre_hook(lambda *_: fault(faults, rank, step_hook["step"], "before_vote"))
    data_x, data_y = samples()
    data = DataPosition(SAMPLES, batch_per_rank=4, seed=3)
    net[0].weight.register_hook(lambda g: fault(faults, rank, step_hook["step"], "backward"))
    checkpoints = os.environ.get("FT_CHECKPOINTS")
    save_at = {int(s) for s in os.environ.get("FT_SAVE_AT", "").split(",") if s}
    if checkpoints and not joiner and latest(checkpoints):
        job.restore(checkpoints, data)
        report(event="restored", step=job.step, digest=digest_of(net), position=data.state())
    loop_allreduce = os.environ.get("FT_LOOP_ALLREDUCE") == "1"
    # The epoch and the first step of it with the wanted world: the same on every member (epochs change between
    # steps), also on one that was away while the others trained (cut off, it comes back into a later epoch).
    settled = None
    for step in job.steps(10**9, data):
        together = job.epoch.size == job.training_place()[1] == world_wanted  # not while a DiLoCo joiner sits out
        if not together:
            settled = None
        elif settled is None or settled[0] != job.epoch.number:
            settled = (job.epoch.number, job.step)
        if settled is not None and job.step >= max(steps, settled[1] + 2):  # 2 steps together: a joiner trains too
            break
        step_hook["step"] = step.number
        with step:
            fault(faults, rank, step.number, "forward")
            if joiner:  # fires in the first joiner's first step only (once per place)
                fault(faults, rank, 0, "joiner_forward")
            time.sleep(step_seconds)
            x, y = data_x[step.indices], data_y[step.indices]
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if loop_allreduce:  # after the commit: a failure in it is the next step's
                summed = torch.ones(1)
                allreduce_inplace(summed)
        if job.step == step.number:
            fields = {"summed": int(summed.item())} if loop_allreduce else {}
            if os.environ.get("FT_REPORT_PARAMS") == "1":
                fields["params"] = [v for p in net.parameters() for v in p.detach().reshape(-1).tolist()]
                state = optimizer.state_dict()["state"]  # per parameter, also the fused optimizer's
                buffers = [state.get(i, {}).get("momentum_buffer") for i in range(len(list(net.parameters())))]
                if not adam and all(b is not None for b in buffers):
                    fields["momentum"] = [v for b in buffers for v in b.reshape(-1).tolist()]
            if exchange_every and step.number % exchange_every == 0:  # DiLoCo's round start after this exchange
                fields["round_start"] = [
                    v for t in model.algorithm_impl.replicated_tensors() for v in t.detach().reshape(-1).tolist()
                ]
            indices = step.indices.tolist()
            report(event="step", step=step.number, world=step.world_size, rank=step.rank, indices=indices, **fields)
            if step.number in save_at:
                folder = job.save(checkpoints)
                report(event="saved", step=step.number, folder=None if folder is None else str(folder))
        else:
            report(event="retry", step=step.number)
        if job.step >= steps and job.epoch.size != world_wanted:
            time.sleep(0.05)  # wait for a joiner, training meanwhile
    digest = digest_of(net)
    replicated = model.algorithm_impl.replicated_tensors()  # DiLoCo's round start: equal where parameters drift
    values = [v for t in replicated for v in t.detach().reshape(-1).tolist()]
    replicated = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in replicated)).hexdigest()
    joined = getattr(job, "joined_after", None)
    copies = {}  # low-precision decentralized: its copies of its neighbours' weights and its own
    if name == "low_precision_decentralized":
        held = {k: getattr(model.algorithm_impl, k) for k in ("weights", "left", "right")}
        copies = ring_digests(held)
    report(
        event="end",
        rank=job.epoch.rank,
        copies=copies,
        step=job.step,
        world=job.epoch.size,
        digest=digest,
        replicated=replicated,
        replicated_values=values,
        recoveries=job.recoveries,
        joined=joined,
        rounds=getattr(model.algorithm_impl, "rounds", None),  # asynchronous averaging's, in the last epoch
    )
    job.close()


if __name__ == "__main__":
    main()

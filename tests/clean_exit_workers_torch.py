"""The jobs of test_clean_exit_torch, run under ``bagua-launch`` without ``--mpi`` (gloo).

Each ends as a training script does: a last collective, then the interpreter exits. The
communicator's job checks at exit that torch.distributed holds none of the tensors the
communicator handed it; the checkpoint job, that torch.distributed's groups are gone.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors in a torch.distributed call's arguments (in lists, and in P2POp's)."""
    import torch
    import torch.distributed as dist

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dist.P2POp):
        yield value.tensor
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        yield from _tensors(list(value.values()))


def _spy_on_handed_tensors(handed: list[weakref.ref]) -> None:
    """Record in ``handed`` a weak reference to every tensor the communicator hands to torch.distributed."""
    import torch.distributed as dist

    from bagua_torch.communicator import process_group_communicator

    def spy(call: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            handed.extend(weakref.ref(t) for t in _tensors([args, kwargs]))
            return call(*args, **kwargs)

        return spied

    for name in ("all_reduce", "reduce", "broadcast", "gather", "scatter", "all_to_all_single", "batch_isend_irecv"):
        setattr(dist, name, spy(getattr(dist, name)))
    for name in ("_all_gather_single", "_reduce_scatter_single"):
        setattr(process_group_communicator, name, spy(getattr(process_group_communicator, name)))


def _check_released_at_exit(handed: list[weakref.ref]) -> None:
    """At exit, after bagua's own exit hooks: fail the process (status 3) if torch still holds a handed tensor."""

    def check() -> None:
        held = sum(ref() is not None for ref in handed)
        if held:
            print(f"torch.distributed still holds {held} of the {len(handed)} tensors it was handed", flush=True)
            os._exit(3)
        print(f"all {len(handed)} tensors handed to torch.distributed were released", flush=True)

    atexit.register(check)  # before bagua_torch is imported: atexit runs its hooks last in, first out


def _check_destroyed_at_exit() -> None:
    """At exit, after bagua's own exit hooks: say whether torch.distributed's groups are gone (then the
    interpreter finalizes: with a group left, a gloo thread may abort it)."""

    def check() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            print("torch.distributed is still initialized when the interpreter finalizes", flush=True)
        else:
            print("torch.distributed was destroyed before the interpreter finalized", flush=True)

    atexit.register(check)  # before bagua_torch is imported: atexit runs its hooks last in, first out


def checkpoint_then_exit(folder: str) -> None:
    """docs/guides/checkpoints.md's DCP example: train, save twice, restore, then let the interpreter exit.

    DCP runs its collectives on torch.distributed's default group itself, not through the
    communicator, so the communicator's exit hook cannot release what gloo holds of them; in
    this job the old code aborted at exit in 4 of 6 runs.
    """
    _check_destroyed_at_exit()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU and long switches, as below

    import torch

    import bagua_torch
    from bagua_torch import distributed_checkpoint

    bagua_torch.init_process_group(timeout=60)
    sys.setswitchinterval(30.0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = bagua_torch.with_bagua(model, [optimizer], "decentralized")
    for step in range(1, 11):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            distributed_checkpoint.save(folder, model, optimizer, step=step)
    assert distributed_checkpoint.restore(folder, model, optimizer) == 10


def every_primitive_then_exit(rounds: int) -> None:
    """Every primitive, sync and async (an allreduce waited while a later barrier is pending too), then
    ``rounds`` allgathers, then return and let the interpreter exit.

    The process runs on one CPU with a long GIL switch interval, which makes the race this guards
    against likely: on one CPU the waiter woken by gloo's worker thread tends to run before that
    thread drops its reference to the collective, and then keeps the GIL until the interpreter
    finalizes; a gloo thread that needs the GIL then aborts the process.
    """
    handed: list[weakref.ref] = []
    _check_released_at_exit(handed)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    import torch

    import bagua_torch

    group = bagua_torch.init_process_group(timeout=60)
    sys.setswitchinterval(30.0)
    comm, rank, size = group.world, group.rank, group.size
    _spy_on_handed_tensors(handed)
    x = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3) + rank
    calls = {
        "allreduce": (x,),
        "reduce": (x, 0),
        "broadcast": (x, 0),
        "reduce_scatter": (x,),
        "allgather": (x,),
        "gather": (x, 0),
        "scatter": (x, 0),
        "alltoall": (x,),
        "alltoall_v": (x.view(-1), [3] * size, [3] * size, 3 * size),
        "send_recv": (x, [(rank + 1) % size]),
        "barrier": (),
    }
    for name, args in calls.items():
        getattr(comm, name)(*args)
        getattr(comm, name + "_async")(*args).wait()
    work = comm.allreduce_async(x)
    barrier = comm.barrier_async()
    work.wait()
    barrier.wait()
    for _ in range(rounds):
        comm.allgather(torch.ones(1))
    group.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["checkpoint"]:
        checkpoint_then_exit(sys.argv[2])
    else:
        every_primitive_then_exit(int(sys.argv[1]) if len(sys.argv) > 1 else 10)

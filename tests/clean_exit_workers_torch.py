"""Ranks of test_clean_exit_torch over gloo: what torch.distributed still holds after ``wait()``, and a real exit.

``held_after_wait`` runs under ``multiprocess.run_ranks``. Run as a script (under ``bagua-launch``
without ``--mpi``), this file is a job that ends as a training script does: a last collective,
then the interpreter exits.
"""

from __future__ import annotations

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


def _spy_on_handed_tensors() -> list[weakref.ref]:
    """Record a weak reference to every tensor the communicator hands to torch.distributed, in the list returned."""
    import torch.distributed as dist

    from bagua_torch.communicator import process_group_communicator

    handed: list[weakref.ref] = []

    def spy(call: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            handed.extend(weakref.ref(t) for t in _tensors([args, kwargs]))
            return call(*args, **kwargs)

        return spied

    for name in ("all_reduce", "reduce", "broadcast", "gather", "scatter", "all_to_all_single", "batch_isend_irecv"):
        setattr(dist, name, spy(getattr(dist, name)))
    for name in ("_all_gather_single", "_reduce_scatter_single"):
        setattr(process_group_communicator, name, spy(getattr(process_group_communicator, name)))
    return handed


def held_after_wait() -> dict[str, tuple[int, int]]:
    """Per primitive (sync, then async): how many tensors torch.distributed was handed, and still held after wait().

    Checked while the caller still holds the result. ``allreduce behind a barrier`` waits for an
    allreduce issued before a barrier that is not waited for yet.
    """
    import torch

    import bagua_torch

    group = bagua_torch.init_process_group(timeout=60)
    comm, rank, size = group.world, group.rank, group.size
    x = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3) + rank
    calls = {
        "allreduce": ("allreduce", (x,)),
        "reduce": ("reduce", (x, 0)),
        "broadcast": ("broadcast", (x, 0)),
        "reduce_scatter": ("reduce_scatter", (x,)),
        "allgather": ("allgather", (x,)),
        "gather": ("gather", (x, 0)),
        "scatter": ("scatter", (x, 0)),
        "alltoall": ("alltoall", (x,)),
        "alltoall_v": ("alltoall_v", (x.view(-1), [3] * size, [3] * size, 3 * size)),
        "send_recv": ("send_recv", (x, [(rank + 1) % size])),
        "barrier": ("barrier", ()),
    }
    handed = _spy_on_handed_tensors()
    held = {}
    for key, (name, args) in calls.items():
        for suffix in ("", "_async"):
            handed.clear()
            result = getattr(comm, name + suffix)(*args)
            if suffix:
                result = result.wait()
            held[key + suffix] = (len(handed), sum(ref() is not None for ref in handed))
            del result
    handed.clear()
    work = comm.allreduce_async(x)
    allreduce_handed = list(handed)
    barrier = comm.barrier_async()
    work.wait()
    held["allreduce behind a barrier"] = (len(allreduce_handed), sum(ref() is not None for ref in allreduce_handed))
    barrier.wait()
    group.close()
    return held


def exit_after_collectives(rounds: int) -> None:
    """``rounds`` allgathers on the world communicator, then return and let the interpreter exit.

    The process runs on one CPU with a long GIL switch interval, which makes the race this guards
    against likely: on one CPU the waiter woken by gloo's worker thread tends to run before that
    thread drops its reference to the collective, and then keeps the GIL until the interpreter
    finalizes; a gloo thread that needs the GIL then aborts the process.
    """
    import torch

    import bagua_torch

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    group = bagua_torch.init_process_group(timeout=60)
    sys.setswitchinterval(30.0)
    for _ in range(rounds):
        group.world.allgather(torch.ones(1))
    group.close()


if __name__ == "__main__":
    exit_after_collectives(int(sys.argv[1]) if len(sys.argv) > 1 else 10)

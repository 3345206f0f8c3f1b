"""What a fault-tolerant torch job trains in-process (:mod:`bagua_torch.fault_tolerance`), and what it refuses, naming
what to do instead: the JAX front end's counterpart is :func:`bagua_jax.state_rules.refuse_unsurvivable`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bagua_torch.algorithms import algorithm_class, available_algorithms

if TYPE_CHECKING:
    from bagua_torch.bagua_module import BaguaModule

__all__ = ["carried_algorithms", "refuse_unsurvivable"]


def carried_algorithms() -> list[str]:
    """The algorithms a fault-tolerant job trains, by name: those declaring ``fault_tolerant`` (their state is carried
    across a change of members by its rule, and tested); the others are refused, naming the elastic restart."""
    return [name for name in available_algorithms() if algorithm_class(name).fault_tolerant]


def refuse_unsurvivable(module: BaguaModule) -> None:
    """Raise ValueError unless a fault-tolerant job can train ``module`` in-process: an algorithm not in
    :func:`carried_algorithms` (the message names the elastic restart), and autotuning (each member wraps its model
    alone, before the job forms, and so does a later joiner: each would tune its buckets its own way)."""
    algorithm = module.algorithm
    if not type(algorithm).fault_tolerant:
        raise ValueError(
            f"fault tolerance: {algorithm.name or type(algorithm).__name__} cannot continue in-process after a change "
            f"of members yet (it can: {', '.join(carried_algorithms())}); train it without fault tolerance and "
            "restart from a checkpoint when a rank is lost (the elastic restart: bagua-launch --nnodes MIN:MAX "
            "--max-restarts N)"
        )
    if module.bucket_tuner is not None:
        raise ValueError(
            "fault tolerance: autotune cannot tune a fault-tolerant job: each member wraps its model alone, before "
            "the job forms, and so does a member that joins later, so each would bucket the gradients its own "
            "way. Tune in a run without fault tolerance, then pass the bucket size it chose "
            "(model.bucket_tuner.current['bucket_bytes']) as bucket_bytes, with autotune off (BAGUA_AUTOTUNE=off)"
        )

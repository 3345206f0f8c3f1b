"""The ranks' means of a step's small values (loss, aux, BatchNorm statistics), sent with the gradients where possible.

Averaging a step's loss, its aux values and the model's BatchNorm statistics over the ranks is
one small collective per step, and on a latency-bound link its round trip is all it costs. So
the trainer hands those values to the algorithm as :class:`StepMeans` (the optax extra argument
``step_means``): an algorithm whose step averages float32 gradient buckets in full precision
over the world in one message (flat gradient allreduce) carries them at the end of its smallest
float32 bucket (:meth:`StepMeans.averaged_with`), and PowerSGD in the float32 allreduce that
starts either of its steps (:meth:`StepMeans.deliver`), so the step sends no extra message.
Every other algorithm ignores the argument (compressed codes must not carry the loss;
decentralized, asynchronous and DiLoCo steps have no full-precision world average every step),
and :meth:`StepMeans.result` then averages all of them in one allreduce of their own. The trainer leaves
the loss and aux of the last three to each rank (:meth:`bagua_jax.DataParallel.step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from bagua_jax.bucketing import BucketPlan
from bagua_jax.communicator import Communicator


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)


class StepMeans:
    """The floating leaves of ``tree`` (other leaves, counts and keys, stay as they are), to be averaged over the
    ranks once in this step, in float32.

    An algorithm may carry them in its own float32 averages with :meth:`averaged_with` (once); the trainer
    reads the averaged tree from :meth:`result` after the algorithm's update, which allreduces them itself
    when no algorithm did. Build it inside the traced step, and let only the step's own trace (not a
    ``lax.cond`` or loop body) carry it.
    """

    def __init__(self, tree: Any):
        self._tree = tree
        floats = [leaf for leaf in jax.tree.leaves(tree) if _is_float(leaf)]
        flat, self._unravel = ravel_pytree(floats)
        self._dtype = flat.dtype
        self.values: jax.Array = flat.astype(jnp.float32)
        """The floating leaves as one float32 vector (empty when there are none)."""
        self._mean: jax.Array | None = None

    def averaged_with(self, plan: BucketPlan, tree: Any, average: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
        """``average(bucket)`` of each of ``plan``'s buckets of ``tree``, :attr:`values` riding at the end of the
        smallest float32 bucket; ``average`` must be the algorithm's full-precision mean over the world, taken
        elementwise in one message. Without a float32 bucket (or values) the values are left for :meth:`result`.
        Once per step.
        """
        candidates = [i for i, bucket in enumerate(plan.buckets) if bucket.dtype == jnp.float32]
        if not self.values.size or not candidates:
            return [average(bucket) for bucket in plan.flatten(tree)]
        carrier = min(candidates, key=lambda i: plan.buckets[i].size)
        size = plan.buckets[carrier].size
        # The room is made while the bucket is built. Copied into a longer buffer afterwards, the finished bucket
        # is padded, and XLA's CPU backend fuses the pad with the bucket's last slice update: a gradient reduced
        # over the batch is then reduced again for every element of the bucket (a 17x slower step for a 1.8M-parameter
        # MLP on 4 ranks).
        buckets = plan.flatten(tree, room={carrier: self.values.size})
        buckets[carrier] = lax.dynamic_update_slice(buckets[carrier], self.values, (size,))
        averaged = [average(bucket) for bucket in buckets]
        self.deliver(averaged[carrier][size:])
        averaged[carrier] = averaged[carrier][:size]
        return averaged

    def deliver(self, mean: jax.Array) -> None:
        """Hand over the ranks' mean of :attr:`values`, for an algorithm that carried them in a full-precision
        message of its own (e.g. out of a ``lax.cond`` whose every branch carries them). Once per step."""
        if self._mean is not None:
            raise RuntimeError("StepMeans: the values were already carried in this step")
        self._mean = mean

    def result(self, communicator: Communicator) -> Any:
        """The tree with each floating leaf replaced by its mean over the ranks: the carried means, or one
        allreduce over ``communicator`` when no algorithm carried them (none when there is nothing to average)."""
        if not self.values.size:
            return self._tree
        mean = self._mean if self._mean is not None else communicator.allreduce(self.values, "avg")
        averaged = iter(self._unravel(mean.astype(self._dtype)))
        return jax.tree.map(lambda leaf: next(averaged) if _is_float(leaf) else leaf, self._tree)

"""Flatten many small tensors into few large buckets, and back.

Communication cost is dominated by per-call latency for small tensors, so the
algorithms communicate buckets: the leaves of a pytree, grouped in tree order
and by dtype by the rule of :mod:`bagua_common.comm.bucket_plan` (shared with the torch
front end). The plan is static: it depends only on shapes and dtypes, so it is
computed once outside ``jit`` and its flatten/unflatten trace to reshapes and
slice updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bagua_common.comm import bucket_plan
from bagua_common.comm.bucket_plan import DEFAULT_BUCKET_BYTES, TensorSlot

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "BucketPlan", "plan_buckets"]


class Bucket(NamedTuple):
    dtype: np.dtype
    leaves: tuple[int, ...]  # indices into the flattened tree, in order
    size: int  # elements including padding


class BucketPlan(NamedTuple):
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    buckets: tuple[Bucket, ...]

    def flatten(self, tree: Any, room: Mapping[int, int] | None = None) -> list[jax.Array]:
        """The tree's leaves as one zero-padded 1-D array per bucket, bucket ``i`` with ``room[i]`` more zeros at its
        end for values the caller then writes there (with ``lax.dynamic_update_slice``, which XLA does in place)."""
        room = room or {}
        leaves = self.treedef.flatten_up_to(tree)
        out = []
        for index, bucket in enumerate(self.buckets):
            extra = room.get(index, 0)
            if len(bucket.leaves) == 1 and not extra and bucket.size == int(np.prod(self.shapes[bucket.leaves[0]])):
                out.append(jnp.ravel(leaves[bucket.leaves[0]]).astype(bucket.dtype))
                continue
            # Written into a zeroed buffer rather than concatenated: XLA's CPU backend copies a
            # concatenate element by element, about 4x slower for a 7 MB bucket, and 10x when
            # the bucket then feeds a custom call such as a native collective.
            flat = jnp.zeros(bucket.size + extra, bucket.dtype)
            offset = 0
            for i in bucket.leaves:
                flat = lax.dynamic_update_slice(flat, jnp.ravel(leaves[i]).astype(bucket.dtype), (offset,))
                offset += int(np.prod(self.shapes[i]))
            out.append(flat)
        return out

    def unflatten(self, buckets: list[jax.Array]) -> Any:
        """The inverse of :meth:`flatten` (padding dropped)."""
        leaves: list[Any] = [None] * len(self.shapes)
        for bucket, flat in zip(self.buckets, buckets):
            offset = 0
            for i in bucket.leaves:
                size = int(np.prod(self.shapes[i]))
                leaves[i] = flat[offset : offset + size].reshape(self.shapes[i]).astype(self.dtypes[i])
                offset += size
        return self.treedef.unflatten(leaves)


def plan_buckets(tree: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, pad_to: int = 1) -> BucketPlan:
    """Group the leaves of ``tree`` (arrays or shape/dtype structs) into buckets.

    Leaves are taken in tree order and grouped by dtype with the rule of
    :mod:`bagua_common.comm.bucket_plan` (at most ``bucket_bytes`` per bucket, each padded to a
    multiple of ``pad_to`` elements).
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(leaf)) for leaf in leaves)
    dtypes = tuple(np.dtype(leaf.dtype) for leaf in leaves)
    slots = [TensorSlot(int(np.prod(shape)), dtype.itemsize, dtype) for shape, dtype in zip(shapes, dtypes)]
    buckets = tuple(
        Bucket(dtypes[planned.members[0]], planned.members, planned.size)
        for planned in bucket_plan.plan_buckets(slots, bucket_bytes, pad_to)
    )
    return BucketPlan(treedef, shapes, dtypes, buckets)

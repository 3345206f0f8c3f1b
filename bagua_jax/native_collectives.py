"""The native collectives as JAX primitives with an ordered effect.

Each collective is one primitive whose lowering is an XLA FFI custom call into
the engine that owns the communicator (MPI for CPU buffers, NCCL for GPU
buffers). The custom calls take and return an XLA token threaded through
``CollectiveEffect``, an ordered effect: XLA keeps them in program order on every
rank and never drops one whose result is unused, so no rank can reorder two
collectives into a deadlock (the pattern mpi4jax uses).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax.extend.core import Primitive


class CollectiveEffect(effects.Effect):
    """Orders native collectives: every rank issues them in program order."""

    __str__ = lambda self: "BaguaCollective"  # noqa: E731


collective_effect = CollectiveEffect()
for _kind in (
    effects.lowerable_effects,
    effects.ordered_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
):
    _kind.add_type(CollectiveEffect)


# Primitive parameters that only shape the result; they are not FFI attributes.
_SHAPE_ONLY = ("size", "out_size", "shape", "dtype")


def _lowering(name: str) -> Callable:
    """The lowering of ``name`` to the FFI target ``bagua_<engine>_<name>`` of the communicator's engine."""

    def rule(ctx: mlir.LoweringRuleContext, *operands, engine: str, **params):
        ffi_rule = jax.ffi.ffi_lowering(f"bagua_{engine}_{name}", has_side_effect=True)
        token = ctx.tokens_in.get(collective_effect)
        with_token = ctx.replace(
            avals_in=[*ctx.avals_in, core.abstract_token],
            avals_out=[*ctx.avals_out, core.abstract_token],
        )
        attrs = {k: np.int64(v) for k, v in params.items() if k not in _SHAPE_ONLY}
        *results, token = ffi_rule(with_token, *operands, token, **attrs)
        ctx.set_tokens_out(mlir.TokenSet({collective_effect: token}))
        return results

    return rule


def _collective(name: str, output: Callable[..., core.ShapedArray] | None) -> Primitive:
    """Define the primitive ``bagua_<name>``: ``output(*input_avals, **params)`` gives its
    result, or it has none when ``output`` is None."""
    primitive = Primitive(f"bagua_{name}")
    primitive.multiple_results = output is None
    primitive.def_impl(partial(dispatch.apply_primitive, primitive))

    def abstract_eval(*avals, **params):
        return ([] if output is None else output(*avals, **params)), {collective_effect}

    primitive.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, _lowering(name))
    return primitive


def _same(x, **_):
    return core.ShapedArray(x.shape, x.dtype)


def _times_ranks(x, *, size, **_):
    return core.ShapedArray((size * x.size,), x.dtype)


def _per_rank(x, *, size, **_):
    return core.ShapedArray((x.size // size,), x.dtype)


def _per_peer(x, peers, **_):
    return core.ShapedArray((peers.size * x.size,), x.dtype)


# Inputs are flat: the communicator reshapes around the calls. `size` is the
# communicator's rank count, a static attribute used for shapes only.
allreduce_p = _collective("allreduce", _same)
reduce_p = _collective("reduce", _same)
broadcast_p = _collective("broadcast", _same)
reduce_scatter_p = _collective("reduce_scatter", _per_rank)
allgather_p = _collective("allgather", _times_ranks)
gather_p = _collective("gather", _times_ranks)
scatter_p = _collective("scatter", _per_rank)
alltoall_p = _collective("alltoall", _same)
alltoall_v_p = _collective("alltoall_v", lambda x, sc, rc, *, out_size, **_: core.ShapedArray((out_size,), x.dtype))
send_recv_p = _collective("send_recv", _per_peer)
send_p = _collective("send", None)
recv_p = _collective("recv", lambda peer, *, shape, dtype, **_: core.ShapedArray(shape, dtype))
barrier_p = _collective("barrier", None)
# The rank is read at run time from the communicator the handle holds now, so a handle rebound after a
# membership change gives a compiled program the new rank.
rank_p = _collective("rank", lambda **_: core.ShapedArray((), np.int32))


def forget_failed_calls() -> None:
    """Drop the ordering tokens left by a computation whose collective failed (a revoked communicator): each later
    ordered call takes the last one's token as input, so an errored token would fail every collective after it.
    Waits for what is still running first."""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failure was already reported by the call that raised it
        pass
    dispatch.runtime_tokens.clear()

"""DiLoCo and Streaming DiLoCo: local steps with the user's optimizer, an outer step every ``sync_every`` steps.

The schedule, the fragments and the options are :mod:`bagua_common.algorithms.diloco`'s; the exchange of
the pseudo-gradients is :mod:`bagua_common.algorithms.outer_exchange`'s, the same bytes as torch's. In
optax terms :func:`diloco` goes *after* the user's (inner) optimizer and needs ``params``: it
computes this rank's parameters after the inner step, ``x = params + updates``, and on the
steps where a fragment is synchronized replaces that fragment by the outer step's result, so it
returns ``x' - params``; on the steps where no fragment is due it passes the inner updates through
without that work (one predicate guards all fragments). Its state holds everything needed to resume
mid-round: the step count, the round-start parameters (in host memory by default), each fragment's
outer optimizer state, each fragment's pseudo-gradient waiting for its exchange to be applied
(Streaming, tau > 0) and the error-feedback residuals.

With ``fragment_sync_delay`` tau the step that starts a fragment's exchange keeps its
pseudo-gradient in the state, and the step tau later applies the average of the ranks'. On a
NativeCommunicator over MPI the average is computed on a thread of its own meanwhile
(:mod:`~bagua_jax.algorithms.background_exchange`, over a split of the world made when the
transform is built, collectively), so its wire time overlaps the tau inner steps; the applying
step only waits for what is left of it. Elsewhere (a mesh, whose collectives are XLA's, or NCCL)
the applying step computes the average itself: the same numbers, the wire time not hidden. The
result depends on the state alone, so a state saved while an exchange was on the wire resumes
bit for bit. With ``round_start_memory="host"`` the step copies the round start to the device
and back every step, outside the synchronizing branch (no host-memory operands inside control
flow); where accelerator memory allows, ``"device"`` saves those copies.

The parameters every rank holds after a sync are ``params + (x' - params)``, which equals the
bit-identical ``x'`` up to one float rounding (as in :mod:`~bagua_jax.algorithms.decentralized`);
the round-start copy, the outer state and the averages are bit-identical on every rank.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from bagua_common.algorithms.diloco import (
    DiLoCoConfig,
    fragment_plan,
)
from bagua_common.algorithms.outer_exchange import OuterExchange
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax import ops
from bagua_jax.algorithms.background_exchange import BackgroundExchange
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_params,
    check_weights_given,
    implements,
    varying_like,
)
from bagua_jax.communicator import innermost
from bagua_jax.native_communicator import NativeCommunicator

EXCHANGE = OuterExchange(ops, lambda x, dtype: x.astype(dtype))
"""The pseudo-gradient averages on JAX arrays."""


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`; ``pending`` and ``residuals`` hold empty arrays where not used."""

    step: jax.Array
    """Inner steps done (int32): the position in every fragment's round."""
    round_start: Any
    """The parameters at the start of the round (a pytree like the parameters)."""
    outer_states: tuple
    """Per fragment, the outer optimizer's state over the fragment's parameters (a list of leaves)."""
    pending: tuple
    """Per fragment, its pseudo-gradient (float32, flat) whose exchange is started but not yet applied (tau > 0)."""
    residuals: tuple
    """Per fragment, the error-feedback residual of its compressed exchange (float32, padded to the ranks)."""
    trained: jax.Array
    """1.0 (float32), or 0.0 while this rank sits out the round in flight (a fault-tolerant job's joiner, given the
    state mid-round): where the ranks that trained are counted, its pseudo-gradient weighs nothing. Back to 1.0 after
    the exchange."""


def default_outer_optimizer(config: DiLoCoConfig) -> optax.GradientTransformation:
    """Nesterov SGD with ``config``'s outer learning rate and momentum
    (:attr:`~bagua_common.algorithms.diloco.DiLoCoConfig.outer_settings`)."""
    learning_rate, momentum = config.outer_settings
    return optax.sgd(learning_rate, momentum=momentum or None, nesterov=momentum > 0)


def _to_memory(tree: Any, memory: str) -> Any:
    """``tree`` placed in host or device memory (inside a jitted function)."""
    space = jax.memory.Space.Host if memory == "host" else jax.memory.Space.Device
    return jax.device_put(tree, space)


def _when(predicate: jax.Array, fn: Any, operands: Any) -> Any:
    """``fn(operands)`` where ``predicate`` holds, else ``operands``: a loop run once or not at all. Unlike a cond's,
    its carry needs no copy where it skips (the carry's buffers are updated in place)."""
    _, operands = lax.while_loop(
        lambda carry: carry[0], lambda carry: (jnp.zeros_like(carry[0]), fn(carry[1])), (predicate, operands)
    )
    return operands


def diloco(
    comms: Communicators, *config: Any, counts_trainers: bool = False, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo as an optax transform to chain *after* the inner optimizer, with ``params``.

    After inner step ``t`` (counted from 1), for each fragment ``p`` due (see
    :class:`bagua_common.algorithms.diloco.DiLoCoConfig`): its pseudo-gradient ``round_start - x`` is averaged
    over ``comms.world`` as ``outer_exchange`` says; ``fragment_sync_delay`` steps later the outer
    optimizer steps on the fragment's round-start parameters with it, and the fragment becomes
    ``alpha * x + (1 - alpha) * round_start``. Per sync, each rank sends ``2 (n-1)/n`` of the
    fragment in the wire format (4 bytes an element for fp32 down to about half a byte for
    uint4), and nothing on the other steps: divide DDP's traffic by ``sync_every`` and by the
    bytes saved per element. Choose it on slow links, where communicating every step dominates. The options are
    :class:`~bagua_common.algorithms.diloco.DiLoCoConfig`'s, given as one or as its fields. With ``counts_trainers``
    (a fault-tolerant job's) each pseudo-gradient is weighed by :attr:`DiLoCoState.trained` (an overlapped exchange's
    by its value when the exchange is applied) and the average divides by the ranks that trained, counted in one more
    (two-element) allreduce per exchange.
    """
    config = as_config(DiLoCoConfig, *config, **options)
    comms = check_communicators(comms, config.name)
    world = comms.world
    outer = config.outer_optimizer if config.outer_optimizer is not None else default_outer_optimizer(config)
    delay, alpha = config.fragment_sync_delay, float(config.fragment_update_alpha)
    outer_exchange, error_feedback = config.outer_exchange, config.error_feedback
    round_start_memory = config.round_start_memory
    if round_start_memory == "host" and isinstance(innermost(world), NativeCommunicator):
        # JAX (0.10) cannot lower a program with ordered effects (the native collectives) that returns arrays in host
        # memory. On CPU the device's memory is host memory, so nothing is lost there.
        if jax.default_backend() != "cpu":
            raise ValueError(
                f"{config.name}: round_start_memory='host' is not available with a NativeCommunicator on "
                f"{jax.default_backend()} (JAX cannot return host-memory arrays from programs with the native "
                "collectives' ordered effects); use round_start_memory='device', or a mesh"
            )
        round_start_memory = "device"

    def layout(params: Any) -> tuple[list[range], list[int]]:
        leaves = jax.tree.leaves(params)
        plan = fragment_plan([int(math.prod(jnp.shape(x))) for x in leaves], config.fragments)
        sizes = [sum(int(math.prod(jnp.shape(leaves[i]))) for i in part) for part in plan]
        return plan, sizes

    def padded(size: int) -> int:
        return -(-size // world.size) * world.size

    def init_fn(params: Any) -> DiLoCoState:
        check_float_params(params)
        plan, sizes = layout(params)
        leaves = jax.tree.leaves(params)
        copy = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        return DiLoCoState(
            step=jnp.zeros([], jnp.int32),
            round_start=_to_memory(copy, round_start_memory),
            outer_states=tuple(outer.init([leaves[i] for i in part]) for part in plan),
            pending=tuple(jnp.zeros([size if delay else 0], jnp.float32) for size in sizes),
            residuals=tuple(jnp.zeros([padded(size) if error_feedback else 0], jnp.float32) for size in sizes),
            trained=jnp.ones([], jnp.float32),
        )

    def pseudo_gradient(anchor: list, local: list) -> jax.Array:
        """One fragment's ``round_start - x`` in float32, flat."""
        return jnp.concatenate([(a.astype(jnp.float32) - x.astype(jnp.float32)).ravel() for a, x in zip(anchor, local)])

    def average(flat: jax.Array, residual: jax.Array, comm: Any) -> tuple[jax.Array, jax.Array]:
        """The ranks' mean of one fragment's pseudo-gradient ``flat`` over ``comm``, and the new residual."""
        size = flat.shape[0]
        padded_flat = jnp.pad(flat, (0, padded(size) - size))
        mean, residual = EXCHANGE.average(padded_flat, comm, outer_exchange, residual if error_feedback else None)
        return mean[:size], (residual if error_feedback else jnp.zeros([0], jnp.float32))

    def weighed_average(
        flat: jax.Array, residual: jax.Array, trained: jax.Array, comm: Any
    ) -> tuple[jax.Array, jax.Array]:
        """:func:`average` over ``comm``; with ``counts_trainers``, this rank's ``flat`` weighed by ``trained`` (1 or
        0) and the mean divided by the ranks that trained instead of all (none trained: zero, the same on every
        rank)."""
        if not counts_trainers:
            return average(flat, residual, comm)
        mean, residual = average(flat * trained, residual, comm)
        trainers, ranks = comm.allreduce(jnp.stack([trained, jnp.ones_like(trained)]))
        return mean * (ranks / jnp.maximum(trainers, 1.0)), residual

    # Streaming on a host engine (under any wrapper, e.g. a CountingCommunicator): the exchanges run on a thread of
    # their own while the next tau steps compute.
    engine = innermost(world)
    overlapped = delay > 0 and isinstance(engine, NativeCommunicator) and engine.on_host
    background = BackgroundExchange(engine, weighed_average, config.name) if overlapped else None

    def outer_step(anchor: list, local: list, outer_state: Any, mean: jax.Array) -> tuple[list, list, Any]:
        """The outer optimizer's step on the fragment's round-start parameters, and the mixed local ones."""
        offsets = [0]
        for a in anchor:
            offsets.append(offsets[-1] + a.size)
        grads = [mean[s:e].reshape(a.shape).astype(a.dtype) for a, s, e in zip(anchor, offsets, offsets[1:])]
        updates, outer_state = outer.update(grads, outer_state, anchor)
        anchor = optax.apply_updates(anchor, updates)
        if alpha == 0.0:
            mixed = list(anchor)
        else:
            mixed = [(alpha * x + (1.0 - alpha) * a).astype(x.dtype) for x, a in zip(local, anchor)]
        return list(anchor), mixed, outer_state

    def due(step: jax.Array, offset: int) -> jax.Array:
        return (step >= 1) & ((step - offset) % config.sync_every == 0)

    def any_fragment_due(step: jax.Array) -> jax.Array:
        """Whether step ``step`` starts or applies any fragment's synchronization."""
        offsets = [config.fragment_offset(p) for p in range(config.fragments)]
        return functools.reduce(operator.or_, [due(step, o) | due(step - delay, o) for o in offsets])

    def synchronize(step: jax.Array, params: Any, trained: jax.Array, operands: tuple) -> tuple:
        """The inner updates and state parts after step ``step``, with the fragments due synchronized.

        Each fragment's work runs in a loop run once or not at all (:func:`_when`), whose carry is what that work
        changes: the fragments not due this step cost nothing, and nothing is copied for them (a cond would copy
        its operands). A synchronized fragment's updates become ``x' - params``; the others stay as they are.
        """
        updates, anchors, outer_states, pending, residuals = operands
        plan, _ = layout(params)
        weights, inner = jax.tree.leaves(params), jax.tree.leaves(updates)
        anchors = jax.tree.leaves(anchors)
        outer_states, pending, residuals = list(outer_states), list(pending), list(residuals)
        for p, part in enumerate(plan):
            offset = config.fragment_offset(p)
            weight = [weights[i] for i in part]

            def local(updates: list) -> list:
                """This rank's parameters after the inner step."""
                return optax.apply_updates(weight, updates)

            def synchronized(mixed: list, updates: list) -> list:
                """The updates that take this rank's parameters to ``mixed``."""
                return [(x - w).astype(u.dtype) for x, w, u in zip(mixed, weight, updates)]

            def sync(operands):
                anchor, updates, outer_state, residual = operands
                mine = local(updates)
                mean, residual = weighed_average(pseudo_gradient(anchor, mine), residual, trained, world)
                anchor, mixed, outer_state = outer_step(anchor, mine, outer_state, mean)
                return varying_like((anchor, synchronized(mixed, updates), outer_state, residual), updates)

            def start(_):
                updates = [inner[i] for i in part]
                flat = pseudo_gradient([anchors[i] for i in part], local(updates))
                if background is not None:
                    background.start(p, step, flat, residuals[p], trained)
                    if world is not engine:  # a wrapper sees the exchange the thread will make, traced not run
                        jax.eval_shape(functools.partial(weighed_average, comm=world), flat, residuals[p], trained)
                return varying_like(flat, updates)

            def apply(operands):
                anchor, updates, outer_state, residual = operands
                if background is not None:
                    mean, residual = background.finish(p, step - delay, pending[p], residual, trained)
                else:
                    mean, residual = weighed_average(pending[p], residual, trained, world)
                anchor, mixed, outer_state = outer_step(anchor, local(updates), outer_state, mean)
                return varying_like((anchor, synchronized(mixed, updates), outer_state, residual), updates)

            # Every rank holds the same step, so all take the same branch: off-round steps do not communicate.
            if delay:
                pending[p] = _when(due(step, offset), start, pending[p])
            fragment = ([anchors[i] for i in part], [inner[i] for i in part], outer_states[p], residuals[p])
            anchor, fragment_updates, outer_states[p], residuals[p] = _when(
                due(step - delay, offset), apply if delay else sync, fragment
            )
            for i, a, u in zip(part, anchor, fragment_updates):
                anchors[i], inner[i] = a, u
        new_updates = jax.tree.unflatten(jax.tree.structure(updates), inner)
        anchors = jax.tree.unflatten(jax.tree.structure(params), anchors)
        return varying_like((new_updates, anchors, tuple(outer_states), tuple(pending), tuple(residuals)), operands)

    def update_fn(updates: Any, state: DiLoCoState, params: Any = None, **extra_args: Any) -> tuple[Any, DiLoCoState]:
        del extra_args
        check_weights_given(params, config.name)
        step = state.step + 1
        anchors = _to_memory(state.round_start, "device")
        operands = (updates, anchors, state.outer_states, state.pending, state.residuals)
        # Off-round steps (most of them) skip the per-fragment work: the inner updates pass through as they are.
        synchronizing = any_fragment_due(step)
        new_updates, anchors, outer_states, pending, residuals = _when(
            synchronizing, functools.partial(synchronize, step, params, state.trained), operands
        )
        round_start = _to_memory(anchors, round_start_memory)
        trained = state.trained  # changes only where a joiner sits a round out (counts_trainers)
        if counts_trainers:
            trained = jnp.where(synchronizing, jnp.ones_like(trained), trained)
        return new_updates, DiLoCoState(step, round_start, outer_states, pending, residuals, trained)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@implements(DiLoCoConfig)
class DiLoCo(ConfiguredAlgorithm):
    """DiLoCo / Streaming DiLoCo (see :mod:`bagua_common.algorithms.diloco`): ``optax.chain(optimizer, diloco(...))``.

    The user's optimizer is the inner one; every ``sync_every`` steps the ranks average their
    pseudo-gradients (``outer_exchange``: fp32, bf16, 8-bit or 4-bit min-max codes) and
    ``outer_optimizer`` (an optax transformation; Nesterov SGD, lr 0.7, momentum 0.9 when None)
    steps on the round-start parameters. ``fragments`` > 1 synchronizes the model in staggered
    parts (Streaming DiLoCo). Choose it on slow links: it sends ``sync_every`` times fewer
    bytes than an allreduce per step (times the codec's saving), at the price of replicas that
    drift apart inside a round. See :func:`diloco`; it buckets nothing, so ``bucket_bytes`` has no effect.
    """

    after_optimizer = fault_tolerant = True
    counts_trainers = False
    """Whether the exchange divides by the ranks that trained the round (:meth:`counting_trainers`)."""

    def transform(self, comms: Communicators) -> optax.GradientTransformationExtraArgs:
        """:func:`diloco` with this configuration."""
        return diloco(comms, self.config, counts_trainers=self.counts_trainers)

    def counting_trainers(self) -> DiLoCo:
        """A copy whose exchange weighs each rank's pseudo-gradient by :attr:`DiLoCoState.trained` and divides by the
        ranks that trained: a fault-tolerant job's, whose joiner contributes zero to the exchanges it sits out (its
        first round under DiLoCo; the step that applies an exchange started before it came, under Streaming DiLoCo)."""
        return self.replace()._variant(counts_trainers=True)


def skip_untrained(opt_state: Any, steps: int) -> Any:
    """``opt_state`` with each :class:`DiLoCoState` in it ``steps`` inner steps on and marked as not trained: a
    fault-tolerant joiner's, which sits out the steps up to the next exchange (or the one it is given the state in)
    and joins it with a zero pseudo-gradient."""

    def skip(node: Any) -> Any:
        if not isinstance(node, DiLoCoState):
            return node
        return node._replace(step=node.step + steps, trained=jnp.zeros_like(node.trained))

    return jax.tree.map(skip, opt_state, is_leaf=lambda node: isinstance(node, DiLoCoState))

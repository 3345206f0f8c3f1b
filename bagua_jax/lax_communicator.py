"""The communicator protocol over JAX's own collectives on a named mesh axis.

:class:`LaxCommunicator` implements :class:`bagua_jax.communicator.Communicator`
with ``jax.lax`` collectives (``psum``, ``pmin``, ``pmax``, ``all_gather``,
``all_to_all``, ``psum_scatter``, ``axis_index``). Its methods must be called
inside ``jax.shard_map`` (jitted or not) over a mesh that has the named axis or
axes; shapes are per rank (per shard), as in the protocol.

``axis_name`` may be one mesh axis or a tuple of mesh axes. A tuple means the
flattened group of all devices along those axes, ranked major to minor in tuple
order (the order ``lax.axis_index``/``lax.all_gather`` use). Hierarchical
algorithms on a 2-D ``("inter", "intra")`` mesh typically hold three
communicators: ``LaxCommunicator("intra")`` (the fast axis, one group per node),
``LaxCommunicator("inter")`` (the slow axis, one group per local rank) and
``LaxCommunicator(("inter", "intra"))`` (everyone).

Costs (per rank, ``n = size``, ``B`` = bytes of ``x``): ``allreduce``/``reduce``/
``broadcast`` one all-reduce of ``B``; ``reduce_scatter`` one reduce-scatter of
``B`` (``min``/``max``: an all-to-all of ``B``); ``allgather``/``gather`` one
all-gather producing ``n * B``; ``scatter`` and ``alltoall`` one all-to-all of
``B``; ``alltoall_v`` an all-to-all of ``n * B`` (every block padded to the whole
input, since XLA needs static shapes); ``send_recv`` an all-gather producing
``n * B``; ``send_recv_scheduled`` one ``ppermute`` of ``B`` per peer; ``barrier`` an all-reduce
of two float32 plus one elementwise select per leaf.

Reductions run in the input dtype, as XLA's collectives do (no float32 accumulation for
bfloat16/float16; the native MPI engine likewise rounds after every pairwise step). ``"avg"`` is
the sum divided by ``size`` in the input dtype and needs a floating dtype. XLA's all-reduce hands
every rank the same bits (in one process, and over gloo's ring across processes; both are tested)
and every rank post-processes them identically, so results that every rank receives are
bit-identical across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bagua_jax.communicator import REDUCE_OPS, ReduceOp, check_schedule

AxisName = str | tuple[str, ...]

_UNSIGNED_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class LaxCommunicator:
    """Collectives among the devices of mesh axis (or axes) ``axis_name``, inside ``shard_map``.

    ``size`` is the number of ranks in the group: the product of the sizes of the named mesh
    axes. It may be left out, in which case it is read with ``jax.lax.axis_size`` when first
    needed, which only works while tracing inside ``shard_map``; give it explicitly to use
    ``comm.size`` outside. When given it is checked against the mesh whenever a collective is
    traced.
    """

    def __init__(self, axis_name: AxisName, size: int | None = None) -> None:
        if isinstance(axis_name, str):
            if not axis_name:
                raise ValueError("LaxCommunicator: axis_name must be a non-empty mesh axis name")
        elif isinstance(axis_name, tuple):
            if not axis_name or not all(isinstance(a, str) and a for a in axis_name):
                raise ValueError(
                    "LaxCommunicator: axis_name must be a mesh axis name or a non-empty tuple of them, "
                    f"got {axis_name!r}"
                )
            if len(set(axis_name)) != len(axis_name):
                raise ValueError(f"LaxCommunicator: axis_name {axis_name!r} repeats an axis")
        else:
            raise TypeError(
                f"LaxCommunicator: axis_name must be a str or a tuple of str, got {type(axis_name).__name__}"
            )
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"LaxCommunicator: size must be a positive int, got {size!r}")
            size = int(size)
        self._axis_name: AxisName = axis_name
        self._size: int | None = size

    # ------------------------------------------------------------------ basics

    @property
    def axis_name(self) -> AxisName:
        """The mesh axis name (or tuple of names) this communicator reduces over."""
        return self._axis_name

    @property
    def size(self) -> int:
        """The number of ranks, a Python int (see the class docstring for when it can be derived)."""
        if self._size is not None:
            return self._size
        try:
            return int(lax.axis_size(self._axis_name))
        except NameError as e:  # raised by JAX for an unbound axis name
            raise ValueError(
                f"LaxCommunicator({self._axis_name!r}): size was not given and the axis is not bound here; "
                "call inside jax.shard_map over a mesh with this axis, or pass size="
            ) from e

    def __repr__(self) -> str:
        return f"LaxCommunicator(axis_name={self._axis_name!r}, size={self._size!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaxCommunicator) and self._axis_name == other._axis_name and self._size == other._size

    def __hash__(self) -> int:
        return hash((LaxCommunicator, self._axis_name, self._size))

    def _checked_size(self, method: str) -> int:
        """``size``, checked against the bound mesh axes while tracing."""
        try:
            bound = int(lax.axis_size(self._axis_name))
        except NameError as e:
            raise ValueError(
                f"LaxCommunicator.{method}: mesh axis {self._axis_name!r} is not bound; "
                "call it inside jax.shard_map over a mesh with this axis"
            ) from e
        if self._size is not None and bound != self._size:
            raise ValueError(
                f"LaxCommunicator.{method}: size={self._size} but mesh axis {self._axis_name!r} has {bound} devices"
            )
        return bound

    def rank(self) -> jax.Array:
        """This rank's index in the group as an int32 scalar (``lax.axis_index``; see the protocol)."""
        self._checked_size("rank")
        return lax.axis_index(self._axis_name).astype(jnp.int32)

    # -------------------------------------------------------------- reductions

    def allreduce(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks with ``op`` ("sum", "avg", "min", "max"); every rank gets the
        bit-identical result. One ``psum``/``pmin``/``pmax``; "avg" is the ``psum`` divided by
        ``size``. See :meth:`Communicator.allreduce`."""
        x = jnp.asarray(x)
        _check_op("allreduce", op, x.dtype)
        n = self._checked_size("allreduce")
        return self._allreduce(x, op, n)

    def _allreduce(self, x: jax.Array, op: ReduceOp, n: int) -> jax.Array:
        if op == "min":
            return lax.pmin(x, self._axis_name)
        if op == "max":
            return lax.pmax(x, self._axis_name)
        total = lax.psum(x, self._axis_name)
        return _divide(total, n) if op == "avg" else total

    def reduce(self, x: jax.Array, root: int, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks onto the static rank ``root``; other ranks get zeros of the
        same shape and dtype. Costs one all-reduce (the result is masked off-root). See
        :meth:`Communicator.reduce`."""
        x = jnp.asarray(x)
        _check_op("reduce", op, x.dtype)
        n = self._checked_size("reduce")
        _check_root("reduce", root, n)
        reduced = self._allreduce(x, op, n)
        return jnp.where(self._index() == root, reduced, jnp.zeros_like(reduced))

    def broadcast(self, x: jax.Array, root: int) -> jax.Array:
        """Every rank gets the static rank ``root``'s ``x``, bit for bit (NaN payloads and -0.0
        included): the bits of ``x`` travel as unsigned integers in one ``psum`` where every other
        rank contributes zeros. See :meth:`Communicator.broadcast`."""
        x = jnp.asarray(x)
        n = self._checked_size("broadcast")
        _check_root("broadcast", root, n)
        is_root = self._index() == root
        encoded = _as_summable_bits(x)
        if encoded is None:  # e.g. complex: gather everything and pick the root's row
            return lax.all_gather(x, self._axis_name)[root]
        bits, decode = encoded
        return decode(lax.psum(jnp.where(is_root, bits, jnp.zeros_like(bits)), self._axis_name))

    def reduce_scatter(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """``x`` is ``[size, *s]`` (one block per rank on the leading axis, as for
        :class:`bagua_jax.NativeCommunicator`); rank r gets row r reduced over ranks, of shape
        ``s``. A flat bucket padded to a multiple of ``size`` goes in as ``x.reshape(size, -1)``.
        "sum"/"avg" use one ``psum_scatter``; "min"/"max" an ``all_to_all`` and a local reduction.
        See :meth:`Communicator.reduce_scatter`."""
        x = jnp.asarray(x)
        _check_op("reduce_scatter", op, x.dtype)
        n = self._checked_size("reduce_scatter")
        _check_leading_equal("reduce_scatter", x, n)
        if op in ("sum", "avg"):
            total = lax.psum_scatter(x, self._axis_name, scatter_dimension=0, tiled=True)[0]
            return _divide(total, n) if op == "avg" else total
        received = lax.all_to_all(x, self._axis_name, 0, 0, tiled=True)  # row j: rank j's row r
        return jnp.min(received, axis=0) if op == "min" else jnp.max(received, axis=0)

    # ------------------------------------------------------------ data motion

    def allgather(self, x: jax.Array) -> jax.Array:
        """Every rank gets ``[size, *x.shape]`` where row j is rank j's ``x`` (one
        ``all_gather``). See :meth:`Communicator.allgather`."""
        x = jnp.asarray(x)
        self._checked_size("allgather")
        return lax.all_gather(x, self._axis_name)

    def gather(self, x: jax.Array, root: int) -> jax.Array:
        """The static rank ``root`` gets ``[size, *x.shape]`` (row j from rank j); other ranks get
        zeros. Costs a full ``all_gather`` (XLA has no rooted gather). See
        :meth:`Communicator.gather`."""
        x = jnp.asarray(x)
        n = self._checked_size("gather")
        _check_root("gather", root, n)
        gathered = lax.all_gather(x, self._axis_name)
        return jnp.where(self._index() == root, gathered, jnp.zeros_like(gathered))

    def scatter(self, x: jax.Array, root: int) -> jax.Array:
        """``x`` is ``[size, *s]``, read on the static rank ``root`` (other ranks' ``x`` is
        ignored but must have the same shape); rank r gets ``root``'s row r, bit for bit. One
        ``all_to_all`` of ``x`` from which each rank keeps the row that came from ``root``. See
        :meth:`Communicator.scatter`."""
        x = jnp.asarray(x)
        n = self._checked_size("scatter")
        _check_root("scatter", root, n)
        _check_leading_equal("scatter", x, n)
        return lax.all_to_all(x, self._axis_name, 0, 0, tiled=True)[root]

    def alltoall(self, x: jax.Array) -> jax.Array:
        """``x`` is ``[size, *s]``; row j goes to rank j, and row j of the result came from rank
        j (one ``all_to_all``). See :meth:`Communicator.alltoall`."""
        x = jnp.asarray(x)
        n = self._checked_size("alltoall")
        _check_leading_equal("alltoall", x, n)
        return lax.all_to_all(x, self._axis_name, 0, 0, tiled=True)

    def alltoall_v(self, x: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, out_size: int) -> jax.Array:
        """Variable all-to-all on 1-D ``x`` with counts known only at run time (semantics of
        :meth:`Communicator.alltoall_v`). XLA needs static shapes, so every one of the ``size``
        blocks sent is padded to the whole length of ``x``: the cost is an ``all_to_all`` of
        ``size * len(x)`` elements per rank plus two gathers, i.e. ``size`` times the bytes of a
        dense all-to-all. Block j holds ``x[off_j : off_j + send_counts[j]]`` (``off`` the
        exclusive cumulative sum of ``send_counts``) and zeros after; the received blocks are packed
        with the exclusive cumulative sum of ``recv_counts``. Elements past the sum of
        ``recv_counts`` are zeros; counts beyond ``x`` or ``out_size`` are truncated."""
        x = jnp.asarray(x)
        n = self._checked_size("alltoall_v")
        if x.ndim != 1:
            raise ValueError(f"LaxCommunicator.alltoall_v: x must be 1-D, got shape {x.shape}")
        send_counts = _check_counts("send_counts", send_counts, n)
        recv_counts = _check_counts("recv_counts", recv_counts, n)
        if isinstance(out_size, bool) or not isinstance(out_size, (int, np.integer)) or out_size < 0:
            raise ValueError(f"LaxCommunicator.alltoall_v: out_size must be a non-negative int, got {out_size!r}")
        out_size = int(out_size)
        m = x.shape[0]
        if m == 0 or out_size == 0:
            # Shapes are static and the same on every rank, so every rank takes this branch.
            return jnp.zeros((out_size,), x.dtype)
        idx = _index_dtype(n * max(m, out_size))
        sc, rc = send_counts.astype(idx), recv_counts.astype(idx)
        # Pack: block j = x[soff[j] : soff[j] + sc[j]], zero-padded to m elements.
        soff = jnp.cumsum(sc) - sc
        pos = jnp.arange(m, dtype=idx)
        src = soff[:, None] + pos[None, :]
        valid = (pos[None, :] < sc[:, None]) & (src < m)
        blocks = jnp.where(valid, x[jnp.clip(src, 0, m - 1)], jnp.zeros((), x.dtype))
        received = lax.all_to_all(blocks, self._axis_name, 0, 0, tiled=True).reshape(-1)
        # Unpack: output element k comes from the rank j whose receive range holds k.
        rend = jnp.cumsum(rc)
        k = jnp.arange(out_size, dtype=idx)
        j = jnp.searchsorted(rend, k, side="right").astype(idx)
        jc = jnp.clip(j, 0, n - 1)
        within = k - (rend[jc] - rc[jc])
        ok = (j < n) & (within < rc[jc]) & (within < m)
        flat = jc * m + jnp.clip(within, 0, m - 1)
        return jnp.where(ok, received[flat], jnp.zeros((), x.dtype))

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        """Exchange ``x`` with the run-time int32 ``peers``; returns ``[len(peers), *x.shape]``
        with row i from rank ``peers[i]`` (semantics of :meth:`Communicator.send_recv`). XLA's
        point-to-point ``ppermute`` needs the pattern when tracing, so this gathers every rank's
        ``x`` (one ``all_gather``, ``size`` times the bytes of ``x``) and indexes it; when the
        pairing is static, ``lax.ppermute`` is the cheap alternative. An out-of-range peer gives a
        row of zeros."""
        x = jnp.asarray(x)
        n = self._checked_size("send_recv")
        peers = jnp.asarray(peers)
        if peers.ndim != 1 or not jnp.issubdtype(peers.dtype, jnp.integer):
            raise TypeError(
                f"LaxCommunicator.send_recv: peers must be a 1-D integer array, got {peers.dtype}{list(peers.shape)}"
            )
        gathered = lax.all_gather(x, self._axis_name)
        valid = (peers >= 0) & (peers < n)
        rows = gathered[jnp.clip(peers, 0, n - 1).astype(jnp.int32)]
        mask = valid.reshape(valid.shape + (1,) * x.ndim)
        return jnp.where(mask, rows, jnp.zeros((), x.dtype))

    def send_recv_scheduled(self, x: jax.Array, schedule: np.ndarray, round_index: jax.Array) -> jax.Array:
        """``send_recv`` with peers from the static table ``schedule[round_index % rounds]``: one
        ``lax.ppermute`` per peer column, the round picked with ``lax.switch`` (every rank takes
        the same branch). See :meth:`Communicator.send_recv_scheduled`."""
        x = jnp.asarray(x)
        table = check_schedule(schedule, self._checked_size("send_recv_scheduled"))

        def round_branch(round_peers: np.ndarray) -> Callable[[jax.Array], jax.Array]:
            # Column j: rank r receives from round_peers[r, j], so that rank sends to r.
            perms = [[(int(src), dst) for dst, src in enumerate(column)] for column in round_peers.T]
            return lambda v: jnp.stack([lax.ppermute(v, self._axis_name, perm) for perm in perms])

        rounds = table.shape[0]
        if rounds == 1:
            return round_branch(table[0])(x)
        which = jnp.asarray(round_index, jnp.int32) % rounds
        return lax.switch(which, [round_branch(t) for t in table], x)

    def barrier(self, x: jax.Array) -> jax.Array:
        """Return ``x`` (an array or a pytree of arrays) unchanged, bit for bit, once every rank has
        reached this point: one tiny ``psum`` (two float32) whose input depends on ``x`` and whose
        result every leaf of the returned ``x`` depends on, so XLA neither drops the all-reduce nor
        moves it before ``x`` is computed or after ``x`` is used. Costs that all-reduce plus one
        elementwise select per leaf (usually fused). See :meth:`Communicator.barrier`."""
        n = self._checked_size("barrier")
        leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(x)]
        index = lax.axis_index(self._axis_name).astype(jnp.float32)
        # Element 1 ties the all-reduce to x's computation (its value is irrelevant); element 0 sums
        # the rank indices, which XLA cannot prove replicated or constant, so it keeps the
        # all-reduce and the selects below that read it.
        sample = next((jnp.real(leaf.ravel()[0]).astype(jnp.float32) for leaf in leaves if leaf.size), jnp.float32(0))
        arrived = lax.psum(jnp.stack([index, sample]), self._axis_name)[0]
        everyone = arrived == jnp.float32(n * (n - 1) // 2)
        return jax.tree.map(lambda leaf: jnp.where(everyone, leaf, jnp.zeros_like(leaf)), x)

    def _index(self) -> jax.Array:
        return lax.axis_index(self._axis_name)


# ---------------------------------------------------------------- helpers


def _check_op(method: str, op: Any, dtype: Any) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"LaxCommunicator.{method}: unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"LaxCommunicator.{method}: op 'avg' needs a floating dtype, got {jnp.dtype(dtype).name}")


def _check_root(method: str, root: Any, n: int) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"LaxCommunicator.{method}: root must be a Python int known when tracing, got {root!r}")
    if not 0 <= root < n:
        raise ValueError(f"LaxCommunicator.{method}: root {root} is out of range for {n} ranks")


def _check_leading_equal(method: str, x: jax.Array, n: int) -> None:
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(f"LaxCommunicator.{method}: x must be [size, ...] with size={n} rows, got shape {x.shape}")


def _check_counts(name: str, counts: Any, n: int) -> jax.Array:
    counts = jnp.asarray(counts)
    if counts.shape != (n,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(
            f"LaxCommunicator.alltoall_v: {name} must be an integer array of {n} entries, "
            f"got {counts.dtype}{list(counts.shape)}"
        )
    return counts


def _index_dtype(extent: int) -> Any:
    if extent < 2**31:
        return jnp.int32
    if not jax.config.jax_enable_x64:
        raise ValueError(
            f"LaxCommunicator.alltoall_v: {extent} padded elements need 64-bit indices; enable jax_enable_x64"
        )
    return jnp.int64


def _divide(total: jax.Array, n: int) -> jax.Array:
    return total / jnp.asarray(n, total.dtype)


def _as_summable_bits(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]] | None:
    """``x`` as an integer array whose sum with zeros restores ``x`` exactly, and the decoder."""
    dtype = x.dtype
    if dtype == jnp.bool_:
        return x.astype(jnp.uint8), lambda y: y.astype(jnp.bool_)
    if jnp.issubdtype(dtype, jnp.integer):
        return x, lambda y: y
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _UNSIGNED_OF_WIDTH:
        unsigned = _UNSIGNED_OF_WIDTH[dtype.itemsize]
        return lax.bitcast_convert_type(x, unsigned), lambda y: lax.bitcast_convert_type(y, dtype)
    return None

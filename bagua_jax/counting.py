"""Count the bytes an algorithm puts on the wire, per rank, while it is traced.

:class:`CountingCommunicator` wraps any :class:`~bagua_jax.communicator.Communicator`
and, on every call, adds the bytes this rank sends under the standard ring/direct
cost model to a running total and a per-operation breakdown, then delegates. Shapes
are static, so the count is taken when the call is traced: trace one step (for
example with ``jax.eval_shape`` or ``jax.jit(...).lower``) to measure it, and note
that a cached ``jit`` that is not retraced adds nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bagua_jax.communicator import Communicator, ReduceOp


def _nbytes(x: Any) -> int:
    x = jnp.asarray(x)
    return int(x.size) * x.dtype.itemsize


class CountingCommunicator:
    """A communicator that records, at trace time, the bytes this rank sends, and delegates every call to ``inner``.

    With ``n = size`` and ``B`` the bytes of the input: ``allreduce`` ``2(n-1)/n B`` (ring); ``reduce_scatter``
    ``(n-1)/n B``; ``allgather`` ``(n-1) B`` (the ``(n-1)/n`` of the gathered ``n B`` that others contribute);
    ``alltoall`` ``(n-1)/n B`` (every row but its own); ``broadcast`` ``B`` and ``reduce`` ``B`` (the bytes through
    the root's link in a pipelined ring or tree, counted on every rank since this rank's index is not static);
    ``gather`` and ``scatter`` ``(n-1)/n`` of the full ``[n, ...]`` buffer (``(n-1) B`` for gather, ``(n-1)/n B``
    for scatter, whose input is the full buffer), as their transposes allgather and reduce-scatter; ``send_recv``
    ``B`` per peer; ``alltoall_v`` ``B``, an upper bound since its counts are only known at run time; ``barrier``
    zero. These are the bytes of the cost model, independent of how ``inner`` implements a call (a
    :class:`~bagua_jax.LaxCommunicator` pads ``alltoall_v`` and gathers for ``send_recv``, for instance).
    ``bytes_sent`` is the total, ``bytes_by_op`` and ``calls_by_op`` the breakdown, ``reset()`` starts over.
    """

    def __init__(self, inner: Communicator) -> None:
        self._inner = inner
        self._bytes: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    @property
    def inner(self) -> Communicator:
        """The wrapped communicator."""
        return self._inner

    @property
    def size(self) -> int:
        """The wrapped communicator's number of ranks."""
        return self._inner.size

    @property
    def bytes_sent(self) -> float:
        """Total bytes this rank sends over all calls recorded since construction or the last :meth:`reset`."""
        return float(sum(self._bytes.values()))

    @property
    def bytes_by_op(self) -> dict[str, float]:
        """Bytes sent per operation name (a copy), for the calls recorded since the last :meth:`reset`."""
        return dict(self._bytes)

    @property
    def calls_by_op(self) -> dict[str, int]:
        """Number of recorded calls per operation name (a copy), since the last :meth:`reset`."""
        return dict(self._calls)

    def reset(self) -> None:
        """Forget every recorded call, so the next traced step is counted from zero."""
        self._bytes.clear()
        self._calls.clear()

    def _record(self, op: str, nbytes: float) -> None:
        self._bytes[op] = self._bytes.get(op, 0.0) + float(nbytes)
        self._calls[op] = self._calls.get(op, 0) + 1

    def rank(self) -> jax.Array:
        """This rank's index, from the wrapped communicator (no bytes)."""
        return self._inner.rank()

    def allreduce(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """Ring allreduce: records ``2 (n-1)/n`` of ``x``'s bytes, then delegates."""
        n = self.size
        self._record("allreduce", 2 * (n - 1) / n * _nbytes(x))
        return self._inner.allreduce(x, op)

    def reduce(self, x: jax.Array, root: int, op: ReduceOp = "sum") -> jax.Array:
        """Rooted reduce, the transpose of a broadcast: records ``x``'s bytes, then delegates."""
        self._record("reduce", _nbytes(x))
        return self._inner.reduce(x, root, op)

    def broadcast(self, x: jax.Array, root: int) -> jax.Array:
        """Broadcast: records ``x``'s bytes (what the root sends), then delegates."""
        self._record("broadcast", _nbytes(x))
        return self._inner.broadcast(x, root)

    def reduce_scatter(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """Ring reduce-scatter: records ``(n-1)/n`` of ``x``'s bytes (the whole ``[n, ...]`` input), then delegates."""
        n = self.size
        self._record("reduce_scatter", (n - 1) / n * _nbytes(x))
        return self._inner.reduce_scatter(x, op)

    def allgather(self, x: jax.Array) -> jax.Array:
        """Ring allgather: records ``(n-1)`` times ``x``'s bytes (forwarding each other rank's block); delegates."""
        self._record("allgather", (self.size - 1) * _nbytes(x))
        return self._inner.allgather(x)

    def gather(self, x: jax.Array, root: int) -> jax.Array:
        """Rooted gather: records ``(n-1)/n`` of the gathered ``n``-row buffer, i.e. ``(n-1)`` times ``x``'s bytes."""
        self._record("gather", (self.size - 1) * _nbytes(x))
        return self._inner.gather(x, root)

    def scatter(self, x: jax.Array, root: int) -> jax.Array:
        """Rooted scatter: records ``(n-1)/n`` of the full ``[n, ...]`` input's bytes, then delegates."""
        n = self.size
        self._record("scatter", (n - 1) / n * _nbytes(x))
        return self._inner.scatter(x, root)

    def alltoall(self, x: jax.Array) -> jax.Array:
        """Direct all-to-all: records ``(n-1)/n`` of ``x``'s bytes (every row but this rank's own), then delegates."""
        n = self.size
        self._record("alltoall", (n - 1) / n * _nbytes(x))
        return self._inner.alltoall(x)

    def alltoall_v(self, x: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, out_size: int) -> jax.Array:
        """Variable all-to-all: records ``x``'s static bytes (an upper bound; counts are run-time), then delegates."""
        self._record("alltoall_v", _nbytes(x))
        return self._inner.alltoall_v(x, send_counts, recv_counts, out_size)

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        """Point-to-point exchange: records ``x``'s bytes once per entry of ``peers``, then delegates."""
        self._record("send_recv", int(jnp.shape(peers)[0]) * _nbytes(x))
        return self._inner.send_recv(x, peers)

    def send_recv_scheduled(self, x: jax.Array, schedule: np.ndarray, round_index: jax.Array) -> jax.Array:
        """Scheduled point-to-point exchange: records ``x``'s bytes once per peer column, then delegates."""
        self._record("send_recv", int(np.shape(schedule)[2]) * _nbytes(x))
        return self._inner.send_recv_scheduled(x, schedule, round_index)

    def barrier(self, x: jax.Array) -> jax.Array:
        """Barrier: records the call with zero bytes (it carries no payload), then delegates."""
        self._record("barrier", 0)
        return self._inner.barrier(x)

    def __repr__(self) -> str:
        return f"CountingCommunicator({self._inner!r}, bytes_sent={self.bytes_sent:.0f})"

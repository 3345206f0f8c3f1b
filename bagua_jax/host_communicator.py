"""A host engine's (MPI, TCP) collectives on host buffers, callable from any thread, outside ``jax.jit``.

A :class:`~bagua_jax.NativeCommunicator`'s methods bind primitives with JAX's ordered effect, so
JAX threads one token through every computation that uses them: a collective issued from a
background thread would wait for the training step in flight, and the step for it. The engine's
DLPack bindings take NumPy buffers instead, release the GIL and wait on the engine alone, which is what a
thread that communicates while the training loop runs needs. Results come back as JAX arrays
(host memory; placed, which compiles nothing), so the front end's kernels and casts apply to them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from bagua_common.comm.collectives import ReduceOp
from bagua_jax.communicator import innermost
from bagua_jax.native_communicator import NativeCommunicator


def _host(x: jax.typing.ArrayLike) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))


def _bytes(x: np.ndarray) -> np.ndarray:
    """``x``'s bytes, flat: what the data-moving collectives send (DLPack has no bfloat16 for NumPy)."""
    return x.reshape(-1).view(np.uint8)


class HostCommunicator:
    """``comm``'s host engine on host buffers, for a background thread: the collectives an outer exchange needs, and
    the broadcast a fault-tolerant job's state travels by.

    The engines need one communicator's collectives in the same order on every rank, and a thread's calls
    interleave with the training loop's differently on each rank: give it a communicator nothing
    else uses meanwhile (e.g. a split of the world made for the thread), or call it while the loop
    makes no collective on ``comm`` (a fault-tolerant job's state transfer runs during a DiLoCo
    round's inner steps, and the loop waits for it before the exchange). ``comm``'s timeout bounds
    every wait, so a dead peer raises an error naming the communicator instead of hanging.
    """

    def __init__(self, comm: NativeCommunicator) -> None:
        comm = innermost(comm)  # a wrapper's (e.g. a CountingCommunicator's) engine: host calls are not traced
        if not isinstance(comm, NativeCommunicator) or not comm.on_host:
            raise ValueError(f"a host communicator needs a host engine's NativeCommunicator (MPI, TCP), got {comm!r}")
        self._engine, self._handle = comm.engine, comm.handle
        self.size = comm.size

    def allreduce(self, x: jax.typing.ArrayLike, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks (``op``: sum, avg, min or max); every rank gets the result."""
        send = _host(x)
        recv = np.empty_like(send)
        self._engine.allreduce(self._handle, send.reshape(-1), recv.reshape(-1), ReduceOp(op).code)
        return jax.device_put(recv)

    def alltoall(self, x: jax.typing.ArrayLike) -> jax.Array:
        """``x`` is ``[size, *s]``; row j goes to rank j, row j of the result came from rank j."""
        send = _host(x)
        if send.ndim == 0 or send.shape[0] != self.size:
            raise ValueError(f"alltoall needs x of shape [size={self.size}, ...], got {list(send.shape)}")
        recv = np.empty_like(send)
        self._engine.alltoall(self._handle, _bytes(send), _bytes(recv))
        return jax.device_put(recv)

    def broadcast(self, x: jax.typing.ArrayLike, root: int) -> jax.Array:
        """Rank ``root``'s ``x`` on every rank (the others pass a buffer of its shape and dtype)."""
        buffer = _host(x).copy()
        self._engine.broadcast(self._handle, _bytes(buffer), int(root))
        return jax.device_put(buffer)

    def send_recv(self, x: jax.typing.ArrayLike, peers: Sequence[int]) -> jax.Array:
        """Send ``x`` to each rank of ``peers`` and receive ``[len(peers), *x.shape]``: row j from ``peers[j]``
        (each of them calls it with this rank among its peers, as often)."""
        send = _host(x)
        recv = np.empty((len(peers), *send.shape), send.dtype)
        self._engine.send_recv(self._handle, _bytes(send), _bytes(recv), [int(p) for p in peers])
        return jax.device_put(recv)

    def allgather(self, x: jax.typing.ArrayLike) -> jax.Array:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""
        send = _host(x)
        recv = np.empty((self.size, *send.shape), send.dtype)
        self._engine.allgather(self._handle, _bytes(send), _bytes(recv))
        return jax.device_put(recv)

"""The native collectives (MPI, TCP or NCCL) behind the communicator protocol."""

from __future__ import annotations

import base64
import secrets
import weakref
from collections.abc import Sequence
from threading import Event, Thread
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from bagua_common.comm import mpi_rendezvous, tcp_rendezvous
from bagua_common.comm.engines import HOST_ENGINES, MpiSettings, mpi_ring_min_bytes
from bagua_common.comm.key_value_store import KeyValueStore
from bagua_common.comm.timeout import timeout_seconds
from bagua_jax import native_collectives as nc
from bagua_jax.communicator import REDUCE_OPS, ReduceOp, check_schedule
from bagua_jax.engines import engine


class NativeCommunicator(MpiSettings):
    """Collectives through Bagua's native engines, one device per process.

    CPU arrays go through the MPI engine (start the processes with ``mpiexec`` or
    ``bagua-launch --mpi``) or the TCP engine (:meth:`tcp_through_store`), GPU arrays
    through NCCL. Every method lowers to an XLA FFI custom call ordered by an effect
    token, so it may be used inside ``jax.jit`` and keeps program order on every rank. A
    collective that does not complete within ``timeout`` seconds (a dead peer, a rank that
    skipped it) raises an error naming the communicator, the operation and the rank.

    Attributes (read them, do not set them): ``size``, the number of ranks; ``handle``, the
    engine's integer handle of this communicator; ``engine``, the engine module (``_bagua_mpi``,
    ``_bagua_tcp`` or ``_bagua_nccl``) for calls outside ``jit``; ``kind``, ``"mpi"`` or ``"tcp"``
    (host buffers) or ``"nccl"`` (device buffers).

    The handle is a slot: after a membership change :meth:`shrink` and :meth:`grow` (or
    :meth:`rebuild`) put the new communicator in it, so a step compiled before the change
    runs on the new ranks without being compiled again wherever its shapes do not depend on
    ``size`` (:meth:`rank` is read at run time). ``generation`` counts the communicators put
    in the slot since the first.
    """

    def __init__(self, handle: int, engine_kind: str):
        self.engine = engine(engine_kind)
        self.handle = handle
        self.kind = engine_kind
        self.size = self.engine.size(handle)
        self._rank = self.engine.rank(handle)
        self.generation = 0
        self._companions: list[tuple[weakref.ref[NativeCommunicator], str]] = []
        self._closed = False

    @classmethod
    def mpi_world(cls, timeout: float | None = None) -> NativeCommunicator:
        """All ranks of the MPI job (``MPI_COMM_WORLD``), for CPU arrays."""
        return cls(engine("mpi").world("world", timeout_seconds(timeout)), "mpi")

    @classmethod
    def nccl_world(cls, timeout: float | None = None) -> NativeCommunicator:
        """All processes of ``jax.distributed`` over NCCL, for GPU arrays.

        Rank 0 creates the NCCL unique id and shares it through ``jax.distributed``'s
        key-value store; call ``jax.distributed.initialize`` first.
        """
        from jax._src.distributed import global_state

        if global_state.client is None:
            raise RuntimeError("call jax.distributed.initialize() before NativeCommunicator.nccl_world()")
        nccl = engine("nccl")
        timeout = timeout_seconds(timeout)
        rank, size = jax.process_index(), jax.process_count()
        key = "bagua/nccl/world"
        if rank == 0:
            unique_id = nccl.unique_id()
            global_state.client.key_value_set(key, base64.b64encode(unique_id).decode())
        else:
            unique_id = base64.b64decode(global_state.client.blocking_key_value_get(key, int(timeout * 1000)))
        return cls(nccl.create(unique_id, rank, size, "world", timeout), "nccl")

    @classmethod
    def world(cls, timeout: float | None = None) -> NativeCommunicator:
        """The world communicator for this process's device: NCCL on a GPU, MPI on the CPU."""
        if jax.devices()[0].platform == "gpu":
            return cls.nccl_world(timeout)
        return cls.mpi_world(timeout)

    @classmethod
    def mpi_through_store(
        cls, store: KeyValueStore, prefix: str, rank: int, size: int, timeout: float | None = None
    ) -> NativeCommunicator:
        """A world of ``size`` ranks built through ``store`` (under the unused key ``prefix``) instead of
        ``MPI_COMM_WORLD``, for CPU arrays: each rank is its own ``mpiexec -n 1`` job, so a rank killed by a signal
        ends only its own job and the others can :meth:`shrink` to the survivors and go on (see
        :mod:`bagua_common.comm.mpi_rendezvous`). Every rank calls it with its rank and the same ``prefix`` and
        ``size``; MPI must not have started before (it selects MPICH's ofi netmod over TCP, whose ports work), and a
        process that no ``mpiexec`` started is refused with a ``RuntimeError`` naming how to start it.
        """
        mpi_rendezvous.prepare_rank()
        mpi, timeout = engine("mpi"), timeout_seconds(timeout)
        return cls(mpi_rendezvous.assemble(mpi, store, prefix, rank, size, None, 0, "world", timeout), "mpi")

    @classmethod
    def tcp_through_store(
        cls, store: KeyValueStore, prefix: str, rank: int, size: int, host: str, timeout: float | None = None
    ) -> NativeCommunicator:
        """A world of ``size`` ranks over the TCP engine, for CPU arrays, built through ``store`` (under the unused
        key ``prefix``; only the job's processes may write it): each rank listens on ``host``, the address the job
        uses, and connects to every other. No MPI: a rank that dies fails the others' operation in flight at once,
        and they can :meth:`rebuild` the communicator of the survivors (see :mod:`bagua_common.comm.tcp_rendezvous`).
        Every rank calls it with its rank and the same ``prefix`` and ``size``."""
        tcp, timeout = engine("tcp"), timeout_seconds(timeout)
        address = tcp.listen(host)
        return cls(tcp_rendezvous.assemble(tcp, store, prefix, rank, size, address, "world", timeout), "tcp")

    @classmethod
    def tcp_self(cls, host: str, timeout: float | None = None) -> NativeCommunicator:
        """This process alone over the TCP engine, listening on ``host``: a fault-tolerant joiner's communicator
        until :meth:`join` puts the job's in its slot."""
        tcp = engine("tcp")
        handle = tcp.build(secrets.token_hex(16), 0, [tcp.listen(host)], "world", timeout_seconds(timeout))
        return cls(handle, "tcp")

    @property
    def timeout(self) -> float:
        """The seconds this communicator's operations wait at most (the host engines: MPI, TCP)."""
        if not self.on_host:
            raise ValueError(f"timeout: the {self.kind} engine does not say its timeout (MPI and TCP do)")
        return self.engine.timeout(self.handle)

    @property
    def can_rebuild(self) -> bool:
        """Whether :meth:`rebuild` can build the communicator of any members afresh, whatever this slot holds (TCP),
        so that a change of members that failed as a rank died can be made again. MPI shrinks and grows the
        communicator it holds instead, and cannot abandon a pending build."""
        return self.kind == "tcp"

    def rebuild(
        self,
        store: KeyValueStore,
        prefix: str,
        rank: int,
        size: int,
        abandoned: Event | None = None,
        timeout: float | None = None,
    ) -> None:
        """Put a communicator of ``size`` ranks built afresh through ``store`` (under the unused key ``prefix``) in this
        slot, this process being ``rank`` (TCP, :attr:`can_rebuild`): the members of a membership, survivors and
        newcomers alike, each call it with its place in it. Fails at once when ``abandoned`` is set (the members
        changed again meanwhile: a rank died before connecting), and then, as after any failure, it may be called
        again under another prefix. Its operations wait ``timeout`` seconds at most (None: as this one's)."""
        if not self.can_rebuild:
            raise ValueError(f"rebuild: the {self.kind} engine cannot build a communicator afresh (TCP can)")
        tcp = self.engine
        address = tcp.addresses(self.handle)[self._rank]
        seconds = self.timeout if timeout is None else timeout_seconds(timeout)
        self._install(tcp_rendezvous.assemble(tcp, store, prefix, rank, size, address, "world", seconds, abandoned))

    @property
    def on_host(self) -> bool:
        """Whether the engine communicates host buffers (MPI, TCP), which its DLPack bindings take from any thread
        (:class:`~bagua_jax.host_communicator.HostCommunicator`), and whose averages take a divisor at run time."""
        return self.kind in HOST_ENGINES

    def revoke(self, reason: str) -> None:
        """Make the collective in flight on this communicator (blocked in a compiled step, say) and every later one
        fail at once with an error naming ``reason``: call it from another thread when the job's membership
        changed. Local and never waiting; :meth:`shrink` or :meth:`grow` then install the new communicator.
        """
        self.engine.revoke(self.handle, str(reason))

    def shrink(self, members: Sequence[int]) -> None:
        """Keep only the ranks ``members`` (ascending; member i becomes rank i), in place: the survivors of a
        membership change call it with the same list, the others never. MPI builds the survivors' communicator
        from this one (``MPI_Comm_create_group``), NCCL shrinks it (``ncclCommShrink``, NCCL 2.27); either way a
        rank that died meanwhile makes it raise instead of hang.
        """
        members = [int(m) for m in members]
        if members != sorted(set(members)) or not members or not 0 <= members[0] <= members[-1] < self.size:
            raise ValueError(f"shrink: members must be ascending ranks of this {self.size}-rank communicator")
        if self.kind == "mpi":
            shrunk = mpi_rendezvous.shrink(self.engine, self.handle, members, "world")
        elif self.kind == "tcp":  # on connections of its own, no store: rebuild() makes one through the store
            shrunk = self.engine.shrink(self.handle, members, "world")
        else:
            shrunk = self.engine.shrink(self.handle, sorted(set(range(self.size)) - set(members)), "world")
        self._install(shrunk)

    def grow(
        self, store: KeyValueStore, prefix: str, size: int, timeout: float | None = None, abandoned: Event | None = None
    ) -> None:
        """Admit ``size - self.size`` newcomers (MPI, TCP) as the last ranks, which call :meth:`join` with the same
        ``prefix`` and ``size``. Every rank calls it; all give up once any of them sees ``abandoned`` set. Waits
        ``timeout`` seconds at most (None: as this one's operations) for the newcomers."""
        self._admit(store, prefix, self._rank, size, timeout, abandoned, self.size)

    @classmethod
    def mpi_join(
        cls, store: KeyValueStore, prefix: str, rank: int, size: int, timeout: float | None = None
    ) -> NativeCommunicator:
        """This newcomer's place (``rank``) in a communicator of ``size`` ranks whose members call :meth:`grow`."""
        communicator = cls.mpi_self(timeout)
        communicator.join(store, prefix, rank, size)
        return communicator

    @classmethod
    def mpi_self(cls, timeout: float | None = None) -> NativeCommunicator:
        """This process alone, for CPU arrays: a fault-tolerant joiner's communicator until it is admitted, when
        :meth:`join` puts the job's communicator in its slot, so the steps compiled on it meanwhile run in the job.
        MPI must not have started before, as for :meth:`mpi_through_store`."""
        mpi_rendezvous.prepare_rank()
        return cls(engine("mpi").self("world", timeout_seconds(timeout)), "mpi")

    def join(
        self,
        store: KeyValueStore,
        prefix: str,
        rank: int,
        size: int,
        timeout: float | None = None,
        abandoned: Event | None = None,
    ) -> None:
        """Take place ``rank`` in the communicator of ``size`` ranks whose members call :meth:`grow` with ``prefix``,
        in this communicator's slot (one of :meth:`tcp_self` or :meth:`mpi_self`): what :meth:`mpi_join` builds,
        without compiling the steps again wherever their shapes do not depend on ``size``. Waits ``timeout`` seconds
        at most (None: as this one's operations) for the members, and gives up as soon as ``abandoned`` is set."""
        self._admit(store, prefix, rank, size, timeout, abandoned, None)

    def _admit(
        self,
        store: KeyValueStore,
        prefix: str,
        rank: int,
        size: int,
        timeout: float | None,
        abandoned: Event | None,
        members: int | None,
    ) -> None:
        """:meth:`grow` (``members``: the ranks this communicator holds) or :meth:`join` (``members`` None)."""
        if self.can_rebuild:
            self.rebuild(store, prefix, rank, size, abandoned, timeout)
            return
        if self.kind != "mpi":
            raise ValueError("grow, join: only MPI and TCP admit newcomers in place (NCCL: build a new communicator)")
        seconds = self.timeout if timeout is None else timeout_seconds(timeout)
        group, start = (None, rank) if members is None else (self.handle_copy(), members)  # a newcomer: from its own
        self._install(
            mpi_rendezvous.assemble(self.engine, store, prefix, rank, size, group, start, "world", seconds, abandoned)
        )

    def revoke_when(self, event: Event, reason: str) -> None:
        """Revoke (:meth:`revoke`) the communicator this one holds now, and its companions' (:meth:`companion`),
        from a thread, the moment ``event`` is set: the training thread may be blocked in a collective with a member
        that will never arrive. The thread holds handles of its own (:meth:`handle_copy`), so a late wake-up never
        revokes the communicators installed later."""
        owned, engine = [self.handle_copy(), *(c.handle_copy() for c, _ in self._live_companions())], self.engine

        def revoke_when_set() -> None:
            event.wait()
            for own in owned:
                engine.revoke(own, reason)
                engine.destroy(own)

        Thread(target=revoke_when_set, name="bagua-revoke", daemon=True).start()

    def handle_copy(self) -> int:
        """A second handle of the communicator this one holds (destroying either leaves the other)."""
        return self.engine.share(self.handle)

    def pinned(self) -> NativeCommunicator:
        """A communicator on the one this slot holds now, in a handle of its own (:meth:`handle_copy`): a later
        change of members does not move it (it fails once revoked). Close it after use."""
        return NativeCommunicator(self.handle_copy(), self.kind)

    def _install(self, handle: int) -> None:
        """Put the engine communicator ``handle`` in this communicator's slot, once the calls on the old one ended
        (a revoked call's error must not reach the next computations through JAX's ordering tokens)."""
        nc.forget_failed_calls()
        if not self.engine.rebind(self.handle, handle):
            raise RuntimeError(f"communicator handle {self.handle} or {handle} is unknown to the engine")
        self.size = self.engine.size(self.handle)
        self._rank = self.engine.rank(self.handle)
        self.generation += 1
        for companion, name in self._live_companions():  # collective, as every change of members is
            companion._install(self.engine.split(self.handle, 0, self._rank, name))

    def split(self, color: int, key: int, name: str) -> NativeCommunicator:
        """The ranks with the same ``color``, ordered by ``key`` (e.g. one per node for the
        intra-node group of a hierarchical algorithm). Every rank must call it."""
        return NativeCommunicator(self.engine.split(self.handle, int(color), int(key), name), self.kind)

    def companion(self, name: str) -> NativeCommunicator:
        """A communicator of the same ranks in a slot of its own, for collectives made beside this one's (an outer
        exchange on a thread: MPI needs each communicator's collectives in one order on every rank), which follows
        this one through a change of members: :meth:`shrink`, :meth:`grow` and :meth:`join` build it again over the
        new ranks in its slot, and :meth:`revoke_when` revokes it with this one. Every rank makes it at the same point,
        and keeps it for as long as the others do."""
        companion = self.split(0, self._rank, name)
        self._companions.append((weakref.ref(companion), name))
        return companion

    def _live_companions(self) -> list[tuple[NativeCommunicator, str]]:
        """The companions (:meth:`companion`) not yet released, with their names."""
        live = [(ref(), name) for ref, name in self._companions]
        live = [(companion, name) for companion, name in live if companion is not None and not companion._closed]
        self._companions = [(weakref.ref(companion), name) for companion, name in live]
        return live

    def _engine_state(self) -> tuple[str, ModuleType, int, str]:
        return self.kind, self.engine, self.handle, f"communicator handle {self.handle}"

    def set_mpi_ring_min_bytes(self, value: int) -> None:
        """Set :attr:`mpi_ring_min_bytes` for the collectives dispatched after this call, once those dispatched before
        completed with the old one (``jax.effects_barrier``). Run-time state, not part of any compiled program: it
        recompiles nothing. Every rank must set the same value at the same point."""
        value = mpi_ring_min_bytes(value, self.kind, f"communicator handle {self.handle}")
        jax.effects_barrier()
        self.engine.set_ring_min_bytes(self.handle, value)

    def set_average_divisor(self, ranks: int | None) -> None:
        """Make ``"avg"`` reductions divide by ``ranks`` instead of the size (None: the size again), set as
        :meth:`set_mpi_ring_min_bytes` is: a fault-tolerant job's joiner sends zeros in the step it takes weighed out,
        and every rank divides by the members that trained it."""
        if not self.on_host:
            raise ValueError("set_average_divisor: only the host engines' (MPI, TCP) averages take a divisor")
        if ranks is not None and not 1 <= ranks <= self.size:
            raise ValueError(f"set_average_divisor: ranks must be 1..{self.size} (the size) or None, got {ranks}")
        jax.effects_barrier()
        self.engine.set_average_divisor(self.handle, 0 if ranks is None else int(ranks))

    def close(self) -> None:
        """Release the communicator (it is freed once no call uses it)."""
        self._closed = True
        self.engine.destroy(self.handle)

    def rank(self) -> jax.Array:
        """This rank's index as an int32 scalar, read at run time from the communicator the handle holds."""
        return nc.rank_p.bind(comm=self.handle, engine=self.kind)

    def _op(self, op: ReduceOp) -> int:
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduction {op!r}; use one of {REDUCE_OPS}")
        return ReduceOp(op).code

    def _root(self, root: int) -> int:
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root {root} is not a rank of this {self.size}-rank communicator")
        return int(root)

    def _rows(self, x: jax.Array, what: str) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] != self.size:
            raise ValueError(f"{what} needs x of shape [size={self.size}, ...], got {list(x.shape)}")
        return x

    def allreduce(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks; every rank gets the result."""
        x = jnp.asarray(x)
        return nc.allreduce_p.bind(x.ravel(), comm=self.handle, engine=self.kind, op=self._op(op)).reshape(x.shape)

    def reduce(self, x: jax.Array, root: int, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks onto ``root``; other ranks get zeros."""
        x = jnp.asarray(x)
        flat = nc.reduce_p.bind(x.ravel(), comm=self.handle, engine=self.kind, op=self._op(op), root=self._root(root))
        return flat.reshape(x.shape)

    def broadcast(self, x: jax.Array, root: int) -> jax.Array:
        """Every rank gets ``root``'s ``x``."""
        x = jnp.asarray(x)
        return nc.broadcast_p.bind(x.ravel(), comm=self.handle, engine=self.kind, root=self._root(root)).reshape(
            x.shape
        )

    def reduce_scatter(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """``x`` is ``[size, *s]``; rank r gets row r reduced over ranks."""
        x = self._rows(x, "reduce_scatter")
        flat = nc.reduce_scatter_p.bind(x.ravel(), comm=self.handle, engine=self.kind, op=self._op(op), size=self.size)
        return flat.reshape(x.shape[1:])

    def allgather(self, x: jax.Array) -> jax.Array:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""
        x = jnp.asarray(x)
        return nc.allgather_p.bind(x.ravel(), comm=self.handle, engine=self.kind, size=self.size).reshape(
            self.size, *x.shape
        )

    def gather(self, x: jax.Array, root: int) -> jax.Array:
        """``root`` gets ``[size, *x.shape]``; other ranks get zeros."""
        x = jnp.asarray(x)
        flat = nc.gather_p.bind(x.ravel(), comm=self.handle, engine=self.kind, root=self._root(root), size=self.size)
        return flat.reshape(self.size, *x.shape)

    def scatter(self, x: jax.Array, root: int) -> jax.Array:
        """``x`` is ``[size, *s]`` (read on ``root``); rank r gets ``root``'s row r."""
        x = self._rows(x, "scatter")
        flat = nc.scatter_p.bind(x.ravel(), comm=self.handle, engine=self.kind, root=self._root(root), size=self.size)
        return flat.reshape(x.shape[1:])

    def alltoall(self, x: jax.Array) -> jax.Array:
        """``x`` is ``[size, *s]``; row j goes to rank j, row j of the result came from rank j."""
        x = self._rows(x, "alltoall")
        return nc.alltoall_p.bind(x.ravel(), comm=self.handle, engine=self.kind).reshape(x.shape)

    def alltoall_v(self, x: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, out_size: int) -> jax.Array:
        """Variable all-to-all of 1-D ``x`` with run-time int32 counts (see the protocol)."""
        x = jnp.asarray(x)
        if x.ndim != 1:
            raise ValueError(f"alltoall_v needs a 1-D x, got shape {list(x.shape)}")
        counts = [jnp.asarray(c, jnp.int32).reshape(-1) for c in (send_counts, recv_counts)]
        for c in counts:
            if c.size != self.size:
                raise ValueError(f"alltoall_v counts need {self.size} entries, got {c.size}")
        return nc.alltoall_v_p.bind(x, *counts, comm=self.handle, engine=self.kind, out_size=int(out_size))

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        """Send ``x`` to each rank in ``peers`` (run-time int32) and receive one ``x`` from each."""
        x = jnp.asarray(x)
        peers = jnp.asarray(peers, jnp.int32).reshape(-1)
        flat = nc.send_recv_p.bind(x.ravel(), peers, comm=self.handle, engine=self.kind)
        return flat.reshape(peers.shape[0], *x.shape)

    def send_recv_scheduled(self, x: jax.Array, schedule: np.ndarray, round_index: jax.Array) -> jax.Array:
        """``send_recv`` with this rank's peers of round ``round_index % rounds`` of the static table
        ``schedule`` (see :meth:`Communicator.send_recv_scheduled`)."""
        table = jnp.asarray(check_schedule(schedule, self.size))
        return self.send_recv(x, table[jnp.asarray(round_index, jnp.int32) % table.shape[0], self.rank()])

    def send(self, x: jax.Array, peer: jax.Array | int) -> None:
        """Send ``x`` to rank ``peer`` (chosen at run time); it must meet a matching ``recv``.

        Point-to-point calls are ordered with the collectives, so two ranks that send and
        receive in opposite orders still meet.
        """
        nc.send_p.bind(jnp.asarray(x), jnp.asarray(peer, jnp.int32).reshape(1), comm=self.handle, engine=self.kind)

    def recv(self, shape: tuple[int, ...], dtype: jnp.dtype, peer: jax.Array | int) -> jax.Array:
        """Receive an array of ``shape`` and ``dtype`` sent by rank ``peer``."""
        peer = jnp.asarray(peer, jnp.int32).reshape(1)
        return nc.recv_p.bind(peer, comm=self.handle, engine=self.kind, shape=tuple(shape), dtype=jnp.dtype(dtype))

    def barrier(self, x: jax.Array) -> jax.Array:
        """Return ``x`` once every rank has reached this point."""
        nc.barrier_p.bind(comm=self.handle, engine=self.kind)
        return x

"""The native collective engines: loading one, and the reduction codes they take.

The engines are separate extension modules (``_bagua_mpi``, ``_bagua_nccl``, ``_bagua_tcp``) so
that the kernels never need libmpi or libnccl to import; both front ends load them here, so a
missing engine is reported the same way from either.
"""

from __future__ import annotations

import abc
import functools
import importlib
import os
from types import ModuleType

from bagua_common.comm.engine_exit import finalize_at_exit
from bagua_common.fault_tolerance.settings import ENV_FAULT_TOLERANCE, ENV_JOIN

ENGINE_MODULES = {"mpi": "_bagua_mpi", "nccl": "_bagua_nccl", "tcp": "_bagua_tcp"}
"""Engine name -> its extension module."""

HOST_ENGINES = ("mpi", "tcp")
"""The engines of host buffers (NCCL's are device buffers)."""

ENV_ELASTIC = "BAGUA_ELASTIC"
"""Set to 1 in the workers of an elastic job (``bagua-launch --nnodes MIN:MAX``)."""


def fault_tolerant_job() -> bool:
    """Whether this process belongs to a fault-tolerant job (``BAGUA_FAULT_TOLERANCE=1``, or ``BAGUA_FT_JOIN=1``
    in a process joining one), whose communicators change members in place."""
    return os.environ.get(ENV_FAULT_TOLERANCE) == "1" or os.environ.get(ENV_JOIN) == "1"


@functools.cache
def load_engine(kind: str) -> ModuleType:
    """The engine module ``"mpi"``, ``"nccl"`` or ``"tcp"``, imported once and finalized at exit.

    Raises a ValueError for another name and a RuntimeError naming the fix when this build
    of bagua has no such engine.
    """
    if kind not in ENGINE_MODULES:
        raise ValueError(f"unknown engine {kind!r}; use one of {sorted(ENGINE_MODULES)}")
    if kind == "mpi" and os.environ.get(ENV_ELASTIC) == "1" and not fault_tolerant_job():
        raise RuntimeError(
            "the native MPI engine runs in an elastic job only with fault tolerance (BAGUA_FAULT_TOLERANCE=1): "
            "MPI_COMM_WORLD cannot change size, but a world built through the job's store can shrink and grow "
            "(bagua_jax.fault_tolerance.FaultTolerantTrainer, every rank its own `mpiexec -n 1` job); otherwise use "
            "torch's gloo/NCCL, JAX over jax.distributed or the native NCCL engine"
        )
    import _bagua_ffi

    if not _bagua_ffi.build_info().get(kind):
        raise RuntimeError(
            f"bagua was built without the {kind.upper()} engine (see build_info()); "
            + {"mpi": "install mpich and rebuild", "nccl": "install NCCL and rebuild with CUDA"}.get(kind, "rebuild")
        )
    module = importlib.import_module(ENGINE_MODULES[kind])
    finalize_at_exit(module)
    return module


def mpi_ring_min_bytes(value: object, engine: str, communicator: str) -> int:
    """``value`` as the MPI engine's ring threshold in bytes, checked: an int >= 0, on an MPI communicator.

    ``engine`` and ``communicator`` (how the errors name it) say where it is being set.
    """
    mpi_setting(engine, communicator, "the ring threshold")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the MPI ring threshold must be an int (bytes), got {value!r}")
    if value < 0:
        raise ValueError(f"the MPI ring threshold must be >= 0 bytes, got {value}")
    return value


def mpi_setting(engine: str, communicator: str, what: str) -> None:
    """Raise a ValueError unless ``engine`` is MPI: ``what`` is a setting of the MPI engine only."""
    if engine != "mpi":
        raise ValueError(f"{what} is the MPI engine's; {communicator} uses {engine.upper()}")


class MpiSettings(abc.ABC):
    """The MPI engine's run-time settings, read the same way on both front ends' native communicators.

    The communicator class provides :meth:`_engine_state`. Setting the ring threshold waits for
    different things in each front end, so each writes its own ``set_mpi_ring_min_bytes`` around
    :func:`mpi_ring_min_bytes`.
    """

    @abc.abstractmethod
    def _engine_state(self) -> tuple[str, ModuleType, int, str]:
        """The engine's name (``"mpi"``, ``"nccl"``), its module, this communicator's handle, and how errors
        name the communicator."""

    @property
    def spans_nodes(self) -> bool:
        """Whether the ranks span more than one node (MPI's view: no shared memory between them); MPI only."""
        engine, module, handle, where = self._engine_state()
        mpi_setting(engine, where, "spans_nodes")
        return bool(module.spans_nodes(handle))

    @property
    def mpi_ring_min_bytes(self) -> int:
        """The size in bytes from which allreduces take the engine's ring when the ranks span nodes; MPI only.

        1 MiB unless ``BAGUA_MPI_RING_MIN_BYTES`` says otherwise; a split starts with its parent's.
        """
        engine, module, handle, where = self._engine_state()
        mpi_setting(engine, where, "the ring threshold")
        return int(module.ring_min_bytes(handle))

"""Modules and names that moved: they keep working for one release, with a ``DeprecationWarning``.

:data:`MOVED_MODULES` maps an old module path to its new one: importing the old path (``import
bagua_common.elastic_sampler``, ``from bagua_torch.algorithms.q_adam import QAdamOptimizer``)
warns, naming the new place, and gives the new module itself. :data:`MOVED_NAMES` maps a name
that left a module to the module that holds it now; the old module answers for it through
``__getattr__ = moved_names(__name__)``. The finder is installed when :mod:`bagua_common` is
imported (every front end imports it) and answers for the old paths only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "moved_names"]

MOVED_MODULES: dict[str, str] = {
    "bagua_common.advisor": "bagua_common.tuning.advisor",
    "bagua_common.algorithm_configs": "bagua_common.algorithms.configs",
    "bagua_common.autotune": "bagua_common.tuning.autotune",
    "bagua_common.averaging_rounds": "bagua_common.algorithms.averaging_rounds",
    "bagua_common.bagua_net": "bagua_common.comm.bagua_net",
    "bagua_common.balanced_plan": "bagua_common.data.balanced_plan",
    "bagua_common.bucket_plan": "bagua_common.comm.bucket_plan",
    "bagua_common.cache_stores": "bagua_common.data.cache_stores",
    "bagua_common.cached_dataset": "bagua_common.data.cached_dataset",
    "bagua_common.checkpoint": "bagua_common.job.checkpoint",
    "bagua_common.child_process": "bagua_common.job.child_process",
    "bagua_common.collectives": "bagua_common.comm.collectives",
    "bagua_common.comm_timeout": "bagua_common.comm.timeout",
    "bagua_common.compressed_allreduce": "bagua_common.algorithms.compressed_allreduce",
    "bagua_common.elastic_sampler": "bagua_common.data.elastic_sampler",
    "bagua_common.engine_exit": "bagua_common.comm.engine_exit",
    "bagua_common.engines": "bagua_common.comm.engines",
    "bagua_common.frozen_variance": "bagua_common.algorithms.frozen_variance",
    "bagua_common.local_ranks": "bagua_common.job.local_launch",
    "bagua_common.options": "bagua_common.algorithms.option_checks",
    "bagua_common.powersgd": "bagua_common.algorithms.configs",
    "bagua_common.redis_server": "bagua_common.data.redis_server",
    "bagua_common.reshard": "bagua_common.job.reshard",
    "bagua_common.signature": "bagua_common.job.signature",
    "bagua_common.successive_halving": "bagua_common.tuning.successive_halving",
    "bagua_common.topology": "bagua_common.comm.topology",
    "bagua_common.tpe_search": "bagua_common.tuning.tpe_search",
    "bagua_launch.launcher": "bagua_launch",
    "bagua_torch.algorithms.q_adam": "bagua_torch.algorithms.qadam",
    "bagua_torch.distributed": "bagua_torch.bagua_module",
    "bagua_torch.process_group": "bagua_torch.job",
}
"""Old module path -> new module path."""

MOVED_NAMES: dict[tuple[str, str], str] = {
    # bagua_torch.distributed is bagua_torch.bagua_module now (MOVED_MODULES), DistributedDataParallel apart.
    ("bagua_torch.bagua_module", "DistributedDataParallel"): "bagua_torch.distributed_data_parallel",
    ("bagua_torch.torch_api.distributed", "broadcast_optimizer_state"): "bagua_torch.broadcast",
}
"""(old module, name) -> the module that holds the name now."""


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED_MODULES`; loading one warns and yields the new module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        _warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    """Put the finder of the old module paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


def moved_names(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering, with a warning, for the names that left ``module`` (:data:`MOVED_NAMES`)."""

    def module_getattr(name: str) -> Any:
        new = MOVED_NAMES.get((module, name))
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{new}.{name}")
        return getattr(importlib.import_module(new), name)

    return module_getattr

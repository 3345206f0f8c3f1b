"""Which algorithms exist, and which class implements each one in each front end.

An algorithm is declared once, by its configuration, and every lookup is derived from that
declaration and from one decorator per front end. To add an algorithm (``diloco`` here):

1. its configuration in :mod:`bagua_common.algorithms.configs` (or in the algorithm's own module
   of :mod:`bagua_common.algorithms`, as ``DiLoCoConfig`` in ``diloco.py``): a frozen dataclass
   with the registry ``name`` as a ``ClassVar``, its fields with their defaults, and its checks
   in ``__post_init__`` (raising TypeError/ValueError that start with the name), decorated with
   :func:`register_config`;
2. its class in each front end, decorated with that front end's ``implements``, in a module the
   front end's ``algorithms/__init__.py`` imports (so that importing the package registers it)::

       # bagua_jax/algorithms/diloco.py             # bagua_torch/algorithms/diloco.py
       @implements(DiLoCoConfig)                    @implements(DiLoCoConfig)
       class DiLoCo(ConfiguredAlgorithm): ...       class DiLoCoAlgorithm(Algorithm): ...

The class then holds a ``DiLoCoConfig`` (its ``config``), gets ``name`` and ``config_class``
from it, and is found by name (``make_algorithm("diloco")``, ``get_algorithm("diloco")``,
Bagua's ``Algorithm.init("diloco")``) and by configuration class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)
T = TypeVar("T")

CONFIGS: dict[str, type] = {}
"""Registry name -> configuration class, in declaration order: every algorithm there is."""


def register_config(cls: C) -> C:
    """Register the configuration class ``cls`` (a frozen dataclass whose own ``name`` is unique): see the module
    docstring for the steps of adding an algorithm."""
    name = vars(cls).get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_config: {cls.__name__} must declare its registry name as name: ClassVar[str]")
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"register_config: {cls.__name__} must be a frozen dataclass")
    if name in CONFIGS:
        raise ValueError(f"register_config: {name!r} is already the name of {CONFIGS[name].__name__}")
    CONFIGS[name] = cls
    return cls


def unknown_algorithm(name: str, available: Iterable[str]) -> ValueError:
    """The error every front end raises for a name no algorithm is registered under."""
    return ValueError(f"algorithm {name!r} is unknown; available: {', '.join(available)}")


def as_config(config_class: type, *args: Any, **options: Any) -> Any:
    """The configuration given as arguments: ``args[0]`` when it is the only one and a ``config_class`` (taken as it
    is: it checked itself when it was built), else ``config_class(*args, **options)``."""
    if len(args) == 1 and not options and isinstance(args[0], config_class):
        return args[0]
    return config_class(*args, **options)


def build_algorithm(cls: type[T], options: dict[str, Any]) -> T:
    """``cls(**options)``, the registered algorithm class ``cls``; a TypeError (an unknown option or a value of the
    wrong type) is raised again with the algorithm's name in front, the same in every front end."""
    try:
        return cls(**options)
    except TypeError as error:
        raise TypeError(f"algorithm {cls.name!r}: {error}") from error


class AlgorithmRegistry:
    """One front end's algorithm classes, each registered against its configuration class by :meth:`implements`."""

    def __init__(self, front_end: str):
        self.front_end = front_end
        self._classes: dict[type, type] = {}

    def implements(self, config_class: type) -> Callable[[C], C]:
        """A class decorator: the decorated class is this front end's implementation of ``config_class`` (a class
        registered with :func:`register_config`), and gets its ``name`` and ``config_class``.

        A new algorithm needs its configuration in :mod:`bagua_common.algorithms.configs` and one
        ``@implements(ItsConfig)`` class in each front end (see :mod:`bagua_common.algorithms.registry`).
        """
        if CONFIGS.get(getattr(config_class, "name", None)) is not config_class:
            raise TypeError(f"implements: {config_class!r} is not registered with @register_config")

        def register(cls: C) -> C:
            if self._classes.get(config_class, cls) is not cls:
                raise ValueError(
                    f"{self.front_end}: {config_class.name!r} is already implemented by "
                    f"{self._classes[config_class].__qualname__}"
                )
            cls.name = config_class.name
            cls.config_class = config_class
            self._classes[config_class] = cls
            return cls

        return register

    def names(self) -> list[str]:
        """The registry names this front end implements, in declaration order."""
        return [name for name, config_class in CONFIGS.items() if config_class in self._classes]

    def by_config(self, config_class: type) -> type:
        """The class implementing ``config_class``; a ValueError if this front end has none."""
        if config_class not in self._classes:
            raise ValueError(
                f"{self.front_end} has no implementation of {getattr(config_class, 'name', config_class)!r}"
            )
        return self._classes[config_class]

    def by_name(self, name: str) -> type:
        """The class registered under ``name``; a ValueError listing the available names otherwise."""
        if not isinstance(name, str):
            raise TypeError(f"an algorithm name must be a string, got {type(name).__name__}")
        config_class = CONFIGS.get(name)
        if config_class not in self._classes:
            raise unknown_algorithm(name, self.names())
        return self._classes[config_class]

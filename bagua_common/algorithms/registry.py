"""Which algorithms exist, and which class implements each one in each front end.

An algorithm is declared once, by its configuration, and every lookup is derived from that
declaration and from one decorator per front end. To add an algorithm (``diloco`` here):

1. its configuration in :mod:`bagua_common.algorithms.configs` (or in the algorithm's own module
   of :mod:`bagua_common.algorithms`, as ``DiLoCoConfig`` in ``diloco.py``): a frozen dataclass
   subclassing :class:`AlgorithmConfig`, with the registry ``name`` and the facts of
   :class:`AlgorithmConfig` it differs in as class attributes, its fields with their defaults, and its checks
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
import inspect
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound=type)
T = TypeVar("T")

CONFIGS: dict[str, type] = {}
"""Registry name -> configuration class, in declaration order: every algorithm there is."""


class AlgorithmConfig:
    """What an algorithm declares about itself beside its fields; every per-algorithm lookup of the library (the
    checkpoint's reshard rule, the autotuner's exactness, the advisor's candidates) reads these, so an algorithm is
    described in one place. The defaults are the cautious answers; a configuration overrides what differs."""

    name: ClassVar[str]
    """The registry name (``"bytegrad"``): the same in every front end and in a checkpoint's options."""
    replicated: ClassVar[bool] = False
    """Whether every rank's parameters and state stay identical (restored into another world size, the saved
    rank 0's carry over); False where the ranks drift apart (restored, they start from the ranks' mean)."""
    world_sized_state: ClassVar[tuple[str, ...]] = ()
    """Words that name the state leaves restarting at their initial value when the world size changes (error
    feedback residuals, copies of the neighbours' weights: their shapes follow the world size)."""
    bucket_exact: ClassVar[bool] = False
    """Whether its numbers do not depend on the bucket layout (it exchanges full-precision values elementwise), so
    the autotuner may change the bucket size without changing the numbers."""
    hierarchical_exact: ClassVar[bool] = False
    """Whether its hierarchical form adds the same values as the flat one (in another order)."""
    step_free_of_world_size: ClassVar[bool] = False
    """Whether its flat step's collectives are full-precision averages over the world, with no buffer laid out per
    rank, so the number of ranks enters only through the engine's division at run time: a step compiled once runs on
    any world size (a fault-tolerant JAX job does not compile it again after a change of members)."""
    stateless: ClassVar[bool] = False
    """Whether it keeps no state between steps, so rebuilding it mid-run (re-bucketing) changes nothing."""
    is_optimizer: ClassVar[bool] = False
    """Whether it is an optimizer itself (QAdam, 1-bit Adam): it replaces the user's, and its warm-up is a gradient
    allreduce beside its compressed steady state."""
    background: ClassVar[bool] = False
    """Whether it communicates beside the step, on its own communicator, rather than inside it."""
    advised: ClassVar[bool] = True
    """Whether ``bagua_jax.advisor`` ranks it (flat, and hierarchical where it has that option)."""
    advisor_variants: ClassVar[dict[str, dict[str, Any]]] = {}
    """Further flat variants the advisor ranks, by suffix: ``{"shift_one": {"peer_selection_mode": "shift_one"}}``
    is ranked as ``decentralized_shift_one``."""

    def local_steps_from(self) -> int | None:
        """The step count from which its training steps communicate nothing (asynchronous averaging's, once its
        warm-up is over: the weights are averaged beside the steps), so that a rank can take one by itself (a
        fault-tolerant member one step behind the others); None where its steps communicate."""
        return None


def register_config(cls: C) -> C:
    """Register the configuration class ``cls`` (a frozen dataclass whose own ``name`` is unique): see the module
    docstring for the steps of adding an algorithm."""
    name = vars(cls).get("name")
    if not issubclass(cls, AlgorithmConfig):
        raise TypeError(f"register_config: {cls.__name__} must subclass AlgorithmConfig (the facts it declares)")
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_config: {cls.__name__} must declare its registry name as name: ClassVar[str]")
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"register_config: {cls.__name__} must be a frozen dataclass")
    if name in CONFIGS:
        raise ValueError(f"register_config: {name!r} is already the name of {CONFIGS[name].__name__}")
    CONFIGS[name] = cls
    return cls


def algorithm_facts(name: str) -> type[AlgorithmConfig]:
    """What the algorithm registered as ``name`` declares about itself; for a name not registered (a user's own
    algorithm), the cautious defaults of :class:`AlgorithmConfig`."""
    return CONFIGS.get(name, AlgorithmConfig)


def unknown_algorithm(name: str, available: Iterable[str]) -> ValueError:
    """The error every front end raises for a name no algorithm is registered under."""
    return ValueError(f"algorithm {name!r} is unknown; available: {', '.join(available)}")


def as_config(config_class: type, *args: Any, **options: Any) -> Any:
    """The configuration given as arguments: ``args[0]`` when it is the only one and a ``config_class`` (taken as it
    is: it checked itself when it was built), else ``config_class(*args, **options)``."""
    if len(args) == 1 and not options and isinstance(args[0], config_class):
        return args[0]
    return config_class(*args, **options)


def option_names(cls: type) -> list[str]:
    """The keyword options the algorithm class ``cls`` takes: its constructor's named parameters, and the fields of
    its configuration (``config_class``) where the constructor passes its keywords on to it."""
    parameters = list(inspect.signature(cls).parameters.values())
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    config_class = getattr(cls, "config_class", None)
    if any(p.kind is p.VAR_KEYWORD for p in parameters) and dataclasses.is_dataclass(config_class):
        names += [field.name for field in dataclasses.fields(config_class) if field.name not in names]
    return names


def check_options(cls: type, options: Iterable[str]) -> str:
    """Raise a TypeError naming the algorithm class ``cls`` and its options (:func:`option_names`) unless it takes
    every option in ``options``; return its name."""
    name = getattr(cls, "name", "") or cls.__name__
    valid = option_names(cls)
    unknown = [key for key in options if key not in valid]
    if unknown:
        listed = ", ".join(valid) or "none"
        raise TypeError(f"algorithm {name!r} has no option {', '.join(map(repr, unknown))}; its options: {listed}")
    return name


def build_algorithm(cls: type[T], options: dict[str, Any]) -> T:
    """``cls(**options)``, the registered algorithm class ``cls``, the same in every entry point of both front ends.

    An option ``cls`` does not take raises a TypeError naming the algorithm and its options (:func:`option_names`);
    any other TypeError (a value of the wrong type) is raised again with the algorithm's name in front, unless its
    message starts with the name already.
    """
    name = check_options(cls, options)
    try:
        return cls(**options)
    except TypeError as error:
        if str(error).startswith(name):
            raise
        raise TypeError(f"algorithm {name!r}: {error}") from error


def algorithm_from(spec: Any, options: dict[str, Any], *, base: type, by_name: Callable[[str], type]) -> Any:
    """The algorithm ``spec`` is or names, taken the same way by every entry point of both front ends.

    An instance of ``base`` is returned as it is (``options`` must then be empty); a subclass of ``base``, or a
    name that ``by_name`` looks up, is built with ``options`` by :func:`build_algorithm`, so an unknown option's
    error names the algorithm and its options wherever the name was given.
    """
    if isinstance(spec, str):
        return build_algorithm(by_name(spec), options)
    if isinstance(spec, type) and issubclass(spec, base):
        return build_algorithm(spec, options)
    if isinstance(spec, base) and not isinstance(spec, type):
        if options:
            raise TypeError(
                f"options {sorted(options)} can only be given with an algorithm's name, not with an algorithm object "
                f"({type(spec).__name__}): set them when building it"
            )
        return spec
    raise TypeError(f"algorithm must be a name or a {base.__module__}.{base.__qualname__}, got {type(spec).__name__}")


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

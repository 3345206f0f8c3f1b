"""The shared algorithm configurations and the lookups derived from their registration.

Every configuration registered in :mod:`bagua_common.algorithms.registry` must have an
implementation in ``bagua_jax`` and in ``bagua_torch``, found by name and by configuration class;
each front end's algorithm holds the configuration of :mod:`bagua_common.algorithms.configs`, and
a bad value must raise the same error type with the same message in both (and carry the shared
configuration's own message).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import bagua_jax.algorithms as jax_algorithms
import bagua_torch.algorithms as torch_algorithms
import bagua_torch.torch_api.algorithms as compat_algorithms
from bagua_common.algorithms.registry import CONFIGS, AlgorithmConfig, AlgorithmRegistry, register_config
from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
from bagua_torch.algorithms.qadam import QAdamOptimizer

FRONT_ENDS = {"bagua_jax": jax_algorithms.REGISTRY, "bagua_torch": torch_algorithms.REGISTRY}

ADAM_OPTIMIZERS = {"qadam": QAdamOptimizer, "onebit_adam": OneBitAdamOptimizer}

# Options each name needs (the Adam variants are optimizers and need a learning rate).
REQUIRED: dict[str, dict[str, Any]] = {"qadam": {"learning_rate": 0.01}, "onebit_adam": {"learning_rate": 0.01}}

BAD_VALUES: list[tuple[str, dict[str, Any]]] = [
    ("gradient_allreduce", {"hierarchical": "yes"}),
    ("gradient_allreduce", {"average": "sum"}),
    ("bytegrad", {"error_feedback": 1}),
    ("decentralized", {"peer_selection_mode": "ring"}),
    ("decentralized", {"communication_interval": 0}),
    ("decentralized", {"communication_interval": True}),
    ("decentralized", {"communication_interval": -1}),
    ("decentralized", {"hierarchical": None}),
    ("low_precision_decentralized", {"communication_interval": 1.5}),
    ("low_precision_decentralized", {"hierarchical": "no"}),
    ("async", {"sync_interval_ms": -1}),
    ("async", {"warmup_steps": -1}),
    ("qadam", {"learning_rate": -1.0}),
    ("qadam", {"learning_rate": np.float64(-0.5)}),
    ("qadam", {"warmup_steps": 0}),
    ("qadam", {"b1": 1.0}),
    ("qadam", {"eps": 0.0}),
    ("qadam", {"hierarchical": "x"}),
    ("qadam", {"step_bound": 0.0}),
    ("onebit_adam", {"step_bound": "1"}),
    ("onebit_adam", {"b2": -0.1}),
    ("onebit_adam", {"warmup_steps": 2.5}),
    ("powersgd", {"rank": 0}),
    ("powersgd", {"rank": 2.0}),
    ("powersgd", {"min_compression_rate": 0.5}),
    ("powersgd", {"start_iter": -1}),
    ("powersgd", {"error_feedback": "on"}),
]


def build_jax(name: str, options: dict[str, Any]) -> Any:
    """The JAX algorithm called ``name`` with ``options``."""
    options = dict(options)
    learning_rate = options.pop("learning_rate", None)
    return jax_algorithms.make_algorithm(name, learning_rate, **options)


def build_torch(name: str, options: dict[str, Any]) -> Any:
    """The torch algorithm called ``name`` with ``options``; the Adam variants take their hyperparameters through
    their optimizer (torch's spelling: ``lr``, ``betas``)."""
    if name not in ADAM_OPTIMIZERS:
        return torch_algorithms.get_algorithm(name, **options)
    hyper = dict(options)
    hierarchical = hyper.pop("hierarchical", True)
    betas = (hyper.pop("b1", 0.9), hyper.pop("b2", 0.999))
    lr = hyper.pop("learning_rate")
    optimizer = ADAM_OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=betas, **hyper)
    return torch_algorithms.get_algorithm(name, optimizer=optimizer, hierarchical=hierarchical)


def fields_of(config: Any) -> dict[str, Any]:
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


def raised(build: Any, *args: Any) -> Exception:
    with pytest.raises((TypeError, ValueError)) as info:
        build(*args)
    return info.value


def missing_implementations(registries: dict[str, AlgorithmRegistry]) -> list[str]:
    """``front end: name`` for every registered configuration a front end has no class for."""
    missing = []
    for front_end, registry in registries.items():
        for name, config_class in CONFIGS.items():
            try:
                registry.by_config(config_class)
            except ValueError:
                missing.append(f"{front_end}: {name}")
    return missing


def test_every_registered_configuration_is_implemented_by_both_front_ends():
    assert missing_implementations(FRONT_ENDS) == []
    for registry in FRONT_ENDS.values():
        assert registry.names() == list(CONFIGS)


def test_a_front_end_without_a_class_for_a_configuration_is_found(request):
    @register_config
    @dataclasses.dataclass(frozen=True)
    class OnlyInJaxConfig(AlgorithmConfig):
        name: ClassVar[str] = "only_in_jax_for_test"

    request.addfinalizer(lambda: CONFIGS.pop(OnlyInJaxConfig.name))
    jax_registry = AlgorithmRegistry("bagua_jax")
    jax_registry.implements(OnlyInJaxConfig)(type("OnlyInJax", (), {}))
    torch_registry = AlgorithmRegistry("bagua_torch")
    missing = missing_implementations({"bagua_jax": jax_registry, "bagua_torch": torch_registry})
    assert "bagua_torch: only_in_jax_for_test" in missing and "bagua_jax: only_in_jax_for_test" not in missing
    assert jax_registry.by_name("only_in_jax_for_test").name == "only_in_jax_for_test"
    with pytest.raises(ValueError, match="'only_in_jax_for_test' is unknown; available: $"):
        torch_registry.by_name("only_in_jax_for_test")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lookup_by_name_and_by_configuration_agree(name):
    config_class = CONFIGS[name]
    assert config_class.name == name
    for registry in FRONT_ENDS.values():
        cls = registry.by_name(name)
        assert cls is registry.by_config(config_class)
        assert cls.name == name and cls.config_class is config_class


def test_names_and_implementations_are_unique():
    assert len(set(CONFIGS)) == len(CONFIGS) == len(set(CONFIGS.values()))
    for registry in FRONT_ENDS.values():
        classes = [registry.by_name(name) for name in registry.names()]
        assert len(set(classes)) == len(classes)
    with pytest.raises(ValueError, match="'bytegrad' is already the name of ByteGradConfig"):

        @register_config
        @dataclasses.dataclass(frozen=True)
        class AnotherByteGrad(AlgorithmConfig):
            name: ClassVar[str] = "bytegrad"

    with pytest.raises(ValueError, match="'bytegrad' is already implemented by ByteGrad"):
        jax_algorithms.implements(CONFIGS["bytegrad"])(type("AnotherByteGrad", (), {}))


def test_bagua_spelling_registry_is_derived_from_its_classes():
    registry = compat_algorithms.GlobalAlgorithmRegistry
    assert list(registry) == compat_algorithms.REGISTRY.names()
    assert registry["low_precision_decentralized"] is compat_algorithms.decentralized.LowPrecisionDecentralizedAlgorithm
    assert registry["bytegrad"] is torch_algorithms.ByteGradAlgorithm
    assert isinstance(compat_algorithms.Algorithm.init("async", warmup_steps=2), torch_algorithms.Algorithm)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_name_resolves_to_the_shared_configuration_in_both_front_ends(name):
    config_class = CONFIGS[name]
    expected = config_class(**REQUIRED.get(name, {}))
    for algorithm in (build_jax(name, REQUIRED.get(name, {})), build_torch(name, REQUIRED.get(name, {}))):
        assert isinstance(algorithm.config, config_class), (name, type(algorithm))
        assert algorithm.name == name
        assert fields_of(algorithm.config) == fields_of(expected)


@pytest.mark.parametrize("name,bad", BAD_VALUES, ids=[f"{n}-{next(iter(b))}" for n, b in BAD_VALUES])
def test_a_bad_value_fails_the_same_way_in_both_front_ends(name, bad):
    options = {**REQUIRED.get(name, {}), **bad}
    from_config = raised(lambda: CONFIGS[name](**options))
    from_jax, from_torch = raised(build_jax, name, options), raised(build_torch, name, options)
    assert type(from_jax) is type(from_torch) is type(from_config)
    assert str(from_jax) == str(from_torch)
    assert str(from_config) in str(from_jax)
    assert str(from_config).startswith(f"{name}: {next(iter(bad))}")


def test_an_unknown_name_fails_the_same_way_in_both_front_ends():
    from_jax, from_torch = raised(build_jax, "bytegrd", {}), raised(build_torch, "bytegrd", {})
    assert type(from_jax) is type(from_torch) is ValueError
    assert str(from_jax) == str(from_torch)
    assert "'bytegrd' is unknown; available: gradient_allreduce, bytegrad," in str(from_jax)


def test_configurations_are_frozen():
    for name, config_class in CONFIGS.items():
        config = config_class(**REQUIRED.get(name, {}))
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, getattr(config, field))

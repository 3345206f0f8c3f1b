"""The shared algorithm configurations: every registry name means the same options in both front ends.

Each algorithm is built by name in ``bagua_jax`` and in ``bagua_torch``; both must hold the fields
of the configuration in :mod:`bagua_common.algorithms.configs`, and a bad value must raise the same
error type with the same message in both (and carry the shared configuration's own message).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import bagua_jax.algorithms as jax_algorithms
import bagua_torch.algorithms as torch_algorithms
from bagua_common.algorithms.configs import ALGORITHM_CONFIGS, config_options
from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
from bagua_torch.algorithms.qadam import QAdamOptimizer

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


def shared_config(algorithm: Any) -> Any:
    """The shared configuration an algorithm object is built on."""
    return getattr(algorithm, "config", algorithm) if isinstance(algorithm, torch_algorithms.Algorithm) else algorithm


def raised(build: Any, *args: Any) -> Exception:
    with pytest.raises((TypeError, ValueError)) as info:
        build(*args)
    return info.value


def test_the_registry_names_are_the_same_everywhere():
    assert all(config.name == name for name, config in ALGORITHM_CONFIGS.items())
    assert list(jax_algorithms.ALGORITHMS) == list(ALGORITHM_CONFIGS)
    assert list(torch_algorithms.BUILTIN_ALGORITHMS) == list(ALGORITHM_CONFIGS)
    assert torch_algorithms.available_algorithms() == list(ALGORITHM_CONFIGS)


@pytest.mark.parametrize("name", list(ALGORITHM_CONFIGS))
def test_every_name_resolves_to_the_shared_configuration_in_both_front_ends(name):
    config_class = ALGORITHM_CONFIGS[name]
    expected = config_class(**REQUIRED.get(name, {}))
    shared_fields = set(config_options(expected))
    for algorithm in (build_jax(name, REQUIRED.get(name, {})), build_torch(name, REQUIRED.get(name, {}))):
        config = shared_config(algorithm)
        assert isinstance(config, config_class), (name, type(algorithm))
        assert algorithm.name == name
        assert {k: v for k, v in config_options(config).items() if k in shared_fields} == config_options(expected)


@pytest.mark.parametrize("name,bad", BAD_VALUES, ids=[f"{n}-{next(iter(b))}" for n, b in BAD_VALUES])
def test_a_bad_value_fails_the_same_way_in_both_front_ends(name, bad):
    options = {**REQUIRED.get(name, {}), **bad}
    from_config = raised(lambda: ALGORITHM_CONFIGS[name](**options))
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
    for name, config_class in ALGORITHM_CONFIGS.items():
        config = config_class(**REQUIRED.get(name, {}))
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, getattr(config, field))

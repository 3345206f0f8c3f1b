"""A launch configuration filled from the parsed command line."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


def config_from_namespace(config_class: type[C], ns: argparse.Namespace, **computed: Any) -> C:
    """``config_class`` (a dataclass) built from the command line ``ns``: each field ``computed`` names takes its
    value from there, every other field the option of its name, so that a field is listed once, where the
    configuration declares it."""
    given = {
        field.name: getattr(ns, field.name)
        for field in dataclasses.fields(config_class)  # type: ignore[arg-type]
        if field.name not in computed and hasattr(ns, field.name)
    }
    return config_class(**given, **computed)

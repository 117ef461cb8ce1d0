"""Which classes may cross from a child to its parent, by their own dotted names.

A module that defines a dataclass a child returns registers it where it defines it
(``@result_type``): ``run.outcome.Outcome``, ``plan.environment.Environment`` and ``Device``.
The wire format (``run.isolation.wire``) rebuilds only registered classes, and so names no
class of the layers above it; whatever process can build one has registered it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["registered", "registered_fields", "result_type", "result_types"]

_REGISTRY: dict[str, type[Any]] = {}
_FIELDS: dict[type[Any], tuple[str, ...]] = {}  # each registered class's field names, in order
_T = TypeVar("_T", bound=type)


def result_type(cls: _T) -> _T:
    """Allow the dataclass ``cls`` as a child's result (a class decorator)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__} is not a dataclass: only dataclasses cross the "
                        "result pipe")
    _REGISTRY[f"{cls.__module__}.{cls.__qualname__}"] = cls
    _FIELDS[cls] = tuple(field.name for field in dataclasses.fields(cls))
    return cls


def registered(name: str) -> type[Any] | None:
    """The registered class of that dotted name, or None."""
    return _REGISTRY.get(name)


def registered_fields(name: str, cls: type[Any]) -> tuple[str, ...] | None:
    """The field names of ``cls``, in order, when it is the class registered as ``name``
    (read from the registration: a forked child need not run ``dataclasses`` for them)."""
    return _FIELDS[cls] if _REGISTRY.get(name) is cls else None


def result_types() -> tuple[str, ...]:
    """The dotted names of the classes a child may return, sorted."""
    return tuple(sorted(_REGISTRY))

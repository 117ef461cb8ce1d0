"""The parts of an output the comparison walks into, and its leaves named by their paths.

Dicts, lists and tuples are walked by ``compare`` itself. Any other object is walked
here (``parts``) when it says what it holds:

- a dataclass, field by field (``out.hidden``);
- a type registered with ``torch.utils._pytree`` (as ``transformers`` registers its
  ``ModelOutput`` classes, and a user may register a cache or a result class), by the
  children and keys its registration gives (``out['cache'][0]``, ``out.keys``);
- an object whose type defines no ``==`` of its own and whose attributes hold a tensor
  (a ``transformers`` ``DynamicCache``: ``out['cache'].layers[0].keys``), attribute by
  attribute.

``named_leaves`` lists every tensor and Python number of an output with the path the
comparison reports it under, for what is computed per leaf outside the comparison (the
rounding budget, the cotangents of a gradient check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from pytest_gpucase.base.tensors import field_names, indexed, tuple_fields

__all__ = ["holds_tensor", "named_leaves", "parts", "walked_by_attributes"]

# How much of an object is searched for a tensor before it is walked by its attributes: a
# cache or a result object holds them near the top; an object graph (a model's config, a
# tokenizer) is not searched whole.
_SEARCHED = 4096
_DEPTH = 6


def parts(value: object) -> list[tuple[str, object]] | None:
    """The named parts of an object the comparison walks into (path suffix, value), or
    None for a leaf (compared with its own ``==``). Not for tensors, numbers, strings,
    mappings and sequences, which the comparison walks itself."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor)):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f".{item.name}", getattr(value, item.name))
                for item in dataclasses.fields(value)]
    found = _pytree_parts(value)
    if found is not None:
        return found
    if walked_by_attributes(value):
        return [(f".{name}", item) for name, item in vars(value).items()]
    return None


def walked_by_attributes(value: object) -> bool:
    """Whether an object is compared attribute by attribute: its type defines no ``==``,
    it is not a module (whose parameters are the state, not the output), and its
    attributes hold a tensor."""
    cls = type(value)
    return (cls.__eq__ is object.__eq__ and hasattr(value, "__dict__")
            and not isinstance(value, (type, torch.nn.Module)) and not callable(value)
            and holds_tensor(value))


def holds_tensor(value: object) -> bool:
    """Whether a tensor is found in ``value`` within a bounded search (mappings, sequences,
    dataclass fields, attributes)."""
    budget = [_SEARCHED]
    seen: set[int] = set()

    def search(item: object, depth: int) -> bool:
        if isinstance(item, torch.Tensor):
            return True
        budget[0] -= 1
        if budget[0] < 0 or depth > _DEPTH or id(item) in seen or isinstance(
                item, (str, bytes, int, float, complex, type, torch.nn.Module)):
            return False
        seen.add(id(item))
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif dataclasses.is_dataclass(item):
            children = [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif hasattr(item, "__dict__") and not callable(item):
            children = list(vars(item).values())
        else:
            return False
        return any(search(child, depth + 1) for child in children)

    return search(value, 0)


def _pytree_parts(value: object) -> list[tuple[str, object]] | None:
    from torch.utils import _pytree as pytree

    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        return None
    if node.flatten_with_keys_fn is not None:
        keyed, _ = node.flatten_with_keys_fn(value)
        return [(_key_suffix(key), child) for key, child in keyed]
    children, _ = node.flatten_fn(value)
    return [(f"[{i}]", child) for i, child in enumerate(children)]


def _key_suffix(key: object) -> str:
    from torch.utils import _pytree as pytree

    if isinstance(key, pytree.GetAttrKey):
        return f".{key.name}"
    if isinstance(key, pytree.MappingKey):
        return f"[{key.key!r}]"
    if isinstance(key, pytree.SequenceKey):
        return f"[{key.idx}]"
    return str(key)


def named_leaves(value: object, path: str = "out") -> Iterator[tuple[str, object]]:
    """Every tensor and Python float or complex number in an output, with its path as
    ``compare`` spells it (``out['logits']``, ``out.values``, ``out['cache'].layers[0].keys``);
    a nested tensor as its components (``out[0]``). Objects holding themselves are walked
    once."""
    yield from _leaves(value, path, set())


def _leaves(value: object, path: str, above: set[int]) -> Iterator[tuple[str, object]]:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            for i, component in enumerate(value.unbind()):
                yield f"{path}[{i}]", component
        else:
            yield path, value
        return
    if isinstance(value, bool) or value is None or isinstance(value, (int, str, bytes)):
        return
    if isinstance(value, (float, complex)):
        yield path, value
        return
    if id(value) in above:
        return
    above.add(id(value))
    try:
        if isinstance(value, Mapping):
            for key, item in value.items():
                yield from _leaves(item, indexed(path, key), above)
        elif isinstance(value, Sequence):
            names = tuple_fields(value) or field_names(value)
            for i, item in enumerate(value):
                sub = f"{path}.{names[i]}" if names is not None else f"{path}[{i}]"
                yield from _leaves(item, sub, above)
        else:
            found = parts(value)
            for suffix, item in found or ():
                yield from _leaves(item, path + suffix, above)
    finally:
        above.discard(id(value))

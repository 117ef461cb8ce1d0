"""Golden outputs on disk (``expected.safetensors``) for non-regression.

Outputs are nested values (tensors, numbers, None, strings, bytes, tuples,
named tuples, lists, sets, dicts). The tensors go into the payload under their
path (``out['logits']``); the nesting and the plain values go into the
payload's metadata as JSON, with each tensor replaced by a reference to its
path. Nothing goes through pickle.

A golden must read back as a value the comparison finds equal to the one
written, or every later run fails and asks for ``--gpu-cases-regen``, which
writes the same file again. So a named tuple keeps its class (found again by
module and name, never imported here), a dict key that JSON cannot spell (a
tuple) is stored as a value of its own, and what cannot come back equal (a NaN
key, a class defined inside a function, an object of no known kind) is refused
by ``save`` with its path and the reason, before anything is written.
"""

from __future__ import annotations

import collections
import json
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pytest_gpucase.base.errors import CaseFormatError, display
from pytest_gpucase.case import payload

__all__ = ["STRUCTURE_KEY", "Unstorable", "encode", "load", "save"]

STRUCTURE_KEY = "gpucase.structure"


class Unstorable(TypeError):
    """An output a golden file cannot hold so that it reads back equal (a TypeError, as
    before this class: callers that skip what cannot be stored catch either)."""


def save(path: Path, results: Mapping[str, Any]) -> None:
    """Write a run's results (``{"out": outputs, "grad": gradients}``) to ``path`` atomically.

    Raises ``Unstorable`` naming the output's path, and writes nothing, when a value
    could not read back equal.
    """
    tensors, metadata = _prepared(path, results)
    try:
        payload.save(path, tensors, metadata=metadata)
    except TypeError as exc:  # a dtype or kind of tensor payload refuses, with its reason
        raise Unstorable(f"{display(path)} not written: {exc}") from None


def encode(path: Path, results: Mapping[str, Any]) -> list[bytes | memoryview]:
    """The bytes ``save`` would write to ``path``, for a caller that writes them itself
    (the reference cache, which authenticates them); ``Unstorable`` as for ``save``."""
    tensors, metadata = _prepared(path, results)
    try:
        return payload.encode(tensors, metadata)
    except TypeError as exc:
        raise Unstorable(f"{display(path)} not written: {exc}") from None


def _prepared(path: Path, results: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    tensors: dict[str, Any] = {}
    try:
        structure = {key: _encode(value, key, tensors) for key, value in results.items()}
    except Unstorable as exc:
        raise Unstorable(f"{display(path)} not written: {exc}") from None
    return tensors, {STRUCTURE_KEY: json.dumps(structure)}


def load(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """Read the results written by ``save`` (``data``: the file's bytes, read already)."""
    _, metadata = payload.read_header(path, data)
    if STRUCTURE_KEY not in metadata:
        raise CaseFormatError(path, f"no '{STRUCTURE_KEY}' metadata; rewrite it with "
                              "pytest --gpu-cases --gpu-cases-regen")
    tensors = payload.load(path, data=data)
    try:
        structure = json.loads(metadata[STRUCTURE_KEY])
        if not isinstance(structure, dict):
            raise ValueError("the structure is not an object of outputs")
        return {key: _decode(node, tensors) for key, node in structure.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CaseFormatError(path, f"malformed '{STRUCTURE_KEY}' metadata ({exc!r}); rewrite it "
                              "with pytest --gpu-cases --gpu-cases-regen") from None


def _encode(value: Any, where: str, tensors: dict[str, Any]) -> Any:
    import torch

    from pytest_gpucase.base.tensors import (
        tuple_fields,  # what the comparison treats as a named tuple
    )

    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, where, tensors)
    if isinstance(value, Mapping):
        return {"dict": [[_encode_key(key, f"{where}: the dict key {key!r}"),
                          _encode(item, f"{where}[{key!r}]", tensors)]
                         for key, item in value.items()]}
    fields = tuple_fields(value)
    if fields is not None:
        return {"namedtuple": _encode_named_tuple(value, fields, where, tensors)}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(item, f"{where}[{i}]", tensors) for i, item in enumerate(value)]}
    if type(value) in (set, frozenset):  # compared with ==, which a subclass may redefine
        return {type(value).__name__: [_encode_key(item, f"{where}: the element {item!r}")
                                       for item in value]}
    return _encode_plain(value, where)


def _encode_tensor(value: Any, where: str, tensors: dict[str, Any]) -> dict[str, str]:
    import torch

    if value.is_nested or value.layout != torch.strided:
        raise Unstorable(f"{where}: a {str(value.layout).removeprefix('torch.')}"
                         f"{' nested' if value.is_nested else ''} tensor cannot be stored "
                         "in a golden; return its dense values or its list of tensors")
    if value.dtype in (torch.complex64, torch.complex128):
        # safetensors holds no complex dtype: its real and imaginary parts, last axis.
        tensors[where] = torch.view_as_real(value.detach().resolve_conj())
        return {"complex_tensor": where}
    tensors[where] = value.detach()
    return {"tensor": where}


def _encode_plain(value: Any, where: str) -> dict[str, Any]:
    """A value that holds no other: a number, a string, bytes, None, a dtype, a device."""
    import torch

    if type(value) is bytes:
        return {"bytes": value.hex()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # JSON has no nan/inf
    if isinstance(value, str) and type(value) is not str:
        raise Unstorable(f"{where}: a {type(value).__qualname__} string (a str subclass) "
                         "would read back as a plain str, which the comparison tells apart "
                         "from it; return str(value)")
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise Unstorable(f"{where}: a value of type {type(value).__qualname__} cannot be stored "
                     "in a golden (it holds tensors, numbers, None, strings, bytes, dtypes, "
                     "devices, and lists, tuples, named tuples, sets and dicts of them)")


def _encode_key(key: Any, what: str) -> Any:
    """A dict key or set element: as itself where JSON spells it (as goldens always
    stored keys), else as a node; refused unless it reads back equal."""
    if isinstance(key, (int, str)) or (isinstance(key, float) and math.isfinite(key)):
        return key
    held: dict[str, Any] = {}
    node = _encode(key, what, held)
    if held:
        raise Unstorable(f"{what} is or holds a tensor, hashed by identity: no key of another "
                         "run ever equals it; key by numbers or strings")
    if _decode_key(node) != key:
        raise Unstorable(f"{what} does not equal itself read back (a NaN never equals a "
                         "NaN), so no run could match the golden; use another key")
    return node


def _encode_named_tuple(value: tuple[Any, ...], fields: tuple[str, ...], where: str,
                        tensors: dict[str, Any]) -> dict[str, Any]:
    cls = type(value)
    if _named_tuple_class(cls.__module__, cls.__qualname__, fields) is not cls:
        raise Unstorable(
            f"{where}: the named tuple class {cls.__qualname__} cannot be found again as "
            f"{cls.__module__}.{cls.__qualname__} when the golden is read, and the comparison "
            "needs the very same class; define it at module level under its own name")
    return {"module": cls.__module__, "qualname": cls.__qualname__, "fields": list(fields),
            "items": [_encode(item, f"{where}.{field}", tensors)
                      for field, item in zip(fields, value, strict=True)]}


def _named_tuple_class(module: str, qualname: str, fields: tuple[str, ...]) -> type | None:
    """The class ``module.qualname`` if that module is imported (as the case's own code is,
    in the child that compares) and the class has these fields; nothing is imported."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        # The namespaces' own dicts only: getattr could run a module's __getattr__ (torch
        # imports submodules there) or a property, on the word of a file from anywhere.
        space = getattr(found, "__dict__", None) if found is not None else None
        found = space.get(part) if isinstance(space, Mapping) else None
    if (isinstance(found, type) and issubclass(found, tuple)
            and getattr(found, "_fields", None) == fields):
        return found
    return None


def _decode(node: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    if not isinstance(node, Mapping) or len(node) != 1:
        raise ValueError(f"a node is a one-key object, not {str(node)[:80]}")
    ((kind, body),) = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "complex_tensor":
        import torch

        return torch.view_as_complex(tensors[body].contiguous())
    if kind == "dict":
        return {_decode_key(key): _decode(item, tensors) for key, item in body}
    if kind in ("list", "tuple"):
        items = [_decode(item, tensors) for item in body]
        return items if kind == "list" else tuple(items)
    if kind == "namedtuple":
        return _decode_named_tuple(body, tensors)
    if kind in ("set", "frozenset"):
        return (set if kind == "set" else frozenset)(_decode_key(item) for item in body)
    leaf = _LEAVES.get(kind)
    if leaf is None:
        raise ValueError(f"unknown node kind {kind!r}")
    return leaf(body)


def _decode_named_tuple(body: Any, tensors: Mapping[str, Any]) -> Any:
    if not (isinstance(body, Mapping) and isinstance(body.get("module"), str)
            and isinstance(body.get("qualname"), str)
            and isinstance(body.get("fields"), list) and isinstance(body.get("items"), list)):
        raise ValueError("a named tuple node needs the strings module and qualname and "
                         "the lists fields and items")
    fields = tuple(str(field) for field in body["fields"])
    cls: Any = _named_tuple_class(body["module"], body["qualname"], fields)
    if cls is None:
        # Not loaded, or its fields changed: a stand-in of the same name and fields,
        # whose name says so where the comparison reports the type.
        name = body["qualname"].rpartition(".")[2]
        make: Any = collections.namedtuple  # a name known only at run time
        cls = make(name if name.isidentifier() else "NamedTuple", fields, rename=True,
                   module=body["module"])
        cls.__qualname__ = f"{body['module']}.{body['qualname']} (as the golden recorded it)"
    return cls(*(_decode(item, tensors) for item in body["items"]))


def _dtype_of(body: Any) -> Any:
    import torch

    dtype = vars(torch).get(str(body))  # never torch's __getattr__: it imports
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{body!r} is no torch dtype")
    return dtype


def _device_of(body: Any) -> Any:
    import torch

    try:
        return torch.device(str(body))
    except RuntimeError as exc:  # "Invalid device string": the file is malformed
        raise ValueError(f"{body!r} is no torch device: {exc}") from None


# The nodes that hold one plain value, by kind: how each reads back.
_LEAVES: Mapping[str, Callable[[Any], Any]] = {
    "bytes": bytes.fromhex,
    "float": float,
    "complex": lambda body: complex(*body),
    "value": lambda body: body,
    "dtype": _dtype_of,
    "device": _device_of,
}


def _decode_key(key: Any) -> Any:
    return _decode(key, {}) if isinstance(key, Mapping) else key

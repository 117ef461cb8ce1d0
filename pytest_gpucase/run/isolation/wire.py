"""The wire format: what a child sends its parent on the result pipe, and how it is read.

Phase notes first (``note`` writes them in the child), then one JSON envelope: the value as
data (``encode``, in the child) or the error, and the warnings. The parent reads it
(``_read_result``, ``decode``) trusting nothing: only known tags, and dataclasses registered
with ``base.results.result_type`` rebuilt field by field, each checked against its annotation:
the modules that define what a child returns register it, and this one names no class of theirs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pytest_gpucase.base.results import registered, registered_fields, result_types
from pytest_gpucase.run.isolation.clipping import clip
from pytest_gpucase.run.isolation.result import ChildWarning

__all__ = ["MAX_WARNINGS", "NOTE_LIMIT", "BadResult", "decode", "encode"]

MAX_WARNINGS = 20  # distinct warnings returned by a child; the rest are counted
_FORMAT = 1
_NOTE = b"\x1e"  # begins a note line on the result pipe; the JSON envelope holds no newline
NOTE_LIMIT = 1000  # bytes of one note: below PIPE_BUF, so that a note is written whole


def _split_notes(raw: bytes) -> tuple[str | None, bytes]:
    """(the last note, the result envelope) of what a child wrote to its result pipe."""
    notes, newline, envelope = raw.rpartition(b"\n")
    if not newline:
        return None, raw
    last = notes.rpartition(b"\n")[2]
    phase = last[len(_NOTE):].decode(errors="replace") if last.startswith(_NOTE) else None
    return (clip(phase, 200, 300) if phase else None), envelope


def encode(value: Any) -> Any:
    """``value`` as JSON data: NaN, infinities, tuples, dicts and allowed dataclasses tagged."""
    if value is None or isinstance(value, (bool, str)):
        return clip(value) if isinstance(value, str) else value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$": "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$": "tuple", "items": [encode(item) for item in value]}
    if type(value) is dict:  # most dicts: no question to the Mapping ABC
        return _encoded_dict(value)
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    # A registered dataclass before the Mapping ABC: ``isinstance(outcome, Mapping)`` was
    # never asked in the parent, so a forked child asked it anew every time, walking every
    # subclass of Mapping loaded (0.3 ms and 100 page faults of a trivial run's child).
    fields = registered_fields(name, kind)
    if fields is not None:
        return {"$": "dataclass", "type": name,
                "fields": {field: encode(getattr(value, field)) for field in fields}}
    if isinstance(value, Mapping):
        return _encoded_dict(value)
    raise TypeError(f"a {name} cannot be returned from a child: return plain data (None, bool, "
                    "int, float, str, list, tuple, dict) or one of " + ", ".join(
                        result_types()))


def _encoded_dict(value: Mapping[Any, Any]) -> dict[str, Any]:
    return {"$": "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}


class BadResult(ValueError):
    """A child's result that is not what ``encode`` writes."""


def decode(data: Any, depth: int = 0) -> Any:
    """The value ``encode`` wrote, checked: only known tags, allowed and well-typed dataclasses."""
    if depth > 100:
        raise BadResult("nested more than 100 levels deep")
    if data is None or isinstance(data, (bool, int, float)):
        return data
    if isinstance(data, str):
        return clip(data)
    if isinstance(data, list):
        return [decode(item, depth + 1) for item in data]
    if not isinstance(data, dict):
        raise BadResult(f"unexpected {type(data).__name__}")
    return _tagged(data, depth)


def _tagged(data: dict[str, Any], depth: int) -> Any:
    """A tagged object ``encode`` wrote: a non-finite float, a tuple, a dict, a dataclass."""
    tag = data.get("$")
    if tag == "float" and data.get("value") in ("nan", "inf", "-inf"):
        return float(data["value"])
    if tag in ("tuple", "dict") and isinstance(data.get("items"), list):
        items = [decode(item, depth + 1) for item in data["items"]]
        return tuple(items) if tag == "tuple" else _dict_of(items)
    if tag == "dataclass" and isinstance(data.get("fields"), dict):
        return _rebuild(data.get("type"), data["fields"], depth)
    raise BadResult(f"unknown type tag {tag!r}" if tag is not None else "an untagged object")


def _dict_of(items: list[Any]) -> dict[Any, Any]:
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
        raise BadResult("a dict's items are not [key, value] pairs")
    try:
        return {key: value for key, value in items}  # the keys must hash
    except TypeError:
        raise BadResult("a dict has an unhashable key") from None


def _rebuild(name: Any, fields: dict[str, Any], depth: int) -> Any:
    cls = registered(name) if isinstance(name, str) else None
    if cls is None:
        raise BadResult(f"type {name!r} is not one a child may return")
    qualname = cls.__qualname__
    hints, wanted = _shape(name)
    if set(fields) != wanted:
        raise BadResult(f"{qualname} fields {sorted(fields)} are not {sorted(wanted)}")
    values = {key: decode(value, depth + 1) for key, value in fields.items()}
    for key, value in values.items():
        if not _conforms(value, hints[key]):
            raise BadResult(f"{qualname}.{key} is a {type(value).__name__}, not "
                            f"{getattr(hints[key], '__name__', hints[key])}")
    return cls(**values)


@functools.cache
def _shape(name: str) -> tuple[dict[str, Any], frozenset[str]]:
    """A registered dataclass's fields' annotations and the names ``__init__`` takes: read
    once a session (evaluating the annotations is most of what rebuilding one costs)."""
    cls = registered(name)
    assert cls is not None
    return (typing.get_type_hints(cls),
            frozenset(f.name for f in dataclasses.fields(cls) if f.init))


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded value fits an annotation (the shapes the allowed dataclasses use)."""
    try:
        origin, args = _hint_parts(hint)
    except TypeError:  # an annotation that does not hash: the same, uncached
        origin, args = _hint_parts.__wrapped__(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, tuple) and _items_conform(value, args)
    if origin in (dict, Mapping):
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if hint in (float, int):
        numbers = (int, float) if hint is float else (int,)
        return isinstance(value, numbers) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


@functools.cache
def _hint_parts(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """``typing.get_origin`` and ``get_args`` of an annotation, once a session (the pytest
    process decodes every run's outcome: each field's annotation, every time)."""
    return typing.get_origin(hint), typing.get_args(hint)


def _items_conform(value: tuple[Any, ...], args: tuple[Any, ...]) -> bool:
    """A tuple against ``tuple[X, ...]`` or ``tuple[X, Y]``."""
    if len(args) == 2 and args[1] is Ellipsis:
        return all(_conforms(item, args[0]) for item in value)
    return len(args) == len(value) and all(map(_conforms, value, args))


def _read_result(raw: bytes, parsed: dict[str, Any] | None = None,
                 ) -> tuple[Any, bool, str | None, tuple[ChildWarning, ...], int]:
    """(value, returned, child_error, warnings, warnings dropped) of the child's envelope
    (``parsed``: its JSON, read already by ``_flags``)."""
    try:
        envelope = json.loads(raw) if parsed is None else parsed
    except (ValueError, RecursionError) as exc:
        raise BadResult(f"not JSON ({str(exc)[:200]})") from None
    if not isinstance(envelope, dict) or envelope.get("format") != _FORMAT:
        raise BadResult("not a result envelope of this version")
    found, dropped = _read_warnings(envelope.get("warnings"))
    if envelope.get("kind") == "value" and "value" in envelope:
        return decode(envelope["value"]), True, None, found, dropped
    if envelope.get("kind") == "error" and isinstance(envelope.get("error"), str):
        return None, False, clip(envelope["error"]), found, dropped
    raise BadResult("neither a value nor an error")


def _read_warnings(data: Any) -> tuple[tuple[ChildWarning, ...], int]:
    if data is None:
        return (), 0
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise BadResult("no list of warnings")
    found = []
    for item in data["items"][:MAX_WARNINGS]:
        try:
            warning = ChildWarning(**item)
        except TypeError:
            raise BadResult(f"a malformed warning {str(item)[:200]}") from None
        if not (isinstance(warning.category, str) and isinstance(warning.message, str)
                and isinstance(warning.filename, str) and type(warning.lineno) is int
                and type(warning.count) is int):
            raise BadResult(f"a malformed warning {str(item)[:200]}")
        found.append(dataclasses.replace(
            warning, category=warning.category[:200], message=clip(warning.message, 512, 1488),
            filename=warning.filename[-500:]))
    dropped = data.get("dropped", 0)
    extra = len(data["items"]) - len(found)
    return tuple(found), (dropped if type(dropped) is int else 0) + extra


def _flags(raw: bytearray) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The flags of a complete result: ``alone`` (the child left no living descendant, see
    ``child._end_descendants``), ``retire`` (a worker that ends after it) and ``device`` (the
    child holds a device context: its exit is slow); {} when unreadable, and then the parent
    searches and kills as usual. With the envelope's JSON, for ``_read_result`` (None when
    it is not a JSON object)."""
    if not raw.endswith(b"}"):
        return {}, None
    try:
        envelope = json.loads(_split_notes(bytes(raw))[1])
    except (ValueError, RecursionError):
        return {}, None
    if not isinstance(envelope, dict):
        return {}, None
    return {key: envelope.get(key) for key in ("alone", "retire", "device")}, envelope

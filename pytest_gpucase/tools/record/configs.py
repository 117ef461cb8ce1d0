"""A rebuild's constructor arguments as plain data: numbers, text, lists, dicts, None, and
the config objects models are built from, each kind read by a reader of its own.

A config object (nanoGPT's ``GPT(GPTConfig(...))``, a ``SimpleNamespace`` or argparse
``Namespace``, a named tuple, a pydantic model, a Hugging Face ``PretrainedConfig``) is kept
as its kind, its importable class and its fields, ``{CONFIG_KEY: kind, "class":
"pkg.mod:Config", "fields": {...}}``, which ``run.replay.decode_configs`` builds again
(``CONFIG_KINDS``, the one table of how each kind is built). A typed dict is a dict. A field
that is no plain data (a tensor, a function, another object) makes the rebuild impossible,
and the reason names the field (``config.act is a function``). An enum member and a torch
dtype, which config fields often hold, are kept the same way (by name).

Also where a replay finds a class again: an import, or the script that was run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import json
import math
import os
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpucase.base.tensors import is_tensor
from pytest_gpucase.tools.record.inputs import NOT_LITERAL
from pytest_gpucase.tools.record.origin import error_line, import_name

__all__ = ["FIX", "Plain", "class_target", "config_kind", "holds_config", "plain"]

FIX = ("pass rec.watch(model, factory=\"package.module:make_model\", kwargs={...}) naming a "
       "function that builds it")


def _hf_config(value: Any) -> bool:
    return any(cls.__name__ in ("PretrainedConfig", "PreTrainedConfig")
               and cls.__module__.split(".")[0] == "transformers"
               for cls in type(value).__mro__)


def _pydantic(value: Any) -> bool:
    return not isinstance(value, type) and callable(getattr(value, "model_dump", None))


def _dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and callable(getattr(value, "_asdict", None))


def _namespace(value: Any) -> bool:
    return isinstance(value, types.SimpleNamespace | argparse.Namespace)


def _enum(value: Any) -> bool:
    return isinstance(value, enum.Enum)


def _dtype(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def _dataclass_fields(value: Any) -> Mapping[str, Any]:
    # Fields the constructor takes: init=False ones are computed again by it.
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


# kind -> (whether a value is one, its fields): the readers, most specific first (a pydantic
# dataclass is read as pydantic). ``run.replay.CONFIG_KINDS`` builds each kind again.
_READERS: tuple[tuple[str, Callable[[Any], bool], Callable[[Any], Mapping[str, Any]]], ...] = (
    ("hf_config", _hf_config, lambda v: json.loads(v.to_json_string(use_diff=False))),
    ("pydantic", _pydantic, lambda v: v.model_dump()),
    ("dataclass", _dataclass, _dataclass_fields),
    ("namedtuple", _namedtuple, lambda v: v._asdict()),
    ("namespace", _namespace, vars),
    # Not config objects, but what their fields often hold (an activation, a dtype).
    ("enum", _enum, lambda v: {"name": v.name}),
    ("dtype", _dtype, lambda v: {"name": str(v).removeprefix("torch.")}),
)


def config_kind(value: Any) -> str | None:
    """The kind of config object ``value`` is (a key of ``run.replay.CONFIG_KINDS``), or None."""
    for kind, matches, _ in _READERS:
        try:
            if matches(value):
                return kind
        except Exception:
            continue
    return None


@dataclass
class Plain:
    """What reading arguments as plain data found besides the data: the scripts (run as
    ``__main__``) whose classes the data names, which a replay must load."""

    scripts: set[str] = field(default_factory=set)


def _what(value: Any) -> str:
    """What a value that is no plain data is, in words."""
    if is_tensor(value):
        return "a tensor"
    if isinstance(value, type):
        return f"a class ({value.__qualname__})"
    if isinstance(value, float):
        return f"{value}, which JSON does not hold"
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"a function or callable ({name})"
    return f"a {type(value).__qualname__} object"


def plain(value: Any, path: str, found: Plain) -> tuple[Any, str]:
    """``value`` as JSON data (config objects as ``{CONFIG_KEY: kind, ...}``), or
    ``(NOT_LITERAL, why)`` naming the first field at ``path`` (``config.act``) that is none."""
    if value is None or isinstance(value, bool | str):
        return value, ""
    if isinstance(value, int):
        return int(value), ""
    if isinstance(value, float):
        return (float(value), "") if math.isfinite(value) else (
            NOT_LITERAL, f"{path} is {_what(value)}")  # JSON has no inf or nan
    kind = config_kind(value)
    if kind is not None:
        return _config(value, kind, path, found)
    if isinstance(value, list | tuple):
        items = []
        for i, item in enumerate(value):
            data, why = plain(item, f"{path}[{i}]", found)
            if why:
                return NOT_LITERAL, why
            items.append(data)
        return items, ""
    if isinstance(value, Mapping):
        return _table(value, path, found)
    return NOT_LITERAL, f"{path} is {_what(value)}, {_NOT_PLAIN}"


_NOT_PLAIN = ("no plain data (numbers, text, lists, dicts, None, config objects of these) "
              "that a case can hold")


def _table(value: Mapping[Any, Any], path: str, found: Plain) -> tuple[Any, str]:
    table: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            return NOT_LITERAL, (f"{path} has the key {key!r}, not text, which JSON does not "
                                 "hold as it is")
        data, why = plain(item, f"{path}.{key}", found)
        if why:
            return NOT_LITERAL, why
        table[key] = data
    return table, ""


def _config(value: Any, kind: str, path: str, found: Plain) -> tuple[Any, str]:
    """A config object as its kind, class and fields (see the module's docstring)."""
    from pytest_gpucase.run.replay import CONFIG_KEY

    cls = type(value)
    target, script, why = class_target(cls)
    if target is None:
        return NOT_LITERAL, (f"{path} is a {cls.__qualname__}, which a replay cannot build "
                             f"again: {why.removesuffix(': ' + FIX)}")
    reader = next(read for name, _, read in _READERS if name == kind)
    try:
        fields = reader(value)
    except Exception as exc:
        return NOT_LITERAL, (f"{path} is a {cls.__qualname__} whose fields cannot be read "
                             f"({error_line(exc)})")
    data, why = _table(fields, path, found)
    if why:
        return NOT_LITERAL, why
    if script is not None:
        found.scripts.add(script)
    return {CONFIG_KEY: kind, "class": target, "fields": data}, ""


def holds_config(value: Any) -> bool:
    """Whether JSON data ``plain`` gave holds a config object (a ``case.py`` builds it)."""
    from pytest_gpucase.run.replay import CONFIG_KEY

    if isinstance(value, list):
        return any(map(holds_config, value))
    if isinstance(value, Mapping):
        return CONFIG_KEY in value or any(map(holds_config, value.values()))
    return False


def _script_of(cls: type) -> tuple[str | None, str]:
    """The script (run as ``__main__``) whose top level defines ``cls``, or why not."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or not os.path.isfile(script):
        return None, (f"{cls.__qualname__} is defined in __main__ with no script file (an "
                      f"interactive session or python -c): {FIX}")
    if "." in cls.__qualname__:
        return None, (f"{cls.__qualname__} is not at the top level of {Path(script).name}, "
                      f"so a replay cannot find it there: {FIX}")
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as exc:
        return None, f"{Path(script).name} cannot be read again ({error_line(exc)}): {FIX}"
    if not any(isinstance(node, ast.ClassDef) and node.name == cls.__name__
               for node in tree.body):
        return None, (f"{cls.__qualname__} is not defined at the top level of "
                      f"{Path(script).name}: {FIX}")
    return str(Path(script).resolve()), ""


def class_target(cls: type) -> tuple[str | None, str | None, str]:
    """(import target, script, why not) of a class a replay builds: ``"pkg.mod:Qual"``, or
    ``"Qual"`` of the script that was run."""
    if cls.__module__ == "__main__":
        script, why = _script_of(cls)
        return (cls.__qualname__, script, why) if script else (None, None, why)
    target, why_not = import_name(cls, cls.__qualname__)
    if target is None:
        return None, None, (f"{cls.__qualname__} cannot be rebuilt by a replay "
                            f"({why_not.split(';')[0]}): {FIX}")
    return target, None, ""

"""The vocabulary of generated calls: names a case written by the Recorder uses in its
``case.toml`` and payload, read by the child that replays it and by the variants.

Saved cases name ``REPLAY_MODULE`` and ``REPLAY_OP`` in their ``call``: those strings
never change (``pytest_gpucase.capture`` stays importable for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CODE_OWNED",
    "DICT_PREFIX",
    "FUNCTION_KEY",
    "GRAD_PREFIX",
    "LOSS_PREFIX",
    "MODULE_KEY",
    "NESTED_PREFIX",
    "OP_KEY",
    "REPLAY_ENV",
    "REPLAY_FUNCTION",
    "REPLAY_MODULE",
    "REPLAY_OP",
    "RNG_NAMES",
    "STATE_PREFIX",
    "TENSORS_KEY",
    "argument_path",
    "checkpoint_path",
    "tensor_dicts",
]

# Set in a replay's child so that a watched function imported there records nothing.
REPLAY_ENV = "GPUCASE_REPLAY"
# The generated calls of module and op cases, and the [inputs] tables they read.
REPLAY_MODULE = "pytest_gpucase.capture:replay_module"
REPLAY_OP = "pytest_gpucase.capture:replay_op"
REPLAY_FUNCTION = "pytest_gpucase.capture:replay_function"
MODULE_KEY = "gpucase_module"
OP_KEY = "gpucase_op"
FUNCTION_KEY = "gpucase_function"
STATE_PREFIX = "state."
# [inputs.gpucase_module] code_owned: the state entries (names without STATE_PREFIX) that
# held the constructor's own value when recorded; a replay takes them from the model its code
# builds then, not from the payload (docs/case-format.md, "State the code owns").
CODE_OWNED = "code_owned"
GRAD_PREFIX = "grad_output."
# A backward case's loss function inputs besides the module's output (docs/case-format.md).
LOSS_PREFIX = "loss."
# Tensors of an argument nesting them in lists, tuples and dicts (a batch (x, y)), which the
# module's or function's table rebuilds (docs/case-format.md).
NESTED_PREFIX = "nested."
# A dict-of-tensors argument: [inputs] <arg> = { gpucase_tensors = { <key> = "dict.<arg>.<key>" } },
# each tensor saved under that payload name (docs/case-format.md, "Dicts of tensors").
TENSORS_KEY = "gpucase_tensors"
DICT_PREFIX = "dict."
RNG_NAMES = {"cpu": "context.rng_cpu", "cuda": "context.rng_cuda"}


def tensor_dicts(literals: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[inputs]`` entries that stand for a dict of tensors: name -> its
    ``gpucase_tensors`` table (dict key -> payload name), as written by capture."""
    return {name: value[TENSORS_KEY] for name, value in literals.items()
            if isinstance(value, Mapping) and TENSORS_KEY in value}


def argument_path(literals: Mapping[str, Any], name: str) -> tuple[str, tuple[str, ...]] | None:
    """Where the payload tensor ``name`` sits in the call's arguments as the user passed
    them: the argument and the key path inside it (``("batch", ("targets",))`` for
    ``dict.batch.targets`` or ``nested.batch.targets``, ``("batch", ("1",))`` for the second
    item of a tuple batch), read from the ``gpucase_tensors`` and ``nested`` tables that
    name it; None when no table does (a tensor passed as the argument itself)."""
    for arg, table in tensor_dicts(literals).items():
        for key, payload_name in dict(table).items():
            if payload_name == name:
                return str(arg), (str(key),)
    for recipe_key in (MODULE_KEY, FUNCTION_KEY):
        recipe = literals.get(recipe_key)
        nested = recipe.get("nested") if isinstance(recipe, Mapping) else None
        for arg, spec in (nested.items() if isinstance(nested, Mapping) else ()):
            found = _path_in(spec, name, 0)
            if found is not None:
                return str(arg), found
    return None


def _path_in(spec: Any, name: str, depth: int) -> tuple[str, ...] | None:
    """The key path to ``{tensor = name}`` in a ``nested`` spec (``record.inputs``)."""
    if not isinstance(spec, Mapping) or depth > 32:
        return None
    if spec.get("tensor") == name:
        return ()
    items: list[tuple[str, Any]] = []
    for kind in ("tuple", "list"):
        if isinstance(spec.get(kind), list):
            items = [(str(i), item) for i, item in enumerate(spec[kind])]
    if isinstance(spec.get("dict"), Mapping):
        items = [(str(k), v) for k, v in spec["dict"].items()]
    for key, item in items:
        found = _path_in(item, name, depth + 1)
        if found is not None:
            return (key, *found)
    return None


def checkpoint_path(case_dir: Path, reference: Mapping[str, Any]) -> Path:
    """The file a model case's ``[inputs.gpucase_module] checkpoint`` names: its ``path`` is
    relative to the case directory (the Recorder writes it so; docs/case-format.md), and an
    absolute one, written by an earlier version, is taken as it is."""
    return case_dir / str(reference.get("path", ""))

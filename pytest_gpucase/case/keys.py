"""The vocabulary of generated calls: names a case written by the Recorder uses in its
``case.toml`` and payload, read by the child that replays it and by the variants.

Saved cases name ``REPLAY_MODULE`` and ``REPLAY_OP`` in their ``call``: those strings
never change (``pytest_gpucase.capture`` stays importable for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DICT_PREFIX", "GRAD_PREFIX", "MODULE_KEY", "OP_KEY", "REPLAY_ENV", "REPLAY_MODULE",
           "REPLAY_OP", "RNG_NAMES", "STATE_PREFIX", "TENSORS_KEY", "tensor_dicts"]

# Set in a replay's child so that a watched function imported there records nothing.
REPLAY_ENV = "GPUCASE_REPLAY"
# The generated calls of module and op cases, and the [inputs] tables they read.
REPLAY_MODULE = "pytest_gpucase.capture:replay_module"
REPLAY_OP = "pytest_gpucase.capture:replay_op"
MODULE_KEY = "gpucase_module"
OP_KEY = "gpucase_op"
STATE_PREFIX = "state."
GRAD_PREFIX = "grad_output."
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

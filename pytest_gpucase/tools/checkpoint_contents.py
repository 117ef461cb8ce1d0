"""What a checkpoint holds beside its weights (the optimizer's state, the step count),
which of a model's names are tied aliases of one storage, and how many of a file's problems
``gpucase checkpoint`` lists: the words of ``tools.checkpoint``'s table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["SHOWN_PROBLEMS", "STATE_DICT_KEYS", "find_state_dict", "further_problems", "holds",
           "tied_aliases"]

# Where common trainers nest the model's state dict: plain scripts ("model",
# "model_state_dict"), Lightning ("state_dict"), DeepSpeed ("module").
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "module")

# Where trainers keep the optimizer's state (plain scripts, Lightning) and the step count.
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_states", "optim", "opt")
_STEP_KEYS = ("iter_num", "global_step", "step", "iteration", "epoch")


def holds(loaded: object) -> str:
    """What a restart from ``loaded`` gets back, in words: ``weights only``, or the weights
    and the optimizer's state and step count kept beside them."""
    found = find_state_dict(loaded)
    if not isinstance(loaded, Mapping) or found is None:
        return "no model state dict"
    if found[0] == "at top level":
        return "weights only"
    parts = ["weights"]
    if any(isinstance(loaded.get(key), (Mapping, list)) and loaded.get(key)
           for key in _OPTIMIZER_KEYS):
        parts.append("optimizer")
    for key in _STEP_KEYS:
        value = loaded.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{key} {value}")
            break
    return "weights only" if len(parts) == 1 else " + ".join(parts)


def tied_aliases(expected: Mapping[str, object]) -> dict[str, set[str]]:
    """Each name of ``expected`` that shares its storage with others (tied weights), with
    those others: the groups ``safetensors.torch`` saves once and ``load_model`` restores
    (same device, storage pointer and size; meta tensors share nothing)."""
    groups: dict[tuple[str, int, int], set[str]] = {}
    for name, value in expected.items():
        if not isinstance(value, torch.Tensor) or value.is_meta or value.layout != torch.strided:
            continue
        storage = value.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            continue
        groups.setdefault((str(value.device), storage.data_ptr(), storage.nbytes()),
                          set()).add(str(name))
    return {name: group - {name} for group in groups.values() if len(group) > 1
            for name in group}


# A file's problems listed below its first, unless ``--all-problems``.
SHOWN_PROBLEMS = 4


def further_problems(problems: Sequence[str], all_problems: bool) -> tuple[str, ...]:
    """A file's problems after its first, as the lines below its row."""
    if all_problems or len(problems) <= SHOWN_PROBLEMS + 1:
        return tuple(problems)
    hidden = len(problems) - SHOWN_PROBLEMS
    return (*problems[:SHOWN_PROBLEMS],
            f"... and {hidden} more problems (--all-problems lists them)")


def find_state_dict(loaded: object) -> tuple[str, str, Mapping[str, object]] | None:
    """Return (layout, name prefix, state dict) for the common checkpoint layouts."""
    if not isinstance(loaded, Mapping):
        return None
    values = list(loaded.values())
    if any(isinstance(v, torch.Tensor) for v in values) and not any(
        isinstance(v, Mapping) for v in values
    ):
        return "at top level", "", loaded
    for key in STATE_DICT_KEYS:
        nested = loaded.get(key)
        if isinstance(nested, Mapping):
            return f"under {key!r}", f"{key}.", nested
    return None

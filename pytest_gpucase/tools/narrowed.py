"""The lifecycle of narrowed cases: what they are, which case they were narrowed from, and
when to delete them.

The Recorder writes a model case's narrowed cases beside it (``gpt.transformer.wte``,
``gpt.aten.embedding.default``; ``tools.record.narrow``), each replaying the submodule or
the op with the inputs the failure gave it, its parent named by ``[origin] narrowed_from``
(the parent's folder name, beside it). Such a case reproduces the op's failure on those
inputs: when the bug is in the calling code (a batch the model built wrong, the data), its
fix changes what the op is given, not the saved inputs, so the narrowed case fails on for
ever. It passes only if the op or submodule itself is changed to accept or reject them
differently. Its xfail line says so (``narrowed_xfail``); ``gpucase show`` names its parent
(``parent_lines``); when the parent passes (a strict XPASS), its item names the narrowed
cases to delete with its xfail line (``narrowed_note``), and ``gpucase narrowed CASE
--delete`` deletes them.
"""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_gpucase.base.errors import display
from pytest_gpucase.base.files import read_regular
from pytest_gpucase.case.model import CASE_FILE, MAX_CASE_BYTES, Case

__all__ = ["NARROWED_FROM", "delete_narrowed", "narrowed_cases", "narrowed_note",
           "narrowed_xfail", "parent_lines"]

# The [origin] key of a narrowed case that names its parent's folder (beside it).
NARROWED_FROM = "narrowed_from"


def narrowed_xfail(error: str, parent: str, what: str) -> str:
    """The xfail line of a case narrowed from ``parent`` to ``what`` (``op aten.add.Tensor``,
    ``module transformer.wte``), whose failure is ``error``."""
    return (f"narrowed from {parent}: {what} fails on the inputs the failure of {parent} "
            f"gave it ({error}); a fix in the calling code does not change these saved "
            f"inputs, so this passes only if {what} itself (its code, or what it is built "
            "from) is changed to accept or reject them differently; delete this case with "
            f"the xfail line of {parent} once {parent} passes")


def narrowed_cases(case_dir: Path) -> list[Path]:
    """The cases beside ``case_dir`` whose ``[origin] narrowed_from`` names it, by name.

    A case.toml that cannot be read is passed over: it is no narrowed case anyone can
    tell, and its own run says what is wrong with it."""
    case_dir = Path(case_dir)
    name = case_dir.name
    try:
        siblings = sorted(case_dir.parent.iterdir())
    except OSError:
        return []
    found = []
    for sibling in siblings:
        if sibling.name == name or sibling.name.startswith(".") or not sibling.is_dir():
            continue
        origin = _origin(sibling / CASE_FILE)
        if origin.get(NARROWED_FROM) == name:
            found.append(sibling)
    return found


def _origin(file: Path) -> Mapping[str, Any]:
    try:
        doc = tomllib.loads(read_regular(file, MAX_CASE_BYTES).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    origin = doc.get("origin")
    return origin if isinstance(origin, dict) else {}


def narrowed_note(case_dir: Path) -> str | None:
    """What the item of a passing parent says of its narrowed cases; None if it has none."""
    found = narrowed_cases(case_dir)
    if not found:
        return None
    names = ", ".join(display(path) for path in found)
    return (f"{display(case_dir)} passes: its narrowed cases ({names}) replay a submodule or "
            "an op on the inputs its failure gave them, which a fix outside them does not "
            "change: delete them with its xfail line: gpucase narrowed "
            f"{display(case_dir)} --delete")


def delete_narrowed(case_dir: Path) -> list[Path]:
    """Delete the narrowed cases of ``case_dir``; the ones deleted. Their store files
    (shared tensors) stay until ``gpucase store --prune``."""
    found = narrowed_cases(case_dir)
    for path in found:
        shutil.rmtree(path)
    return found


def parent_lines(case: Case) -> list[str]:
    """``gpucase show``'s lines of a narrowed case (its parent and what it is), or of a case
    narrowed from (its narrowed cases, to delete with its xfail line once it passes)."""
    parent = case.origin.get(NARROWED_FROM)
    if not isinstance(parent, str) or not parent:
        found = narrowed_cases(case.path) if case.origin else []
        if not found:
            return []
        return [f"narrowed: to {', '.join(path.name for path in found)} beside it; once it "
                "passes, delete them with its xfail line (gpucase narrowed "
                f"{display(case.path)} --delete)"]
    where = case.path.parent / parent
    state = "" if (where / CASE_FILE).is_file() else " (not found beside it)"
    return [f"narrowed: from {display(where)}{state}: replays a submodule or an op on the "
            f"inputs {parent}'s failure gave it; delete it with {parent}'s xfail line once "
            f"{parent} passes (gpucase narrowed {display(where)} --delete)"]

"""Writing a minimized case (``gpucase minimize``): its ``case.toml`` with the
``[origin.minimized_from]`` record and the kept entries' ``[origin] sample_ids``, its payload
and support files, as a new directory written atomically (``case.write.write_case_dir``).

``case.toml``: the original text is copied verbatim (comments and layout kept), the ids'
line replaced, and the new table appended with a dotted header written by ``tomli_w``; the
result is parsed back and compared with the intended document. When that cannot hold
(``origin`` written inline or as dotted keys, or a case that was minimized before), the whole
document is written by ``tomli_w``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from pytest_gpucase.base.errors import display
from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case, read_case_file
from pytest_gpucase.case.model import CASE_FILE, EXPECTED_FILE, INPUTS_FILE, MAX_CASE_BYTES, Case
from pytest_gpucase.case.write import write_case_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

__all__ = ["UNCHANGED", "free_path", "origin_path", "support_files", "with_minimized_from",
           "write_case"]


def free_path(base: Path) -> Path:
    """``base``, or ``base2``, ``base3``… when taken: a derived case never overwrites one."""
    candidate, number = base, 1
    while candidate.exists():
        number += 1
        candidate = base.with_name(f"{base.name}{number}")
    return candidate


def origin_path(original: Path, target: Path) -> str:
    """The original seen from the new case, relative to it whatever the working directory:
    a case holds no absolute path, so it moves with its project and names no one's home."""
    return Path(os.path.relpath(os.path.abspath(original), os.path.abspath(target))).as_posix()


UNCHANGED: Any = object()


# --- writing the new case --------------------------------------------------------------------

_NOT_COPIED = {CASE_FILE, INPUTS_FILE, EXPECTED_FILE, "__pycache__"}


def support_files(source: Path) -> list[Path]:
    """A case directory's other files (case.py, helpers); payloads and case.toml are written.

    ``expected.safetensors`` is left out: its golden outputs belong to the full batch.
    """
    return [entry for entry in source.iterdir() if entry.name not in _NOT_COPIED]


def write_case(case: Case, target: Path, tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str], record: Mapping[str, Any], *,
               sample_ids: Any = UNCHANGED) -> Path:
    """Write a new case directory at ``target`` atomically; never overwrite one.
    ``sample_ids``: the new ``[origin] sample_ids`` (None: none), else the original's."""
    if target.exists():
        raise FileExistsError(f"{display(target)} exists; minimize never overwrites")
    # Within its bound, as load_case read it: the file may have changed since.
    text = read_case_file(case.case_file, MAX_CASE_BYTES, "a case.toml holds settings, not "
                          "data", case.path).decode("utf-8", "replace")
    try:
        return write_case_dir(
            target, with_minimized_from(text, record, sample_ids=sample_ids),
            {INPUTS_FILE: lambda path: payload.save(path, tensors, metadata)},
            support_files(case.path), check=load_case)  # the new case must load as any other
    except FileExistsError:
        raise FileExistsError(f"{display(target)} appeared meanwhile; not overwritten") from None


# --- TOML writing ----------------------------------------------------------------------------

def with_minimized_from(text: str, record: Mapping[str, Any], *,
                        sample_ids: Any = UNCHANGED) -> str:
    """``case.toml`` text with ``[origin.minimized_from]`` set to ``record`` (and ``[origin]
    sample_ids`` to ``sample_ids``, or removed for None, unless ``UNCHANGED``).

    The text is kept verbatim and the table appended; when that does not parse to
    the intended document (the ids' line is replaced where it is one line), the
    document is written whole. A ``minimized_from`` already there is kept under ``previous``.
    """
    doc = tomllib.loads(text)
    origin = dict(doc.get("origin", {}))
    if sample_ids is not UNCHANGED:
        origin.pop("sample_ids", None)
        if sample_ids is not None:
            origin["sample_ids"] = list(sample_ids)
        text = _ids_line_replaced(text, sample_ids)
    table = dict(record)
    if "minimized_from" in origin:
        table["previous"] = origin["minimized_from"]
    origin["minimized_from"] = table
    wanted = {**doc, "origin": origin}
    appended = (text.rstrip("\n") + "\n\n# written by gpucase minimize\n"
                + tomli_w.dumps({"origin": {"minimized_from": table}}))
    try:
        if tomllib.loads(appended) == wanted:
            return appended
    except tomllib.TOMLDecodeError:
        pass
    return tomli_w.dumps(wanted)


def _ids_line_replaced(text: str, sample_ids: Sequence[object] | None) -> str:
    """``text`` with its one ``sample_ids = [...]`` line under ``[origin]`` set to
    ``sample_ids`` (dropped for None), other lines verbatim; unchanged when there is no such
    line (the caller checks the result parses to the intended document)."""
    lines, section = text.splitlines(keepends=True), None
    for number, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
        elif section == "[origin]" and stripped.startswith("sample_ids") and \
                stripped.partition("=")[0].strip() == "sample_ids":
            new = ("" if sample_ids is None else
                   tomli_w.dumps({"sample_ids": list(sample_ids)}).strip() + "\n")
            return "".join([*lines[:number], new, *lines[number + 1:]])
    return text

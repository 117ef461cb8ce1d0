"""Read cases without running them: ``show`` one, write a sanitized analysis ``request``, and
``validate`` case directories.

Nothing here imports torch but the reading of an index error's offending value
(``tools.offending``): a payload is otherwise read from its header only.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.base.text import markdown_code, terminal_safe
from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.model import INPUTS_FILE, Case
from pytest_gpucase.report.file import load_report
from pytest_gpucase.tools.narrowed import parent_lines
from pytest_gpucase.tools.offending import item_notes
from pytest_gpucase.tools.scrub import Scrubber, remove_secrets
from pytest_gpucase.tools.validate import hash_setting
from pytest_gpucase.verdict.triage import assertion_line, triage

__all__ = ["request", "show"]

_ORIGIN_VERSIONS = ("python", "torch", "cuda", "hip")
# [origin] keys that request() shows in their own place; any other key is listed as context.
_SHOWN_ORIGIN = ("error", "stderr", "backend", "device", "revision", "iteration", "stage",
                 "last_step", "sample_ids", "later_errors", "inputs", *_ORIGIN_VERSIONS)
_STDERR_LINES = 20


def show(case_dir: Path, report: Path | None = None) -> str:
    """The case at a glance: what it calls and expects, where it came from, its inputs.

    Everything it says comes from files anyone may have written: the text is made safe
    for a terminal (no escape sequence: a window title, a clipboard write, a screen
    clear), and secrets are removed by their shape (``scrub.remove_secrets``; paths and
    names stay, as this is for the person who has the case). A ``report`` is read as
    ``gpucase matrix`` reads one; ``ReportError`` when it cannot be.
    """
    case = load_case(Path(case_dir))
    lines = [f"{case.name}  ({case.path})"]
    if case.summary:
        lines.append(f"summary:   {case.summary}")
    lines.append(f"call:      {case.call}")
    lines.append(f"reference: {case.reference or 'the call itself, on CPU in float64'}")
    lines.append(f"expect:    {_expectation(case)}")
    if case.xfail:
        lines.append(f"xfail:     {case.xfail} (strict)")
    lines.append(f"timeout:   {case.timeout:g} s"
                 + (", launch blocking" if case.launch_blocking else ""))
    lines.extend(parent_lines(case))
    lines.extend(_origin_lines(case.origin))
    lines.extend(item_notes(case))   # an index error's offending value, and what to do
    lines.append("inputs:")
    lines.extend(f"  {line}" for line in _input_lines(case))
    if not case.literals and not case.inputs_file.exists():
        lines.append("  (none)")
    setting = hash_setting(case.path)
    if setting is not None:
        lines.append(f"hash:      {setting}")
    matrix = _matrix(case)
    if matrix:
        lines.append(f"matrix:    {matrix}")
    variants = _variants(case)
    if variants:
        lines.append(f"variants:  {variants}")
        lines.extend(f"  {line}" for line in _resized(case))
    if report is not None:
        lines.append(f"last verdicts ({report}):")
        lines.extend(f"  {line}" for line in _verdicts(Path(report), case))
    return remove_secrets(terminal_safe("\n".join(lines)))


def _origin_lines(origin: Mapping[str, Any]) -> list[str]:
    """The ``[origin]`` table as ``show`` lists it: the error first, versions and sample ids
    summed up, what the capture could not keep last."""
    if not origin:
        return []
    lines = ["origin:"]
    lines += [f"  {key}: {_one_line(origin[key])}" for key in ("error", "stderr") if key in origin]
    for label, text in (("where", _where(origin)), ("versions", _versions(origin))):
        if text:
            lines.append(f"  {label}: {text}")
    lines += [f"  {key}: {_one_line(origin[key])}"
              for key in ("revision", "snapshot", "later_errors", "captured") if key in origin]
    ids = origin.get("sample_ids")
    if isinstance(ids, list):
        shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
        lines.append(f"  sample_ids: {len(ids)} ({shown})")
    incomplete = origin.get("incomplete")
    if isinstance(incomplete, list):
        lines.extend(f"  incomplete: {item}" for item in incomplete)
    return lines


def request(case_dir: Path) -> str:
    """A ready-to-paste Markdown request for analysis of a case, with private data removed."""
    case = load_case(Path(case_dir))
    origin = case.origin
    error = str(origin.get("error", "")) or "(no error recorded in [origin])"
    stderr = str(origin.get("stderr", ""))
    error_type, _, message = error.partition(": ")
    found = triage(error_type, message, stderr)
    kernel = assertion_line(stderr)
    code = markdown_code   # a backtick or newline in recorded text cannot end the span
    parts = [f"## GPU failure: {code(_one_line(error))}", ""]
    if case.summary:
        parts += [case.summary, ""]
    facts = _request_facts(case, error, kernel)
    parts += [f"- **{name}**: {value}" for name, value in facts]
    if stderr.strip() and stderr.strip() != kernel:
        lines = stderr.strip().splitlines()[-_STDERR_LINES:]
        # A fence longer than any run of backticks in the text: the text cannot close it.
        fence = "`" * max(3, 1 + max((len(run) for line in lines
                                     for run in re.findall(r"`+", line)), default=0))
        parts += ["", "### Recorded stderr", "", f"{fence}text", *lines, fence]
    context = [f"- {key}: {_context_value(origin[key])}" for key in origin
               if key not in _SHOWN_ORIGIN]
    if context:
        parts += ["", "### Context", "", *context]
    parts += ["", "### Inputs", ""]
    parts += _input_table(case)
    if found is not None:
        parts += ["", "### Triage", ""]
        parts += [f"- {line}" for line in found.render().splitlines()]
        parts += [f"- note: {line}" for line in item_notes(case)]
    parts += ["", "### Reproduce", "", "```bash",
              f"pytest --gpu-cases {_case_arg(case)} -k {case.name} -rxX", "```"]
    if case.xfail:
        parts += ["", f"The case is a strict xfail (`{case.xfail}`); add `--runxfail` to see the "
                  "failure itself."]
    # Made safe for the terminal first: an escape sequence inside a secret's name must not
    # keep the scrubber from seeing it.
    text = terminal_safe("\n".join(parts) + "\n")
    return Scrubber.here(case, _every_sample_id(origin)).scrub(text)


def _every_sample_id(table: Any, depth: int = 0) -> list[object]:
    """The sample ids anywhere in ``[origin]``: its ``sample_ids``, and the lists a derived case
    keeps of its parent's (``minimized_from`` ``original_sample_ids``, ``data_check_from``
    ``dropped_sample_ids``), so that none reaches a request."""
    found: list[object] = []
    if not isinstance(table, Mapping) or depth > 8:
        return found
    for key, value in table.items():
        if str(key).endswith("sample_ids") and isinstance(value, list):
            found += [item for item in value if not isinstance(item, Mapping | list)]
        elif isinstance(value, Mapping):
            found += _every_sample_id(value, depth + 1)
    return found


def _request_facts(case: Case, error: str, kernel: str | None) -> list[tuple[str, str]]:
    """The request's list of facts: what the case calls, its first error, where and with
    which versions it ran; sample ids counted, never shown."""
    code = markdown_code
    origin = case.origin
    facts = [("Operation", code(case.call))]
    if case.reference:
        facts.append(("Reference", code(case.reference)))
    facts.append(("First error", code(_one_line(error))))
    if kernel:
        facts.append(("Kernel assertion", code(kernel)))
    backend = str(origin.get("backend", "unknown"))
    if "device" in origin:
        backend += f" ({origin['device']})"
    facts.append(("Backend", backend))
    facts.append(("Versions", _versions(origin) or "not recorded"))
    if "revision" in origin:
        facts.append(("Revision", code(str(origin["revision"]))))
    where = _where(origin)
    if where:
        facts.append(("Where", where))
    ids = origin.get("sample_ids")
    if isinstance(ids, list):
        facts.append(("Sample ids", f"{len(ids)} recorded (withheld)"))
    if origin.get("later_errors"):
        facts.append(("Later errors", f"{origin['later_errors']} after the first (likely "
                      "consequences, not separate causes)"))
    return facts


def _expectation(case: Case) -> str:
    expect = case.expect
    if expect.outcome == "raises":
        return f"raises {expect.wanted}"
    text = "outputs match the reference"
    if expect.gradients:
        text += ", gradients included"
    if expect.tolerance:
        text += "; tolerance " + ", ".join(
            f"{dtype}: " + ", ".join(f"{k}={v:g}" for k, v in
                                     (("rtol", t.rtol), ("atol", t.atol), ("ulps", t.ulps))
                                     if v is not None)
            for dtype, t in expect.tolerance.items())
    return text


def _where(origin: Mapping[str, Any]) -> str:
    parts = []
    if "iteration" in origin:
        parts.append(f"iteration {origin['iteration']}")
    if "stage" in origin:
        parts.append(f"in {origin['stage']}")
    if "last_step" in origin:
        parts.append(f"after {origin['last_step']}")
    return ", ".join(parts)


def _versions(origin: Mapping[str, Any]) -> str:
    names = {"python": "Python", "torch": "torch", "cuda": "CUDA", "hip": "HIP"}
    return ", ".join(f"{names[key]} {origin[key]}" for key in _ORIGIN_VERSIONS if key in origin)


def _context_value(value: Any) -> str:
    if isinstance(value, Mapping):
        return "; ".join(f"{key} = {item}" for key, item in value.items())
    if isinstance(value, list):
        return "; ".join(str(item) for item in value)
    return str(value)


def _one_line(value: Any) -> str:
    lines = str(value).strip().splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def _payload_rows(case: Case) -> tuple[list[payload.TensorInfo], str | None]:
    if not case.inputs_file.exists():
        return [], None
    try:
        infos = payload.describe(case.inputs_file)
    except CaseFormatError as exc:
        return [], str(exc)
    return sorted(infos, key=lambda info: info.name), None


def _dtype(code: str) -> str:
    return payload.DTYPES.get(code, (code, 0))[0]


def _input_lines(case: Case) -> list[str]:
    infos, problem = _payload_rows(case)
    lines = []
    width = max((len(info.name) for info in infos), default=0)
    for info in infos:
        layout = "contiguous" if info.contiguous else "non-contiguous"
        offset = f", offset {info.storage_offset}" if info.storage_offset else ""
        lines.append(f"{info.name:<{width}}  {_dtype(info.dtype):<9} {list(info.shape)} "
                     f"stride {list(info.stride)}{offset}  {layout}")
    if problem:
        lines.append(f"{INPUTS_FILE}: {problem}")
    lines.extend(f"{name} = {json.dumps(value)}" for name, value in case.literals.items())
    origin_inputs = case.origin.get("inputs")
    if not infos and isinstance(origin_inputs, Mapping):
        lines.extend(f"{name}: {desc} (recorded, not saved)"
                     for name, desc in origin_inputs.items())
    skipped = case.origin.get("skipped_inputs")
    if isinstance(skipped, Mapping):
        lines.extend(f"{name}: {kind} (skipped: not storable)" for name, kind in skipped.items())
    return lines


def _input_table(case: Case) -> list[str]:
    infos, problem = _payload_rows(case)
    rows = ["| name | dtype | shape | stride | contiguous |", "|---|---|---|---|---|"]
    for info in infos:
        rows.append(f"| `{info.name}` | {_dtype(info.dtype)} | {list(info.shape)} | "
                    f"{list(info.stride)} | {'yes' if info.contiguous else 'no'} |")
    origin_inputs = case.origin.get("inputs")
    if not infos and isinstance(origin_inputs, Mapping):
        rows.extend(f"| `{name}` | {desc} (recorded, not saved) | | | |"
                    for name, desc in origin_inputs.items())
    lines = rows if len(rows) > 2 else ["No saved tensors."]
    if problem:
        lines.append(f"\nThe payload cannot be read: {problem}")
    if case.literals:
        lines += ["", "Literals: " + ", ".join(f"`{name} = {json.dumps(value)}`"
                                               for name, value in case.literals.items())]
    return lines


def _matrix(case: Case) -> str:
    req = case.matrix
    parts = []
    for name, values in (("devices", req.devices), ("dtypes", req.dtypes),
                         ("backends", req.backends)):
        if values:
            parts.append(f"{name} {', '.join(values)}")
    parts += [f"{key}{spec}" for key, spec in req.versions.items()]
    parts += [f"{name}{spec}" for name, spec in req.packages.items()]
    return "; ".join(parts)


def _variants(case: Case) -> str:
    tables = case.variants
    parts = []
    for kind, axis in (("batch", tables.batch), ("length", tables.length)):
        if axis is not None:
            parts.append(f"{kind} axis {axis.axis} sizes {', '.join(map(str, axis.sizes))}"
                         + ("" if axis.independent else " (samples not independent: rows "
                            "not compared with the saved batch's)"))
    if tables.boundaries is not None:
        b = tables.boundaries
        text = f"boundaries of '{b.input}' ({b.classes} classes"
        text += f", ignore_index {b.ignore_index})" if b.ignore_index is not None else ")"
        parts.append(text)
    return "; ".join(parts)


def _resized(case: Case) -> list[str]:
    """Which inputs each batch/length variant resizes, to what shape (the payload's header)."""
    from pytest_gpucase.case.variants import describe_saved, expand

    # Boundaries are left to the item's failure text: telling the entry they set reads the
    # tensors (torch), and show reads the payload's header only.
    found = (describe_saved(variant, case) for variant in expand(case.variants)
             if variant.kind != "boundary")
    return [line for line in found if line]


def _verdicts(report: Path, case: Case) -> list[str]:
    """This case's last verdict per item from a JSON report (``load_report`` checks it)."""
    last: dict[str, Mapping[str, Any]] = {}
    for entry in load_report(report)["results"]:
        if _is_this_case(entry, case):
            key = entry["nodeid"]
            last.pop(key, None)  # a later entry for the same item wins, in its new place
            last[key] = entry
    if not last:
        return ["no verdict of this case in the report"]
    lines = []
    for entry in last.values():
        message = _one_line(entry["message"] or "")
        line = f"{_run_id(entry)}: {entry['outcome']}"
        lines.append(f"{line}: {message}" if message else line)
    return lines


def _run_id(entry: Mapping[str, Any]) -> str:
    parts = [str(entry[key]) for key in ("device", "dtype", "variant") if entry.get(key)]
    return "-".join(parts) or str(entry.get("nodeid", "?"))


def _is_this_case(entry: Mapping[str, Any], case: Case) -> bool:
    """Whether a report entry is a run of ``case``: by its path when the entry names one.

    Two cases may share a name in different folders (cases/a/ce, cases/b/ce); the path
    tells them apart. ``case_path`` is relative to where the run was started, which need
    not be here: it matches when it is the case's path or ends the case's resolved path.
    """
    recorded = entry.get("case_path")
    if isinstance(recorded, str) and recorded:
        where = Path(recorded)
        mine = case.path.resolve()
        with contextlib.suppress(OSError, ValueError):  # too long, or a NUL in it
            if where.resolve() == mine:
                return True
        parts = where.parts
        return not where.is_absolute() and mine.parts[-len(parts):] == parts
    named = entry.get("case")
    if isinstance(named, str) and named and Path(named).name == case.name:
        return True
    nodeid = entry.get("nodeid")
    return isinstance(nodeid, str) and f"::{case.name}[" in nodeid


def _case_arg(case: Case) -> str:
    """The case directory as a command argument: relative to here, else its name."""
    try:
        return str(case.path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(Path(case.path.resolve().parent.name) / case.name)

"""JSON results of a run, the compatibility matrix across runs, and GitHub step summaries.

The JSON report (schema in docs/report-schema.md) is the one file a run leaves
behind; ``gpucase matrix`` reads several of them, one per runner, and shows
which cases pass where. Everything here is pure data in, text out: no torch,
no pytest, so the command stays fast and the functions are tested directly.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from . import __version__
from .case import CASE_FILE
from .environment import Device, Environment, canonical_name, dnn_library
from .errors import display_posix
from .fsutil import write_text_atomic

if TYPE_CHECKING:
    import pytest

    from .plan import RunSpec
    from .runner import Verdict

SCHEMA = "pytest-gpucase/report"
VERSION = 2          # the newest version this module reads; a writer writes the lowest that fits
MATRIX_SCHEMA = "pytest-gpucase/matrix"
MATRIX_VERSION = 1

FAILING = ("failed", "error", "xpassed")  # a strict xfail that passed fails the run too

# Outcomes a version-1 report may hold; "interrupted" (the item that ran when the run was
# cancelled) and "not run" (selected, never started) came with version 2.
_V1_OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")

# A status is said per device type of a row, so that a CPU pass never reads as a CUDA pass;
# "partial" is a cell's sum only: some device types passed, others were skipped or not run.
Status = Literal["pass", "fail", "flaky", "skip", "xfail", "interrupted", "not run", "partial"]
STATUSES: tuple[Status, ...] = ("pass", "fail", "flaky", "xfail", "skip", "interrupted",
                                "not run")
STATUS_MEANINGS: Mapping[Status, str] = {
    "pass": "every run on this device type ran and passed",
    "fail": "a run failed, errored, or passed although marked as a known failure",
    "flaky": ("a run failed in one report of this environment and passed in another; the "
              "note names them"),
    "xfail": "a known failure (xfail in case.toml) still fails here",
    "skip": "every run on this device type was skipped; the note says why",
    "interrupted": "the run was cancelled while this ran: no verdict",
    "not run": ("no report holds a run of this case on this device type here, or its run "
                "stopped before it started"),
    "partial": "some device types passed; the others were skipped or not run",
}
_MARKDOWN_SYMBOLS: Mapping[Status, str] = {
    "pass": "✅", "fail": "❌", "flaky": "🔀", "xfail": "⚠️", "skip": "⏭️",
    "interrupted": "⏹️", "not run": "—", "partial": "◐",
}
# The HTML page must read well without an emoji font (CI images rarely have one).
_HTML_SYMBOLS: Mapping[Status, str] = {
    "pass": "✓", "fail": "✗", "flaky": "≠", "xfail": "⚠", "skip": "↷", "interrupted": "■",
    "not run": "—", "partial": "◐",
}
_DEVICE_WORDS: Mapping[Status, str] = {
    "pass": "pass", "fail": "fail", "flaky": "flaky", "xfail": "xfail", "skip": "skipped",
    "interrupted": "interrupted", "not run": "not run", "partial": "partial",
}
_SHORT_REASON = 48   # characters of a skip reason said in the cell; the note holds all of it
_REASON_WORDS = {
    "failed": "failed", "error": "error", "xpassed": "passed although marked xfail (strict)",
    "xfailed": "xfail", "skipped": "skipped", "interrupted": "interrupted",
    "not run": "not run",
}
# Which outcome of an item is shown when reports of one environment started at the same
# moment (which ran later is unknown): the worse one, so that a tie never hides a failure.
_SEVERITY = {"not run": 0, "skipped": 1, "passed": 2, "xfailed": 3, "interrupted": 4,
             "failed": 5, "error": 5, "xpassed": 5}
_MAX_RUNS_NAMED = 6
_MAX_FAILURES_LISTED = 20
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# What a version-1 file must hold, read from the JSON Schema shipped with the package (the one
# home of these facts; docs/report-schema.md explains them). Readers ignore keys they do not
# know, so that a writer may add a key without breaking older readers (removing or changing
# one bumps VERSION). The check is hand-written, not jsonschema's: its messages name the
# file, the place and the fix the way every other message here does, with no new dependency.
SCHEMA_FILE = "report_schema.json"
_SCHEMA: Mapping[str, Any] = json.loads(
    resources.files(__package__ or "pytest_gpucase").joinpath(SCHEMA_FILE)
    .read_text(encoding="utf-8"))


def _kind_of(spec: Mapping[str, Any]) -> str:
    """A schema property as the kind its messages name: ``string or null``, ``measure``."""
    if "$ref" in spec:
        return "measure" if spec["$ref"].endswith("/measure") else "object"
    types = spec.get("type", "string")
    types = [types] if isinstance(types, str) else list(types)
    base = str(types[0])
    if base == "array":
        base = "list of strings" if spec.get("items", {}).get("type") == "string" else "list"
    return base + (" or null" if "null" in types else "")


def _required(definition: Mapping[str, Any]) -> dict[str, str]:
    return {key: _kind_of(definition["properties"][key]) for key in definition["required"]}


_TOP_KEYS = _required(_SCHEMA)
_ENVIRONMENT_KEYS = _required(_SCHEMA["$defs"]["environment"])
_DEVICE_KEYS = _required(_SCHEMA["$defs"]["device"])
_RESULT_KEYS = _required(_SCHEMA["$defs"]["result"])
_OPTIONAL_RESULT_KEYS = {key: _kind_of(spec) for key, spec
                         in _SCHEMA["$defs"]["result"]["properties"].items()
                         if key not in _RESULT_KEYS}
OUTCOMES = tuple(_SCHEMA["$defs"]["result"]["properties"]["outcome"]["enum"])
_OPTIONAL_TOP_KEYS = {key: _kind_of(spec) for key, spec in _SCHEMA["properties"].items()
                      if key not in _TOP_KEYS}
# The keys that tell one environment from another: those every version-1 report has (the
# schema's required ones). A key a later writer adds (the schema lets it) describes a run
# but never splits one environment into two columns: a report written before it cannot
# have it, and its absence there says nothing about the environment.
ENVIRONMENT_IDENTITY = tuple(_ENVIRONMENT_KEYS)


class ReportError(ValueError):
    """A JSON report that cannot be read as written; the message names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


# ----------------------------------------------------------------------------- text for its place

# Every text below comes from a child, a case file or a node id, and is written where markup
# or a terminal would act on it: each function makes it inert for one place. The patterns
# have bounded quantifiers only, so that a hostile text costs linear time.
_TERMINAL = re.compile(
    r"\x1b\[[0-?]{0,64}[ -/]{0,16}[@-~]"          # CSI: colours, cursor moves, screen clears
    r"|\x1b\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)"  # OSC: window titles, hyperlinks, clipboard
    r"|\r\n?"
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Backslash-escapable punctuation that GitHub Markdown acts on anywhere in a line; an
# underscore inside a word (sm_80, ce_class4) cannot start emphasis, so it is left alone.
_MARKDOWN = re.compile(r"[\\`*\[\]<|#&~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# What starts a block when it begins a line: a quote, a list item, a setext underline.
_MARKDOWN_LINE_START = re.compile(r"[>+=-]|\d{1,9}[.)]")


def terminal_safe(text: str) -> str:
    """``text`` with no terminal control left: escapes removed, other controls shown as ``\\xNN``.

    Newlines and tabs stay; a carriage return becomes a newline, so that a progress bar
    cannot overwrite what was printed before it. Bidirectional overrides are shown as
    ``\\u202e`` and the like: they would make a line read differently from what it holds.
    """
    def replace(found: re.Match[str]) -> str:
        control = found.group(0)
        if len(control) > 1 and control[0] == "\x1b":
            return ""   # a whole escape sequence; a lone ESC is shown below
        if control[0] == "\r":
            return "\n"
        code = ord(control)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _TERMINAL.sub(replace, text)


def _one_line(text: str) -> str:
    return " ".join(terminal_safe(text).split())


def markdown_text(text: str) -> str:
    """``text`` as literal Markdown on one line (messages hold ``*``, ``|``, ``__init__``)."""
    line = _MARKDOWN.sub(lambda found: "\\" + found.group(0), _one_line(text))
    return "\\" + line if _MARKDOWN_LINE_START.match(line) else line


_md = markdown_text


def markdown_code(text: str) -> str:
    """``text`` as one Markdown code span, whatever backticks or newlines it holds."""
    line = _one_line(text)
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"


# ----------------------------------------------------------------------------- the JSON report


def new_report(environment: Mapping[str, Any], created: str | None = None) -> dict[str, Any]:
    """Start the report of a run in ``environment`` (``Environment.to_dict()``), results empty.

    ``created`` is when the run started; a session passes the time it started, so that
    every rewrite of its file keeps it. ``gpucase`` names the writer's version.
    """
    return {
        "schema": SCHEMA,
        "version": 1,
        "created": created or now(),
        "environment": dict(environment),
        "results": [],
        "complete": False,
        "gpucase": __version__,
    }


def now() -> str:
    """The time to write as ``created``: to the microsecond, so that reports of reruns a
    second apart are still told apart in time (ties are said, and broken, by the matrix)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def report_version(results: Iterable[Mapping[str, Any]]) -> int:
    """The lowest report version that holds ``results``: 1 unless an outcome needs 2.

    A run that ended normally stays readable by a pytest-gpucase that reads only version 1;
    only a report that holds an ``interrupted`` or ``not run`` item needs a newer reader.
    """
    return 2 if any(result["outcome"] not in _V1_OUTCOMES for result in results) else 1


def write_report(path: Path | str, report: Mapping[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically, so a reader or a crash never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Strict JSON (jq, JavaScript) has no NaN or Infinity; a max_abs of inf is spelled "inf".
    text = json.dumps(_finite(report), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    # A node id holds a directory name as the OS gave it: bytes that are not UTF-8 arrive
    # as lone surrogates, written as JSON escapes (\udcff) rather than failing the write.
    # The mode a person expects: the old file's, else what the umask gives a new one.
    write_text_atomic(target, text, mode=_file_mode(target), errors="backslashreplace")


def _file_mode(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)   # there is no way to read the umask without setting it
        os.umask(umask)
        return 0o666 & ~umask


def property_json(value: Any) -> str:
    """``value`` as the JSON text of a pytest user property (junit XML shows it as written).

    Non-finite floats are spelled as in the report file ("nan", "inf"), never NaN.
    """
    return json.dumps(_finite(value), sort_keys=True, ensure_ascii=False, allow_nan=False)


def property_value(value: Any) -> Any:
    """A user property written by ``property_json``, as data again."""
    return json.loads(value) if isinstance(value, str) else value


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def load_report(path: Path | str) -> dict[str, Any]:
    """Read and validate one JSON report; ``ReportError`` names the file and what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ReportError(path, f"cannot read: {reason}") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(path, f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None
    if not isinstance(report, dict):
        raise ReportError(path, f"not a pytest-gpucase report: the top level is {_kind(report)}, "
                                "expected an object")
    if report.get("schema") != SCHEMA:
        found = "missing" if "schema" not in report else json.dumps(report["schema"])
        raise ReportError(path, f"not a pytest-gpucase report: \"schema\" is {found}, "
                                f"expected \"{SCHEMA}\"")
    version = report.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise ReportError(path, f"report version {version} is newer than this pytest-gpucase "
                                f"reads (up to {VERSION}); upgrade pytest-gpucase")
    check_report(report, path)
    for result in report["results"]:
        for key in ("max_abs", "max_rel"):
            if isinstance(result[key], str):
                result[key] = _NON_FINITE[result[key]]
    return report


def check_report(report: Mapping[str, Any], path: Path | str = "<report>") -> None:
    """Check a report against the schema; ``ReportError`` says where it breaks it.

    ``load_report`` checks what it reads with it, and the plugin what it is about to write.
    """
    version = report.get("version")
    _check_keys(path, report, _TOP_KEYS, "")
    _check_keys(path, report, {key: kind for key, kind in _OPTIONAL_TOP_KEYS.items()
                               if key in report}, "")
    if version not in range(1, VERSION + 1) or isinstance(version, bool):
        raise ReportError(path, f"version: {json.dumps(version)} is not a report version "
                                f"this pytest-gpucase reads (1 to {VERSION})")
    _check_created(path, report["created"])
    environment = report["environment"]
    _check_keys(path, environment, _ENVIRONMENT_KEYS, "environment")
    for index, device in enumerate(environment["devices"]):
        _check_keys(path, device, _DEVICE_KEYS, f"environment.devices[{index}]")
    for name, version_found in environment["packages"].items():
        if not _is(version_found, "string or null"):
            raise ReportError(path, f"environment.packages.{name}: expected a string or null, "
                                    f"found {_kind(version_found)}")
    for index, result in enumerate(report["results"]):
        where = f"results[{index}]"
        _check_keys(path, result, _RESULT_KEYS, where)
        optional = {key: kind for key, kind in _OPTIONAL_RESULT_KEYS.items() if key in result}
        _check_keys(path, result, optional, where)
        if result["outcome"] not in OUTCOMES:
            raise ReportError(path, f"{where}.outcome: {json.dumps(result['outcome'])} is not "
                                    f"one of {', '.join(OUTCOMES)}")
        if version == 1 and result["outcome"] not in _V1_OUTCOMES:
            raise ReportError(path, f"{where}.outcome: {json.dumps(result['outcome'])} needs "
                                    "report version 2; write \"version\": 2")


def _check_keys(path: Path | str, value: Any, spec: Mapping[str, str], where: str) -> None:
    if not isinstance(value, dict):
        raise ReportError(path, f"{where}: expected an object, found {_kind(value)}")
    prefix = f"{where}." if where else ""
    for key, kind in spec.items():
        if key not in value:
            raise ReportError(path, f"{where + ': ' if where else ''}missing key \"{key}\"")
        if not _is(value[key], kind):
            expected = ('a number, null, or one of "nan", "inf", "-inf"' if kind == "measure"
                        else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}")
            raise ReportError(path, f"{prefix}{key}: expected {expected}, "
                                    f"found {_kind(value[key])}")


def _is(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null") or kind == "measure"
    if isinstance(value, bool):
        return kind == "boolean"
    base = kind.removesuffix(" or null")
    if base == "measure":
        return isinstance(value, (int, float)) or value in _NON_FINITE
    if base == "list of strings":
        return isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)
    # A tuple is what a report still in memory holds where its file will hold a list.
    types: Mapping[str, type | tuple[type, ...]] = {
        "string": str, "integer": int, "number": (int, float), "object": dict,
        "list": (list, tuple),
        "boolean": bool,
    }
    return isinstance(value, types[base])


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _check_created(path: Path | str, created: str) -> None:
    try:
        moment = datetime.fromisoformat(created)
    except ValueError:
        raise ReportError(path, f"created: {json.dumps(created)} is not an ISO 8601 time"
                          ) from None
    # Reports of one environment are ordered by this time; a naive time cannot be compared.
    if moment.tzinfo is None:
        raise ReportError(path, f"created: {json.dumps(created)} has no UTC offset")


def describe_environment(environment: Mapping[str, Any]) -> str:
    """One line naming an environment as a PyTorch engineer reads it, with its extensions."""
    env = Environment(
        backend=environment["backend"],
        device_types=tuple(environment["device_types"]),
        devices=tuple(Device(d["index"], d["name"], d.get("capability"), d.get("memory_gib"))
                      for d in environment["devices"]),
        torch=environment["torch"], cuda=environment["cuda"], hip=environment["hip"],
        cudnn=environment["cudnn"], python=environment["python"],
        platform=environment["platform"], packages=environment["packages"],
        revision=environment["revision"],
    )
    line = env.header().removeprefix("gpucase: ")
    for name, version in sorted(env.packages.items()):
        line += f" · {name} {version}" if version else f" · {name} not installed"
    return line


# ----------------------------------------------------------------------------- step summary


def step_summary(report: Mapping[str, Any]) -> str:
    """A short Markdown summary of one run, for GitHub's job summary page."""
    results: list[Mapping[str, Any]] = report["results"]
    counts = Counter(result["outcome"] for result in results)
    order = ("failed", "error", "xpassed", "interrupted", "xfailed", "passed", "skipped",
             "not run")
    tally = ", ".join(f"{counts[outcome]} {outcome}" for outcome in order if counts[outcome])
    failures = [result for result in results if result["outcome"] in FAILING]
    symbol = "❌" if failures else ("⚠️" if not report["complete"] else "✅")
    lines = [f"### pytest-gpucase: {symbol} {tally or 'no items ran'}", ""]
    if not report["complete"]:
        lines += ["⚠️ The run did not finish: these are the items recorded before it stopped.", ""]
    lines += [_md(describe_environment(report["environment"])), ""]
    if failures:
        lines += ["**Failed**", ""]
        for result in failures[:_MAX_FAILURES_LISTED]:
            # "failed" is the heading already; an error or a strict xpass says what it is.
            said = [] if result["outcome"] == "failed" else [_REASON_WORDS[result["outcome"]]]
            said += [text] if (text := _as_in_nodeid(result, _reason_text(result))) else []
            line = f"- {markdown_code(result['nodeid'])}: {_md(': '.join(said) or 'failed')}"
            clue = (result["triage"] or {}).get("clue")
            lines.append(line + (f" (clue: {_md(str(clue))})" if clue else ""))
        if len(failures) > _MAX_FAILURES_LISTED:
            lines.append(f"- … and {len(failures) - _MAX_FAILURES_LISTED} more in the JSON report")
        lines.append("")
    return "\n".join(lines)


def _as_in_nodeid(result: Mapping[str, Any], text: str) -> str:
    """``text`` with the case's directory written as the node id beside it writes it.

    A message names the case as the run displayed it: relative to the working
    directory, or absolute when the case lies outside it, while a node id is
    relative to the rootdir. On a CI page only the node id's form means anything.
    """
    case_path = str(result.get("case_path") or "")
    file = str(result["nodeid"]).partition("::")[0]
    directory, _, name = file.rpartition("/")
    if not case_path or not directory or name != CASE_FILE or directory == case_path:
        return text
    # Not where the path goes on with a longer name: cases/bom is no prefix of cases/bomb.
    return re.sub(re.escape(case_path) + r"(?![\w.-])", lambda _: directory, text)


def append_step_summary(report: Mapping[str, Any],
                        env: Mapping[str, str] = os.environ) -> Path | None:
    """Append ``step_summary(report)`` to the file GitHub names in GITHUB_STEP_SUMMARY, if any."""
    name = env.get("GITHUB_STEP_SUMMARY")
    if not name:
        return None
    path = Path(name)
    # Other steps write to the same file; a blank line keeps our heading out of their paragraph.
    separator = "\n" if path.exists() and path.stat().st_size else ""
    with path.open("a", encoding="utf-8") as stream:
        stream.write(separator + step_summary(report))
    return path


# ----------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Column:
    """One environment: the label says what differs from the other columns."""

    label: str
    description: str                 # the whole environment in one line
    environment: Mapping[str, Any]
    sources: tuple[str, ...]         # the report files merged into this column, oldest first
    created: str                     # when the newest of them was started
    complete: bool                   # False when any of them comes from an unfinished run


@dataclass(frozen=True)
class DeviceCell:
    """What the runs of one device type did in one cell: its own status and reasons."""

    device: str
    status: Status                   # "not run" when the column holds no run on this device
    reasons: tuple[str, ...]         # why its runs did not pass: failure messages, skip reasons

    @property
    def text(self) -> str:
        """``cuda: skipped (no CUDA device here)``: the status, with a skip's short reason."""
        said = f"{self.device}: {_DEVICE_WORDS[self.status]}"
        if self.status == "skip" and self.reasons:
            said += f" ({_short(self.reasons[0])})"
        return said


@dataclass(frozen=True)
class Cell:
    """What one case (or case variant) did in one environment, over its devices and dtypes."""

    status: Status
    counts: Mapping[str, int]        # outcome -> number of runs
    reasons: tuple[str, ...]         # why runs did not pass: failure messages, skip reasons
    devices: tuple[DeviceCell, ...] = ()   # one per device type of the row, in every column


@dataclass(frozen=True)
class Row:
    """One case, or one case variant in detail mode."""

    label: str
    case: str
    case_path: str
    variant: str | None
    cells: tuple[Cell, ...]          # one per column


@dataclass(frozen=True)
class Matrix:
    """Cases against environments, built from the JSON reports of several runs."""

    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    detail: bool
    notes: tuple[str, ...] = ()      # what the reader should know about how reports were merged


def build_matrix(reports: Sequence[Mapping[str, Any]], *, detail: bool,
                 names: Sequence[str] | None = None) -> Matrix:
    """Merge loaded reports into a matrix: one column per environment, one row per case.

    ``names`` name the reports (their file names) in notes and in labels that would
    otherwise be equal. Reports of one environment (``same_environment``) share a column.
    For an item in more than one of them, the report created later wins; between reports
    created at the same moment, the worse outcome (a failure before a pass), whatever the
    order they were given in. An item whose outcomes differ between them is flagged in its
    cell (``flaky`` where one failed and another passed) and named in a note. An item
    that only an older report holds is kept, shown from it, and counted in the note.
    """
    names = list(names) if names is not None else [f"report {n + 1}" for n in range(len(reports))]
    created = [datetime.fromisoformat(report["created"]) for report in reports]
    groups, notes = _environment_groups(reports, names, created)

    merged: list[dict[str, Mapping[str, Any]]] = []
    for indexes in groups:
        indexes.sort(key=lambda i: (created[i], names[i]))
        items, note = _merge_runs(reports, names, created, indexes)
        if note:
            notes.append(note)
        merged.append(items)

    environments = [_merged_environment([reports[i]["environment"] for i in indexes])
                    for indexes in groups]
    sources = [tuple(names[i] for i in indexes) for indexes in groups]
    labels = _labels(environments, sources)
    columns = tuple(
        Column(label=label, description=describe_environment(environment),
               environment=environment, sources=source,
               created=reports[indexes[-1]]["created"],
               complete=all(reports[i]["complete"] for i in indexes))
        for label, environment, source, indexes in zip(labels, environments, sources, groups,
                                                         strict=True)
    )
    return Matrix(columns=columns, rows=_rows(merged, detail), detail=detail, notes=tuple(notes))


def _identity(environment: Mapping[str, Any]) -> str:
    """What must be equal for two reports to share an environment, packages aside."""
    return json.dumps({key: environment.get(key) for key in ENVIRONMENT_IDENTITY
                       if key != "packages"}, sort_keys=True)


def _packages(environment: Mapping[str, Any]) -> dict[str, str | None]:
    return {canonical_name(name): version for name, version in environment["packages"].items()}


def _packages_agree(mine: Mapping[str, str | None], theirs: Mapping[str, str | None]) -> bool:
    """Every package both name at the same version (``same_environment``'s package rule)."""
    return all(mine[name] == theirs[name] for name in mine.keys() & theirs.keys())


def same_environment(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether two reports' environments are one: the identity keys equal, and every package
    both name at the same version (or absent from both).

    A report names the packages its cases ask about (``[matrix.packages]``, the
    distribution a ``call`` imports): a shard that collected other cases, or a run from
    before a case was added, does not name a package it never looked at, and that says
    nothing about whether it was installed. Recording a fixed set instead would mean every
    installed distribution (columns split by an unrelated upgrade of a test tool) or a
    list kept by hand; so a package one report does not mention is unknown there, not
    different. Names compare as pip compares them (``flash_attn`` is ``flash-attn``).
    """
    if _identity(first) != _identity(second):
        return False
    return _packages_agree(_packages(first), _packages(second))


def _environment_groups(reports: Sequence[Mapping[str, Any]], names: Sequence[str],
                        created: Sequence[datetime]) -> tuple[list[list[int]], list[str]]:
    """The reports of each column (``same_environment``), columns in the order given.

    Reports naming more packages are placed first, so that one naming fewer meets the
    columns its packages cannot tell apart: it joins the one column it fits, and where it
    fits several (it does not name what tells them apart) it gets a column of its own and
    a note, rather than a guess.
    """
    notes: list[str] = []
    by_identity: dict[str, list[int]] = {}
    for index, report in enumerate(reports):
        by_identity.setdefault(_identity(report["environment"]), []).append(index)
    groups: list[list[int]] = []
    for indexes in by_identity.values():
        known = {i: _packages(reports[i]["environment"]) for i in indexes}
        placed: list[tuple[dict[str, str | None], list[int]]] = []
        for index in sorted(indexes, key=lambda i: (-len(known[i]), created[i], names[i])):
            mine = known[index]
            fits = [group for group in placed if _packages_agree(group[0], mine)]
            if len(fits) == 1:
                fits[0][0].update(mine)
                fits[0][1].append(index)
                continue
            if fits:
                unnamed = sorted({name for group in fits for name in group[0]
                                  if name not in mine and len({g[0].get(name) for g in fits}) > 1})
                notes.append(f"{names[index]} does not name {', '.join(unnamed)}, which tells "
                             "apart the environments it would otherwise share a column with: "
                             "it has a column of its own.")
            placed.append((dict(mine), [index]))
        groups += [members for _, members in placed]
    groups.sort(key=min)
    return groups, notes


def _merged_environment(environments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One column's environment: the newest report's, with the packages any of them named."""
    merged = dict(environments[-1])
    packages: dict[str, str | None] = {}
    seen: set[str] = set()
    for environment in environments:
        for name, version in environment["packages"].items():
            if canonical_name(name) not in seen:
                seen.add(canonical_name(name))
                packages[name] = version
    merged["packages"] = dict(sorted(packages.items()))
    return merged


def _merge_runs(reports: Sequence[Mapping[str, Any]], names: Sequence[str],
                created: Sequence[datetime], indexes: Sequence[int]
                ) -> tuple[dict[str, Mapping[str, Any]], str | None]:
    """One column's items from its reports (oldest first), and the note on how they merged."""
    runs: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for index in indexes:
        for result in reports[index]["results"]:
            runs.setdefault(result["nodeid"], []).append((index, result))
    newest = indexes[-1]
    items: dict[str, Mapping[str, Any]] = {}
    repeated = older_only = 0
    differed: list[str] = []
    for nodeid, found in runs.items():
        repeated += len(found) > 1
        older_only += all(created[index] < created[newest] for index, _ in found)
        # A "not run" never hides a run that happened; between the latest runs, the worse.
        real = [run for run in found if run[1]["outcome"] != "not run"] or found
        latest = max(created[index] for index, _ in real)
        tied = sorted((run for run in real if created[run[0]] == latest),
                      key=lambda run: (-_SEVERITY[run[1]["outcome"]], names[run[0]]))
        shown = tied[0][1]
        outcomes = dict.fromkeys(result["outcome"] for _, result in real)
        if len(outcomes) > 1:
            said = "; ".join(
                f"{outcome} in {', '.join(names[i] for i, r in real if r['outcome'] == outcome)}"
                for outcome in outcomes)
            flaky = bool(outcomes.keys() & set(FAILING)) and "passed" in outcomes
            failure = next((r for _, r in reversed(real) if r["outcome"] in FAILING), None)
            if failure is not None and (text := _reason_text(failure)):
                said += f" (failure: {text})"
            shown = {**shown, "_differed": said, "_flaky": flaky}
            differed.append(f"{_run_id(shown)} of {shown['case']}: {said}")
        items[nodeid] = shown
    if len(indexes) < 2:
        return items, None
    note = f"{', '.join(names[i] for i in indexes)} come from one environment and share a column"
    if repeated:
        note += (f"; {repeated} {'item' if repeated == 1 else 'items'} ran in more than one of "
                 "them: the result of the report created later is shown")
    if differed:
        shown_runs = "; ".join(differed[:_MAX_RUNS_NAMED])
        if len(differed) > _MAX_RUNS_NAMED:
            shown_runs += f"; and {len(differed) - _MAX_RUNS_NAMED} more"
        note += (f"; the outcomes of {len(differed)} "
                 f"{'item' if len(differed) == 1 else 'items'} differed between them, "
                 f"marked in the cells: {shown_runs}")
    if older_only and repeated:
        note += (f"; {older_only} {'item is' if older_only == 1 else 'items are'} only in an "
                 "older report and shown from it")
    moments = Counter(created[i] for i in indexes)
    tied_names = [names[i] for i in indexes if moments[created[i]] > 1]
    if tied_names:
        note += (f"; {', '.join(tied_names)} were started at the same moment, so which ran later "
                 "is unknown: for an item in more than one of them the worse outcome is shown "
                 "(a failure before a pass), whatever the order of the files")
    writers = dict.fromkeys(reports[i].get("gpucase") for i in indexes)
    if len(writers) > 1:
        note += ("; they were written by different versions of pytest-gpucase: " + ", ".join(
            f"{'an older one' if writer is None else writer} "
            f"({', '.join(names[i] for i in indexes if reports[i].get('gpucase') == writer)})"
            for writer in writers))
    return items, note + "."


def _rows(columns: list[dict[str, Mapping[str, Any]]], detail: bool) -> tuple[Row, ...]:
    keys: dict[tuple[str, str | None], str] = {}   # (case_path, variant) -> case name
    # Each column's results by row once, so that a large suite is not scanned once per cell.
    by_row: list[dict[tuple[str, str | None], list[Mapping[str, Any]]]] = []
    for items in columns:
        grouped: dict[tuple[str, str | None], list[Mapping[str, Any]]] = {}
        for result in items.values():
            key = (result["case_path"], result["variant"] if detail else None)
            keys.setdefault(key, result["case"])
            grouped.setdefault(key, []).append(result)
        by_row.append(grouped)
    # Cases by path; a case's variants in the order its items ran (batch=1 before batch=16).
    first_seen = {key: order for order, key in enumerate(keys)}
    ordered = sorted(keys, key=lambda key: (key[0], key[1] is not None, first_seen[key]))
    paths: dict[str, set[str]] = {}
    for (path, _), case in keys.items():
        paths.setdefault(case, set()).add(path)
    devices: dict[tuple[str, str | None], set[str]] = {}
    for grouped in by_row:
        for key, results in grouped.items():
            devices.setdefault(key, set()).update(result["device"] for result in results)
    rows = []
    for key in ordered:
        path, variant = key
        case = keys[key]
        shown = path if len(paths[case]) > 1 else case   # two cases of one name: show paths
        label = f"{shown} ({variant})" if variant is not None else shown
        # Every column says every device type of the row, "not run" included: a column that
        # ran only the CPU must not read as if its CUDA runs had passed.
        kinds = sorted(devices[key], key=lambda device: (device != "cpu", device))
        cells = tuple(_cell(grouped.get(key, []), kinds) for grouped in by_row)
        rows.append(Row(label=label, case=case, case_path=path, variant=variant, cells=cells))
    return tuple(rows)


def _status(results: Sequence[Mapping[str, Any]]) -> Status:
    outcomes = {result["outcome"] for result in results}
    if outcomes & set(FAILING):
        return "fail"
    if any(result.get("_flaky") for result in results):
        return "flaky"   # the latest run passed, an earlier one of the same item failed
    if "xfailed" in outcomes:
        # A known failure that still fails here is what the reader looks for, even next to
        # runs of the same case that pass (on another dtype).
        return "xfail"
    if "interrupted" in outcomes:
        return "interrupted"
    if "passed" in outcomes:
        return "pass"
    return "skip" if "skipped" in outcomes else "not run"


def _cell(results: Sequence[Mapping[str, Any]], kinds: Sequence[str]) -> Cell:
    counts = Counter(result["outcome"] for result in results)
    on_device = [[r for r in results if r["device"] == device] for device in kinds]
    devices = tuple(DeviceCell(device, _status(runs), _reasons(runs))
                    for device, runs in zip(kinds, on_device, strict=True))
    statuses = {device.status for device in devices}
    status: Status
    if not results:
        status = "not run"
    elif statuses & {"fail", "flaky", "xfail", "interrupted"}:
        status = next(s for s in ("fail", "flaky", "xfail", "interrupted") if s in statuses)
    elif statuses == {"pass"}:
        status = "pass"
    elif "pass" in statuses:
        status = "partial"   # never "pass" for a device type whose runs did not happen
    elif statuses == {"not run"}:
        status = "not run"   # selected, but the run stopped before them
    else:
        status = "skip"
    ordered = {outcome: n for outcome in OUTCOMES if (n := counts[outcome])}
    reasons = tuple(dict.fromkeys(r for device in devices for r in device.reasons))
    return Cell(status=status, counts=ordered, reasons=reasons, devices=devices)


def _short(reason: str) -> str:
    """The first clause of a skip reason, for the cell: its note holds the whole of it."""
    text = reason.removeprefix("skipped: ")
    for stop in (": ", "; ", " ("):
        text = text.split(stop, 1)[0]
    return text if len(text) <= _SHORT_REASON else text[:_SHORT_REASON - 1] + "…"


def _reasons(results: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Why the runs of one cell did not pass, one line per distinct reason."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    rank = {outcome: order for order, outcome in enumerate(
        ("failed", "error", "xpassed", "interrupted", "xfailed", "skipped", "not run"))}
    # An item whose outcomes differed between reports of the column: said first, by itself.
    reasons = [f"{'flaky' if r['_flaky'] else 'outcomes differed'}: {_run_id(r)}: {r['_differed']}"
               for r in results if r.get("_differed")]
    for result in sorted(results, key=lambda r: rank.get(r["outcome"], len(rank))):
        if result["outcome"] == "passed":
            continue
        key = (_REASON_WORDS[result["outcome"]], _reason_text(result))
        groups.setdefault(key, []).append(result)
    runs_on = Counter(result["device"] for result in results)
    for (word, text), group in groups.items():
        said = f"{word}: {text}" if text else word
        # A reason shared by every run of the cell, or by every run on a device, is said
        # without a list of runs: it then reads the same in every cell it applies to, and
        # becomes one footnote.
        if len(group) < len(results):
            named = _named_runs(group, runs_on)
            said = f"{named}: {said}"
        reasons.append(said)
    return tuple(reasons)


def _named_runs(group: Sequence[Mapping[str, Any]], runs_on: Mapping[str, int]) -> str:
    """Name the runs that share a reason: ``all cuda runs`` where it covers a whole device."""
    in_group = Counter(result["device"] for result in group)
    names = [f"all {device} runs" for device, n in in_group.items() if n == runs_on[device]]
    names += [_run_id(result) for result in group if in_group[result["device"]]
              != runs_on[result["device"]]]
    shown = ", ".join(names[:_MAX_RUNS_NAMED])
    if len(names) > _MAX_RUNS_NAMED:
        shown += f" and {len(names) - _MAX_RUNS_NAMED} more"
    return shown


def _reason_text(result: Mapping[str, Any]) -> str:
    if result["outcome"] == "skipped":
        text = result["skip_reason"] or result["message"]
    else:
        text = result["message"] or result["error_type"]
    return " ".join(str(text or "").split())


def _run_id(result: Mapping[str, Any]) -> str:
    found = re.search(r"\[(.+)\]$", result["nodeid"])
    if found:
        return found.group(1)
    parts = [result["device"], result["dtype"]] + ([result["variant"]] if result["variant"] else [])
    return "-".join(parts)


# ----------------------------------------------------------------------------- column labels


def _labels(environments: Sequence[Mapping[str, Any]],
            sources: Sequence[tuple[str, ...]]) -> list[str]:
    """Label each column by what differs between the environments, falling back to file names."""
    packages = sorted({name for env in environments for name in env["packages"]})
    fields = [_fields(env, packages) for env in environments]
    keys = list(fields[0]) if fields else []
    differing = [key for key in keys if len({f[key] for f in fields}) > 1]
    if "arch" in differing and "gpu" in differing:
        differing.remove("gpu")   # sm_80 vs sm_90 already tells an A100 from an H100
    labels = [" · ".join(token for key in differing if (token := f[key])) for f in fields]
    counts = Counter(labels)
    return [
        label if label and counts[label] == 1
        else f"{label} ({', '.join(source)})" if label else ", ".join(source)
        for label, source in zip(labels, sources, strict=True)
    ]


def _fields(env: Mapping[str, Any], packages: Iterable[str]) -> dict[str, str | None]:
    """The label token of every field of an environment, in label order; None shows nothing."""
    fields: dict[str, str | None] = {
        "backend": env["backend"],
        "torch": f"torch {env['torch'].split('+')[0]}" if env["torch"] else "no torch",
        "cuda": _cuda_token(env["cuda"]),
        "hip": f"rocm{'.'.join(env['hip'].split('.')[:2])}" if env["hip"] else None,
        "cudnn": dnn_library(env["cudnn"], env["backend"]),
    }
    for name in packages:
        if name not in env["packages"]:
            fields[f"package {name}"] = None   # not probed there: nothing is known
        else:
            version = env["packages"][name]
            fields[f"package {name}"] = f"{name} {version}" if version else f"no {name}"
    devices = env["devices"]
    arches = sorted({_arch(d["capability"]) for d in devices if d["capability"]})
    fields["arch"] = "+".join(arches) or None
    gpus = Counter(d["name"] for d in devices)
    fields["gpu"] = " + ".join(f"{n} × {name}" if n > 1 else name
                               for name, n in sorted(gpus.items())) or None
    fields["python"] = f"Python {env['python']}"
    fields["platform"] = env["platform"]
    fields["revision"] = f"rev {env['revision']}" if env["revision"] else None
    return fields


def _cuda_token(version: str | None) -> str | None:
    if not version:
        return None
    parts = version.split(".")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
        return f"cu{parts[0]}{parts[1]}"   # the name of PyTorch's wheel index: cu121
    return f"CUDA {version}"


def _arch(capability: str) -> str:
    if re.fullmatch(r"\d+\.\d+", capability):
        return "sm_" + capability.replace(".", "")
    return capability.split(":")[0]   # ROCm: gfx90a:sramecc+:xnack- -> gfx90a


# ----------------------------------------------------------------------------- rendering


def _footnotes(matrix: Matrix) -> dict[str, int]:
    """Number each distinct reason in reading order; one reason shared by many cells is one note."""
    numbers: dict[str, int] = {}
    for row in matrix.rows:
        for cell in row.cells:
            for reason in cell.reasons:
                numbers.setdefault(reason, len(numbers) + 1)
    return numbers


def _counts_text(cell: Cell) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in cell.counts.items()) or "no runs"


def _md_cell(cell: Cell, numbers: Mapping[str, int]) -> str:
    """``✅ cpu: pass · ⏭️ cuda: skipped (no CUDA device here)[^2]``: one part per device type."""
    # Stacked notes are separated ([^1],[^2]): run together they would read as note 12.
    return " · ".join(
        f"{_MARKDOWN_SYMBOLS[device.status]} {_md(device.text)}"
        + ",".join(f"[^{numbers[reason]}]" for reason in device.reasons)
        for device in cell.devices)


def render_markdown(matrix: Matrix) -> str:
    """The matrix as a GitHub Markdown table, with reasons as footnotes."""
    numbers = _footnotes(matrix)
    head = ["case (variant)" if matrix.detail else "case"]
    # The whole environment is said in the header, not only what tells the columns apart.
    head += [f"**{_md(c.label)}**" + ("" if c.complete else " (incomplete run)")
             + f"<br>{_md(c.description)}" for c in matrix.columns]
    lines = ["| " + " | ".join(head) + " |",
             "| :--- |" + " :---: |" * len(matrix.columns)]
    for row in matrix.rows:
        cells = [_md(row.label)] + [_md_cell(cell, numbers) for cell in row.cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", " · ".join(f"{_MARKDOWN_SYMBOLS[s]} {_DEVICE_WORDS[s]}: {STATUS_MEANINGS[s]}"
                             for s in STATUSES)]
    if matrix.notes:
        lines += [""] + [f"Note: {_md(note)}" for note in matrix.notes]
    if numbers:
        lines.append("")
        lines += [f"[^{n}]: {_md(reason)}" for reason, n in numbers.items()]
    return "\n".join(lines) + "\n"


def render_json(matrix: Matrix) -> str:
    """The matrix as JSON (schema ``pytest-gpucase/matrix``), for dashboards and scripts."""
    data = {
        "schema": MATRIX_SCHEMA,
        "version": MATRIX_VERSION,
        "detail": matrix.detail,
        "columns": [{"label": c.label, "description": c.description, "sources": list(c.sources),
                     "created": c.created, "complete": c.complete,
                     "environment": dict(c.environment)} for c in matrix.columns],
        "rows": [{"label": r.label, "case": r.case, "case_path": r.case_path,
                  "variant": r.variant,
                  "cells": [{"status": cell.status, "counts": dict(cell.counts),
                             "reasons": list(cell.reasons),
                             "devices": [{"device": d.device, "status": d.status,
                                          "reasons": list(d.reasons)} for d in cell.devices]}
                            for cell in r.cells]}
                 for r in matrix.rows],
        "notes": list(matrix.notes),
    }
    return json.dumps(_finite(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


_CSS = """
:root { color-scheme: light; font-family: system-ui, "Segoe UI", "DejaVu Sans", sans-serif;
  color: #1f2328; background: #fff; }
body { margin: 2rem; line-height: 1.45; }
h1 { font-size: 1.5rem; margin: 0 0 .25rem; }
h2 { font-size: 1.15rem; margin: 2rem 0 .5rem; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: 1rem 0; }
caption { text-align: left; font-weight: 600; padding-bottom: .5rem; }
th, td { border: 1px solid #d0d7de; padding: .4rem .7rem; }
thead th { background: #f6f8fa; vertical-align: bottom; min-width: 12rem; max-width: 20rem;
  font-size: .9rem; }
thead th .env { display: block; font-weight: 400; font-size: .8rem; color: #424a53;
  margin-top: .2rem; }
tbody th { text-align: left; font-weight: 600; font-family: ui-monospace, "DejaVu Sans Mono",
  monospace; font-size: .9rem; white-space: nowrap; }
td { text-align: left; white-space: nowrap; }
.device { display: block; font-weight: 600; }
.d-pass { color: #116329; } .d-fail { color: #a40e26; } .d-xfail { color: #7d4e00; }
.d-skip { color: #424a53; } .d-not-run { color: #59636e; font-weight: 400; }
.d-flaky { color: #6639ba; } .d-interrupted { color: #953800; }
.pass { background: #dafbe1; color: #116329; }
.fail { background: #ffebe9; color: #a40e26; }
.xfail { background: #fff8c5; color: #7d4e00; }
.skip { background: #eef1f4; color: #424a53; }
.not-run { background: #fff; color: #59636e; }
.flaky { background: #fbefff; color: #6639ba; }
.interrupted { background: #fff1e5; color: #953800; }
.partial { background: #f1f8ff; color: #0a3069; }
.incomplete { display: block; font-weight: 400; color: #7d4e00; }
sup { font-size: .75rem; margin-left: .1rem; }
sup a { color: inherit; text-decoration: underline; }
dl.legend { display: grid; grid-template-columns: max-content 1fr; gap: .3rem 1rem; }
dl.legend dt { padding: .1rem .5rem; border-radius: .25rem; text-align: center; }
dl.legend dd { margin: 0; }
ol.reasons li, ul.notes li { margin-bottom: .3rem; }
ol.reasons li:target { background: #fff8c5; }
dl.environments dt { font-weight: 600; margin-top: .5rem; }
dl.environments dd { margin-left: 1.5rem; }
"""


def _html_notes(reasons: Sequence[str], numbers: Mapping[str, int]) -> str:
    """One superscript for all the notes of a device: ``¹,²``, never ``12``."""
    if not reasons:
        return ""
    links = ",".join(f'<a href="#reason-{numbers[r]}" aria-label="note {numbers[r]}">'
                     f"{numbers[r]}</a>" for r in reasons)
    return f"<sup>{links}</sup>"


def render_html(matrix: Matrix) -> str:
    """The matrix as one self-contained HTML page: inline CSS, reasons listed below the table."""
    esc = html.escape
    numbers = _footnotes(matrix)
    cases = len({row.case_path for row in matrix.rows})
    title = "pytest-gpucase compatibility matrix"
    out = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>", f"<style>{_CSS}</style>", "</head>", "<body>", "<main>",
        f"<h1>{title}</h1>",
        (f"<p>{cases} {'case' if cases == 1 else 'cases'} in {len(matrix.columns)} "
         f"{'environment' if len(matrix.columns) == 1 else 'environments'}. A cell says what "
         "the runs of a case did on each device type, over its dtypes; a pass on the CPU says "
         "nothing of CUDA. Follow a note to see why a run did not pass.</p>"),
        '<div class="scroll" role="region" aria-labelledby="matrix-caption" tabindex="0">',
        "<table>", '<caption id="matrix-caption">Cases (rows) by environment (columns)</caption>',
        "<thead>", "<tr>",
        f'<th scope="col">{"case (variant)" if matrix.detail else "case"}</th>',
    ]
    for column in matrix.columns:
        sources = ", ".join(column.sources)
        flag = "" if column.complete else '<span class="incomplete">(incomplete run)</span>'
        out.append(f'<th scope="col" title="from {esc(sources)}">{esc(column.label)}{flag}'
                   f'<span class="env">{esc(column.description)}</span></th>')
    out += ["</tr>", "</thead>", "<tbody>"]
    for row in matrix.rows:
        out.append(f'<tr><th scope="row" title="{esc(row.case_path)}">{esc(row.label)}</th>')
        for column, cell in zip(matrix.columns, row.cells, strict=True):
            hover = "\n".join([f"{row.label} on {column.label}: {cell.status}",
                               _counts_text(cell), *cell.reasons])
            css = cell.status.replace(" ", "-")
            body = "".join(
                f'<span class="device d-{device.status.replace(" ", "-")}">'
                f"{_HTML_SYMBOLS[device.status]} {esc(device.text)}"
                f"{_html_notes(device.reasons, numbers)}</span>" for device in cell.devices)
            out.append(f'<td class="{css}" title="{esc(hover)}">{body}</td>')
        out.append("</tr>")
    out += ["</tbody>", "</table>", "</div>", "<h2>Legend</h2>", '<dl class="legend">']
    for status in (*STATUSES, "partial"):
        out.append(f'<dt class="{status.replace(" ", "-")}">{_HTML_SYMBOLS[status]} '
                   f"{_DEVICE_WORDS[status]}</dt><dd>{esc(STATUS_MEANINGS[status])}"
                   f"{' (the colour of a cell)' if status == 'partial' else ''}</dd>")
    out.append("</dl>")
    if numbers:
        out += ["<h2>Why runs did not pass</h2>", '<ol class="reasons">']
        out += [f'<li id="reason-{n}" value="{n}">{esc(reason)}</li>'
                for reason, n in numbers.items()]
        out.append("</ol>")
    if matrix.notes:
        out += ["<h2>Notes</h2>", '<ul class="notes">']
        out += [f"<li>{esc(note)}</li>" for note in matrix.notes]
        out.append("</ul>")
    out += ["<h2>Environments</h2>", '<dl class="environments">']
    for column in matrix.columns:
        state = "" if column.complete else " The run did not finish."
        out.append(f"<dt>{esc(column.label)}</dt><dd>{esc(column.description)}<br>"
                   f"from {esc(', '.join(column.sources))}, started {esc(column.created)}."
                   f"{state}</dd>")
    out += ["</dl>", "</main>", "</body>", "</html>"]
    return "\n".join(out) + "\n"


Renderer = Callable[["Matrix"], str]
# The formats of ``gpucase matrix --format``; plugins add theirs (``add_renderers``).
RENDERERS: dict[str, Renderer] = {
    "markdown": render_markdown, "html": render_html, "json": render_json,
}


def add_renderers(results: Iterable[Mapping[str, Renderer] | None]) -> tuple[str, ...]:
    """Add the renderers plugins return from ``pytest_gpucase_report_formats`` to RENDERERS.

    ``results`` are the hook's results; returns the names added. A format name
    already taken is an error naming the format: a plugin adds formats, it never
    replaces one silently.
    """
    added: list[str] = []
    for found in results:
        for name, render in (found or {}).items():
            if RENDERERS.get(name, render) is not render:
                raise ValueError(f"pytest_gpucase_report_formats: format {name!r} is already "
                                 f"taken ({', '.join(RENDERERS)}); give yours another name")
            if not callable(render):
                raise TypeError(f"pytest_gpucase_report_formats: format {name!r} maps to "
                                f"{type(render).__name__}, not a callable taking a Matrix")
            RENDERERS[name] = render
            added.append(name)
    return tuple(added)


# ----------------------------------------------------------------------------- the command


def short_names(paths: Sequence[Path]) -> list[str]:
    """The shortest trailing parts of each path that tell the paths apart (runner-a/report.json)."""
    parts = [Path(path).parts or (str(path),) for path in paths]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


class UnreadableReports(ValueError):
    """Reports that cannot be merged; ``errors`` holds one ReportError per file."""

    def __init__(self, errors: Sequence[ReportError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(map(str, self.errors)))


def matrix_command(reports: Sequence[Path], *, detail: bool) -> Matrix:
    """``gpucase matrix``: merge JSON reports into a matrix (the command renders and prints it).

    Raises UnreadableReports naming every report that cannot be read, not just the first.
    """
    loaded = []
    problems = []
    for path in reports:
        try:
            loaded.append(load_report(path))
        except ReportError as exc:
            problems.append(exc)
    if problems:
        raise UnreadableReports(problems)
    return build_matrix(loaded, detail=detail, names=short_names(reports))


# --- the JSON record of an item, built from its pytest report -------------------------------


def spec_fields(spec: RunSpec, case_path: str | None = None) -> dict[str, Any]:
    """What the JSON report says of an item before it runs (set at collection);
    ``case_path``, the case's shown path, when the caller has it already.

    ``packages`` (only when there are some) names the distributions the item depends on:
    its ``[matrix.packages]`` and the one its ``call`` imports. It crosses to the process
    that writes the report (the xdist controller collects nothing), which records their
    versions in the report's environment; it is no key of the item's record.
    """
    from .environment import call_distributions

    fields: dict[str, Any] = {
        "case": spec.case.name,
        "case_path": display_posix(spec.case.path) if case_path is None else case_path,
        "device": spec.device,
        "dtype": spec.dtype,
        "variant": spec.variant.label if spec.variant is not None else None,
        "launch_blocking": spec.launch_blocking,
    }
    named = list(spec.case.matrix.packages)
    spelled = {canonical_name(name) for name in named}
    named += [name for name in call_distributions(spec.case.call)
              if canonical_name(name) not in spelled]
    if named:
        fields["packages"] = named
    return fields


def item_packages(report: pytest.TestReport) -> tuple[str, ...]:
    """The distributions a case item depends on, from its report (``spec_fields``)."""
    for name, value in report.user_properties:
        if name == "gpucase":
            return tuple(property_value(value).get("packages", ()))
    return ()


def verdict_fields(verdict: Verdict) -> dict[str, Any]:
    """What the JSON report says of a run's verdict (plain data: it crosses xdist)."""
    outcome = verdict.outcome
    return {
        "error_type": outcome.error_type,
        "message": outcome.summary,
        "max_abs": outcome.max_abs,
        "max_rel": outcome.max_rel,
        "triage": verdict.triage.to_dict() if verdict.triage is not None else None,
        "localized": verdict.localized.outcome.summary if verdict.localized is not None else None,
    }


def result_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The JSON record of an item once its outcome is known, from its pytest report."""
    from .report import property_value

    props: dict[str, Any] = {name: property_value(value) for name, value in
                             report.user_properties if name in ("gpucase", "gpucase_result")}
    if "gpucase" not in props:
        return None
    if report.when == "setup" and report.passed:
        return None  # the call phase will say
    if report.when == "teardown" and not report.failed:
        return None
    xfail = hasattr(report, "wasxfail")
    if report.when != "call":
        outcome = "skipped" if report.skipped else "error"
    elif report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    elif report.passed:
        outcome = "xpassed" if xfail else "passed"
    else:
        strict_xpass = "XPASS(strict)" in str(report.longrepr)
        outcome = "xpassed" if strict_xpass else "failed"
    skip_reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        skip_reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    record = item_record(report.nodeid, props["gpucase"], outcome, duration=report.duration,
                         skip_reason=skip_reason)
    record.update(props.get("gpucase_result", {}))
    if xfail and outcome == "xfailed":
        record["message"] = record["message"] or str(report.wasxfail)
    return record


def crash_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The record of a case item lost with a crashed pytest-xdist worker, from its node id.

    pytest-xdist reports such an item as failed in a phase named "???", with no user
    properties: the controller never collected it, so what it was is read from the id
    (``cases/ce/case.toml::ce[cuda-float32-batch[1]]``).
    """
    if report.when not in ("???", None) or not report.failed:
        return None
    fields = nodeid_fields(report.nodeid)
    if fields is None:
        return None
    return item_record(report.nodeid, fields, "failed", str(report.longrepr),
                       error_type="WorkerCrash", duration=report.duration)


def nodeid_fields(nodeid: str) -> dict[str, Any] | None:
    """What a case item is (``spec_fields``), read from its node id where the item is not
    at hand (``cases/ce/case.toml::ce[cuda-float32-batch[1]]``); None for another item."""
    from .backends import DEVICE_TYPES

    found = re.fullmatch(r"(?P<path>[^\[]+?)(?:/case\.toml)?::(?P<name>[^:\[]+)"
                         r"\[(?P<device>[a-z]+)-(?P<dtype>[a-z0-9]+)(?:-(?P<kind>[a-z]+)\[(?P<value>-?\d+)\])?\]",
                         nodeid)
    if found is None or found["device"] not in DEVICE_TYPES:
        return None
    variant = f"{found['kind']}={found['value']}" if found["kind"] else None
    return {"case": found["name"], "case_path": found["path"], "device": found["device"],
            "dtype": found["dtype"], "variant": variant, "launch_blocking": False}


def item_record(nodeid: str, fields: Mapping[str, Any], outcome: str,
                message: str | None = None, *, error_type: str | None = None,
                duration: float = 0.0, skip_reason: str | None = None) -> dict[str, Any]:
    """An item's JSON record: what it is (``spec_fields``) and its outcome, the verdict's
    fields empty. A run's verdict fills them in (``result_record``); an item that got none
    keeps them: lost with an xdist worker (``failed``), running when the run was cancelled
    (``interrupted``), or never started (``not run``)."""
    record = {"nodeid": nodeid, **fields}
    record.pop("packages", None)   # the environment's, recorded there (spec_fields)
    record.update({"outcome": outcome, "error_type": error_type, "message": message,
                   "max_abs": None, "max_rel": None, "duration": round(duration, 6),
                   "skip_reason": skip_reason, "triage": None, "localized": None})
    return record

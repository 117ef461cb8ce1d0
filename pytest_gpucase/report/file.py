"""The JSON report of a run: its schema facts, writing it, and reading one back checked.

The JSON report (schema in docs/report-schema.md) is the one file a run leaves
behind; ``gpucase matrix`` reads several of them, one per runner (``report.matrix``),
and shows which cases pass where. Everything here is pure data in, text out: no torch,
no pytest, so the command stays fast and the functions are tested directly.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_gpucase.base.errors import printable
from pytest_gpucase.base.files import (
    FileTooLarge,
    NotRegularFile,
    read_regular,
    write_text_atomic,
)
from pytest_gpucase.base.text import one_line
from pytest_gpucase.base.version import __version__
from pytest_gpucase.plan.environment import Device, Environment, build_label

__all__ = [
    "ENVIRONMENT_IDENTITY",
    "FAILING",
    "MATRIX_SCHEMA",
    "MATRIX_VERSION",
    "MAX_DEPTH",
    "MAX_REPORT_BYTES",
    "MAX_STRING",
    "OUTCOMES",
    "SCHEMA",
    "VERSION",
    "ReportError",
    "check_report",
    "describe_environment",
    "json_safe",
    "load_report",
    "new_report",
    "now",
    "property_json",
    "property_value",
    "report_version",
    "write_report",
]

SCHEMA = "pytest-gpucase/report"
VERSION = 2          # the newest version this module reads; a writer writes the lowest that fits
MATRIX_SCHEMA = "pytest-gpucase/matrix"
MATRIX_VERSION = 1

FAILING = ("failed", "error", "xpassed")  # a strict xfail that passed fails the run too

# Outcomes a version-1 report may hold; "interrupted" (the item that ran when the run was
# cancelled) and "not run" (selected, never started) came with version 2.
_V1_OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")

REASON_WORDS = {
    "failed": "failed", "error": "error", "xpassed": "passed although marked xfail (strict)",
    "xfailed": "xfail", "skipped": "skipped", "interrupted": "interrupted",
    "not run": "not run",
}
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# What a version-1 file must hold, read from the JSON Schema shipped with the package (the one
# home of these facts; docs/report-schema.md explains them). Readers ignore keys they do not
# know, so that a writer may add a key without breaking older readers (removing or changing
# one bumps VERSION). The check is hand-written, not jsonschema's: its messages name the
# file, the place and the fix the way every other message here does, with no new dependency.
SCHEMA_FILE = "report_schema.json"
_SCHEMA: Mapping[str, Any] = json.loads(
    resources.files("pytest_gpucase").joinpath(SCHEMA_FILE)
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


# Bounds on a report read from disk, checked before the work they bound (a report is
# untrusted input: an artifact of another job, a file anyone may have written). An honest
# report holds about a kilobyte per item and nests 5 levels deep.
MAX_REPORT_BYTES = 128 * 2**20
MAX_DEPTH = 32
MAX_STRING = 2**20          # characters of any one string (a node id, a package name)
_MAX_NUMBER = 40            # characters of a number as written: a 5000-digit one is refused
_MAX_SHOWN = 80             # characters of a value quoted in a refusal
_MAX_MESSAGE = 1000         # characters of a refusal, which is one line


class ReportError(ValueError):
    """A JSON report that cannot be read as written: one line naming the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(one_line(f"{printable(str(path))}: {problem}", _MAX_MESSAGE))


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
    text = json.dumps(json_safe(report), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
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
    return json.dumps(json_safe(value), sort_keys=True, ensure_ascii=False, allow_nan=False)


def property_value(value: Any) -> Any:
    """A user property written by ``property_json``, as data again."""
    return json.loads(value) if isinstance(value, str) else value


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def load_report(path: Path | str) -> dict[str, Any]:
    """Read and validate one JSON report; ``ReportError`` names the file and what is wrong.

    The file is untrusted: its type and size are checked before it is read (a FIFO or a
    device is refused without blocking), its nesting before it is parsed, and while it is
    parsed every number is bounded, a repeated key refused and NaN refused; then every
    value is checked against the schema, strings are bounded, and a result that claims a
    run on a device type its environment lacks is refused. Free text (messages, reasons)
    is cut to its head and tail as the writer cuts what a run returns.
    """
    text = _read_bounded(path)
    report = _parse(path, text)
    if not isinstance(report, dict):
        raise ReportError(path, f"not a pytest-gpucase report: the top level is {_kind(report)}, "
                                "expected an object")
    if report.get("schema") != SCHEMA:
        found = "missing" if "schema" not in report else _shown(report["schema"])
        raise ReportError(path, f"not a pytest-gpucase report: \"schema\" is {found}, "
                                f"expected \"{SCHEMA}\"")
    version = report.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise ReportError(path, f"report version {version} is newer than this pytest-gpucase "
                                f"reads (up to {VERSION}); upgrade pytest-gpucase")
    check_report(report, path)
    _check_claims(path, report)
    # Here, not at the top: every pytest session imports this module (its report's time).
    from pytest_gpucase.run.isolation import clip

    for result in report["results"]:
        for key in ("max_abs", "max_rel"):
            if isinstance(result[key], str):
                result[key] = _NON_FINITE[result[key]]
        for key in _FREE_TEXT:
            if isinstance(result.get(key), str):
                result[key] = clip(result[key])
    return report


# What a person reads, of any length a run gave it: cut as a run's own result is cut.
_FREE_TEXT = ("message", "skip_reason", "localized", "error_type")


def _read_bounded(path: Path | str) -> str:
    """The text of a regular file of at most ``MAX_REPORT_BYTES`` (``read_regular``: a FIFO
    or a device is refused without blocking), whose nesting is bounded."""
    try:
        data = read_regular(path, MAX_REPORT_BYTES)
    except NotRegularFile as exc:
        raise ReportError(path, f"is {exc.kind}, not a regular file; give the JSON report "
                                "that --gpu-cases-report wrote") from None
    except FileTooLarge as exc:
        raise ReportError(path, f"is {exc.size} bytes, over the limit of {MAX_REPORT_BYTES} "
                                "for a report") from None
    except OSError as exc:
        raise ReportError(path, f"cannot read: {exc.strerror or exc}") from None
    if not _nesting_bounded(data):
        raise ReportError(path, f"not a pytest-gpucase report: arrays and objects nest deeper "
                                f"than {MAX_DEPTH} levels")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(path, f"cannot read: not UTF-8 ({exc.reason} at byte {exc.start})"
                          ) from None


# A JSON string, whatever it holds (an escaped quote included): its brackets are not structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _nesting_bounded(data: bytes) -> bool:
    """Whether ``data`` nests at most about ``MAX_DEPTH`` levels, found before any parser
    recurses into it (200,000 nested arrays end json's parser with a RecursionError, or a
    crash where the recursion limit was raised). The brackets outside strings are paired
    off innermost first, a level or two per round, each round a C-speed pass; what cannot
    be paired (a truncated file) is left for the parser, whose depth it then bounds."""
    skeleton = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH + 1):
        paired = skeleton.replace(b"[]", b"").replace(b"{}", b"")
        if len(paired) == len(skeleton):
            return len(skeleton) <= MAX_DEPTH
        skeleton = paired
    return not skeleton


class _Refused(Exception):
    """Raised from inside the JSON parser's hooks: what is wrong with the text."""


def _integer(text: str) -> int:
    if len(text) > _MAX_NUMBER:
        raise _Refused(f"an integer of {len(text)} digits; a report holds no number that long")
    return int(text)


def _number(text: str) -> float:
    if len(text) > _MAX_NUMBER:
        raise _Refused(f"a number written with {len(text)} characters; a report holds no "
                       "number that long")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} overflows a float; non-finite values are written \"inf\"")
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON; non-finite values are written \"nan\", \"inf\", "
                   "\"-inf\"")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            # {"outcome": "failed", "outcome": "passed"} read as a pass by any other reader.
            raise _Refused(f"the key {_shown(key)} appears twice in one object")
        found[key] = value
    return found


def _parse(path: Path | str, text: str) -> Any:
    """``text`` as JSON, strictly (see ``load_report``), every string bounded and printable."""
    try:
        data = json.loads(text, object_pairs_hook=_object, parse_int=_integer,
                          parse_float=_number, parse_constant=_constant)
    except _Refused as exc:
        raise ReportError(path, f"not a pytest-gpucase report: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(path, f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None
    except RecursionError:  # bounded by _nesting_bounded; said rather than raised regardless
        raise ReportError(path, f"not a pytest-gpucase report: arrays and objects nest deeper "
                                f"than {MAX_DEPTH} levels") from None
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ReportError(path, f"not a pytest-gpucase report: arrays and objects nest "
                                    f"deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            items = list(value.items())
            value.clear()
            for key, item in items:
                shown = _check_string(path, key)
                if shown in value:   # two keys that differ only in bytes that are not UTF-8
                    raise ReportError(path, f"not a pytest-gpucase report: the key "
                                            f"{_shown(shown)} appears twice in one object")
                if isinstance(item, str):
                    item = _check_string(path, item)
                else:
                    stack.append((item, depth + 1))
                value[shown] = item
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, str):
                    value[index] = _check_string(path, item)
                else:
                    stack.append((item, depth + 1))
    if isinstance(data, str):
        data = _check_string(path, data)
    return data


def _check_string(path: Path | str, text: str) -> str:
    """``text`` when it is at most ``MAX_STRING`` characters; a lone surrogate (a name that
    was not UTF-8) shown as ``\\xNN``, so that it can be printed and written."""
    if len(text) > MAX_STRING:
        raise ReportError(path, f"not a pytest-gpucase report: a string of {len(text)} "
                                f"characters, over the limit of {MAX_STRING}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return printable(text)
        except UnicodeEncodeError:
            return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _shown(value: Any) -> str:
    """A value quoted in a refusal, as JSON (ASCII: nothing in it can act on a terminal),
    cut short."""
    text = json.dumps(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 1] + "…"


# Outcomes that say a run happened (not a skip, not a run a cancel or a lost worker cut
# short, which a device type missing here can still name).
_RAN = frozenset({"passed", "failed", "xfailed", "xpassed"})


def _check_claims(path: Path | str, report: Mapping[str, Any]) -> None:
    """Refuse a report that claims what its own environment says cannot have happened: a
    run on a device type it lacks (a passed CUDA item from a CPU-only runner would read as
    CUDA compatibility), or an accelerator type with no device; and one that holds an item
    twice (which record would a reader take?)."""
    seen: dict[str, int] = {}
    for index, result in enumerate(report["results"]):
        first = seen.setdefault(result["nodeid"], index)
        if first != index:
            raise ReportError(path, f"results[{index}].nodeid: {_shown(result['nodeid'])} is "
                                    f"the node id of results[{first}] too; a report holds each "
                                    "item once")
    environment = report["environment"]
    types = set(environment["device_types"]) - {"all"}
    accelerators = sorted(types - {"cpu"})
    if accelerators and not environment["devices"]:
        raise ReportError(path, f"environment.device_types names {_shown(accelerators[0])} but "
                                "environment.devices lists no device: not the environment of "
                                "a run")
    for index, result in enumerate(report["results"]):
        device, outcome = result["device"], result["outcome"]
        if device in types or outcome not in _RAN:
            continue
        # Failures that name no device the run had: a broken case ("all", every device
        # type), an item lost with its worker (read from its id, maybe while skipping).
        if outcome == "failed" and (device == "all" or result["error_type"] == "WorkerCrash"):
            continue
        shown = ", ".join(_shown(kind) for kind in sorted(types)) or "none"
        raise ReportError(path, f"results[{index}]: {outcome} on {_shown(device)}, a "
                                f"device type its environment does not have (device_types: "
                                f"{shown}): a run that cannot have happened there")


def check_report(report: Mapping[str, Any], path: Path | str = "<report>") -> None:
    """Check a report against the schema; ``ReportError`` says where it breaks it.

    ``load_report`` checks what it reads with it, and the plugin what it is about to write.
    """
    version = report.get("version")
    _check_keys(path, report, _TOP_KEYS, "")
    _check_keys(path, report, {key: kind for key, kind in _OPTIONAL_TOP_KEYS.items()
                               if key in report}, "")
    if version not in range(1, VERSION + 1) or isinstance(version, bool):
        raise ReportError(path, f"version: {_shown(version)} is not a report version "
                                f"this pytest-gpucase reads (1 to {VERSION})")
    _check_created(path, report["created"])
    environment = report["environment"]
    _check_keys(path, environment, _ENVIRONMENT_KEYS, "environment")
    for index, device in enumerate(environment["devices"]):
        _check_keys(path, device, _DEVICE_KEYS, f"environment.devices[{index}]")
    for name, version_found in environment["packages"].items():
        if not _is(version_found, "string or null"):
            raise ReportError(path, f"environment.packages.{one_line(name, _MAX_SHOWN)}: expected "
                                    f"a string or null, found {_kind(version_found)}")
    _check_builds(path, environment.get("builds", {}))
    for index, result in enumerate(report["results"]):
        where = f"results[{index}]"
        _check_keys(path, result, _RESULT_KEYS, where)
        optional = {key: kind for key, kind in _OPTIONAL_RESULT_KEYS.items() if key in result}
        _check_keys(path, result, optional, where)
        if result["outcome"] not in OUTCOMES:
            raise ReportError(path, f"{where}.outcome: {_shown(result['outcome'])} is not "
                                    f"one of {', '.join(OUTCOMES)}")
        if version == 1 and result["outcome"] not in _V1_OUTCOMES:
            raise ReportError(path, f"{where}.outcome: {_shown(result['outcome'])} needs "
                                    "report version 2; write \"version\": 2")


def _check_builds(path: Path | str, builds: Any) -> None:
    """``environment.builds`` (optional): package -> {fingerprint, tag, torch}, strings or null."""
    if not isinstance(builds, dict):
        raise ReportError(path, f"environment.builds: expected an object, found {_kind(builds)}")
    for name, build in builds.items():
        where = f"environment.builds.{one_line(name, _MAX_SHOWN)}"
        if not isinstance(build, dict):
            raise ReportError(path, f"{where}: expected an object, found {_kind(build)}")
        for key, value in build.items():
            if not _is(value, "string or null"):
                raise ReportError(path, f"{where}.{one_line(key, _MAX_SHOWN)}: expected a "
                                        f"string or null, found {_kind(value)}")


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
        raise ReportError(path, f"created: {_shown(created)} is not an ISO 8601 time"
                          ) from None
    # Reports of one environment are ordered by this time; a naive time cannot be compared.
    if moment.tzinfo is None:
        raise ReportError(path, f"created: {_shown(created)} has no UTC offset")


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
    builds = environment.get("builds") or {}
    line = env.header().removeprefix("gpucase: ")
    for name, version in sorted(env.packages.items()):
        line += f" · {name} {version}" if version else f" · {name} not installed"
        if version and isinstance(builds.get(name), Mapping):
            line += f" ({build_label(builds[name])})"
    return line

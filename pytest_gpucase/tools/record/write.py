"""The case a failure becomes, and writing it: the draft (call, summary, the expect policy's
xfail line, the ``[origin]`` table), its ``case.toml`` document, a free name claimed and the
directory written whole, a rerun's same failure counted in the case it wrote before instead
of copied, ``[origin] later_errors`` rewritten, and the sizes the saved lines show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from pytest_gpucase.base import backends, files
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import MODULE_KEY as REPLAY_MODULE_KEY
from pytest_gpucase.case.keys import REPLAY_MODULE
from pytest_gpucase.case.model import CASE_FILE, INPUTS_FILE, MAX_CASE_BYTES, VERSION_KEYS
from pytest_gpucase.case.write import FileContent, write_case_dir
from pytest_gpucase.tools.record.distributed import Rank
from pytest_gpucase.tools.record.inputs import Inputs
from pytest_gpucase.tools.record.packages import declared_packages
from pytest_gpucase.tools.record.origin import (
    ORIGIN_ERROR_CHARS,
    SUMMARY_ERROR_CHARS,
    Context,
    Watched,
    case_name,
    error_line,
    message_of,
    mib,
    say,
    shown,
    user_label,
    where,
)
from pytest_gpucase.verdict.failure import cut
from pytest_gpucase.verdict.triage import assertion_line, current_class

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

__all__ = [
    "Draft",
    "case_bytes",
    "case_draft",
    "context_doc",
    "fit_name",
    "mark_incomplete",
    "origin_only",
    "recapture",
    "set_later_errors",
    "sized",
    "without_secrets",
    "write_case",
    "write_kept",
]

# A "gpucase: saved" line shows the case's size from this size on.
_SHOWN_SIZE = 2**20
STUB_FILE = "case.py"
_STDERR_LINES = 10
_MAX_NAMES = 10_000


@dataclass(frozen=True)
class Draft:
    """Everything a case directory will hold, before it is written."""

    name: str
    call: str
    summary: str
    xfail: str | None
    literals: Mapping[str, Any]
    origin: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]
    files: Mapping[str, str]
    context: Mapping[str, Any] = field(default_factory=dict)


def case_draft(exc: BaseException, watched: Watched | None, inputs: Inputs, context: Context,
               ids: tuple[str | int, ...] | None, stderr_text: str,
               device_names: Mapping[str, str], *, what: str | None = None,
               incomplete: tuple[str, ...] = (), origin: Mapping[str, Any] | None = None,
               files: Mapping[str, str] | None = None, call: str | None = None,
               literals: Mapping[str, Any] | None = None, rank: Rank | None = None) -> Draft:
    """The case of a failure: its call (or a stand-in ``case.py``), summary, xfail line (none
    when the case is incomplete) and ``[origin]`` table; ``device_names`` are the names the
    devices gave while they answered. ``what`` names what raised in the summary, ``incomplete``
    adds reasons the case cannot replay, ``origin`` entries, ``files`` (name -> text) files
    of the case, ``call`` and ``literals`` replace the watched call's, ``rank`` is the
    process's place in a run of several."""
    import torch

    error = error_line(exc)
    case_files: dict[str, str] = dict(files or {})
    name, label, reasons = _name_label_reasons(watched, inputs, context, what=what,
                                               incomplete=incomplete, call=call)
    reasons.extend(incomplete)
    if inputs.snapshot is not None and inputs.snapshot.startswith("not saved"):
        reasons.append(_rebuild_hint(inputs, ids))
    if call is None:
        call = watched.call if watched is not None and watched.call else f"{STUB_FILE}:run"
    if call == f"{STUB_FILE}:run" and STUB_FILE not in case_files:
        case_files[STUB_FILE] = _stub(reasons[0] if reasons else "no call was recorded")
    # A message that already says where (the nonfinite check's "(at iteration 3)") is not
    # told it twice.
    place = where(context)
    told = f" (at iteration {context.iteration})"
    if f"at iteration {context.iteration}" in place and error.endswith(told):
        error = error[:-len(told)]
    summary = f"{label} raised {error}{place}"
    if reasons:
        summary = f"INCOMPLETE: {'; '.join(reasons)}. Captured: {summary}"
    table: dict[str, Any] = _failure_entries(exc, stderr_text)
    table.update(_context_entries(context))
    table.update(_build_entries(inputs.devices, device_names, torch))
    table.update(_run_entries(rank, ids, inputs.snapshot))
    table.update(origin or {})
    table["captured"] = datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    table["later_errors"] = 0
    if reasons:
        table["incomplete"] = reasons
    if inputs.described:
        table["inputs"] = dict(inputs.described)
    if inputs.skipped:
        table["skipped_inputs"] = dict(inputs.skipped)
    xfail = None if reasons else _xfail_line(error)
    return Draft(name=name, call=call, summary=summary, xfail=xfail,
                 literals={**inputs.literals, **dict(literals or {})}, origin=table,
                 tensors=inputs.tensors, files=case_files)


def _name_label_reasons(watched: Watched | None, inputs: Inputs, context: Context, *,
                        what: str | None, incomplete: tuple[str, ...],
                        call: str | None) -> tuple[str, str, list[str]]:
    """The case's name, the summary's label of what raised, and the first incomplete reasons."""
    reasons = list(inputs.problems)
    if watched is None:
        name = case_name(what or (f"step_{context.stage}" if context.stage else "failure"))
        if not incomplete:
            reasons.insert(0, "the failure happened outside any watched call, so no inputs "
                           "were saved: watch the function that raised with rec.watch(fn)")
        return name, what or "a step", reasons
    label = user_label(watched.fn) or watched.name
    # An importable call names where the code lives (``pkg.losses:loss_fn``); a stand-in
    # ``case.py`` of the case's own (a script's function, a rebuilt model) names nothing the
    # user wrote, so the function's own name is the label.
    if watched.call and watched.call != REPLAY_MODULE and not watched.call.startswith(
            f"{STUB_FILE}:"):
        label = watched.call
    if watched.call is None and call is None:
        reasons.insert(0, watched.why_not)
    return watched.name, what or label, reasons


def _failure_entries(exc: BaseException, stderr_text: str) -> dict[str, Any]:
    """The ``[origin]`` entries of the error itself: its line, failure class and stderr."""
    table: dict[str, Any] = {"error": error_line(exc, ORIGIN_ERROR_CHARS)}
    with contextlib.suppress(Exception):
        from pytest_gpucase.verdict.triage import failure_class

        kind = failure_class(type(exc).__name__, message_of(exc), stderr_text)
        if kind is not None:
            table["failure_class"] = kind
    excerpt = _stderr_excerpt(stderr_text)
    if excerpt:
        table["stderr"] = excerpt
    return table


def _context_entries(context: Context) -> dict[str, Any]:
    """The ``[origin]`` entries of where in the run it failed: those the context knows."""
    values = {"iteration": context.iteration, "stage": context.stage,
              "last_step": context.last_step}
    return {key: value for key, value in values.items() if value is not None}


def _run_entries(rank: Rank | None, ids: tuple[str | int, ...] | None,
                 snapshot: str | None) -> dict[str, Any]:
    """The ``[origin]`` entries of the process's rank, the sample ids and the snapshot."""
    table: dict[str, Any] = {}
    if rank is not None:
        table.update(rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size)
    if ids is not None:
        kept = _kept_ids(ids)
        table["sample_ids"] = list(kept)
        if len(kept) < len(ids):  # the first len(kept) of them
            table["sample_ids_total"] = len(ids)
    if snapshot is not None:
        table["snapshot"] = snapshot
    return table


# The text [origin] sample_ids may take: case.toml is read within MAX_CASE_BYTES (1 MiB),
# and the ids of a batch of a hundred thousand samples would make the case unloadable.
_IDS_BYTES = 2**18


def _kept_ids(ids: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """The first of ``ids`` whose text fits ``_IDS_BYTES`` (JSON's escaping: an upper bound
    of TOML's)."""
    size = 0
    for count, one in enumerate(ids):
        size += len(json.dumps(one)) + 8  # with the comma, the indent and the line's end
        if size > _IDS_BYTES:
            return ids[:count]
    return ids


def _build_entries(devices: tuple[str, ...], device_names: Mapping[str, str],
                   torch: Any) -> dict[str, Any]:
    """The ``[origin]`` entries of the build: revision, versions, backend and device."""
    backend = _backend(devices, torch)
    table: dict[str, Any] = {}
    revision = _revision()
    if revision:
        table["revision"] = revision
    table["python"] = platform.python_version()
    table["torch"] = torch.__version__
    table["backend"] = backend
    device = next((d for d in devices if d != "cpu"), None)
    if device is not None:
        table["device"] = device_names.get(device, device)
    # The build's version where [matrix] can require it (cuda, hip): backends.py says which.
    row = backends.backend(backend)
    version = getattr(torch.version, row.version, None) if row and row.version else None
    if row is not None and row.version in VERSION_KEYS and version:
        table[row.version] = version
    return table


def _rebuild_hint(inputs: Inputs, ids: tuple[str | int, ...] | None) -> str:
    missing = sorted(set(inputs.described) - set(inputs.tensors) - set(inputs.skipped))
    names = ", ".join(missing)
    if ids:
        source = (f"rebuild the batch from the {len(ids)} [origin] sample_ids with the same data "
                  "pipeline")
    else:
        source = ("no sample ids were recorded (pass rec.step(it, stage, ids=...) or "
                  "rec.watch(fn, ids=...) next time), so rebuild the batch from the iteration")
    why = (inputs.snapshot or "").removeprefix("not saved: ")
    return (f"{names} not saved ({why}): {source}, then save it with "
            f"pytest_gpucase.payload.save(<case>/{INPUTS_FILE}, {{...}}) under the names {names}")


def _revision() -> str | None:
    """``git describe`` of the working directory, if it is a repository (bounded in time)."""
    from pytest_gpucase.plan.environment import git_revision

    try:
        return git_revision(os.getcwd())
    except OSError:
        return None


def _stderr_excerpt(text: str) -> str | None:
    """The kernel's assertion line if stderr holds one, else its last few lines."""
    if not text.strip():
        return None
    line = assertion_line(text)
    if line is not None:
        return line
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-_STDERR_LINES:])


def _backend(devices: tuple[str, ...], torch: Any) -> str:
    kinds = [d.split(":")[0] for d in devices if not d.startswith("cpu")]
    if not kinds:
        return "cpu"
    return backends.run_backend(kinds[0], backends.detect(torch))


def _stub(reason: str) -> str:
    message = json.dumps(f"gpucase: this case cannot be replayed as captured: {reason}",
                         ensure_ascii=False)
    return (
        '"""Stand-in written by pytest_gpucase.capture: the failing call could not be named."""\n'
        "\n\n"
        "def run(**inputs: object) -> object:\n"
        f"    raise NotImplementedError({message})\n"
    )


def _case_document(draft: Draft) -> dict[str, Any]:
    """The ``case.toml`` document of a draft."""
    doc: dict[str, Any] = {"format": 1, "summary": draft.summary, "call": draft.call}
    if draft.xfail is not None:
        doc["xfail"] = draft.xfail
    if draft.literals:
        doc["inputs"] = dict(draft.literals)
    # No [expect.tolerance]: an explicit table is applied exactly as written, with no
    # rounding budget, so any fixed figure fails a correct model somewhere (a bf16 model
    # rounds at every layer). The verdict's default rule judges the replay: the run's
    # precision (the autocast dtype), then the computation's rounding budget.
    doc["expect"] = {"outcome": "matches"}
    packages: dict[str, str] = {}
    with contextlib.suppress(Exception):  # never over the failure: the case replays as is
        packages = declared_packages(draft.call, draft.literals, draft.files)
    if packages:
        # A runner without a framework the case imports skips it, saying which.
        doc["matrix"] = {"packages": packages}
    if draft.context:
        doc["context"] = dict(draft.context)
    doc["origin"] = dict(draft.origin)
    return doc


def _claim(root: Path, name: str) -> Path:
    """Create the first free ``name``, ``name-2``, ... as an empty directory; mkdir is the lock."""
    for number in itertools.count(1):
        candidate = root / (name if number == 1 else f"{name}-{number}")
        try:
            candidate.mkdir()
        except FileExistsError:
            if number >= _MAX_NAMES:
                raise
            continue
        return candidate
    raise AssertionError("unreachable")  # itertools.count never ends


def write_case(root: Path, draft: Draft) -> tuple[Path, bool]:
    """Write a case directory atomically under ``root``; never overwrite one. Returns the
    case and whether this call wrote it.

    A rerun that hits the same failure (same call, failure class and inputs) finds the
    case it wrote before: that one's ``[origin] seen`` and ``last_seen`` are updated instead,
    and it is returned with False.
    """
    written, new = write_kept(root, draft, None)
    assert written is not None  # nothing to refuse without ``keep``
    return written, new


class _NotWritten(Exception):
    """The staged case is not kept: the same failure was saved before, or ``keep`` said no."""

    def __init__(self, existing: Path | None) -> None:
        super().__init__(str(existing))
        self.existing = existing


def write_kept(root: Path, draft: Draft, keep: Callable[[Path], bool] | None,
                ) -> tuple[Path | None, bool]:
    """Write a case as ``write_case`` does, once ``keep(staged directory)`` says yes.

    Returns the case and whether this call wrote it: (None, False) when ``keep`` said
    no, (the earlier case, False) when it holds the same failure.

    ``write_case_dir`` writes it into a hidden temporary directory beside the
    target (hidden directories are not collected), ``case.toml`` last; the directory
    is then renamed onto a freshly claimed empty name.
    """
    draft = dataclasses.replace(without_secrets(draft), name=fit_name(draft.name))
    files: dict[str, FileContent] = dict(draft.files)
    if draft.tensors:
        tensors = draft.tensors
        files[INPUTS_FILE] = lambda path: _save_inputs(path, tensors)

    def check(staged: Path) -> None:
        size = (staged / CASE_FILE).stat().st_size
        if size > MAX_CASE_BYTES:  # every reader refuses it: the origin-only case instead
            raise ValueError(f"its {CASE_FILE} would be {size} bytes, over the {MAX_CASE_BYTES} "
                             "every reader takes (a literal argument too large for it)")
        seen = _same_failure_case(root, draft, staged)
        if seen is not None:
            raise _NotWritten(seen)
        if keep is not None and not keep(staged):
            raise _NotWritten(None)

    try:
        written = write_case_dir(root / draft.name, _case_document(draft), files,
                                 check=check, claim=lambda: _claim(root, draft.name))
        return written, True
    except _NotWritten as stop:
        if stop.existing is not None:
            _count_seen(stop.existing)
        return stop.existing, False


_MAX_SCRUBBED_NAMES = 50


def without_secrets(draft: Draft) -> Draft:
    """``draft`` with no secret in what it writes as text (``tools.scrub``: the rules
    ``gpucase request`` applies, URLs kept but for their credentials, the home as ``~``):
    its summary, xfail line, ``[origin]`` (error, stderr, sample ids), literal arguments
    and the JSON files it writes (``model.json``'s hyperparameters, a ``config.json``);
    fields whose names say they hold a secret (``wandb_api_key``, ``hub_token``) become
    ``<secret>``. ``[origin] scrubbed`` lists where, and a line says so."""
    from pytest_gpucase.tools.scrub import capture_text, scrub_data

    removed: list[str] = []
    summary = scrub_data(draft.summary, removed, "summary")
    xfail = None if draft.xfail is None else scrub_data(draft.xfail, removed, "xfail")
    # Fields are told secret by their names in hyperparameters only: an input's name
    # ("tokens") says nothing of its value.
    literals = scrub_data(dict(draft.literals), removed, "inputs", fields=False)
    recipe = literals.get(REPLAY_MODULE_KEY)
    if isinstance(recipe, dict) and isinstance(recipe.get("kwargs"), dict):
        literals[REPLAY_MODULE_KEY] = {**recipe, "kwargs": scrub_data(
            recipe["kwargs"], removed, f"inputs.{REPLAY_MODULE_KEY}.kwargs")}
    origin = scrub_data(dict(draft.origin), removed, "origin", fields=False)
    case_files = dict(draft.files)
    for name, text in draft.files.items():
        if name.endswith(".json"):
            try:
                data = json.loads(text)
            except ValueError:
                continue
            found: list[str] = []
            cleaned = scrub_data(data, found, "")
            if found:
                case_files[name] = json.dumps(cleaned, indent=2) + "\n"
                removed.extend(f"{name}: {place}" for place in found)
        elif name == STUB_FILE and capture_text(text) != text:
            case_files[name] = capture_text(text)
            removed.append(name)
    if not removed:
        return draft
    places = sorted(set(removed))
    shown_places = places[:_MAX_SCRUBBED_NAMES] + (
        [f"and {len(places) - _MAX_SCRUBBED_NAMES} more"]
        if len(places) > _MAX_SCRUBBED_NAMES else [])
    origin["scrubbed"] = shown_places
    rebuilt = [p for p in places if p.startswith(("model.json", "config.json",
                                                  f"inputs.{REPLAY_MODULE_KEY}"))]
    if rebuilt:
        origin["scrubbed_note"] = (
            "hyperparameters or config fields that held secrets (or the home folder) were "
            "rewritten: the replay builds the model with <secret> (or ~) in their place; "
            "where building the model needs them, the case says so in [origin] incomplete")
    say(f"gpucase: note: secrets removed from the case {draft.name} before it was written "
        f"({', '.join(shown_places[:6])}{', ...' if len(shown_places) > 6 else ''}): "
        "[origin] scrubbed lists where")
    return dataclasses.replace(draft, summary=summary, xfail=xfail, literals=literals,
                               origin=origin, files=case_files)


# A case's name in bytes at most: its staging name adds about 35 (``.<name>.<host>.<pid>.
# <token>.tmp``) and a free name ``-N``, and some file systems hold 143 bytes (eCryptfs).
MAX_NAME_BYTES = 100


def fit_name(name: str) -> str:
    """``name`` when it fits ``MAX_NAME_BYTES``, else its beginning and a hash of the whole
    (``<first 91 bytes>-<8 hex>``): names of any length fit any file system, and two long
    names that begin alike stay apart."""
    import hashlib

    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_NAME_BYTES:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:8]
    head = raw[:MAX_NAME_BYTES - 9].decode("utf-8", "ignore").rstrip("._-")
    return f"{head}-{digest}"


def origin_only(draft: Draft, problem: BaseException) -> Draft:
    """The least a failure's case keeps when the whole case cannot be written (a payload the
    file system refused, a tensor with no values): its ``[origin]`` (error, iteration,
    sample ids, versions), incomplete, saying what is missing and why."""
    held = sorted(draft.tensors)
    missing = (f"its inputs ({', '.join(held[:6])}{', ...' if len(held) > 6 else ''})"
               if held else "its inputs")
    why = (f"the full case could not be written ({error_line(problem)}), so it holds the "
           f"failure's origin only (error, iteration, sample ids), not {missing}: capture "
           "it again once that is fixed, or rebuild them from the sample ids")
    origin = dict(draft.origin)
    origin["incomplete"] = [*origin.get("incomplete", []), why]
    captured = draft.summary.partition("Captured: ")[2] or draft.summary
    return Draft(name=draft.name, call=f"{STUB_FILE}:run",
                 summary=f"INCOMPLETE: {why}. Captured: {captured}", xfail=None,
                 literals={}, origin=origin, tensors={}, files={STUB_FILE: _stub(why)})


def _save_inputs(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """The payload of a case, its large tensors in the capture's store; when the store
    cannot be written (not writable, full) while the case folder can, they stay in the
    payload itself, said once."""
    try:
        payload.save(path, tensors, store=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        payload.save(path, tensors, store=False)
        say(f"gpucase: note: the store {shown(path.parent.parent / payload.STORE_DIR)} could "
            f"not be written ({exc.strerror or exc}): the case holds its tensors itself")


def _read_doc(case_dir: Path) -> dict[str, Any] | None:
    try:
        return tomllib.loads((case_dir / CASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _same_failure_case(root: Path, draft: Draft, staged: Path) -> Path | None:
    """An earlier case of ``draft.name`` (or ``name-N``) with the same call, failure class
    and inputs hash: the same failure, met again by a rerun."""
    failure = draft.origin.get("failure_class")
    if failure is None:
        return None
    mine = payload.content_hash(staged / INPUTS_FILE) if (staged / INPUTS_FILE).exists() else ""
    pattern = re.compile(rf"{re.escape(draft.name)}(-\d+)?")
    for candidate in sorted(root.iterdir()):
        if not pattern.fullmatch(candidate.name) or not candidate.is_dir():
            continue
        doc = _read_doc(candidate)
        if doc is None or doc.get("call") != draft.call:
            continue
        kind = doc.get("origin", {}).get("failure_class")   # "nan" from an earlier gpucase
        if not isinstance(kind, str) or current_class(kind) != failure:
            continue
        inputs = candidate / INPUTS_FILE
        theirs = payload.content_hash(inputs) if inputs.exists() else ""
        if theirs == mine:
            return candidate
    return None


def _count_seen(case_dir: Path) -> None:
    """``[origin] seen += 1`` and ``last_seen`` = today, rewritten atomically."""
    doc = _read_doc(case_dir)
    if doc is None:
        return
    origin = doc.setdefault("origin", {})
    origin["seen"] = int(origin.get("seen", 1)) + 1
    origin["last_seen"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    files.write_text_atomic(case_dir / CASE_FILE, tomli_w.dumps(doc))
    say(f"gpucase: the same failure as {shown(case_dir)} (seen {origin['seen']} "
        "times): its [origin] seen and last_seen were updated, no copy written")


def context_doc(case: Any) -> dict[str, Any]:
    """The ``[context]`` table of a written case, as its ``case.toml`` holds it."""
    doc = _read_doc(case.path)
    table = doc.get("context", {}) if doc else {}
    return dict(table) if isinstance(table, dict) else {}


def _rewrite(case_dir: Path, change: Callable[[dict[str, Any]], bool]) -> None:
    """Read a case's ``case.toml``, let ``change`` edit the document, and write it back in
    place, atomically (through tomli-w), unless ``change`` says there was nothing to do."""
    file = case_dir / CASE_FILE
    doc = tomllib.loads(file.read_text(encoding="utf-8"))
    if change(doc):
        files.write_text_atomic(file, tomli_w.dumps(doc))


def set_later_errors(case_dir: Path, count: int) -> None:
    """Rewrite ``[origin] later_errors`` of a case in place."""
    def change(doc: dict[str, Any]) -> bool:
        origin = doc.get("origin")
        if not isinstance(origin, dict) or "later_errors" not in origin:
            return False
        origin["later_errors"] = count
        return True

    _rewrite(case_dir, change)


def recapture(case_dir: Path, error: str, failure_class: str | None, compiled: str) -> None:
    """Make ``error`` (the eager replay's failure of a case captured from a compiled model)
    the case's captured failure: its xfail line, summary and ``[origin] error``; the
    compiled model's own error is kept as ``[origin] compiled_error``."""
    from pytest_gpucase.tools.scrub import capture_text

    def change(doc: dict[str, Any]) -> bool:
        origin = doc.setdefault("origin", {})
        before = _summary_error(str(origin.get("error", "")))
        origin["compiled_error"] = capture_text(compiled)
        origin["error"] = cut(capture_text(error), ORIGIN_ERROR_CHARS)
        origin.pop("stderr", None)  # the compiled run's; the eager failure is in the message
        if failure_class is None:
            origin.pop("failure_class", None)
        else:
            origin["failure_class"] = failure_class
        short = _summary_error(capture_text(error))
        if "xfail" in doc:
            doc["xfail"] = _xfail_line(short)
        if before and isinstance(doc.get("summary"), str):
            doc["summary"] = doc["summary"].replace(before, short)
        return True

    _rewrite(case_dir, change)


def mark_incomplete(case_dir: Path, reason: str) -> None:
    """Add ``reason`` to ``[origin] incomplete`` and drop the xfail line: the case does not
    replay its failure, and ``gpucase validate`` says why."""
    from pytest_gpucase.tools.scrub import capture_text

    def change(doc: dict[str, Any]) -> bool:
        origin = doc.setdefault("origin", {})
        origin["incomplete"] = [*origin.get("incomplete", []), capture_text(reason)]
        doc.pop("xfail", None)
        return True

    _rewrite(case_dir, change)


def _summary_error(error: str) -> str:
    """An ``[origin] error`` as a summary and an xfail line show it (``error_line``'s bound)."""
    return cut(error, SUMMARY_ERROR_CHARS)


def _xfail_line(error: str) -> str:
    """The xfail line of a case whose captured failure is ``error``."""
    return f"captured failure: {error}; remove this line once fixed"


def case_bytes(case_dir: Path, besides: Iterable[Path] = ()) -> int:
    """The bytes of the files a case directory holds, and of the store files its payload
    names that none of the cases ``besides`` names too (those it shares with them)."""
    try:
        own = sum(entry.stat().st_size for entry in os.scandir(case_dir) if entry.is_file())
    except OSError:
        return 0
    shared = set().union(*(_stored(other) for other in besides))
    return own + sum(_size(blob) for blob in _stored(case_dir) - shared)


def _stored(case_dir: Path) -> set[Path]:
    try:
        return set(payload.store_files(case_dir / INPUTS_FILE).values())
    except Exception:
        return set()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def sized(case_dir: Path) -> str:
    """``"98.1 MiB; "`` for a case of ``_SHOWN_SIZE`` or more (one to commit with care), else
    nothing."""
    size = case_bytes(case_dir)
    return f"{mib(size)}; " if size >= _SHOWN_SIZE else ""

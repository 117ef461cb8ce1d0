"""The compatibility matrix: reports grouped into environments (columns), their items merged
into rows of per-device cells, and ``gpucase matrix`` reading the files."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pytest_gpucase.plan.environment import build_label, canonical_name, dnn_library
from pytest_gpucase.report.file import (
    ENVIRONMENT_IDENTITY,
    FAILING,
    OUTCOMES,
    REASON_WORDS,
    ReportError,
    describe_environment,
    load_report,
)

__all__ = [
    "STATUSES",
    "STATUS_MEANINGS",
    "Cell",
    "Column",
    "DeviceCell",
    "Matrix",
    "Row",
    "Status",
    "UnreadableReports",
    "build_matrix",
    "matrix_command",
    "reason_text",
    "same_environment",
    "short_names",
]

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
    "partial": ("some runs passed; the others (other device types, or runs the session "
                "stopped before) were skipped or not run"),
}
DEVICE_WORDS: Mapping[Status, str] = {
    "pass": "pass", "fail": "fail", "flaky": "flaky", "xfail": "xfail", "skip": "skipped",
    "interrupted": "interrupted", "not run": "not run", "partial": "partial",
}
_SHORT_REASON = 48   # characters of a skip reason said in the cell; the note holds all of it
# Which outcome of an item is shown when reports of one environment started at the same
# moment (which ran later is unknown): the worse one, so that a tie never hides a failure.
_SEVERITY = {"not run": 0, "skipped": 1, "passed": 2, "xfailed": 3, "interrupted": 4,
             "failed": 5, "error": 5, "xpassed": 5}
_MAX_RUNS_NAMED = 6


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
    # A "fail" whose failing runs all passed although marked xfail (strict): fixed here, and
    # the xfail line is to be deleted (the HTML page's own look).
    fixed: bool = False

    @property
    def text(self) -> str:
        """``cuda: skipped (no CUDA device here)``: the status, with a skip's short reason."""
        said = f"{self.device}: {DEVICE_WORDS[self.status]}"
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


# A package as a column tells it: its version, and its build's fingerprint where recorded.
_Package = tuple[str | None, str | None]


def _packages(environment: Mapping[str, Any]) -> dict[str, _Package]:
    builds = {canonical_name(name): build
              for name, build in (environment.get("builds") or {}).items()}
    return {canonical_name(name): (version, _fingerprint(builds.get(canonical_name(name))))
            for name, version in environment["packages"].items()}


def _fingerprint(build: Any) -> str | None:
    return build.get("fingerprint") if isinstance(build, Mapping) else None


def _packages_agree(mine: Mapping[str, _Package], theirs: Mapping[str, _Package]) -> bool:
    """Every package both name at the same version and, where both recorded its build, the
    same build (``same_environment``'s package rule)."""
    for name in mine.keys() & theirs.keys():
        (version, build), (other_version, other_build) = mine[name], theirs[name]
        if version != other_version or (build and other_build and build != other_build):
            return False
    return True


def _learn(known: dict[str, _Package], mine: Mapping[str, _Package]) -> None:
    """A column's packages with a report's added: a build one report recorded stays known."""
    for name, (version, build) in mine.items():
        known[name] = (version, build or (known[name][1] if name in known else None))


def same_environment(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """Whether two reports' environments are one: the identity keys equal, and every package
    both name at the same version (or absent from both), and where both recorded the build of
    a package with compiled files (``environment.builds``), the same build: two builds of
    one version (one made for another torch) are two environments, never one column whose
    runs disagree.

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
    """The reports of each column (``same_environment``, the one rule), columns in the order given.

    Reports naming more packages are placed first, so that one naming fewer meets the
    columns its packages cannot tell apart: it joins the one column it fits, and where it
    fits several (it does not name what tells them apart) it gets a column of its own and
    a note, rather than a guess.
    """
    notes: list[str] = []
    environments = [report["environment"] for report in reports]
    order = sorted(range(len(reports)),
                   key=lambda i: (-len(environments[i]["packages"]), created[i], names[i]))
    # Each column: its environment as far as its reports tell it (the packages any of them
    # names), and its reports. A report joins the one column whose environment is its own.
    # same_environment's rule, with each report's identity and packages made once (not once
    # per column it is compared with).
    placed: list[tuple[str, dict[str, _Package], list[int]]] = []
    identities = [_identity(environment) for environment in environments]
    everyone = [_packages(environment) for environment in environments]
    telling = _telling_packages(identities, everyone)
    for index in order:
        identity, mine = identities[index], everyone[index]
        fits = [column for column in placed
                if column[0] == identity and _packages_agree(column[1], mine)]
        # A package the reports of this environment name in two versions (or builds) tells
        # columns apart: a report that does not name it cannot be placed, whatever columns
        # happen to exist when it is reached (a shard that names only the project's package).
        blind = sorted(name for name, by_build in telling.get(identity, {}).items()
                       if name not in mine or (by_build and mine[name][1] is None))
        if fits and blind:
            notes.append(f"{names[index]} does not name {', '.join(blind)}, which tells "
                         "apart the environments it would otherwise share a column with: "
                         "it has a column of its own.")
            placed.append((_ALONE, dict(mine), [index]))   # joined by no other report
            continue
        if len(fits) == 1:
            _learn(fits[0][1], mine)
            fits[0][2].append(index)
            continue
        if fits:
            known = [column[1] for column in fits]
            unnamed = sorted({name for packages in known for name in packages
                              if (name not in mine or mine[name][1] is None)
                              and len({other.get(name) for other in known}) > 1})
            notes.append(f"{names[index]} does not name {', '.join(unnamed)}, which tells "
                         "apart the environments it would otherwise share a column with: "
                         "it has a column of its own.")
        placed.append((identity, dict(mine), [index]))
    groups = [members for _, _, members in placed]
    groups.sort(key=min)
    return groups, notes


# The identity of a column a report has to itself (``_environment_groups``): no other matches.
_ALONE = "\0alone"


def _telling_packages(identities: Sequence[str], packages: Sequence[Mapping[str, _Package]],
                      ) -> dict[str, dict[str, bool]]:
    """By environment identity: the packages its reports name in more than one version
    (False), or at one version in more than one recorded build (True)."""
    seen: dict[str, dict[str, tuple[set[str | None], set[str]]]] = {}
    for identity, found in zip(identities, packages, strict=True):
        for name, (version, build) in found.items():
            versions, builds = seen.setdefault(identity, {}).setdefault(name, (set(), set()))
            versions.add(version)
            if build is not None:
                builds.add(build)
    return {identity: {name: len(versions) == 1
                       for name, (versions, builds) in names.items()
                       if len(versions) > 1 or len(builds) > 1}
            for identity, names in seen.items()}


def _merged_environment(environments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One column's environment: the newest report's, with the packages any of them named."""
    merged = dict(environments[-1])
    packages: dict[str, str | None] = {}
    builds: dict[str, Any] = {}
    seen: set[str] = set()
    for environment in environments:
        found = environment.get("builds") or {}
        for name, version in environment["packages"].items():
            if canonical_name(name) not in seen:
                seen.add(canonical_name(name))
                packages[name] = version
            if name in packages and name not in builds and isinstance(found.get(name), Mapping):
                builds[name] = found[name]
    merged["packages"] = dict(sorted(packages.items()))
    if builds:
        merged["builds"] = dict(sorted(builds.items()))
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
        shown, said = _merge_item(found, names, created)
        if said is not None:
            differed.append(f"{_run_id(shown)} of {shown['case']}: {said}")
        items[nodeid] = shown
    if len(indexes) < 2:
        return items, None
    return items, _merge_note(reports, names, created, indexes, repeated, older_only, differed)


def _merge_item(found: Sequence[tuple[int, Mapping[str, Any]]], names: Sequence[str],
                created: Sequence[datetime]) -> tuple[Mapping[str, Any], str | None]:
    """Which run of one item a column shows, and what its runs said where they differed."""
    # A "not run" never hides a run that happened; between the latest runs, the worse.
    real = [run for run in found if run[1]["outcome"] != "not run"] or list(found)
    latest = max(created[index] for index, _ in real)
    tied = sorted((run for run in real if created[run[0]] == latest),
                  key=lambda run: (-_SEVERITY[run[1]["outcome"]], names[run[0]]))
    shown = tied[0][1]
    outcomes = dict.fromkeys(result["outcome"] for _, result in real)
    if len(outcomes) <= 1:
        return shown, None
    said = "; ".join(
        f"{outcome} in {', '.join(names[i] for i, r in real if r['outcome'] == outcome)}"
        for outcome in outcomes)
    flaky = bool(outcomes.keys() & set(FAILING)) and "passed" in outcomes
    failure = next((r for _, r in reversed(real) if r["outcome"] in FAILING), None)
    if failure is not None and (text := reason_text(failure)):
        said += f" (failure: {text})"
    return {**shown, "_differed": said, "_flaky": flaky}, said


def _items_word(count: int) -> str:
    """Whether a count of items reads "item" or "items"."""
    return "item" if count == 1 else "items"


def _merge_note(reports: Sequence[Mapping[str, Any]], names: Sequence[str],
                created: Sequence[datetime], indexes: Sequence[int], repeated: int,
                older_only: int, differed: Sequence[str]) -> str:
    """The note under a column that merged several reports: what ran twice, what differed."""
    note = f"{', '.join(names[i] for i in indexes)} come from one environment and share a column"
    if repeated:
        note += (f"; {repeated} {_items_word(repeated)} ran in more than one of "
                 "them: the result of the report created later is shown")
    if differed:
        note += _differed_note(differed)
    if older_only and repeated:
        note += (f"; {older_only} {'item is' if older_only == 1 else 'items are'} only in an "
                 "older report and shown from it")
    note += _tied_note(names, created, indexes)
    note += _writers_note(reports, names, indexes)
    return note + "."


def _differed_note(differed: Sequence[str]) -> str:
    """The part of a merge note that names the items whose outcomes differed."""
    shown_runs = "; ".join(differed[:_MAX_RUNS_NAMED])
    if len(differed) > _MAX_RUNS_NAMED:
        shown_runs += f"; and {len(differed) - _MAX_RUNS_NAMED} more"
    return (f"; the outcomes of {len(differed)} "
            f"{_items_word(len(differed))} differed between them, "
            f"marked in the cells: {shown_runs}")


def _tied_note(names: Sequence[str], created: Sequence[datetime],
               indexes: Sequence[int]) -> str:
    """The part of a merge note on reports started at the same moment, if any were."""
    moments = Counter(created[i] for i in indexes)
    tied_names = [names[i] for i in indexes if moments[created[i]] > 1]
    if not tied_names:
        return ""
    return (f"; {', '.join(tied_names)} were started at the same moment, so which ran later "
            "is unknown: for an item in more than one of them the worse outcome is shown "
            "(a failure before a pass), whatever the order of the files")


def _writers_note(reports: Sequence[Mapping[str, Any]], names: Sequence[str],
                  indexes: Sequence[int]) -> str:
    """The part of a merge note on reports written by different pytest-gpucase versions."""
    writers = dict.fromkeys(reports[i].get("gpucase") for i in indexes)
    if len(writers) <= 1:
        return ""
    return ("; they were written by different versions of pytest-gpucase: " + ", ".join(
        f"{'an older one' if writer is None else writer} "
        f"({', '.join(names[i] for i in indexes if reports[i].get('gpucase') == writer)})"
        for writer in writers))


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
        # Runs of it that never started (a run stopped by -x, a kill) are no pass: "pass"
        # says every run on this device type ran.
        return "partial" if "not run" in outcomes else "pass"
    return "skip" if "skipped" in outcomes else "not run"


def _fixed(results: Sequence[Mapping[str, Any]], still_expected: bool = False) -> bool:
    """Whether the runs' only failures are strict xfails that passed: fixed, not broken;
    never while another run of the case (``still_expected``: another dtype, another
    device) still fails as expected, which deleting the xfail line would turn red."""
    if still_expected:
        return False
    return {result["outcome"] for result in results} & set(FAILING) == {"xpassed"}


def _cell(results: Sequence[Mapping[str, Any]], kinds: Sequence[str]) -> Cell:
    counts = Counter(result["outcome"] for result in results)
    # Grouped in one pass: a scan per device type made a cell quadratic in their number.
    on_device: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        on_device.setdefault(result["device"], []).append(result)
    expected = counts["xfailed"] > 0   # once per cell: a scan per device was quadratic
    devices = tuple(DeviceCell(device, _status(runs), _reasons(runs), _fixed(runs, expected))
                    for device in kinds for runs in (on_device.get(device, []),))
    statuses = {device.status for device in devices}
    status: Status
    if not results:
        status = "not run"
    elif statuses & {"fail", "flaky", "xfail", "interrupted"}:
        status = next(s for s in ("fail", "flaky", "xfail", "interrupted") if s in statuses)
    elif statuses == {"pass"}:
        status = "pass"
    elif statuses & {"pass", "partial"}:
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
        key = (REASON_WORDS[result["outcome"]], reason_text(result))
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


def reason_text(result: Mapping[str, Any]) -> str:
    """Why a result did not pass, on one line, cut as the writer cuts a run's text."""
    from pytest_gpucase.run.isolation import clip

    if result["outcome"] == "skipped":
        text = result["skip_reason"] or result["message"]
    else:
        text = result["message"] or result["error_type"]
    return " ".join(clip(str(text or "")).split())


def _run_id(result: Mapping[str, Any]) -> str:
    """``cpu-float32-batch[1]``: the parameters that end the node id (a case folder's name
    may hold brackets too), else the fields. String operations, not a regex: a pattern
    searched from every ``[`` of a megabyte node id took minutes."""
    nodeid: str = result["nodeid"]
    start = nodeid.rfind(f"[{result['device']}-{result['dtype']}")
    if nodeid.endswith("]") and start >= 0:
        return nodeid[start + 1:-1]
    parts = [result["device"], result["dtype"]] + ([result["variant"]] if result["variant"] else [])
    return "-".join(parts)


def _labels(environments: Sequence[Mapping[str, Any]],
            sources: Sequence[tuple[str, ...]]) -> list[str]:
    """Label each column by what differs between the environments, falling back to file names.

    Linear in the environments and the packages they name: a package is a field only of
    the environments that name it (unknown elsewhere, which shows nothing), so each
    environment's label is built from its own packages, never from every package any
    report named.
    """
    fields = [_fields(env) for env in environments]
    heads, tails = [head for head, _ in fields], [tail for _, tail in fields]
    differing = _differing_keys(heads)
    differing_tail = _differing_keys(tails)
    if "arch" in differing_tail and "gpu" in differing_tail:
        differing_tail.remove("gpu")   # sm_80 vs sm_90 already tells an A100 from an H100
    differs, builds_of = _differing_packages(environments)
    shape = (differing, differing_tail, differs, builds_of)
    labels = [_label(shape, env, head, tail, False)
              for env, head, tail in zip(environments, heads, tails, strict=True)]
    # A build is named only where the label would otherwise name two columns alike: where
    # torch already tells them apart, its build for each torch is no news.
    alike = Counter(labels)
    labels = [_label(shape, env, head, tail, True) if alike[labels[index]] > 1 else labels[index]
              for index, (env, head, tail) in enumerate(zip(environments, heads, tails,
                                                            strict=True))]
    counts = Counter(labels)
    return [
        label if label and counts[label] == 1
        else f"{label} ({', '.join(source)})" if label else ", ".join(source)
        for label, source in zip(labels, sources, strict=True)
    ]


def _differing_keys(fields: Sequence[Mapping[str, str | None]]) -> list[str]:
    """The keys of the first environment's fields whose token differs between environments."""
    return [key for key in (fields[0] if fields else {})
            if len({field[key] for field in fields}) > 1]


def _differing_packages(environments: Sequence[Mapping[str, Any]]
                        ) -> tuple[set[str], dict[tuple[str, str | None], set[str | None]]]:
    """Which packages differ between environments, and the builds of each package version."""
    tokens: dict[str, set[str | None]] = {}
    named: Counter[str] = Counter()
    # Builds of one version that differ: a label that would name two columns alike says the
    # build (its fingerprint, and the torch it was made for where recorded).
    builds_of: dict[tuple[str, str | None], set[str | None]] = {}
    for env in environments:
        for name, version in env["packages"].items():
            tokens.setdefault(name, set()).add(_package_token(name, version))
            named[name] += 1
            builds_of.setdefault((name, version), set()).add(_build_token(env, name))
    differs = {name for name, found in tokens.items()
               if len(found) + (named[name] < len(environments)) > 1}
    differs |= {name for (name, _), found in builds_of.items() if len(found) > 1}
    return differs, builds_of


# The differing head fields, tail fields and packages, and the builds of each package version.
_LabelShape = tuple[list[str], list[str], set[str], dict[tuple[str, str | None], set[str | None]]]


def _label(shape: _LabelShape, env: Mapping[str, Any], head: Mapping[str, str | None],
           tail: Mapping[str, str | None], builds: bool) -> str:
    """One column's label: its differing fields and packages (with builds where asked)."""
    differing, differing_tail, differs, builds_of = shape
    parts = [head[key] for key in differing]
    for name in sorted(env["packages"]):
        if name not in differs:
            continue
        token = _package_token(name, env["packages"][name])
        build = _build_token(env, name)
        if builds and build and len(builds_of[(name, env["packages"][name])]) > 1:
            token += f" ({build})"
        parts.append(token)
    parts += [tail[key] for key in differing_tail]
    return " · ".join(token for token in parts if token)


def _package_token(name: str, version: str | None) -> str:
    return f"{name} {version}" if version else f"no {name}"


def _build_token(env: Mapping[str, Any], name: str) -> str | None:
    build = (env.get("builds") or {}).get(name)
    return build_label(build) if isinstance(build, Mapping) else None


def _fields(env: Mapping[str, Any]) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """The label tokens of an environment's fields before its packages and after them, in
    label order; None shows nothing."""
    head: dict[str, str | None] = {
        "backend": env["backend"],
        "torch": f"torch {env['torch'].split('+')[0]}" if env["torch"] else "no torch",
        "cuda": _cuda_token(env["cuda"]),
        "hip": f"rocm{'.'.join(env['hip'].split('.')[:2])}" if env["hip"] else None,
        "cudnn": dnn_library(env["cudnn"], env["backend"]),
    }
    devices = env["devices"]
    arches = sorted({_arch(d["capability"]) for d in devices if d["capability"]})
    gpus = Counter(d["name"] for d in devices)
    tail: dict[str, str | None] = {
        "arch": "+".join(arches) or None,
        "gpu": " + ".join(f"{n} × {name}" if n > 1 else name
                          for name, n in sorted(gpus.items())) or None,
        "python": f"Python {env['python']}",
        "platform": env["platform"],
        "revision": f"rev {env['revision']}" if env["revision"] else None,
    }
    return head, tail


def _cuda_token(version: str | None) -> str | None:
    if not version:
        return None
    parts = version.split(".", 2)
    if len(parts) >= 2 and all(re.fullmatch(r"[0-9]{1,4}", part) for part in parts[:2]):
        return f"cu{parts[0]}{parts[1]}"   # the name of PyTorch's wheel index: cu121
    return f"CUDA {version}"


def _arch(capability: str) -> str:
    if re.fullmatch(r"[0-9]{1,4}\.[0-9]{1,4}", capability):
        return "sm_" + capability.replace(".", "")
    return capability.split(":", 1)[0]   # ROCm: gfx90a:sramecc+:xnack- -> gfx90a


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

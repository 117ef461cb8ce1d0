"""Shrink a failing case to the fewest batch entries (and shortest length) that fail the same way.

The original is run once first, so that "failing" has a meaning: the same kind of
outcome (``FailureClass``: an exception, a crash, outputs that differ) and the same
failure (``verdict.failure.same_failure``: the triage class and the shape of the message,
so that a smaller batch raising *another* RuntimeError does not count). Then delta
debugging (Zeller's ddmin) removes entries along the case's batch axis, and, where
``[variants] length`` names an axis, a binary search cuts the length to the shortest
window that still fails.
Every try is a temporary copy of the case with a subset payload, run in a fresh
child by ``run.parent.run_spec``; a try counts as failing only when it fails the same way
(``same_way``), and the tries that fail otherwise are listed with their messages.

Nothing is invented: a try holds subsets and slices of the saved tensors, with
their dtype, the order of their strides in memory, their padding and their
storage offset (see ``laid_out_like``), because a small random tensor may no
longer reproduce a layout- or alignment-dependent fault.

The result is written as a new case directory, atomically (a temporary
directory beside it, then a rename; an existing directory is never
overwritten), with ``[origin]`` kept and an ``[origin.minimized_from]`` table.

The new case's ``[origin] sample_ids`` are the kept entries' (the original's list stays in
``[origin.minimized_from]``); when one entry is kept, one or two other entries are tried
alone, so that a failure every entry gives (a code bug) names no sample as its cause.
Writing the new case: ``tools.minimize_write``.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, cast

from pytest_gpucase.base.errors import display
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import tensor_dicts
from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.model import CASE_FILE, EXPECTED_FILE, INPUTS_FILE, Case
from pytest_gpucase.case.variants import (
    InputsInDoubt,
    VariantNotApplicable,
    call_shapes,
    members_of,
    shapes_of,
)
from pytest_gpucase.case.write import copy_into
from pytest_gpucase.plan.environment import Environment
from pytest_gpucase.plan.runs import NotRunnable, RunSpec, choose_device, unchanged_runs
from pytest_gpucase.run.isolation import signal_name
from pytest_gpucase.run.parent import Verdict, failure_of, run_spec
from pytest_gpucase.run.runcontext import RunContext
from pytest_gpucase.tools.minimize_write import (
    UNCHANGED,
    free_path,
    origin_path,
    support_files,
    with_minimized_from,
    write_case,
)
from pytest_gpucase.verdict.failure import Failure, same_failure

if TYPE_CHECKING:
    import torch

__all__ = [
    "FailureClass", "OriginalPasses", "Selection", "Stop", "ddmin", "failure_class",
    "first_failure", "laid_out_like", "minimize", "minimize_command", "one_thread", "plan_axes",
    "same_way", "select", "shown", "strides_like", "with_minimized_from", "write_case",
]

FailureKind = Literal["raises", "reference raises", "no exception", "mismatch",
                      "golden mismatch", "crash", "timeout", "child error", "broken case"]
Stop = Literal["max tries", "time budget", "interrupted"]


class OriginalPasses(Exception):
    """The original case passes, so there is no failure to keep."""


# --- what "failing the same way" means ------------------------------------------------------


@dataclass(frozen=True)
class FailureClass:
    """How a run failed, coarse enough to survive a smaller batch: kind, exception, clue."""

    kind: FailureKind
    name: str | None = None   # the exception type, the signal name, or the exit status
    clue: str | None = None   # the triage clue, when triage recognized the failure

    def __str__(self) -> str:
        base = {
            "raises": f"{self.name}",
            "reference raises": f"{self.name} in the reference",
            "no exception": "no exception",
            "mismatch": "mismatch",
            "golden mismatch": "mismatch with expected.safetensors",
            "crash": f"crash: {self.name}",
            "timeout": "timeout",
            "child error": "error in the child",
            "broken case": "broken case",
        }[self.kind]
        return f"{base} ({self.clue})" if self.clue else base


def failure_class(verdict: Verdict) -> FailureClass | None:
    """The class of a failed run, or None when it passed or was skipped."""
    outcome, child = verdict.outcome, verdict.child
    if outcome.status != "failed":
        return None
    clue = verdict.triage.clue if verdict.triage is not None else None
    if not child.returned:
        if child.timed_out:
            return FailureClass("timeout", clue=clue)
        if child.signal is not None:
            return FailureClass("crash", signal_name(child.signal), clue)
        if child.child_error is not None:
            return FailureClass("child error", clue=clue)
        return FailureClass("crash", f"exit status {child.exitcode}", clue)
    if outcome.broken_case or outcome.kind == "environment":
        # Nothing to shrink: the case or a package of this environment cannot run it.
        return FailureClass("broken case")
    if outcome.kind in ("raises", "reference raises"):
        return FailureClass(cast(FailureKind, outcome.kind), outcome.error_type, clue)
    if outcome.kind in ("no exception", "golden mismatch"):
        return FailureClass(cast(FailureKind, outcome.kind), clue=clue)
    return FailureClass("mismatch", clue=clue)


def same_way(baseline: Verdict, found: Verdict) -> bool:
    """Whether ``found`` failed as ``baseline`` did: the same kind of outcome (an exception
    and a crash are one kind: a CUDA assert may abort or raise) and the same failure
    (``verdict.failure.same_failure``)."""
    expected, seen = failure_class(baseline), failure_class(found)
    if expected is None or seen is None:
        return False
    if expected.kind != seen.kind and not {expected.kind, seen.kind} <= {"raises", "crash"}:
        return False
    recorded, again = failure_of(baseline), failure_of(found)
    return recorded is not None and again is not None and same_failure(recorded, again)


def shown(kind: FailureClass, failure: Failure | None) -> str:
    """A failure as the summaries show it: its kind, and the first line of its message."""
    if failure is None or failure.error_type is None:
        return str(kind)
    line = failure.describe()
    line = line if len(line) <= 160 else line[:157] + "..."
    return f"{line} ({kind.clue})" if kind.clue else line


# --- how the original runs (shared with ablate; where and in which dtype: plan.py) ----------


def first_failure(specs: Sequence[RunSpec],
                  ctx: RunContext) -> tuple[Verdict | None, tuple[Verdict, ...]]:
    """Run ``specs`` in order until one fails; return that verdict (or None) and every verdict."""
    seen: list[Verdict] = []
    for spec in specs:
        verdict = run_spec(spec, ctx)
        seen.append(verdict)
        if verdict.failed:
            return verdict, tuple(seen)
    return None, tuple(seen)


def describe_passes(case: Case, verdicts: Sequence[Verdict]) -> str:
    """The message for an original that passes every run tried."""
    runs = ", ".join(f"{v.spec.device} in {v.spec.numeric}" for v in verdicts)
    return f"{display(case.path)} passes unchanged ({runs}): there is no failure to keep"


# --- subsets of the saved tensors, laid out as saved -----------------------------------------


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Do this process's tensor work on one thread, so that the children forked later can run.

    An OpenMP thread pool does not survive a fork: once this process has run a
    parallel region (a fill or copy of a few 10k elements is enough), a forked
    child's first parallel region waits forever for workers that are not there.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _bits_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """An integer dtype of the same width: selections copy bits, so NaN payloads survive."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        tensor.element_size())


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    kind = _bits_dtype(tensor)
    return tensor if kind is None or tensor.dtype == kind else tensor.view(kind)


def strides_like(shape: Sequence[int], like_shape: Sequence[int],
                 like_stride: Sequence[int]) -> tuple[int, ...]:
    """Strides for ``shape`` that keep a layout's dim order, padding and broadcast dims.

    Dims are walked from innermost (smallest stride) out; each keeps the gap
    its stride left beyond the span of the dims inside it, so a transposed view
    stays transposed and a padded row stays padded. A size-1 dim keeps its
    stride (it is never stepped), a stride-0 (expanded) dim stays 0, and an
    overlapping dim (negative gap) is laid out densely.
    """
    order = sorted(range(len(shape)), key=lambda d: (like_stride[d], -d))
    stride = list(like_stride)
    span_old = span_new = 1
    for d in order:
        if like_shape[d] <= 1 or like_stride[d] == 0:
            continue
        gap = like_stride[d] - span_old
        stride[d] = span_new + gap if gap >= 0 else span_new
        span_old += (like_shape[d] - 1) * like_stride[d]
        span_new += (shape[d] - 1) * stride[d]
    return tuple(stride)


def laid_out_like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (a subset of ``like``) stored as ``like`` is: stride order, padding, offset.

    The storage offset is kept, so the data pointer keeps the alignment kernels saw;
    the storage the view never reads (before the offset, padding) is zeros, as
    ``payload.load`` gives it.
    """
    import torch

    shape = tuple(values.shape)
    stride = strides_like(shape, tuple(like.shape), tuple(like.stride()))
    offset = like.storage_offset()
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    kind = _bits_dtype(like) or like.dtype
    flat = torch.zeros(offset + extent, dtype=kind)
    target, source = flat.as_strided(shape, stride, offset), _as_bits(values)
    for dim, step in enumerate(stride):
        if step == 0 and shape[dim] > 1:  # an expanded dim: one write per element
            target, source = target.narrow(dim, 0, 1), source.narrow(dim, 0, 1)
    target.copy_(source)
    if kind != like.dtype:
        flat = flat.view(like.dtype)
    return flat.as_strided(shape, stride, offset)


@dataclass(frozen=True)
class Selection:
    """The part of the saved inputs a try keeps: batch entries, and a window along the length."""

    entries: tuple[int, ...] | None = None    # indices along the batch axis; None: all
    window: tuple[int, int] | None = None     # [start, stop) along the length axis; None: all


@dataclass(frozen=True)
class Axes:
    """Which saved tensors share the batch (and length) axis, and its saved size."""

    batch_axis: int
    batch_size: int | None
    batch_members: frozenset[str]
    length_axis: int | None = None
    length_size: int | None = None
    length_members: frozenset[str] = frozenset()


def _members(case: Case, tensors: Mapping[str, torch.Tensor], axis: int,
             names: tuple[str, ...] | None, kind: str) -> tuple[int | None, frozenset[str]]:
    """The saved size on ``axis`` and who shares it: the variants' rule (``members_of``), on
    the tensors it sees (never an RNG state or a module's state dict: ``case_shapes``)."""
    anchor = case.variants.boundaries.input if case.variants.boundaries is not None else None
    try:
        found = members_of(_cut_shapes(case, tensors), axis, anchor, names, table=kind)
    except VariantNotApplicable as exc:
        why = str(exc)
        if isinstance(exc, InputsInDoubt) and kind == "batch":
            # Named on the command line: a [variants.batch] table would add pytest items too.
            listed = shlex.quote(",".join(exc.candidates))
            why = (f"{exc.reason}; name the inputs that follow it, e.g. gpucase minimize "
                   f"{shlex.quote(display(case.path))} --inputs {listed}")
        raise NotRunnable(f"{display(case.case_file)}: which inputs to shrink on axis {axis}: "
                          f"{why}") from None
    if found is None:
        return None, frozenset()
    return found[0], frozenset(found[1])


def _cut_shapes(case: Case, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The shapes the search may cut: the case's (``case_shapes``), and the tensors of a dict
    argument too (a batch passed as ``{"x": ..., "y": ...}``: its inputs and its targets
    share the batch axis, and cutting one without the other is another failure)."""
    literals = {name: value for name, value in case.literals.items()
                if name not in tensor_dicts(case.literals)}
    return call_shapes(shapes_of(tensors), literals, tuple(case.context.rng.values()))


def plan_axes(case: Case, tensors: Mapping[str, torch.Tensor],
              inputs: tuple[str, ...] | None = None) -> Axes:
    """The batch axis (``[variants] batch``, default 0) and the length axis, if one is named.

    ``inputs`` (``--inputs``) name the tensors that follow the batch axis, before
    ``[variants.batch] inputs``; neither: the variants' rule infers them.
    """
    batch = case.variants.batch
    batch_axis = batch.axis if batch is not None else 0
    names = inputs if inputs is not None else batch.inputs if batch is not None else None
    batch_size, batch_members = _members(case, tensors, batch_axis, names, "batch")
    length = case.variants.length
    if length is None or length.axis == batch_axis:
        return Axes(batch_axis, batch_size, batch_members)
    length_size, length_members = _members(case, tensors, length.axis, length.inputs, "length")
    return Axes(batch_axis, batch_size, batch_members, length.axis, length_size, length_members)


def select(tensors: Mapping[str, torch.Tensor], axes: Axes,
           selection: Selection) -> dict[str, torch.Tensor]:
    """The saved tensors cut to ``selection``, each laid out as saved."""
    import torch

    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        values, cut = tensor, False
        if selection.entries is not None and name in axes.batch_members:
            index = torch.tensor(selection.entries, dtype=torch.long)
            values = _as_bits(values).index_select(axes.batch_axis, index).view(tensor.dtype)
            cut = True
        if (selection.window is not None and axes.length_axis is not None
                and name in axes.length_members):
            start, stop = selection.window
            values = values.narrow(axes.length_axis, start, stop - start)
            cut = True
        result[name] = laid_out_like(values, tensor) if cut else tensor
    return result


# --- delta debugging -------------------------------------------------------------------------


def _chunks(items: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    size, extra = divmod(len(items), n)
    found, start = [], 0
    for index in range(n):
        stop = start + size + (1 if index < extra else 0)
        found.append(items[start:stop])
        start = stop
    return [chunk for chunk in found if chunk]


def ddmin(items: tuple[int, ...], fails: Callable[[tuple[int, ...]], bool],
          improved: Callable[[tuple[int, ...]], None] = lambda items: None) -> tuple[int, ...]:
    """Zeller's ddmin: a 1-minimal subset of ``items`` (known to fail) for which ``fails`` holds.

    Subsets are tried before complements, so that one bad entry among many is
    found in about 2·log2(n) tries; ``improved`` is told of every smaller failing set.
    """
    n = 2
    while len(items) >= 2:
        chunks = _chunks(items, n)
        candidates = [(chunk, 2) for chunk in chunks]
        if n > 2:  # with two chunks each complement is the other chunk, already tried
            for chunk in chunks:
                removed = set(chunk)
                candidates.append((tuple(i for i in items if i not in removed), max(n - 1, 2)))
        for candidate, next_n in candidates:
            if fails(candidate):
                items, n = candidate, next_n
                improved(items)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


class _Budget(Exception):
    def __init__(self, reason: Stop) -> None:
        super().__init__(reason)
        self.reason: Stop = reason


class _Search:
    """The tries of one minimization: budget, cache, the best selection so far, progress."""

    def __init__(self, *, spec: RunSpec, baseline: Verdict,
                 tensors: Mapping[str, torch.Tensor], axes: Axes, metadata: Mapping[str, str],
                 ctx: RunContext, max_tries: int, time_budget: float,
                 started: float, clock: Callable[[], float], out: TextIO) -> None:
        self.spec, self.baseline, self.tensors, self.axes = spec, baseline, tensors, axes
        kind = failure_class(baseline)
        assert kind is not None
        self.failure = str(kind)  # the progress lines name the kind; the header, the message
        self.metadata = metadata
        self.ctx = ctx
        self.max_tries, self.time_budget, self.started, self.clock = (
            max_tries, time_budget, started, clock)
        self.out = out
        self.tries = 0
        self.differently: dict[str, int] = {}
        self.cache: dict[Selection, bool] = {}
        # The failure of each try that failed the same way, as ``shown`` and ``describe``
        # word it: the kept case's own message (a smaller batch holds fewer NaN).
        self.messages: dict[Selection, tuple[str, str]] = {}
        self.best = Selection()

    def size(self, selection: Selection) -> str:
        parts = []
        if self.axes.batch_size is not None:
            count = (len(selection.entries) if selection.entries is not None
                     else self.axes.batch_size)
            parts.append(f"{count} {'entry' if count == 1 else 'entries'}")
        if self.axes.length_size is not None:
            start, stop = selection.window or (0, self.axes.length_size)
            parts.append(f"length {stop - start}")
        return ", ".join(parts)

    def fails(self, selection: Selection) -> bool:
        if selection in self.cache:
            return self.cache[selection]
        if self.tries >= self.max_tries:
            raise _Budget("max tries")
        if self.clock() - self.started >= self.time_budget:
            raise _Budget("time budget")
        self.tries += 1
        if self.out.isatty():
            self.out.write(f"\r\033[K  try {self.tries}/{self.max_tries}: "
                           f"{self.size(selection)} …")
            self.out.flush()
        # The try's case directory is reused: each child is fresh and reads the payload anew.
        with one_thread():
            payload.save(self.spec.case.inputs_file,
                         select(self.tensors, self.axes, selection), self.metadata)
        verdict = run_spec(self.spec, self.ctx)
        found = failure_class(verdict)
        same = same_way(self.baseline, verdict)
        if found is not None and not same:
            other = shown(found, failure_of(verdict))
            self.differently[other] = self.differently.get(other, 0) + 1
        if same and found is not None:
            own = failure_of(verdict)
            self.messages[selection] = (shown(found, own), own.describe() if own is not None
                                        and own.error_type is not None else "")
        self.cache[selection] = same
        return same

    def improve(self, selection: Selection) -> None:
        self.best = selection
        seconds = self.clock() - self.started
        clear = "\r\033[K" if self.out.isatty() else ""
        self.out.write(f"{clear}  try {self.tries}: {self.size(selection)}, still "
                       f"{self.failure} [{seconds:.1f} s]\n")
        self.out.flush()


def _shortest_window(search: _Search, entries: tuple[int, ...] | None, length: int) -> None:
    """Cut the length: the shortest prefix that fails, then the latest start that still fails."""
    low, high = 1, length
    while low < high:
        middle = (low + high) // 2
        if search.fails(Selection(entries, (0, middle))):
            high = middle
            search.improve(Selection(entries, (0, middle)))
        else:
            low = middle + 1
    stop = high
    low, high = 0, stop - 1
    while low < high:
        middle = (low + high + 1) // 2
        if search.fails(Selection(entries, (middle, stop))):
            low = middle
            search.improve(Selection(entries, (middle, stop)))
        else:
            high = middle - 1


# --- the result ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Minimized:
    """What a minimization kept, what it cost, and where the new case was written."""

    original: Path
    output: Path | None                          # None: nothing smaller was found
    spec: RunSpec                                # the failing original run (device, dtype)
    failure: FailureClass
    axes: Axes
    selection: Selection
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]  # cut tensors: before, after
    tries: int
    seconds: float
    stopped: Stop | None                         # None: ran until no single cut failed
    failed_differently: Mapping[str, int]        # other failures met, with counts
    notes: tuple[str, ...] = ()                  # what the new case leaves out, and why
    message: str = ""                            # the failure kept, as ``shown`` words it
    error: str = ""                              # ... as ``Failure.describe`` writes it
    # [origin] sample_ids of the entries kept; None where the case holds none for its batch.
    sample_ids: tuple[object, ...] | None = None
    ids_unmatched: str = ""                      # why the case's sample ids fit no entry
    # Other single entries tried alone, and those that failed the same way (_others_alone);
    # None: not checked (more than one entry kept, or the budget ran out).
    alone: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    kept_message: str = ""                       # the kept case's own failure, as ``shown``

    @property
    def every_entry_fails(self) -> bool:
        """Whether every other entry tried alone failed the same way: no culprit sample."""
        return self.alone is not None and set(self.alone[1]) == set(self.alone[0])

    def alone_words(self) -> str:
        """What the entries tried alone say of the kept one ("" when nothing was tried)."""
        if self.alone is None:
            return ""
        tried, failing = self.alone
        listed = ", ".join(map(str, (*(self.selection.entries or ()), *tried)))
        if self.every_entry_fails:
            return (f"every entry tried fails alone the same way (entries {listed}): the "
                    "failure does not single out a sample; look at the code, not the data "
                    "(or at what every sample shares: a label mapping, a vocabulary)")
        if failing:
            return (f"entr{'y' if len(failing) == 1 else 'ies'} "
                    f"{', '.join(map(str, failing))} fail{'s' if len(failing) == 1 else ''} "
                    "alone the same way too: the kept entry is not the only one")
        passes = "entry {} alone passes" if len(tried) == 1 else "entries {} alone pass"
        return (passes.format(", ".join(map(str, tried)))
                + ", so the failure is in the kept entry's data")

    @classmethod
    def of(cls, case: Case, baseline: Verdict, failure: FailureClass,
           kept_failure: Failure | None, message: str, search: _Search,
           shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]], *, seconds: float,
           stopped: Stop | None,
           alone: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Minimized:
        """The result of a search over ``case``, before anything is written; ``error`` and
        ``kept_message`` are the kept case's own failure (the original's when none is kept)."""
        own = search.messages.get(search.best)
        original = (kept_failure.describe()
                    if kept_failure is not None and kept_failure.error_type is not None else "")
        return cls(
            original=case.path, output=None, spec=baseline.spec, failure=failure,
            axes=search.axes, selection=search.best, shapes=shapes, tries=search.tries,
            seconds=seconds, stopped=stopped, failed_differently=dict(search.differently),
            message=message, error=(own[1] or original) if own is not None else original,
            alone=alone, kept_message=own[0] if own is not None else "",
            **_kept_ids(case, search.axes, search.best))

    def _ids_line(self) -> str:
        """The kept entries' sample ids: the data to look at, named as the dataset names it."""
        if self.sample_ids is None:
            return f"  sample ids: {self.ids_unmatched}"
        shown = ", ".join(map(str, self.sample_ids[:20]))
        more = " …" if len(self.sample_ids) > 20 else ""
        return (f"  sample id{'s' if len(self.sample_ids) > 1 else ''} kept: {shown}{more} "
                "([origin] sample_ids)")

    def render(self) -> str:
        """The summary printed at the end: sizes, tries, time, where the case went."""
        how = {None: "", "max tries": " (stopped at --max-tries)",
               "time budget": " (stopped at --time-budget)", "interrupted": " (interrupted)"}
        lines = [f"gpucase minimize: {display(self.original)} on {self.spec.device} in "
                 f"{self.spec.numeric}, {self.message or self.failure}: {self.tries} tries in "
                 f"{self.seconds:.1f} s{how[self.stopped]}"]
        if self.output is None:
            lines.append("  no smaller case fails the same way; nothing written")
            if self.failed_differently:
                lines.append("  (a smaller case that fails otherwise is another failure, "
                             "not this one: refused)")
        else:
            lines.append(f"  wrote {display(self.output)}")
            if self.kept_message:   # its own message: a smaller batch holds fewer NaN
                lines.append(f"  it fails with: {self.kept_message}")
        if self.selection.entries is not None:
            kept = ", ".join(map(str, self.selection.entries[:20]))
            more = " …" if len(self.selection.entries) > 20 else ""
            which = "entry" if len(self.selection.entries) == 1 else "entries"
            # The original's entry numbers: "(kept 3)" read as a count.
            lines.append(f"  entries on axis {self.axes.batch_axis}: {self.axes.batch_size} -> "
                         f"{len(self.selection.entries)} (kept {which} {kept}{more})")
            if self.every_entry_fails:   # no culprit: naming a sample would point at the data
                lines.append(f"  {self.alone_words()}")
            else:
                lines.append(self._ids_line())
                if self.alone_words():
                    lines.append(f"  {self.alone_words()}")
        if self.selection.window is not None:
            start, stop = self.selection.window
            lines.append(f"  length on axis {self.axes.length_axis}: {self.axes.length_size} "
                         f"-> {stop - start} (kept positions [{start}, {stop}))")
        for name, (before, after) in self.shapes.items():
            lines.append(f"  {name}: {list(before)} -> {list(after)}")
        for found, count in self.failed_differently.items():
            tries = "try failed" if count == 1 else "tries failed"
            lines.append(f"  {count} {tries} differently ({found}): not kept")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _kept_ids(case: Case, axes: Axes, best: Selection) -> dict[str, Any]:
    """``Minimized``'s ``sample_ids`` (those of the entries kept), or why there are none."""
    if best.entries is None:
        return {}
    ids = case.origin.get("sample_ids")
    if not isinstance(ids, list) or not ids:
        return {"ids_unmatched": "none recorded ([origin] sample_ids): the entries are "
                                 "positions in the saved batch"}
    if len(ids) != axes.batch_size:
        return {"ids_unmatched": f"[origin] sample_ids holds {len(ids)} ids for a batch of "
                                 f"{axes.batch_size} entries: not matched to the entries kept"}
    return {"sample_ids": tuple(ids[i] for i in best.entries)}


def minimize(
    case: Case,
    *,
    env: Environment,
    device: str | None = None,
    dtype: str | None = None,
    output: Path | None = None,
    max_tries: int = 200,
    time_budget: float = 600.0,
    ctx: RunContext | None = None,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    inputs: Sequence[str] | None = None,
) -> Minimized:
    """Shrink ``case`` to the fewest entries that fail the same way and write the new case.

    ``inputs`` name the saved tensors that follow the batch axis (``--inputs``),
    when the rule cannot tell them and the case's ``[variants.batch]`` does not
    list them. ``max_tries`` bounds the shrinking tries (the first run of the original is not
    one); ``time_budget`` bounds the whole, checked before each try. Ctrl-C stops
    the search and the best case so far is written. Raises ``OriginalPasses`` when
    the original passes, ``NotRunnable`` when it cannot run here or has no tensors
    to shrink, ``FileExistsError`` when ``output`` exists. ``ctx``: the run context of
    every try (default: this process's, ``RunContext.here``).
    """
    ctx = replace(ctx or RunContext.here(env.backend), localize=False).fresh()
    stream = out if out is not None else io.StringIO()  # progress only where a caller asks
    started = clock()
    _preconditions(case, output)
    chosen = choose_device(case, env, device)
    baseline, tried = first_failure(unchanged_runs(case, env, device=chosen, dtype=dtype), ctx)
    if baseline is None:
        raise OriginalPasses(describe_passes(case, tried))
    failure = failure_class(baseline)
    assert failure is not None  # a failed verdict always has a class
    kept_failure = failure_of(baseline)
    message = shown(failure, kept_failure)
    _refuse_unshrinkable(case, baseline, failure)
    with one_thread():
        tensors = payload.load(case.inputs_file)
    _, metadata = payload.read_header(case.inputs_file)
    metadata = {k: v for k, v in metadata.items() if k != payload.LAYOUT_KEY}
    axes = plan_axes(case, tensors, tuple(inputs) if inputs is not None else None)
    if axes.batch_size is None and axes.length_size is None:
        raise NotRunnable(f"{display(case.path)}: no saved tensor has axis {axes.batch_axis}: "
                          "nothing to shrink")
    stream.write(f"gpucase minimize: {display(case.path)} fails on {baseline.spec.device} in "
                 f"{baseline.spec.numeric} ({message}); {_sizes(axes)}; budget {max_tries} "
                 f"tries, {time_budget:g} s\n")
    stream.flush()
    scratch = _scratch_dir(case)
    try:
        search = _Search(spec=replace(baseline.spec, case=_scratch_case(case, scratch)),
                         baseline=baseline, tensors=tensors, axes=axes, metadata=metadata,
                         ctx=ctx, max_tries=max_tries,
                         time_budget=time_budget, started=started, clock=clock, out=stream)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        stopped = _shrink(search, axes)
        alone = _others_alone(search) if stopped != "interrupted" else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if stream.isatty():
        stream.write("\r\033[K")
    best = search.best
    with one_thread():
        kept = select(tensors, axes, best)
    shapes = {name: (tuple(tensors[name].shape), tuple(t.shape)) for name, t in kept.items()
              if t.shape != tensors[name].shape}
    result = Minimized.of(case, baseline, failure, kept_failure, message, search, shapes,
                          seconds=clock() - started, stopped=stopped, alone=alone)
    if not shapes:
        return result
    target = output if output is not None else _free_name(case.path)
    record = record_of(case, result, target)
    with one_thread():
        written = write_case(case, target, kept, metadata, record,
                             sample_ids=new_ids(case, result))
    return replace(result, output=written, notes=_notes(case))


def _preconditions(case: Case, output: Path | None) -> None:
    """Refuse before any run: an ``output`` taken or inside the case, or no payload to cut."""
    if output is not None and output.exists():
        raise FileExistsError(f"{display(output)} exists; minimize never overwrites, give a "
                              "new -o")
    if output is not None and output.resolve().is_relative_to(case.path.resolve()):
        raise NotRunnable(f"-o {display(output)} lies inside the case directory it copies; "
                          "write the new case beside it")
    if not case.inputs_file.exists():
        raise NotRunnable(f"{display(case.path)} has no {INPUTS_FILE}: nothing to shrink")


def _refuse_unshrinkable(case: Case, baseline: Verdict, failure: FailureClass) -> None:
    """Refuse a failure no smaller batch can keep: a broken case, a golden mismatch."""
    if failure.kind == "broken case":
        raise NotRunnable(baseline.outcome.summary)
    if failure.kind == "golden mismatch":
        raise NotRunnable(f"{display(case.path)} fails only against its {EXPECTED_FILE}, whose "
                          "outputs belong to the full batch: a smaller batch cannot be judged "
                          "against them")


def _scratch_dir(case: Case) -> Path:
    """Where the tries run: a sibling of the original when its folder is writable, else in tmp.

    A sibling at the original's own depth (hidden: never collected), so that a try imports the
    user's code from the same project as the original does (project.py) and the paths a
    recorded case holds relative to its folder (``../train.py``) name the same files."""
    try:
        return Path(tempfile.mkdtemp(prefix=f".gpucase-minimize-{case.path.name[:64]}-",
                                     dir=case.path.parent))
    except OSError:  # a read-only case folder
        return Path(tempfile.mkdtemp(prefix="gpucase-minimize-"))


def _shrink(search: _Search, axes: Axes) -> Stop | None:
    """Cut entries, then length; which budget or Ctrl-C stopped it (None: ran to the end)."""
    try:
        if axes.batch_size is not None and axes.batch_size > 1:
            everything = tuple(range(axes.batch_size))
            ddmin(everything, lambda items: search.fails(Selection(items)),
                  lambda items: search.improve(Selection(items)))
        if axes.length_size is not None and axes.length_size > 1:
            _shortest_window(search, search.best.entries, axes.length_size)
    except _Budget as budget:
        return budget.reason
    except KeyboardInterrupt:
        return "interrupted"
    return None


def _others_alone(search: _Search) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """When one entry is kept: other single entries, far from it, tried alone (one or two
    more tries, the search's own single-entry tries counted), and those of them that fail the
    same way; None when not checked. A code bug fails on any entry: the kept one is then no
    culprit, and saying its sample id as if it were sends the user to the data."""
    best, size = search.best, search.axes.batch_size
    if best.entries is None or len(best.entries) != 1 or size is None or size < 2:
        return None
    kept = best.entries[0]
    tried = {sel.entries[0]: same for sel, same in search.cache.items()
             if sel.entries is not None and len(sel.entries) == 1 and sel.window == best.window
             and sel.entries[0] != kept}
    wanted = min(2, size - 1)
    offsets = (size // 2, size // 4, 3 * size // 4, 1, size - 1)
    for entry in ((kept + offset) % size for offset in offsets):
        if len(tried) >= wanted or not all(tried.values()):
            break
        if entry == kept or entry in tried:
            continue
        try:
            tried[entry] = search.fails(Selection((entry,), best.window))
        except (_Budget, KeyboardInterrupt):
            break
    if not tried:
        return None
    return tuple(tried), tuple(entry for entry, same in tried.items() if same)


def _notes(case: Case) -> tuple[str, ...]:
    """What the new case leaves out of the original, and why."""
    if case.expected_file.exists():
        return (f"{EXPECTED_FILE} is not copied: its golden outputs belong to the full "
                "batch; write new ones with --gpu-cases-regen",)
    return ()


def _scratch_case(case: Case, scratch: Path) -> Case:
    """The copy of the case that tries run: same case.toml and case.py, a subset payload."""
    copy_into(support_files(case.path), scratch)
    shutil.copyfile(case.case_file, scratch / CASE_FILE)
    return replace(load_case(scratch), name=case.name)


def _sizes(axes: Axes) -> str:
    parts = []
    if axes.batch_size is not None:
        parts.append(f"{axes.batch_size} entries on axis {axes.batch_axis}")
    if axes.length_size is not None:
        parts.append(f"length {axes.length_size} on axis {axes.length_axis}")
    return ", ".join(parts)


def _free_name(original: Path) -> Path:
    """``<case>_min`` beside the original, or ``_min2``, ``_min3``… when taken."""
    return free_path(original.with_name(f"{original.name}_min"))


def new_ids(case: Case, result: Minimized) -> Any:
    """The new case's ``[origin] sample_ids``: the kept entries' ids (show, triage, offending
    and data-check read them as the new batch's); none when the original's fit no entry;
    ``UNCHANGED`` when no entry was cut or the case holds none."""
    if result.selection.entries is None or "sample_ids" not in case.origin:
        return UNCHANGED
    return list(result.sample_ids) if result.sample_ids is not None else None


def record_of(case: Case, result: Minimized, target: Path) -> dict[str, Any]:
    """The ``[origin.minimized_from]`` table: where it came from, what was kept, what it cost."""
    record: dict[str, Any] = {
        "case": origin_path(case.path, target),
        "inputs": payload.content_hash(case.inputs_file),
        "device": result.spec.device,
        "dtype": result.spec.dtype,
        "failure": str(result.failure),
    }
    if result.error:
        record["error"] = result.error  # the failure the new case keeps (gpucase validate)
    axes, best = result.axes, result.selection
    if best.entries is not None:
        record["axis"] = axes.batch_axis
        record["entries"] = list(best.entries)
        if result.sample_ids is not None:
            record["sample_ids"] = list(result.sample_ids)
        parent_ids = case.origin.get("sample_ids")
        if isinstance(parent_ids, list):   # the new [origin] sample_ids are the kept entries'
            record["original_sample_ids"] = list(parent_ids)
        if result.alone is not None:
            record["tried_alone"] = {"entries": list(result.alone[0]),
                                     "failing": list(result.alone[1])}
            if result.every_entry_fails:
                record["note"] = result.alone_words()
    if best.window is not None:
        record["length"] = {"axis": axes.length_axis, "start": best.window[0],
                            "stop": best.window[1]}
    record["tries"] = result.tries
    record["seconds"] = round(result.seconds, 2)
    record["stopped"] = result.stopped or "complete"
    record["shapes"] = {name: {"before": list(before), "after": list(after)}
                        for name, (before, after) in result.shapes.items()}
    return record


# --- the command -----------------------------------------------------------------------------


def minimize_command(case: Path, *, output: Path | None, device: str | None, max_tries: int,
                     time_budget: float, progress: TextIO | None = None,
                     inputs: Sequence[str] | None = None,
                     run_env: Mapping[str, str] | None = None) -> Minimized:
    """``gpucase minimize``: shrink the case at ``case`` on this machine (the command prints);
    ``run_env``: variables every try's child gets (``--env NAME=VALUE``).

    Raises what ``minimize`` raises, and KeyboardInterrupt when Ctrl-C came before
    any smaller case.
    """
    import torch  # noqa: F401 - imported before the children fork, so that each shares it

    from pytest_gpucase.run.probe import probe

    loaded = load_case(case)
    env = probe(tuple(loaded.matrix.packages))
    return minimize(loaded, env=env, device=device, output=output, max_tries=max_tries,
                    time_budget=time_budget, ctx=RunContext.here(env.backend, env=run_env),
                    out=progress,
                    inputs=inputs)

"""How one run's outputs are judged in the child: against the reference (cached, or computed
afresh), the golden, the second look of ``verdict.rounding`` (``second_look`` runs it), and a
float64 gradcheck where nothing independent checks the gradients."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.base.tensors import named_tensors, tensor_versions
from pytest_gpucase.case import golden, payload
from pytest_gpucase.case.model import Case, Expectation
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import reference_cache, second_look
from pytest_gpucase.run.calls import (
    MAX_OUTPUT_DEPTH,
    BadOutput,
    NothingDifferentiated,
    call,
    each_tensor,
    upcast,
)
from pytest_gpucase.run.context import grad_mode, replay_context, rng_restored
from pytest_gpucase.run.isolation import note
from pytest_gpucase.run.outcome import Outcome, describe_exception, exception_text, raised
from pytest_gpucase.verdict import ranges
from pytest_gpucase.verdict.compare import Comparison, Tolerance, combine, compare

__all__ = ["GOLDEN_PRECISION", "OUTPUT_MARKS", "REFERENCE_OUTPUT", "Judged", "autocast_reference",
           "compare_results", "labelled_output", "reference_inputs", "run_precision"]


# Written before the reference's output: a case that prints shows its lines twice, from the
# call and from the reference, which is otherwise hard to tell apart.
REFERENCE_OUTPUT = "--- gpucase: the reference (float64 on CPU) runs from here ---\n"
# The capture's marks (isolation): a clipped capture whose omitted middle holds the label
# says so, or its tail, all of it the reference's output, would read as the call's.
OUTPUT_MARKS = {REFERENCE_OUTPUT: "the reference's output (float64 on CPU) begins inside them"}


@contextlib.contextmanager
def labelled_output(label: str) -> Iterator[None]:
    """Write ``label`` to stdout and to stderr just before the block's first text on each.

    Only a stream the block writes to is labelled, so that a quiet reference adds no captured
    section to a report. Text written through ``sys.stdout``/``sys.stderr`` (print, logging,
    warnings shown) is seen; a write to the file descriptor itself (C code, a subprocess)
    is not, and stays unlabelled as before.
    """
    patched: list[Any] = []
    for stream in {id(s): s for s in (sys.stdout, sys.stderr) if s is not None}.values():
        def labelled(text: str, stream: Any = stream, write: Any = stream.write) -> Any:
            if text:
                delattr(stream, "write")  # the stream's own write again: one label
                write(label)
            return write(text)

        try:
            setattr(stream, "write", labelled)  # noqa: B010 - an instance's method, for a while
        except AttributeError:  # a stream that takes no attribute: labelled at once
            with contextlib.suppress(Exception):
                stream.write(label)
            continue
        patched.append(stream)
    try:
        yield
    finally:
        for stream in patched:
            with contextlib.suppress(AttributeError):  # gone at the first write
                delattr(stream, "write")


def run_precision(spec: RunSpec) -> torch.dtype:
    """The dtype a run computes in: the autocast dtype under ``[context] autocast``, else the
    run's dtype (the one its floating inputs are cast to, or the saved inputs' own)."""
    autocast = spec.case.context.autocast
    if autocast is not None and autocast.enabled:
        return getattr(torch, autocast.dtype)  # type: ignore[no-any-return]
    found = getattr(torch, spec.dtype, None)
    return found if isinstance(found, torch.dtype) else torch.float32


class Judged:
    """The judging of one run's outputs: against the reference (cached, or computed here on a
    miss and again on any failure: a failure never rests on the cache), the golden, and the
    second look the comparison asks for (``second_look``); then a gradcheck where nothing
    independent checks the gradients."""

    def __init__(self, spec: RunSpec, func: Callable[..., Any], reference: Callable[..., Any],
                 saved: Callable[[], dict[str, Any]], rng: Mapping[str, torch.Tensor],
                 cotangents: dict[str, torch.Tensor], precision: torch.dtype,
                 returned: str, reload: Callable[[], dict[str, Any]] | None = None) -> None:
        self.spec, self.case, self.func, self.reference = spec, spec.case, func, reference
        self._load_saved, self._reload, self.rng = saved, reload, rng
        self.cotangents, self.precision, self.returned = cotangents, precision, returned
        self.expect = self.case.expect
        self.cached = reference_cache.entry(spec, reference)
        self.autocast = autocast_reference(self.case)
        self.notes: list[str] = []
        self._saved: dict[str, Any] | None = None
        self._reference_rng: torch.Tensor | None = None
        self.reference_seconds = 0.0
        self._budget_entry: tuple[reference_cache.Entry | None] | None = None
        self._inputs_cast: bool | None = None
        # What the budget's draws (or the kept budget) found past the range of the run's
        # precision: a failure then runs the reference with that range (``held``).
        self.range_events: dict[str, Any] = {}
        # What the user's code returned and this run still compares: (whose, tensor by path,
        # their version counters), checked after each later call of that code (``untouched``).
        self._held: list[tuple[str, dict[str, torch.Tensor], dict[int, int]]] = []

    def saved(self) -> dict[str, Any]:
        """The run's inputs as the case holds them (loaded again if the call changed them)."""
        if self._saved is None:
            self._saved = self._load_saved()
        return self._saved

    def reference_inputs(self) -> dict[str, Any]:
        return reference_inputs(self.case, self.saved())

    def reference_inputs_releasing(self) -> dict[str, Any]:
        """``reference_inputs()``, letting go of the run's inputs as it goes when they can be
        loaded again (``reload``): each is freed as its float64 copy is made, so a module
        case's state is in memory about twice over, not three times. A second look that
        needs them later loads them again from the case."""
        if self._reload is None:
            return self.reference_inputs()
        saved = self.saved()
        self._saved, self._load_saved = None, self._reload
        found: dict[str, Any] = {}
        for name in list(saved):
            found.update(reference_inputs(self.case, {name: saved.pop(name)}))
        return found

    def hold(self, whose: str, outputs: Mapping[str, Any]) -> None:
        """Keep ``outputs`` (of the user's code) to be checked by ``untouched``."""
        tensors = {path: tensor for key, value in outputs.items()
                   for path, tensor in named_tensors(value, str(key))}
        self._held.append((whose, tensors, tensor_versions(tensors.values())))

    def untouched(self, by: str) -> None:
        """Raise ``CaseFormatError`` if a later call of the user's code (``by``) wrote into a
        tensor an earlier one returned: a buffer the code keeps between calls and returns,
        whose earlier values are gone before they were compared (a wrong call would pass
        with the reference's values in its outputs)."""
        for whose, tensors, versions in self._held:
            now = tensor_versions(tensors.values())
            if now == versions:
                continue
            path = next((path for path, tensor in tensors.items()
                         if now.get(id(tensor)) != versions.get(id(tensor))), "?")
            raise CaseFormatError(
                self.case.case_file, f"{whose} outputs ({path}) were written again while {by} "
                "ran: the code returns a tensor it writes again on its next call (a buffer "
                "kept between calls), so what it returned was changed before it was compared; "
                "return a new tensor (a clone of the buffer)",
                key="reference" if self.case.reference else "call")

    def _untouched_in_draw(self, by: str) -> None:
        try:
            self.untouched(by)
        except CaseFormatError as exc:  # out of the second look's handler of the draws
            raise second_look.Abandoned(exc) from exc

    def call_reference(self, inputs: Mapping[str, Any],
                       cotangents: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The reference on the CPU, with the saved random draws and the call's grad mode.

        Each later run (the budget's draws) starts from the random state the first one
        started from, saved or not: a dropout draws the same mask in every draw, so that
        the draws measure rounding, not other random numbers."""
        with rng_restored(self.rng, "cpu"), torch.set_grad_enabled(grad_mode(self.case.context)):
            if self._reference_rng is None:
                self._reference_rng = torch.get_rng_state()
            else:
                torch.set_rng_state(self._reference_rng)
            return call(self.reference, inputs, self.expect.gradients, "cpu", dict(cotangents))

    def verdict(self, actual: dict[str, Any]) -> Outcome:
        golden_file = self.case.expected_file
        with_golden = self.spec.variant is None and os.path.exists(golden_file)
        comparing = f"while comparing the outputs ({self.returned})"
        self.hold("the call's", actual)
        expected = reference_cache.load(self.cached)
        found: dict[str, Any] = {}
        passed = False
        if expected is not None:
            look = self.stored_look()
            comparison, against_golden = self.judged(actual, expected, look, with_golden)
            passed = comparison.ok and (against_golden is None or against_golden.ok)
        if not passed:
            fresh = self.fresh_reference()
            if isinstance(fresh, Outcome):
                return fresh
            self.untouched(_reference_words(self.case))
            self.hold("the reference's", fresh)
            found = fresh
            note(comparing)
            if expected is None and self.cached is not None:
                # A reference too fast to be kept: what the cache holds beside it (a rounding
                # budget costs draws) may still let the run pass, as it does above.
                look = self.stored_look()
                comparison, against_golden = self.judged(actual, found, look, with_golden)
                passed = comparison.ok and (against_golden is None or against_golden.ok)
        if not passed:
            look = self.fresh_look(found)
            try:
                comparison, against_golden = self.judged(actual, found, look, with_golden)
            except second_look.Abandoned as failed:
                raise failed.error from None  # as when it happened before judging
        self.store(look)
        self.notes.extend(look.notes())
        against = found or expected or {}
        _say_nothing_compared(actual, against, self.notes)
        held = self.held(actual, against, comparison)
        held_paths = {failure.path for failure in held}
        self.notes.extend(note for note in comparison.notes
                          if not any(note.startswith(f"{path} passed") for path in held_paths))
        fields = {"max_abs": comparison.max_abs, "max_rel": comparison.max_rel,
                  "budgets": comparison.budgets}
        if held:
            return self.held_outcome(held, comparison, {
                **fields, "nonfinite": self.nonfinite(actual, against, comparison)})
        if not comparison.ok:
            return self.outcome("failed", "outputs differ from the reference: "
                                f"{comparison.headline()}", details=comparison.report(),
                                error_message=comparison.where(), kind="mismatch",
                                nonfinite=self.nonfinite(actual, against, comparison),
                                **fields)
        if against_golden is not None and not against_golden.ok:
            return self.outcome(
                "failed", self.golden_summary(golden_file.name), details=against_golden.report(),
                error_message=against_golden.where(), kind="golden mismatch",
                max_abs=against_golden.max_abs, max_rel=against_golden.max_rel,
                nonfinite=self.nonfinite(actual, golden.load(golden_file), against_golden))
        problem = self.gradients_checked(actual)
        if problem is not None:
            return self.outcome("failed", "the gradients disagree with finite differences of "
                                "the call's own forward (float64 on the CPU): "
                                f"{problem}", error_message="gradients: gradcheck",
                                details=_GRADCHECK_HELP, kind="mismatch", **fields)
        also = f" and {golden_file.name}" if against_golden is not None else ""
        return self.outcome("passed", f"outputs match the reference{also}", kind="passed",
                            **fields)

    def golden_summary(self, name: str) -> str:
        if self.inputs_cast():
            return (f"outputs match the reference but differ from the golden {name}; if the "
                    "change is intended, rewrite it with --gpu-cases-regen")
        return (f"outputs match the reference, but {_reference_words(self.case)} differs from "
                f"the golden {name} (actual: the reference now): the computation changed "
                "since the golden was written; if the change is intended, rewrite it with "
                "--gpu-cases-regen")

    def nonfinite(self, actual: Mapping[str, Any], expected: Mapping[str, Any],
                  comparison: Comparison) -> tuple[str, ...]:
        """The leaves that differ because the run is NaN or infinite where ``expected`` is
        not (``Outcome.nonfinite``): what a failure recorded as a non-finite output needs
        to be met again."""
        paths = [m.path for m in comparison.mismatches if m.kind == "values"]
        if not paths:
            return ()
        ours, theirs = second_look.leaves_of(actual), second_look.leaves_of(expected)
        return tuple(path for path in paths
                     if ranges.non_finite(ours.get(path), theirs.get(path))
                     or (not self.expect.equal_nan and _nan_in(ours.get(path))))

    def held(self, actual: Mapping[str, Any], expected: Mapping[str, Any],
             comparison: Comparison) -> list[ranges.RangeFailure]:
        """The leaves that fail, or pass only within a budget wider than the detectability
        rule, because the run's precision cannot hold a value of their computation
        (``verdict.ranges``): the reference runs once more for them, with that precision's
        range and no rounding. Not under autocast, whose operations hold their results in
        several dtypes."""
        paths = [m.path for m in comparison.mismatches if m.kind == "values"]
        paths += [str(found["path"]) for found in comparison.budgets
                  if found.get("wide") and found["path"] not in paths]
        if not paths or not expected or self.case.context.autocast is not None:
            return []
        ours, theirs = second_look.leaves_of(actual), second_look.leaves_of(expected)
        limited: tuple[dict[str, object], dict[str, Any]] | None = None
        failures = []
        for path in paths:
            found = ranges.result_overflow(path, ours.get(path), theirs.get(path),
                                           self.precision)
            # The reference runs again only where the range may be the cause: the draws met
            # a value past it, or the run is non-finite where the reference is not.
            if found is None and (self.range_events
                                  or ranges.non_finite(ours.get(path), theirs.get(path))):
                if limited is None:
                    limited = self.range_limited()
                found = ranges.range_failure(path, ours.get(path), theirs.get(path),
                                             limited[0].get(path), self.precision, limited[1])
            if found is not None:
                failures.append(found)
        return failures

    def range_limited(self) -> tuple[dict[str, object], dict[str, Any]]:
        note(f"while running the reference with {_name(self.precision)}'s range "
             f"({self.returned})")
        try:
            found = second_look.range_limited(self.call_reference, self.reference_inputs(),
                                              self.cotangents, self.precision)
        except Exception:  # the user's code with a narrower range: no finding, never raised
            return {}, {}
        self.untouched("the reference with the run's range")
        return found

    def held_outcome(self, held: list[ranges.RangeFailure], comparison: Comparison,
                     fields: dict[str, Any]) -> Outcome:
        """A failure whose cause is the run's dtype's range: its own class, and advice."""
        first = held[0]
        name = _name(self.precision)
        also = (f"outputs differ from the reference: {comparison.headline()}"
                if not comparison.ok else
                f"{first.path} passed only within a rounding budget its range widened")
        report = "\n".join(failure.message for failure in held)
        if not comparison.ok:
            report += "\n" + comparison.report()
        return self.outcome(
            "failed", f"a value of this computation is outside the range {name} holds "
            f"({first.kind}): {also}", details=report,
            error_message=comparison.where() if not comparison.ok
            else f"{first.path}: values differ", kind="mismatch", verdict_class=first.kind,
            **fields)

    def outcome(self, status: Literal["passed", "failed", "skipped"], summary: str,
                **fields: Any) -> Outcome:
        return Outcome(status, summary, notes=tuple(self.notes), **fields)

    def judged(self, actual: dict[str, Any], expected: dict[str, Any], look: second_look.Look,
               with_golden: bool) -> tuple[Comparison, Comparison | None]:
        """The comparison with the reference, and with the golden when it passed. The
        comparison runs none of the user's code: the budgets and the baseline it asks for
        are computed here (``Look.settle``, for the leaves that asked only) and the outputs
        compared again."""
        for _ in range(_SETTLES):
            found = self.judged_once(actual, expected, look, with_golden)
            if not look.waiting:
                break
            look.settle()
        return found

    def judged_once(self, actual: dict[str, Any], expected: dict[str, Any],
                    look: second_look.Look,
                    with_golden: bool) -> tuple[Comparison, Comparison | None]:
        comparison = compare_results(actual, expected, self.expect, self.precision,
                                     self.spec.device, look)
        if not (with_golden and comparison.ok):
            return comparison, None
        kept = golden.load(self.case.expected_file)
        if _identical(kept, expected):
            # The golden holds the reference's own values (as --gpu-cases-regen writes it, and
            # until the reference changes): the run compares with it as with the reference.
            return comparison, comparison
        if self.inputs_cast():
            # The reference ran on the inputs cast to the run's dtype, the golden on the
            # case's own: they differ by that rounding, which the budget measures.
            return comparison, compare_results(actual, kept, self.expect, self.precision,
                                               self.spec.device, look)
        # The golden is what the reference computed when it was written: the run passed the
        # reference within the rounding of its own precision, so what is left to ask is
        # whether the reference still computes the golden. That is the same code on the
        # same inputs: held to what another run or machine moves the reference by (float32's
        # tolerance at the least, GOLDEN_PRECISION), never to the run's rounding budget (which
        # let a wrong rotary frequency through, RMS 0.165 within a budget of 0.362).
        return comparison, compare_results(expected, kept, self.expect, GOLDEN_PRECISION)

    def inputs_cast(self) -> bool:
        """Whether the run cast floating inputs to another dtype (``[matrix] dtypes``), so
        that its reference ran on other inputs than the golden was written from."""
        if not self.spec.cast:
            return False
        if self._inputs_cast is None:
            file = self.case.inputs_file
            codes = [info.dtype for info in payload.describe(file)] if file.exists() else []
            self._inputs_cast = any(
                payload.DTYPES.get(code, ("",))[0].startswith(("float", "bfloat"))
                and payload.DTYPES[code][0] != self.spec.dtype for code in codes)
        return self._inputs_cast

    def fresh_reference(self) -> dict[str, Any] | Outcome:
        began = time.perf_counter()
        note(f"while computing {_reference_words(self.case)} on the CPU ({self.returned})")
        try:
            with labelled_output(REFERENCE_OUTPUT):
                expected = self.call_reference(self.reference_inputs_releasing(),
                                               self.cotangents)
        except BadOutput as problem:
            return problem.outcome("the reference's")
        except NothingDifferentiated as problem:
            raise problem.error(self.case, "the reference") from None
        except BaseException as exc:  # SystemExit and the like too: see raised
            return reference_failed(self.case, exc)
        self.reference_seconds = time.perf_counter() - began
        shared_why = getattr(self.reference, "shared_why", None)
        if shared_why:
            self.notes.append(
                "the reference ran in the call's own module, since its body could not run a "
                f"second time apart ({shared_why}): what the call left at module level (a "
                "cache) was the reference's too")
        reference_cache.store(self.cached, expected, self.reference_seconds)
        return expected

    def stored_look(self) -> second_look.Look:
        """The second look from what the cache holds beside the reference: read only when a
        leaf asks (a passing run reads nothing more), and never computed: a leaf it cannot
        clear sends the run to the fresh reference."""
        def baseline() -> dict[str, Any]:  # named only when a leaf asks, as the spreads are
            return reference_cache.load(reference_cache.companion(
                self.cached, f"baseline1-{_name(self.precision)}")) or {}

        def spreads(paths: object) -> Mapping[str, tuple[Any, ...]]:
            found = reference_cache.load(self.budget_entry())
            stored = found.get("spreads", {}) if found else {}
            for kind in str(found.get("ranges", "") if found else "").split(","):
                if kind in ranges.RANGE_CLASSES:
                    self.range_events.setdefault(kind, None)
            elements = found.get("elements", {}) if found else {}
            return {path: (float(pair[0]), float(pair[1]), elements.get(path))
                    for path, pair in stored.items()}

        return second_look.Look(precision=self.precision, spreads=spreads,
                                baseline=baseline)

    def budget_entry(self) -> reference_cache.Entry | None:
        """Where the rounding budget is kept: named by content (``reference_cache.persisted``),
        so that a CI job that restores the cache folder on a fresh checkout finds it; made
        once, when a leaf first asks for a budget, so that reading and keeping agree."""
        if self._budget_entry is None:
            self._budget_entry = (reference_cache.persisted(
                self.cached, self.spec, self.reference, f"{_BUDGET}-{_name(self.precision)}"),)
        return self._budget_entry[0]

    def fresh_look(self, expected: dict[str, Any]) -> second_look.Look:
        def drawn_call(inputs: Mapping[str, Any],
                       cotangents: Mapping[str, torch.Tensor]) -> dict[str, Any]:
            outputs = self.call_reference(inputs, cotangents)
            self._untouched_in_draw("a draw of the rounding budget")
            return outputs

        draw = second_look.drawn(drawn_call, self.reference_inputs, self.cotangents,
                                 self.precision, self.range_events, autocast=self.autocast)
        return second_look.Look(
            precision=self.precision, fresh=True,
            spreads=lambda paths: second_look.element_spreads_of(expected, draw, paths),
            baseline=self.baseline if self.spec.device != "cpu" else None)

    def baseline(self) -> dict[str, Any]:
        """The call again on the CPU in the run's dtype and context (autocast included)."""
        note(f"while running the call on the CPU in {_name(self.precision)} as the baseline "
             f"of this precision ({self.returned})")
        inputs = {name: each_tensor(value, lambda t: t.detach().cpu().clone())
                  for name, value in self.saved().items()}
        cotangents = dict(self.cotangents)
        with replay_context(self.case.context, "cpu", self.rng):
            outputs = call(self.func, inputs, self.expect.gradients, "cpu", cotangents,
                           self.precision)
        self._untouched_in_draw("the call's CPU baseline")
        return outputs

    def store(self, look: second_look.Look) -> None:
        if not look.fresh:
            return
        if "spreads" in look.computed and look.spreads:
            finite = {path: [value[0], value[1]] for path, value in look.spreads.items()
                      if all(math.isfinite(v) for v in value[:2])}
            elements = {path: value[2] for path, value in look.spreads.items()
                        if path in finite and len(value) > 2
                        and isinstance(value[2], torch.Tensor)}
            # Read back faster than any draw is made (as a gradcheck's pass): kept however
            # fast the draws were, unlike tensors of results; written once (a failing run
            # computes them afresh each time, to the same numbers).
            budget = self.budget_entry()
            if reference_cache.load(budget) is None:
                reference_cache.store(budget, {"spreads": finite, "elements": elements,
                                               "ranges": ",".join(self.range_events)},
                                      max(look.seconds["spreads"], reference_cache.MIN_SECONDS))
        if "baseline" in look.computed and look.baseline_results:
            reference_cache.store(
                reference_cache.companion(self.cached, f"baseline1-{_name(self.precision)}"),
                dict(look.baseline_results), look.seconds["baseline"])

    def gradients_checked(self, actual: Mapping[str, Any]) -> str | None:
        """A float64 gradcheck of the call where its gradients met only its own float64 run
        (no independent ``reference``), or a note saying why nothing independent checked
        them; a pass is kept beside the reference."""
        if not self.expect.gradients or self.case.reference:
            return None
        _say_ungiven(actual, self.notes)
        unchecked = ("the gradients were compared with the call's own run on the CPU, whose "
                     "backward is the same code: nothing independent checked them")
        if self.autocast:
            self.notes.append(f"{unchecked} (under [context] autocast the reference runs in "
                              "float32, too coarse for finite differences); name an "
                              "independent reference to check them")
            return None
        passed = reference_cache.companion(self.cached, "gradcheck2")
        if reference_cache.load(passed) is not None:
            return None
        note(f"while checking the gradients against finite differences ({self.returned})")
        began = time.perf_counter()
        rng = self.rng.get("cpu")
        try:
            with torch.set_grad_enabled(grad_mode(self.case.context)):
                given = [name for name, grad in actual.get("grad", {}).items()
                         if grad is not None]
                problem = second_look.gradient_check(
                    lambda inputs: self.reference(**inputs), upcast(self.saved()), given,
                    rng.to(torch.uint8) if rng is not None else None,
                    max(self.reference_seconds, 1e-4))
        except second_look.NotChecked as why:
            self.notes.append(f"{unchecked}: a float64 gradcheck was not run ({why}); name an "
                              "independent reference to check them")
            return None
        except Exception as exc:  # the user's code under gradcheck: said, never raised
            self.notes.append(f"{unchecked}: the float64 gradcheck could not run "
                              f"({type(exc).__name__}: {_first_line(exc)})")
            return None
        if problem is None:
            reference_cache.store(passed, {"gradcheck": "passed"},
                                  max(time.perf_counter() - began, reference_cache.MIN_SECONDS))
        return problem


def _say_nothing_compared(actual: Mapping[str, Any], against: Mapping[str, Any],
                          notes: list[str]) -> None:
    """Say so where the call and the reference both returned None and nothing else was
    compared: a pass then checks nothing."""
    if actual.get("out") is None and against.get("out") is None and not actual.get("grad"):
        notes.append("the call returned None, as the reference did: nothing was compared (a "
                     "kernel that works in place leaves its results in its inputs: return "
                     "them from the case's call to have them checked)")


def _say_ungiven(actual: Mapping[str, Any], notes: list[str]) -> None:
    """Name the floating inputs the call gave no gradient (a custom backward returning None
    for one, a ``detach``): a float64 run of the same code gives none either, and finite
    differences cannot tell a stop-gradient meant from one forgotten, so nothing checked
    them; said, never passed in silence."""
    ungiven = [name for name, grad in actual.get("grad", {}).items() if grad is None]
    if ungiven:
        names = ", ".join(ungiven[:10]) + (", ..." if len(ungiven) > 10 else "")
        notes.append(f"the call gave no gradient to {names} (a backward that returns None "
                     "for it, or a detach): nothing checked whether it should have one; "
                     "name an independent reference that differentiates it to check it")


# The name of the rounding budget kept beside a reference (its format's version with it), under
# a name made of content (reference_cache.persisted).
_BUDGET = "budget3"
# Rounds of compare, compute what it asked for, compare again: spreads, then a baseline a
# leaf asks for once its budget is known, then the last comparison.
_SETTLES = 4

# The least precision a golden is held to against the reference that wrote it: what the
# same code on the same inputs moves by between runs, machines and torch versions (another
# summation order, another BLAS), not the rounding budget of the run's precision.
GOLDEN_PRECISION = torch.float32

_GRADCHECK_HELP = (
    "The case names no independent reference, so the gradients were compared with the "
    "call's own backward run in float64, which a wrong backward formula (a custom "
    "torch.autograd.Function, say) passes every time; the check compares that backward with "
    "central differences of the forward instead, along random directions. A kink at the "
    "inputs (relu at exactly 0, a max with ties) can fail it too: then name an independent "
    "reference = \"case.py:reference\" in case.toml.")


def _nan_in(value: object) -> bool:
    """Whether a leaf of a run holds NaN (a NaN against NaN differs without equal_nan)."""
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return bool(torch.isnan(value.detach()).any())
    return False


def autocast_reference(case: Case) -> bool:
    """Whether the reference is the call in float32 without autocast: a case recorded under
    autocast whose reference is the call itself. Its code casts explicitly for mixed
    precision (``.float()``, a float32 buffer), which float64 activations would meet with
    "mat1 and mat2 must have the same dtype"; float32 is the dtype those casts are written
    for, and at least six orders finer than the autocast dtype it is judged in."""
    autocast = case.context.autocast
    return autocast is not None and autocast.enabled and not case.reference


def _reference_words(case: Case) -> str:
    return ("the float32 reference (no autocast)" if autocast_reference(case)
            else "the float64 reference")


def reference_failed(case: Case, exc: BaseException) -> Outcome:
    """A reference that cannot run: its own verdict, never the call's known failure."""
    outcome = raised("the reference", exc, "reference raises")
    error = describe_exception(exc).splitlines()[0]
    if case.reference:
        summary = (f"the reference could not run: {error} ({case.reference}, on the CPU in "
                   "float64); fix it so that the call's outputs can be judged")
    else:
        words = _reference_words(case)
        advice = ("name an independent reference = \"case.py:reference\" in case.toml"
                  if autocast_reference(case) else
                  "name an independent reference = \"case.py:reference\" in case.toml that "
                  "runs in float64, or, if the code casts explicitly because it runs under "
                  "autocast, set [context] autocast = { device_type = ..., dtype = ... } so "
                  "that its reference runs in float32")
        summary = f"{words} could not run: {error}; {advice}"
    return dataclasses.replace(outcome, summary=summary)


def reference_inputs(case: Case, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's inputs: on the CPU, floating tensors in float64, or in float32 where
    the reference is the call of an autocast case (``autocast_reference``)."""
    return _in_float32(inputs) if autocast_reference(case) else upcast(inputs)


def _in_float32(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The autocast reference's inputs: on the CPU, floating tensors in float32."""
    def down(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().cpu()
        if value.is_floating_point():
            return value.to(torch.float32)
        if value.is_complex():
            return value.to(torch.complex64)
        return value

    return {name: each_tensor(value, down) for name, value in inputs.items()}


def compare_results(actual: dict[str, Any], expected: dict[str, Any], expect: Expectation,
             precision: torch.dtype | None = None, device: str = "cpu",
             look: second_look.Look | None = None) -> Comparison:
    tolerances = {}
    for name, override in expect.tolerance.items():
        # ulps alone: only the ULP test applies (atol and rtol 0), as the message says.
        tolerances[getattr(torch, name)] = Tolerance(
            rtol=override.rtol or 0.0, atol=override.atol or 0.0, ulps=override.ulps,
            source=f"case.toml [expect.tolerance.{name}]")
    return combine(compare(actual[key], expected[key], tolerances=tolerances,
                           equal_nan=expect.equal_nan, check_dtype=False, path=key,
                           precision=precision, second_look=look,
                           device=device.split(":", 1)[0])
                   for key in actual)


def _identical(found: object, expected: object, depth: int = 0) -> bool:
    """Whether two outputs are the same values in the same structure, so that comparing a
    run with either gives the same comparison: containers of one type with the same keys in
    the same order or the same length; tensors of one class, dtype, shape and device with
    equal values (a NaN makes them differ); any other value of one type and equal."""
    if type(found) is not type(expected) or depth > MAX_OUTPUT_DEPTH:
        return False
    if isinstance(found, torch.Tensor):
        other: torch.Tensor = expected  # type: ignore[assignment]
        return (found.layout == torch.strided and other.layout == torch.strided
                and found.dtype == other.dtype and found.shape == other.shape
                and found.device == other.device and bool(torch.equal(found, other)))
    if isinstance(found, dict):
        pairs: dict[Any, Any] = expected  # type: ignore[assignment]
        return (list(found) == list(pairs)
                and all(_identical(found[key], pairs[key], depth + 1) for key in found))
    if isinstance(found, (list, tuple)):
        items: Sequence[Any] = expected  # type: ignore[assignment]
        return len(found) == len(items) and all(
            _identical(a, b, depth + 1) for a, b in zip(found, items, strict=True))
    if found is None or isinstance(found, (bool, int, float, complex, str)):
        return bool(found == expected)
    return False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(exc: BaseException) -> str:
    text = exception_text(exc).strip()
    return text.splitlines()[0] if text else ""

"""The parent's side of one run: start the child, read what became of it, triage a failure,
and localize an asynchronous device error with a launch-blocking rerun.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pytest_gpucase.base.backends import launch_blocking_env
from pytest_gpucase.base.errors import display
from pytest_gpucase.case.model import Case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.child import run, write_golden
from pytest_gpucase.run.judge import OUTPUT_MARKS
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.run.outcome import OutcomeKind
from pytest_gpucase.run.isolation import (
    ChildResult,
    ChildWarning,
    run_in_child,
)
from pytest_gpucase.run.prepared import prepare_in_parent
from pytest_gpucase.run.runcontext import RunContext

if TYPE_CHECKING:
    from pytest_gpucase.verdict.failure import Failure
    from pytest_gpucase.verdict.triage import Triage

# The failure path's modules (verdict.failure, verdict.triage and the secrets they remove:
# some hundred regular expressions, compiled as they are imported) are imported by the
# functions that meet a failure: a session whose runs pass never imports them.

__all__ = [
    "INCOMPLETE_CASE", "Verdict", "describe_rerun", "describe_warnings", "failure_of",
    "incomplete_pass", "listed_incomplete", "regenerate_golden", "reissue_warnings",
    "run_spec", "stderr_section",
]

STDERR_SHORT_LINES = 30  # a crash's stderr up to this long is quoted in the failure text


@dataclass(frozen=True)
class Verdict:
    """What the parent concludes of one run, with everything a report needs."""

    spec: RunSpec
    outcome: Outcome
    child: ChildResult
    triage: Triage | None = None
    localized: Verdict | None = None  # the launch-blocking rerun of an asynchronous error

    @property
    def failed(self) -> bool:
        return self.outcome.status == "failed"


def failure_of(verdict: Verdict) -> Failure | None:
    """What a failed run failed with, for ``verdict.failure.same_failure``; None when it
    passed or was skipped. A failure without an exception is its kind and where it was met
    (``mismatch: out['loss']: values differ``), else its one-line summary (a timeout)."""
    outcome = verdict.outcome
    if outcome.status != "failed":
        return None
    from pytest_gpucase.verdict.failure import Failure

    if outcome.error_type is not None:
        return Failure(outcome.error_type, outcome.error_message or "", verdict.child.stderr,
                       verdict.spec.device)
    message = (f"{outcome.kind}: {outcome.error_message}" if outcome.error_message
               else outcome.summary)
    return Failure(None, message, verdict.child.stderr, verdict.spec.device)


def run_spec(spec: RunSpec, ctx: RunContext, *, expects_failure: bool = False) -> Verdict:
    """Run ``spec`` in a child as ``ctx`` says and judge it; rerun with launch blocking when
    that helps (``ctx.localize``).

    The child's environment is ``ctx.env(spec)``; its memory limit the case's own, else the
    context's. With a reference cache in ``ctx``, the float64 reference is computed once per
    case and variant and reused (``reference_cache`` module).

    With ``ctx.isolation`` ``case`` or ``worker`` and a pool, the run goes to a reused child
    (one per case, or one per device and environment). What such a child says is reported
    only when it was a fresh child's (the worker's first call), or when it cannot be a
    failure: a failure seen after an earlier call, or any outcome when the item
    ``expects_failure`` (a strict xfail reports a pass as XPASS(strict), a failure as an
    expected one), ends that child and is judged again in a fresh child. A timeout is the
    exception: the worker's state was checked after its last call (``WorkerPool``), and a
    second run would pay the timeout twice, so it is reported as it is, saying where it ran.
    """
    env = ctx.env(spec)
    reused = ctx.reuses()
    key = (spec.device, tuple(sorted(env.items())),
           str(spec.case.path) if ctx.isolation == "case" else None)
    child = _start(spec, ctx, env, key if reused else None)
    outcome = child.value if child.returned else _crash_outcome(spec, child)
    if reused:
        assert ctx.pool is not None
        if outcome.status == "failed" or (child.reused and expects_failure):
            ctx.pool.retire(key)  # whatever failed may have left the child unfit
        if child.reused and child.timed_out:
            outcome = replace(outcome, summary=outcome.summary + _TIMED_OUT_REUSED)
        elif child.reused and (outcome.status == "failed" or expects_failure):
            return run_spec(spec, ctx.fresh())  # the fresh child's verdict is the one reported
    found = None
    if outcome.status == "failed":
        from pytest_gpucase.verdict.triage import triage

        found = triage(outcome.error_type or "", outcome.error_message or outcome.summary,
                       child.stderr)
    return _localized(Verdict(spec, outcome, child, found), ctx)


def listed_incomplete(case: Case) -> str:
    """What the case lacks (``Case.incomplete``), a line each, as its reports list it."""
    return "\n".join(f"  - {reason[:2000]}" for reason in case.incomplete[:10])


# The error type of a pass of an incomplete case, told as the case's failure.
INCOMPLETE_CASE = "IncompleteCase"


def incomplete_pass(verdict: Verdict) -> Verdict:
    """``verdict``, or a failure of the case where it passed a case the Recorder marked
    incomplete (``Case.incomplete``): such a case replays something other than what failed
    (a model rebuilt without state the capture could not hold, a step without its trainer),
    so its pass says nothing of whether the captured failure is fixed, and must not gate
    green. What the entry points that judge a case report (the item, ``gpu_case.run``);
    the tools that replay a case to learn how it behaves (narrowing, minimize) see the
    run as it was."""
    case = verdict.spec.case
    if verdict.outcome.status != "passed" or not case.incomplete:
        return verdict
    error = case.origin.get("error")
    failure = f" ({str(error)[:300]})" if isinstance(error, str) and error else ""
    summary = (f"{display(case.case_file)}: the run passed, but the case is incomplete "
               f"([origin] incomplete): it does not replay the captured failure{failure}, so "
               "this pass cannot tell whether it is fixed")
    details = ("What the case lacks:\n" + listed_incomplete(case) + "\n"
               + "Complete the case (or record it again once the capture can hold it), then "
                 "delete `incomplete` from [origin] in case.toml.")
    outcome = Outcome("failed", summary, details=details, kind="broken case",
                      error_type=INCOMPLETE_CASE, error_message=summary,
                      max_abs=verdict.outcome.max_abs, max_rel=verdict.outcome.max_rel,
                      notes=verdict.outcome.notes)
    return replace(verdict, outcome=outcome)


_TIMED_OUT_REUSED = (
    "; it ran in a reused worker, whose state was found as a fresh child's after its last "
    "call, and was not run again so that the timeout is paid once (--gpu-isolation item "
    "runs every item in a fresh child)")


def _start(spec: RunSpec, ctx: RunContext, env: dict[str, str],
           key: tuple[object, ...] | None) -> ChildResult:
    """Run ``spec`` in a child: a reused one of ``ctx.pool`` under ``key``, else a fresh one.
    Only an ``Outcome`` comes back as a value: the child runs a case's code, which may send
    anything."""
    memory_limit = ctx.memory_limit_for(spec.case)
    if key is not None:
        assert ctx.pool is not None
        child = ctx.pool.run(key, run, spec, timeout=spec.case.timeout, env=env,
                             start_method=ctx.start_method, memory_limit=memory_limit,
                             exclusive=ctx.isolation == "case", marks=OUTPUT_MARKS,
                             label=f"{display(spec.case.path)} [{spec.id}]")
    else:
        # What the child would find the same way is found by the process that forks it.
        child = run_in_child(run, spec, timeout=spec.case.timeout, env=env,
                             start_method=ctx.start_method, memory_limit=memory_limit,
                             marks=OUTPUT_MARKS, prepare=(prepare_in_parent, (spec,), {"env": env}))
    if child.returned and not isinstance(child.value, Outcome):
        child = replace(child, value=None, returned=False, bad_result=(
            f"sent a {type(child.value).__name__} instead of an Outcome"))
    return child


def _localized(verdict: Verdict, ctx: RunContext) -> Verdict:
    """``verdict`` with its launch-blocking rerun, where the error was asynchronous and the
    backend has such a variable (``ctx.localize``)."""
    spec = verdict.spec
    blocking = launch_blocking_env(ctx.backend)
    asynchronous = verdict.triage is not None and verdict.triage.asynchronous
    if not (ctx.localize and asynchronous and blocking and not spec.launch_blocking):
        return verdict
    rerun_spec = replace(spec, env={**spec.env, **blocking}, launch_blocking=True)
    return replace(verdict, localized=run_spec(rerun_spec, replace(ctx.fresh(), localize=False)))


def regenerate_golden(case: Case, ctx: RunContext) -> ChildResult:
    """Write the case's golden outputs from its reference run, in a fresh child, with the
    environment a CPU run of the case gets in ``ctx``."""
    env = ctx.env(RunSpec(case, "cpu", "float64", cast=False))
    return run_in_child(write_golden, case, timeout=case.timeout, env=env,
                        start_method=ctx.start_method, memory_limit=ctx.memory_limit_for(case))


def _crash_outcome(spec: RunSpec, child: ChildResult) -> Outcome:
    """A child that returned nothing becomes a failure naming why, with its last words."""
    where = display(spec.case.case_file)
    # The child's last note says what was running (the reference, say), which a stack dump
    # alone does not: gpucase's frames are hidden from it.
    during = f" {child.phase}" if child.phase else ""
    if child.timed_out:
        summary = (f"{where}: run timed out after {spec.case.timeout:g} s{during} and was killed "
                   "with its process group and every process it started")
        if child.starting:
            summary += ("; its process was still starting, before the case's code ran, so "
                        "there are no stacks: raise timeout in case.toml if this machine is "
                        "that loaded")
        else:
            summary += "; the stack of every thread at the timeout is in the captured stderr"
        if during:
            summary += ("; the timeout counts the call, its float64 reference and the "
                        "comparison together: raise timeout in case.toml if they are slow, "
                        "not hung")
    elif child.child_error is not None:
        summary = f"{where}: the run failed inside the child"
    else:
        summary = f"{where}: run {child.problem}{during}"
    from pytest_gpucase.verdict.triage import assertion_line

    details = child.child_error or _stderr_pointer(child.stderr)
    line = assertion_line(child.stderr)
    message = line or (child.problem or "")
    kind: OutcomeKind = "timeout" if child.timed_out else "crash"
    return Outcome("failed", summary, details=details, kind=kind,
                   error_type="Crash" if child.signal else None, error_message=message)


def _stderr_pointer(stderr: str) -> str:
    """Where a crash's last words are: the stderr section (quoting them here too would show a
    stack dump twice in one report), or its last lines when they are few."""
    lines = stderr.rstrip().splitlines()
    if not lines:
        return "stderr is empty"
    if len(lines) <= STDERR_SHORT_LINES and "(most recent call first):" not in stderr:
        return "stderr:\n" + "\n".join(lines)
    return f"the child's stderr ({len(lines)} lines) is in the report's 'stderr (child)' section"


def stderr_section(verdict: Verdict) -> str:
    """The child's stderr as the report's section shows it: all of it, unless the failure text
    above quotes it already (then nothing)."""
    stderr = verdict.child.stderr
    if stderr and verdict.outcome.details == f"stderr:\n{stderr.rstrip()}":
        return ""
    return stderr


def describe_warnings(child: ChildResult) -> str:
    """The child's warnings, one line each, as the report's 'warnings (child)' section."""
    lines = [warning.render() for warning in child.warnings]
    if child.warnings_dropped:
        lines.append(f"[... {child.warnings_dropped} more distinct warnings not kept ...]")
    return "\n".join(lines)


def reissue_warnings(found: Iterable[ChildWarning]) -> None:
    """Raise the child's warnings again here, so that pytest's warning summary shows them.

    A builtin category is kept; any other (torch's, the case's own) becomes a
    UserWarning whose message names it, as its class is not imported here.
    """
    for warning in found:
        category = getattr(builtins, warning.category, None)
        message = warning.message
        if not (isinstance(category, type) and issubclass(category, Warning)):
            category, message = UserWarning, f"{warning.category}: {message}"
        warnings.warn_explicit(f"(in the case's child) {message}", category, warning.filename,
                               warning.lineno, module=warning.filename.removesuffix(".py"),
                               registry={})


def describe_rerun(verdict: Verdict) -> str:
    """The launch-blocking rerun in words: where it places the first error."""
    rerun = verdict.localized
    if rerun is None:
        return ""
    names = ", ".join(f"{k}={v}" for k, v in rerun.spec.env.items())
    lines = [f"rerun in a new child with {names}:",
             f"  first error as seen: {verdict.outcome.summary}",
             f"  with launch blocking: {rerun.outcome.summary}"]
    if rerun.outcome.details:
        lines += ["", rerun.outcome.details.rstrip()]
    from pytest_gpucase.verdict.triage import assertion_line

    line = assertion_line(rerun.child.stderr)
    if line:
        lines += ["", f"kernel assertion: {line}"]
    return "\n".join(lines)

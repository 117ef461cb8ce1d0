"""The parent's side of one run: start the child, read what became of it, triage a failure,
and localize an asynchronous device error with a launch-blocking rerun.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .environment import launch_blocking_env
from .errors import display
from .case import Case
from .execute import Outcome, run, write_golden
from .isolation import ChildResult, StartMethod, run_in_child
from .matrix import RunSpec
from .triage import Triage, assertion_line, triage

STDERR_TAIL_LINES = 30


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


def run_spec(spec: RunSpec, *, start_method: StartMethod, backend: str,
             localize: bool = True) -> Verdict:
    """Run ``spec`` in a fresh child and judge it; rerun with launch blocking when that helps."""
    child = run_in_child(run, spec, timeout=spec.case.timeout, env=dict(spec.env),
                         start_method=start_method)
    outcome = child.value if child.returned else _crash_outcome(spec, child)
    found = None
    if outcome.status == "failed":
        found = triage(outcome.error_type or "", outcome.error_message or outcome.summary,
                       child.stderr)
    verdict = Verdict(spec, outcome, child, found)
    blocking = launch_blocking_env(backend)
    asynchronous = found is not None and found.asynchronous
    if localize and asynchronous and blocking and not spec.launch_blocking:
        rerun_spec = replace(spec, env={**spec.env, **blocking}, launch_blocking=True)
        verdict = replace(verdict, localized=run_spec(rerun_spec, start_method=start_method,
                                                      backend=backend, localize=False))
    return verdict


def regenerate_golden(case: Case, *, start_method: StartMethod) -> ChildResult:
    """Write the case's golden outputs from its reference run, in a fresh child."""
    return run_in_child(write_golden, case, timeout=case.timeout, start_method=start_method)


def _crash_outcome(spec: RunSpec, child: ChildResult) -> Outcome:
    """A child that returned nothing becomes a failure naming why, with its last words."""
    where = display(spec.case.case_file)
    if child.timed_out:
        summary = (f"{where}: run timed out after {spec.case.timeout:g} s and was killed with its "
                   "process group; the stack of every thread at the timeout is in the "
                   "captured stderr")
    elif child.child_error is not None:
        summary = f"{where}: the run failed inside the child"
    else:
        summary = f"{where}: run {child.problem}"
    tail = "\n".join(child.stderr.rstrip().splitlines()[-STDERR_TAIL_LINES:])
    details = child.child_error or (f"last lines of stderr:\n{tail}" if tail else "stderr is empty")
    line = assertion_line(child.stderr)
    message = line or (child.problem or "")
    kind = "timeout" if child.timed_out else "crash"
    return Outcome("failed", summary, details=details, kind=kind,
                   error_type="Crash" if child.signal else None, error_message=message)


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
    line = assertion_line(rerun.child.stderr)
    if line:
        lines += ["", f"kernel assertion: {line}"]
    return "\n".join(lines)

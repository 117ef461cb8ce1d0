"""The verdict of one run as plain data (``Outcome``), and an exception of the user's code
told as Python tells it, without gpucase's own frames."""

# No ``from __future__ import annotations`` here: the parent rebuilds an Outcome field by
# field, checking each against its annotation; annotations kept as objects resolve anywhere.
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pytest_gpucase.base.results import result_type

__all__ = ["OUTCOME_KINDS", "CaseSetupError", "Outcome", "OutcomeKind", "StaleCaseError",
           "describe_exception", "exception_text", "raised", "user_traceback"]

# What happened in a run, for the tools that sort failures (minimize, ablate, the known-failure
# rule): the one list of them, checked by mypy wherever a kind is compared.
OutcomeKind = Literal[
    "",                 # not told (an outcome built by hand)
    "passed", "skipped",
    "mismatch",         # outputs differ from the reference
    "golden mismatch",  # outputs differ from the saved golden
    "raises",           # the call raised
    "reference raises",  # the reference raised: nothing judged the call
    "no exception",     # the call returned where the case expects it to raise
    "bad output",       # an output that cannot be walked: nested too deep, or holding itself
    "broken case",      # the case itself is wrong: its files, an import
    "environment",      # the dynamic loader refused a module the case imports: a package
                        # built for another torch or CUDA, a library missing (not the case)
    "crash", "timeout",  # the child died, or was killed at its deadline
]
OUTCOME_KINDS: tuple[str, ...] = typing.get_args(OutcomeKind)


@result_type   # what a run's child sends back (isolation.wire)
@dataclass(frozen=True)
class Outcome:
    """The verdict of one run, as plain data that crosses the process boundary."""

    status: Literal["passed", "failed", "skipped"]
    summary: str                       # one line a person reads first
    details: str = ""                  # the mismatch report or traceback
    error_type: str | None = None      # the exception raised by the call, if any
    # Its text; for outputs that differ, where and what (Comparison.where): what "the same
    # failure" compares (verdict.failure), as the numbers of the summary change with inputs.
    error_message: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    kind: OutcomeKind = ""             # what happened (OutcomeKind)
    # What the verdict could not check, and why, shown with the item's report on a pass too
    # ("nothing independent checked the gradients": no reference, and no gradcheck).
    notes: tuple[str, ...] = ()
    # Each output judged by its rounding budget: path, precision, multiplier, RMS error and
    # allowance, their ratio, and the constant error it lets through (verdict.compare's
    # budget_record), for the JSON report; () where every output passed at once.
    budgets: tuple[dict[str, Any], ...] = ()
    # A mismatch whose cause is the range of the run's precision (verdict.ranges): "overflow"
    # or "underflow"; "" for any other outcome.
    verdict_class: str = ""
    # For outputs that differ: the leaves the run holds NaN or inf in where what it was
    # compared with does not (a NaN against NaN too, unless equal_nan): a failure recorded
    # as a non-finite output is met by such outputs only, not by any difference of values.
    nonfinite: tuple[str, ...] = ()
    # For a case that could not be set up (error_type "CaseSetupError" or a subclass): the
    # type of the exception that stopped it (its ``__cause__``: "ModuleNotFoundError"), so
    # that what caused it is read here, not out of the words of its message.
    cause_type: str | None = None

    @property
    def broken_case(self) -> bool:
        return self.kind == "broken case"



def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or what Python's traceback module prints when that raises: the user's
    ``__str__`` may fail, and the report of their exception must not."""
    try:
        return str(exc)
    except BaseException:  # anything at all: it is the user's code
        return "<exception str() failed>"


def describe_exception(exc: BaseException) -> str:
    """``ValueError: bad``, or the bare name for an empty message, as a traceback ends."""
    text = exception_text(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# The machinery that calls the user's code; its frames only add noise to a traceback.
_MACHINERY = {*(str(Path(__file__).with_name(name)) for name in (
                  "child.py", "calls.py", "context.py", "judge.py", "outcome.py",
                  "second_look.py")),
              *(str(path) for path in Path(__file__).with_name("isolation").glob("*.py"))}


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of gpucase's own calling machinery."""
    try:
        tb = traceback.TracebackException.from_exception(exc)
        tb.stack = traceback.StackSummary.from_list(
            [frame for frame in tb.stack if frame.filename not in _MACHINERY])
        return "".join(tb.format())
    except Exception as failed:  # an exception hostile enough to break the traceback module
        return (f"{describe_exception(exc)}\n(its traceback could not be formatted: "
                f"{describe_exception(failed)})\n")


class CaseSetupError(Exception):
    """Raised while a case's call sets itself up, before the code under test runs: the
    user's module imported, the model built, its saved state loaded into it
    (``run.replay``). Its cause is the error that stopped it. Told as a broken case
    (``raised``), never as the call's failure: not the captured one, and not one a case
    should be made to expect."""


class StaleCaseError(CaseSetupError):
    """The saved state of a model case no longer fits the model its code builds now: a key
    the model lacks or has beyond the state, a shape or kind of dtype changed (a layer
    renamed, a buffer made non-persistent). The case was recorded from other code: it is
    to be recorded again, not expected to fail."""


def _setup_failure(what: str, exc: CaseSetupError) -> Outcome:
    """A case that could not set its call up: a broken case, or the environment's failure
    when the dynamic loader refused a module it imports (``triage.loader_words``)."""
    from pytest_gpucase.verdict.triage import loader_words

    # The cause's traceback (the user's constructor that raised); none of the replay's own.
    text = user_traceback(exc.__cause__) if exc.__cause__ is not None else ""
    first = exception_text(exc).splitlines()[0] if exception_text(exc) else type(exc).__name__
    cause: BaseException | None = exc.__cause__
    kind: OutcomeKind = "broken case"
    for _ in range(8):
        if cause is None:
            break
        if loader_words(exception_text(cause)) is not None:
            kind = "environment"
            break
        cause = cause.__cause__ or cause.__context__
    cause_type = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
    return Outcome("failed", f"{what} could not be set up: {first}", details=text,
                   error_type=type(exc).__name__, error_message=exception_text(exc), kind=kind,
                   cause_type=cause_type)


def raised(what: str, exc: BaseException, kind: OutcomeKind = "raises") -> Outcome:
    """``exc``, raised by the user's call or reference, as the run's failure.

    Any ``BaseException``: ``sys.exit()`` in a case, a ``KeyboardInterrupt`` or a
    ``BaseException`` subclass it raises are its result, told as any exception is. A real
    Ctrl-C never arrives as one: the child's SIGINT is at its default action
    (``isolation.child._child_main``), so it ends the child, and pytest, which gets its
    own, stops. A ``CaseSetupError`` is the case's own failure to set up, not the call's:
    a broken case (``_setup_failure``).
    """
    if isinstance(exc, CaseSetupError):
        return _setup_failure(what, exc)
    text = user_traceback(exc)
    first = describe_exception(exc).splitlines()[0]
    return Outcome("failed", f"{what} raised {first}", details=text,
                   error_type=type(exc).__name__, error_message=exception_text(exc), kind=kind)

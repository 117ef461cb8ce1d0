"""What the parent tells its caller about one child: ``ChildResult`` and ``ChildWarning``.

Plain values, built in the parent (the pytest process) from what the child sent and what
became of it; ``StartMethod`` names how the child was started, and ``Prepare`` what the
process that forks it prepares for it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

__all__ = ["ChildResult", "ChildWarning", "Prepare", "StartMethod", "gib", "signal_name"]

StartMethod = Literal["fork", "forkserver", "spawn"]
# A context manager's factory, its arguments and keywords: entered around a child's fork in
# the process that forks it, so that the child inherits what it found (``run_in_child``).
# Picklable: a zygote gets it as it gets the job.
Prepare = tuple[Callable[..., AbstractContextManager[Any]], tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ChildWarning:
    """A warning raised in the child: where, what, and how many times."""

    category: str        # "RuntimeWarning", or "module.Name" for one that is not a builtin
    message: str
    filename: str
    lineno: int
    count: int = 1

    def render(self) -> str:
        times = f" ({self.count} times)" if self.count > 1 else ""
        return f"{self.filename}:{self.lineno}: {self.category}: {self.message}{times}"


@dataclass(frozen=True)
class ChildResult:
    """What became of one child: its returned value, or why there is none, and its output."""

    value: Any
    returned: bool
    exitcode: int | None
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    duration: float
    start_method: StartMethod
    child_error: str | None = None  # traceback of an exception raised by the function itself
    bad_result: str | None = None   # why the child's result was refused (too big, malformed)
    memory_exceeded: bool = False
    memory_limit: int | None = None
    resident: int | None = None     # the tree's highest sampled resident memory, in bytes
    warnings: tuple[ChildWarning, ...] = ()
    warnings_dropped: int = 0       # distinct warnings past MAX_WARNINGS
    phase: str | None = None        # what the child said it was doing last (``note``)
    # A reused worker's call after its first: not a fresh child (``WorkerPool``).
    reused: bool = False
    # Timed out before its start was done (its stack signal still held, no handler yet;
    # read on Linux): killed at once, as it could not answer with its stacks.
    starting: bool = False

    @property
    def problem(self) -> str | None:
        """Why no value came back, in words, or None when it did."""
        if self.returned:
            return None
        if self.timed_out:
            return "timed out while starting" if self.starting else "timed out"
        if self.memory_exceeded:
            return (f"exceeded the memory limit of {gib(self.memory_limit or 0)} "
                    f"(resident {gib(self.resident or 0)})")
        if self.bad_result is not None:
            return self.bad_result
        if self.signal is not None:
            return f"crashed with signal {self.signal} ({signal_name(self.signal)})"
        if self.child_error is not None:
            return "raised in the child"
        if self.exitcode == 0:
            return "exited with code 0 without returning a result"
        return f"exited with code {self.exitcode} without returning a result"


def signal_name(number: int) -> str:
    """``11`` -> ``SIGSEGV``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def gib(nbytes: int) -> str:
    """``1610612736`` -> ``1.5 GiB``."""
    return f"{nbytes / 2**30:.3g} GiB"

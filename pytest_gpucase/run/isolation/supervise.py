"""The parent's side of a run: supervising one child until it has ended or been ended.

Runs in the parent (the pytest process): it drains the child's output into bounded
captures and its result pipe, keeps the deadline and the memory limit, asks for the stack
dump and kills the tree, turns SIGTERM and SIGHUP into ``RunInterrupted``, builds the
``ChildResult``, and reaps the children that returned before they exited.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import signal
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpucase.run.isolation.clipping import _Capture
from pytest_gpucase.run.isolation.proctree import (
    REAP_GRACE,
    _kill_tree,
    _resident,
    _stat,
    _tree,
)
from pytest_gpucase.run.isolation.result import ChildResult, ChildWarning, StartMethod, signal_name
from pytest_gpucase.run.isolation.wire import BadResult, _flags, _read_result, _split_notes

if TYPE_CHECKING:
    from pytest_gpucase.run.isolation.zygote import _Zygote

__all__ = [
    "DUMP_GRACE",
    "DUMP_QUIET",
    "MAX_PENDING",
    "MAX_POLL_STEP",
    "MEMORY_SAMPLE",
    "RESULT_LIMIT",
    "RunInterrupted",
    "hide_machinery",
    "reap_pending",
]

# The biggest result the parent reads; a child sending more is killed.
RESULT_LIMIT = 16 * 2**20
# Time the child gets to print its thread stacks after a timeout, before SIGKILL.
DUMP_GRACE = 2.0
DUMP_QUIET = 0.2  # stderr silent this long after the dump began: the dump is complete
MAX_POLL_STEP = 3600.0  # seconds: poll() takes milliseconds in a C int
MEMORY_SAMPLE = 0.1     # seconds between samples of the tree's resident memory
# Frames of the machinery under a case's code, hidden from faulthandler's dumps.
_MACHINERY_DIRS = frozenset({"_pytest", "pytest", "pluggy", "pytest_gpucase", "xdist", "execnet"})


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached pytest while a child ran; the child's tree was killed."""

    def __init__(self, signum: int) -> None:
        # The item is named as pytest names it while it runs ("nodeid (call)").
        running = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]
        super().__init__(f"pytest received {signal_name(signum)} while a case ran"
                         + (f" ({running})" if running else "")
                         + "; the run's processes were killed")
        self.signum = signum


@dataclass
class _Run:
    """One child and what the parent knows of its tree."""

    pid: int
    token: str
    memory_limit: int | None
    resident: int = 0
    memory_exceeded: bool = False
    ended: bool = False  # the child exited and its tree was killed after it
    zygote: _Zygote | None = None  # the child's parent, when it is not this process
    reusable: bool = False  # a worker: left running after a clean call
    kept: bool = False      # the worker was left running after this call
    sampled_at: float = field(default=-math.inf)
    started: int = 0     # the child's start time in clock ticks: no older process is marked

    def __post_init__(self) -> None:
        stat = _stat(self.pid)
        self.started = stat[2] if stat is not None else 0

    def has_exited(self) -> bool:
        """Whether the child ended (it stays unreaped, its pid its own, until ``reap``)."""
        if self.zygote is None:
            return _has_exited(self.pid)
        stat = _stat(self.pid)  # the zygote reaps only when asked: a zombie until then
        return stat is None or stat[1] in (b"Z", b"X")

    def reap(self) -> int:
        """Wait for the child and return its wait status."""
        if self.zygote is None:
            return os.waitpid(self.pid, 0)[1]
        return self.zygote.reap(self.pid)

    def kill(self) -> None:
        """Kill the whole tree; only before the child is reaped (its pid is its own till then)."""
        _kill_tree(self.pid, self.token, include_root=True, since=self.started)

    def over_memory(self, now: float) -> bool:
        """Sample the tree's resident memory now and then; True once over the limit."""
        if self.memory_limit is None or now - self.sampled_at < MEMORY_SAMPLE:
            return False
        self.sampled_at = now
        resident = _resident(self.pid, _tree(self.pid, self.token, self.started))
        self.resident = max(self.resident, resident)
        return resident > self.memory_limit


def _has_exited(pid: int) -> bool:
    """Whether the child has ended, leaving it unreaped (its pid stays its own until waitpid)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


class _Interruptible:
    """While a child runs, SIGTERM and SIGHUP end the run, then pytest (see ``isolation``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.armed = False  # until the parent supervises the child: it must not be orphaned
        self.pending: int | None = None

    def __enter__(self) -> _Interruptible:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN or previous is None:
                continue  # ignored on purpose (nohup), or set outside Python: leave it
            self.previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        previous = self.previous.get(signum)
        if callable(previous) and not getattr(previous, "gpucase_interrupts", False):
            previous(signum, frame)  # someone else's handler decides; if it raises, we clean up
        elif self.armed:
            self.armed = False
            raise RunInterrupted(signum)
        else:
            self.pending = signum  # before the wait or while cleaning up: raised later

    def arm(self) -> None:
        """From now on a signal interrupts the wait (and one that came already does now)."""
        self.armed = True
        if self.pending is not None:
            signum, self.pending = self.pending, None
            self.armed = False
            raise RunInterrupted(signum)

    def hold(self) -> None:
        """From now on a signal waits until the cleanup is over."""
        self.armed = False

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if self.pending is not None and kind is None:
            raise RunInterrupted(self.pending)


def _supervise(run: _Run, out_r: int, err_r: int, res_r: int, timeout: float, start: float,
               start_method: StartMethod, guard: _Interruptible,
               marks: Mapping[str, str] | None = None) -> ChildResult:
    pid = run.pid
    captures = {out_r: _Capture(marks=marks), err_r: _Capture(marks=marks)}
    result = bytearray()
    oversize = False
    open_fds = {out_r, err_r, res_r}
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):  # no pidfd (old kernel, macOS): poll in small steps
        pidfd = None
    exited = False
    deferred = False
    timed_out = False
    kill_at: float | None = None
    drain_until = math.inf
    dumped_at: float | None = None  # when the child last wrote to stderr after SIGUSR1
    deadline = start + timeout
    try:
        guard.arm()
        while not exited or open_fds:
            now = time.monotonic()
            if not exited and not timed_out and now >= deadline:
                timed_out = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGUSR1)  # faulthandler: dump every thread's stack
                kill_at = now + DUMP_GRACE
            if not exited and not run.memory_exceeded and run.over_memory(now):
                run.memory_exceeded = True
                kill_at = now
            if kill_at is not None and dumped_at is not None and now - dumped_at >= DUMP_QUIET:
                kill_at = now  # the stack dump has been written and stderr is quiet again
            if kill_at is not None and now >= kill_at:
                run.kill()
                kill_at = None
            wait_until = kill_at if kill_at is not None else deadline
            if dumped_at is not None and kill_at is not None:
                wait_until = min(kill_at, dumped_at + DUMP_QUIET)
            if exited:
                if now >= drain_until:
                    break  # a process that escaped still holds a pipe: stop reading
                wait_until = drain_until
            step = min(max(0.0, wait_until - now), MAX_POLL_STEP)
            if pidfd is None and not exited:
                step = min(step, 0.05)
            if run.memory_limit is not None and not exited:
                step = min(step, MEMORY_SAMPLE)
            events = poller.poll(step * 1000)
            for fd, _ in events:
                if fd == pidfd:
                    poller.unregister(pidfd)
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif fd == res_r:
                    if len(result) + len(data) > RESULT_LIMIT:
                        oversize = True  # read no more of it, and end the child
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        result.clear()
                        kill_at = time.monotonic()
                    else:
                        result += data
                else:
                    captures[fd].add(data)
                    if kill_at is not None and fd == err_r:
                        dumped_at = time.monotonic()
            flags = (_flags(result) if not open_fds and not oversize and not timed_out
                     and not run.memory_exceeded else {})
            clean = flags.get("alone") is True
            if clean and not exited:
                if run.reusable and flags.get("retire") is False:
                    run.kept = True  # a worker, ready for the next call
                    break
                # The child sent its result, closed every pipe and started nothing that
                # lives: it is exiting. Reap it later (before the next fork, at the end).
                deferred = True
                break
            if not exited and run.has_exited():
                exited = True
                if not clean:
                    # Grandchildren may live on and hold the pipes open: end them all,
                    # while the child's pid is still its own (not reaped).
                    run.kill()
                run.ended = True
                drain_until = time.monotonic() + 1.0
    finally:
        guard.hold()
        if run.kept:
            status = 0
        elif deferred:
            _PENDING.append(run)
            status = 0  # what the child's os._exit(0) gives; checked when it is reaped
        else:
            if not run.ended:
                run.kill()
            status = run.reap()
        if pidfd is not None:
            os.close(pidfd)
    return _result(status, bytes(result), oversize, run, captures[out_r], captures[err_r],
                   timed_out, time.monotonic() - start, start_method)


def _result(status: int, raw: bytes, oversize: bool, run: _Run, out: _Capture, err: _Capture,
            timed_out: bool, duration: float, start_method: StartMethod) -> ChildResult:
    exitcode = os.waitstatus_to_exitcode(status)
    signum = -exitcode if exitcode < 0 else None
    value, returned, child_error, bad_result = None, False, None, None
    found: tuple[ChildWarning, ...] = ()
    dropped = 0
    phase, raw = _split_notes(raw)
    if oversize:
        bad_result = (f"sent too big a result: the child's result exceeded "
                      f"{RESULT_LIMIT // 2**20} MiB and the child was killed; return less, or "
                      "write big data to a file")
    elif raw and not timed_out and not run.memory_exceeded:
        try:
            value, returned, child_error, found, dropped = _read_result(raw)
        except BadResult as exc:
            bad_result = f"sent a malformed result: {exc}"
        except Exception as exc:  # the rebuilt class refused its fields, a hint we do not know
            bad_result = f"sent a malformed result: {type(exc).__name__}: {str(exc)[:200]}"
    return ChildResult(
        value=value, returned=returned, exitcode=None if signum else exitcode, signal=signum,
        timed_out=timed_out, stdout=out.text(), stderr=hide_machinery(err.text()),
        duration=duration, start_method=start_method, child_error=child_error,
        bad_result=bad_result, memory_exceeded=run.memory_exceeded,
        memory_limit=run.memory_limit, resident=run.resident or None, warnings=found,
        warnings_dropped=dropped, phase=phase,
    )


_DUMP_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ .*"
                          r"\(most recent call first\):$")
_DUMP_FRAME = re.compile(r'^  File "(?P<file>[^"]*)", line (?:\d+|\?\?\?) in \S*$')


def _machinery(filename: str) -> bool:
    parts = filename.replace("\\", "/").split("/")
    return (bool(_MACHINERY_DIRS.intersection(parts[:-1])) or filename == "<frozen runpy>"
            or parts[-1] in ("pytest", "py.test"))


def hide_machinery(text: str) -> str:
    """faulthandler's dumps in ``text`` without the frames of pytest, pluggy and gpucase."""
    if "(most recent call first):" not in text:
        return text
    lines: list[str] = []
    hidden = 0
    in_dump = False
    for line in text.split("\n"):
        frame = _DUMP_FRAME.match(line) if in_dump else None
        if frame is not None:
            if _machinery(frame["file"]):
                hidden += 1
            else:
                lines.append(line)
            continue
        if hidden:
            lines.append(f"  [{hidden} frames of pytest, pluggy and gpucase hidden]")
            hidden = 0
        in_dump = _DUMP_HEADER.match(line) is not None
        lines.append(line)
    if hidden:
        lines.append(f"  [{hidden} frames of pytest, pluggy and gpucase hidden]")
    return "\n".join(lines)


# Children that returned a clean result and were exiting: reaped by ``reap_pending``.
_PENDING: list[_Run] = []
MAX_PENDING = 16  # exiting children left to finish on their own before one is waited for


def reap_pending(block: bool = True) -> None:
    """Reap the children whose results came back before they exited (see ``_supervise``).

    Before each fork (``block=False``) only those that have exited are reaped: a forked
    torch image takes milliseconds to tear down, which overlap the next run instead of
    delaying it; past ``MAX_PENDING`` the oldest are waited for. At the end of the session
    (``shutdown``, ``atexit``) every one is, so that no zombie and no stray process
    outlives the session. One still running after ``REAP_GRACE`` (stuck in its exit, e.g.
    a driver's teardown) is killed with its tree.
    """
    if not block:
        for run in [run for run in _PENDING if run.has_exited()]:
            _PENDING.remove(run)
            with contextlib.suppress(ChildProcessError, OSError):
                run.reap()
    while _PENDING and (block or len(_PENDING) > MAX_PENDING):
        run = _PENDING.pop(0)
        end = time.monotonic() + REAP_GRACE
        while not run.has_exited() and time.monotonic() < end:
            time.sleep(0.001)
        if not run.has_exited():
            run.kill()
        with contextlib.suppress(ChildProcessError, OSError):
            run.reap()

"""The parent's side of a run: supervising one child until it has ended or been ended.

Runs in the parent (the pytest process): it drains the child's output into bounded
captures and its result pipe, keeps the deadline and the memory limit, asks for the stack
dump and kills the tree, turns SIGTERM and SIGHUP into ``RunInterrupted``, builds the
``ChildResult``, and reaps the children that returned before they exited.
"""

from __future__ import annotations

import _signal
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

from pytest_gpucase.run.isolation.child import DUMP_SIGNAL
from pytest_gpucase.run.isolation.clipping import _Capture
from pytest_gpucase.run.isolation.proctree import (
    MAX_POLL_STEP,
    REAP_GRACE,
    _held,
    _kill_tree,
    _resident,
    _stat,
    _tree,
    disown,
    reap_killed,
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
    "QUIET_START",
    "RESULT_LIMIT",
    "RunInterrupted",
    "hide_machinery",
    "reap_pending",
    "wait_quietly",
]

# The biggest result the parent reads; a child sending more is killed.
RESULT_LIMIT = 16 * 2**20
# Time the child gets to print its thread stacks after a timeout, before SIGKILL.
DUMP_GRACE = 2.0
DUMP_QUIET = 0.2  # stderr silent this long after the dump began: the dump is complete
MEMORY_SAMPLE = 0.1     # seconds between samples of the tree's resident memory
# Seconds the pytest process first waits on a fresh forked child's end alone, before it reads
# the child's pipes (``wait_quietly``): a short child's run is read whole after it.
QUIET_START = 0.05
EXIT_WAIT = 0.05        # seconds a child that sent a clean result is waited for (exits_soon)
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
    # Clock ticks since boot: no process started before is an orphan or a marked process
    # of this run. The child's start time, or (a worker's call) when the call began; -1
    # until ``since`` reads it.
    started: int = -1

    def since(self) -> int:
        """``started``; a child's start time is read from /proc when first needed (a kill,
        a memory sample), not on every run: until the child is reaped its pid and start
        time are its own, and a run that passes never needs it."""
        if self.started < 0:
            stat = _stat(self.pid)
            self.started = stat.start if stat is not None else 0
        return self.started

    def has_exited(self) -> bool:
        """Whether the child ended (it stays unreaped, its pid its own, until ``reap``)."""
        if self.zygote is None:
            return _has_exited(self.pid)
        stat = _stat(self.pid)  # the zygote reaps only when asked: a zombie until then
        return stat is None or stat.state in (b"Z", b"X")

    def reap(self) -> int:
        """Wait for the child and return its wait status."""
        if self.zygote is None:
            try:
                return os.waitpid(self.pid, 0)[1]
            finally:
                disown(self.pid)
        return self.zygote.reap(self.pid)

    def kill(self) -> None:
        """Kill the whole tree; only before the child is reaped (its pid is its own till then).

        The orphans of a child that died are adopted by its parent, a subreaper: this
        process, or the zygote (which also ends them when it reaps the child).
        """
        adopter = self.zygote.pid if self.zygote is not None else os.getpid()
        _kill_tree(self.pid, self.token, include_root=True, since=self.since(),
                   adopter=adopter)

    def over_memory(self, now: float) -> bool:
        """Sample the tree's resident memory now and then; True once over the limit."""
        if self.memory_limit is None or now - self.sampled_at < MEMORY_SAMPLE:
            return False
        self.sampled_at = now
        # The child is a subreaper: while it lives, its group and descendants are all.
        resident = _resident(self.pid, _tree(self.pid, self.token, self.since(),
                                             markers=False))
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
        # _signal, the C module behind signal: its wrappers make an enum of each number, on
        # every run (the handlers are kept as it gives them, and given back to it).
        for signum in self.SIGNALS:
            previous = _signal.getsignal(signum)
            if previous is None or (type(previous) is int and previous == _signal.SIG_IGN):
                continue  # ignored on purpose (nohup), or set outside Python: leave it
            self.previous[signum] = previous
            _signal.signal(signum, self._handle)
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
            _signal.signal(signum, previous)
        if self.pending is not None and kind is None:
            raise RunInterrupted(self.pending)


def wait_quietly(pid: int, seconds: float) -> BaseException | None:
    """Block until child ``pid`` ends or ``seconds`` pass, touching as little as can be: the
    exception a signal handler raised meanwhile (Ctrl-C's ``KeyboardInterrupt``), returned
    for ``_Supervisor.watch`` to raise once it supervises the child, which it then kills.

    Its pipes are left unread meanwhile (64 KiB each: a child that writes more waits that
    long at most). While the child lives every page this process writes is copied, and a
    write into memory backed by a huge page splits that page's mapping for every later fork
    (``hugepages``); once the child has ended, neither. So a short child is read whole after
    its end.
    """
    if not seconds > 0:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (an old kernel, macOS): no quiet wait
        return None
    try:
        # poll, not select: a pidfd past FD_SETSIZE (1024) is waited on as well
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll(seconds * 1000)
    except OSError:
        pass
    except BaseException as exc:  # raised again by watch, once the child is supervised
        return exc
    finally:
        os.close(pidfd)
    return None


class _Supervisor:
    """The parent's watch over one child, from its start until it has ended or been ended.

    ``watch`` polls the child's pipes (and its pidfd) and hands what happens to a method:
    the clock (``on_clock``: the deadline, the memory limit, the kill a stack dump waits
    for), data on a pipe (``on_ready``: ``on_output``, ``on_result``), a whole clean result
    (``done``) and the child's end (``on_exit``); ``settle`` leaves the child as it must be.
    """

    def __init__(self, child: _Run, out_r: int, err_r: int, res_r: int, timeout: float,
                 start: float, start_method: StartMethod,
                 marks: Mapping[str, str] | None = None) -> None:
        self.child = child
        self.err_r, self.res_r = err_r, res_r
        self.out, self.err = _Capture(marks=marks), _Capture(marks=marks)
        self.captures = {out_r: self.out, err_r: self.err}
        self.result = bytearray()
        # The result's JSON as ``done`` read it, with the result's length then: read once.
        self.parsed: tuple[int, dict[str, Any] | None] = (-1, None)
        self.oversize = False  # the result passed RESULT_LIMIT: read no more, end the child
        self.open_fds = {out_r, err_r, res_r}
        self.poller = select.poll()
        for fd in self.open_fds:
            self.poller.register(fd, select.POLLIN)
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(child.pid)
            self.poller.register(self.pidfd, select.POLLIN)
        except (AttributeError, OSError):  # no pidfd (old kernel, macOS): poll in small steps
            self.pidfd = None
        self.exited = False    # the child ended; its pipes are drained a little longer
        self.deferred = False  # the child returned cleanly and is exiting: reaped later
        self.slow_exit = True  # its exit is slow (a device context's teardown): not waited for
        self.timed_out = False
        self.starting = False  # timed out with its stack signal still held: no dump to wait for
        self.kill_at: float | None = None
        self.drain_until = math.inf
        self.dumped_at: float | None = None  # when the child last wrote to stderr after SIGUSR1
        self.start, self.start_method = start, start_method
        self.deadline = start + timeout

    def watch(self, guard: _Interruptible, raised: BaseException | None = None) -> ChildResult:
        """Wait until the child is done or ended, and say what became of it. ``raised``: an
        exception that came before (``wait_quietly``), raised once the child is supervised
        (it is killed, as for one raised while it is watched)."""
        try:
            guard.arm()
            if raised is not None:
                raise raised
            while not self.exited or self.open_fds:
                now = time.monotonic()
                self.on_clock(now)
                step = self.step(now)
                if step is None:
                    break  # a process that escaped still holds a pipe: stop reading
                for fd, _ in self.poller.poll(step * 1000):
                    self.on_ready(fd)
                if self.done():
                    break
                if not self.exited and self.child.has_exited():
                    # A child closes its pipes before it exits: their ends, still unread
                    # when the exit is seen, are read first, so that a clean result is
                    # taken as one (no tree to search and kill) however the polls fell.
                    for fd, _ in self.poller.poll(0):
                        self.on_ready(fd)
                    if self.done():
                        break
                    self.on_exit()
        finally:
            guard.hold()
            status = self.settle()
        return self.outcome(status, time.monotonic() - self.start)

    def on_clock(self, now: float) -> None:
        """The deadline, the memory limit, and the kill that a stack dump waits for."""
        child = self.child
        if not self.exited and not self.timed_out and now >= self.deadline:
            self.on_deadline(now)
        if not self.exited and not child.memory_exceeded and child.over_memory(now):
            child.memory_exceeded = True
            self.kill_at = now
        if (self.kill_at is not None and self.dumped_at is not None
                and now - self.dumped_at >= DUMP_QUIET):
            self.kill_at = now  # the stack dump has been written and stderr is quiet again
        if self.kill_at is not None and now >= self.kill_at:
            child.kill()
            self.kill_at = None

    def on_deadline(self, now: float) -> None:
        """Time is up: ask for every thread's stack, and kill after ``DUMP_GRACE``; at once
        for a child still starting, which would answer only once its start is done."""
        self.timed_out = True
        if _held(self.child.pid, DUMP_SIGNAL):
            self.starting = True
            self.kill_at = now
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.child.pid, DUMP_SIGNAL)  # faulthandler: dump every thread's stack
        self.kill_at = now + DUMP_GRACE

    def step(self, now: float) -> float | None:
        """How long to poll: until the next thing on the clock, in bounded steps. None when
        the pipes have been drained long enough after the child's end."""
        wait_until = self.kill_at if self.kill_at is not None else self.deadline
        if self.dumped_at is not None and self.kill_at is not None:
            wait_until = min(self.kill_at, self.dumped_at + DUMP_QUIET)
        if self.exited:
            if now >= self.drain_until:
                return None
            wait_until = self.drain_until
        step = min(max(0.0, wait_until - now), MAX_POLL_STEP)
        if self.pidfd is None and not self.exited:
            step = min(step, 0.05)
        if self.child.memory_limit is not None and not self.exited:
            step = min(step, MEMORY_SAMPLE)
        return step

    def on_ready(self, fd: int) -> None:
        """``fd`` polled ready: a pipe's data or its end; the pidfd (``has_exited`` tells)."""
        if fd == self.pidfd:
            self.poller.unregister(fd)
            return
        data = os.read(fd, 1 << 16)
        if not data:
            self.stop_reading(fd)
        elif fd == self.res_r:
            self.on_result(data)
        else:
            self.on_output(fd, data)

    def stop_reading(self, fd: int) -> None:
        self.poller.unregister(fd)
        self.open_fds.discard(fd)

    def on_result(self, data: bytes) -> None:
        """Data on the result pipe: kept, up to ``RESULT_LIMIT``; past it the child ends."""
        if len(self.result) + len(data) > RESULT_LIMIT:
            self.oversize = True
            self.stop_reading(self.res_r)
            self.result.clear()
            self.kill_at = time.monotonic()
        else:
            self.result += data

    def on_output(self, fd: int, data: bytes) -> None:
        """Data on fd 1 or 2; on stderr while a kill waits, the stack dump going on."""
        self.captures[fd].add(data)
        if self.kill_at is not None and fd == self.err_r:
            self.dumped_at = time.monotonic()

    def done(self) -> bool:
        """Whether the child sent a whole, clean result and closed every pipe, leaving
        nothing that lives: then it is exiting (or, a worker, waiting for the next call),
        and there is nothing more to watch."""
        child = self.child
        if (self.exited or self.open_fds or self.oversize or self.timed_out
                or child.memory_exceeded):
            return False
        flags, envelope = _flags(self.result)
        self.parsed = (len(self.result), envelope)
        if flags.get("alone") is not True:
            return False
        if child.reusable and flags.get("retire") is False:
            child.kept = True  # a worker, ready for the next call
        else:
            # The child sent its result, closed every pipe and started nothing that
            # lives: it is exiting. Reap it soon (``exits_soon``) or later (before the next
            # fork, at the end).
            self.deferred = True
            self.slow_exit = flags.get("device") is not False
        return True

    def exits_soon(self) -> bool:
        """Whether the child, exiting after a clean result, is gone within ``EXIT_WAIT``.

        Waited for, rather than left to exit while the parent goes on: until it is gone,
        every page of the parent's that either one writes is copied, the parent's work on
        the result and the report included (a trivial item: 0.3-0.6 of a bare fork's CPU
        more, measured in benchmarks/README.md). A child slower to end (a device context's
        teardown, which the child says it has) is left pending, so that it cannot hold up the
        session."""
        if self.pidfd is None or self.slow_exit:
            return False
        waiting = select.poll()
        waiting.register(self.pidfd, select.POLLIN)
        return bool(waiting.poll(EXIT_WAIT * 1000))

    def on_exit(self) -> None:
        """The child ended without a clean result (see ``done``)."""
        self.exited = True
        # Grandchildren may live on and hold the pipes open: end them all,
        # while the child's pid is still its own (not reaped).
        self.child.kill()
        self.child.ended = True
        self.drain_until = time.monotonic() + 1.0

    def settle(self) -> int:
        """Leave the child kept, pending or killed and reaped; its wait status."""
        child = self.child
        if child.kept:
            status = 0
        elif self.deferred:
            if self.exits_soon():
                child.reap()
            else:
                _PENDING.append(child)
            status = 0  # what the child's os._exit(0) gives
        else:
            if not child.ended:
                child.kill()
            status = child.reap()
            # What the kill left as zombies of this process (orphans it adopted), reaped now:
            # a killed process is gone when the run is.
            reap_killed(time.monotonic() + 1.0)
        if self.pidfd is not None:
            os.close(self.pidfd)
        return status

    def outcome(self, status: int, duration: float) -> ChildResult:
        """What became of the child, from its wait status and what it sent."""
        child = self.child
        exitcode = os.waitstatus_to_exitcode(status)
        signum = -exitcode if exitcode < 0 else None
        value, returned, child_error, bad_result = None, False, None, None
        found: tuple[ChildWarning, ...] = ()
        dropped = 0
        phase, raw = _split_notes(bytes(self.result))
        if self.oversize:
            bad_result = (f"sent too big a result: the child's result exceeded "
                          f"{RESULT_LIMIT // 2**20} MiB and the child was killed; return less, "
                          "or write big data to a file")
        elif raw and not self.timed_out and not child.memory_exceeded:
            try:
                length, envelope = self.parsed
                value, returned, child_error, found, dropped = _read_result(
                    raw, envelope if length == len(self.result) else None)
            except BadResult as exc:
                bad_result = f"sent a malformed result: {exc}"
            except Exception as exc:
                # The rebuilt class refused its fields, or a hint we do not know.
                bad_result = f"sent a malformed result: {type(exc).__name__}: {str(exc)[:200]}"
        return ChildResult(
            value=value, returned=returned, exitcode=None if signum else exitcode,
            signal=signum, timed_out=self.timed_out, stdout=self.out.text(),
            stderr=hide_machinery(self.err.text()), duration=duration,
            start_method=self.start_method, child_error=child_error, bad_result=bad_result,
            memory_exceeded=child.memory_exceeded, memory_limit=child.memory_limit,
            resident=child.resident or None, warnings=found, warnings_dropped=dropped,
            phase=phase, starting=self.starting,
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


# Children that returned a clean result and were still exiting ``EXIT_WAIT`` after: reaped
# by ``reap_pending``.
_PENDING: list[_Run] = []
MAX_PENDING = 16  # exiting children left to finish on their own before one is waited for


def reap_pending(block: bool = True) -> None:
    """Reap the children whose results came back before they exited (see ``_Supervisor.done``)
    and that did not exit within ``EXIT_WAIT`` after (``_Supervisor.exits_soon``).

    Before each fork (``block=False``) only those that have exited are reaped: a slow
    teardown (a device context's) overlaps the next run instead of delaying it; past
    ``MAX_PENDING`` the oldest are waited for. At the end of the session
    (``shutdown``, ``atexit``) every one is, so that no zombie and no stray process
    outlives the session. One still running after ``REAP_GRACE`` (stuck in its exit, e.g.
    a driver's teardown) is killed with its tree.
    """
    if not block:
        reap_killed()
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
    if block:
        reap_killed(time.monotonic() + 1.0)

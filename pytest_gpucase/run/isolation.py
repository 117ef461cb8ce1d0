"""Run a function in a fresh child process, with its own environment, a timeout, and its output.

The child is a fork of this process by default (cheap: torch is already
imported) or, when CUDA was initialized here and a fork would inherit a broken
context, a fresh interpreter started with ``posix_spawn``. Its fds 1 and 2 go
to pipes the parent drains into bounded buffers: device-side assertion lines
are printed to fd 2 by the kernel, and a child printing gigabytes must not
fill memory or disk.

Nothing the child sends is trusted. The child runs a case's code, which may do
anything, so its result comes back as JSON data over a third pipe, never as a
pickle: plain values, with NaN and infinities, tuples and dicts tagged, and
dataclasses rebuilt only from the allow-list ``RESULT_TYPES``, each field
checked against its annotation. Before it, the child may write short notes
(``note``) of what it is doing, which the parent reads even from a child it
killed: a timeout says what it interrupted. The parent reads at most ``RESULT_LIMIT``
bytes of it (a bigger result kills the child and is a failure), and every
string in it is cut to its head and tail (``TEXT_HEAD``/``TEXT_TAIL``) before
it reaches a report. A malformed result is a failure that names the problem.

The timeout lives in the parent: a hang inside a GIL-released CUDA call cannot
be interrupted by a Python signal handler in the child. On expiry the parent
asks the child's ``faulthandler`` for every thread's stack (SIGUSR1), waits a
moment for it, then kills the run's whole process tree. Its frames from
pytest, pluggy and gpucase itself are hidden from the dump (the stack of a
forked child still holds the pytest process's frames below the case's own).

The process tree of a run is found three ways, because a child may leave its
process group (``setpgid``) or session (``setsid``) and orphan its children:

- the child's process group, and the child by pid (all a system without
  ``/proc``, such as macOS, offers);
- on Linux, the child is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a
  descendant orphaned while the child lives is reparented to the child, not
  to init, so every living descendant is found by following parent pids in
  ``/proc`` from the child. Before the parent kills it, the whole tree is
  stopped (SIGSTOP, round after round until no new process appears, so that
  nothing forks away during the kill), then killed. A child that returns also
  kills what it started, while it is still everyone's ancestor;
- a per-run marker ``GPUCASE_RUN=<random token>`` in the child's environment,
  found in ``/proc/PID/environ`` of this user's processes: a descendant that
  was ``exec``'d keeps it even after its ancestors died.

Only those processes are ever signalled (each through a pidfd opened before it
is checked again, so a reused pid is never hit): the pytest process's other
children (xdist, pytester, user fixtures) are left alone. What escapes: a
descendant forked without ``exec``, moved out of the group, after the child
itself died on its own (a crash), before the parent saw it.

The direct child dies with the pytest process even on SIGKILL
(``PR_SET_PDEATHSIG``, set in the forked and in the spawned child; it fires
when the *thread* that started the child ends, which ``run_in_child`` outlives
as it waits for the child). Its descendants are then orphaned: best effort only
(they keep the process group and the marker for whoever cleans up).

SIGTERM and SIGHUP to the pytest process while a child runs (what CI runners
send on cancel or timeout) kill the run's tree, then end pytest through a
``KeyboardInterrupt`` (``RunInterrupted``): pytest's own Ctrl-C path, so its
``sessionfinish`` hooks run and the JSON report gets its last write. The
handlers are installed only while a child runs, only from the main thread,
only over the default action (a handler someone else installed is called
instead, an ignored signal stays ignored), and the previous ones are restored.

A memory limit (``memory_limit``) is enforced by the parent, which samples the
resident memory (``VmRSS``) of the child's whole tree while it waits: RLIMIT_AS
would break CUDA's large virtual mappings. Resident memory counts the pages a
forked child still shares with the pytest process (torch's libraries and
heap), as ``ps`` and the OOM killer do: set a limit above the parent's size.

Warnings raised in the child are recorded (pytest's warning filters, inherited
by a fork, are reset to "always"), deduplicated, bounded, and returned as data
with the result. Under coverage.py (``--cov``), a forked child saves its data
to a file of its own before it ends, which ``coverage combine`` and pytest-cov
pick up.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import functools
import gc
import importlib
import json
import math
import os
import pickle
import re
import secrets
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CAPTURE_HEAD",
    "CAPTURE_TAIL",
    "MAX_PENDING",
    "RESULT_LIMIT",
    "TEXT_HEAD",
    "TEXT_TAIL",
    "ChildResult",
    "ChildWarning",
    "StartMethod",
    "WorkerPool",
    "clip",
    "decode",
    "default_start_method",
    "encode",
    "forkserver",
    "forkserver_available",
    "gib",
    "note",
    "reap_pending",
    "run_in_child",
    "shutdown",
    "signal_name",
]

StartMethod = Literal["fork", "forkserver", "spawn"]

CAPTURE_HEAD = 16 * 1024
CAPTURE_TAIL = 48 * 1024
# The longest string of a result that reaches a report: its head and tail, and how much
# was cut between them (a 50 MB exception message must not be printed twice).
TEXT_HEAD = 4 * 1024
TEXT_TAIL = 12 * 1024
# The biggest result the parent reads; a child sending more is killed.
RESULT_LIMIT = 16 * 2**20
MAX_WARNINGS = 20          # distinct warnings returned by a child; the rest are counted
WARNING_TEXT = 2000        # characters of one warning's message
# Time the child gets to print its thread stacks after a timeout, before SIGKILL.
DUMP_GRACE = 2.0
DUMP_QUIET = 0.2  # stderr silent this long after the dump began: the dump is complete
MAX_POLL_STEP = 3600.0  # seconds: poll() takes milliseconds in a C int
MEMORY_SAMPLE = 0.1     # seconds between samples of the tree's resident memory
MARKER_ENV = "GPUCASE_RUN"
# Classes a child may return, rebuilt field by field; nothing else is ever constructed.
RESULT_TYPES = frozenset({
    "pytest_gpucase.run.child.Outcome",
    "pytest_gpucase.plan.environment.Environment",
    "pytest_gpucase.plan.environment.Device",
})
_RESULT_FD = 3  # where a spawned child writes its result
_FORMAT = 1
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Frames of the machinery under a case's code, hidden from faulthandler's dumps.
_MACHINERY_DIRS = frozenset({"_pytest", "pytest", "pluggy", "pytest_gpucase", "xdist", "execnet"})


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

    @property
    def problem(self) -> str | None:
        """Why no value came back, in words, or None when it did."""
        if self.returned:
            return None
        if self.timed_out:
            return "timed out"
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


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached pytest while a child ran; the child's tree was killed."""

    def __init__(self, signum: int) -> None:
        # The item is named as pytest names it while it runs ("nodeid (call)").
        running = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]
        super().__init__(f"pytest received {signal_name(signum)} while a case ran"
                         + (f" ({running})" if running else "")
                         + "; the run's processes were killed")
        self.signum = signum


def signal_name(number: int) -> str:
    """``11`` -> ``SIGSEGV``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def gib(nbytes: int) -> str:
    """``1610612736`` -> ``1.5 GiB``."""
    return f"{nbytes / 2**30:.3g} GiB"


# A terminal escape sequence (colour, cursor, an OSC hyperlink or title): CSI, OSC ended by
# BEL or ST, or a two-byte escape. A cut is moved off one, so that no fragment ("red\x1b[",
# "[31mred") is left either side of the omitted bytes.
_ESCAPE = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)"
                     rb"|[ -/]*[0-Z\\^-~])")
_UNFINISHED = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)\Z")  # cut short
_ESCAPE_ROOM = 512  # the longest sequence a cut is moved off; a longer one is cut as text


class _Capture:
    """Keep the head and the tail of a stream, and count what fell between them.

    ``marks`` maps a line the stream may hold (a label the child writes, say) to what the
    omission marker says when that line begins in the omitted part, where the reader would
    otherwise never learn that it was there.
    """

    def __init__(self, head: int = CAPTURE_HEAD, tail: int = CAPTURE_TAIL,
                 marks: Mapping[str, str] | None = None) -> None:
        self.head_limit, self.tail_limit = head, tail
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.lost = b""  # the last bytes dropped, just before the tail: a sequence may span
        self.marks = {line.encode(): said for line, said in (marks or {}).items()
                      if 0 < len(line.encode()) <= tail}
        self.omitted_marks: list[str] = []  # what the omission marker says, in stream order

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            for line, said in self.marks.items():
                # One that begins in the bytes dropped now: all of it is still in the tail,
                # which keeps more than a line's length past them. One search (memchr speed)
                # of what is dropped anyway.
                if said not in self.omitted_marks and self.tail.find(
                        line, 0, excess + len(line) - 1) >= 0:
                    self.omitted_marks.append(said)
            self.lost = (self.lost + self.tail[max(0, excess - _ESCAPE_ROOM):excess])[
                -_ESCAPE_ROOM:]
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        head, tail = bytes(self.head), bytes(self.tail)
        if not self.dropped:
            return (head + tail).decode(errors="replace")
        unfinished = _UNFINISHED.search(head, max(0, len(head) - _ESCAPE_ROOM))
        if unfinished is not None:
            head = head[:unfinished.start()]  # a sequence the cut began
        start = self.lost.rfind(b"\x1b")
        if start >= 0:
            spanning = _ESCAPE.match(self.lost + tail[:_ESCAPE_ROOM], start)
            if spanning is not None and spanning.end() > len(self.lost):
                tail = tail[spanning.end() - len(self.lost):]  # the rest of one it ended
        omitted = self.dropped + len(self.head) - len(head) + len(self.tail) - len(tail)
        said = "".join(f"; {text}" for text in self.omitted_marks)
        return (head.decode(errors="replace") + f"\n[... {omitted} bytes omitted{said} ...]\n"
                + tail.decode(errors="replace"))


_MARKER_ROOM = 48  # "\n[... N bytes omitted ...]\n" for any N a result can have


def clip(text: str, head: int = TEXT_HEAD, tail: int = TEXT_TAIL) -> str:
    """``text`` cut to its first ``head`` and last ``tail`` bytes, with what was omitted.

    Text clipped already (by the child; the parent clips what it reads again) is left
    as it is: the room for the "[... N bytes omitted ...]" line keeps its count true.
    """
    limit = head + tail + _MARKER_ROOM
    if len(text) <= limit and len(text.encode(errors="replace")) <= limit:
        return text
    capture = _Capture(head, tail)
    capture.add(text.encode(errors="replace"))
    return capture.text()


def thread_count() -> int:
    """How many OS threads this process has (1 when only the main thread runs)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs (macOS): Python's own threads are the best we know
        return threading.active_count()


def default_start_method() -> StartMethod:
    """``fork`` unless this process already initialized CUDA (then a fork would inherit it):
    then ``forkserver`` (a zygote started before CUDA was), or ``spawn`` where there is none."""
    if not _cuda_initialized():
        return "fork"
    return "forkserver" if forkserver_available() else "spawn"


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def run_in_child(
    func: Callable[..., Any],
    *args: Any,
    timeout: float,
    env: Mapping[str, str] | None = None,
    start_method: StartMethod = "fork",
    memory_limit: int | None = None,
    marks: Mapping[str, str] | None = None,
) -> ChildResult:
    """Call ``func(*args)`` in a fresh child process and report what happened to it.

    ``timeout`` is in seconds (any non-negative number, ``inf`` included);
    ``memory_limit`` in bytes of resident memory of the child's whole tree; ``marks``: lines
    of output that a clipped capture names when it omits where one begins (``_Capture``).
    """
    if not timeout >= 0:  # NaN fails this too
        raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
    if memory_limit is not None and memory_limit <= 0:
        raise ValueError(f"memory_limit must be a number of bytes > 0, not {memory_limit!r}")
    token = secrets.token_hex(16)
    child_env = {**(env or {}), MARKER_ENV: token}
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    job_file = None
    # Started (once) before the clock: the zygote's preloading is no part of a run's time.
    zygote = forkserver() if start_method == "forkserver" else None
    start = time.monotonic()
    try:
        reap_pending(block=False)
        with _Interruptible() as guard:
            if start_method == "fork":
                # Objects that exist now are never collected by the parent's later passes,
                # and a collection in the child cannot touch (and so copy) their pages.
                gc.freeze()
                threaded = thread_count() > 1
                parent = os.getpid()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child, measured by the parent
                    _forked_child(out_w, err_w, res_w, (out_r, err_r, res_r), child_env,
                                  threaded, parent, func, args)
            elif zygote is not None:  # forkserver: its children are supervised by pid
                pid = zygote.start(func, args, (out_w, err_w, res_w), child_env)
            else:
                job_file = _write_job(func, args)
                pid = _spawn(job_file, out_w, err_w, res_w, child_env)
            with contextlib.suppress(OSError):  # the child does it too; the first one wins
                os.setpgid(pid, pid)
            for fd in (out_w, err_w, res_w):
                os.close(fd)
            out_w = err_w = res_w = -1
            run = _Run(pid, token, memory_limit, zygote=zygote)
            return _supervise(run, out_r, err_r, res_r, timeout, start, start_method, guard,
                              marks)
    finally:
        for fd in (out_r, err_r, res_r, out_w, err_w, res_w):
            if fd >= 0:
                os.close(fd)
        if job_file is not None:
            os.unlink(job_file)


# --- the child's side -------------------------------------------------------------------------

def _prctl(option: int, value: int) -> bool:  # pragma: no cover - child side
    """Linux's prctl(2), or False where there is none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _contain_self(parent: int) -> None:  # pragma: no cover - child side
    """Die with the parent, and keep orphaned descendants as this process's own."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody waits
        os._exit(70)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _forked_child(out_w: int, err_w: int, res_w: int, parent_ends: tuple[int, ...],
                  env: Mapping[str, str], threaded: bool, parent: int,
                  func: Callable[..., Any], args: tuple[Any, ...]) -> None:  # pragma: no cover
    try:
        _contain_self(parent)
        torch = sys.modules.get("torch")
        if threaded and torch is not None:
            # The parent may have run parallel CPU work: OpenMP's worker threads do
            # not survive a fork, and a child's parallel region would wait for them
            # forever. One intra-op thread never enters one (DataLoader workers do this).
            torch.set_num_threads(1)
        # A run is short: a collection pass would only touch (and so copy) pages
        # shared with the parent.
        gc.disable()
        os.setpgid(0, 0)
        for fd in parent_ends:
            os.close(fd)
        _flush_std_streams()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        # pytest's capture may have replaced sys.stdout/err: write to the real fds again.
        # Left open on purpose: they live as long as the child.
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
        os.environ.update(env)
    except BaseException:
        os._exit(70)
    _child_main(res_w, func, args)


def _flush_std_streams() -> None:  # pragma: no cover - child side
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream: nothing to flush
            stream.flush()


class _WarningLog:
    """The warnings of one call, each distinct one once with its count, at most MAX_WARNINGS."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str, int], int] = {}
        self.dropped = 0

    def add(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
            file: Any = None, line: str | None = None) -> None:
        name = category.__qualname__
        if category.__module__ != "builtins":
            name = f"{category.__module__}.{name}"
        key = (name, str(message)[:WARNING_TEXT], str(filename), int(lineno))
        if key in self.seen:
            self.seen[key] += 1
        elif len(self.seen) < MAX_WARNINGS:
            self.seen[key] = 1
        else:
            self.dropped += 1

    def data(self) -> dict[str, Any]:
        return {"items": [{"category": c, "message": m, "filename": f, "lineno": n, "count": k}
                          for (c, m, f, n), k in self.seen.items()],
                "dropped": self.dropped}


# The child's end of its result pipe while a call runs, for ``note``; None elsewhere.
_NOTE_FD: int | None = None
_NOTE = b"\x1e"  # begins a note line on the result pipe; the JSON envelope holds no newline
NOTE_LIMIT = 1000  # bytes of one note: below PIPE_BUF, so that a note is written whole


def note(phase: str) -> None:
    """Tell the parent what this child is doing now (``ChildResult.phase``): what a timeout
    interrupted, beyond the stacks of the dump. Nothing outside a child run.

    A line on the result pipe before the result, read by the parent also after a kill; a
    write of a few bytes, cheap enough for every phase of every run.
    """
    if _NOTE_FD is None:
        return
    line = _NOTE + phase.replace("\n", " ").encode(errors="replace")[:NOTE_LIMIT] + b"\n"
    with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
        _write_all(_NOTE_FD, line)


def _split_notes(raw: bytes) -> tuple[str | None, bytes]:
    """(the last note, the result envelope) of what a child wrote to its result pipe."""
    notes, newline, envelope = raw.rpartition(b"\n")
    if not newline:
        return None, raw
    last = notes.rpartition(b"\n")[2]
    phase = last[len(_NOTE):].decode(errors="replace") if last.startswith(_NOTE) else None
    return (clip(phase, 200, 300) if phase else None), envelope


def _child_main(res_w: int, func: Callable[..., Any],
                args: tuple[Any, ...]) -> None:  # pragma: no cover - child side
    global _NOTE_FD
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    code = 0
    _NOTE_FD = res_w
    payload = _envelope(func, args)
    _NOTE_FD = None
    _flush_std_streams()
    _save_coverage()
    try:
        _write_all(res_w, payload)
    except BaseException:
        code = 71
    # Every pipe closed: the parent has all it needs now and need not wait for the exit
    # (tearing down a forked torch image takes milliseconds).
    for fd in (1, 2, res_w):
        with contextlib.suppress(OSError):
            os.close(fd)
    os._exit(code)


def _envelope(func: Callable[..., Any], args: tuple[Any, ...],
              extra: Callable[[], dict[str, Any]] | None = None) -> bytes:  # pragma: no cover
    """Call ``func(*args)`` and return what the parent reads: the value or the error, the
    warnings, whether the child is alone, and the ``extra`` fields, as JSON."""
    log = _WarningLog()
    try:
        with warnings.catch_warnings():
            # The filters inherited from pytest (-W error, filterwarnings) would turn the
            # replayed call's warnings into exceptions or hide them: record them all.
            warnings.simplefilter("always")
            warnings.showwarning = log.add
            value = func(*args)
        envelope: dict[str, Any] = {"kind": "value", "value": encode(value)}
    except BaseException:
        envelope = {"kind": "error", "error": clip(traceback.format_exc())}
    # Before the result: the parent trusts "alone" only as a hint to skip its own search.
    alone = _end_descendants()
    envelope.update(format=_FORMAT, warnings=log.data(), alone=alone)
    if extra is not None:
        envelope.update(extra())
    try:
        return json.dumps(envelope, allow_nan=False).encode()
    except BaseException:
        return json.dumps({"format": _FORMAT, "kind": "error",
                           "error": clip(traceback.format_exc())}).encode()


def _end_descendants() -> bool:  # pragma: no cover - child side
    """Kill what this child started, while it is still their ancestor (a subreaper).

    True when it had started nothing that still lives: a subreaper with no child has no
    living descendant, so the whole-system search is skipped (the common case).
    """
    if _children(os.getpid()) == []:
        return True
    with contextlib.suppress(Exception):
        _kill_tree(os.getpid(), None, include_root=False)
    return False


def _children(pid: int) -> list[int] | None:
    """The living children of ``pid`` from /proc/PID/task/*/children, or None if unknown."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        raw = _read(f"/proc/{pid}/task/{task}/children")
        if raw is None:
            return None  # a kernel without CONFIG_PROC_CHILDREN: unknown
        found.extend(int(part) for part in raw.split())
    return found


def _save_coverage() -> None:  # pragma: no cover - child side, and only under coverage
    """Save coverage.py's data of this child (``os._exit`` skips its atexit hook)."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    cov = current() if current is not None else None
    if cov is None:
        return
    with contextlib.suppress(Exception):
        data = getattr(cov, "_data", None)
        if data is not None and not getattr(data, "_suffix", True):
            # Not a parallel run: a suffix of our own, never the parent's file. A forked
            # CoverageData starts a new file on its own (pytest-cov asks for suffixes).
            data._suffix = True
        cov.stop()
        cov.save()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_job(func: Callable[..., Any], args: tuple[Any, ...]) -> str:
    # The job goes from the parent to the child: pickled, as it is the parent's own data.
    fd, path = tempfile.mkstemp(prefix="gpucase-job-", suffix=".pickle")
    with os.fdopen(fd, "wb") as handle:
        pickle.dump(list(sys.path), handle)
        pickle.dump((func, args), handle)
    return path


def _spawn(job_file: str, out_w: int, err_w: int, res_w: int, env: Mapping[str, str]) -> int:
    child_env = dict(os.environ)
    child_env.update(env)
    actions = [
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
        (os.POSIX_SPAWN_DUP2, res_w, _RESULT_FD),
    ]
    entry = "from pytest_gpucase.run.isolation import spawned_main; spawned_main()"
    argv = [sys.executable, "-c", entry, job_file, str(os.getpid())]
    return os.posix_spawn(sys.executable, argv, child_env, file_actions=actions, setpgroup=0)


def spawned_main() -> None:  # pragma: no cover - runs in a spawned child
    """Entry point of a spawned child: load the job, run it, send the result on fd 3."""
    _contain_self(int(sys.argv[2]))
    with open(sys.argv[1], "rb") as handle:
        sys.path[:] = pickle.load(handle)
        func, args = pickle.load(handle)
    _child_main(_RESULT_FD, func, args)


# --- the result as data -----------------------------------------------------------------------

def encode(value: Any) -> Any:
    """``value`` as JSON data: NaN, infinities, tuples, dicts and allowed dataclasses tagged."""
    if value is None or isinstance(value, (bool, str)):
        return clip(value) if isinstance(value, str) else value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$": "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$": "tuple", "items": [encode(item) for item in value]}
    if isinstance(value, Mapping):
        return {"$": "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if dataclasses.is_dataclass(value) and name in RESULT_TYPES:
        return {"$": "dataclass", "type": name,
                "fields": {f.name: encode(getattr(value, f.name))
                           for f in dataclasses.fields(value)}}
    raise TypeError(f"a {name} cannot be returned from a child: return plain data (None, bool, "
                    "int, float, str, list, tuple, dict) or one of " + ", ".join(
                        sorted(RESULT_TYPES)))


class BadResult(ValueError):
    """A child's result that is not what ``encode`` writes."""


def decode(data: Any, depth: int = 0) -> Any:
    """The value ``encode`` wrote, checked: only known tags, allowed and well-typed dataclasses."""
    if depth > 100:
        raise BadResult("nested more than 100 levels deep")
    if data is None or isinstance(data, (bool, int, float)):
        return data
    if isinstance(data, str):
        return clip(data)
    if isinstance(data, list):
        return [decode(item, depth + 1) for item in data]
    if not isinstance(data, dict):
        raise BadResult(f"unexpected {type(data).__name__}")
    tag = data.get("$")
    if tag == "float" and data.get("value") in ("nan", "inf", "-inf"):
        return float(data["value"])
    if tag in ("tuple", "dict") and isinstance(data.get("items"), list):
        items = [decode(item, depth + 1) for item in data["items"]]
        if tag == "tuple":
            return tuple(items)
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
            raise BadResult("a dict's items are not [key, value] pairs")
        try:
            return {key: value for key, value in items}  # the keys must hash
        except TypeError:
            raise BadResult("a dict has an unhashable key") from None
    if tag == "dataclass" and isinstance(data.get("fields"), dict):
        return _rebuild(data.get("type"), data["fields"], depth)
    raise BadResult(f"unknown type tag {tag!r}" if tag is not None else "an untagged object")


def _rebuild(name: Any, fields: dict[str, Any], depth: int) -> Any:
    if name not in RESULT_TYPES:
        raise BadResult(f"type {name!r} is not one a child may return")
    module, _, qualname = str(name).rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    hints = typing.get_type_hints(cls)
    wanted = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != wanted:
        raise BadResult(f"{qualname} fields {sorted(fields)} are not {sorted(wanted)}")
    values = {key: decode(value, depth + 1) for key, value in fields.items()}
    for key, value in values.items():
        if not _conforms(value, hints[key]):
            raise BadResult(f"{qualname}.{key} is a {type(value).__name__}, not "
                            f"{getattr(hints[key], '__name__', hints[key])}")
    return cls(**values)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded value fits an annotation (the shapes the allowed dataclasses use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(item, args[0]) for item in value)
        return len(args) == len(value) and all(map(_conforms, value, args))
    if origin in (dict, Mapping):
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return False


def _read_result(raw: bytes) -> tuple[Any, bool, str | None, tuple[ChildWarning, ...], int]:
    """(value, returned, child_error, warnings, warnings dropped) of the child's envelope."""
    try:
        envelope = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadResult(f"not JSON ({str(exc)[:200]})") from None
    if not isinstance(envelope, dict) or envelope.get("format") != _FORMAT:
        raise BadResult("not a result envelope of this version")
    found, dropped = _read_warnings(envelope.get("warnings"))
    if envelope.get("kind") == "value" and "value" in envelope:
        return decode(envelope["value"]), True, None, found, dropped
    if envelope.get("kind") == "error" and isinstance(envelope.get("error"), str):
        return None, False, clip(envelope["error"]), found, dropped
    raise BadResult("neither a value nor an error")


def _read_warnings(data: Any) -> tuple[tuple[ChildWarning, ...], int]:
    if data is None:
        return (), 0
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise BadResult("no list of warnings")
    found = []
    for item in data["items"][:MAX_WARNINGS]:
        try:
            warning = ChildWarning(**item)
        except TypeError:
            raise BadResult(f"a malformed warning {str(item)[:200]}") from None
        if not (isinstance(warning.category, str) and isinstance(warning.message, str)
                and isinstance(warning.filename, str) and type(warning.lineno) is int
                and type(warning.count) is int):
            raise BadResult(f"a malformed warning {str(item)[:200]}")
        found.append(dataclasses.replace(
            warning, category=warning.category[:200], message=clip(warning.message, 512, 1488),
            filename=warning.filename[-500:]))
    dropped = data.get("dropped", 0)
    extra = len(data["items"]) - len(found)
    return tuple(found), (dropped if type(dropped) is int else 0) + extra


# --- the process tree -------------------------------------------------------------------------

def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # gone, or not ours to read
        return None


def _stat(pid: int) -> tuple[int, bytes, int] | None:
    """(parent pid, state, start time in clock ticks since boot) of a process."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # the name in parentheses may hold anything
    return int(fields[1]), fields[0], int(fields[19])


def _marked(pid: int, needle: bytes) -> bool:
    data = _read(f"/proc/{pid}/environ")
    return data is not None and needle in data


def _tree(root: int, token: str | None, since: int = 0) -> set[int]:
    """The living processes of a run: descendants of ``root`` and those with its marker.

    Only processes started at or after ``since`` (clock ticks, like /proc's start times)
    can carry the marker: older ones are not read.
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()  # no procfs: the process group is all there is
    me, uid = os.getpid(), os.getuid()
    needle = f"{MARKER_ENV}={token}\0".encode() if token else None
    parents: dict[int, int] = {}
    found: set[int] = set()
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        stat = _stat(pid)
        if stat is None or stat[1] in (b"Z", b"X"):
            continue  # gone, or dead and waiting for its parent
        parents[pid] = stat[0]
        if needle is not None and pid != root and stat[2] >= since:
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid and _marked(pid, needle):
                    found.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    found.discard(root)
    return found


def _signal_ours(pid: int, signum: int, root: int, members: set[int], token: str | None) -> None:
    """Signal ``pid`` if it still belongs to the run (checked after a pidfd pins it)."""
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    try:
        stat = _stat(pid)
        needle = f"{MARKER_ENV}={token}\0".encode() if token else None
        ours = stat is not None and (stat[0] == root or stat[0] in members
                                     or (needle is not None and _marked(pid, needle)))
        if not ours:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _kill_tree(root: int, token: str | None, *, include_root: bool, since: int = 0) -> None:
    """Stop the run's processes round after round until none is new, then kill them all.

    ``root`` must not be reaped yet (its pid is then still its own) when ``include_root``.
    """
    stopped: set[int] = set()
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGSTOP)  # no more forks, no more reaping, no more orphans
    for _ in range(100):
        new = _tree(root, token, since) - stopped
        if not new:
            break
        for pid in new:
            _signal_ours(pid, signal.SIGSTOP, root, stopped | new, token)
        stopped |= new
    for pid in stopped:
        _signal_ours(pid, signal.SIGKILL, root, stopped, token)
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)  # also on systems without /proc
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGKILL)  # the child may have left its group


def _resident(pid: int, members: set[int]) -> int:
    """Resident bytes of ``pid`` and ``members`` (VmRSS, from /proc/PID/statm)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for member in (pid, *members):
        raw = _read(f"/proc/{member}/statm")
        if raw is not None:
            with contextlib.suppress(ValueError, IndexError):
                total += int(raw.split()[1]) * page
    return total


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


class _Interruptible:
    """While a child runs, SIGTERM and SIGHUP end the run, then pytest (see the docstring)."""

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


# --- the parent's side ------------------------------------------------------------------------

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


def _flags(raw: bytearray) -> dict[str, Any]:
    """The flags of a complete result: ``alone`` (the child left no living descendant, see
    ``_end_descendants``) and ``retire`` (a worker that ends after it); {} when unreadable,
    and then the parent searches and kills as usual."""
    if not raw.endswith(b"}"):
        return {}
    try:
        envelope = json.loads(_split_notes(bytes(raw))[1])
    except (ValueError, RecursionError):
        return {}
    if not isinstance(envelope, dict):
        return {}
    return {key: envelope.get(key) for key in ("alone", "retire")}


# Children that returned a clean result and were exiting: reaped by ``reap_pending``.
_PENDING: list[_Run] = []
REAP_GRACE = 10.0  # seconds a returned child gets to finish exiting before it is killed


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


def shutdown() -> None:
    """End of the session: end the workers, reap every child still pending, end the zygote."""
    global _ZYGOTE
    for pool in list(_POOLS):
        pool.close()
    reap_pending()
    if _ZYGOTE is not None:
        zygote, _ZYGOTE = _ZYGOTE, None
        zygote.stop()


# --- the zygote (forkserver) ------------------------------------------------------------------

def forkserver_available() -> bool:
    """Whether this system can serve runs from a zygote (Linux: pidfds, fd passing, /proc)."""
    return (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")
            and hasattr(socket, "send_fds"))


_ZYGOTE: _Zygote | None = None
_ZYGOTE_FD = 3  # the socket's fd in a spawned zygote
# Imported before the zygote starts, so that every child it forks has them already.
PRELOAD = ("torch", "safetensors.torch", "pytest_gpucase.run.child",
           "pytest_gpucase.verdict.compare")


def forkserver() -> _Zygote:
    """The session's zygote, started now if it is not running yet.

    Started as a fork of this process when CUDA is not initialized here (the plugin
    does it at ``pytest_configure``, before anything can initialize it), else as a
    fresh interpreter, once: either way it imports ``PRELOAD`` and never touches the
    device, so each child it forks starts from a clean, warm image.
    """
    global _ZYGOTE
    if _ZYGOTE is not None and _ZYGOTE.alive():
        return _ZYGOTE
    if not forkserver_available():
        raise RuntimeError("the forkserver start method needs Linux (pidfd_open, fd passing); "
                           "use --gpu-start-method=spawn")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    try:
        if _cuda_initialized():
            actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), _ZYGOTE_FD),
                       (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                       (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                       (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
            entry = "from pytest_gpucase.run.isolation import zygote_main; zygote_main()"
            pid = os.posix_spawn(sys.executable, [sys.executable, "-c", entry, str(parent)],
                                 {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                 file_actions=actions)
        else:
            for name in PRELOAD:
                importlib.import_module(name)
            _flush_std_streams()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the zygote
                try:
                    mine.close()
                    null = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(null, fd)
                    keep = theirs.fileno()
                    os.closerange(3, keep)
                    os.closerange(keep + 1, 1 << 16)
                except BaseException:
                    os._exit(70)
                _zygote_loop(theirs, parent)
    finally:
        theirs.close()
    _ZYGOTE = _Zygote(pid, mine)
    return _ZYGOTE


def zygote_main() -> None:  # pragma: no cover - runs in a spawned zygote
    """Entry point of a zygote started as a fresh interpreter (CUDA was initialized)."""
    for name in PRELOAD:
        importlib.import_module(name)
    _zygote_loop(socket.socket(fileno=_ZYGOTE_FD), int(sys.argv[1]))


class _Zygote:
    """This process's end of the zygote: ask it to fork a run's child, or to reap one.

    The zygote reaps a child only when asked, so that the child's pid stays its own
    while this process checks and kills its tree, as with a child of its own.
    """

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def _ask(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> int:
        data = pickle.dumps(message)  # the parent's own data, to a process of its own
        blob = len(data).to_bytes(8, "little") + data
        sent = socket.send_fds(self.sock, [blob], list(fds))
        self.sock.sendall(blob[sent:])
        reply = _receive_exactly(self.sock, 8)
        if len(reply) < 8:
            raise RuntimeError(f"the gpucase zygote (pid {self.pid}) ended; each run's child "
                               "is forked by it. Use --gpu-start-method=spawn if it keeps ending")
        return int.from_bytes(reply, "little", signed=True)

    def start(self, func: Callable[..., Any], args: tuple[Any, ...], fds: tuple[int, int, int],
              env: Mapping[str, str], fd_argument: bool = False) -> int:
        """Fork a child that calls ``func(*args)`` writing to ``fds`` (out, err, result);
        with ``fd_argument``, ``func(*args, result_fd)``."""
        return self._ask({"op": "run", "job": pickle.dumps((func, args)), "path": list(sys.path),
                          "cwd": os.getcwd(), "environ": dict(os.environ), "env": dict(env),
                          "fd_argument": fd_argument}, fds)

    def reap(self, pid: int) -> int:
        status = self._ask({"op": "reap", "pid": pid})
        if status < 0:
            raise ChildProcessError(f"pid {pid} is not a child of the zygote")
        return status

    def stop(self) -> None:
        """Close the zygote's socket (it exits on that) and reap it."""
        self.sock.close()
        end = time.monotonic() + REAP_GRACE
        while time.monotonic() < end:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                    time.sleep(0.005)
                    continue
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _receive_exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _zygote_loop(sock: socket.socket, parent: int) -> None:  # pragma: no cover - the zygote
    """Serve the parent until it closes the socket: fork children, reap them when asked."""
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(0)
        os.setpgid(0, 0)  # Ctrl-C goes to pytest's group, not here; pytest ends us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gc.collect()
        gc.freeze()
        me = os.getpid()
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            if len(data) < 8:
                os._exit(0)
            size = int.from_bytes(data[:8], "little")
            message = pickle.loads(_receive_exactly(sock, size + 8, data)[8:])
            if message["op"] == "run":
                pid = os.fork()
                if pid == 0:
                    _zygote_child(sock, message, fds, me)
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
                for fd in fds:
                    os.close(fd)
                reply = pid
            else:
                try:
                    reply = os.waitpid(message["pid"], 0)[1]
                except ChildProcessError:
                    reply = -1
            sock.sendall(reply.to_bytes(8, "little", signed=True))
    except BaseException:
        os._exit(0)


def _zygote_child(sock: socket.socket, message: dict[str, Any], fds: list[int],
                  zygote: int) -> None:  # pragma: no cover - a child of the zygote
    try:
        sock.close()
        os.environ.clear()
        os.environ.update(message["environ"])
        sys.path[:] = message["path"]
        with contextlib.suppress(OSError):
            os.chdir(message["cwd"])
        out_w, err_w, res_w = fds
    except BaseException:
        os._exit(70)
    job = message["job"]

    def call() -> Any:
        func, args = pickle.loads(job)
        if message.get("fd_argument"):  # a worker: its socket came as the result fd
            return func(*args, res_w)
        return func(*args)

    _forked_child(out_w, err_w, res_w, (), message["env"], False, zygote, call, ())


atexit.register(shutdown)


def _has_exited(pid: int) -> bool:
    """Whether the child has ended, leaving it unreaped (its pid stays its own until waitpid)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


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


# --- reusable workers (--gpu-isolation case, worker) -----------------------------------------

_POOLS: list[WorkerPool] = []


class WorkerPool:
    """Long-lived children that run calls one after another, by key (device, environment,
    and the case in ``case`` isolation), to amortize a device context over many runs.

    A worker ends on anything it cannot vouch for: a crash, a timeout, a result refused,
    a process left behind, or global state it cannot restore (``_State``); the caller
    retires it after any failure too (``retire``) and confirms that failure in a fresh
    child. ``shutdown`` ends every pool's workers.
    """

    def __init__(self) -> None:
        self.workers: dict[Any, _Worker] = {}
        _POOLS.append(self)

    def run(self, key: Any, func: Callable[..., Any], *args: Any, timeout: float,
            env: Mapping[str, str] | None = None, start_method: StartMethod = "fork",
            memory_limit: int | None = None, exclusive: bool = False,
            marks: Mapping[str, str] | None = None) -> ChildResult:
        """``func(*args)`` in the worker of ``key`` (started now if there is none); with
        ``exclusive``, the other workers end first (one case's worker at a time). ``marks``
        as ``run_in_child`` has them."""
        if exclusive:
            for other in [k for k in self.workers if k != key]:
                self.retire(other)
        worker = self.workers.get(key)
        if worker is None:
            worker = self.workers[key] = _Worker(start_method, env or {})
        result = worker.call(func, args, timeout, memory_limit, marks)
        if not worker.usable:
            del self.workers[key]
        return result

    def retire(self, key: Any) -> None:
        """End the worker of ``key``, if there is one."""
        worker = self.workers.pop(key, None)
        if worker is not None:
            worker.close()

    def close(self) -> None:
        for key in list(self.workers):
            self.retire(key)
        reap_pending()


class _Worker:
    """One reusable child and this process's socket to it."""

    def __init__(self, start_method: StartMethod, env: Mapping[str, str]) -> None:
        if start_method == "spawn":
            raise ValueError("a reusable worker is forked (fork or forkserver), not spawned")
        self.token = secrets.token_hex(16)
        self.start_method = start_method
        child_env = {**env, MARKER_ENV: self.token}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        nulls = (os.open(os.devnull, os.O_WRONLY), os.open(os.devnull, os.O_WRONLY))
        self.zygote: _Zygote | None = None
        reap_pending(block=False)
        try:
            if start_method == "forkserver":
                self.zygote = forkserver()
                self.pid = self.zygote.start(_worker_serve, (), (*nulls, theirs.fileno()),
                                             child_env, fd_argument=True)
            else:
                gc.freeze()
                threaded, parent = thread_count() > 1, os.getpid()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the worker
                    _forked_child(nulls[0], nulls[1], theirs.fileno(), (mine.fileno(),),
                                  child_env, threaded, parent, _worker_serve, (theirs.fileno(),))
                self.pid = pid
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
        finally:
            theirs.close()
            for fd in nulls:
                os.close(fd)
        self.sock = mine
        self.usable = True

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], timeout: float,
             memory_limit: int | None, marks: Mapping[str, str] | None = None) -> ChildResult:
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        start = time.monotonic()
        try:
            with _Interruptible() as guard:
                job = pickle.dumps((func, args))  # the parent's own data, as for spawn
                blob = len(job).to_bytes(8, "little") + job
                try:
                    sent = socket.send_fds(self.sock, [blob], [out_w, err_w, res_w])
                    self.sock.sendall(blob[sent:])
                except OSError:  # it died between calls: the result will say so
                    pass
                for fd in (out_w, err_w, res_w):
                    os.close(fd)
                out_w = err_w = res_w = -1
                run = _Run(self.pid, self.token, memory_limit, zygote=self.zygote, reusable=True)
                result = _supervise(run, out_r, err_r, res_r, timeout, start, self.start_method,
                                    guard, marks)
        finally:
            for fd in (out_r, err_r, res_r, out_w, err_w, res_w):
                if fd >= 0:
                    os.close(fd)
        if not run.kept:  # killed and reaped, or exiting and pending
            self.usable = False
            self.sock.close()
        return result

    def close(self) -> None:
        """End the worker: it exits when its socket closes (killed if it does not)."""
        if not self.usable:
            return
        self.usable = False
        self.sock.close()
        _PENDING.append(_Run(self.pid, self.token, None, zygote=self.zygote))


def _worker_serve(sock_fd: int) -> None:  # pragma: no cover - the worker
    """Run the calls the parent sends, one at a time, each with its own pipes."""
    global _NOTE_FD
    sock = socket.socket(fileno=sock_fd)
    null = os.open(os.devnull, os.O_RDWR)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if len(data) < 8 or len(fds) != 3:
            _flush_std_streams()
            _save_coverage()
            os._exit(0)
        size = int.from_bytes(data[:8], "little")
        job = _receive_exactly(sock, size + 8, data)[8:]
        out_w, err_w, res_w = fds
        state = _State()
        _flush_std_streams()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)

        restored: list[bool] = []
        _NOTE_FD = res_w
        payload = _envelope(_unpickle_and_call, (job,), functools.partial(
            _restore, state, restored))
        _NOTE_FD = None
        retire = restored != [True]
        _flush_std_streams()
        try:
            _write_all(res_w, payload)
        except BaseException:
            retire = True
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(res_w)
        if retire:
            _save_coverage()
            os._exit(0)


def _unpickle_and_call(job: bytes) -> Any:  # pragma: no cover - the worker
    func, args = pickle.loads(job)  # the parent's own data
    return func(*args)


def _restore(state: _State, found: list[bool]) -> dict[str, Any]:  # pragma: no cover
    """Restore the worker's state after a call; the result says whether the worker ends."""
    found.append(state.restore())
    return {"retire": not found[-1]}


class _State:  # pragma: no cover - the worker
    """The global state a run may change, saved before it and restored after it.

    ``restore`` returns False when it cannot be (the worker then ends): a device left in
    an error state, a failed restore.
    """

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.random = __import__("random").getstate()
        torch = sys.modules.get("torch")
        self.torch: dict[str, Any] = {}
        if torch is not None:
            backends = torch.backends
            self.torch = {
                "grad": torch.is_grad_enabled(),
                "dtype": torch.get_default_dtype(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "matmul_tf32": backends.cuda.matmul.allow_tf32,
                "precision": torch.get_float32_matmul_precision(),
                "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark,
                          backends.cudnn.deterministic, backends.cudnn.allow_tf32),
                "threads": torch.get_num_threads(),
                "rng": torch.random.get_rng_state(),
                "cuda": torch.cuda.is_initialized(),
            }
            if self.torch["cuda"]:
                self.torch["device"] = torch.cuda.current_device()
                self.torch["cuda_rng"] = torch.cuda.get_rng_state_all()

    def restore(self) -> bool:
        try:
            os.environ.clear()
            os.environ.update(self.environ)
            os.chdir(self.cwd)
            sys.path[:] = self.path
            for name in set(sys.modules) - self.modules:
                if name.startswith("gpucase_case_"):  # a case's own code: never shared
                    del sys.modules[name]
            __import__("random").setstate(self.random)
            torch = sys.modules.get("torch")
            if torch is None or not self.torch:
                return True
            saved, backends = self.torch, torch.backends
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a sticky device error raises here: end the worker
            torch.set_grad_enabled(saved["grad"])
            torch.set_default_dtype(saved["dtype"])
            if (torch.are_deterministic_algorithms_enabled(), saved["warn_only"]) != (
                    saved["deterministic"], torch.is_deterministic_algorithms_warn_only_enabled()):
                # As execute's switch does: the public call would import inductor (seconds).
                torch._C._set_deterministic_algorithms(saved["deterministic"],
                                                       warn_only=saved["warn_only"])
            backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
            torch.set_float32_matmul_precision(saved["precision"])
            (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
             backends.cudnn.allow_tf32) = saved["cudnn"]
            torch.set_num_threads(saved["threads"])
            torch.random.set_rng_state(saved["rng"])
            if saved["cuda"]:
                torch.cuda.set_device(saved["device"])
                torch.cuda.set_rng_state_all(saved["cuda_rng"])
            return True
        except Exception:
            return False

"""Run a function in a fresh child process, with its own environment, a timeout, and its output.

The child is a fork of this process by default (cheap: torch is already
imported) or, when CUDA was initialized here and a fork would inherit a broken
context, a fresh interpreter started with ``posix_spawn``. The child gets its
own process group, so a timeout kills every process it started. Its fds 1 and
2 go to pipes the parent drains into bounded buffers: device-side assertion
lines are printed to fd 2 by the kernel, and a child printing gigabytes must
not fill memory or disk. The result comes back pickled over a third pipe;
tensors never travel that way (``execute`` returns plain values).

The timeout lives in the parent: a hang inside a GIL-released CUDA call cannot
be interrupted by a Python signal handler in the child. On expiry the parent
asks the child's ``faulthandler`` for every thread's stack (SIGUSR1), waits a
moment for it, then kills the process group.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

StartMethod = Literal["fork", "spawn"]

CAPTURE_HEAD = 16 * 1024
CAPTURE_TAIL = 48 * 1024
# Time the child gets to print its thread stacks after a timeout, before SIGKILL.
DUMP_GRACE = 2.0
DUMP_QUIET = 0.2  # stderr silent this long after the dump began: the dump is complete
_RESULT_FD = 3  # where a spawned child writes its result


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

    @property
    def problem(self) -> str | None:
        """Why no value came back, in words, or None when it did."""
        if self.returned:
            return None
        if self.timed_out:
            return "timed out"
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


class _Capture:
    """Keep the head and the tail of a stream, and count what fell between them."""

    def __init__(self, head: int = CAPTURE_HEAD, tail: int = CAPTURE_TAIL) -> None:
        self.head_limit, self.tail_limit = head, tail
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        middle = f"\n[... {self.dropped} bytes omitted ...]\n" if self.dropped else ""
        return (bytes(self.head).decode(errors="replace") + middle
                + bytes(self.tail).decode(errors="replace"))


def thread_count() -> int:
    """How many OS threads this process has (1 when only the main thread runs)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs (macOS): Python's own threads are the best we know
        import threading

        return threading.active_count()


def default_start_method() -> StartMethod:
    """``fork`` unless this process already initialized CUDA (then a fork would inherit it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def run_in_child(
    func: Callable[..., Any],
    *args: Any,
    timeout: float,
    env: Mapping[str, str] | None = None,
    start_method: StartMethod = "fork",
) -> ChildResult:
    """Call ``func(*args)`` in a fresh child process and report what happened to it."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    job_file = None
    start = time.monotonic()
    try:
        if start_method == "fork":
            threaded = thread_count() > 1
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child, measured by the parent
                _forked_child(out_w, err_w, res_w, (out_r, err_r, res_r), env, threaded,
                              func, args)
        else:
            job_file = _write_job(func, args)
            pid = _spawn(job_file, out_w, err_w, res_w, env)
        with contextlib.suppress(OSError):  # the child does it too; the first one wins
            os.setpgid(pid, pid)
        for fd in (out_w, err_w, res_w):
            os.close(fd)
        out_w = err_w = res_w = -1
        return _supervise(pid, out_r, err_r, res_r, timeout, start, start_method)
    finally:
        for fd in (out_r, err_r, res_r, out_w, err_w, res_w):
            if fd >= 0:
                os.close(fd)
        if job_file is not None:
            os.unlink(job_file)


def _forked_child(out_w: int, err_w: int, res_w: int, parent_ends: tuple[int, ...],
                  env: Mapping[str, str] | None, threaded: bool, func: Callable[..., Any],
                  args: tuple[Any, ...]) -> None:  # pragma: no cover - child side
    try:
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
        if env:
            os.environ.update(env)
    except BaseException:
        os._exit(70)
    _child_main(res_w, func, args)


def _flush_std_streams() -> None:  # pragma: no cover - child side
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream: nothing to flush
            stream.flush()


def _child_main(res_w: int, func: Callable[..., Any],
                args: tuple[Any, ...]) -> None:  # pragma: no cover - child side
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    code = 0
    try:
        payload = pickle.dumps(("value", func(*args)))
    except BaseException:
        payload = pickle.dumps(("error", traceback.format_exc()))
    try:
        _write_all(res_w, payload)
    except BaseException:
        code = 71
    _flush_std_streams()
    os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_job(func: Callable[..., Any], args: tuple[Any, ...]) -> str:
    fd, path = tempfile.mkstemp(prefix="gpucase-job-", suffix=".pickle")
    with os.fdopen(fd, "wb") as handle:
        pickle.dump(list(sys.path), handle)
        pickle.dump((func, args), handle)
    return path


def _spawn(job_file: str, out_w: int, err_w: int, res_w: int,
           env: Mapping[str, str] | None) -> int:
    child_env = dict(os.environ)
    child_env.update(env or {})
    actions = [
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
        (os.POSIX_SPAWN_DUP2, res_w, _RESULT_FD),
    ]
    entry = "from pytest_gpucase.isolation import spawned_main; spawned_main()"
    argv = [sys.executable, "-c", entry, job_file]
    return os.posix_spawn(sys.executable, argv, child_env, file_actions=actions, setpgroup=0)


def spawned_main() -> None:  # pragma: no cover - runs in a spawned child
    """Entry point of a spawned child: load the job, run it, send the result on fd 3."""
    with open(sys.argv[1], "rb") as handle:
        sys.path[:] = pickle.load(handle)
        func, args = pickle.load(handle)
    _child_main(_RESULT_FD, func, args)


def _supervise(pid: int, out_r: int, err_r: int, res_r: int, timeout: float, start: float,
               start_method: StartMethod) -> ChildResult:
    captures = {out_r: _Capture(), err_r: _Capture()}
    result = bytearray()
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
    status: int | None = None
    timed_out = False
    kill_at: float | None = None
    drain_until = float("inf")
    dumped_at: float | None = None  # when the child last wrote to stderr after SIGUSR1
    deadline = start + timeout
    try:
        while status is None or open_fds:
            now = time.monotonic()
            if status is None and not timed_out and now >= deadline:
                timed_out = True
                _signal_group(pid, signal.SIGUSR1)  # faulthandler: dump every thread's stack
                kill_at = now + DUMP_GRACE
            if kill_at is not None and dumped_at is not None and now - dumped_at >= DUMP_QUIET:
                kill_at = now  # the stack dump has been written and stderr is quiet again
            if kill_at is not None and now >= kill_at:
                _signal_group(pid, signal.SIGKILL)
                kill_at = None
            wait_until = kill_at if kill_at is not None else deadline
            if dumped_at is not None and kill_at is not None:
                wait_until = min(kill_at, dumped_at + DUMP_QUIET)
            if status is not None:
                if now >= drain_until:
                    break  # a process that left the group still holds a pipe: stop reading
                wait_until = drain_until
            step = max(0.0, wait_until - now)
            if pidfd is None and status is None:
                step = min(step, 0.05)
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
                    result += data
                else:
                    captures[fd].add(data)
                    if kill_at is not None and fd == err_r:
                        dumped_at = time.monotonic()
            if status is None:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = raw
                    # Grandchildren may still hold the pipes open: end them all.
                    _signal_group(pid, signal.SIGKILL)
                    drain_until = time.monotonic() + 1.0
    finally:
        if status is None:
            _signal_group(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        if pidfd is not None:
            os.close(pidfd)
    return _result(status, bytes(result), captures[out_r], captures[err_r], timed_out,
                   time.monotonic() - start, start_method)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pid, signum)


def _result(status: int, raw: bytes, out: _Capture, err: _Capture, timed_out: bool,
            duration: float, start_method: StartMethod) -> ChildResult:
    exitcode = os.waitstatus_to_exitcode(status)
    signum = -exitcode if exitcode < 0 else None
    value, returned, child_error = None, False, None
    if raw and not timed_out:
        try:
            kind, value = pickle.loads(raw)
        except Exception as exc:
            child_error = f"the child's result could not be read: {exc!r}"
        else:
            returned = kind == "value"
            if not returned:
                child_error, value = value, None
    return ChildResult(
        value=value, returned=returned, exitcode=None if signum else exitcode, signal=signum,
        timed_out=timed_out, stdout=out.text(), stderr=err.text(), duration=duration,
        start_method=start_method, child_error=child_error,
    )

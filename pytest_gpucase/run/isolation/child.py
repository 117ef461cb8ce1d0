"""The child's side of a run: what a forked, spawned or zygote-forked child does.

Runs in the child, but for ``fork_child`` and ``held_dumps``, with which the parent starts
a child. The child contains itself (dies with the parent, keeps its orphans as a
subreaper), points fds 1 and 2 at the parent's pipes, calls the function while recording
its warnings and the phase notes (``note``), ends what it started, saves its coverage data,
and writes its result on the result pipe (``wire``).
"""

from __future__ import annotations

import _signal
import contextlib
import gc
import io
import json
import os
import pickle
import signal
import stat
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from pytest_gpucase.base.torch_import import cuda_initialized
from pytest_gpucase.run.isolation.clipping import clip
from pytest_gpucase.run.isolation.proctree import (
    _PR_SET_PDEATHSIG,
    _children,
    _kill_tree,
    _prctl,
    adopt_orphans,
    forget_parent,
    name_process,
    own,
    thread_count,
)
from pytest_gpucase.run.isolation.wire import _FORMAT, _NOTE, MAX_WARNINGS, NOTE_LIMIT, encode

__all__ = ["DUMP_SIGNAL", "WARNING_TEXT", "fork_child", "held_dumps", "note", "spawned_main"]

WARNING_TEXT = 2000  # characters of one warning's message
_RESULT_FD = 3  # where a spawned child writes its result

# The signal a timed-out child is sent for every thread's stack (faulthandler). A child is
# started with it blocked and unblocks it once its handler is in place: its default action
# ends the process, and a child still starting when its time ran out (a loaded machine) would
# die of the request instead of reporting the timeout. A blocked one is delivered on unblocking.
DUMP_SIGNAL = signal.SIGUSR1
# What the child runs on every run is made before the fork where it can be, and its signal
# calls go to ``_signal``, the C module behind ``signal``: those wrappers make an enum of each
# number they take or return, and each Python function a forked child runs first costs it
# copies of the parent's pages (its code, its objects).
_RESULT_JSON = json.JSONEncoder(allow_nan=False)  # json.dumps(..., allow_nan=False)'s


@contextlib.contextmanager
def held_dumps() -> Any:
    """Block ``DUMP_SIGNAL`` in this thread meanwhile: a process forked (or spawned) inside
    starts with it blocked, until ``_answer_dumps`` has its handler in place. A forked child
    never leaves the block (it ends in ``os._exit``)."""
    # Read first, block inside the try: a handler run as the mask changes (Ctrl-C) must
    # not leave this process with the signal blocked for good.
    old = _signal.pthread_sigmask(_signal.SIG_BLOCK, ())
    try:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {DUMP_SIGNAL})
        yield
    finally:
        if DUMP_SIGNAL not in old:
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {DUMP_SIGNAL})


def _answer_dumps() -> None:  # pragma: no cover - child side
    """Put faulthandler in place, for a fatal signal and for ``DUMP_SIGNAL``, then unblock
    the latter (held since the child started): a request made meanwhile is answered now.
    Unblocked whatever the parent's own mask: a child's stacks are always asked for."""
    import faulthandler

    # Disabled first: enable() on a faulthandler the parent had enabled (pytest enables it)
    # only changes its file, and keeps no handler that code in the parent replaced since
    # (a library's own SIGSEGV handler, a test restoring SIG_DFL): a crash would then leave
    # no stack. Enabled anew, its handlers are this child's, whatever came before.
    # On fd 2 by its number, as sys.stderr's: nothing of the stream object is run.
    faulthandler.disable()
    faulthandler.enable(file=2, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=2, all_threads=True)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {DUMP_SIGNAL})


def _contain_self(parent: int, name: str = "run") -> None:  # pragma: no cover - child side
    """Die with the parent, keep orphaned descendants as this process's own, and carry
    gpucase's name (``proctree.TAG``), which forks of this process inherit."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody waits
        os._exit(70)
    forget_parent()
    adopt_orphans()
    name_process(name)


def _drop_channels(keep: tuple[int, ...]) -> None:  # pragma: no cover - child side
    """Point every pipe and socket this child inherited, but ``keep``, at /dev/null.

    They are the parent's channels to other processes (the zygote's and each worker's
    socket, an xdist worker's link to its controller, a test runner's pipes): a process a
    case leaves behind must hold none of them, or whoever waits for their end (the zygote
    at the end of the session, xdist for a worker that died) waits for that process. The
    fd numbers stay taken, so that an object still holding one never closes a file of the
    case's later. Regular files are left open.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    null = -1
    for name in names:
        fd = int(name)
        if fd <= 2 or fd in keep:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue  # the listing's own fd, closed by now
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            if null < 0:
                null = os.open(os.devnull, os.O_RDWR)
            if fd != null:
                os.dup2(null, fd)
    if null >= 0:
        os.close(null)


def _forked_child(out_w: int, err_w: int, res_w: int, parent_ends: tuple[int, ...],
                  env: Mapping[str, str], threaded: bool, parent: int,
                  func: Callable[..., Any], args: tuple[Any, ...],
                  name: str = "run") -> None:  # pragma: no cover
    try:
        _contain_self(parent, name)
        for fd in parent_ends:
            os.close(fd)
        _drop_channels((out_w, err_w, res_w))
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
        _flush_std_streams()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        # pytest's capture may have replaced sys.stdout/err: write to the real fds again.
        sys.stdout, sys.stderr = _STREAMS or _std_streams(1)
        for variable, value in env.items():  # not update(): no question to the Mapping ABC
            os.environ[variable] = value
    except BaseException:
        os._exit(70)
    _child_main(res_w, func, args)


class _FdWriter(io.RawIOBase):
    """Writes to an fd by its number, whatever file that number holds when it writes (named
    as ``open``'s file of it is: code reads ``sys.stdout.name`` and ``.mode``)."""

    mode = "wb"
    closefd = False

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    @property
    def name(self) -> int:
        return self.fd

    def fileno(self) -> int:
        return self.fd

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return _OS_WRITE(self.fd, data)


# os.write as it is now: a case that replaces it (a test double) must not see, or swallow,
# its prints, which a file ``open`` makes writes without it.
_OS_WRITE = os.write


# The child's sys.stdout and sys.stderr, line-buffered text on fds 1 and 2 (which the child
# points at its pipes), made once by the parent before its first fork (``fork_child``) and
# inherited: made by each child (``open(1, "w")``: a file it stats, a codec looked up), they
# cost it 50 page faults and 0.13 ms. Never written in the parent. Left open on purpose.
_STREAMS: tuple[io.TextIOWrapper, io.TextIOWrapper] | None = None


def _std_streams(like: int) -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """The child's streams, made once; buffered as ``open`` buffers a file of fd ``like``
    (a child's pipe: its block, past which a write goes out at once, so that a crash loses
    no more of the output than a file of the child's own did)."""
    global _STREAMS
    if _STREAMS is None:
        block = os.fstat(like).st_blksize
        block = block if block > 1 else io.DEFAULT_BUFFER_SIZE
        _STREAMS = (_text_writer(1, block), _text_writer(2, block))
    return _STREAMS


def _text_writer(fd: int, block: int) -> io.TextIOWrapper:
    """What ``open(fd, "w", buffering=1, closefd=False, errors="replace")`` gives, over
    ``_FdWriter``: nothing asked of the file the fd holds now (the parent's, not the child's)."""
    stream = io.TextIOWrapper(io.BufferedWriter(_FdWriter(fd), buffer_size=block),
                              errors="replace", line_buffering=True)
    stream.mode = "w"  # type: ignore[misc]  # as open() sets it
    return stream


def fork_child(out_w: int, err_w: int, res_w: int, parent_ends: tuple[int, ...],
               env: Mapping[str, str], func: Callable[..., Any], args: tuple[Any, ...],
               name: str = "run") -> int:
    """Fork a child of this process that runs ``func(*args)`` (``_forked_child``), started
    with the stack signal held (``held_dumps``); its pid, owned (``proctree.own``)."""
    # Objects that exist now are never collected by the parent's later passes, and a
    # collection in the child cannot touch (and so copy) their pages.
    _std_streams(out_w)
    gc.freeze()
    threaded = thread_count() > 1
    parent = os.getpid()
    with held_dumps():
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, measured by the parent
            _forked_child(out_w, err_w, res_w, parent_ends, env, threaded, parent, func, args,
                          name=name)
    own(pid)
    return pid


def _flush_std_streams() -> None:  # pragma: no cover - child side
    for stream in (sys.stdout, sys.stderr):
        # Not contextlib.suppress: no context manager for the child to run. A closed or
        # replaced stream has nothing to flush.
        try:  # noqa: SIM105
            stream.flush()
        except Exception:
            pass


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


def _child_main(res_w: int, func: Callable[..., Any],
                args: tuple[Any, ...]) -> None:  # pragma: no cover - child side
    _answer_dumps()
    for number in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        _signal.signal(number, _signal.SIG_DFL)
    code = 0
    payload = _envelope_noting(res_w, func, args)
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


def _envelope_noting(res_w: int, func: Callable[..., Any], args: tuple[Any, ...],
                     extra: Callable[[], dict[str, Any]] | None = None
                     ) -> bytes:  # pragma: no cover - child side
    """``_envelope``, with ``note`` writing to ``res_w`` (the call's result pipe) meanwhile."""
    global _NOTE_FD
    _NOTE_FD = res_w
    payload = _envelope(func, args, extra)
    _NOTE_FD = None
    return payload


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
    envelope.update(format=_FORMAT, warnings=log.data(), alone=alone, device=_device_started())
    if extra is not None:
        envelope.update(extra())
    try:
        return _RESULT_JSON.encode(envelope).encode()
    except BaseException:
        return json.dumps({"format": _FORMAT, "kind": "error",
                           "error": clip(traceback.format_exc())}).encode()


def _device_started() -> bool:  # pragma: no cover - child side
    """Whether this child holds a CUDA (or ROCm) context, whose teardown at its exit takes
    far longer than a CPU child's: the parent does not wait for it (``exits_soon``)."""
    try:
        return cuda_initialized()
    except Exception:  # a broken torch: as if it had one (the parent waits less)
        return True


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


def spawned_main() -> None:  # pragma: no cover - runs in a spawned child
    """Entry point of a spawned child: load the job, run it, send the result on fd 3."""
    _contain_self(int(sys.argv[2]))
    # Line by line on its pipes, and text that does not encode replaced, as a forked child's
    # streams write; still the interpreter's own, as its environment made them (an encoding
    # PYTHONIOENCODING names, unbuffered under PYTHONUNBUFFERED: nothing lost at a crash).
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True,
                               errors="replace" if stream is sys.stdout else None)
    # Before the job's imports (torch: seconds on a loaded machine): a timeout during them
    # gets their stacks, and what they start (threads, processes) does not inherit the block.
    _answer_dumps()
    with open(sys.argv[1], "rb") as handle:
        sys.path[:] = pickle.load(handle)
        func, args = pickle.load(handle)
    _child_main(_RESULT_FD, func, args)

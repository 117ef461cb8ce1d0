"""The zygote (the forkserver start method): a warm process that forks each run's child.

Two processes run this module. The parent (the pytest process) starts the zygote once per
session, before CUDA is initialized if it can, and asks it over a socket to fork a child
or to reap one (``_Zygote``). The zygote itself imports ``PRELOAD``, never touches the
device, and serves the parent until the socket closes (``_zygote_loop``); each child it
forks goes on as a forked child does (``child``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import os
import pickle
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pytest_gpucase.base.torch_import import cuda_initialized as _cuda_initialized
from pytest_gpucase.run.isolation.child import (
    DUMP_SIGNAL,
    _flush_std_streams,
    _forked_child,
)
from pytest_gpucase.run.isolation.hugepages import before_fork, expect_forks
from pytest_gpucase.run.isolation.proctree import (
    _PR_SET_PDEATHSIG,
    MAX_POLL_STEP,
    REAP_GRACE,
    _children,
    _kill_tree,
    _prctl,
    adopt_orphans,
    disown,
    forget_parent,
    name_process,
    own,
)
from pytest_gpucase.run.isolation.result import Prepare, StartMethod

__all__ = [
    "ANSWER_GRACE",
    "PRELOAD",
    "default_start_method",
    "entered",
    "expect_zygote_forks",
    "forkserver",
    "forkserver_available",
    "stop_forkserver",
    "zygote_main",
    "zygote_running",
]

_ZYGOTE: _Zygote | None = None
_EXPECTED: int | None = None  # the forks the session expects (``expect_zygote_forks``)
_ZYGOTE_FD = 3  # the socket's fd in a spawned zygote
# Imported before the zygote starts, so that every child it forks has them already.
PRELOAD = ("torch", "safetensors.torch", "pytest_gpucase.run.child",
           "pytest_gpucase.run.prepared", "pytest_gpucase.verdict.compare")
# Seconds past a run's timeout that the zygote has to fork its child (its huge pages and the
# run's prepare are no part of the run's time), after which it is taken for stuck and ended.
ANSWER_GRACE = 60.0
# Called in the zygote once it preloaded, before it serves: what every child would otherwise
# find again (the reference-cache key's rows of the modules loaded, a stat each).
PRIME = ("pytest_gpucase.run.reference_cache:prime",)


# --- in the parent ---------------------------------------------------------------------------

def default_start_method() -> StartMethod:
    """``fork`` unless this process already initialized CUDA (then a fork would inherit it):
    then ``forkserver`` (a zygote started before CUDA was), or ``spawn`` where there is none."""
    if not _cuda_initialized():
        return "fork"
    return "forkserver" if forkserver_available() else "spawn"


def forkserver_available() -> bool:
    """Whether this system can serve runs from a zygote (Linux: pidfds, fd passing, /proc)."""
    return (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")
            and hasattr(socket, "send_fds"))


def zygote_running() -> bool:
    """Whether the session's zygote is running already (never starts one)."""
    return _ZYGOTE is not None and _ZYGOTE.alive()


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
            entry = "from pytest_gpucase.run.isolation.zygote import zygote_main; zygote_main()"
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
    own(pid)
    _ZYGOTE = _Zygote(pid, mine)
    return _ZYGOTE


def expect_zygote_forks(count: int) -> None:
    """Tell the session's zygote, with its next fork, about how many more it will make (what
    its huge pages are worth: ``hugepages.expect_forks``); a zygote started later in the
    session is told too."""
    global _EXPECTED
    _EXPECTED = count
    if _ZYGOTE is not None:
        _ZYGOTE.expected = count


def stop_forkserver() -> None:
    """End the session's zygote, if one runs (a later ``forkserver`` starts a new one)."""
    global _ZYGOTE, _EXPECTED
    _EXPECTED = None  # the session's
    if _ZYGOTE is not None:
        zygote, _ZYGOTE = _ZYGOTE, None
        zygote.stop()


class _Zygote:
    """This process's end of the zygote: ask it to fork a run's child, or to reap one.

    The zygote reaps a child only when asked, so that the child's pid stays its own
    while this process checks and kills its tree, as with a child of its own.
    """

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        # Seconds the zygote spent before its last fork, backing its memory with huge pages
        # (``hugepages.before_fork``) and in the run's prepare: no part of that child's run.
        self.prepared = 0.0
        # The environment and import path the zygote holds, as last sent: sent again only
        # where they changed (the folder, every run), and applied in the zygote itself, so
        # that a child inherits them instead of setting a hundred variables again.
        self._context: dict[str, Any] = {}
        # Forks to come, for the next message (expect_forks): what the session expected when
        # this zygote started after another was ended.
        self.expected: int | None = _EXPECTED
        self.ended = False  # killed or stopped, and reaped (``_ended``)

    def alive(self) -> bool:
        if self.ended:
            return False
        try:
            if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                return True
        except ChildProcessError:
            pass
        self._ended()  # reaped now (or not this process's): never signalled again
        return False

    def _ended(self) -> None:
        """The zygote is gone and reaped: its pid may be another process's from now on, so
        it is never signalled or waited for again; the next run starts another."""
        global _ZYGOTE
        self.ended = True
        self.sock.close()
        disown(self.pid)
        if _ZYGOTE is self:
            _ZYGOTE = None

    def _ask(self, message: dict[str, Any], fds: tuple[int, ...] = (),
             within: float = math.inf, size: int = 8) -> bytes:
        """Send ``message`` and read the zygote's answer, ``size`` bytes; one that does not
        come ``within`` seconds ends the zygote (the next run starts another) and raises."""
        if self.ended:
            raise RuntimeError(f"the gpucase zygote (pid {self.pid}) was ended; the next run "
                               "starts another")
        data = pickle.dumps(message)  # the parent's own data, to a process of its own
        blob = len(data).to_bytes(8, "little") + data
        try:
            sent = socket.send_fds(self.sock, [blob], list(fds))
            self.sock.sendall(blob[sent:])
            answered = self._answers(within)
            reply = _receive_exactly(self.sock, size) if answered else b""
        except BaseException:
            # Cut short (Ctrl-C): what the zygote read, or will answer, is unknown, and the
            # next question would read this answer as its own. Ended; the next run starts
            # another.
            self.kill()
            raise
        if not answered:
            self.kill()
            raise RuntimeError(
                f"the gpucase zygote (pid {self.pid}) did not fork the run's child within "
                f"{within:g} s: it reads what the child would (the case's module, a small "
                "payload), and one of them blocked it (a case file replaced by a FIFO "
                "since collection?); it was ended, and the next run starts another")
        if len(reply) < size:
            raise RuntimeError(f"the gpucase zygote (pid {self.pid}) ended; each run's child "
                               "is forked by it. Use --gpu-start-method=spawn if it keeps ending")
        return reply

    def _answers(self, within: float) -> bool:
        """Whether the zygote's answer is there within ``within`` seconds."""
        if within == math.inf:
            return True  # read as it comes
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        end = time.monotonic() + within
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            if poller.poll(min(left, MAX_POLL_STEP) * 1000):
                return True

    def start(self, func: Callable[..., Any], args: tuple[Any, ...], fds: tuple[int, int, int],
              env: Mapping[str, str], fd_argument: bool = False,
              prepare: Prepare | None = None, within: float = math.inf) -> int:
        """Fork a child that calls ``func(*args)`` writing to ``fds`` (out, err, result);
        with ``fd_argument``, ``func(*args, result_fd)``; ``prepare`` entered around the fork
        (``entered``); ``prepared`` is then set: the seconds the zygote spent before the
        fork, no part of the run. A zygote that has not forked ``within`` seconds is ended."""
        job, prepared = pickle.dumps((func, args)), _pickled(prepare)  # before any is sent
        environ, path = dict(os.environ), list(sys.path)
        # The folder always: one the parent left and made again at the same path is a new one.
        changed: dict[str, Any] = {"cwd": os.getcwd()}
        if self._context.get("path") != path:
            changed["path"] = path
        held = self._context.get("environ")
        if held is None:  # the first run: the whole environment, in place of the zygote's
            changed["environ"] = (environ, None)
        elif environ != held:  # the variables set or changed, and those removed
            changed["environ"] = ({name: value for name, value in environ.items()
                                   if held.get(name) != value},
                                  [name for name in held if name not in environ])
        try:
            # The child's pid, then the microseconds the zygote spent before the fork.
            reply = self._ask({"op": "run", "job": job, "context": changed,
                               "expect": self.expected, "env": dict(env),
                               "fd_argument": fd_argument, "prepare": prepared}, fds, within,
                              size=16)
        except BaseException:
            self._context = {}  # what the zygote holds is unknown: all of it next time
            raise
        self._context, self.expected = {"environ": environ, "path": path}, None
        self.prepared = int.from_bytes(reply[8:], "little") / 1e6
        return int.from_bytes(reply[:8], "little", signed=True)

    def reap(self, pid: int) -> int:
        try:
            status = int.from_bytes(self._ask({"op": "reap", "pid": pid}), "little", signed=True)
        except (OSError, RuntimeError):
            # The zygote died (a case may kill it): its children were adopted by this
            # process, a subreaper, and are reaped here.
            return os.waitpid(pid, 0)[1]
        if status < 0:
            raise ChildProcessError(f"pid {pid} is not a child of the zygote")
        return status

    def kill(self) -> None:
        """End the zygote now (it no longer answers): killed and reaped; its children die
        with it (their death signal), the workers it forked too. Once only."""
        if self.ended:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._ended()

    def stop(self) -> None:
        """Close the zygote's socket (it exits on that, ending the orphans it adopted) and
        reap it. Once only."""
        if self.ended:
            return
        self.sock.close()
        end = time.monotonic() + REAP_GRACE
        while time.monotonic() < end:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                    time.sleep(0.005)
                    continue
            self._ended()  # exited and reaped (or not this process's)
            return
        self.kill()  # past REAP_GRACE


def _pickled(prepare: Prepare | None) -> bytes | None:
    """``prepare`` for the zygote; None where it cannot be pickled (a local function): the
    child then finds all of it itself."""
    if prepare is None:
        return None
    try:
        return pickle.dumps(prepare)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None


@contextlib.contextmanager
def entered(prepare: Prepare | bytes | None,
            absorb: type[BaseException] = Exception) -> Iterator[None]:
    """``prepare`` (``Prepare``, or pickled as a zygote gets it) entered around a fork, in the
    process that forks; what it finds is its child's alone. What it raises (``absorb``: in
    the pytest process, not a Ctrl-C) is left for the child to meet: the child finds all of
    it itself, and reports what fails there."""
    manager = None
    if prepare is not None:
        try:
            factory, args, kwargs = (pickle.loads(prepare) if isinstance(prepare, bytes)
                                     else prepare)  # the parent's own data
            manager = factory(*args, **kwargs)
            manager.__enter__()
        except absorb:
            manager = None
    try:
        yield
    finally:
        if manager is not None:
            with contextlib.suppress(absorb):
                manager.__exit__(None, None, None)


def _receive_exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


# --- in the zygote ---------------------------------------------------------------------------

def zygote_main() -> None:  # pragma: no cover - runs in a spawned zygote
    """Entry point of a zygote started as a fresh interpreter (CUDA was initialized)."""
    for name in PRELOAD:
        importlib.import_module(name)
    _zygote_loop(socket.socket(fileno=_ZYGOTE_FD), int(sys.argv[1]))


def _zygote_loop(sock: socket.socket, parent: int) -> None:  # pragma: no cover - the zygote
    """Serve the parent until it closes the socket: fork children, reap them when asked.

    The zygote is the subreaper of every child it forks: an orphan of a run whose child
    died is adopted here, not by init. Each reap, and the zygote's own end, kills and reaps
    every child it did not fork itself (``_end_adopted``): the zygote runs no case code, so
    any such child is a run's.
    """
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(0)
        os.setpgid(0, 0)  # Ctrl-C goes to pytest's group, not here; pytest ends us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Held for good: each child inherits it blocked until its handler is in place.
        signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})
        forget_parent()
        adopt_orphans()
        name_process("zygote")
        for target in PRIME:
            module, _, name = target.partition(":")
            getattr(importlib.import_module(module), name)()
        gc.collect()
        gc.freeze()
        me = os.getpid()
        forked: set[int] = set()
        # The last run's prepare, left at the next message (the last child's reap, mostly):
        # what the zygote drops is a write, and a write while a child lives copies a page.
        held = contextlib.ExitStack()
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            held.close()
            if len(data) < 8:
                _end_adopted(forked)
                os._exit(0)
            size = int.from_bytes(data[:8], "little")
            message = pickle.loads(_receive_exactly(sock, size + 8, data)[8:])
            spent = b""
            if message["op"] == "run":
                _take_context(message["context"])
                if message.get("expect") is not None:
                    expect_forks(message["expect"])
                begun = time.monotonic()
                before_fork()
                # Whatever the prepare raises is the child's to meet: the zygote serves on.
                held.enter_context(entered(message.get("prepare"), absorb=BaseException))
                spent = round((time.monotonic() - begun) * 1e6).to_bytes(8, "little")
                pid = os.fork()
                if pid == 0:
                    _zygote_child(sock, message, fds, me)
                forked.add(pid)
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
                forked.discard(message["pid"])
                _end_adopted(forked)
            sock.sendall(reply.to_bytes(8, "little", signed=True) + spent)
    except BaseException:
        os._exit(0)


def _take_context(changed: Mapping[str, Any]) -> None:  # pragma: no cover - the zygote
    """Hold the parent's environment, import path and folder where they changed since the
    last run: each child the zygote forks inherits them, as a fork of the parent would.
    Never raises (the zygote would end): a variable the C library refuses (an empty name,
    inherited from an odd parent) is left as it is."""
    if "environ" in changed:
        values, removed = changed["environ"]
        if removed is None:  # the whole environment
            removed = [name for name in os.environ if name not in values]
        for name in removed:
            with contextlib.suppress(ValueError, OSError):
                os.environ.pop(name, None)
        for name, value in values.items():
            with contextlib.suppress(ValueError, OSError):
                os.environ[name] = value
    if "path" in changed:
        sys.path[:] = changed["path"]
    if "cwd" in changed:
        with contextlib.suppress(OSError):
            os.chdir(changed["cwd"])


def _end_adopted(forked: set[int]) -> None:  # pragma: no cover - the zygote
    """Kill and reap the zygote's children that it did not fork: orphans it adopted from
    its runs. Never a wait for any child: the parent asks for its runs' statuses."""
    me = os.getpid()
    adopted = [pid for pid in _children(me) or () if pid not in forked]
    if not adopted:
        return
    for pid in adopted:
        _kill_tree(pid, None, include_root=True)  # its group and descendants: the run's
    deadline = time.monotonic() + REAP_GRACE
    while adopted and time.monotonic() < deadline:
        for pid in adopted:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        # The kills' zombies, and their children adopted as they died.
        adopted = [pid for pid in _children(me) or () if pid not in forked]
        if adopted:
            time.sleep(0.002)


def _zygote_child(sock: socket.socket, message: dict[str, Any], fds: list[int],
                  zygote: int) -> None:  # pragma: no cover - a child of the zygote
    try:
        sock.close()
        out_w, err_w, res_w = fds
    except BaseException:
        os._exit(70)
    job = message["job"]

    def call() -> Any:
        func, args = pickle.loads(job)
        if message.get("fd_argument"):  # a worker: its socket came as the result fd
            return func(*args, res_w)
        return func(*args)

    _forked_child(out_w, err_w, res_w, (), message["env"], False, zygote, call, (),
                  name="worker" if message.get("fd_argument") else "run")



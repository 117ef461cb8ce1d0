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
dataclasses rebuilt only from those registered with ``wire.result_type``, each field
checked against its annotation. Before it, the child may write short notes
(``note``) of what it is doing, which the parent reads even from a child it
killed: a timeout says what it interrupted. The parent reads at most ``RESULT_LIMIT``
bytes of it (a bigger result kills the child and is a failure), and every
string in it is cut to its head and tail (``TEXT_HEAD``/``TEXT_TAIL``) before
it reaches a report. A malformed result is a failure that names the problem.

The timeout lives in the parent: a hang inside a GIL-released CUDA call cannot
be interrupted by a Python signal handler in the child. On expiry the parent
asks the child's ``faulthandler`` for every thread's stack (SIGUSR1), waits a
moment for it, then kills the run's whole process tree. A child starts with
SIGUSR1 blocked and unblocks it once the handler is in place: a child whose
start is not done at the deadline (blocked, no handler, in /proc/PID/status)
is killed at once as ``starting`` instead of dying of the signal's default
action, and a request that meets the block is answered once it is lifted.
Frames of pytest, pluggy and gpucase itself are hidden from the dump (the
stack of a forked child still holds the pytest process's frames below the
case's own).

No process of a run outlives it. Every process that starts or supervises a child is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): the child itself, for its own tree while it
lives; the pytest process (each xdist worker, and the controller) and the zygote, which run
no case code, for the orphans of a child that died. A descendant that leaves the group
(``setsid``) and outlives its parent is adopted by one of them, never by init. A run's
processes are found in /proc (``proctree``): the child's process group, its descendants by
parent pid, the orphans its parent adopted since the run began (told from the user's own
processes by the name every gpucase child carries and its forks inherit, ``gpucase-run``,
by the process group, and last by a per-run marker ``GPUCASE_RUN=<token>`` in their
environment, which an ``exec``'d descendant keeps). The kill signals first and inspects
after: one SIGSTOP to the child and one to its group before anything is read, then rounds
of SIGSTOP to what ``/proc/PID/stat`` shows (a read that never waits on the process, unlike
``/proc/PID/environ``, which waits while the process is inside ``fork()``), then SIGKILL to
all, each through a pidfd checked against its start time, so that a reused pid is never
hit. A fork bomb in the group stops at the first signal. A child that returns also kills
what it started, while it is still everyone's ancestor. The zygote ends the orphans it
adopted each time it reaps a child, and the pytest process those it adopted at the end of
the session (``shutdown``): under xdist the controller sweeps what a SIGKILLed worker's
helpers left. A forked child holds none of its parent's pipes and sockets but its
standard streams (they point at /dev/null in it): the zygote's socket, an xdist worker's
channel to its controller.

The direct child dies with the pytest process even on SIGKILL (``PR_SET_PDEATHSIG``, set in
the forked and in the spawned child, in the zygote and in each worker; it fires when the
*thread* that started the child ends, which ``run_in_child`` outlives as it waits for the
child). The child's own descendants are then adopted by the nearest living subreaper: under
xdist the controller, which sweeps them; a pytest process SIGKILLed without one leaves them
to init (best effort only: they keep the process group, the name and the marker).

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

The modules, by the process they run in: ``run_in_child`` here and ``supervise`` in the
parent; ``child`` in the child; ``wire`` (the result pipe's format) and ``clipping`` (text
kept head and tail) on both sides of the pipe; ``proctree`` (the run's processes in
/proc) in the parent, and in the child for what it started; ``zygote`` and ``workers`` in
the parent and in the zygote or worker process they start; ``state`` in a worker, which
checks after each call that it is still as a fresh child; ``result`` holds the values the
parent returns.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import pickle
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from pytest_gpucase.run.isolation.child import _RESULT_FD, fork_child, held_dumps, note
from pytest_gpucase.run.isolation.clipping import (
    CAPTURE_HEAD,
    CAPTURE_TAIL,
    TEXT_HEAD,
    TEXT_TAIL,
    clip,
)
from pytest_gpucase.run.isolation import hugepages
from pytest_gpucase.run.isolation.hugepages import before_fork, collapsed
from pytest_gpucase.run.isolation.proctree import (
    MARKER_ENV,
    REAP_GRACE,
    adopt_orphans,
    own,
    sweep_adopted,
)
from pytest_gpucase.run.isolation.result import (
    ChildResult,
    ChildWarning,
    Prepare,
    StartMethod,
    gib,
    signal_name,
)
from pytest_gpucase.run.isolation.supervise import (
    MAX_PENDING,
    MEMORY_SAMPLE,
    QUIET_START,
    RESULT_LIMIT,
    RunInterrupted,
    _Interruptible,
    wait_quietly,
    _Run,
    _Supervisor,
    reap_pending,
)
from pytest_gpucase.run.isolation.wire import decode, encode
from pytest_gpucase.run.isolation.workers import WorkerPool, close_pools
from pytest_gpucase.run.isolation.zygote import (
    ANSWER_GRACE,
    default_start_method,
    entered,
    expect_zygote_forks,
    forkserver,
    forkserver_available,
    stop_forkserver,
    zygote_running,
)

__all__ = [
    "CAPTURE_HEAD",
    "CAPTURE_TAIL",
    "MAX_PENDING",
    "RESULT_LIMIT",
    "TEXT_HEAD",
    "TEXT_TAIL",
    "ChildResult",
    "ChildWarning",
    "RunInterrupted",
    "StartMethod",
    "WorkerPool",
    "adopt_orphans",
    "clip",
    "decode",
    "default_start_method",
    "encode",
    "expect_forks",
    "forkserver",
    "forkserver_available",
    "gib",
    "note",
    "reap_pending",
    "run_in_child",
    "shutdown",
    "signal_name",
    "zygote_running",
]


def expect_forks(count: int) -> None:
    """This process's runs will fork about ``count`` more children (the session's case items):
    told to whichever process forks them, this one and the zygote (what huge pages are worth
    there: ``hugepages``)."""
    hugepages.expect_forks(count)
    expect_zygote_forks(count)


def run_in_child(
    func: Callable[..., Any],
    *args: Any,
    timeout: float,
    env: Mapping[str, str] | None = None,
    start_method: StartMethod = "fork",
    memory_limit: int | None = None,
    marks: Mapping[str, str] | None = None,
    prepare: Prepare | None = None,
) -> ChildResult:
    """Call ``func(*args)`` in a fresh child process and report what happened to it.

    ``timeout`` is in seconds (any non-negative number, ``inf`` included);
    ``memory_limit`` in bytes of resident memory of the child's whole tree; ``marks``: lines
    of output that a clipped capture names when it omits where one begins
    (``clipping._Capture``). ``prepare``: a context manager's factory and its arguments
    (``Prepare``), entered around the fork in the process that forks the child (this one,
    or the zygote, which gets it pickled), so that the child inherits what it finds; never
    for a spawned child.
    """
    if not timeout >= 0:  # NaN fails this too
        raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
    if memory_limit is not None and memory_limit <= 0:
        raise ValueError(f"memory_limit must be a number of bytes > 0, not {memory_limit!r}")
    token = secrets.token_hex(16)
    child_env = {**(env or {}), MARKER_ENV: token}
    out_r = out_w = err_r = err_w = res_r = res_w = -1
    job_file = None
    # Started (once) before the clock: the zygote's preloading is no part of a run's time.
    zygote = forkserver() if start_method == "forkserver" else None
    adopt_orphans()  # the orphans of a child that dies come here, not to init
    with contextlib.ExitStack() as held:
        if start_method == "fork":
            # Entered before the clock, and left once the child is done: what this process
            # drops then is a write, and a write while a child lives copies a page (and
            # splits a huge one for every later fork).
            held.enter_context(entered(prepare))
        start = time.monotonic()
        try:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            res_r, res_w = os.pipe()
            reap_pending(block=False)
            if start_method == "fork":  # huge pages for this process's forks: not the run's time
                start += before_fork()
            with _Interruptible() as guard:
                raised = None  # what a signal handler raised before the child was supervised
                if start_method == "fork":
                    pid = fork_child(out_w, err_w, res_w, (out_r, err_r, res_r), child_env,
                                     func, args)
                    if collapsed():  # no huge page to split: nothing to wait for
                        raised = wait_quietly(pid, min(QUIET_START, timeout, math.inf
                                                       if memory_limit is None else MEMORY_SAMPLE))
                elif zygote is not None:  # forkserver: its children are supervised by pid
                    pid = zygote.start(func, args, (out_w, err_w, res_w), child_env,
                                       prepare=prepare, within=timeout + ANSWER_GRACE)
                    start += zygote.prepared  # its huge pages and prepare: not the run's time
                else:
                    job_file = _write_job(func, args)
                    pid = _spawn(job_file, out_w, err_w, res_w, child_env)
                    own(pid)
                with contextlib.suppress(OSError):  # the child does it too; the first one wins
                    os.setpgid(pid, pid)
                for fd in (out_w, err_w, res_w):
                    os.close(fd)
                out_w = err_w = res_w = -1
                run = _Run(pid, token, memory_limit, zygote=zygote)
                return _Supervisor(run, out_r, err_r, res_r, timeout, start, start_method,
                                   marks).watch(guard, raised)
        finally:
            for fd in (out_r, err_r, res_r, out_w, err_w, res_w):
                if fd >= 0:
                    os.close(fd)
            if job_file is not None:
                os.unlink(job_file)


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
    entry = "from pytest_gpucase.run.isolation.child import spawned_main; spawned_main()"
    argv = [sys.executable, "-c", entry, job_file, str(os.getpid())]
    with held_dumps():  # the new interpreter keeps the mask until its handler is in place
        return os.posix_spawn(sys.executable, argv, child_env, file_actions=actions,
                              setpgroup=0)


def shutdown() -> None:
    """End of the session: end the workers, reap every child still pending, end the zygote,
    and kill what this process adopted from its runs (or, under xdist, from a worker that
    died): no process of a run outlives the session."""
    close_pools()
    reap_pending()
    stop_forkserver()
    sweep_adopted(time.monotonic() + REAP_GRACE)


atexit.register(shutdown)

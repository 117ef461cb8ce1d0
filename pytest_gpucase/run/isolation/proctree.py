"""The process tree of a run, read from /proc, and how it is ended.

Runs in the parent, which finds every process of a run, samples their memory and kills them,
adopts the orphans of its runs (a child subreaper, ``adopt_orphans``) and sweeps those left
at the end of the session (``sweep_adopted``), and counts its own threads before a fork
(``thread_count``); in the zygote, which adopts and ends the orphans of the children it
forked; and in the child, which ends what it started before it returns (``_children``,
``_kill_tree``).

How a run's processes are found, without trusting anything a case can change cheaply:

- the run's process group (the child's own; a fork bomb stays in it unless it leaves);
- the descendants of the child, by parent pid: the child is a subreaper, so while it
  lives every orphan of its tree is its own, and a stopped child keeps them;
- the orphans of a child that died: its parent (this process, or the zygote) is a
  subreaper too, so they are adopted by it, not by init. This process tells them from
  the children of the user's own code by the start time (after the run began), the
  process name every gpucase child sets and its forks inherit (``TAG``), the process
  group, and, read last, the run's marker ``MARKER_ENV`` in their environment;
- where no subreaper can be had (no ``prctl``), every process of this user started
  since the run began that carries the marker.

Reads of ``/proc/PID/stat`` never wait on the process; a read of ``/proc/PID/environ``
waits while that process is inside ``fork()`` (it takes the process's memory lock). So
the kill signals first and inspects after: it stops the run's group and the child with
one signal each, stops what it finds by ``stat`` alone, and reads an environment only of
the few candidates nothing else placed, when nothing of the run forks any more.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = ["MARKER_ENV", "MAX_POLL_STEP", "REAP_GRACE", "TAG", "adopt_orphans", "sweep_adopted",
           "thread_count"]

MARKER_ENV = "GPUCASE_RUN"  # =<a token of the run> in the environment of all its processes
REAP_GRACE = 10.0  # seconds a child (or the zygote) gets to finish exiting before it is killed
MAX_POLL_STEP = 3600.0  # seconds: poll() takes milliseconds in a C int
# The name (/proc/PID/comm) of every process gpucase starts; forks without exec inherit it.
TAG = b"gpucase-"

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_LIBC: Any = None
_ADOPTING: dict[int, bool] = {}  # pid -> whether that process is a subreaper (not inherited)
_KNOWN: set[int] = set()  # children this process started and has not reaped yet
_KILLED: dict[int, int] = {}  # pid -> start time, of processes killed and maybe not reaped


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_PRCTL: Any = None  # prctl(2) with its argument types, made once in the parent

if sys.platform.startswith("linux"):
    # Looked up once, at import in the parent: a child that opens the C library again, or
    # converts the arguments of an untyped function, pays for it in every run (the first
    # call of a child touched 75 pages, 25 so).
    with contextlib.suppress(OSError, AttributeError):
        _PRCTL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                  ctypes.c_ulong, ctypes.c_ulong, use_errno=True)(
            ("prctl", _libc()))


def _prctl(option: int, value: int | bytes) -> bool:
    """Linux's prctl(2), or False where there is none."""
    if _PRCTL is None:
        return False
    try:
        return int(_PRCTL(option, value, 0, 0, 0)) == 0
    except (OSError, ctypes.ArgumentError):
        return False


def name_process(name: str) -> None:
    """Name this process (its thread) ``TAG`` + ``name``: what ``ps`` shows, and what its forks
    inherit, so that a fork that outlived its parent is known as gpucase's."""
    _prctl(_PR_SET_NAME, (TAG + name.encode())[:15])


def adopt_orphans() -> bool:
    """Make this process a child subreaper: an orphan of any process below it is reparented
    to it, not to init, so that no descendant of a run escapes by outliving its parent.
    Once per process (the setting is not inherited by a fork); False where Linux has none."""
    me = os.getpid()
    if me not in _ADOPTING:
        _ADOPTING[me] = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return _ADOPTING[me]


def _adopting() -> bool:
    return _ADOPTING.get(os.getpid(), False)


def own(pid: int) -> None:
    """``pid`` is a child this process started (a run's child, a worker, the zygote): never
    taken for an orphan it adopted."""
    _KNOWN.add(pid)


def disown(pid: int) -> None:
    """``pid`` was reaped."""
    _KNOWN.discard(pid)


def forget_parent() -> None:
    """In a new child: what the parent knew of its own children is not this process's."""
    _KNOWN.clear()
    _KILLED.clear()


def thread_count() -> int:
    """How many OS threads this process has (1 when only the main thread runs)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs (macOS): Python's own threads are the best we know
        return threading.active_count()


def now_ticks() -> int:
    """The clock /proc's start times count in (clock ticks since boot), a tick early."""
    try:
        return max(0, int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")) - 1)
    except (AttributeError, OSError, ValueError):
        return 0


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # gone, or not ours to read
        return None


def _held(pid: int, signum: int) -> bool:
    """Whether ``pid``'s main thread has ``signum`` blocked with no handler for it
    (/proc/PID/status): a child of ours before its start is done. False when unknown."""
    raw = _read(f"/proc/{pid}/status")
    if raw is None:
        return False
    masks = {}
    for line in raw.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"SigBlk", b"SigCgt"):
            try:
                masks[key] = int(value, 16) >> (signum - 1) & 1
            except ValueError:
                return False
    return masks.get(b"SigBlk") == 1 and masks.get(b"SigCgt") == 0


class _Proc(NamedTuple):
    ppid: int
    state: bytes
    pgrp: int
    session: int
    start: int   # clock ticks since boot
    name: bytes  # /proc/PID/comm: what the process is called (TAG for gpucase's)


def _stat(pid: int) -> _Proc | None:
    """What /proc/PID/stat says of a process (a read that never waits on the process)."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    close = raw.rfind(b")")
    fields = raw[close + 2:].split()  # the name in parentheses may hold anything
    try:
        return _Proc(int(fields[1]), fields[0], int(fields[2]), int(fields[3]), int(fields[19]),
                     raw[raw.find(b"(") + 1:close])
    except (IndexError, ValueError):
        return None


def _living(proc: _Proc | None) -> bool:
    return proc is not None and proc.state not in (b"Z", b"X")


def _scan() -> dict[int, _Proc]:
    """Every process of the system, by ``stat`` alone; {} without procfs."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for name in names:
        if name.isdigit():
            proc = _stat(int(name))
            if proc is not None:
                found[int(name)] = proc
    return found


def _marked(pid: int, needle: bytes) -> bool:
    data = _read(f"/proc/{pid}/environ")
    return data is not None and needle in data


def _needle(token: str | None) -> bytes:
    return f"{MARKER_ENV}={token}\0".encode() if token else f"{MARKER_ENV}=".encode()


def _tree(root: int, token: str | None, since: int = 0, *, group: bool = True,
          adopter: int | None = None, procs: dict[int, _Proc] | None = None,
          known: Iterable[int] = (), markers: bool = True) -> set[int]:
    """The living processes of a run besides ``root``: its process group (``group``), its
    descendants, the orphans ``adopter`` adopted from it, and (without a subreaper) those
    with its marker; each with the descendants of its own.

    Only processes started at or after ``since`` (clock ticks, like /proc's start times) can
    be adopted orphans or marked. ``known``: processes found to be the run's before (their
    environment is not read again).
    """
    if procs is None:
        procs = _scan()
    me = os.getpid()
    mine = procs.get(me)
    found: set[int] = {pid for pid in known if _living(procs.get(pid))}
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        if not _living(proc) or pid in (me, root):
            continue
        children.setdefault(proc.ppid, []).append(pid)
        if pid in found:
            continue
        in_group = group and proc.pgrp == root
        if in_group or (adopter is not None and proc.ppid == adopter and pid not in _KNOWN
                        and proc.start >= since
                        and (adopter != me or _stranger_is_ours(proc, mine, token, pid))):
            found.add(pid)
    if markers and token and not _adopting():
        found |= _marked_since(procs, token, since, exclude=(me, root))
    found.update(children.get(root, ()))
    found |= _descendants(found, children)
    found.discard(root)
    found.discard(me)
    return found


def _marked_since(procs: dict[int, _Proc], token: str, since: int,
                  exclude: tuple[int, ...]) -> set[int]:
    """Without a subreaper an orphan may be anywhere: the living processes of this user,
    started since ``since``, whose environment holds the run's marker."""
    needle, uid = _needle(token), os.getuid()
    found = set()
    for pid, proc in procs.items():
        if pid in exclude or not _living(proc) or proc.start < since:
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid and _marked(pid, needle):
                found.add(pid)
    return found


def _descendants(roots: Iterable[int], children: dict[int, list[int]]) -> set[int]:
    """Every descendant of ``roots`` (the roots themselves included)."""
    found = set(roots)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _stranger_is_ours(proc: _Proc, mine: _Proc | None, token: str | None, pid: int) -> bool:
    """Whether a child this process adopted, started during the run, is the run's: named
    as gpucase's, or outside this process's group (the user's own subprocesses stay in
    it), or (read last, and only for these) carrying the marker."""
    if proc.name.startswith(TAG):
        return True
    if mine is None or proc.pgrp != mine.pgrp or proc.session != mine.session:
        return True
    return _marked(pid, _needle(token))


def _signal(pid: int, start: int, signum: int) -> None:
    """Signal ``pid`` if it is still the process that started at ``start`` (a pidfd pins it
    first, so that a reused pid is never hit)."""
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    try:
        proc = _stat(pid)
        if proc is None or proc.start != start:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _kill_tree(root: int, token: str | None, *, include_root: bool, since: int = 0,
               adopter: int | None = None) -> None:
    """Stop the run's processes, signal first and inspect after, then kill them all.

    With ``include_root``, the root and its whole process group are stopped by one signal
    each before anything is read (a fork bomb in the group stops at once, and nothing
    reads the environment of a process inside ``fork()``); then, round after round, what
    ``stat`` shows to be the run's is stopped, until no new process appears; then all are
    killed. ``root`` must not be reaped yet (its pid is then still its own) when
    ``include_root``. ``adopter``: the subreaper that adopts the orphans of a dead root
    (this process for a forked child, the zygote for its children).
    """
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGSTOP)  # no more forks, no more reaping, no more orphans
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGSTOP)  # the group at once: a bomb in it stops here
    stopped: dict[int, int] = {}
    for _ in range(100):
        procs = _scan()
        members = _tree(root, token, since, group=include_root, adopter=adopter, procs=procs,
                        known=stopped.keys())
        new = {pid: procs[pid].start for pid in members if pid not in stopped and pid in procs}
        if not new:
            break
        for pid, start in new.items():
            _signal(pid, start, signal.SIGSTOP)
        stopped.update(new)
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)  # also on systems without /proc
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root, signal.SIGKILL)  # the child may have left its group
    for pid, start in stopped.items():
        _signal(pid, start, signal.SIGKILL)
    _KILLED.update(stopped)  # those that become this process's children are reaped here


def reap_killed(deadline: float = 0.0) -> None:
    """Reap the processes ``_kill_tree`` killed that this process adopted (they would stay
    zombies otherwise), until ``deadline`` (``time.monotonic``) for those not dead yet."""
    me = os.getpid()
    while _KILLED:
        for pid, start in list(_KILLED.items()):
            proc = _stat(pid)
            if proc is None or proc.start != start:
                del _KILLED[pid]  # gone, reaped by its parent
            elif proc.ppid == me and proc.state in (b"Z", b"X"):
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)  # a zombie of ours: its pid stays ours till now
                del _KILLED[pid]
        if not _KILLED or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def sweep_adopted(deadline: float = 0.0) -> int:
    """Kill the orphans of gpucase's processes that this process adopted and that still live
    (the end of the session), and reap them; how many were killed.

    A child of this process that it did not start is one of its runs' (or, under xdist, of
    a SIGKILLed worker's helpers and runs) when it carries gpucase's name or, read after it
    is stopped, the run marker in its environment; any other (the user's own) is continued.
    """
    if not _adopting():
        return 0
    me = os.getpid()
    killed = 0
    for pid, proc in _scan().items():
        if proc.ppid != me or pid in _KNOWN:
            continue
        if not _living(proc):
            if proc.name.startswith(TAG):
                _KILLED[pid] = proc.start  # a zombie of ours: reaped below
            continue
        ours = proc.name.startswith(TAG)
        if not ours:
            stopped_here = proc.state != b"T"
            if stopped_here:
                _signal(pid, proc.start, signal.SIGSTOP)  # read after signalling
            ours = _marked(pid, _needle(None))
            if not ours and stopped_here:
                _signal(pid, proc.start, signal.SIGCONT)
        if ours:
            _KILLED[pid] = proc.start
            _kill_tree(pid, None, include_root=True, since=proc.start)
            killed += 1
    reap_killed(deadline)
    return killed


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

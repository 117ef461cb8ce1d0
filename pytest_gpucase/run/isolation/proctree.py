"""The process tree of a run, read from /proc, and how it is ended.

Runs in the parent, which finds every process of a run (its descendants, and those carrying
the run's marker ``MARKER_ENV``), samples their memory and kills them, and counts its own
threads before a fork (``thread_count``); and in the child, which ends what it started
before it returns (``_children``, ``_kill_tree``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["MARKER_ENV", "REAP_GRACE", "thread_count"]

MARKER_ENV = "GPUCASE_RUN"  # =<a token of the run> in the environment of all its processes
REAP_GRACE = 10.0  # seconds a child (or the zygote) gets to finish exiting before it is killed


def thread_count() -> int:
    """How many OS threads this process has (1 when only the main thread runs)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs (macOS): Python's own threads are the best we know
        return threading.active_count()


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

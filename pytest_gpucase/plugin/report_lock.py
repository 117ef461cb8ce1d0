"""One writer per JSON report: a lock beside the report, held by the session that writes it.

Two sessions given the same ``--gpu-cases-report`` (one ini key, two CI jobs on one runner)
both rewrote the file and both exited 0; the one that wrote last erased the other's
results. The writer now holds ``fcntl.flock`` on ``.<report>.lock`` in the report's folder
for the whole session (the kernel releases it when the process dies, however it dies, so
a killed session never leaves a stale lock), and a second session stops at its start with
a usage error naming the holder. The lock file is removed by its holder on the way out; a
session that locked a file someone removed in between tries again, so that two sessions
never each hold a lock of their own.

Where ``flock`` is unavailable (Windows) or refused by the file system, the session goes on
unlocked; ``GpuCaseSession.write_report`` still refuses to overwrite a report another
writer changed since its own last write.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pytest_gpucase.base.errors import display
from pytest_gpucase.base.text import one_line

__all__ = ["ReportLocked", "lock_path", "lock_report", "unlock_report"]

_TRIES = 5


class ReportLocked(Exception):
    """Another session writes this report; the message says which and what to do."""


def lock_path(report: Path) -> Path:
    """The lock file of ``report``: hidden, beside it (``.report.json.lock``)."""
    return report.with_name(f".{report.name}.lock")


def lock_report(report: Path) -> int | None:
    """Take the lock of ``report`` and return its descriptor (None where there is no
    ``flock``, or the file system refuses one); ``ReportLocked`` when another holds it."""
    try:
        import fcntl
    except ImportError:
        return None
    path = lock_path(report)
    for _ in range(_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            return None   # a link or a folder in its place: writes still check for another
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ReportLocked(
                f"--gpu-cases-report {display(report)}: another pytest session is writing this "
                f"report ({holder}); two sessions on one path would erase each other's results. "
                "Give each run its own path (--gpu-cases-report report-$JOB.json), or wait for "
                "that one to finish") from None
        except OSError:
            os.close(fd)
            return None   # no locks on this file system: writes still check for another writer
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except OSError:
            same = False
        if not same:   # its holder removed it between our open and our lock: lock the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {_host()}\n".encode())
        return fd
    raise ReportLocked(f"--gpu-cases-report {display(report)}: its lock file {display(path)} "
                       "keeps being replaced; another session is starting and stopping on it")


def unlock_report(report: Path, fd: int) -> None:
    """Remove the lock file (still holding it, so that no one locks a file about to go),
    then release it."""
    with contextlib.suppress(OSError):
        os.unlink(lock_path(report))
    os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (a line of a file anyone could write)."""
    try:
        said = os.pread(fd, 200, 0).decode("utf-8", "replace")
    except OSError:
        said = ""
    return one_line(said, 120) or "it did not say which"


def _host() -> str:
    import socket

    try:
        return socket.gethostname() or "this host"
    except OSError:
        return "this host"

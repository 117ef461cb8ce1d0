"""Breaking the copy-on-write sharing of scattered pages in one call, before they are written
(``process_madvise(MADV_POPULATE_WRITE)``, Linux 6.13+): what ``bench_pages.py`` times in a
small test and tries in a real case item's child. No torch here: a session's conftest
imports it."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

MADV_POPULATE_WRITE = 23
PIDFD_OPEN, PROCESS_MADVISE = 434, 440  # syscall numbers, the same on every architecture
IOV_MAX = 1024  # ranges one process_madvise call takes
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class Range(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]  # struct iovec


def page_ranges(pages: Iterable[int]) -> ctypes.Array[Range]:
    """The pages numbered ``pages`` (address // PAGE), neighbours joined, as ranges."""
    runs: list[list[int]] = []
    for page in sorted(pages):
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
    return (Range * len(runs))(*(Range(page * PAGE, count * PAGE) for page, count in runs))


def break_sharing(ranges: ctypes.Array[Range]) -> bool:
    """Make this process's copy of every page in ``ranges`` its own now, as writing each
    would; False where the kernel refuses (before 6.13, or no pidfds)."""
    pidfd = _libc.syscall(PIDFD_OPEN, os.getpid(), 0)
    if pidfd < 0:
        return False
    try:
        for first in range(0, len(ranges), IOV_MAX):
            chunk = ranges[first:first + IOV_MAX]
            done = _libc.syscall(PROCESS_MADVISE, pidfd,
                                 ctypes.byref(ranges, first * ctypes.sizeof(Range)),
                                 len(chunk), MADV_POPULATE_WRITE, 0)
            if done != sum(item.length for item in chunk):
                return False
        return True
    finally:
        os.close(pidfd)

"""Cheaper forks: a process that forks a child per run backs its used memory with huge pages.

A fork copies one page-table entry for each 4 KiB page of the parent's private memory, and
the child's exit frees them again: in a process that imported torch (about 150 MB of heap and
anonymous maps), 2.5 ms of the parent's CPU and 3.8 ms of the child's for a child that does
nothing, most of what a fresh child per item costs. Memory mapped as 2 MiB pages is one entry
per 2 MiB, and a write the child makes still copies 4 KiB of it, not 2 MiB: that bare fork then
costs 0.7 ms and 1.6 ms, and a trivial case item inside pytest about a fifth less CPU
(``benchmarks/bench_isolation.py --pytest``: its rows without huge pages and with every dense
chunk collapsed, and ``benchmarks/README.md``).

So ``before_fork``, which every fork of a run's child calls in the process that forks it,
asks Linux (``madvise(MADV_COLLAPSE)``, Linux 6.1) to back that process's densely used private
memory (its heap and anonymous maps) with huge pages, 2 MiB at a time, when it pays: before its
FIRST_PASS'th fork and again each time the count doubles (memory used since, chunks an earlier
pass left), it collapses chunks while their measured mean cost stays under what a chunk saves
(``SAVED_PER_FORK`` a fork) over half the forks to come (``PAYBACK``). The forks to come are
those the caller expects (``expect_forks``: the pytest process, its session's case items) and
at least as many as were made. A machine on which a collapse is slow (a virtual machine's first
touch of memory it never used: 6 ms a chunk on this one, 0.55 ms once touched) collapses little
or nothing, and a pass is skipped while the last one's chunks (before any, ``PRIOR_COST``) cost
more than one would save. What a pass takes is no part of the run whose fork it precedes:
its clock starts after it (a pass on a big heap can take long, and the run's timeout and
duration are its own).

A program reads and writes the same bytes at the same addresses; what it can see change is its
timing and its memory (``/proc``, ``ps``, the memory limit of a run, which counts the pages a
forked child shares). A chunk is collapsed when at least DENSE of its 512 pages are in memory;
its untouched pages are filled (at most 1/32 of it). A page still shared with a fork that lives
on is copied into the huge page and the fork keeps its own: with the default start method the
zygote, a fork made at configure, shares most of the torch heap, so a collapse grows the
session's memory by about what it collapses (70-120 MB of a torch session). A pass therefore
grows it by at most a sixteenth of the memory the machine has available (``MemAvailable``), and
none where that cannot be read. Nothing is done where there is no MADV_COLLAPSE (Linux before
6.1, transparent huge pages set to ``never``, pages other than 4 KiB, another system), once
CUDA is initialized in the process (nothing forks there), or with ``GPUCASE_HUGEPAGES=0``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import time
from typing import Any

from pytest_gpucase.base.torch_import import cuda_initialized
from pytest_gpucase.run.isolation.proctree import _libc

__all__ = ["HUGEPAGES_ENV", "before_fork", "collapsed", "expect_forks"]

HUGEPAGES_ENV = "GPUCASE_HUGEPAGES"  # =0: never collapse
FIRST_PASS = 2  # the fork before which a process may first collapse; then at every doubling
# What one collapsed chunk saves per fork, parent and child together: 38-42 us on this machine
# (150 trivial items, 62 chunks of the pytest process collapsed at its second fork: 2.4 ms an
# item; a bare fork of a process holding 104: 4.4 ms). Taken a little under, so that a
# collapse that would barely pay is not made.
SAVED_PER_FORK = 30e-6
# A chunk must pay for itself within this share of the forks to come, which are a guess.
PAYBACK = 0.5
# What a chunk is taken to cost before one was measured: the least seen here (memory the
# machine had touched before). A pass worth less is not tried: no chunk is spent to learn
# that a session of a few items gains nothing.
PRIOR_COST = 0.5e-3
DENSE = 496  # of the 512 pages of a chunk in memory: collapsed (it grows by at most 16)

_HUGE = 1 << 21
_PAGES = _HUGE // 4096
_MADV_COLLAPSE = 25


class _State:
    """This process's: how often it forked and will, the next pass, what collapsing cost."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.forks = 0
        self.expected = 0  # forks still to come, as the caller expects them (expect_forks)
        self.next_pass = FIRST_PASS
        self.cost = PRIOR_COST  # seconds a chunk cost in the last pass that made any (mean)
        self.done: set[int] = set()  # chunks collapsed, or that cannot be
        self.made = 0  # chunks collapsed
        self.off = not _supported()


_STATE: _State | None = None
_CALLS: Any = None  # madvise, made on first use
# /proc/self/pagemap: 8 bytes a page, whose top byte holds "in memory" (bit 63) and "mapped by
# this process alone" (bit 56). A page shared with a fork that still lives (the zygote, a
# worker) is copied by a collapse and then held twice: counted as what the collapse adds.
_PRESENT = bytes(b >> 7 for b in range(256))
_OWN_PAGE = bytes(int(b & 0x81 == 0x81) for b in range(256))
AVAILABLE_SHARE = 16  # a pass grows this process's memory by at most MemAvailable / this


def _supported() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get(HUGEPAGES_ENV, "1") == "0":
        return False
    if os.sysconf("SC_PAGE_SIZE") != 4096:  # 16 or 64 KiB pages: a huge page is not 2 MiB
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", "rb") as f:
            return b"[never]" not in f.read()
    except OSError:
        return False


def _calls() -> Any:
    global _CALLS
    if _CALLS is None:
        madvise = _libc().madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        _CALLS = madvise
    return _CALLS


def _state() -> _State:
    global _STATE
    if _STATE is None or _STATE.pid != os.getpid():  # a fork's child starts its own count
        _STATE = _State()
    return _STATE


def expect_forks(count: int) -> None:
    """This process expects to fork about ``count`` more children (the session's case items):
    a collapse may then pay from the first passes, not only once it forked as often."""
    _state().expected = max(0, count)


def collapsed() -> bool:
    """Whether this process backed any of its memory with huge pages: only then is a write of
    its own while a forked child lives worth waiting out (``supervise.wait_quietly``)."""
    return _STATE is not None and _STATE.pid == os.getpid() and _STATE.made > 0


def before_fork() -> float:
    """Count a fork of this process, and at the forks that call for it collapse what pays;
    the seconds that took, which are no part of the forked child's run (its clock starts
    after them: a pass can take long on a big heap, and a run's timeout is its own)."""
    state = _state()
    if state.off:
        return 0.0
    state.forks += 1
    state.expected = max(0, state.expected - 1)
    if state.forks < state.next_pass:
        return 0.0
    state.next_pass *= 2
    # Forks to come: those expected, and at least as many as made (a process that forked n
    # times is taken to fork about n times more).
    worth = SAVED_PER_FORK * PAYBACK * max(state.forks, state.expected)
    if state.cost > worth:
        return 0.0  # the last pass's chunks cost more than one would save now
    start = time.monotonic()
    try:
        if cuda_initialized():
            state.off = True  # the driver's pinned memory is its own; nothing forks here anyway
            return 0.0
        _collapse(state, worth)
    except Exception:  # no /proc, no C library, a torch stub: a run never fails of this
        state.off = True
    return time.monotonic() - start


def _collapse(state: _State, worth: float) -> None:
    """Collapse dense chunks while their mean cost in seconds stays at most ``worth``."""
    madvise = _calls()
    spent, tried, made, invalid = 0.0, 0, 0, 0
    room = _available() // AVAILABLE_SHARE  # bytes this pass may add to the machine's use
    for chunk, growth in _dense_chunks(state.done):
        room -= growth
        if room < 0:
            break
        start = time.perf_counter()
        failed = madvise(chunk, _HUGE, _MADV_COLLAPSE) != 0
        spent += time.perf_counter() - start
        tried += 1
        if not failed:
            made += 1
            state.done.add(chunk)
        elif ctypes.get_errno() == errno.EINVAL:  # this chunk cannot be, or no kernel can
            invalid += 1
            state.done.add(chunk)
        if spent > worth * tried:
            break
    if tried and invalid == tried and not state.made:  # a kernel without MADV_COLLAPSE
        state.off = True
    if made:
        state.cost = spent / tried
    state.made += made


def _available() -> int:
    """The machine's available memory in bytes (``MemAvailable``), 0 where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _dense_chunks(done: set[int]) -> Any:
    """The 2 MiB chunks of this process's private anonymous memory (its heap and its anonymous
    maps) with at least DENSE pages in memory, not in ``done``; each with the bytes a collapse
    adds to the machine's use: its pages not in memory, and those a living fork shares."""
    with open("/proc/self/maps", "rb") as f:
        maps = f.read().splitlines()
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5] != b"[heap]":
                continue  # a file's, a stack, the vdso
            if not fields[1].startswith(b"rw") or fields[1][3:4] != b"p":
                continue
            low, high = (int(x, 16) for x in fields[0].split(b"-"))
            chunk = (low + _HUGE - 1) & ~(_HUGE - 1)
            while chunk + _HUGE <= high:
                if chunk not in done:
                    present, own = _pages(pagemap, chunk)
                    if present >= DENSE:
                        yield chunk, (_PAGES - own) * 4096
                chunk += _HUGE
    finally:
        os.close(pagemap)


def _pages(pagemap: int, chunk: int) -> tuple[int, int]:
    """How many of the chunk's pages are in memory, and how many of those this process alone
    maps (/proc/self/pagemap: bit 63, and bit 56, readable unprivileged since Linux 4.2)."""
    flags = os.pread(pagemap, _PAGES * 8, chunk // 4096 * 8)[7::8]
    return flags.translate(_PRESENT).count(1), flags.translate(_OWN_PAGE).count(1)

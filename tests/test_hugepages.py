"""A forking process's memory backed by huge pages: when, how much, and what it changes."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import time
from typing import Any

import pytest
import torch  # noqa: F401 - loaded before pytester's snapshot of sys.modules: never unloaded

from pytest_gpucase.run.isolation import hugepages
from pytest_gpucase.run.isolation.hugepages import DENSE, FIRST_PASS, HUGEPAGES_ENV
from pytest_gpucase.run.isolation.result import StartMethod

from .helpers import FORKING, RAISES, ce_case

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
HUGE = 1 << 21


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's own count of forks, on a kernel taken to support the collapse."""
    monkeypatch.setattr(hugepages, "_STATE", None)
    monkeypatch.setattr(hugepages, "_supported", lambda: True)


def _region(pages_touched: int) -> tuple[mmap.mmap, int]:
    """An anonymous private map of 3 chunks; the first ``pages_touched`` pages of its first
    whole aligned chunk written; that chunk's address."""
    region = mmap.mmap(-1, 3 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    chunk = (base + HUGE - 1) & ~(HUGE - 1)
    offset = chunk - base
    for page in range(pages_touched):
        region[offset + page * 4096] = 7
    return region, chunk


def _release(region: mmap.mmap) -> None:
    import gc
    gc.collect()  # the exported buffer of from_buffer is gone with its ctypes object
    region.close()


@linux
def test_only_dense_chunks_of_anonymous_memory_are_candidates() -> None:
    dense, dense_chunk = _region(512)
    sparse, sparse_chunk = _region(DENSE - 1)
    chunks = dict(hugepages._dense_chunks(set()))
    assert dense_chunk in chunks
    assert chunks[dense_chunk] == 0  # every page in memory, and this process's alone
    assert sparse_chunk not in chunks
    assert dense_chunk not in dict(hugepages._dense_chunks({dense_chunk}))
    assert all(chunk % HUGE == 0 for chunk in chunks)
    _release(dense)
    _release(sparse)


def test_passes_come_at_the_first_pass_and_each_doubling(fresh: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    passes: list[tuple[int, float]] = []
    monkeypatch.setattr(hugepages, "_collapse",
                        lambda state, worth: passes.append((state.forks, worth)))
    hugepages._state().cost = 0.0  # every pass worth trying
    for _ in range(8 * FIRST_PASS):
        hugepages.before_fork()
    assert [forks for forks, _ in passes] == [FIRST_PASS, 2 * FIRST_PASS, 4 * FIRST_PASS,
                                              8 * FIRST_PASS]
    # a chunk may cost what it saves over half as many forks again
    assert [worth for _, worth in passes] == [
        hugepages.SAVED_PER_FORK * hugepages.PAYBACK * forks for forks, _ in passes]


def test_a_forked_child_counts_its_own_forks(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(FIRST_PASS - 1):
        hugepages.before_fork()
    state = hugepages._STATE
    assert state is not None and state.forks == FIRST_PASS - 1
    monkeypatch.setattr(state, "pid", state.pid + 1)  # as if this process were its fork
    hugepages.before_fork()
    fresh_state = hugepages._STATE
    assert fresh_state is not state and fresh_state is not None and fresh_state.forks == 1


@pytest.mark.parametrize("why", ["the variable", "not Linux", "never"])
def test_nothing_is_done_where_it_is_turned_off_or_cannot_be(
        why: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(hugepages, "_STATE", None)
    monkeypatch.delenv(HUGEPAGES_ENV, raising=False)
    if why == "the variable":
        monkeypatch.setenv(HUGEPAGES_ENV, "0")
    elif why == "not Linux":
        monkeypatch.setattr(sys, "platform", "darwin")
    elif not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages here")
    else:
        real_open = open

        def never(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith("transparent_hugepage/enabled"):
                setting = tmp_path / "enabled"
                setting.write_bytes(b"always madvise [never]\n")
                return real_open(setting, *args, **kwargs)
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr("builtins.open", never)
    monkeypatch.setattr(hugepages, "_collapse", lambda state, worth: pytest.fail("collapsed"))
    for _ in range(4 * FIRST_PASS):
        hugepages.before_fork()
    assert hugepages._STATE is not None and hugepages._STATE.off


class _FakeCalls:
    """madvise that answers ``code`` (0, or an errno) and costs ``cost`` seconds of a clock the
    test moves; every chunk full, and this process's alone."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, chunks: int, code: int = 0,
                 cost: float = 0.0) -> None:
        self.now = 0.0
        self.asked: list[int] = []
        self.code, self.cost = code, cost
        monkeypatch.setattr(hugepages, "_dense_chunks",
                            lambda done, *_: ((c * HUGE, 0) for c in range(1, chunks + 1)
                                              if c * HUGE not in done))
        monkeypatch.setattr(hugepages, "_available", lambda: 1 << 40)
        monkeypatch.setattr(hugepages, "_calls", lambda: self.madvise)
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(ctypes, "get_errno", lambda: self.code)

    def madvise(self, address: int, size: int, advice: int) -> int:
        assert size == HUGE and advice == 25
        self.asked.append(address)
        self.now += self.cost
        return -1 if self.code else 0


def test_a_pass_stops_when_chunks_cost_more_than_they_save(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _FakeCalls(monkeypatch, chunks=10, cost=0.002)
    state = hugepages._State()
    state.off = False
    hugepages._collapse(state, worth=0.001)
    assert len(calls.asked) == 1 and state.made == 1  # the first one told the cost
    calls.cost = 0.0005
    hugepages._collapse(state, worth=0.001)
    assert len(calls.asked) == 10 and state.made == 10  # every chunk left pays
    hugepages._collapse(state, worth=0.001)
    assert len(calls.asked) == 10  # nothing is asked twice


def test_a_kernel_without_the_collapse_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _FakeCalls(monkeypatch, chunks=4, code=errno.EINVAL)
    state = hugepages._State()
    state.off = False
    hugepages._collapse(state, worth=1.0)
    assert len(calls.asked) == 4 and state.off


def test_a_busy_chunk_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _FakeCalls(monkeypatch, chunks=2, code=errno.EAGAIN)
    state = hugepages._State()
    state.off = False
    hugepages._collapse(state, worth=1.0)
    assert not state.off and not state.done
    calls.code = 0
    hugepages._collapse(state, worth=1.0)
    assert state.made == 2 and len(calls.asked) == 4


def _huge_kib(address: int) -> int | None:
    """AnonHugePages of the map holding ``address``, in KiB (None: not found)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                current = low <= address < high
            elif current and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return None


@linux
def test_a_real_collapse_keeps_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    region, chunk = _region(512)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = chunk - base
    for page in range(512):
        region[offset + page * 4096 + 1] = page % 251
    state = hugepages._State()
    if state.off:
        _release(region)
        pytest.skip("no transparent huge pages here")
    monkeypatch.setattr(hugepages, "_dense_chunks",
                        lambda done, *_: iter([(chunk, 0)] if chunk not in done else []))
    hugepages._collapse(state, worth=1.0)
    if not state.made:
        _release(region)
        pytest.skip("this kernel collapses nothing (before Linux 6.1, or no memory for it)")
    assert _huge_kib(chunk) == 2048
    assert all(region[offset + page * 4096] == 7 and region[offset + page * 4096 + 1] == page % 251
               for page in range(512))
    _release(region)


def test_forks_expected_make_the_first_passes_worth_more(fresh: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    worths: list[float] = []
    monkeypatch.setattr(hugepages, "_collapse", lambda state, worth: worths.append(worth))
    hugepages.expect_forks(100)
    for _ in range(4):
        hugepages.before_fork()
    # at fork 2, 98 to come; at fork 4, 96
    share = hugepages.SAVED_PER_FORK * hugepages.PAYBACK
    assert worths == [share * 98, share * 96]


def test_a_pass_is_skipped_while_chunks_cost_more_than_they_would_save(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _FakeCalls(monkeypatch, chunks=100, cost=0.01)
    share = hugepages.SAVED_PER_FORK * hugepages.PAYBACK
    first = next(n for n in (2 ** k for k in range(1, 20)) if share * n >= hugepages.PRIOR_COST)
    for _ in range(first - 1):
        hugepages.before_fork()
    # before a chunk was measured, one is taken to cost PRIOR_COST: no pass is worth trying
    assert not calls.asked
    hugepages.before_fork()
    assert len(calls.asked) == 1  # one chunk tried: 10 ms, more than it would save
    dear = next(n for n in (2 ** k for k in range(1, 20)) if share * n >= 0.01)
    for _ in range(dear - 1 - first):
        hugepages.before_fork()
    assert len(calls.asked) == 1  # every pass until then skipped
    calls.cost = 0.0001
    hugepages.before_fork()  # the fork at which 10 ms a chunk pays: cheaper now, all of them
    assert len(calls.asked) == 100 and hugepages._STATE is not None and hugepages._STATE.made == 100


def test_a_failure_of_its_own_never_fails_the_fork(fresh: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(state: Any, worth: float) -> None:
        raise RuntimeError("no such thing")
    monkeypatch.setattr(hugepages, "_collapse", broken)
    hugepages.expect_forks(10_000)
    for _ in range(FIRST_PASS):
        hugepages.before_fork()
    assert hugepages._STATE is not None and hugepages._STATE.off


@linux
@pytest.mark.slow
def test_children_forked_from_collapsed_memory_run_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucase.run.isolation import run_in_child

    from . import isolation_targets as targets

    monkeypatch.setattr(hugepages, "_STATE", None)
    hugepages.expect_forks(1_000_000)  # every chunk worth its cost
    tables = [list(range(1000)) for _ in range(3000)]  # a heap worth collapsing
    results = [run_in_child(targets.echo, n, timeout=30, start_method="fork") for n in range(4)]
    state = hugepages._STATE
    assert state is not None
    assert [result.value for result in results] == [0, 2, 4, 6]
    assert all(r.returned and r.problem is None and r.stdout == "to stdout\n" for r in results)
    assert tables[-1][-1] == 999
    if state.off or not state.made:
        pytest.skip("this kernel collapses nothing (before Linux 6.1, or huge pages off)")


@linux
@pytest.mark.slow
def test_the_quiet_wait_ends_with_the_child_or_its_time() -> None:
    import signal
    import time

    from pytest_gpucase.run.isolation.supervise import wait_quietly

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    start = time.monotonic()
    wait_quietly(pid, 30.0)
    assert time.monotonic() - start < 10  # the child's end, not the 30 s
    os.waitpid(pid, 0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        time.sleep(60)
        os._exit(0)
    start = time.monotonic()
    wait_quietly(pid, 0.2)
    took = time.monotonic() - start
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert 0.15 < took < 10


@linux
@pytest.mark.slow
def test_a_child_that_fills_its_pipes_during_the_quiet_wait_is_read_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucase.run import isolation
    from pytest_gpucase.run.isolation import run_in_child

    from . import isolation_targets as targets

    monkeypatch.setattr(isolation, "collapsed", lambda: True)  # huge pages: a wait

    # 3 x 64 KiB on stdout, more than its pipe holds while nobody reads it: the child waits
    # for the quiet wait's end, then is read to its last line
    result = run_in_child(targets.flood, 3 * 65536, timeout=60, start_method="fork")
    assert result.returned and result.value == 3 * 65536 and result.problem is None
    assert result.stdout.startswith("BEGIN\n") and result.stdout.endswith("END\n")


def _alive(pid: int) -> bool:
    """Whether ``pid``, a child of this process, is still unreaped."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


@linux
@pytest.mark.slow
def test_ctrl_c_in_the_quiet_wait_ends_the_run_and_its_child(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import signal
    import threading
    import time

    from pytest_gpucase.run import isolation

    from . import isolation_targets as targets

    # A quiet wait long enough for Ctrl-C to come inside it, whenever the machine runs us.
    monkeypatch.setattr(isolation, "QUIET_START", 60.0)
    monkeypatch.setattr(isolation, "collapsed", lambda: True)  # huge pages: a wait
    pid_file = tmp_path / "pid"
    main, native = threading.get_ident(), threading.get_native_id()

    def waiting() -> bool:  # the main thread asleep (in the wait) once the child is running
        with open(f"/proc/self/task/{native}/stat") as f:
            return pid_file.exists() and f.read().rpartition(")")[2].split()[0] == "S"

    def press() -> None:
        end = time.monotonic() + 60
        while not waiting() and time.monotonic() < end:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press)
    presser.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            isolation.run_in_child(targets.pid_and_hang, str(pid_file), timeout=120,
                                   start_method="fork")
        took = time.monotonic() - start
    finally:
        presser.join()
        child = int(pid_file.read_text())
        alive = _alive(child)
        if alive:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    assert not alive  # the run's child was killed and reaped, as on Ctrl-C in the wait
    assert took < 30  # at once, not at the quiet wait's end


@linux
@pytest.mark.slow
@pytest.mark.parametrize("method", FORKING)
def test_a_collapse_before_the_fork_is_no_part_of_the_runs_time(
        method: StartMethod, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from pytest_gpucase.run import isolation
    from pytest_gpucase.run.isolation import zygote

    from . import isolation_targets as targets

    def dear_pass() -> float:  # a pass that took 2 s: a big heap, a slow machine
        time.sleep(2.0)
        return 2.0

    # where the pytest process (and a zygote forked from it) calls it before a fork
    for module in (isolation, zygote):
        monkeypatch.setattr(module, "before_fork", dear_pass)
    if method == "forkserver":
        zygote.stop_forkserver()  # the next zygote is a fork of this process, patched
    try:
        result = isolation.run_in_child(targets.echo, 3, timeout=1.5, start_method=method)
    finally:
        if method == "forkserver":
            zygote.stop_forkserver()
    assert result.returned and result.value == 6 and not result.timed_out
    assert result.duration < 1.5


@linux
@pytest.mark.slow
def test_memory_a_living_fork_shares_counts_as_growth() -> None:
    # A collapse copies shared pages into a huge page of this process's own, and the fork
    # keeps the old ones: the machine then holds them twice.
    region, chunk = _region(512)
    if not os.path.exists("/proc/self/pagemap"):
        _release(region)
        pytest.skip("no /proc/self/pagemap here")
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child shares the chunk until told to end
        os.read(go_r, 1)
        os._exit(0)
    try:
        shared = dict(hugepages._dense_chunks(set()))
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        os.close(go_r)
        os.close(go_w)
    alone = dict(hugepages._dense_chunks(set()))
    _release(region)
    assert shared[chunk] == HUGE  # all of it shared: all of it would be held twice
    assert alone[chunk] == 0


def test_a_pass_grows_memory_by_at_most_a_share_of_what_is_available(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _FakeCalls(monkeypatch, chunks=100)
    monkeypatch.setattr(hugepages, "_dense_chunks",
                        lambda done, *_: ((c * HUGE, HUGE) for c in range(1, 101)
                                          if c * HUGE not in done))
    monkeypatch.setattr(hugepages, "_available",
                        lambda: 10 * HUGE * hugepages.AVAILABLE_SHARE)
    state = hugepages._State()
    state.off = False
    hugepages._collapse(state, worth=1.0)
    assert len(calls.asked) == 10  # ten shared chunks: all the room this pass had
    monkeypatch.setattr(hugepages, "_available", lambda: 0)  # nothing known: nothing grows
    hugepages._collapse(state, worth=1.0)
    assert len(calls.asked) == 10


def test_the_available_memory_is_read_from_meminfo() -> None:
    available = hugepages._available()
    if not os.path.exists("/proc/meminfo"):
        assert available == 0
    else:
        assert available > 0


@pytest.mark.slow
def test_the_forks_expected_are_this_sessions_case_items(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b", "c", "d"):
        ce_case(pytester.path, name, [0, 2, 4], RAISES)
    pytester.makeconftest("""
        def pytest_sessionfinish(session):
            from pytest_gpucase.run.isolation import hugepages
            print("EXPECTED", hugepages._state().expected)
    """)
    # Inherited from an xdist worker that runs this pytest (a test of a plugin, say): not
    # this session's workers, which would share its items out.
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--collect-only", "-p", "no:randomly", "cases")
    result.stdout.fnmatch_lines(["collected 4 items", "EXPECTED 4"])


@linux
@pytest.mark.slow
def test_the_quiet_wait_is_only_for_a_process_with_huge_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucase.run import isolation
    from pytest_gpucase.run.isolation import supervise

    from . import isolation_targets as targets

    # Without a collapsed chunk the wait saves nothing (no huge page to split), and a child
    # that writes more than its pipe holds would wait on it.
    waits: list[float] = []

    def recorded(pid: int, seconds: float) -> BaseException | None:
        waits.append(seconds)
        return supervise.wait_quietly(pid, seconds)

    monkeypatch.setattr(isolation, "wait_quietly", recorded)
    monkeypatch.setattr(hugepages, "_STATE", None)
    monkeypatch.setenv(HUGEPAGES_ENV, "0")
    result = isolation.run_in_child(targets.flood, 3 * 65536, timeout=60, start_method="fork")
    assert result.returned and result.value == 3 * 65536
    assert not [seconds for seconds in waits if seconds > 0]
    state = hugepages._state()
    state.made = 1  # as if a pass had collapsed a chunk
    result = isolation.run_in_child(targets.flood, 3 * 65536, timeout=60, start_method="fork")
    assert result.returned and result.value == 3 * 65536
    assert [seconds for seconds in waits if seconds > 0] == [supervise.QUIET_START]

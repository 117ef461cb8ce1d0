"""Containment of a run's child: real processes, real signals, hostile results.

Each test waits a bounded, generous time for what it checks (the machine may be
loaded), and asserts no timing: only what died, what came back, what was refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pytest_gpucase.run.isolation import (
    RESULT_LIMIT,
    TEXT_HEAD,
    TEXT_TAIL,
    ChildWarning,
    clip,
    run_in_child,
)

from . import isolation_targets as targets
from .helpers import FORKING, run_reaching

pytestmark = pytest.mark.slow  # every test here starts processes

LINUX = sys.platform.startswith("linux")
needs_proc = pytest.mark.skipif(not LINUX, reason="finding escaped processes needs Linux /proc")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a parent that never reaps counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return not LINUX
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def wait_gone(pid: int, seconds: float = 30) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def read_pid(path: Path, seconds: float = 60) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


# --- the whole tree dies ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_child_that_joins_the_parents_group_is_killed(tmp_path: Path, method: str) -> None:
    pid_file = tmp_path / "child.pid"
    result, _ = run_reaching(targets.join_parent_group_and_hang, str(pid_file), timeout=1.0,
                             start_method=method)
    assert result.timed_out and result.signal == signal.SIGKILL
    assert not alive(read_pid(pid_file))  # reaped by run_in_child


@needs_proc
@pytest.mark.parametrize("target", [targets.setsid_grandchild_and_hang, targets.daemon_and_hang])
def test_grandchild_in_its_own_session_dies_at_the_timeout(tmp_path: Path, target: object) -> None:
    pid_file = tmp_path / "grandchild.pid"
    result, _ = run_reaching(target, str(pid_file), timeout=1.5)
    assert result.timed_out
    grandchild = read_pid(pid_file)
    assert wait_gone(grandchild), f"grandchild {grandchild} survived the timeout"


@needs_proc
def test_daemon_of_a_child_that_returned_dies_with_the_run(tmp_path: Path) -> None:
    pid_file = tmp_path / "daemon.pid"
    result = run_in_child(targets.daemon_and_return, str(pid_file), timeout=60)
    assert result.returned and result.value == 7
    daemon = read_pid(pid_file)
    assert wait_gone(daemon), f"daemon {daemon} outlived its run"


def test_other_children_of_the_parent_are_left_alone(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        result = run_in_child(targets.setsid_grandchild_and_hang, str(tmp_path / "g.pid"),
                              timeout=1.0)
        assert result.timed_out
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# --- signals to pytest ------------------------------------------------------------------------

HANGING_CASE = '''
import os, time

def run():
    grandchild = os.fork()
    if grandchild == 0:
        os.setsid()
        time.sleep(600)
        os._exit(0)
    with open({pids!r} + ".tmp", "w") as handle:
        handle.write(f"{{os.getpid()}} {{grandchild}}")
    os.replace({pids!r} + ".tmp", {pids!r})
    time.sleep(600)
'''


def start_pytest_on_hanging_case(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    case = tmp_path / "cases" / "hangs"
    case.mkdir(parents=True)
    pids = tmp_path / "pids"
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\ntimeout = 600\n')
    (case / "case.py").write_text(HANGING_CASE.format(pids=str(pids)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # Output to a file: a pipe would stay open as long as any process that inherited it.
    with open(tmp_path / "output.txt", "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "--gpu-cases", "--gpu-devices", "cpu", "-p",
             "no:cacheprovider", "--gpu-cases-report", "report.json", "cases"],
            cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not pids.exists():
            assert process.poll() is None and time.monotonic() < end, "the case never started"
            time.sleep(0.1)
    except BaseException:
        process.kill()
        process.wait()
        raise
    child, grandchild = map(int, pids.read_text().split())
    return process, child, grandchild


@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_pytest_kills_the_run_and_ends_pytest(
        tmp_path: Path, signum: int) -> None:
    process, child, grandchild = start_pytest_on_hanging_case(tmp_path)
    process.send_signal(signum)
    try:
        process.wait(timeout=120)
    finally:
        process.kill()
    output = (tmp_path / "output.txt").read_text(errors="replace")
    assert process.returncode == 2, output  # pytest's exit status when interrupted
    assert f"pytest received {signal.Signals(signum).name} while a case ran" in output
    assert wait_gone(child) and wait_gone(grandchild)
    report = json.loads((tmp_path / "report.json").read_text())  # sessionfinish wrote it
    assert report["complete"] is False


@needs_proc
def test_sigkill_to_pytest_takes_the_direct_child_along(tmp_path: Path) -> None:
    process, child, grandchild = start_pytest_on_hanging_case(tmp_path)
    process.kill()
    process.wait(timeout=120)
    try:
        assert wait_gone(child), "the child outlived a SIGKILLed pytest"
    finally:  # the grandchild is best effort only (documented): end it here, it is ours
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)


def test_handlers_are_restored_after_a_run() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    assert run_in_child(targets.echo, 1, timeout=30).returned
    assert {s: signal.getsignal(s) for s in before} == before


# --- what comes back is data, bounded and checked ---------------------------------------------

def test_values_cross_as_data_with_nan_infinities_tuples_and_keys() -> None:
    result = run_in_child(targets.nested_value, timeout=30)
    assert result.returned, result.problem
    value = result.value
    assert value["a"][0] == 1.5 and math.isnan(value["a"][1])
    assert value["a"][2:] == (math.inf, -math.inf)
    assert value[3] == [None, True, "s"]
    assert value[(1, 2)] == {"deep": ()}


def test_a_result_over_the_limit_is_a_bounded_failure() -> None:
    script = textwrap.dedent(f"""
        import resource
        from pytest_gpucase.run.isolation import run_in_child
        from tests import isolation_targets as targets
        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        base = peak()
        result = run_in_child(targets.big_list, {100 * 2**20}, timeout=120)
        print(result.problem)
        print(peak() - base)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, timeout=300, cwd=Path(__file__).parent.parent)
    problem, growth = done.stdout.strip().splitlines()
    assert problem.startswith(f"sent too big a result: the child's result exceeded "
                              f"{RESULT_LIMIT // 2**20} MiB and the child was killed")
    assert int(growth) < RESULT_LIMIT + 32 * 2**20  # the bound, not the 100 MB sent


def test_long_strings_keep_head_and_tail() -> None:
    text = "HEAD" + "m" * 50_000_000 + "TAIL"
    result = run_in_child(targets.raise_message, text, timeout=60)
    assert result.child_error is not None
    assert len(result.child_error) < TEXT_HEAD + TEXT_TAIL + 200
    assert "ValueError: HEAD" in result.child_error and "TAIL" in result.child_error
    assert "bytes omitted ...]" in result.child_error
    assert clip("short") == "short"


class TestCraftedResults:
    """A child that writes its own bytes on the result pipe: refused, and nothing runs."""

    def test_a_pickle_is_not_unpickled(self, tmp_path: Path) -> None:
        import pickle

        marker = tmp_path / "unpickled"
        crafted = pickle.dumps(targets.Marker(str(marker)))
        result = run_in_child(targets.send_raw_result, crafted, timeout=30)
        assert not result.returned
        assert result.problem is not None
        assert result.problem.startswith("sent a malformed result: not JSON")
        assert not marker.exists()

    @pytest.mark.parametrize(("crafted", "problem"), [
        (b"{not json", "not JSON"),
        (b"[" * 100_000, "not JSON"),
        (b'{"format": 1, "kind": "value", "value": {"$": "pickle", "data": "gASV"}}',
         "unknown type tag 'pickle'"),
        (b'{"format": 1, "kind": "value", "value": {"$": "dataclass", "type": "os.system", '
         b'"fields": {}}}', "type 'os.system' is not one a child may return"),
        (b'{"format": 1, "kind": "value", "value": {"$": "dataclass", "type": '
         b'"pytest_gpucase.run.outcome.Outcome", "fields": {"status": "failed", "summary": 5, '
         b'"details": "", "error_type": null, "error_message": null, "max_abs": null, '
         b'"max_rel": null, "kind": "", "notes": {"$": "tuple", "items": []}, '
         b'"budgets": {"$": "tuple", "items": []}, "verdict_class": null, '
         b'"nonfinite": {"$": "tuple", "items": []}, "cause_type": null}}}',
         "Outcome.summary is a int, not str"),
        (b'{"format": 1, "kind": "value", "value": {"$": "dataclass", "type": '
         b'"pytest_gpucase.run.outcome.Outcome", "fields": {"status": "failed"}}}', "fields"),
        (b'{"format": 1, "kind": "value", "value": 1, "warnings": {"items": [{"x": 1}]}}',
         "a malformed warning"),
        (b'{"format": 9, "kind": "value", "value": 1}', "not a result envelope"),
        (b'{"format": 1, "kind": "other"}', "neither a value nor an error"),
    ])
    def test_malformed_results_are_named(self, crafted: bytes, problem: str) -> None:
        result = run_in_child(targets.send_raw_result, crafted, timeout=30)
        assert not result.returned and result.value is None
        assert result.problem is not None and result.problem.startswith("sent a malformed")
        assert problem in result.problem

    def test_an_outcome_is_rebuilt(self) -> None:
        from pytest_gpucase.run.outcome import Outcome

        sent = Outcome("failed", "s", max_abs=float("nan"), kind="mismatch")
        crafted = json.dumps({"format": 1, "kind": "value", "value": {
            "$": "dataclass", "type": "pytest_gpucase.run.outcome.Outcome",
            "fields": {**{k: v for k, v in sent.__dict__.items()
                          if k not in ("max_abs", "notes", "budgets", "nonfinite")},
                       "max_abs": {"$": "float", "value": "nan"},
                       "notes": {"$": "tuple", "items": []},
                       "nonfinite": {"$": "tuple", "items": []},
                       "budgets": {"$": "tuple", "items": []}}}}).encode()
        result = run_in_child(targets.send_raw_result, crafted, timeout=30)
        assert result.returned, result.problem
        assert isinstance(result.value, Outcome)
        assert result.value.summary == "s" and math.isnan(result.value.max_abs or 0.0)


# --- memory and timeouts ----------------------------------------------------------------------

@needs_proc
def test_memory_limit_kills_the_tree() -> None:
    own = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    limit = own + 128 * 2**20
    result = run_in_child(targets.hold_memory, 512 * 2**20, timeout=120, memory_limit=limit)
    assert result.memory_exceeded and not result.returned
    assert result.resident is not None and result.resident > limit
    assert result.problem is not None
    assert result.problem.startswith(f"exceeded the memory limit of {limit / 2**30:.3g} GiB "
                                     "(resident ")


def test_a_generous_memory_limit_lets_the_run_finish() -> None:
    result = run_in_child(targets.echo, 2, timeout=30, memory_limit=64 * 2**30)
    assert result.returned and result.value == 4 and not result.memory_exceeded


@pytest.mark.parametrize("timeout", [10**9, 30 * 86400.0, math.inf])
def test_huge_timeouts_work(timeout: float) -> None:
    result = run_in_child(targets.echo, 3, timeout=timeout)
    assert result.returned and result.value == 6


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_negative_or_nan_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        run_in_child(targets.echo, 1, timeout=timeout)


# --- what the report shows --------------------------------------------------------------------

def test_hang_dump_hides_pytests_frames() -> None:
    result, _ = run_reaching(targets.hang, timeout=1.0)
    assert result.timed_out
    assert "in hang" in result.stderr
    assert "frames of pytest, pluggy and gpucase hidden]" in result.stderr
    for machinery in ("/_pytest/", "/pluggy/", "pytest_gpucase/"):
        assert machinery not in result.stderr


def test_warnings_come_back_counted_and_bounded() -> None:
    # This suite runs with filterwarnings=error, inherited by the fork: the child records
    # its warnings all the same.
    result = run_in_child(targets.warn_often, timeout=30)
    assert result.returned, result.problem
    first = result.warnings[0]
    assert first == ChildWarning("UserWarning", "std(): degrees of freedom is <= 0",
                                 first.filename, first.lineno, count=500)
    assert first.filename.endswith("isolation_targets.py")
    assert result.warnings[1].category == "RuntimeWarning"
    assert len(result.warnings) == 20 and result.warnings_dropped == 82


WARNING_CASE = '''
import warnings

def run(x):
    warnings.warn("std(): degrees of freedom is <= 0", UserWarning)
    return x + 1
'''


def test_warnings_reach_pytests_summary_and_a_section(pytester: pytest.Pytester) -> None:
    case = pytester.path / "cases" / "warns"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[inputs]\nx = 1\n')
    (case / "case.py").write_text(WARNING_CASE)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rP", "cases")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines([
        "*Captured warnings (child) call*",
        "*case.py:5: UserWarning: std(): degrees of freedom is <= 0 (2 times)",
    ])
    result.stdout.fnmatch_lines([
        "*warnings summary*",
        "*UserWarning: (in the case's child) std(): degrees of freedom is <= 0",
    ])


COVERED_CASE = '''
def run(x):
    if x > 0:
        return x + 1  # only a case run gets here
    return x
'''


def test_code_a_case_runs_counts_as_covered(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_cov")
    case = pytester.path / "cases" / "covered"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[inputs]\nx = 1\n')
    (case / "case.py").write_text(COVERED_CASE)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--cov=cases", "--cov-report=term-missing", "cases")
    result.assert_outcomes(passed=1)
    # Line 4 runs only in the case's child; line 5 never runs.
    result.stdout.fnmatch_lines(["cases/covered/case.py * 4 * 1 * 75% * 5"])


# --- nothing left behind: orphans, a fork bomb, a SIGKILLed xdist worker ----------------------

def reap_now() -> None:
    from pytest_gpucase.run.isolation import reap_pending

    reap_pending(block=False)  # the killed orphans this process adopted are reaped here


@needs_proc
@pytest.mark.parametrize("method", FORKING)
def test_daemon_of_a_child_that_died_without_a_result_is_killed(tmp_path: Path,
                                                                method: str) -> None:
    """The daemon left its session and its parent before the child died: no group, no
    living ancestor in the run. Its parent's parent (this process, or the zygote) is a
    subreaper: the daemon is adopted there, found and killed with the run."""
    pid_file = tmp_path / "daemon.pid"
    result = run_in_child(targets.daemon_and_die, str(pid_file), timeout=60,
                          start_method=method)
    assert result.exitcode == 3 and not result.returned
    daemon = read_pid(pid_file)
    reap_now()
    assert wait_gone(daemon), f"daemon {daemon} outlived its run"


DAEMON_CASE = '''
import os, time

def run():
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            with open({pid_file!r} + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace({pid_file!r} + ".tmp", {pid_file!r})
            time.sleep(600)
        os._exit(0)
    os.waitpid(middle, 0)
    while not os.path.exists({pid_file!r}):
        time.sleep(0.01)
    os._exit(3)  # no result: the daemon lives on, holding what this child held
'''


@needs_proc
def test_a_session_whose_case_left_a_daemon_ends_at_once_and_leaves_nothing(
        tmp_path: Path) -> None:
    """The daemon of a child that died held the zygote's socket the pytest process forked
    it with, and pytest waited 10 s at its exit for the zygote; then the daemon lived on."""
    case = tmp_path / "cases" / "daemon"
    case.mkdir(parents=True)
    pid_file = tmp_path / "daemon.pid"
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\ntimeout = 60\n')
    (case / "case.py").write_text(DAEMON_CASE.format(pid_file=str(pid_file)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--gpu-cases", "--gpu-devices", "cpu", "-p",
         "no:cacheprovider", "cases"], cwd=tmp_path, capture_output=True, timeout=300,
        check=False)
    ended = time.time()
    daemon = read_pid(pid_file, seconds=1)
    try:
        assert done.returncode == 1, done.stdout.decode(errors="replace")
        assert not alive(daemon), f"daemon {daemon} outlived the session"
        # From the daemon's start to pytest's end: the run, the report, the exit; not 10 s.
        assert ended - pid_file.stat().st_mtime < 8, done.stdout.decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon, signal.SIGKILL)


@needs_proc
def test_a_fork_bomb_dies_within_seconds_of_its_timeout(tmp_path: Path) -> None:
    """Capped at 300 processes by a shared counter (and RLIMIT_NPROC where it applies), each
    forking without end. The kill stops the run's group with one signal before it reads
    anything; reading every process's environment first (each read waits while that
    process is inside fork()) took minutes. The bound is generous: CI is loaded; the
    benchmark-quality figure is in docs/isolation.md."""
    pids = tmp_path / "bomb.pids"
    result = run_in_child(targets.capped_fork_bomb, 300, str(pids), timeout=2.0)
    members = [int(line) for line in pids.read_text().split()]
    try:
        assert result.timed_out
        assert result.duration < 2.0 + 10, f"the bomb died {result.duration - 2:.1f} s late"
        assert len(members) > 100  # it was a bomb
        reap_now()
        assert not [pid for pid in members if not wait_gone(pid, 10)]
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(members[0], signal.SIGKILL)  # the child led the bomb's group


XDIST_CASE = '''
import os, signal, time

def run(x):
    sleeper = os.fork()  # a helper of the run (a DataLoader worker, say): no exec
    if sleeper == 0:
        time.sleep(600)
        os._exit(0)
    with open({pids!r}, "a") as handle:
        handle.write(f"{{os.getpid()}} {{sleeper}}\\n")
    # Then the xdist worker that runs this is SIGKILLed (the OOM killer, say): the topmost
    # ancestor with execnet's command line (its forks, the zygote, have it too).
    def parent(pid):
        with open(f"/proc/{{pid}}/stat") as handle:
            stat = handle.read()
        return int(stat[stat.rfind(")") + 2:].split()[1])

    def execnet(pid):
        with open(f"/proc/{{pid}}/cmdline", "rb") as handle:
            return b"exec(eval(" in handle.read()

    worker = parent(os.getpid())
    while not execnet(worker) or execnet(parent(worker)):
        worker = parent(worker)
    os.kill(worker, signal.SIGKILL)
    time.sleep(600)
'''


@needs_proc
@pytest.mark.parametrize("method", FORKING)
def test_a_sigkilled_xdist_workers_processes_are_swept_at_session_end(
        tmp_path: Path, method: str) -> None:
    """The worker's helpers (its pooled worker, its zygote) die with it (PR_SET_PDEATHSIG);
    what they started is adopted by the controller, a subreaper, and swept at its end."""
    pytest.importorskip("xdist")
    pids = tmp_path / "pids"
    case = tmp_path / "cases" / "kills_its_worker"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\ntimeout = 120\n'
                                    '[inputs]\nx = 1\n')
    (case / "case.py").write_text(XDIST_CASE.format(pids=str(pids)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--gpu-cases", "--gpu-devices", "cpu", "-p",
         "no:cacheprovider", "-n", "2", "--gpu-isolation", "worker", "--gpu-start-method",
         method, "cases"], cwd=tmp_path, capture_output=True, timeout=300, check=False)
    found = [int(pid) for pid in pids.read_text().split()]
    try:
        assert b"crashed" in done.stdout, done.stdout.decode(errors="replace")
        left = [pid for pid in found if not wait_gone(pid, 5)]
        assert not left, f"{left} outlived the session"
    finally:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@needs_proc
def test_orphans_of_the_users_own_processes_are_left_alone(tmp_path: Path) -> None:
    """This process is a subreaper now: an orphan of a subprocess a test started is adopted
    here too, and the session's sweep must not take it for a run's."""
    from pytest_gpucase.run.isolation import adopt_orphans, shutdown

    assert run_in_child(targets.echo, 1, timeout=60).returned
    assert adopt_orphans()
    done = subprocess.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"],
                          capture_output=True, text=True, check=True, timeout=60)
    orphan = int(done.stdout)
    try:
        shutdown()
        assert alive(orphan)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(orphan, 0)  # adopted here: reaped here


# --- what the pytest process itself reads of a case: within bounds ---------------------------

READS_WITHIN_BOUNDS = """
import resource, sys
from pathlib import Path
from pytest_gpucase.case import project
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import reference_cache

case = Path(sys.argv[1])
spec = RunSpec(load_case(case), "cpu", "float32", cast=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reference_cache.prepare(spec)     # in the parent, before each fork: the key's files
reference_cache.forget_prepared()
project.import_paths(case)        # the project's configuration file, above the case
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


HEADER_WITHIN_BOUNDS = """
import resource, sys
from pathlib import Path
from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.case import payload

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    payload.describe(Path(sys.argv[1]))   # what collection reads of each case's inputs
except CaseFormatError as exc:
    print(exc, file=sys.stderr)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_payload_header_costs_the_collecting_process_its_bound(tmp_path: Path) -> None:
    """A 60 MiB JSON header of 900,000 tensor entries was parsed whole at collection (some
    500 MiB); it is refused from its length field."""
    import json

    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
              for i in range(900_000)}
    raw = json.dumps(header).encode()
    file = tmp_path / "inputs.safetensors"
    file.write_bytes(len(raw).to_bytes(8, "little") + raw)
    done = subprocess.run([sys.executable, "-c", HEADER_WITHIN_BOUNDS, str(file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over the limit of 16777216" in done.stderr, done.stderr[-2000:]
    assert int(done.stdout) < 100, f"peak grew by {done.stdout.strip()} MiB"


def test_the_parent_reads_a_sparse_case_py_and_config_within_bounds(tmp_path: Path) -> None:
    """A 1 GiB sparse case.py (the reference-cache key) and a 1 GiB sparse pyproject.toml above
    the case (its import paths) cost the pytest process no more than their bounds."""
    case = tmp_path / "cases" / "sparse"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    'reference = "case.py:ref"\n[inputs]\nx = 1\n')
    for name, text in (("case.py", "def run(x):\n    return x\n\ndef ref(x):\n    return x\n"),
                       ("../../pyproject.toml", "[tool.pytest.ini_options]\n")):
        file = case / name
        file.write_text(text)
        with open(file, "r+b") as handle:
            handle.truncate(2**30)
    done = subprocess.run([sys.executable, "-c", READS_WITHIN_BOUNDS, str(case)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) < 100, f"peak grew by {done.stdout.strip()} MiB"

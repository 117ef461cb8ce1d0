"""The child process: results, real crashes, timeouts, bounded output, both start methods."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_gpucase.run import isolation
from pytest_gpucase.run.isolation import child, clipping, proctree, supervise, zygote
from pytest_gpucase.run.isolation import CAPTURE_HEAD, CAPTURE_TAIL, run_in_child

from . import isolation_targets as targets
from .helpers import FORKING, needs_zygote, run_reaching

pytestmark = pytest.mark.slow  # every test here starts processes

METHODS = ["fork", "forkserver", "spawn"]


@pytest.mark.parametrize("method", METHODS)
def test_value_and_output_come_back(method: str) -> None:
    result = run_in_child(targets.echo, 21, timeout=30, start_method=method)
    assert result.returned and result.value == 42
    assert result.problem is None
    assert result.stdout == "to stdout\n"
    assert result.stderr == "to fd 2\n"
    assert result.exitcode == 0 and result.signal is None


@pytest.mark.parametrize("method", METHODS)
def test_environment_reaches_the_child_only(method: str) -> None:
    result = run_in_child(targets.read_env, "GPUCASE_PROBE", timeout=30,
                          env={"GPUCASE_PROBE": "1"}, start_method=method)
    assert result.value == "1"
    assert "GPUCASE_PROBE" not in os.environ


@pytest.mark.parametrize("method", METHODS)
def test_segfault_is_named_with_the_python_stack(method: str) -> None:
    result = run_in_child(targets.segfault, timeout=30, start_method=method)
    assert not result.returned
    assert result.signal == signal.SIGSEGV
    assert result.problem == "crashed with signal 11 (SIGSEGV)"
    assert "Fatal Python error: Segmentation fault" in result.stderr
    assert "in segfault" in result.stderr


@pytest.mark.parametrize("method", METHODS)
def test_a_crash_has_its_stack_whatever_handler_the_parent_left(method: str) -> None:
    """faulthandler was enabled in this process (pytest enables it), then SIGSEGV's handler
    was replaced: a child whose faulthandler only took a new file had no handler left, and
    its crash came back with an empty stderr."""
    previous = signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    try:
        result = run_in_child(targets.segfault, timeout=30, start_method=method)
    finally:
        signal.signal(signal.SIGSEGV, previous)
    assert result.signal == signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in result.stderr


def test_abort_is_named() -> None:
    result = run_in_child(targets.abort, timeout=30)
    assert result.problem == "crashed with signal 6 (SIGABRT)"


@pytest.mark.parametrize("code", [0, 3])
def test_exit_without_result(code: int) -> None:
    result = run_in_child(targets.exit_now, code, timeout=30)
    assert not result.returned
    assert result.problem == f"exited with code {code} without returning a result"


def test_exception_in_child_comes_back_as_traceback() -> None:
    result = run_in_child(targets.raise_value_error, timeout=30)
    assert result.problem == "raised in the child"
    assert result.child_error is not None
    assert "ValueError: boom" in result.child_error


def test_unrepresentable_result_is_reported() -> None:
    # Results cross as data, not pickles: a function is not data.
    result = run_in_child(targets.unpicklable, timeout=30)
    assert not result.returned
    assert result.problem == "raised in the child"
    assert result.child_error is not None
    assert "TypeError: a builtins.function cannot be returned from a child" in result.child_error


@pytest.mark.parametrize("method", METHODS)
def test_hang_is_killed_after_dumping_stacks(method: str) -> None:
    result, timeout = run_reaching(targets.hang, timeout=1.0, start_method=method)
    assert result.timed_out and not result.returned
    assert result.problem == "timed out"
    assert result.duration < timeout + 9
    assert "in hang" in result.stderr  # faulthandler's dump of every thread


@pytest.mark.parametrize("method", METHODS)
def test_a_child_out_of_time_before_its_start_is_done_is_killed_not_signalled(
        method: str) -> None:
    """With no time at all the deadline comes while the child is still starting (as on a
    loaded machine). The stack request must not end it by the signal's default action: it is
    killed at once as still starting, or, had its handler just come in place, it answers."""
    result = run_in_child(targets.hang, timeout=0, start_method=method)
    assert result.timed_out and result.signal == signal.SIGKILL, result
    if result.starting:
        assert result.problem == "timed out while starting"
        assert "most recent call first" not in result.stderr
    else:
        assert result.problem == "timed out"
        assert "most recent call first" in result.stderr


@pytest.mark.parametrize("method", FORKING)
def test_a_worker_out_of_time_before_its_start_is_done_is_killed(method: str) -> None:
    pool = isolation.WorkerPool()
    try:
        result = pool.run("k", targets.hang, timeout=0, start_method=method)
        assert result.timed_out and result.signal == signal.SIGKILL, result
    finally:
        pool.close()


def test_only_a_blocked_signal_without_a_handler_is_held() -> None:
    """The parent's test of "still starting": the stack signal blocked and no handler for it.
    A process that blocks it after its handler is in place is asked as any other."""
    code = ("import faulthandler, signal, sys, time\n"
            "if 'block' in sys.argv: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            "if 'handler' in sys.argv: faulthandler.register(signal.SIGUSR1)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    for flags, held in ((["block"], True), (["block", "handler"], False), ([], False)):
        with subprocess.Popen([sys.executable, "-c", code, *flags],
                              stdout=subprocess.PIPE) as process:
            try:
                assert process.stdout is not None and process.stdout.readline() == b"ready\n"
                assert proctree._held(process.pid, signal.SIGUSR1) is held, flags
            finally:
                process.kill()
    assert proctree._held(process.pid, signal.SIGUSR1) is False  # gone: not known to be held


@pytest.mark.parametrize("method", METHODS)
def test_the_parent_keeps_its_mask_and_the_case_has_the_signal_unblocked(method: str) -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    result = run_in_child(targets.stack_signal_blocked, timeout=60, start_method=method)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before
    assert result.value == {"child": False, "started": False}, result


@pytest.mark.parametrize("method", FORKING)
def test_a_worker_has_the_signal_unblocked_and_the_parent_its_mask(method: str) -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    pool = isolation.WorkerPool()
    try:
        result = pool.run("k", targets.stack_signal_blocked, timeout=60, start_method=method)
    finally:
        pool.close()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before
    assert result.value == {"child": False, "started": False}, result


def test_an_interrupt_while_the_signal_is_held_leaves_the_mask_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C whose handler runs as the mask changes must not leave the pytest process
    with the stack signal blocked for good (every process it starts later would inherit it)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    real = child._signal.pthread_sigmask  # what held_dumps calls (signal's, without enums)

    def interrupted(how: int, mask: object) -> set[int]:
        old = real(how, mask)  # type: ignore[arg-type]
        if how == signal.SIG_BLOCK and mask:
            raise KeyboardInterrupt
        return old

    monkeypatch.setattr(child._signal, "pthread_sigmask", interrupted)
    with pytest.raises(KeyboardInterrupt), child.held_dumps():
        pass
    monkeypatch.undo()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before


def test_grandchildren_are_killed_with_the_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    result, _ = run_reaching(targets.fork_grandchild_and_hang, str(pid_file), timeout=1.0)
    assert result.timed_out
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the timeout")


def test_sigterm_ignoring_child_is_still_killed() -> None:
    result, _ = run_reaching(targets.ignore_sigterm_and_hang, timeout=1.0)
    assert result.timed_out and result.signal == signal.SIGKILL


def test_megabytes_of_output_are_bounded_keeping_head_and_tail() -> None:
    result = run_in_child(targets.flood, 20 * 2**20, timeout=60)
    assert result.returned
    assert result.stdout.startswith("BEGIN")
    assert result.stdout.rstrip().endswith("END")
    assert "bytes omitted" in result.stdout
    assert len(result.stdout) < CAPTURE_HEAD + CAPTURE_TAIL + 200


def test_child_does_not_inherit_pytest_capture(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_in_child(targets.echo, 1, timeout=30)
    assert result.stdout == "to stdout\n"
    out, err = capfd.readouterr()
    assert "to stdout" not in out and "to fd 2" not in err


def test_a_child_that_ends_after_its_result_is_reaped_before_the_parent_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Waited for, not left exiting beside the parent: while it lives, every page either
    process writes is copied (``exits_soon``)."""
    monkeypatch.setattr(supervise, "EXIT_WAIT", 30.0)  # a loaded machine: the exit may be slow
    supervise.reap_pending()
    result = run_in_child(os.getpid, timeout=60)
    assert result.returned and result.exitcode == 0
    assert not supervise._PENDING
    with pytest.raises(ChildProcessError):  # reaped already: no zombie is left
        os.waitpid(result.value, os.WNOHANG)


def _says_it_holds_a_device_context() -> int:
    import torch

    torch.cuda.is_initialized = lambda: True  # this child only: as one that used CUDA says
    return os.getpid()


def test_a_child_holding_a_device_context_is_not_waited_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A device context's teardown takes far longer than a CPU child's exit: such a child is
    left to end while the session goes on, as before."""
    monkeypatch.setattr(supervise, "EXIT_WAIT", 30.0)
    supervise.reap_pending()
    result = run_in_child(_says_it_holds_a_device_context, timeout=60)
    assert result.returned and result.exitcode == 0
    assert [run.pid for run in supervise._PENDING] == [result.value]
    supervise.reap_pending()


def test_returned_children_are_reaped_bounded_and_all_at_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "EXIT_WAIT", 0.0)  # every one left exiting: pending
    pids = []
    for _ in range(supervise.MAX_PENDING + 5):
        result = run_in_child(os.getpid, timeout=60)
        assert result.returned and result.exitcode == 0
        pids.append(result.value)
        assert len(supervise._PENDING) <= supervise.MAX_PENDING + 1
    supervise.reap_pending()
    assert not supervise._PENDING
    for pid in pids:
        with pytest.raises(ChildProcessError):  # reaped: no zombie is left
            os.waitpid(pid, os.WNOHANG)


@needs_zygote
def test_forkserver_children_are_not_children_of_pytest() -> None:
    result = run_in_child(os.getppid, timeout=60, start_method="forkserver")
    assert result.returned and result.start_method == "forkserver"
    assert result.value == zygote.forkserver().pid != os.getpid()


@needs_zygote
def test_a_zygote_child_runs_in_the_context_the_parent_has_now(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The zygote is sent the parent's environment, import path and folder only where they
    changed since its last child, and holds them itself: each child still sees them as they
    are in the parent at its run, a variable removed since included."""
    monkeypatch.setenv("GPUCASE_CONTEXT_PROBE", "first")
    first = run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", timeout=60,
                         start_method="forkserver")
    assert first.value == ("first", sys.path[0], os.getcwd())
    again = run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", timeout=60,
                         start_method="forkserver")
    assert again.value == first.value  # nothing changed, nothing sent: still held
    monkeypatch.delenv("GPUCASE_CONTEXT_PROBE")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    changed = run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", timeout=60,
                           start_method="forkserver")
    assert changed.value == (None, str(tmp_path), str(tmp_path))


@needs_zygote
def test_a_variable_gone_before_the_zygotes_first_run_is_gone_in_its_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote starts with the environment the parent had then; its first run replaces
    that environment whole, a variable removed since included."""
    zygote.stop_forkserver()
    monkeypatch.setenv("GPUCASE_CONTEXT_PROBE", "at the zygote's start")
    zygote.forkserver()
    monkeypatch.delenv("GPUCASE_CONTEXT_PROBE")
    result = run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", timeout=60,
                          start_method="forkserver")
    assert result.returned and result.value[0] is None


@needs_zygote
def test_a_variable_the_c_library_refuses_neither_ends_the_zygote_nor_its_runs() -> None:
    """An environment can hold a variable with an empty name (``=value``), which os.environ
    lists and the C library refuses to set: the zygote leaves it, and serves on."""
    script = ("import os\nfrom pytest_gpucase.run.isolation import run_in_child\n"
              "for _ in range(2):\n"
              "    r = run_in_child(os.getppid, timeout=60, start_method='forkserver')\n"
              "    print(r.returned, r.problem)\n")
    env = {name: value for name, value in os.environ.items() if name}
    done = subprocess.run(["env", "=odd=1", sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["True None", "True None"], done.stderr


@pytest.mark.parametrize("method", FORKING)
def test_prepare_is_entered_in_the_process_that_forks(method: str) -> None:
    """What a run's ``prepare`` finds is found by the process that forks its child (this
    one, or the zygote), inherited by that child, and dropped there after the fork."""
    result = run_in_child(targets.prepared_here, timeout=60, start_method=method,
                          prepare=(targets.marking_prepare, ("found",), {}))
    assert result.returned
    value, where, parent = result.value
    assert value == "found" and where == parent
    assert parent == (os.getpid() if method == "fork" else zygote.forkserver().pid)
    assert not targets.PREPARED  # dropped here, or never made here
    later = run_in_child(targets.prepared_here, timeout=60, start_method=method)
    assert later.value[:2] == (None, None)  # the zygote dropped it too


@pytest.mark.parametrize("method", FORKING)
def test_a_prepare_that_fails_is_left_to_the_child(method: str) -> None:
    result = run_in_child(targets.prepared_here, timeout=60, start_method=method,
                          prepare=(targets.marking_prepare, ("found",), {"fail": True}))
    assert result.returned and result.value[:2] == (None, None)


@needs_zygote
def test_a_prepare_the_zygote_cannot_get_is_left_to_the_child() -> None:
    @contextlib.contextmanager
    def local() -> Iterator[None]:  # a local function: not picklable
        yield

    result = run_in_child(targets.prepared_here, timeout=60, start_method="forkserver",
                          prepare=(local, (), {}))
    assert result.returned and result.value[:2] == (None, None)


@needs_zygote
def test_a_run_the_zygote_never_got_leaves_it_nothing_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails before it reaches the zygote (a job that cannot be pickled) sends
    nothing: the next run still brings the zygote what changed, the whole of it."""
    import threading

    zygote.forkserver()
    monkeypatch.setenv("GPUCASE_CONTEXT_PROBE", "set after the zygote started")
    with pytest.raises(TypeError):
        run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", threading.Lock(),
                     timeout=60, start_method="forkserver")
    after = run_in_child(targets.process_context, "GPUCASE_CONTEXT_PROBE", timeout=60,
                         start_method="forkserver")
    assert after.value[0] == "set after the zygote started"


@needs_zygote
def test_a_folder_made_again_at_the_same_path_is_the_childs_folder(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert run_in_child(targets.process_context, "X", timeout=60,
                        start_method="forkserver").returned
    monkeypatch.chdir(tmp_path)
    folder.rmdir()
    folder.mkdir()
    monkeypatch.chdir(folder)
    (folder / "data.txt").write_text("second")
    result = run_in_child(Path("data.txt").read_text, timeout=60, start_method="forkserver")
    assert result.returned and result.value == "second", result.problem


@needs_zygote
def test_the_zygotes_prepare_is_no_part_of_the_run() -> None:
    """As in the pytest process, what the zygote prepares before the fork is not the run's
    time: a run with a 2 s timeout whose prepare takes 3 s does not time out. (The round
    trip to the zygote and its fork are the run's time: on a loaded runner they took more
    than a second, and a 1 s timeout failed the run for them.)"""
    result = run_in_child(targets.nothing, timeout=2.0, start_method="forkserver",
                          prepare=(targets.slow_prepare, (3.0,), {}))
    assert result.returned and not result.timed_out


@needs_zygote
def test_a_zygote_that_does_not_fork_in_time_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepare that blocks the zygote (a case file replaced by a FIFO) would stop every
    run of the session: past the run's timeout and a grace, the zygote is ended, the run
    says why, and the next run gets a new zygote."""
    stuck = zygote.forkserver()
    monkeypatch.setattr(isolation, "ANSWER_GRACE", 0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not fork the run's child within 1 s"):
        run_in_child(targets.nothing, timeout=0.5, start_method="forkserver",
                     prepare=(targets.slow_prepare, (60.0,), {}))
    assert time.monotonic() - start < 30
    with pytest.raises(ChildProcessError):
        os.waitpid(stuck.pid, os.WNOHANG)  # killed and reaped
    assert run_in_child(os.getpid, timeout=60, start_method="forkserver").returned


@needs_zygote
def test_ctrl_c_while_the_zygote_forks_leaves_no_answer_for_the_next_run() -> None:
    """Ctrl-C while the pytest process waits on the zygote's answer: the zygote answers
    later, and a next run that read that answer as its own would watch another run's child.
    The zygote is ended instead, and the next run gets a new one."""
    import threading

    interrupted = zygote.forkserver()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_child(targets.nothing, timeout=60, start_method="forkserver",
                         prepare=(targets.slow_prepare, (2.0,), {}))
    finally:
        timer.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(interrupted.pid, os.WNOHANG)  # killed and reaped
    time.sleep(2)  # when the answer would have come
    result = run_in_child(os.getppid, timeout=60, start_method="forkserver")
    assert result.returned and result.value == zygote.forkserver().pid != interrupted.pid


@needs_zygote
def test_an_ended_zygote_is_never_signalled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once ended and reaped, a zygote's pid may be another process's: nothing signals or
    waits for it again, and the next run starts another zygote."""
    ended = zygote.forkserver()
    ended.kill()
    assert ended.ended and zygote._ZYGOTE is None
    signalled: list[tuple[str, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append(("kill", pid)))
    ended.kill()
    ended.stop()
    assert not ended.alive() and not signalled
    monkeypatch.undo()
    result = run_in_child(os.getppid, timeout=60, start_method="forkserver")
    assert result.returned and result.value == zygote.forkserver().pid != ended.pid


@pytest.mark.parametrize("method", FORKING)
def test_ctrl_c_in_a_prepare_leaks_no_pipe(method: str) -> None:
    if method == "forkserver":
        # Its socket, held for the session, is no leak: counted before, whichever test
        # (on this xdist worker) started the zygote first, or ended it.
        zygote.forkserver()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        try:
            run_in_child(targets.nothing, timeout=60, start_method=method,
                         prepare=(targets.interrupted_prepare, (), {}))
        except KeyboardInterrupt:
            assert method == "fork"  # the zygote's prepare is the child's to meet
    assert len(os.listdir("/proc/self/fd")) == before


@needs_zygote
def test_the_forks_to_come_are_told_to_the_zygote() -> None:
    """Where the zygote forks the session's children, it is the one whose huge pages pay
    for them (``hugepages.expect_forks``)."""
    zygote.forkserver()
    isolation.expect_forks(500)
    try:
        result = run_in_child(targets.expected_forks, timeout=60, start_method="forkserver")
    finally:
        isolation.expect_forks(0)
    assert result.returned and result.value is not None
    expected, off = result.value
    assert expected == (500 if off else 499)  # counted down by the fork it made


@needs_zygote
def test_a_zygote_started_later_in_the_session_is_told_the_forks_to_come() -> None:
    zygote.forkserver()
    isolation.expect_forks(500)
    try:
        zygote.forkserver().kill()  # ended (it stopped answering): the next run starts another
        result = run_in_child(targets.expected_forks, timeout=60, start_method="forkserver")
    finally:
        isolation.expect_forks(0)
    assert result.returned and result.value is not None
    expected, off = result.value
    assert expected == (500 if off else 499)


@needs_zygote
def test_auto_picks_the_forkserver_once_cuda_is_initialized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert isolation.default_start_method() == "fork"
    monkeypatch.setattr(zygote, "_cuda_initialized", lambda: True)
    assert isolation.default_start_method() == "forkserver"


@needs_zygote
def test_the_zygote_ends_with_the_session() -> None:
    zygote_pid = zygote.forkserver().pid
    isolation.shutdown()
    with pytest.raises(ChildProcessError):
        os.waitpid(zygote_pid, os.WNOHANG)  # reaped
    assert run_in_child(os.getpid, timeout=60, start_method="forkserver").returned  # anew


@needs_zygote
def test_the_zygote_dies_with_a_killed_pytest(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = ("import os, sys, time\nfrom pytest_gpucase.run.isolation import zygote\n"
              "print(zygote.forkserver().pid, flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        zygote = int(owner.stdout.readline())
        owner.kill()
        owner.wait()
        end = time.monotonic() + 60
        while time.monotonic() < end and Path(f"/proc/{zygote}").exists():
            state = Path(f"/proc/{zygote}/stat").read_bytes().rsplit(b")", 1)[-1].split()[0]
            if state in (b"Z", b"X"):
                break
            time.sleep(0.05)
        assert not Path(f"/proc/{zygote}").exists() or state in (b"Z", b"X")
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_a_clipped_text_keeps_its_true_count_through_the_parent() -> None:
    """The child clips a long message, the parent clips what it reads again: the second
    pass used to drop the first one's line and say "[... 34 bytes omitted ...]"."""
    from pytest_gpucase.run.isolation import clip, decode, encode

    text = "x" * 9_000_000
    round_trip = decode(encode(text))
    assert round_trip == clip(text)
    (line,) = [line for line in round_trip.splitlines() if "omitted" in line]
    kept = len(round_trip) - len(line) - 2  # the head and the tail, around "\n" + line + "\n"
    assert line == f"[... {len(text) - kept} bytes omitted ...]"


def test_a_result_dataclass_is_encoded_without_asking_the_mapping_abc() -> None:
    """A forked child asked ``isinstance(outcome, Mapping)`` anew every run (the parent
    never had), walking every subclass of Mapping loaded: a registered dataclass is told
    before, and a plain dict without the ABC. A Mapping of another type is still a dict."""
    import abc
    import collections
    from collections.abc import Mapping

    from pytest_gpucase.run.isolation import decode, encode
    from pytest_gpucase.run.outcome import Outcome

    outcome = Outcome("passed", "outputs match", kind="passed", notes=("a",),
                      budgets=({"path": "out", "ratio": 0.5},))
    abc._reset_caches(Mapping)  # type: ignore[attr-defined]
    assert decode(encode(outcome)) == outcome
    assert decode(encode({"a": (1, 2.5)})) == {"a": (1, 2.5)}
    _, positive, negative, _ = abc._get_dump(Mapping)  # type: ignore[attr-defined]
    asked = {ref() for ref in (*positive, *negative)}
    assert Outcome not in asked and dict not in asked
    chained = collections.ChainMap({"b": 1})
    assert decode(encode(chained)) == {"b": 1}


@pytest.mark.parametrize("shift", range(12))
def test_a_cut_leaves_no_fragment_of_a_terminal_escape_sequence(shift: int) -> None:
    """Coloured output cut inside an escape sequence left "red\\x1b[" before the omitted
    line and "[31mred" after it; the cut now moves off the sequence, and the count says so."""
    from pytest_gpucase.run.isolation import clip

    text = "\x1b[31mred\x1b[0m \x1b]8;;https://example.org\x07link\x1b]8;;\x07 " * 500
    clipped = clip(text, 100 + shift, 200 + shift)
    head, line, tail = clipped.split("\n")
    assert head.startswith("\x1b[31mred") and text.startswith(head)
    assert text.endswith(tail)
    escapes = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*\x07)")
    for kept in (head, tail):
        # every escape byte begins a whole sequence, and no sequence's rest is left bare
        bare = escapes.sub("", kept)
        assert "\x1b" not in bare and "\x07" not in bare, repr(kept)
        assert not re.match(r"\[?[0-9;]*m|\]?8;;|;?https?:", bare), repr(kept)
    assert line == f"[... {len(text) - len(head) - len(tail)} bytes omitted ...]"


def test_a_cut_drops_only_the_sequence_it_began() -> None:
    """An escape byte earlier in the head that begins no sequence is text, kept as it is;
    an OSC hyperlink cut at its two-byte terminator goes as a whole."""
    from pytest_gpucase.run.isolation import clip

    text = "ab\x1b\x01cd" + "y" * 200
    assert clip(text, 8, 4).split("\n")[0] == "ab\x1b\x01cdyy"
    link = "ab\x1b]8;;https://example.org\x1b\\link" + "y" * 200
    head = clip(link, len("ab\x1b]8;;https://example.org\x1b"), 4).split("\n")[0]
    assert head == "ab"
    tail = clip("y" * 200 + "\x1b]8;;https://example.org\x1b\\link", 4, len("\\link"))
    assert tail.split("\n")[-1] == "link"


def note_and_wait(phases: list[str], seconds: float) -> str:
    """Say each phase in turn, then wait (a hang when ``seconds`` passes the timeout)."""
    for phase in phases:
        isolation.note(phase)
    time.sleep(seconds)
    return "done"


@pytest.mark.parametrize("method", METHODS)
def test_the_last_note_says_what_a_timeout_interrupted(method: str) -> None:
    """The parent reads the child's notes even from the child it killed; a note with a
    newline in it stays one note."""
    hung, _ = run_reaching(note_and_wait, ["calling", "the reference\nline two"], 600,
                           timeout=1.0, start_method=method)
    assert hung.timed_out and not hung.returned
    assert hung.phase == "the reference line two"
    done = run_in_child(note_and_wait, ["calling", "comparing"], 0, timeout=60,
                        start_method=method)
    assert done.returned and done.value == "done"
    assert done.phase == "comparing"
    silent = run_in_child(targets.hang, timeout=1.0, start_method=method)
    assert silent.timed_out and silent.phase is None


@pytest.mark.parametrize("method", FORKING)
def test_a_worker_tells_the_phase_of_each_call(method: str) -> None:
    pool = isolation.WorkerPool()
    try:
        done = pool.run("k", note_and_wait, ["comparing"], 0, timeout=60, start_method=method)
        assert done.returned and done.phase == "comparing"
        quiet = pool.run("k", os.getpid, timeout=60, start_method=method)
        assert quiet.returned and quiet.phase is None  # the last call's note is not this one's
        hung = pool.run("k", note_and_wait, ["the reference"], 600, timeout=1.0,
                        start_method=method)
        assert hung.timed_out and hung.phase == "the reference"
    finally:
        pool.close()



LABEL = "--- a label ---\n"
SAID = "the label's part begins inside them"


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_mark_in_the_omitted_middle_is_named_by_the_omission_line(chunk: int) -> None:
    """A label the child writes before a part of its output (the float64 reference's) was
    lost when the cut dropped it: the tail, all of it that part, read as what came before.
    Whatever the chunks the pipe delivers, and wherever the line falls against them."""
    def captured(text: str) -> list[str]:
        capture = clipping._Capture(100, 200, marks={LABEL: SAID})
        data = text.encode()
        for start in range(0, len(data), chunk):
            capture.add(data[start:start + chunk])
        return [line for line in capture.text().split("\n") if "omitted" in line]

    before, after = "b" * 1000, "a" * 1000
    (line,) = captured(before + LABEL + after)
    assert line.endswith(f" bytes omitted; {SAID} ...]")
    for where in (len(before) + len(LABEL) - 1, len(before) + 1):  # a line the cut began
        (line,) = captured("b" * 1000 + LABEL + "a" * (200 - len(LABEL) + where - 1000))
        assert SAID in line
    # A label kept in the head or in the tail is seen as it is: the line says nothing.
    for text in (LABEL + before + after, before + after + LABEL, before + LABEL[:-1]):
        (line,) = captured(text)
        assert SAID not in line
    assert captured(LABEL + "short") == []  # nothing omitted, no line


def test_a_passing_run_never_reads_its_childs_start_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The start time bounds what a kill may reach (``_Run.since``): read from /proc when a
    kill or a memory sample needs it, not after every fork (0.17 ms of the parent's, while
    the child shares its pages); a killed run still reads it (the grandchildren test)."""
    seen: list[int] = []
    real = supervise._stat  # type: ignore[attr-defined]

    def spied(pid: int) -> object:
        seen.append(pid)
        return real(pid)

    monkeypatch.setattr(supervise, "_stat", spied)
    result = run_in_child(os.getpid, timeout=60)
    assert result.returned and result.value != os.getpid()
    assert result.value not in seen


@pytest.mark.parametrize("method", METHODS)
def test_a_child_writes_text_on_its_own_fds_line_by_line(method: str) -> None:
    """The child's sys.stdout and sys.stderr, made once by the parent for every fork, write
    to the child's fds 1 and 2 (its pipes), not to the file those numbers held in the parent
    when they were made (pytest's capture of this test)."""
    result = run_in_child(targets.streams, timeout=30, start_method=method)
    assert result.returned, result.problem
    assert result.value == [1, 2, True, True, "replace"]
    assert result.stdout == "déjà vu\nafter\n"
    assert result.stderr == "naïve\n"


def _bare_fork_stdout(func: object, *args: object) -> str:
    """What a bare fork's stdout pipe receives from ``func(*args)`` when its sys.stdout is the
    file ``open`` makes on fd 1 (what a child made for itself before it inherited one)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the bare child
        os.dup2(write, 1)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
        try:
            func(*args)  # type: ignore[operator]
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return data.decode()


@pytest.mark.parametrize("method", METHODS)
def test_a_crash_loses_no_more_of_the_output_than_a_file_of_the_childs_own(method: str) -> None:
    """Text without a newline that the text layer has passed on to the buffer below it is
    written once it fills a pipe's block, as in a file ``open`` makes on the child's pipe (a
    spawned child's: as its interpreter's stream, unbuffered under PYTHONUNBUFFERED): a child
    that crashes (or is killed at its timeout) after it keeps that much of its output."""
    if method == "spawn":
        code = "import os, sys\nfor _ in range(3): sys.stdout.write('x' * 3000)\nos.abort()"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
        expected = done.stdout.count(b"x")
    else:
        expected = _bare_fork_stdout(targets.partial_then_abort, 3000, 3).count("x")
    assert expected > 0  # what a file of the child's own had written
    result = run_in_child(targets.partial_then_abort, 3000, 3, timeout=30, start_method=method)
    assert result.signal == signal.SIGABRT, result.problem
    assert result.stdout.count("x") == expected


@pytest.mark.parametrize("method", FORKING)
def test_a_childs_std_streams_tell_their_name_and_mode(method: str) -> None:
    """``sys.stdout.name`` and ``.mode``, which a file ``open`` makes has and code reads (a
    logger, a progress bar), are there as they were: the fd's number and "w"."""
    result = run_in_child(targets.stream_attributes, timeout=30, start_method=method)
    assert result.returned, result.problem
    assert result.value[:5] == [1, "w", 2, "w", 1]
    assert result.value[5].startswith("<_io.TextIOWrapper name=1 mode='w'")


def test_a_spawned_child_writes_in_the_encoding_its_environment_names() -> None:
    """A spawned child's streams are its interpreter's, as PYTHONIOENCODING makes them."""
    result = run_in_child(targets.stdout_encoding, timeout=30, start_method="spawn",
                          env={"PYTHONIOENCODING": "latin-1"})
    assert result.returned, result.problem
    assert codecs.lookup(result.value).name == "iso8859-1"


@pytest.mark.parametrize("method", FORKING)
def test_a_print_goes_out_while_the_case_has_os_write_replaced(method: str) -> None:
    """The child's streams write to their fd as a file ``open`` makes does, not through
    ``os.write`` as the case has it: a case's double of it sees none of the prints, and
    swallows none."""
    result = run_in_child(targets.print_while_os_write_is_patched, timeout=30,
                          start_method=method)
    assert result.returned, result.problem
    assert result.value == []
    assert result.stdout == "printed\n"

"""The suite's warm sessions (``tests/warm.py``) behave as the cold ``python -m pytest`` they
replace: what a session sees of its interpreter, its exit, its output, its timeout."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from . import warm

pytestmark = pytest.mark.skipif(warm._COLD,
                                reason="GPUCASE_TEST_COLD=1: no warm session to compare")

SEEN = """
    import atexit, json, os, sys

    def test_seen():
        seen = {"argv0": sys.argv[0], "path0": sys.path[0], "cwd": os.getcwd(),
                "marker": os.environ.get("WARM_MARKER"),
                "pythonpath": os.environ.get("PYTHONPATH"),
                "gpucase": "pytest_gpucase" in sys.modules}
        with open("seen.json", "w") as handle:
            json.dump(seen, handle)
        atexit.register(lambda: open("exited", "w").close())
"""


def seen(pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    pytester.makepyfile(test_seen=SEEN)
    result = pytester.runpytest_subprocess("-p", "gpucase", "test_seen.py")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "exited").exists()  # the interpreter's own exit, atexit and all
    (pytester.path / "exited").unlink()
    return json.loads((pytester.path / "seen.json").read_text()), capsys.readouterr().out


def test_a_warm_session_sees_what_a_cold_one_sees(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WARM_MARKER", "set by the test")
    warm_seen, printed = seen(pytester, capsys)
    assert "running (warm):" in printed
    monkeypatch.setattr(warm, "_COLD", True)
    cold_seen, printed = seen(pytester, capsys)
    assert "running (warm):" not in printed
    assert warm_seen == cold_seen
    assert warm_seen["marker"] == "set by the test"
    assert warm_seen["path0"] == str(pytester.path) and warm_seen["cwd"] == str(pytester.path)
    assert warm_seen["argv0"].endswith(os.path.join("pytest", "__main__.py"))


@pytest.mark.parametrize("body, code", [
    ("def test_ok():\n    pass\n", pytest.ExitCode.OK),
    ("def test_bad():\n    assert False\n", pytest.ExitCode.TESTS_FAILED),
    ("", pytest.ExitCode.NO_TESTS_COLLECTED),
    ("import sys\nsys.exit(3)\n", None),  # a SystemExit at collection: as cold gives it
    ("import os\n\ndef test_dies():\n    os._exit(7)\n", 7),
])
def test_a_warm_session_exits_as_a_cold_one(pytester: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch,
                                            body: str, code: int | None) -> None:
    pytester.makepyfile(test_exit=body)
    warm_result = pytester.runpytest_subprocess("test_exit.py")
    monkeypatch.setattr(warm, "_COLD", True)
    cold_result = pytester.runpytest_subprocess("test_exit.py")
    assert warm_result.ret == cold_result.ret
    assert code is None or warm_result.ret == code
    assert warm_result.outlines[-1:] and (warm_result.outlines[-1].split(" in ")[0]
                                          == cold_result.outlines[-1].split(" in ")[0])


def test_a_session_that_changes_what_torch_reads_at_import_runs_cold(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    pytester.makepyfile(test_threads=textwrap.dedent("""
        import os

        import torch

        def test_threads():
            assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() >= 1
    """))
    pytester.runpytest_subprocess("test_threads.py").assert_outcomes(passed=1)
    assert "running (warm):" not in capsys.readouterr().out


def test_a_warm_session_past_its_timeout_is_killed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_hang=textwrap.dedent(f"""
        import os, time

        def test_hang():
            with open({str(pytester.path / "pid")!r}, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(600)
    """))
    with pytest.raises(pytester.TimeoutExpired):
        pytester.runpytest_subprocess("test_hang.py", timeout=10)
    pid = int((pytester.path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped by the warm interpreter
    # The warm interpreter serves the next session.
    pytester.makepyfile(test_after="def test_after():\n    pass\n")
    pytester.runpytest_subprocess("test_after.py").assert_outcomes(passed=1)


class Interrupted(Exception):
    pass


def test_a_warm_run_interrupted_leaves_the_next_session_its_own_answers(
        pytester: pytest.Pytester) -> None:
    """A signal handler (pytest-timeout's, say) that raises while a warm session runs: that
    session ends, and the next one reads its own exit, not the interrupted one's."""
    pid_file = pytester.path / "pid"
    pytester.makepyfile(test_sleep=textwrap.dedent(f"""
        import os, signal, time

        def test_sleep():
            with open({str(pid_file)!r}, "w") as handle:
                handle.write(str(os.getpid()))
            os.kill({os.getpid()}, signal.SIGUSR1)  # the test process is interrupted now
            time.sleep(600)
    """))

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    before = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(Interrupted):
            pytester.runpytest_subprocess("test_sleep.py")
    finally:
        signal.signal(signal.SIGUSR1, before)
    pid = int(pid_file.read_text())
    for _ in range(200):  # killed, and reaped by its server, which ends too
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    pytester.makepyfile(test_after="def test_after():\n    assert False\n")
    result = pytester.runpytest_subprocess("test_after.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)


def test_a_warm_session_keeps_sigint_as_the_test_process_left_it(
        pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    """A suite started with Ctrl-C ignored (``nohup``, a script's ``&``) starts its sessions
    with it ignored: so does a warm one."""
    pytester.makepyfile(test_sigint=textwrap.dedent("""
        import signal

        def test_sigint():
            print("SIGINT:", signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
    """))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = warm._Server()  # started as the suite's is: by this process
        try:
            ignored = warm._warm_run(pytester, server, [sys.executable, "-mpytest", "-s",
                                                        "test_sigint.py"],
                                     {**os.environ, "PYTHONPATH": str(pytester.path)}, 60)
        finally:
            server.close()
    finally:
        signal.signal(signal.SIGINT, before)
    assert ignored.ret == 0 and "SIGINT: True" in ignored.stdout.str()
    default = pytester.runpytest_subprocess("-s", "test_sigint.py")
    assert "SIGINT: False" in default.stdout.str()
    assert "running (warm):" in capsys.readouterr().out


def test_a_session_with_a_sitecustomize_or_a_shadowing_module_runs_cold(
        pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    for name in ("sitecustomize.py", "numpy"):
        path = pytester.path / name
        path.mkdir() if not name.endswith(".py") else path.write_text("")
        pytester.runpytest_subprocess("test_unit.py").assert_outcomes(passed=1)
        assert "running (warm):" not in capsys.readouterr().out, name
        path.rmdir() if path.is_dir() else path.unlink()
    pytester.makeini("[pytest]\n")  # pytest.ini is no module: warm
    pytester.runpytest_subprocess("test_unit.py").assert_outcomes(passed=1)
    assert "running (warm):" in capsys.readouterr().out

"""End to end: requirements, selection, JSON results, xdist, interruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_gpucase.plugin.report_writer import ReportWriter
from pytest_gpucase.plugin.state import SigintLost
from pytest_gpucase.report.file import load_report
from tests.helpers import RAISES, ce_case, install_fake_distribution, write_case


def test_gpu_requires_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_req="""
        import pytest

        @pytest.mark.gpu_requires(torch=">=2.1", backends=["cpu", "cuda"])
        def test_met():
            pass

        @pytest.mark.gpu_requires(torch=">=99")
        def test_new_torch():
            pass

        @pytest.mark.gpu_requires(packages={"flash-attn": ">=2.5"})
        def test_extension():
            pass

        @pytest.mark.gpu_requires(backends=["rocm"])
        def test_rocm():
            pass
    """)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines_random([
        "SKIPPED [[]1[]] test_req.py:7: requires torch>=99; found *",
        "SKIPPED [[]1[]] test_req.py:11: requires flash-attn>=2.5; not installed",
        # "a CPU-only build" on a CPU wheel, "a CUDA build" on a CUDA wheel
        "SKIPPED [[]1[]] test_req.py:15: requires backend rocm; this is a * build",
    ])


def test_a_bad_gpu_requires_errors_its_test_alone(pytester: pytest.Pytester) -> None:
    # As pytest does with a skipif condition it cannot evaluate: that test errors, with the
    # fix, and the session runs the others (it was a usage error that ran nothing).
    pytester.makepyfile(test_req="""
        import pytest

        @pytest.mark.gpu_requires(torch="2.1")
        def test_bad_specifier():
            pass

        @pytest.mark.gpu_requires(">=2")
        def test_positional():
            pass

        @pytest.mark.gpu_requires(torhc=">=2")
        def test_unknown_key():
            pass

        @pytest.mark.parametrize("packages", ["flash-attn", ["flash-attn"], 5, {1: ">=1"},
                                              {"": ">=1"}])
        def test_bad_packages(packages, request):
            pass

        @pytest.mark.parametrize("backends", [5, [], [None]])
        def test_bad_backends(backends):
            pass

        def test_other():
            pass
    """)
    # The marker's values come from the parametrization: applied per item by a conftest.
    pytester.makeconftest("""
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                params = getattr(item, "callspec", None)
                if params is not None:
                    item.add_marker(pytest.mark.gpu_requires(**params.params))
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=11)
    result.stdout.fnmatch_lines_random([
        "test_req.py::test_bad_specifier: gpu_requires: torch='2.1' is not a PEP 440 "
        "specifier; write it like '>=2.1'",
        "test_req.py::test_positional: gpu_requires takes keyword arguments only, got '>=2'; "
        "write it like gpu_requires(torch='>=2.1', backends=[[]'cuda'[]])",
        "test_req.py::test_unknown_key: gpu_requires: unknown argument 'torhc'; expected *",
        "test_req.py::test_bad_packages[[]flash-attn[]]: gpu_requires: packages='flash-attn' is "
        "not a dict of package names to specifiers; write it like packages={'flash-attn': "
        "'>=2.5'}",
        "test_req.py::test_bad_backends[[]backends1[]]: gpu_requires: backends=[[][]] is not a "
        "backend or a non-empty list of them; write it like backends=[[]'cuda', 'rocm'[]]",
        "test_req.py::test_bad_backends[[]backends2[]]: gpu_requires: unknown backend None; *",
    ])


def test_device_and_dtype_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fix="""
        import torch

        def test_add(gpu_device, gpu_dtype):
            x = torch.ones(3, device=gpu_device, dtype=gpu_dtype)
            assert (x + x).sum().item() == 6
    """)
    result = pytester.runpytest_subprocess("-v", "-rs", "--gpu-dtypes", "float32,bfloat16")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines_random([
        "*test_add[[]cpu-float32[]] PASSED*",
        "*test_add[[]cpu-bfloat16[]] PASSED*",
        "*test_add[[]cuda-float32[]] SKIPPED*",
    ])


def test_select_by_markers(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "ce", [0, 2, 3], "", top="")
    (pytester.path / "cases" / "ce" / "case.toml").write_text(
        (pytester.path / "cases" / "ce" / "case.toml").read_text()
        + '[matrix]\ndtypes = ["float32", "bfloat16"]\n')
    result = pytester.runpytest_subprocess("--gpu-cases", "-m", "backend_cpu and dtype_bfloat16",
                                           "-v", "cases")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["*ce[[]cpu-bfloat16[]] PASSED*"])


def run_with_report(pytester: pytest.Pytester, *args: str) -> dict:
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-report", str(path),
                                           *args, "cases")
    result.stdout.fnmatch_lines([f"gpucase: JSON report written to {path}"])
    return load_report(path)


def make_three_cases(root: Path) -> None:
    ce_case(root, "ok", [0, 2, 4], RAISES)
    ce_case(root, "fixed", [0, 2, 3], RAISES)
    ce_case(root, "known", [0, 2, 4], "", top='xfail = "labels not remapped yet"')


def test_json_report_records_every_item(pytester: pytest.Pytester) -> None:
    make_three_cases(pytester.path)
    report = run_with_report(pytester)
    assert report["complete"] is True
    assert report["environment"]["backend"] == "cpu"
    by_id = {r["nodeid"]: r for r in report["results"]}
    assert by_id["cases/ok/case.toml::ok[cpu-float32]"]["outcome"] == "passed"
    assert by_id["cases/ok/case.toml::ok[cpu-float32]"]["error_type"] == "ValueError"
    fixed = by_id["cases/fixed/case.toml::fixed[cpu-float32]"]
    assert fixed["outcome"] == "failed"
    assert fixed["message"].startswith("expected ValueError matching 'out of range'")
    assert by_id["cases/known/case.toml::known[cpu-float32]"]["outcome"] == "xfailed"
    cuda = by_id["cases/ok/case.toml::ok[cuda-float32]"]
    assert cuda["outcome"] == "skipped"
    assert cuda["skip_reason"].startswith("no CUDA device here")
    assert {r["case"] for r in report["results"]} == {"ok", "fixed", "known"}


def _comparable(report: dict) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k != "duration"} for r in report["results"]),
                  key=lambda r: r["nodeid"])


def test_xdist_report_equals_serial_report(pytester: pytest.Pytester) -> None:
    make_three_cases(pytester.path)
    serial = run_with_report(pytester, "-p", "no:benchmark")
    parallel = run_with_report(pytester, "-p", "no:benchmark", "-n", "2", "--gpu-per-worker")
    assert _comparable(parallel) == _comparable(serial)
    assert len(serial["results"]) == 6


def test_github_step_summary_is_appended(pytester: pytest.Pytester,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    make_three_cases(pytester.path)
    summary = pytester.path / "summary.md"
    summary.write_text("# earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    pytester.runpytest_subprocess("--gpu-cases", "cases")
    text = summary.read_text()
    assert text.startswith("# earlier step\n")
    assert "fixed" in text and "failed" in text



def test_a_step_summary_that_cannot_be_written_changes_no_verdict(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container step without the runner's summary file: the traceback failed a passing
    run and junit's XML was never written."""
    ce_case(pytester.path, "fixed", [0, 2, 3], "")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(pytester.path / "missing" / "summary.md"))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--junitxml", "out/junit.xml", "cases")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["gpucase: could not append the step summary to "
                                 "GITHUB_STEP_SUMMARY (*summary.md): No such file or directory; "
                                 "the run's results are unchanged"])
    assert (pytester.path / "out" / "junit.xml").exists()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize(("where", "error"), [
    ("folder", "argument --gpu-cases-report: 'folder' is a directory; give a file name, e.g. "
               "folder/gpucase.json"),
    ("afile/r.json", "--gpu-cases-report afile/r.json: cannot make its folder (a file is in the "
                     "way); give a path in a folder you can write"),
    ("/proc/r.json", "--gpu-cases-report /proc/r.json: cannot write a file in its folder (*); "
                     "give a path in a folder you can write"),
])
def test_a_report_path_that_cannot_hold_the_report_is_a_usage_error(
        pytester: pytest.Pytester, where: str, error: str) -> None:
    ce_case(pytester.path, "fixed", [0, 2, 3], "")
    (pytester.path / "folder").mkdir()
    (pytester.path / "afile").write_text("")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-report", where, "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {error}"])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


def test_a_report_that_cannot_be_written_any_more_is_a_note(pytester: pytest.Pytester) -> None:
    """The report's folder replaced by a file during the run: a note, not an internal
    error."""
    case = pytester.path / "cases" / "removes"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[matrix]\n'
                                    'devices = ["cpu"]\n')
    out = pytester.path / "out"
    (case / "case.py").write_text(f"import shutil\n\ndef run():\n"
                                  f"    shutil.rmtree({str(out)!r}, ignore_errors=True)\n"
                                  f"    open({str(out)!r}, 'w').close()\n"
                                  "    return 1.0\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-report", "out/r.json",
                                           "cases")
    # Asked for and out of date: the run fails, saying why (a CI job went green).
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "gpucase: could not write the JSON report out/r.json: File exists",
        "gpucase: the run fails: the JSON report --gpu-cases-report asked for is missing or out "
        "of date"])
    assert "JSON report written" not in result.stdout.str()



@pytest.mark.parametrize("args", [["-x"], ["--maxfail", "1", "-n", "2"]], ids=["x", "xdist"])
def test_a_run_stopped_early_is_not_complete(pytester: pytest.Pytester, args: list[str]) -> None:
    """-x after the first failure recorded "complete": true for a run of one item in four; a
    matrix or a dashboard reading the report took it for the finished run."""
    for name in ("a_fails", "b", "c", "d"):
        ce_case(pytester.path, name, [0, 2, 4], "" if name == "a_fails" else RAISES)
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", *args,
                                           "--gpu-cases-report", str(path), "cases")
    assert result.ret in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED)  # xdist: 2
    report = load_report(path)
    ran = [r for r in report["results"] if r["outcome"] != "not run"]
    assert len(ran) < 4
    assert report["complete"] is False
    # Serially, the items -x left unstarted are recorded as such (the matrix has their rows);
    # an xdist controller collects nothing and cannot name them.
    not_run = [r for r in report["results"] if r["outcome"] == "not run"]
    assert len(not_run) == (4 - len(ran) if "-x" in args else 0)
    assert all(r["message"] == "the run stopped before it started (stopping after 1 failures)"
               for r in not_run)
    assert report["version"] == (2 if not_run else 1)
    # and a run that ends on its own is complete, failures or not
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-n", "2",
                                           "--gpu-cases-report", str(path), "cases")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = load_report(path)
    assert len(report["results"]) == 4 and report["complete"] is True

def test_interrupted_run_leaves_a_valid_report(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "a_first", [0, 2, 4], RAISES)
    stop = pytester.path / "cases" / "b_stop"
    stop.mkdir()
    (stop / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[matrix]\n'
                                    'devices = ["cpu"]\n')
    # The child interrupts the pytest process, as one press of Ctrl-C in the terminal would:
    # once (the reference run, the call again, must not press it a second time; a second
    # SIGINT while pytest reports the first ends it as Python's own handler does).
    (stop / "case.py").write_text(
        "import os, signal\n\ndef run():\n"
        "    pressed = os.path.join(os.path.dirname(__file__), 'pressed')\n"
        "    if not os.path.exists(pressed):\n"
        "        open(pressed, 'w').close()\n"
        "        os.kill(os.getppid(), signal.SIGINT)\n")
    ce_case(pytester.path, "c_never", [0, 2, 4], RAISES)
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-cases-report", str(path), "cases")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = load_report(path)
    assert report["complete"] is False
    # The case that was running is recorded as interrupted, the one never started as not run.
    assert [(r["case"], r["outcome"]) for r in report["results"]] == [
        ("a_first", "passed"), ("b_stop", "interrupted"), ("c_never", "not run")]
    stopped, never = report["results"][1:]
    assert stopped["message"] == "SIGINT (Ctrl-C)"
    assert never["message"] == "the run was interrupted before it started: SIGINT (Ctrl-C)"
    assert (stopped["device"], stopped["dtype"], stopped["case_path"]) == (
        "cpu", "float32", "cases/b_stop")
    json.dumps(report)  # plain JSON all the way down


def test_a_ctrl_c_the_item_raises_again_is_reported_as_the_ctrl_c_it_is() -> None:
    """When the handler's KeyboardInterrupt is lost while a case runs (raised in a finalizer),
    the item raises its own as the run returns: the report tells the same Ctrl-C as when the
    handler's reached pytest, whichever came first."""
    writer = ReportWriter(None)  # type: ignore[arg-type]  # the hook reads no state
    for raised in (SigintLost("SIGINT while the case ran"), KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt) as excinfo:
            raise raised
        writer.pytest_keyboard_interrupt(excinfo)
        assert writer._interrupt == "SIGINT (Ctrl-C)"


def test_a_ctrl_c_whose_keyboard_interrupt_is_lost_still_stops_the_session(
        pytester: pytest.Pytester) -> None:
    # Python raises KeyboardInterrupt wherever the main thread is; inside a finalizer it is
    # printed as ignored and dropped. The plugin notes the signal itself: nothing runs on.
    pytester.makepyfile(test_a_drop="""
        import os, signal

        class Dropper:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)  # raised inside __del__: dropped

        def test_first():
            Dropper()
    """)
    ce_case(pytester.path, "z_never", [0, 2, 4], RAISES)
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--gpu-cases", "--gpu-devices",
                                           "cpu", "--gpu-cases-report", str(path),
                                           "test_a_drop.py", "cases")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*Interrupted: interrupted (SIGINT)*"])
    assert load_report(path)["complete"] is False
    # the case never ran, and the report says so
    assert [(r["case"], r["outcome"], r["message"]) for r in load_report(path)["results"]] == [
        ("z_never", "not run", "the run was interrupted before it started: interrupted (SIGINT)")]


def test_gpu_ablate_adds_the_table_to_a_failing_item(pytester: pytest.Pytester) -> None:
    import torch

    # exp(12) is past float16's largest value (65504): the naive softmax gives NaN.
    write_case(pytester.path, "softmax_fp16", """
        format = 1
        call = "case.py:run"
        [matrix]
        devices = ["cpu"]
        dtypes = ["float16"]
    """, "import torch\n\ndef run(x):\n    e = torch.exp(x)\n"
         "    return e / e.sum(dim=-1, keepdim=True)\n",
        {"x": torch.full((2, 4), 12.0)})
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-ablate", "--gpu-cases-report",
                                           str(path), "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*gpucase ablation*", "*float32*passes*"])
    [record] = load_report(path)["results"]
    assert record["ablation"]["rows"]



def test_gpu_ablate_leaves_a_broken_case_alone(pytester: pytest.Pytester) -> None:
    """A call that does not import: the case is what to fix, not something to ablate."""
    import torch

    write_case(pytester.path, "typo", 'format = 1\ncall = "case.py:runn"\n[matrix]\n'
               'devices = ["cpu"]\n', "def run(x):\n    return x\n", {"x": torch.ones(2)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-ablate", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["cases/typo/case.toml: call: 'case.py' has no 'runn'*"])
    assert "ablation" not in result.stdout.str() and "Traceback" not in result.stdout.str()

def test_broken_case_is_in_the_json_report_and_the_step_summary(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:

    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    write_case(pytester.path, "typo", 'format = 1\ncalll = "case.py:run"\n')
    summary = pytester.path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report = run_with_report(pytester, "--gpu-devices", "cpu")
    by_case = {r["case"]: r for r in report["results"]}
    assert set(by_case) == {"good", "typo"}
    broken = by_case["typo"]
    assert (broken["nodeid"], broken["case_path"], broken["outcome"], broken["error_type"]) == (
        "cases/typo/case.toml::typo", "cases/typo", "failed", "CaseFormatError")
    assert broken["message"] == "cases/typo/case.toml: calll: unknown key; did you mean 'call'?"
    assert ("`cases/typo/case.toml::typo`: cases/typo/case.toml: calll: unknown key"
            in summary.read_text())


def test_junit_properties_are_json(pytester: pytest.Pytester) -> None:
    import xml.etree.ElementTree as ElementTree

    make_three_cases(pytester.path)
    junit = pytester.path / "junit.xml"
    pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                  f"--junitxml={junit}", "cases")
    properties = {(case.get("name"), prop.get("name")): prop.get("value")
                  for case in ElementTree.parse(junit).iter("testcase")
                  for prop in case.iter("property")}
    spec = properties[("ok[cpu-float32]", "gpucase")]
    assert json.loads(spec) == {"case": "ok", "case_path": "cases/ok", "device": "cpu",
                                "dtype": "float32", "launch_blocking": False, "variant": None}
    assert spec == json.dumps(json.loads(spec), sort_keys=True)   # keys sorted, plain JSON
    verdict = json.loads(properties[("fixed[cpu-float32]", "gpucase_result")])
    assert verdict["message"].startswith("expected ValueError matching 'out of range'")
    for value in properties.values():
        json.loads(value, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def test_report_keeps_the_time_the_session_started(pytester: pytest.Pytester) -> None:
    from pytest_gpucase.plan.environment import Environment
    from pytest_gpucase.plugin.state import session_key

    path = pytester.path / "report.json"
    config = pytester.parseconfigure("--gpu-cases", "--gpu-cases-report", str(path))
    state = config.stash[session_key]
    state._env = Environment(backend="cpu", device_types=("cpu",), devices=(), torch=None,
                             cuda=None, hip=None, cudnn=None, python="3.11.9",
                             platform="Linux-x86_64", packages={}, revision=None)
    writer = config.pluginmanager.get_plugin("gpucase-recorder")
    started = writer.created
    assert started.endswith("+00:00")
    writer.created = "2026-12-02T16:00:00+00:00"   # as if the session had started then
    writer.write_report(complete=False)
    writer.write_report(complete=True)
    assert load_report(path)["created"] == "2026-12-02T16:00:00+00:00"


def _terminated_once_started(cwd: Path, started: Path, *args: str) -> tuple[int, str]:
    """Run pytest with ``args``, send it SIGTERM once ``started`` exists (a slow case wrote
    it), as a cancelled CI job does; its exit status and output."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark", *args],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300   # a hang guard for a loaded machine, not a timing
        while not started.exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the slow case never started"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, output


def _marker_case(root: Path, name: str, body: str) -> None:

    write_case(root, name, 'format = 1\ncall = "case.py:run"\ntimeout = 600\n'
               '[matrix]\ndevices = ["cpu"]\n', body)


def test_sigterm_leaves_a_report_of_every_finished_item(pytester: pytest.Pytester) -> None:

    for name in ("a1", "a2", "a3", "a4"):
        ce_case(pytester.path, name, [0, 2, 4], RAISES)
    started = pytester.path / "slow-started"
    _marker_case(pytester.path, "z_slow", f"import pathlib, time\n\ndef run():\n"
                 f"    pathlib.Path({str(started)!r}).write_text('x')\n    time.sleep(600)\n")
    path = pytester.path / "report.json"
    returncode, output = _terminated_once_started(
        pytester.path, started, "--gpu-cases", "--gpu-devices", "cpu",
        "--gpu-cases-report", str(path), "cases")
    assert returncode == pytest.ExitCode.INTERRUPTED, output
    report = load_report(path)
    assert report["complete"] is False
    finished = [r for r in report["results"] if r["case"] != "z_slow"]
    assert sorted(r["nodeid"] for r in finished) == [
        f"cases/{name}/case.toml::{name}[cpu-float32]" for name in ("a1", "a2", "a3", "a4")]
    assert {r["outcome"] for r in finished} == {"passed"}
    # The case the cancel stopped is in the report, and the interrupt names it.
    slow = "cases/z_slow/case.toml::z_slow[cpu-float32]"
    (interrupted,) = [r for r in report["results"] if r["case"] == "z_slow"]
    assert (interrupted["nodeid"], interrupted["outcome"]) == (slow, "interrupted")
    assert interrupted["message"] == (f"pytest received SIGTERM while a case ran ({slow}); the "
                                      "run's processes were killed")
    assert interrupted["message"] in output


def test_an_item_lost_with_a_crashed_xdist_worker_is_recorded(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    # The child kills its parent, the xdist worker, as an out-of-memory killer would.
    _marker_case(pytester.path, "killer", "import os, signal\n\ndef run():\n"
                 "    os.kill(os.getppid(), signal.SIGKILL)\n")
    report = run_with_report(pytester, "-p", "no:benchmark", "--gpu-devices", "cpu", "-n", "1")
    by_id = {r["nodeid"]: r for r in report["results"]}
    assert by_id["cases/good/case.toml::good[cpu-float32]"]["outcome"] == "passed"
    lost = by_id["cases/killer/case.toml::killer[cpu-float32]"]
    assert (lost["case"], lost["case_path"], lost["device"], lost["dtype"], lost["outcome"],
            lost["error_type"]) == ("killer", "cases/killer", "cpu", "float32", "failed",
                                    "WorkerCrash")
    assert "crashed while running 'cases/killer/case.toml::killer[cpu-float32]'" in lost["message"]


def test_child_text_cannot_drive_the_terminal(pytester: pytest.Pytester) -> None:
    _marker_case(pytester.path, "loud", "import os\n\ndef run():\n"
                 "    print('\\x1b]0;pwned\\x07\\x1b[2Jcleared\\x1b[31m red')\n"
                 "    os.write(2, b'bell\\x07 \\x1b[1A up\\n')\n"
                 "    raise RuntimeError('boom \\x1b[5m blink \\x00 nul')\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "\x1b" not in text and "\x07" not in text and "\x00" not in text
    result.stdout.fnmatch_lines_random(["cleared red", "bell\\x07  up", "*boom  blink \\x00 nul*"])


def test_the_report_records_the_packages_its_cases_use_serial_or_xdist(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under -n 2 environment.packages was {} (the workers evaluated [matrix.packages], the
    controller wrote the report), and a call's own package was never recorded: runs against
    tinyext 1.0 and 2.0 merged into one column and the 1.0 failures disappeared."""
    import torch

    from pytest_gpucase.report.matrix import build_matrix

    inputs = {"x": torch.ones(2, 3), "mask": torch.ones(2, dtype=torch.bool)}
    # one case names the extension in [matrix.packages], one only calls into it
    write_case(pytester.path, "declared", 'format = 1\ncall = "tinyext:pool"\n[matrix]\n'
               'devices = ["cpu"]\n[matrix.packages]\ntinyext = ">=1.0"\n', None, inputs)
    write_case(pytester.path, "called", 'format = 1\ncall = "tinyext:pool"\n[matrix]\n'
               'devices = ["cpu"]\n', None, inputs)
    reports = {}
    for version in ("1.0", "2.0"):
        site = install_fake_distribution(pytester.path / f"site-{version}", "tinyext", version,
                                         "tinyext")
        monkeypatch.setenv("PYTHONPATH", str(site))
        # serially, the case that only calls into it
        report = run_with_report(pytester, "-p", "no:benchmark", "-k", "called")
        assert report["environment"]["packages"] == {"tinyext": version}
        assert "packages" not in report["results"][0]   # the environment's, not the item's
        # under xdist, both: the controller writes what its workers' items depend on
        report = run_with_report(pytester, "-p", "no:benchmark", "-n", "2")
        assert report["environment"]["packages"] == {"tinyext": version}
        assert len(report["results"]) == 2
        reports[version] = report
    matrix = build_matrix([reports["1.0"], reports["2.0"]], detail=False, names=["a", "b"])
    assert [column.label for column in matrix.columns] == ["tinyext 1.0", "tinyext 2.0"]


def test_a_cancel_under_xdist_records_the_item_a_worker_was_running(
        pytester: pytest.Pytester) -> None:
    """The controller runs no item, but it hears of each one a worker starts: the case that
    hung the cancelled job is in the report (it was absent) and the interrupt names it."""

    ce_case(pytester.path, "a_fast", [0, 2, 4], RAISES)
    started = pytester.path / "slow-started"
    _marker_case(pytester.path, "z_slow", f"import pathlib, time\n\ndef run():\n"
                 f"    pathlib.Path({str(started)!r}).write_text('x')\n    time.sleep(600)\n")
    path = pytester.path / "report.json"
    _, output = _terminated_once_started(
        pytester.path, started, "-p", "no:randomly", "-n", "1", "--gpu-cases", "--gpu-devices",
        "cpu", "--gpu-cases-report", str(path), "cases")
    report = load_report(path)
    assert report["complete"] is False and report["version"] == 2
    slow = "cases/z_slow/case.toml::z_slow[cpu-float32]"
    by_id = {r["nodeid"]: r for r in report["results"]}
    assert by_id["cases/a_fast/case.toml::a_fast[cpu-float32]"]["outcome"] == "passed"
    assert (by_id[slow]["case"], by_id[slow]["outcome"]) == ("z_slow", "interrupted")
    assert by_id[slow]["message"] == f"terminated by signal 15 (SIGTERM) while {slow} ran", output


def test_items_lost_with_sigkilled_workers_are_recorded_whatever_their_folder_holds(
        pytester: pytest.Pytester) -> None:
    """Under -n 4, a case whose worker was SIGKILLed was missing from a report that said
    complete: true when its folder's name held brackets (the node-id parser refused '[')."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    names = ["k[1]", "k]2[", "k[[3]]", "k-4[cpu-float32]"]
    for name in names:
        _marker_case(pytester.path, name, "import os, signal\n\ndef run():\n"
                     "    os.kill(os.getppid(), signal.SIGKILL)\n")
    report = run_with_report(pytester, "-p", "no:benchmark", "--gpu-devices", "cpu", "-n", "4")
    by_id = {r["nodeid"]: r for r in report["results"]}
    lost = {f"cases/{name}/case.toml::{name}[cpu-float32]" for name in names}
    assert set(by_id) == lost | {"cases/good/case.toml::good[cpu-float32]"}
    for name in names:
        record = by_id[f"cases/{name}/case.toml::{name}[cpu-float32]"]
        assert (record["case"], record["case_path"], record["device"], record["dtype"],
                record["outcome"], record["error_type"]) == (
            name, f"cases/{name}", "cpu", "float32", "failed", "WorkerCrash")
    assert report["complete"] is True   # every selected item has its record


def _waiting_case(root: Path, name: str, started: Path, release: Path) -> None:
    _marker_case(root, name, f"import pathlib, time\n\ndef run():\n"
                 f"    pathlib.Path({str(started)!r}).write_text('x')\n"
                 f"    while not pathlib.Path({str(release)!r}).exists():\n"
                 "        time.sleep(0.05)\n")


def test_two_sessions_on_one_report_path_cannot_both_succeed(pytester: pytest.Pytester) -> None:
    """Two jobs given one --gpu-cases-report both exited 0, and the one that wrote last
    erased the other's results. The second now stops at its start, saying why."""
    started, release = pytester.path / "started", pytester.path / "release"
    _waiting_case(pytester.path, "slow", started, release)
    report = pytester.path / "out" / "report.json"
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark",
            "--gpu-cases", "--gpu-cases-report", str(report), "cases"]
    first = subprocess.Popen(args, cwd=pytester.path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300   # a hang guard for a loaded machine, not a timing
        while not started.exists():
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first session never started its case"
            time.sleep(0.1)
        second = subprocess.run(args, cwd=pytester.path, capture_output=True, text=True,
                                timeout=300, check=False)
        release.write_text("go")
        output, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == pytest.ExitCode.USAGE_ERROR, second.stdout + second.stderr
    assert ("ERROR: --gpu-cases-report out/report.json: another pytest session is writing "
            f"this report (pid {first.pid} on ") in second.stderr
    assert "Give each run its own path" in second.stderr
    assert first.returncode == 0, output
    assert [r["case"] for r in load_report(report)["results"]] == ["slow"]
    assert not (report.parent / ".report.json.lock").exists()
    # One after the other, as a rerun: the lock is gone with its session.
    started.unlink()
    again = subprocess.run(args, cwd=pytester.path, capture_output=True, text=True,
                           timeout=300, check=False)
    assert again.returncode == 0, again.stdout


def test_a_report_another_writer_changed_is_not_written_over(pytester: pytest.Pytester) -> None:
    """Where no lock holds (another host, an older writer), a report that changed under the
    session is left to that writer, and the run fails saying so."""
    report = pytester.path / "report.json"
    ce_case(pytester.path, "a_first", [0, 2, 4], RAISES)
    _marker_case(pytester.path, "b_other_writer", "import json, pathlib, time\n\ndef run():\n"
                 f"    path = pathlib.Path({str(report)!r})\n"
                 "    while not path.exists():\n"
                 "        time.sleep(0.05)\n"
                 "    path.write_text(json.dumps({'written by': 'another session'}))\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-report", str(report),
                                           "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"gpucase: another writer changed the JSON report {report} "
                                 "while this session ran*"])
    assert json.loads(report.read_text()) == {"written by": "another session"}


def test_two_builds_of_one_extension_version_are_two_columns(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """rowext 2.0 built twice, one build wrong: each session records its build, and the
    merged matrix has two columns labelled by build, one passing and one failing, instead
    of one column where the working build reads as failing or flaky."""
    import torch

    from pytest_gpucase.report.matrix import build_matrix
    from tests.extension_builds import install_compiled_distribution

    inputs = {"x": torch.ones(2, 3), "mask": torch.ones(2, dtype=torch.bool)}
    write_case(pytester.path, "rowcase", 'format = 1\ncall = "rowext:pool"\n'
               'reference = "case.py:reference"\n[matrix]\ndevices = ["cpu"]\n'
               'dtypes = ["float32"]\n',
               "def reference(x, mask):\n    return x\n", inputs)
    reports = []
    for name, factor in (("good", 1.0), ("bad", 2.0)):
        site = install_compiled_distribution(pytester.path / f"site-{name}", "rowext", "2.0",
                                             factor=factor)
        # the site first, then this checkout (what the session imports gpucase from)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
        report = run_with_report(pytester, "-p", "no:benchmark")
        (pytester.path / "report.json").rename(pytester.path / f"{name}.json")
        assert report["environment"]["packages"] == {"rowext": "2.0"}
        assert len(report["environment"]["builds"]["rowext"]["fingerprint"]) == 12
        assert [r["outcome"] for r in report["results"]] == (
            ["passed"] if factor == 1.0 else ["failed"])
        reports.append(report)
    fingerprints = [r["environment"]["builds"]["rowext"]["fingerprint"] for r in reports]
    assert fingerprints[0] != fingerprints[1]
    matrix = build_matrix(reports, detail=False, names=["good.json", "bad.json"])
    assert [column.label for column in matrix.columns] == [
        f"rowext 2.0 (build {fingerprint})" for fingerprint in fingerprints]
    assert [cell.status for cell in matrix.rows[0].cells] == ["pass", "fail"]


def test_a_loader_error_is_told_in_its_own_words_and_is_no_broken_case(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built for another torch raised "undefined symbol: _ZN5torch..." at
    import; the one-line message said only "importing 'rowext' failed", the outcome was a
    broken case blaming the case, and triage was null."""
    import torch

    from tests.extension_builds import install_compiled_distribution

    site = pytester.path / "site"
    install_compiled_distribution(site, "rowabi", "2.0", defines=("NEEDS_TORCH_SYMBOL",),
                                  requires="torch==2.9.1")
    install_compiled_distribution(site, "rowlib", "1.0", defines=("NEEDS_LIBRARY",))
    (site / "rowops.py").write_text("import torch\n\ndef pool(x, mask):\n"
                                    "    return torch.ops.rowops.logsumexp(x)\n")
    inputs = {"x": torch.ones(2, 3), "mask": torch.ones(2, dtype=torch.bool)}
    for name in ("rowabi", "rowlib", "rowops"):
        write_case(pytester.path, name, f'format = 1\ncall = "{name}:pool"\n[matrix]\n'
                   'devices = ["cpu"]\ndtypes = ["float32"]\n', None, inputs)
    # a case whose own file imports the extension
    write_case(pytester.path, "fileabi", 'format = 1\ncall = "case.py:pool"\n[matrix]\n'
               'devices = ["cpu"]\ndtypes = ["float32"]\n',
               "import rowabi\n\ndef pool(x, mask):\n    return rowabi.pool(x, mask)\n", inputs)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    report = run_with_report(pytester, "-p", "no:benchmark")
    results = {r["case"]: r for r in report["results"]}
    here = torch.__version__
    abi = results["rowabi"]
    assert abi["outcome"] == "failed"
    assert abi["error_type"] == "ImportError"
    assert abi["message"].startswith("cases/rowabi/case.toml: call: importing 'rowabi' failed: ")
    assert "undefined symbol: _ZN5torch7Library4_defEPKc" in abi["message"]
    assert abi["message"].endswith(f"(torch {here} here, rowabi 2.0 built for torch 2.9.1)")
    assert abi["triage"]["clue"] == "extension built for another torch or CUDA"
    assert "Do not call the case broken" in abi["triage"]["avoid"]
    assert (f"rebuild rowabi 2.0 against torch {here}, the torch it runs with here (it was "
            "built for torch 2.9.1)") in abi["triage"]["notes"]
    from_file = results["fileabi"]
    assert from_file["message"].startswith(
        "cases/fileabi/case.toml: call: importing 'case.py' failed: ")
    assert from_file["message"].endswith(f"(torch {here} here, rowabi 2.0 built for torch 2.9.1)")
    assert from_file["triage"]["clue"] == "extension built for another torch or CUDA"
    assert report["environment"]["builds"]["rowabi"]["torch"] == "2.9.1"
    lib = results["rowlib"]
    assert "libgpucase_missing.so: cannot open shared object file" in lib["message"]
    assert lib["triage"]["clue"] == "shared library not found"
    assert "the loader could not find libgpucase_missing.so" in lib["triage"]["notes"]
    ops = results["rowops"]
    assert "'_OpNamespace' 'rowops' object has no attribute 'logsumexp'" in ops["message"]
    assert ops["triage"]["clue"] == "operator not available"
    # and the step summary / junit message is the same one line: the report's "message"
    assert all("\n" not in r["message"] for r in results.values())


def test_a_demanded_package_missing_or_out_of_range_fails_the_session_at_start(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rowext installed every case skipped and the job passed: a missing extension
    gated green. --gpu-require (or the ini's gpu_require) fails the session before anything
    runs, in one line naming the package, as --gpu-devices does for a device."""
    import torch

    site = install_fake_distribution(pytester.path / "site", "tinyext", "1.0", "tinyext")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    write_case(pytester.path, "declared", 'format = 1\ncall = "rowext:pool"\n[matrix]\n'
               'devices = ["cpu"]\n[matrix.packages]\nrowext = ">=2"\n', None,
               {"x": torch.ones(2)})
    # what passed before: every case skipped, exit 0
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(skipped=1)
    assert result.ret == 0
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-require", "rowext", "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpu-require rowext: rowext is not installed in this "
                                 "environment (Python at *); install it, or leave it out where "
                                 "it is not expected"])
    assert "collected" not in result.stdout.str()
    # from the ini, as a TOML list; a range the installed version is outside of
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ngpu_require = ["tinyext>=2,<3"]\n')
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpu-require tinyext>=2,<3: tinyext 1.0 is installed, "
                                 "outside <3,>=2 (Python at *)"])
    # met: the session runs (its case skips as before: the demand is for tinyext)
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ngpu_require = ["tinyext>=1", '
                               '"torch>=2"]\n')
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(skipped=1)
    # a typo is named with the fix
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-require", "rowext>=>2", "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --gpu-require: 'rowext>=>2' is not a requirement *"])


@pytest.mark.slow
def test_matrix_and_show_run_in_an_environment_without_torch_or_pytest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The merge job of a CI matrix installed torch and its CUDA libraries (about 3 GB) to
    merge JSON files: `gpucase matrix` imported torch and pytest at start, and printed a
    traceback without them. In a venv holding only this package and packaging (the light
    install of docs/ci.md), matrix and show --report work, and print what they print with
    torch."""
    import packaging

    import pytest_gpucase
    from pytest_gpucase.cli import main
    from tests.helpers import environment, report_file, result

    venv = tmp_path / "merge-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "packaging").symlink_to(Path(packaging.__file__).parent)
    (site / "gpucase-source.pth").write_text(str(Path(pytest_gpucase.__file__).parents[1]) + "\n")
    missing = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in missing.stderr
    missing = subprocess.run([str(python), "-c", "import pytest"], capture_output=True, text=True)
    assert "No module named 'pytest'" in missing.stderr
    reports = []
    for n, (torch_version, rowext) in enumerate([("2.13.0", "2.0"), ("2.9.1", "1.0"),
                                                 ("2.9.1", "2.0"), ("2.13.0", "1.0")]):
        env = environment(torch_version, None, None, "x", "9.0", packages={"rowext": rowext})
        outcomes = ["passed", "failed" if rowext == "1.0" else "passed"]
        reports.append(report_file(tmp_path / f"r{n}.json", env, [
            result(f"case{i}", "cpu", "float32", outcome, message="outputs differ")
            for i, outcome in enumerate(outcomes)]))
    args = ["matrix", *map(str, reports)]
    start = time.monotonic()
    done = subprocess.run([str(python), "-m", "pytest_gpucase.cli", *args],
                          capture_output=True, text=True, cwd=tmp_path)
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert main(args) == 0
    assert done.stdout == capsys.readouterr().out   # the same matrix as with torch
    assert seconds < 10, f"gpucase matrix without torch took {seconds:.1f} s"
    html = tmp_path / "matrix.html"
    done = subprocess.run([str(python), "-m", "pytest_gpucase.cli", *args, "--format", "html",
                           "-o", str(html)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert html.read_text().startswith("<!DOCTYPE html>")
    for extra in (["--pivot", "rowext,torch"], ["--pivot", "rowext,torch", "--format", "html"]):
        done = subprocess.run([str(python), "-m", "pytest_gpucase.cli", *args, *extra],
                              capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert "| **rowext 1.0** | ✅ 1 pass · ❌ 1 fail | ✅ 1 pass · ❌ 1 fail |" in subprocess.run(
        [str(python), "-m", "pytest_gpucase.cli", *args, "--pivot", "rowext,torch"],
        capture_output=True, text=True, check=True).stdout
    done = subprocess.run([str(python), "-m", "pytest_gpucase.cli", "durations",
                           str(reports[0])], capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout), done.stderr
    case = Path(pytest_gpucase.__file__).parents[1] / "cases" / "ce_class4"
    done = subprocess.run([str(python), "-m", "pytest_gpucase.cli", "show", str(case),
                           "--report", str(reports[0])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no verdict of this case in the report" in done.stdout


_WORKFLOW = Path(__file__).parents[1] / "examples" / "ci" / "extension-matrix.yml"


def test_the_documented_workflow_is_the_example_and_shows_every_red_cell() -> None:
    """docs/ci.md's workflow cancelled the other cells at the first red one, never uploaded
    a failing job's report, had no torch axis and built extensions in pip's isolation."""
    yaml = pytest.importorskip("yaml", reason="needs PyYAML to read the workflow")
    text = _WORKFLOW.read_text()
    docs = (Path(__file__).parents[1] / "docs" / "ci.md").read_text()
    assert f"```yaml\n{text}```" in docs   # the page shows the file a test checks
    workflow = yaml.safe_load(text)
    cases, merge = workflow["jobs"]["cases"], workflow["jobs"]["matrix"]
    assert cases["strategy"]["fail-fast"] is False
    assert "torch" in cases["strategy"]["matrix"]
    runs = [step.get("run", "") for step in cases["steps"]]
    assert any("--no-build-isolation" in run for run in runs)
    assert any("--gpu-require" in run and "--gpu-cases-report" in run for run in runs)
    upload = next(step for step in cases["steps"]
                  if step.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "${{ !cancelled() }}"
    assert merge["if"] == "${{ !cancelled() }}"
    merge_runs = " ".join(step.get("run", "") for step in merge["steps"])
    assert "pip install --no-deps pytest-gpucase packaging" in merge_runs
    assert "torch" not in merge_runs.replace("--pivot rowext,torch", "")
    assert '>> "$GITHUB_STEP_SUMMARY"' in merge_runs
    assert any(step.get("with", {}).get("path") == "matrix.html" for step in merge["steps"])


@pytest.mark.slow
def test_the_example_workflow_passes_githubs_workflow_schema() -> None:
    import shutil

    checker = shutil.which("check-jsonschema")
    if checker is None:
        pytest.skip("needs check-jsonschema (pip install check-jsonschema): it vendors "
                    "GitHub's workflow schema and checks offline")
    done = subprocess.run([checker, "--builtin-schema", "vendor.github-workflows",
                           str(_WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shards_split_by_recorded_durations_merge_into_one_column(
        pytester: pytest.Pytester) -> None:
    """The reports hold every item's duration: `gpucase durations` writes them as
    pytest-split reads them, the shards take about equal time (the slow case alone in one),
    and their reports merge into one column holding every item once."""
    pytest.importorskip("pytest_split", reason="needs pytest-split (pip install pytest-split)")
    from pytest_gpucase.cli import main
    from pytest_gpucase.report.matrix import build_matrix

    for name, seconds in (("slow", 1.5), ("a", 0.0), ("b", 0.0), ("c", 0.0)):
        write_case(pytester.path, name, f'format = 1\ncall = "case.py:run"\n'
                   f'reference = "case.py:run"\n[inputs]\nseconds = {seconds}\n'
                   '[matrix]\ndevices = ["cpu"]\ndtypes = ["float32"]\n',
                   "import time\nimport torch\n\ndef run(seconds):\n"
                   "    time.sleep(seconds / 2)\n    return torch.zeros(1)\n")
    whole = run_with_report(pytester, "-p", "no:benchmark")
    assert len(whole["results"]) == 4
    durations_file = pytester.path / ".test_durations"
    assert main(["durations", str(pytester.path / "report.json"), "-o",
                 str(durations_file)]) == 0
    recorded = json.loads(durations_file.read_text())
    assert set(recorded) == {r["nodeid"] for r in whole["results"]}
    shards = []
    for group in (1, 2):
        report = run_with_report(pytester, "-p", "no:benchmark", "--splits", "2", "--group",
                                 str(group), "--durations-path", str(durations_file),
                                 "--splitting-algorithm", "least_duration")
        shards.append(report)
    names = [{r["case"] for r in shard["results"]} for shard in shards]
    assert sorted(names, key=len) == [{"slow"}, {"a", "b", "c"}]   # by time, not by count
    matrix = build_matrix(shards, detail=False, names=["shard-1.json", "shard-2.json"])
    assert len(matrix.columns) == 1
    assert sorted(row.case for row in matrix.rows) == ["a", "b", "c", "slow"]
    assert all(row.cells[0].status == "pass" for row in matrix.rows)


@pytest.mark.slow
def test_the_noxfile_example_has_a_session_per_torch_and_extension_pair() -> None:
    """examples/nox/noxfile.py (docs/ci.md, "Environments with nox"), as nox reads it: one
    cases session per torch × extension version, then the merge. The whole file was run
    on this project's machine with two source builds (docs/ci.md says what it printed)."""
    import shutil

    nox = shutil.which("nox")
    if nox is None:
        pytest.skip("needs nox (pip install nox) to read the example noxfile")
    noxfile = Path(__file__).parents[1] / "examples" / "nox" / "noxfile.py"
    done = subprocess.run([nox, "-f", str(noxfile), "--list", "--json"], capture_output=True,
                          text=True, timeout=120, check=True)
    sessions = json.loads(done.stdout)
    pairs = {(s["call_spec"]["torch"], s["call_spec"]["rowext"]) for s in sessions
             if s["name"] == "cases"}
    assert pairs == {(t, e) for t in ("2.9.1", "2.13.0") for e in ("1.0", "2.0")}
    assert sessions[-1]["name"] == "matrix"
    source = noxfile.read_text()
    assert '"--no-build-isolation"' in source and "--gpu-require" in source


def test_a_killed_or_refused_session_leaves_no_earlier_green_report(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report path held yesterday's complete, green report; today's session was killed
    (an out-of-memory kill, a job's time limit: no sessionfinish) or stopped at its start
    (--gpu-require unmet), and the file still read complete and passed, merged as today's
    run. The report is now replaced at the start, and names each collected item "not run"
    until it finishes."""
    case = pytester.path / "cases" / "kills"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[matrix]\n'
                                    'devices = ["cpu"]\n')
    (case / "case.py").write_text("import os, signal\n\ndef run():\n"
                                  "    if os.environ.get('KILL_PYTEST'):\n"
                                  "        os.kill(os.getppid(), signal.SIGKILL)\n"
                                  "    return 1.0\n")
    path = pytester.path / "report.json"
    args = ("--gpu-cases", "--gpu-cases-report", str(path), "cases")
    assert pytester.runpytest_subprocess(*args).ret == pytest.ExitCode.OK
    assert [r["outcome"] for r in load_report(path)["results"]] == ["passed"]

    monkeypatch.setenv("KILL_PYTEST", "1")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == -9, result.stdout.str()   # killed: nothing of its own ran after
    report = load_report(path)
    assert report["complete"] is False
    assert [(r["outcome"], r["case"]) for r in report["results"]] == [("not run", "kills")]
    assert "killed" in report["results"][0]["message"]

    monkeypatch.delenv("KILL_PYTEST")
    result = pytester.runpytest_subprocess(*args, "--gpu-require", "gpucase-absent-ext>=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    report = load_report(path)
    assert report["complete"] is False and report["results"] == []


def test_the_packages_a_job_requires_are_in_its_report(pytester: pytest.Pytester) -> None:
    """An extension the cases reach only through the project's own package was never
    recorded, even with --gpu-require naming it: two builds of it shared one column."""
    ce_case(pytester.path, "ce", [0, 2, 3], "")
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-require", "packaging",
                                           "--gpu-require", "absent-ext; python_version < '3'",
                                           "--gpu-cases-report", str(path), "cases")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    from importlib.metadata import version

    packages = load_report(path)["environment"]["packages"]
    assert packages["packaging"] == version("packaging")
    assert "absent-ext" not in packages   # its marker is false here: not demanded

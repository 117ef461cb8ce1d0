"""End to end: requirements, selection, JSON results, xdist, interruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpucase.report import load_report

from .test_plugin import RAISES, ce_case


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
        "SKIPPED [[]1[]] test_req.py:15: requires backend rocm; this is a CPU-only build",
    ])


def test_gpu_requires_with_a_bad_specifier_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_req="""
        import pytest

        @pytest.mark.gpu_requires(torch="2.1")
        def test_x():
            pass
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*test_req.py::test_x: gpu_requires: torch='2.1' is not a PEP 440 specifier; "
        "write it like '>=2.1'"])


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


def test_interrupted_run_leaves_a_valid_report(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "a_first", [0, 2, 4], RAISES)
    stop = pytester.path / "cases" / "b_stop"
    stop.mkdir()
    (stop / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[matrix]\n'
                                    'devices = ["cpu"]\n')
    # The child interrupts the pytest process, as Ctrl-C in the terminal would.
    (stop / "case.py").write_text("import os, signal\n\ndef run():\n"
                                  "    os.kill(os.getppid(), signal.SIGINT)\n")
    ce_case(pytester.path, "c_never", [0, 2, 4], RAISES)
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-cases-report", str(path), "cases")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = load_report(path)
    assert report["complete"] is False
    assert [r["case"] for r in report["results"]] == ["a_first"]
    json.dumps(report)  # plain JSON all the way down


def test_gpu_ablate_adds_the_table_to_a_failing_item(pytester: pytest.Pytester) -> None:
    import torch

    from .test_plugin import write_case

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

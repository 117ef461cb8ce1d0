"""Selecting and rerunning case items as a pytest user does: pasted ids, -k, -m, --lf, ini keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers import RAISES, ce_case, write_case

VARIANTS = """
        [expect]
        gradients = false
        [variants]
        batch = { axis = 0, sizes = [1, 2] }
        boundaries = { input = "target", classes = 4, ignore_index = -100 }
        [variants.reject]
        exception = "ValueError"
        match = "out of range"
"""


def collected(result: pytest.RunResult) -> list[str]:
    """The item ids of a ``--collect-only -q`` run."""
    return [line for line in result.stdout.lines if "::" in line]


@pytest.fixture
def edges(pytester: pytest.Pytester) -> Path:
    """A valid cross-entropy case with batch variants and every class boundary."""
    ce_case(pytester.path, "edges", [0, 2, 3], VARIANTS)
    return pytester.path


def test_pasted_failure_id_runs_that_item_alone(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    ce_case(pytester.path, "bad", [0, 2, 4], "")  # the call raises: a failure
    first = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    first.assert_outcomes(passed=1, failed=1)
    failure = next(line for line in first.stdout.lines if line.startswith("FAILED "))
    node_id = failure.split()[1]
    assert node_id == "cases/bad/case.toml::bad[cpu-float32]"
    alone = pytester.runpytest_subprocess("--gpu-cases", node_id)
    alone.assert_outcomes(failed=1)
    assert "collected 1 item" in alone.stdout.str()


def test_last_failed_failed_first_and_stepwise_narrow_to_failures(
        pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    ce_case(pytester.path, "bad", [0, 2, 4], "")
    pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    last = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "--lf", "cases")
    last.assert_outcomes(failed=1)
    last.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*"])
    first = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "--ff", "-v",
                                          "cases")
    first.assert_outcomes(failed=1, passed=1)
    ran = [line for line in first.stdout.lines if "::" in line and ("PASSED" in line
                                                                  or "FAILED" in line)]
    assert "bad[cpu-float32]" in ran[0]
    stepwise = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "--sw",
                                             "cases")
    stepwise.assert_outcomes(failed=1)
    stepwise.stdout.fnmatch_lines(["*Test failed, continuing from this test next run*"])


@pytest.mark.parametrize(("expression", "expected"), [
    ("boundary[-1]", ["edges[cpu-float32-boundary[-1]]"]),
    ("boundary[-100]", ["edges[cpu-float32-boundary[-100]]"]),
    ("boundary[4]", ["edges[cpu-float32-boundary[4]]"]),
    ("batch[1]", ["edges[cpu-float32-batch[1]]"]),
    ("cpu-float32]", ["edges[cpu-float32]"]),
    ("edges[cpu-float32-boundary[0]]", ["edges[cpu-float32-boundary[0]]"]),
])
def test_k_selects_every_part_of_an_id_exactly(pytester: pytest.Pytester, edges: Path,
                                               expression: str, expected: list[str]) -> None:
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--collect-only", "-q", "-k", expression, "cases")
    assert [line.split("::")[1] for line in collected(result)] == expected


def test_k_device_dtype_as_pytorch_test_names(pytester: pytest.Pytester, edges: Path) -> None:
    result = pytester.runpytest_subprocess("--gpu-cases", "--collect-only", "-q", "-k",
                                           "cuda_float32", "cases")
    ids = collected(result)
    assert ids and all("[cuda-float32" in node for node in ids)
    assert len(ids) == len([n for n in collected(pytester.runpytest_subprocess(
        "--gpu-cases", "--collect-only", "-q", "-k", "cuda and float32", "cases"))])


def test_m_selects_one_variant_value(pytester: pytest.Pytester, edges: Path) -> None:
    result = pytester.runpytest_subprocess(
        "--gpu-cases", "--collect-only", "-q", "-m",
        "variant_boundary(value=-1) and device_cpu", "cases")
    assert [line.split("::")[1] for line in collected(result)] == [
        "edges[cpu-float32-boundary[-1]]"]


def test_every_option_is_an_ini_key(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    pytester.makeini("""
        [pytest]
        gpu_cases = true
        gpu_cases_paths = cases
        gpu_devices = cpu
        gpu_dtypes = float32
        gpu_cases_report = out.json
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    report = json.loads((pytester.path / "out.json").read_text())
    assert [r["nodeid"] for r in report["results"]] == ["cases/good/case.toml::good[cpu-float32]"]



@pytest.mark.parametrize("written", ['["cpu"]', '"cpu"', '"cpu, mps"', '"cpu mps"'])
def test_a_list_ini_key_reads_a_toml_list_or_a_string(pytester: pytest.Pytester,
                                                      written: str) -> None:
    """pyproject.toml's natural spelling, a TOML list, failed with unknown "['cpu']" and a
    deprecation warning."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    pytester.makepyprojecttoml(f"""
        [tool.pytest.ini_options]
        gpu_cases = true
        gpu_cases_paths = ["cases"]
        gpu_devices = {written}
        gpu_dtypes = ["float32", "float64"]
        filterwarnings = ["error"]
    """)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=1 if "mps" in written else 0)  # its saved dtype
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ngpu_dtypes = ["float8"]\n')
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini key gpu_dtypes: unknown 'float8'; expected one of *"])

def test_ini_mistake_is_a_usage_error_naming_the_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpu_devices = cdua\n")
    result = pytester.runpytest_subprocess("--gpu-cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini key gpu_devices: unknown 'cdua'; expected one of *"])


def test_gpu_cases_alone_runs_the_configured_case_paths(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    pytester.makeini("[pytest]\ntestpaths = test_unit.py\ngpu_cases_paths = cases\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu")
    result.assert_outcomes(passed=2)
    plain = pytester.runpytest_subprocess()
    plain.assert_outcomes(passed=1)


def test_gpu_cases_paths_replace_the_rootdir_as_where_cases_come_from(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """No testpaths: pytest collects the rootdir, where a stale case folder lies. A run
    with no path collects the cases of gpu_cases_paths alone (and the user's tests, as
    pytest would); a path given on the command line is collected as given."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    stale = pytester.path / "old" / "stale"
    stale.mkdir(parents=True)
    (stale / "case.toml").write_text("format = 1\ncall = 'gone.py:run'\n[[[broken\n")
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    pytester.makeini("[pytest]\ngpu_cases_paths = cases\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["gpucase: 1 case folder outside gpu_cases_paths not "
                                 "collected (old/stale)*"])
    given = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "old")
    given.assert_outcomes(failed=1)   # named on the command line: collected, and broken
    monkeypatch.chdir(stale.parent)   # as testpaths, the key is read in the rootdir alone
    pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu").assert_outcomes(
        failed=1)
    monkeypatch.chdir(pytester.path)
    pytester.makeini("[pytest]\ntestpaths = test_unit.py old\ngpu_cases_paths = cases\n")
    both = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu")
    both.assert_outcomes(passed=2)   # testpaths' tests, gpu_cases_paths' cases
    pytester.makeini("[pytest]\ngpu_cases_paths = cases/nothing*\n")
    missing = pytester.runpytest_subprocess("--gpu-cases")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*ini key gpu_cases_paths: cases/nothing* matches nothing*"])


def test_gpu_cases_finding_no_case_says_why(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    result = pytester.runpytest_subprocess("--gpu-cases")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpucase: --gpu-cases found no case folder *gpu_cases_paths"])


@pytest.mark.parametrize("option", [["--gpu-cases-report", "r.json"], ["--gpu-cases-regen"],
                                    ["--gpu-ablate"], ["--gpu-launch-blocking"]])
def test_case_option_without_gpu_cases_is_a_usage_error(pytester: pytest.Pytester,
                                                        option: list[str]) -> None:
    result = pytester.runpytest_subprocess(*option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option[0]} needs --gpu-cases*"])


def test_device_with_no_hardware_is_skipped_with_the_reason(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "mps", "-rs", "cases")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["gpucase: --gpu-devices asked for mps, which this machine*",
                                 "SKIPPED*no mps device here*"])



@pytest.mark.parametrize("args", [["--gpu-devices", "cuda"], ["--gpu-devices", "cpu,cuda"],
                                  ["--gpu-devices", "cuda", "-n", "2"]],
                         ids=["cuda", "cpu-and-cuda", "xdist"])
def test_a_device_asked_for_on_the_command_line_and_missing_fails_the_run(
        pytester: pytest.Pytester, args: list[str]) -> None:
    """A GPU runner without its driver (or with a CPU build of torch) skipped every item it was
    there for and exited 0: the GPU gate went green with nothing run."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", *args, "cases")
    result.assert_outcomes(skipped=1, passed=1 if "cpu,cuda" in args else 0)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["gpucase: --gpu-devices asked for cuda, which this machine does "
                                 "not have (* backend, torch *): its 1 item was skipped, so "
                                 "nothing ran on cuda. The run fails: check the runner's driver "
                                 "and torch build, or leave cuda out of --gpu-devices where none "
                                 "is expected"])


def test_the_ini_key_or_no_filter_only_skips_a_missing_device(pytester: pytest.Pytester) -> None:
    """A project's ini is read on laptops too: there it narrows, it does not demand."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=1)
    pytester.makeini("[pytest]\ngpu_devices = cpu,cuda\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=1)
    assert "asked for" not in result.stdout.str()

def test_filters_that_leave_nothing_say_so(pytester: pytest.Pytester) -> None:
    ce_case(pytester.path, "cpu_only", [0, 2, 4], RAISES, top='[matrix]\ndevices = ["cpu"]')
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cuda", "cases")
    result.stdout.fnmatch_lines(["gpucase: no case run was left after --gpu-devices/--gpu-dtypes:"
                                 " cpu_only (its runs: devices cpu*"])
    # A case without [matrix] dtypes runs in its saved dtype: the note names it.
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-dtypes", "float16", "cases")
    result.stdout.fnmatch_lines(["gpucase: no case run was left after --gpu-devices/--gpu-dtypes:"
                                 " cpu_only (its runs: devices cpu; dtypes float32 (its saved "
                                 "dtype))"])


HOG = """
import torch

def run():
    x = torch.ones(256 * 2**20 // 8, dtype=torch.float64)  # 256 MiB, touched
    import time
    time.sleep(30)
    return x.sum()
"""


@pytest.mark.parametrize("where", ["ini", "case"])
def test_memory_limit_from_the_ini_or_the_case(pytester: pytest.Pytester, where: str) -> None:

    top = "memory_limit = 0.1\n" if where == "case" else ""
    write_case(pytester.path, "hog", f'format = 1\ncall = "case.py:run"\ntimeout = 120\n{top}'
               '[matrix]\ndevices = ["cpu"]\n', HOG)
    if where == "ini":
        pytester.makeini("[pytest]\ngpu_memory_limit = 0.1\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*exceeded the memory limit of 0.1 GiB*"])


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # `import numpy` fails, as in a venv without it
"""


@pytest.mark.fresh_interpreter  # the plugin's own first import of torch
def test_no_numpy_and_warnings_as_errors_is_no_internal_error(pytester: pytest.Pytester) -> None:
    """torch warns "Failed to initialize NumPy" on import without numpy; a project with
    filterwarnings = error must not get that warning raised from inside the plugin."""
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    (pytester.path / "sitecustomize.py").write_text(NO_NUMPY)
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    import os

    path = os.pathsep.join([str(pytester.path), os.environ.get("PYTHONPATH", "")])
    pytester._monkeypatch.setenv("PYTHONPATH", path)  # sitecustomize runs first in the child
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "test_unit.py", "cases")
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2)

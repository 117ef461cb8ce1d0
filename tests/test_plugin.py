"""End to end: `pytest --gpu-cases` in a subprocess, as a user runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import CE_CASE_PY, RAISES, ce_case, needs_zygote, write_case


@pytest.fixture
def cases(pytester: pytest.Pytester) -> Path:
    return pytester.path


def test_collects_ids_like_device_type_tests(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--collect-only", "-q", "cases")
    result.stdout.fnmatch_lines([
        "cases/ce_class4/case.toml::ce_class4[[]cpu-float32[]]",
        "cases/ce_class4/case.toml::ce_class4[[]cuda-float32[]]",
    ])
    # The ids the docs quote are the ids pytest prints: a reader pastes them.
    docs = "\n".join((Path(__file__).parent.parent / "docs" / name).read_text("utf-8")
                     for name in ("case-format.md", "report-schema.md"))
    assert "cases/ce_class4/case.toml::ce_class4[cpu-float32]" in docs
    quoted = set(re.findall(r"cases/\w+(?:/[\w.]+)?::\w+\[[^`\"]*", docs))
    assert quoted and all("/case.toml::" in node_id for node_id in quoted), quoted


@needs_zygote
def test_collect_only_starts_no_zygote(pytester: pytest.Pytester, cases: Path) -> None:
    # An editor's test view runs --collect-only at every change: it runs nothing, so the
    # forkserver's zygote (and the run-time modules it preloads) is not started for it.
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    pytester.makeconftest("""
        import sys

        def pytest_collection_finish(session):
            zygote = sys.modules.get("pytest_gpucase.run.isolation.zygote")
            started = zygote._ZYGOTE if zygote is not None else None
            print("zygote:", "none" if started is None else "started")
            print("execute loaded:", "pytest_gpucase.run.child" in sys.modules)
    """)
    listed = pytester.runpytest_subprocess("--gpu-cases", "--collect-only", "-q", "-s", "cases")
    listed.stdout.fnmatch_lines(["zygote: none", "execute loaded: False"])
    ran = pytester.runpytest_subprocess("--gpu-cases", "-q", "-s", "cases")
    ran.stdout.fnmatch_lines(["zygote: started"])
    ran.assert_outcomes(passed=1, skipped=1)


@pytest.mark.parametrize("isolation_mode", ["item", "worker"])
def test_a_passing_session_never_loads_the_failure_path(
        pytester: pytest.Pytester, cases: Path, isolation_mode: str) -> None:
    """Triage and secret removal compile some hundred regular expressions as they are
    imported: a session whose runs pass does not pay for them; one whose run fails does."""
    write_case(cases, "adds", 'format = 1\ncall = "case.py:run"\n\n[matrix]\ndevices = ["cpu"]\n',
               "def run(x):\n    return x + 1\n", {"x": torch.ones(4)})
    pytester.makeconftest("""
        import sys

        def pytest_sessionfinish(session):
            failure_path = ("pytest_gpucase.verdict.triage", "pytest_gpucase.verdict.failure",
                            "pytest_gpucase.base.secrets")
            print("loaded:", [name for name in failure_path if name in sys.modules])
    """)
    passed = pytester.runpytest_subprocess("--gpu-cases", "--gpu-isolation", isolation_mode,
                                           "-q", "-s", "cases")
    passed.assert_outcomes(passed=1)
    assert "loaded: []" in passed.stdout.str()
    (cases / "cases" / "adds" / "case.py").write_text("def run(x):\n    raise ValueError('no')\n")
    failed = pytester.runpytest_subprocess("--gpu-cases", "--gpu-isolation", isolation_mode,
                                           "-q", "-s", "cases")
    failed.assert_outcomes(failed=1)
    assert "loaded: ['pytest_gpucase.verdict.triage'" in failed.stdout.str()


def test_plain_pytest_ignores_cases(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("cases")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    # ... but says how to run them, since nothing else ran.
    result.stdout.fnmatch_lines(["gpucase: 1 case folder (cases/ce_class4) not collected: "
                                 "cases run with --gpu-cases (pytest --gpu-cases cases)"])
    ce_case(cases, "ce_other", [0, 2, 4], RAISES)
    pytester.makepyfile(test_unit="def test_unit():\n    pass\n")
    quiet = pytester.runpytest_subprocess()  # tests ran: no note in every plain run
    quiet.assert_outcomes(passed=1)
    assert "not collected" not in quiet.stdout.str()


def test_raises_case_passes_and_cuda_is_skipped_with_reason(
        pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "-rs", "-v", "cases")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        # "cpu backend" on a CPU wheel; "cuda backend · ... CUDA 12.8" on a CUDA one
        "gpucase: * backend · torch * · Python * · no accelerator*",
        "cases/ce_class4/case.toml::ce_class4[[]cpu-float32[]] PASSED*",
        "SKIPPED [[]1[]] cases/ce_class4/case.toml: no CUDA device here (* backend): a CPU "
        "pass is a hint, not CUDA validation; run it on a GPU runner",
    ])


def test_select_with_k(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    ce_case(cases, "ce_valid", [0, 2, 3], "")
    result = pytester.runpytest_subprocess("--gpu-cases", "-k", "cpu and valid", "cases")
    result.assert_outcomes(passed=1, deselected=3)


def test_case_that_no_longer_raises_fails_clearly(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "fixed", [0, 2, 3], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*_ fixed[[]cpu-float32[]] _*",
        "expected ValueError matching 'out of range', but the call returned normally; if the fix "
        "has landed, set [[]expect[]] outcome = \"matches\" in case.toml",
    ])


def test_wrong_exception_type_fails_with_both_named(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "wrongtype", [0, 2, 4], RAISES.replace("ValueError", "IndexError"))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "expected IndexError matching 'out of range'; the call raised ValueError: target out of "
        "range: [[]4[]]",
    ])


def test_xfail_is_strict(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "known", [0, 2, 4], "", top='xfail = "labels not remapped yet"')
    ce_case(cases, "fixed", [0, 2, 3], "", top='xfail = "labels not remapped yet"')
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rxX", "cases")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*[[]XPASS(strict)[]] labels not remapped yet*"])


def test_mismatch_names_count_difference_and_tolerance(
        pytester: pytest.Pytester, cases: Path) -> None:
    write_case(cases, "drift", """
        format = 1
        call = "case.py:run"
        reference = "case.py:reference"
    """, """
        def run(x):
            y = x * 2
            y[1, 2] += 0.5
            return {"logits": y}

        def reference(x):
            return {"logits": x * 2}
    """, {"x": torch.ones(4, 8)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "outputs differ from the reference: out[[]'logits'[]]: 1 / 32 elements differ, *",
        "*out[[]'logits'[]]*",
        "*1 / 32 (3.1%)*",
        "*0.5*(1, 2)*",
    ])


def test_broken_case_is_one_failure_and_the_rest_still_run(
        pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "good", [0, 2, 4], RAISES)
    write_case(cases, "typo", """
        format = 1
        calll = "case.py:run"
    """)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "cases/typo/case.toml: calll: unknown key; did you mean 'call'?",
        "FAILED cases/typo/case.toml::typo*",
    ])
    result.stdout.no_fnmatch_line("*Traceback*")


@pytest.mark.parametrize(("body", "message"), [
    ("import os, signal\n\ndef run():\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
     "*cases/crash/case.toml: run crashed with signal 11 (SIGSEGV)"),
    ("import os\n\ndef run():\n    os._exit(3)\n",
     "*cases/crash/case.toml: run exited with code 3 without returning a result"),
    ("import time\n\ndef run():\n    time.sleep(600)\n",
     "*cases/crash/case.toml: run timed out after 1 s and was killed with its process group*"),
])
def test_crashing_child_fails_one_item_and_session_goes_on(
        pytester: pytest.Pytester, cases: Path, body: str, message: str) -> None:
    write_case(cases, "crash", 'format = 1\ncall = "case.py:run"\ntimeout = 1\n', body)
    ce_case(cases, "good", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([message])


def test_hang_shows_where_it_hung(pytester: pytest.Pytester, cases: Path) -> None:
    write_case(cases, "hang", 'format = 1\ncall = "case.py:run"\ntimeout = 1\n',
               "import time\n\ndef wait_forever():\n    time.sleep(600)\n\n"
               "def run():\n    wait_forever()\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*stderr (child)*", "*case.py\", line 4 in wait_forever*"])


def test_child_output_is_shown_in_sections(pytester: pytest.Pytester, cases: Path) -> None:
    write_case(cases, "loud", 'format = 1\ncall = "case.py:run"\n',
               "import os\n\ndef run():\n    print('hello from the child')\n"
               "    os.write(2, b'Loss.cu:250: Assertion `t >= 0 && t < n_classes` failed.\\n')\n"
               "    raise RuntimeError('CUDA error: device-side assert triggered')\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*Captured stdout (child) call*", "hello from the child",
        "*Captured stderr (child) call*", "Loss.cu:250: Assertion*",
        "*Captured gpucase triage call*", "clue: device-side assert*",
    ])


def test_launch_blocking_reaches_the_child_only_on_gpu_backends(
        pytester: pytest.Pytester, cases: Path) -> None:
    write_case(cases, "env", """
        format = 1
        call = "case.py:run"
        launch_blocking = true
        [expect]
        outcome = "raises"
        exception = "LookupError"
    """, "import os\n\ndef run():\n    raise LookupError(os.environ.get('CUDA_LAUNCH_BLOCKING'))\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=1)


def test_forked_plugin_gives_the_same_results(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "good", [0, 2, 4], RAISES)
    ce_case(cases, "fixed", [0, 2, 3], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "--forked",
                                           "cases")
    result.assert_outcomes(passed=1, failed=1)


def test_spawn_start_method_gives_the_same_results(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "good", [0, 2, 4], RAISES)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-start-method", "spawn", "cases")
    result.assert_outcomes(passed=1)


@pytest.mark.fresh_interpreter  # it reads the first import of torch
def test_plain_run_does_not_import_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="""
        import sys

        def test_no_torch():
            assert "torch" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "gpucase")
    result.assert_outcomes(passed=1)


def test_gpu_case_fixture(pytester: pytest.Pytester, cases: Path) -> None:
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    pytester.makepyfile(test_fixture="""
        import pytest

        @pytest.mark.gpu_case("cases/ce_class4")
        def test_inputs_and_run(gpu_case):
            inputs = gpu_case.inputs(dtype="float64")
            assert inputs["logits"].dtype.is_floating_point
            assert str(inputs["logits"].dtype) == "torch.float64"
            assert inputs["target"].tolist() == [0, 2, 4]
            verdict = gpu_case.run(device="cpu")
            assert verdict.outcome.status == "passed"
            assert verdict.outcome.error_type == "ValueError"

        def test_fixture_without_marker(gpu_case):
            pass
    """)
    result = pytester.runpytest_subprocess("test_fixture.py")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["test_fixture.py::test_fixture_without_marker: the gpu_case "
                                 "fixture needs the case folder: mark the test "
                                 "@pytest.mark.gpu_case(\"cases/NAME\")"])
    assert "UsageError" not in result.stdout.str()  # one clean error, no fixture traceback


def test_gpu_case_run_skips_where_the_run_cannot_happen(pytester: pytest.Pytester,
                                                       cases: Path) -> None:
    """An unmet [matrix.packages] requirement and a device type missing here skip the test with
    the reason --gpu-cases gives, placed at the test: a FAILED verdict (or a skipped verdict
    passing ``assert not verdict.failed``) told nothing true."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    write_case(cases, "needs_v2", """
        format = 1
        call = "gpucase_absent_ext:newfeature"
        [matrix.packages]
        gpucase-absent-ext = ">=2.0"
        """, None, {"x": torch.zeros(4)})
    ce_case(cases, "ce_class4", [0, 2, 4], RAISES)
    pytester.makepyfile(test_wrap="""
        import pytest

        @pytest.mark.gpu_case("cases/needs_v2")
        def test_unmet(gpu_case):
            assert not gpu_case.run("cpu").failed

        @pytest.mark.gpu_case("cases/ce_class4")
        def test_no_cuda(gpu_case):
            assert not gpu_case.run("cuda").failed

        @pytest.mark.gpu_case("cases/needs_sm80")
        def test_capability_is_the_gpu_runs(gpu_case):
            assert not gpu_case.run("cpu").failed
    """)
    # A compute capability holds back the accelerator runs only, as for the case's items.
    ce_case(cases, "needs_sm80", [0, 2, 4], RAISES, top='[matrix]\ncapability = ">=8.0"')
    result = pytester.runpytest_subprocess("test_wrap.py", "-rs")
    result.assert_outcomes(skipped=2, passed=1)
    result.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] test_wrap.py:3: requires gpucase-absent-ext>=2.0; not installed",
        "SKIPPED [[]1[]] test_wrap.py:7: no CUDA device here (* backend): a CPU pass is a hint, "
        "not CUDA validation; run it on a GPU runner",
    ])


def test_variant_skips_point_at_the_case_file(pytester: pytest.Pytester, cases: Path) -> None:
    """-rs placed every variant skip at the plugin's items.py, naming no case."""
    ce_case(cases, "ce_batch", [0, 2, 3], "[variants]\nbatch = { axis = 0, sizes = [8, 1] }",
            top='[matrix]\ndevices = ["cpu"]')
    result = pytester.runpytest_subprocess("--gpu-cases", "-rs", "cases")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] cases/ce_batch/case.toml:1: batch=8: the saved batch holds 3 entries on "
        "axis 0"])
    assert "items.py" not in result.stdout.str()


def test_an_integer_only_case_runs_one_dtype(pytester: pytest.Pytester, cases: Path) -> None:
    """A bfloat16 item cast nothing and recorded a bfloat16 pass of the float32 computation."""
    write_case(cases, "ids_only", """
        format = 1
        call = "case.py:run"
        [matrix]
        devices = ["cpu"]
        dtypes = ["float32", "bfloat16"]
        """, "def run(ids):\n    return ids * 2\n", {"ids": torch.tensor([3, 1, 2])})
    result = pytester.runpytest_subprocess("--gpu-cases", "-rs", "-v", "cases")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "cases/ids_only/case.toml::ids_only[[]cpu-float32[]] PASSED*",
        "SKIPPED [[]1[]] cases/ids_only/case.toml: no floating input to cast to bfloat16 "
        "(inputs.safetensors holds no floating tensor): this run would repeat the float32 run; "
        "list one dtype in [[]matrix[]] dtypes"])


BOUNDARIES = """
        [variants]
        boundaries = {{ input = "{input}", classes = 4, ignore_index = -100 }}
        [variants.reject]
        exception = "ValueError"
        match = "out of range"
"""


def test_a_boundary_failure_says_what_was_set_and_what_the_case_wants(
        pytester: pytest.Pytester, cases: Path) -> None:
    """A reject item whose call clamps -1 advised 'set [expect] outcome = "matches"' (already
    the default): accepting the invalid label is the bug."""
    clamps = CE_CASE_PY.replace("(target < 0) | ", "").replace(
        "return F.cross_entropy(logits, target,", "return F.cross_entropy(logits, "
        "torch.where(target == -1, 0, target),")
    path = ce_case(cases, "clamps", [-100, 2, 3], BOUNDARIES.format(input="target"),
                   top='[matrix]\ndevices = ["cpu"]')
    (path / "case.py").write_text(clamps)
    ce_case(cases, "typo", [0, 2, 3], BOUNDARIES.format(input="logits"),
            top='[matrix]\ndevices = ["cpu"]')
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-k",
                                           "clamps and boundary[-1] or typo and boundary[3]")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*_ clamps[[]cpu-float32-boundary[[]-1[]][]] _*",
        "boundary[[]-1[]] is a [[]variants[]] reject variant: expected ValueError matching 'out "
        "of range', but the call returned normally, accepting -1, a value the case says must be "
        "rejected",
        "",
        "boundary[[]-1[]]: set target[[]1[]] = -1 (saved 2); [[]variants[]] boundaries in "
        "case.toml makes -1 an out-of-range class index the case must reject "
        "([[]variants.reject[]]: ValueError matching 'out of range')",
        "*_ typo[[]cpu-float32-boundary[[]3[]][]] _*",
        "cases/typo/case.toml: [[]variants[]] boundaries: input 'logits' holds float32, not "
        "class indices: *; name the integer class-index input, e.g. input = \"target\"",
    ])
    assert "outcome = \"matches\"" not in result.stdout.str()
    assert "set logits" not in result.stdout.str()  # a broken case set nothing


def test_xfail_counts_only_the_known_failure(pytester: pytest.Pytester, cases: Path) -> None:
    origin = '\n[origin]\nerror = "ValueError: target out of range: [4]"\n'
    known = ce_case(cases, "known", [0, 2, 4], origin, top='xfail = "labels 1..4"')
    other = ce_case(cases, "other", [0, 2, 4], origin, top='xfail = "labels 1..4"')
    (other / "case.py").write_text("def run(logits, target, num_classes, ignore_index):\n"
                                   "    raise RuntimeError('a different bug')\n")
    broken = ce_case(cases, "broken", [0, 2, 4], origin, top='xfail = "labels 1..4"')
    (broken / "case.py").write_text("import not_installed_anywhere\n")
    exits = ce_case(cases, "exits", [0, 2, 4], origin, top='xfail = "labels 1..4"')
    (exits / "case.py").write_text("import os\n\ndef run(logits, target, num_classes, "
                                   "ignore_index):\n    os._exit(7)\n")
    assert known.exists()
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rxf", "cases")
    result.assert_outcomes(xfailed=1, failed=3)
    # An exit without a result is not the ValueError recorded: a failure, with no advice to
    # expect an exception that nothing raised.
    result.stdout.fnmatch_lines(["FAILED cases/exits/case.toml::exits[[]cpu-float32[]] - *"])
    assert "exception = \"None\"" not in result.stdout.str()
    result.stdout.fnmatch_lines_random([
        "XFAIL cases/known/case.toml::known[[]cpu-float32[]] - labels 1..4",
        # (the summary line is cut at the terminal's width)
        "FAILED cases/other/case.toml::other[[]cpu-float32[]] - the call raised*",
        "FAILED cases/broken/case.toml::broken[[]cpu-float32[]] - cases/broken/case.toml:*",
    ])
    # The other failure says why it fails the run, and what a fix that rejects should change.
    result.stdout.fnmatch_lines([
        "This is not the captured failure (ValueError: target out of range: [[]4[]]), the only "
        "one the case's xfail counts as expected. If rejecting these inputs is the fix, make "
        "the case expect it: [[]expect[]] outcome = \"raises\", exception = \"RuntimeError\", "
        "and remove xfail. Otherwise it is a new failure.",
    ])
    assert result.stdout.str().count("If rejecting these inputs is the fix") == 1  # other's
    assert result.stdout.str().count("This is not the captured failure") == 2  # not broken's
    # --runxfail shows the known failure as a failure: it is the captured one, said as such.
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "--runxfail",
                                           "cases/known")
    result.assert_outcomes(failed=1)
    assert "This is not the captured failure" not in result.stdout.str()


def test_unknown_device_or_dtype_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cdua")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --gpu-devices: unknown 'cdua'; expected one of cuda, "
                                 "cpu, mps, xpu"])
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-dtypes", "bf16")
    result.stderr.fnmatch_lines(["*argument --gpu-dtypes: unknown 'bf16'; expected one of *"])


def test_golden_regen_workflow(pytester: pytest.Pytester, cases: Path) -> None:
    """create -> pass -> change -> fail -> regen -> pass, as pytest-regressions tests it."""
    path = write_case(cases, "scale", 'format = 1\ncall = "case.py:run"\n[matrix]\n'
                      'devices = ["cpu"]\n', "def run(x):\n    return {'y': x * 2}\n",
                      {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    golden = path / "expected.safetensors"
    plain = pytester.runpytest_subprocess("--gpu-cases", "cases")
    plain.assert_outcomes(passed=1)
    assert not golden.exists()  # a normal run never creates a golden
    regen = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases")
    regen.assert_outcomes(passed=1)
    regen.stdout.fnmatch_lines(["*gpucase: golden files written*",
                                "cases/scale/expected.safetensors"])
    assert golden.exists()
    pytester.runpytest_subprocess("--gpu-cases", "cases").assert_outcomes(passed=1)
    (path / "case.py").write_text("def run(x):\n    return {'y': x * 2 + 1}\n")
    changed = pytester.runpytest_subprocess("--gpu-cases", "cases")
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines([
        "outputs match the reference, but the float64 reference differs from the golden "
        "expected.safetensors (actual: the reference now): the computation changed since the "
        "golden was written; if the change is intended, rewrite it with --gpu-cases-regen",
        "out[[]'y'[]]: values differ",
    ])
    pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases").assert_outcomes(
        passed=1)
    pytester.runpytest_subprocess("--gpu-cases", "cases").assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_pass_of_an_incomplete_case_fails_its_item_and_the_fixture(
        pytester: pytest.Pytester, cases: Path) -> None:
    """A case the Recorder marked incomplete (no xfail line) replays something other than
    what failed: its item passed, and the CI gate read green while training still crashed.
    Its pass is now the case's failure, naming what it lacks, in the item and in
    ``gpu_case.run``, and in the JSON report."""
    write_case(cases, "half", """
        format = 1
        call = "case.py:run"

        [origin]
        error = "IndexError: index out of range in self"
        incomplete = ["temperature was set after construction, which the rebuild lacks"]
        """, "def run(x):\n    return x + 1\n", {"x": torch.zeros(4)})
    write_case(cases, "whole", """
        format = 1
        call = "case.py:run"

        [origin]
        error = "IndexError: index out of range in self"
        incomplete = []
        """, "def run(x):\n    return x + 1\n", {"x": torch.zeros(4)})
    pytester.makepyfile(test_wrap="""
        import pytest

        @pytest.mark.gpu_case("cases/half")
        def test_half(gpu_case):
            verdict = gpu_case.run("cpu")
            assert verdict.failed and verdict.outcome.error_type == "IncompleteCase"
            assert "the run passed, but the case is incomplete" in verdict.outcome.summary
            assert "temperature was set" in verdict.outcome.details
    """)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "test_wrap.py",
                                           "--gpu-devices", "cpu", "-p", "no:randomly",
                                           "--gpu-cases-report", "report.json")
    result.assert_outcomes(failed=1, passed=2)   # half's item; whole's item, test_half
    out = result.stdout.str()
    assert "the run passed, but the case is incomplete ([origin] incomplete)" in out
    assert "temperature was set after construction" in out
    assert "delete `incomplete` from [origin] in case.toml" in out
    assert out.count("temperature was set after construction") == 1   # listed once
    import json

    records = {r["case"]: r for r in json.loads(
        (pytester.path / "report.json").read_text())["results"]}
    assert records["half"]["outcome"] == "failed"
    assert records["half"]["error_type"] == "IncompleteCase"
    assert records["whole"]["outcome"] == "passed"   # an emptied list: completed

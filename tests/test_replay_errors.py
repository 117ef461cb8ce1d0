"""How a case's own exceptions are told: whatever they raise, and however they print."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import write_case

TOML = 'format = 1\ncall = "case.py:run"\n[matrix]\ndevices = ["cpu"]\n'
X = {"x": torch.tensor([1.0, 2.0])}


def test_an_exception_whose_str_raises_is_told_as_python_tells_it(
        pytester: pytest.Pytester) -> None:
    """The description did f"{exc}", whose failure ended the run as "the run failed inside
    the child" with gpucase's frames; now the words of Python's traceback module."""
    write_case(pytester.path, "str_raises", TOML, """
        class E(Exception):
            def __str__(self):
                raise ValueError('str broke')

        def run(x):
            raise E()
        """, X)
    write_case(pytester.path, "str_raises_expected", TOML + '[expect]\noutcome = "raises"\n'
               'exception = "E"\nmatch = "failed"\n', """
        class E(Exception):
            def __str__(self):
                raise ValueError('str broke')

        def run(x):
            raise E()
        """, X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*str_raises[[]cpu-float32[]] FAILED*",
        "*str_raises_expected[[]cpu-float32[]] PASSED*",
        "the call raised E: <exception str() failed>",
        "Traceback (most recent call last):",
        '  File "*case.py", line 6, in run',
        "*.E: <exception str() failed>",
    ])
    assert_told_as_the_users(result)


def assert_told_as_the_users(result: pytest.RunResult) -> None:
    """The exception is told as the case's own: not as gpucase's failure, not in its frames."""
    text = result.stdout.str()
    assert "failed inside the child" not in text
    assert "run/child.py" not in text and "run/isolation" not in text


@pytest.mark.parametrize(("raise_", "told"), [
    ("raise SystemExit(0)", "SystemExit: 0"),
    ("import sys; sys.exit('bye')", "SystemExit: bye"),
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("raise Weird('odd')", "Weird: odd"),
    ("raise GeneratorExit", "GeneratorExit"),
])
def test_a_base_exception_from_the_call_is_told_as_any_other(
        pytester: pytest.Pytester, raise_: str, told: str) -> None:
    """SystemExit, KeyboardInterrupt and BaseException subclasses were "the run failed inside
    the child" with gpucase's frames; the session goes on to the next item."""
    write_case(pytester.path, "a", TOML, f"""
        class Weird(BaseException):
            pass

        def run(x):
            {raise_}
        """, X)
    write_case(pytester.path, "b", TOML, "def run(x):\n    return x * 2\n", X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"the call raised {told}", "Traceback (most recent call last):",
                                 '  File "*case.py", line 5, in run'])
    assert_told_as_the_users(result)


def test_the_references_base_exception_and_an_expected_system_exit(
        pytester: pytest.Pytester) -> None:
    write_case(pytester.path, "reference_exits", TOML.replace(
        "[matrix]", 'reference = "case.py:reference"\n[matrix]'), """
        def run(x):
            return x

        def reference(x):
            raise SystemExit(3)
        """, X)
    write_case(pytester.path, "expects_exit", TOML + '[expect]\noutcome = "raises"\n'
               'exception = "SystemExit"\nmatch = "^2$"\n', """
        def run(x):
            raise SystemExit(2)
        """, X)
    write_case(pytester.path, "expects_exception", TOML + '[expect]\noutcome = "raises"\n'
               'exception = "Exception"\n', """
        def run(x):
            raise SystemExit(2)
        """, X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*expects_exception[[]cpu-float32[]] FAILED*",
        "*expects_exit[[]cpu-float32[]] PASSED*",
        "*reference_exits[[]cpu-float32[]] FAILED*",
        "expected Exception; the call raised SystemExit: 2",
        "*",
        "the reference could not run: SystemExit: 3 (case.py:reference, on the CPU in "
        "float64); fix it so that the call's outputs can be judged",
    ])
    assert "failed inside the child" not in result.stdout.str()


def test_sys_exit_while_the_case_file_is_imported_is_a_broken_case(
        pytester: pytest.Pytester) -> None:
    write_case(pytester.path, "exits", TOML, "import sys\nsys.exit(1)\n", X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["cases/exits/case.toml: call: importing 'case.py' failed",
                                 "*SystemExit: 1"])
    assert "failed inside the child" not in result.stdout.str()


def test_a_traceback_the_traceback_module_cannot_format_still_names_the_exception() -> None:
    """``user_traceback`` must not raise in place of the user's exception."""
    from pytest_gpucase.run.outcome import user_traceback

    class Hostile(Exception):
        @property
        def __notes__(self) -> list[str]:
            raise RuntimeError("notes broke")

        def __str__(self) -> str:
            raise ValueError("str broke")

    text = user_traceback(Hostile())
    assert text == ("Hostile: <exception str() failed>\n(its traceback could not be formatted: "
                    "RuntimeError: notes broke)\n")


def test_a_binding_problem_is_printed_once(pytester: pytest.Pytester) -> None:
    """The summary was printed, then the same line again as the details."""
    write_case(pytester.path, "extra", TOML + "[inputs]\nfoo = 3\n",
               "def run(x):\n    return x\n", X)
    write_case(pytester.path, "two", TOML + "[inputs]\nfoo = 3\n",
               "def run(x, y):\n    return x + y\n", X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=2)
    extra = ("cases/extra/case.toml: [inputs] 'foo' is not a parameter of case.py:run(x); "
             "remove it or add the parameter")
    lines = result.stdout.lines
    assert lines.count(extra) == 1, result.stdout.str()
    two = [line for line in lines if line.startswith("cases/two/case.toml: ")]
    assert len(two) == 2 and len(set(two)) == 2, result.stdout.str()
    assert any("'foo' is not a parameter" in line for line in two)
    assert any("parameter 'y' of case.py:run has no value" in line for line in two)



@pytest.mark.parametrize("args", [["-rf", "-p", "no:xdist"], ["-rf", "-n", "2"], ["-rf", "-vv"]],
                         ids=["serial", "xdist", "very-verbose"])
def test_a_ci_log_shows_a_failure_once(pytester: pytest.Pytester,
                                       monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    """On CI (``CI`` set: GitHub Actions, GitLab, ...) and under -vv, pytest's short summary
    prints a string failure whole: every failure's text appeared twice in the log. The
    summary line, and junit's message, carry the first line; the text is shown once."""
    monkeypatch.setenv("CI", "true")
    write_case(pytester.path, "two", TOML + "[inputs]\nfoo = 3\n",
               "def run(x, y):\n    return x + y\n", X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "--junitxml=out.xml", *args)
    result.assert_outcomes(failed=1)
    first = ("cases/two/case.toml: [inputs] 'foo' is not a parameter of case.py:run(x, y); "
             "remove it or add the parameter")
    second = "parameter 'y' of case.py:run has no value"
    assert f"FAILED cases/two/case.toml::two[cpu-float32] - {first}" in result.stdout.lines
    text = result.stdout.str()
    assert text.count(first) == 2 and text.count(second) == 1, text  # summary + text; text
    junit = (pytester.path / "out.xml").read_text()
    assert 'message="cases/two/case.toml: [inputs] \'foo\' is not a parameter' in junit, junit
    assert second in junit  # the whole text is the failure element's body


def test_tb_line_shows_the_first_line_alone(pytester: pytest.Pytester) -> None:
    """--tb=line asks for one line per failure; the whole text was printed above it."""
    write_case(pytester.path, "two", TOML + "[inputs]\nfoo = 3\n",
               "def run(x, y):\n    return x + y\n", X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "--tb=line")
    result.assert_outcomes(failed=1)
    assert ("cases/two/case.toml:1: cases/two/case.toml: [inputs] 'foo' is not a parameter of "
            "case.py:run(x, y); remove it or add the parameter") in result.stdout.lines
    assert "has no value" not in result.stdout.str()

def test_the_references_output_is_labelled_and_only_when_it_runs(
        pytester: pytest.Pytester) -> None:
    """A case printing in its function showed the call's lines, then the reference's, with
    nothing between them. The label goes before the reference's first text on each stream;
    a quiet reference adds none, and one read from the cache prints nothing."""
    from pytest_gpucase.run.judge import REFERENCE_OUTPUT

    marker = REFERENCE_OUTPUT.rstrip("\n")
    write_case(pytester.path, "prints", TOML, """
        import sys
        import time

        def run(x):
            print("called with", x.dtype)
            print("on stderr", x.dtype, file=sys.stderr)
            time.sleep(0.05)  # worth caching
            return x * 2
        """, X)
    write_case(pytester.path, "quiet", TOML.replace(
        "[matrix]", 'reference = "case.py:reference"\n[matrix]'), """
        def run(x):
            return x

        def reference(x):
            return x * 3
        """, X)
    first = pytester.runpytest_subprocess("--gpu-cases", "cases", "-rA")
    first.assert_outcomes(passed=1, failed=1)
    first.stdout.fnmatch_lines([
        "*Captured stdout (child) call*", "called with torch.float32", marker,
        "called with torch.float64",
        "*Captured stderr (child) call*", "on stderr torch.float32", marker,
        "on stderr torch.float64",
    ])
    assert first.stdout.lines.count(marker) == 2  # none for the quiet reference
    assert "_ quiet[cpu-float32] _" in first.stdout.str()
    quiet = first.stdout.str().split("_ quiet[cpu-float32] _")[1].split("\n___")[0]
    assert "Captured" not in quiet, quiet
    again = pytester.runpytest_subprocess("--gpu-cases", "cases", "-rA", "-k", "prints")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*Captured stdout (child) call*", "called with torch.float32"])
    assert marker not in again.stdout.str()
    assert "torch.float64" not in again.stdout.str()


def test_a_label_lost_in_the_clipped_middle_is_told_by_the_omission_line(
        pytester: pytest.Pytester) -> None:
    """The call and the reference each print more than the capture keeps: the label fell in
    the omitted middle, and the tail, all of it the reference's output, read as the call's."""
    from pytest_gpucase.run.judge import OUTPUT_MARKS, REFERENCE_OUTPUT

    write_case(pytester.path, "floods", TOML, """
        def run(x):
            for i in range(200):
                print(x.dtype, i, "y" * 500)
            return x * 2 + (1 if x.dtype.itemsize == 4 else 0)
        """, X)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*Captured stdout (child) call*", "torch.float32 0 y*",
        f"[[]... * bytes omitted; {OUTPUT_MARKS[REFERENCE_OUTPUT]} ...[]]",
        "torch.float64 * y*",
    ])
    assert REFERENCE_OUTPUT.rstrip("\n") not in result.stdout.str()

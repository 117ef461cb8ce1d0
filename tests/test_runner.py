"""The parent's side of a run: verdicts from real children, triage, launch-blocking rerun."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_gpucase.case.load import load_case
from pytest_gpucase.run.isolation import ChildResult, WorkerPool
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.parent import _crash_outcome, describe_rerun, run_spec
from pytest_gpucase.run.runcontext import RunContext

pytestmark = pytest.mark.slow  # every test here starts processes

# A test double, honest about being one: this machine has no GPU, so the case
# fakes what CUDA does. Without CUDA_LAUNCH_BLOCKING the "kernel" error surfaces
# late, at a later call, as the asynchronous message; with it, the error is
# raised where the bad index is used, with the kernel's assertion line on fd 2.
ASYNC_DOUBLE = '''
import os

def gather(index):
    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        os.write(2, b"IndexKernel.cu:92: operator(): block: [0,0,0], thread: [6,0,0] "
                    b"Assertion `index out of bounds` failed.\\n")
        raise RuntimeError("CUDA error: device-side assert triggered (at gather, index 7)")
    return index

def run(index):
    gather(index)
    raise RuntimeError("CUDA error: device-side assert triggered\\nCUDA kernel errors might be "
                       "asynchronously reported at some other API call, so the stacktrace "
                       "below might be incorrect.")
'''


def make_case(root: Path, toml: str, code: str) -> RunSpec:
    path = root / "double"
    path.mkdir()
    (path / "case.toml").write_text(textwrap.dedent(toml).lstrip())
    (path / "case.py").write_text(textwrap.dedent(code).lstrip())
    return RunSpec(load_case(path), "cpu", "float32", cast=False)


TOML = """
    format = 1
    call = "case.py:run"
    timeout = 30
    [inputs]
    index = 7
"""


def test_asynchronous_error_is_rerun_with_launch_blocking(tmp_path: Path) -> None:
    spec = make_case(tmp_path, TOML, ASYNC_DOUBLE)
    verdict = run_spec(spec, RunContext("fork", "cuda"))  # pretend: a CUDA build
    assert verdict.failed
    assert verdict.triage is not None and verdict.triage.asynchronous
    rerun = verdict.localized
    assert rerun is not None
    assert dict(rerun.spec.env) == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert "at gather, index 7" in rerun.outcome.summary
    text = describe_rerun(verdict)
    assert text.splitlines()[:3] == [
        "rerun in a new child with CUDA_LAUNCH_BLOCKING=1:",
        "  first error as seen: the call raised RuntimeError: CUDA error: device-side assert "
        "triggered",
        "  with launch blocking: the call raised RuntimeError: CUDA error: device-side assert "
        "triggered (at gather, index 7)",
    ]
    assert "kernel assertion: IndexKernel.cu:92: operator(): block: [0,0,0], thread: [6,0,0] " \
        "Assertion `index out of bounds` failed." in text
    assert 'line 7, in gather' in rerun.outcome.details
    assert 'run/child.py' not in rerun.outcome.details  # our own frames are hidden


def test_rocm_rerun_uses_its_own_variable(tmp_path: Path) -> None:
    spec = make_case(tmp_path, TOML, ASYNC_DOUBLE)
    verdict = run_spec(spec, RunContext("fork", "rocm"))
    assert verdict.localized is not None
    assert dict(verdict.localized.spec.env) == {"AMD_SERIALIZE_KERNEL": "3"}


def test_no_rerun_on_cpu_backend_or_when_disabled(tmp_path: Path) -> None:
    spec = make_case(tmp_path, TOML, ASYNC_DOUBLE)
    assert run_spec(spec, RunContext("fork", "cpu")).localized is None
    assert run_spec(spec, RunContext("fork", "cuda", localize=False)).localized is None


def test_synchronous_error_is_not_rerun(tmp_path: Path) -> None:
    spec = make_case(tmp_path, TOML, "def run(index):\n    raise ValueError('bad label')\n")
    verdict = run_spec(spec, RunContext("fork", "cuda"))
    assert verdict.failed and verdict.localized is None


def test_crash_outcome_names_the_signal_and_keeps_the_assertion_line(tmp_path: Path) -> None:
    code = """
        import os, signal

        def run(index):
            os.write(2, b"Loss.cu:250: block: [0,0,0] "
                        b"Assertion `t >= 0 && t < n_classes` failed.\\n")
            os.kill(os.getpid(), signal.SIGABRT)
    """
    spec = make_case(tmp_path, TOML, code)
    verdict = run_spec(spec, RunContext("fork", "cpu"))
    assert verdict.outcome.summary.endswith("run crashed with signal 6 (SIGABRT)")
    assert verdict.outcome.error_message == (
        "Loss.cu:250: block: [0,0,0] Assertion `t >= 0 && t < n_classes` failed.")
    assert verdict.triage is not None and verdict.triage.clue.startswith("device-side assert")


def test_fork_after_parallel_cpu_work_in_the_parent_does_not_hang(tmp_path: Path) -> None:
    # Parallel work here starts OpenMP's thread pool, which a forked child cannot
    # use: without the one-thread policy, this child's parallel sum would hang.
    import torch

    float(torch.randn(4_000_000).sum())
    spec = make_case(tmp_path, 'format = 1\ncall = "case.py:run"\ntimeout = 20\n',
                     "import torch\n\ndef run():\n    return torch.ones(4_000_000).sum()\n")
    verdict = run_spec(spec, RunContext("fork", "cpu"))
    assert verdict.outcome.status == "passed", verdict.outcome
    assert verdict.child.duration < 15


SLOW_REFERENCE = """
    import time

    def run(index):
        if {hang_in_call}:
            time.sleep(600)
        return float(index)

    def reference(index):
        time.sleep(600)
        return float(index)
"""


CRASHING_REFERENCE = """
    import os

    def run(index):
        return float(index)

    def reference(index):
        os._exit(3)
"""


def test_a_crash_in_the_reference_says_the_call_returned(tmp_path: Path) -> None:
    toml = TOML.replace("timeout = 30", 'timeout = 30\nreference = "case.py:reference"')
    spec = make_case(tmp_path, toml, CRASHING_REFERENCE)
    verdict = run_spec(spec, RunContext("fork", "cpu"))
    assert verdict.outcome.kind == "crash"
    assert re.fullmatch(r"\S+case\.toml: run exited with code 3 without returning a result "
                        r"while computing the float64 reference on the CPU \(the call itself "
                        r"returned after \S+ s\)", verdict.outcome.summary), verdict.outcome.summary


def test_a_timeout_in_the_reference_is_not_told_as_the_call_hanging(tmp_path: Path) -> None:
    """The call returned and only the float64 reference ran out of time: the summary says
    so (the stack dump hides gpucase's frames, so it showed only the case's own function);
    a call that hangs is told as before. In worker isolation too, whose failure is judged
    again in a fresh child."""
    toml = TOML.replace("timeout = 30", 'timeout = 5\nreference = "case.py:reference"')
    spec = make_case(tmp_path, toml, SLOW_REFERENCE.format(hang_in_call=False))
    pool = WorkerPool()
    try:
        for verdict in (run_spec(spec, RunContext("fork", "cpu")),
                        run_spec(spec, RunContext("fork", "cpu", isolation="worker", pool=pool))):
            assert verdict.outcome.kind == "timeout"
            assert re.fullmatch(
                r"\S+case\.toml: run timed out after 5 s while computing the float64 reference "
                r"on the CPU \(the call itself returned after \S+ s\) and was killed with its "
                r"process group and every process it started; the stack of every thread at the "
                r"timeout is in the captured stderr; the timeout counts the call, its float64 "
                r"reference and the comparison together: raise timeout in case\.toml if they "
                r"are slow, not hung", verdict.outcome.summary), verdict.outcome.summary
    finally:
        pool.close()
    (tmp_path / "hung").mkdir()
    spec = make_case(tmp_path / "hung", toml, SLOW_REFERENCE.format(hang_in_call=True))
    hung = run_spec(spec, RunContext("fork", "cpu"))
    assert hung.outcome.summary.endswith(
        "case.toml: run timed out after 5 s and was killed with its process group and every "
        "process it started; the stack of every thread at the timeout is in the captured stderr")


def test_a_timeout_before_the_child_started_says_so_without_pointing_at_stacks(
        tmp_path: Path) -> None:
    """A child killed while still starting (a loaded runner) has no stacks to point at."""
    spec = make_case(tmp_path, TOML, SLOW_REFERENCE.format(hang_in_call=True))
    starting = ChildResult(value=None, returned=False, exitcode=None, signal=9, timed_out=True,
                           stdout="", stderr="", duration=30.0, start_method="spawn",
                           starting=True)
    outcome = _crash_outcome(spec, starting)
    assert outcome.kind == "timeout"
    assert outcome.summary.endswith(
        "case.toml: run timed out after 30 s and was killed with its process group and every "
        "process it started; its process was still starting, before the case's code ran, so "
        "there are no stacks: raise timeout in case.toml if this machine is that loaded")
    assert outcome.error_message == "timed out while starting"


def test_deterministic_false_does_not_import_inductor(tmp_path: Path) -> None:
    """``[context] deterministic = false`` turns the flag off without importing inductor
    (some 800 modules, a second per run, and a worker's namespaces changed by the import)."""
    toml = TOML + "[context]\ndeterministic = false\n"
    # A forked child has what this process imported: an earlier test here may have
    # compiled something (the child's own import is what is checked).
    inherited = "torch._inductor" in sys.modules
    code = f"""
        import sys

        import torch

        def run(index):
            assert {inherited} or "torch._inductor" not in sys.modules, "inductor was imported"
            assert not torch.are_deterministic_algorithms_enabled()
            return torch.tensor([index])
    """
    verdict = run_spec(make_case(tmp_path, toml, code), RunContext("fork", "cpu"))
    assert verdict.outcome.status == "passed", verdict.outcome.details

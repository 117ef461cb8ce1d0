"""--gpu-isolation: a reused child gives the verdicts a fresh child gives, on every bundled case
and on cases that try to poison the ones after them."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.run.isolation import WorkerPool, shutdown

from . import isolation_targets as targets

BUNDLED = Path(__file__).resolve().parents[1] / "cases"

# Each poisoning case passes on its own; the victim after it fails if the state leaked.
POISONS = {
    "p1_tf32": "torch.backends.cuda.matmul.allow_tf32 = True\n"
               "    torch.backends.cudnn.allow_tf32 = False\n"
               "    torch.set_float32_matmul_precision('medium')",
    "p2_default_dtype": "torch.set_default_dtype(torch.float64)",
    "p3_state": "torch.set_grad_enabled(False)\n    os.environ['GPUCASE_POISON'] = '1'\n"
                "    os.chdir('/')\n    torch.manual_seed(1234)",
    "p4_crash": "os.kill(os.getpid(), signal.SIGSEGV)",
    "p5_hang": "time.sleep(600)",
}
VICTIM = """
    assert torch.get_default_dtype() == torch.float32, torch.get_default_dtype()
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.allow_tf32
    assert torch.is_grad_enabled()
    assert "GPUCASE_POISON" not in os.environ"""
CUDA_ERROR = "torch.zeros(3, device='cuda')[torch.tensor([5], device='cuda')].sum().item()"


def write_case(root: Path, name: str, body: str, devices: str = '["cpu"]') -> None:
    path = root / "cases" / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(f'format = 1\ncall = "case.py:run"\ntimeout = 3\n\n'
                                    f'[matrix]\ndevices = {devices}\n')
    (path / "case.py").write_text(textwrap.dedent(f"""\
        import os, signal, time
        import torch

        def run(x):
            {body}
            return x + 1
        """))
    payload.save(path / "inputs.safetensors", {"x": torch.ones(4)})


def verdicts(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    report = pytester.path / f"report{len(list(pytester.path.glob('report*')))}.json"
    pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-report", str(report),
                                  "-p", "no:cacheprovider", *args, "cases")
    results = json.loads(report.read_text())["results"]
    return {record["nodeid"]: record["outcome"] for record in results}


def poisoned_cases(root: Path, devices: str = '["cpu"]') -> None:
    for name, body in POISONS.items():
        write_case(root, name, body, devices)
        write_case(root, f"{name}_victim", VICTIM, devices)


def test_verdicts_match_fresh_children_on_bundled_and_poisoning_cases(
        pytester: pytest.Pytester) -> None:
    shutil.copytree(BUNDLED, pytester.path / "cases")
    poisoned_cases(pytester.path)
    fresh = verdicts(pytester, "--gpu-isolation", "item")
    assert fresh["cases/p4_crash/case.toml::p4_crash[cpu-float32]"] == "failed"
    assert fresh["cases/p5_hang/case.toml::p5_hang[cpu-float32]"] == "failed"
    assert sum(outcome == "passed" for outcome in fresh.values()) >= 10
    for mode in ("case", "worker"):
        assert verdicts(pytester, "--gpu-isolation", mode) == fresh, mode


@pytest.mark.gpu
def test_verdicts_match_on_cuda_with_a_sticky_device_error(pytester: pytest.Pytester) -> None:
    shutil.copytree(BUNDLED, pytester.path / "cases")
    poisoned_cases(pytester.path, '["cuda"]')
    write_case(pytester.path, "p6_device_assert", CUDA_ERROR, '["cuda"]')
    write_case(pytester.path, "p6_device_assert_victim", VICTIM, '["cuda"]')
    fresh = verdicts(pytester, "--gpu-isolation", "item")
    assert "failed" in fresh.values()
    for mode in ("case", "worker"):
        assert verdicts(pytester, "--gpu-isolation", mode) == fresh, mode


def set_default_dtype() -> str:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["GPUCASE_POISON"] = "1"
    return str(torch.get_default_dtype())


def global_state() -> list[object]:
    return [str(torch.get_default_dtype()), torch.is_grad_enabled(),
            os.environ.get("GPUCASE_POISON"), os.getpid()]


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_restores_global_state_between_calls(method: str) -> None:
    pool = WorkerPool()
    try:
        first = pool.run("k", set_default_dtype, timeout=60, start_method=method)
        assert first.value == "torch.float64"
        second = pool.run("k", global_state, timeout=60, start_method=method)
        assert second.value[:3] == ["torch.float32", True, None]
        third = pool.run("k", global_state, timeout=60, start_method=method)
        assert third.value[3] == second.value[3]  # the same child: it was reused
    finally:
        pool.close()


def test_a_crash_or_timeout_ends_the_worker_and_the_next_call_gets_a_new_one() -> None:
    pool = WorkerPool()
    try:
        before = pool.run("k", os.getpid, timeout=60).value
        assert pool.run("k", targets.segfault, timeout=60).signal is not None
        after_crash = pool.run("k", os.getpid, timeout=60).value
        assert after_crash != before
        assert pool.run("k", targets.hang, timeout=1).timed_out
        assert pool.run("k", os.getpid, timeout=60).value not in (before, after_crash)
    finally:
        pool.close()


def test_session_end_leaves_no_worker() -> None:
    pool = WorkerPool()
    pid = pool.run("k", os.getpid, timeout=60).value
    shutdown()
    assert not pool.workers
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

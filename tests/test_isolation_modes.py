"""--gpu-isolation: a reused child gives the verdicts a fresh child gives, on every bundled case
and on cases that try to poison the ones after them."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.run.isolation import WorkerPool, run_in_child, shutdown

from . import isolation_targets as targets
from .helpers import FORKING

pytestmark = pytest.mark.slow  # every test here starts processes

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
# A case's run timeout, 3 s on a loaded runner; 1 s for the case that must time out.
TIMEOUTS = {"p5_hang": 1}
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
    timeout = TIMEOUTS.get(name, 3)
    (path / "case.toml").write_text(f'format = 1\ncall = "case.py:run"\ntimeout = {timeout}\n\n'
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
    # A project has a pytest configuration file, which the worker reads (import paths).
    (pytester.path / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    shutil.copytree(BUNDLED, pytester.path / "cases")
    poisoned_cases(pytester.path)
    fresh = verdicts(pytester, "--gpu-isolation", "item")
    assert fresh["cases/p4_crash/case.toml::p4_crash[cpu-float32]"] == "failed"
    assert fresh["cases/p5_hang/case.toml::p5_hang[cpu-float32]"] == "failed"
    assert sum(outcome == "passed" for outcome in fresh.values()) >= 10
    for mode in ("case", "worker"):
        assert verdicts(pytester, "--gpu-isolation", mode) == fresh, mode


def test_a_worker_serves_every_bundled_case_of_a_configured_project(
        pytester: pytest.Pytester) -> None:
    """With a pytest configuration file in the project, the plugin's own caches (the files
    read for a case's import paths) are no state a case left: no worker is retired."""
    (pytester.path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n"
                                                  "pythonpath = [\".\"]\n")
    shutil.copytree(BUNDLED, pytester.path / "cases")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-isolation", "worker",
                                           "--gpu-devices", "cpu", "-p", "no:cacheprovider",
                                           "cases")
    retired = [line for line in result.stdout.lines if "left its worker" in line]
    assert not retired, retired
    assert result.parseoutcomes().get("passed", 0) >= 8


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


@pytest.mark.parametrize("method", FORKING)
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


# --- a reused worker ends after any call that left state a fresh child would not have --------

@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    from tests import leak_helper  # noqa: F401 - imported before the workers fork, as a
    # conftest's import would be: a module the workers share with the parent
    import pytest_gpucase.run.child  # noqa: F401 - as run_spec has it imported: its
    # comparison and tolerance tables are the workers' from their start

    found = WorkerPool()
    try:
        yield found
    finally:
        found.close()


def test_a_call_that_changes_nothing_keeps_its_worker(pool: WorkerPool) -> None:
    first = pool.run("k", targets.echo, 1, timeout=60)
    second = pool.run("k", os.getpid, timeout=60)
    third = pool.run("k", os.getpid, timeout=60)
    assert (first.reused, second.reused, third.reused) == (False, True, True)
    assert second.value == third.value
    assert pool.retired == []


@pytest.mark.parametrize("kind", sorted(targets.LEAKS))
def test_a_worker_that_a_call_left_changed_ends(pool: WorkerPool, kind: str) -> None:
    first = pool.run("k", targets.leave, kind, timeout=60)
    assert first.returned, first.problem
    after = pool.run("k", os.getpid, timeout=60)
    assert after.returned and after.value != first.value, "the worker was reused"
    assert not after.reused  # a new worker's first call: a fresh child
    assert len(pool.retired) == 1
    reasons = " ".join(pool.retired[0][1])
    assert targets.LEAKS[kind][1] in reasons, reasons


def test_a_forkserver_worker_ends_too(pool: WorkerPool) -> None:
    first = pool.run("k", targets.leave, "torch.exp replaced", timeout=60,
                     start_method="forkserver")
    after = pool.run("k", os.getpid, timeout=60, start_method="forkserver")
    assert after.value != first.value and "torch.exp" in " ".join(pool.retired[0][1])


def test_a_worker_whose_zygote_was_ended_is_not_called_again(
        pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ending a zygote that stopped answering (a run's prepare blocked it) ends the workers
    it forked: the next call goes to a new worker, and the retirement says why, instead of
    a crash of the case that call runs."""
    from pytest_gpucase.run import isolation

    first = pool.run("k", os.getpid, timeout=60, start_method="forkserver")
    monkeypatch.setattr(isolation, "ANSWER_GRACE", 0.5)
    with pytest.raises(RuntimeError, match="did not fork"):
        run_in_child(targets.nothing, timeout=0.5, start_method="forkserver",
                     prepare=(targets.slow_prepare, (60.0,), {}))
    after = pool.run("k", os.getpid, timeout=60, start_method="forkserver")
    assert after.returned and after.value != first.value, after.problem
    assert any("zygote was ended" in why for _, why in pool.take_retired() for why in why)


@pytest.mark.parametrize("kind", sorted(targets.RESTORED))
def test_what_is_restored_keeps_the_worker(pool: WorkerPool, kind: str) -> None:
    fresh = run_in_child(targets.probe_restored, kind, timeout=60).value
    changed = pool.run("k", targets.change_restored, kind, timeout=60)
    assert changed.returned, changed.problem
    pid, value = pool.run("k", targets.probe_restored, kind, timeout=60).value
    assert pid == changed.value, pool.retired  # the same worker
    assert value == fresh[1]


def test_a_helper_the_call_imported_is_imported_afresh(pool: WorkerPool, tmp_path: Path) -> None:
    (tmp_path / "new_helper.py").write_text("VALUE = 1\n")
    first = pool.run("k", targets.import_helper_from, str(tmp_path), 2, timeout=60)
    pid, value = pool.run("k", targets.helper_value, str(tmp_path), timeout=60).value
    assert pid == first.value and value == 1  # forgotten, not kept: as a fresh child has it



# --- verdict parity with fresh children, on cases that leave state behind ---------------------

# kind -> (what the case leaves behind, what its victim asserts: true only with the state left)
LEFT_BEHIND = {
    "exp": ("torch.exp = lambda t, *a, **k: torch.zeros_like(t)", None),
    "aten_kernel": ("lib = torch.library.Library('aten', 'IMPL'); "
                    "lib.impl('exp', lambda t: torch.zeros_like(t), 'CPU'); torch._lib = lib",
                    None),
    "gpucase_table": ("from pytest_gpucase.verdict import tolerance as t; "
                      "t.DEFAULT_TOLERANCES[torch.float32] = t.Tolerance(rtol=1.0, atol=1.0)",
                      "OFF_BY_1E-3"),
    "gpucase_compare": ("from pytest_gpucase.verdict.compare import Comparison; "
                        "Comparison.ok = property(lambda self: True)", "OFF_BY_1E-3"),
    "optim": ("torch.optim.SGD.step = lambda self, closure=None: None",
              "torch.optim.SGD.step.__name__ == '<lambda>'"),
    "torch_attr": ("torch.GPUCASE_POISON = True", "getattr(torch, 'GPUCASE_POISON', False)"),
    "helper_global": ("shared_helper.SCALE = 0.0", "shared_helper.SCALE == 0.0"),
    "helper_tensor": ("shared_helper.TABLE.mul_(0)", "shared_helper.TABLE.sum().item() == 0"),
    "helper_object": ("shared_helper.SETTINGS.scale = 0.0", "shared_helper.SETTINGS.scale == 0"),
    "denormal": ("torch.set_flush_denormal(True)", "torch.tensor([1e-39]).mul(1.0).item() == 0"),
    "anomaly": ("torch.autograd.set_detect_anomaly(True)", "torch.is_anomaly_enabled()"),
    "device": ("torch.set_default_device('meta')", "torch.get_default_device().type == 'meta'"),
    "dtype": ("torch.set_default_dtype(torch.float64)",
              "torch.get_default_dtype() == torch.float64"),
    "threads": ("torch.set_num_threads(7)", "torch.get_num_threads() == 7"),
    "thread": ("threading.Thread(target=time.sleep, args=(60,), name='left', daemon=True)"
               ".start()", "'left' in [t.name for t in threading.enumerate()]"),
    "environ": ("os.environ['GPUCASE_LEFT'] = '1'", "os.environ.get('GPUCASE_LEFT') == '1'"),
}
# Victims that fail by their values, not by an assert: a float32 overflow against a finite
# float64 reference, an output 1e-3 off the reference.
VICTIMS = {None: "return torch.exp(x * 100.0)",
           "OFF_BY_1E-3": "return x + 1e-3 if x.dtype == torch.float32 else x"}
# Past what the worker checks (private data of a library): only the fresh confirmation of
# every outcome of a strict xfail keeps its victim from XPASS(strict).
UNSEEN = ("torch._gpucase_unseen = True", "getattr(torch, '_gpucase_unseen', False)")


def write_run_case(root: Path, name: str, body: str, toml: str = "") -> None:
    """A case whose run appends its name to runs.log, then runs ``body`` (statements)."""
    path = root / "cases" / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(f'format = 1\ncall = "case.py:run"\ntimeout = 2\n{toml}\n'
                                    '[matrix]\ndevices = ["cpu"]\n')
    log = str(root / "runs.log")
    (path / "case.py").write_text(
        "import os, threading, time\nimport torch\nimport shared_helper\n\n"
        "def run(x):\n"
        f"    with open({log!r}, 'a') as f:\n        f.write({name!r} + '\\n')\n"
        f"    {body}\n    return x + 1\n")
    payload.save(path / "inputs.safetensors", {"x": torch.ones(4)})


def leaky_project(root: Path) -> None:
    # Imported by the conftest, before any child is forked: a module every run shares.
    (root / "shared_helper.py").write_text("import types\nimport torch\n\nSCALE = 1.0\n"
                                           "TABLE = torch.ones(3)\n"
                                           "SETTINGS = types.SimpleNamespace(scale=1.0)\n")
    (root / "conftest.py").write_text("import shared_helper  # noqa: F401\n")
    for index, (kind, (leave, holds)) in enumerate(sorted(LEFT_BEHIND.items())):
        write_run_case(root, f"k{index:02}_{kind}", leave)
        # Fails in a fresh child; passes only where the state was left behind.
        write_run_case(root, f"k{index:02}_{kind}_victim", VICTIMS.get(holds, f"assert {holds}"))
    write_run_case(root, "u1_unseen", UNSEEN[0])
    write_run_case(root, "u1_unseen_xfail", f"assert {UNSEEN[1]}", 'xfail = "never fixed"')


def test_verdicts_match_fresh_children_on_cases_that_leave_state_behind(
        pytester: pytest.Pytester) -> None:
    leaky_project(pytester.path)
    fresh = verdicts(pytester, "--gpu-isolation", "item")
    victims = {node: outcome for node, outcome in fresh.items() if "_victim[" in node}
    assert len(victims) == len(LEFT_BEHIND) and set(victims.values()) == {"failed"}, fresh
    assert fresh["cases/u1_unseen_xfail/case.toml::u1_unseen_xfail[cpu-float32]"] == "xfailed"
    assert verdicts(pytester, "--gpu-isolation", "worker") == fresh


def test_a_reused_worker_runs_a_first_call_failure_and_a_hang_once(
        pytester: pytest.Pytester) -> None:
    (pytester.path / "shared_helper.py").write_text("SCALE = 1.0\n")
    write_run_case(pytester.path, "a_fails_first", "assert False, 'fails'")
    write_run_case(pytester.path, "b_passes", "pass")
    write_run_case(pytester.path, "c_hangs", "time.sleep(600)")
    outcomes = verdicts(pytester, "--gpu-isolation", "worker", "--rootdir", str(pytester.path))
    assert list(outcomes.values()) == ["failed", "passed", "failed"]
    # a_fails_first ran in a worker's first call (a fresh child's); c_hangs in a reused
    # worker, whose state was checked: neither is run again.
    runs = (pytester.path / "runs.log").read_text().split()
    assert runs.count("a_fails_first") == 1 and runs.count("c_hangs") == 1, runs
    assert runs.count("b_passes") == 2, runs  # the call and its float64 reference


def test_the_summary_names_the_case_that_left_its_worker_changed(
        pytester: pytest.Pytester) -> None:
    (pytester.path / "shared_helper.py").write_text("SCALE = 1.0\n")
    write_run_case(pytester.path, "a_leaves", LEFT_BEHIND["exp"][0])
    write_run_case(pytester.path, "b_passes", "pass")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-isolation", "worker",
                                           "-p", "no:cacheprovider", "--rootdir",
                                           str(pytester.path), "cases")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["gpucase: --gpu-isolation: cases/a_leaves [[]cpu-float32[]] "
                                 "left its worker unlike a fresh child (torch.exp was "
                                 "replaced); the next run got a new worker"])

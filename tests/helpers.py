"""What several test modules share: cases written as a user writes them, reports as the
plugin writes them, the Recorder's case of a known bug, and commands run as a user runs them.

Test modules import from here, never from each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.environment import Device, Environment
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.report.file import new_report, write_report
from pytest_gpucase.run.isolation import ChildResult, forkserver_available, run_in_child
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext

from . import isolation_targets

needs_zygote = pytest.mark.skipif(not forkserver_available(),
                                  reason="the forkserver needs Linux pidfds and fd passing")
# The two start methods whose process forks the child (this one, or the zygote).
FORKING = ["fork", pytest.param("forkserver", marks=needs_zygote)]

CE_CASE_PY = """
import torch
import torch.nn.functional as F

def run(logits, target, num_classes, ignore_index):
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bad.any():
        raise ValueError(f"target out of range: {target[bad].tolist()}")
    return F.cross_entropy(logits, target, ignore_index=ignore_index)
"""


def write_case(root: Path, name: str, toml: str, case_py: str | None = None,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a case directory as a user would by hand."""
    path = root / "cases" / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(toml).lstrip())
    if case_py is not None:
        (path / "case.py").write_text(textwrap.dedent(case_py).lstrip())
    if tensors is not None:
        payload.save(path / "inputs.safetensors", tensors)
    return path


def ce_case(root: Path, name: str, target: list[int], expect: str, top: str = "") -> Path:
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    toml = f"""
        format = 1
        call = "case.py:run"
        timeout = 60
        {top}
        [inputs]
        num_classes = 4
        ignore_index = -100
        {expect}
    """
    return write_case(root, name, toml, CE_CASE_PY,
                      {"logits": logits, "target": torch.tensor(target)})


RAISES = """
        [expect]
        outcome = "raises"
        exception = "ValueError"
        match = "out of range"
"""


BARE_CASE_PY = "def run(logits, target, num_classes):\n    return logits.sum()\n"


RICH = """
    format = 1
    summary = "CrossEntropyLoss target holds class 4 on a 4-class head"
    call = "case.py:run"
    reference = "case.py:run"
    timeout = 60
    xfail = "labels not remapped yet"

    [inputs]
    num_classes = 4

    [expect]
    gradients = true
    [expect.tolerance.bfloat16]
    rtol = 2e-2
    atol = 1e-3

    [matrix]
    devices = ["cuda", "cpu"]
    dtypes = ["float32", "bfloat16"]
    torch = ">=2.1"

    [variants]
    batch = { axis = 0, sizes = [1, 2] }
    boundaries = { input = "target", classes = 4, ignore_index = -100 }
    [variants.reject]
    exception = "ValueError"

    [origin]
    error = "RuntimeError: CUDA error: device-side assert triggered"
    stderr = "Loss.cu:250: nll_loss: block: [0,0] Assertion `t >= 0 && t < n_classes` failed."
    iteration = 1834
    stage = "loss"
    last_step = "optimizer.step"
    revision = "3f2c1ab"
    python = "3.11.7"
    torch = "2.3.1"
    cuda = "12.1"
    backend = "cuda"
    device = "NVIDIA A100-SXM4-80GB"
    later_errors = 12
    sample_ids = ["img_00412", "img_00413", "img_00414"]
"""


def write_bare_case(root: Path, name: str, toml: str,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(toml).lstrip())
    (path / "case.py").write_text(BARE_CASE_PY)
    if tensors is not None:
        payload.save(path / "inputs.safetensors", tensors)
    return path


def rich_case(root: Path, name: str = "ce_class4", toml: str = RICH) -> Path:
    logits = (torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7)[:, 1:].t()
    return write_bare_case(root, name, toml, {"logits": logits, "target": torch.tensor([0, 2, 4])})


def make_case(root: Path, name: str, toml: str, case_py: str,
              tensors: dict[str, torch.Tensor]) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(toml))
    (path / "case.py").write_text(textwrap.dedent(case_py))
    payload.save(path / "inputs.safetensors", tensors)
    return path


def recorded_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def recorded_ce_case(root: Path) -> Path:
    """The case a Recorder writes for a batch of 8 whose entry 5 holds class 4 of 4: its
    payload holds the RNG state ``[context] rng`` names, as every recorded case does."""
    from pytest_gpucase.tools.record import Recorder

    rec = Recorder(root / "cases")
    loss = rec.watch(recorded_loss, name="ce")
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(IndexError):
        loss(logits, torch.tensor([0, 1, 2, 3, 0, 4, 1, 2]))
    return root / "cases" / "ce"


def replay_cpu(case_dir: Path) -> Any:
    """Run a case's CPU item in a fresh child and return its verdict."""
    case = load_case(case_dir)
    return run_spec(RunSpec(case, "cpu", "float32", cast=False),
                    RunContext("fork", "cpu", localize=False))


def read_toml(case_dir: Path) -> dict[str, Any]:
    return tomllib.loads((case_dir / "case.toml").read_text())


def replays(case_dir: Path, error: str) -> None:
    """The case's CPU item raises ``error`` again, and it counts as the known failure."""
    from pytest_gpucase.plugin.items import is_known_failure

    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == error, verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


def environment(torch: str, cuda: str | None, flash_attn: str | None, gpu: str, capability: str,
                **changes: Any) -> dict[str, Any]:
    """A CUDA runner's environment, as the plugin probes it."""
    fields: dict[str, Any] = {
        "backend": "cuda", "device_types": ("cuda", "cpu"),
        "devices": (Device(0, gpu, capability, 79.1),), "torch": torch, "cuda": cuda,
        "cudnn": "90100", "python": "3.11.9", "platform": "Linux-x86_64",
        "packages": {"flash-attn": flash_attn}, "revision": "3f2c1ab",
    }
    fields.update(changes)
    return Environment(**fields).to_dict()


A100 = environment("2.3.1+cu121", "12.1", "2.5.8", "NVIDIA A100-SXM4-80GB", "8.0")


H100 = environment("2.4.0+cu124", "12.4", "2.6.3", "NVIDIA H100 80GB HBM3", "9.0")


def result(case: str, device: str, dtype: str, outcome: str, variant: str | None = None,
           **fields: Any) -> dict[str, Any]:
    """One item's record, as the plugin writes it."""
    token = "-".join([device, dtype] + ([variant] if variant else []))
    record: dict[str, Any] = {
        "nodeid": f"cases/{case}::{case}[{token}]", "case": case, "case_path": f"cases/{case}",
        "device": device, "dtype": dtype, "variant": variant, "outcome": outcome,
        "error_type": None, "message": None, "max_abs": None, "max_rel": None,
        "duration": 0.25, "skip_reason": None, "triage": None, "launch_blocking": False,
    }
    record.update(fields)
    return record


def report_file(path: Path, env: dict[str, Any], results: list[dict[str, Any]], *,
                created: str = "2026-12-02T16:00:00+00:00", complete: bool = True) -> Path:
    report = new_report(env)
    report.update(created=created, results=results, complete=complete)
    write_report(path, report)
    return path


def install_fake_distribution(site: Path, name: str, version: str, module: str) -> Path:
    """A distribution as pip leaves it (dist-info with top_level.txt), without pip."""
    (site / module).mkdir(parents=True, exist_ok=True)
    (site / module / "__init__.py").write_text("def pool(x, mask):\n    return x\n")
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")
    return site


# The `pytest` console script: the working directory is not on sys.path (`python -m` would
# put it there and hide a missing `pythonpath` setting).
PYTEST = ("import os, sys\n"
          "if sys.path and sys.path[0] in ('', os.getcwd()):\n"
          "    sys.path.pop(0)\n"
          "import pytest\n"
          "sys.exit(pytest.console_main())\n")


def run(project: Path, *args: str) -> pytest.RunResult:
    """Run a command in ``project`` without PYTHONPATH (pytester's runners set it to the cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTEST_ADDOPTS"] = "-p no:randomly"  # the outputs read here keep their order
    start = time.monotonic()
    done = subprocess.run(args, cwd=project, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    return pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(),
                            time.monotonic() - start)


def apply_fix(source_file: Path, bug: str, fix: str) -> None:
    """Make the fix a user makes: the buggy line, which must be there, replaced."""
    source = source_file.read_text()
    assert bug in source
    source_file.write_text(source.replace(bug, fix))


def without_xfail(case_dir: Path) -> None:
    toml = case_dir / "case.toml"
    lines = toml.read_text().splitlines(keepends=True)
    toml.write_text("".join(line for line in lines if not line.startswith("xfail = ")))


def run_reaching(target: Any, *args: Any, timeout: float,
                 **options: Any) -> tuple[ChildResult, float]:
    """``run_in_child`` for a test of what happens to a target that is running when its time
    runs out, and the timeout it was given. A child still starting by then (a loaded CI
    machine: a spawned interpreter, a zygote's first fork) tests nothing of the target, so
    it runs again with four times the time, twice at most; one that never got there fails
    the test."""
    for attempt in range(3):
        given = timeout * 4 ** attempt
        result = run_in_child(isolation_targets.reach, target, *args, timeout=given, **options)
        if result.phase is not None or not result.timed_out:
            return result, given
    raise AssertionError(f"the child never reached {target.__name__} in {given:g} s: "
                         f"{result.problem}\n{result.stderr}")


CHECKOUT = Path(__file__).resolve().parents[1]


def python_in(cwd: Path, *args: str, paths: tuple[Path, ...] = (),
              check: bool = False) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` run in ``cwd`` in a fresh interpreter, as a user runs a training
    script, with this checkout (then ``paths``) importable; its output as text."""
    path = os.pathsep.join(str(p) for p in (CHECKOUT, *paths))
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path}, check=check)


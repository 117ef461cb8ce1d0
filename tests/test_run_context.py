"""One run context: every entry point runs a case the same way (items, the gpu_case fixture,
--gpu-ablate, gpucase ablate and minimize), and the typed settings behind it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case.keys import REPLAY_ENV
from pytest_gpucase.case.load import load_case
from pytest_gpucase.cli import main
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.plugin.settings import SETTINGS, Settings
from pytest_gpucase.run.runcontext import RunContext

from .helpers import write_case

# A case that fails only where a run-env hook (or --env) set DEMO_PIN=1: the variable is part
# of the run, so every entry point must give it, or they disagree about the same case.
PINNED_TOML = """
    format = 1
    call = "case.py:run"
    timeout = 60
"""
PINNED_PY = """
    import os
    import torch

    def run(x):
        if os.environ.get("DEMO_PIN") == "1":
            raise RuntimeError("pinned run: DEMO_PIN is 1")
        return x * 2
"""
HOOK = """
def pytest_gpucase_run_env(item, spec):
    return {"DEMO_PIN": "1"}
"""
FIXTURE_TEST = """
import pytest

@pytest.mark.gpu_case("cases/pinned")
def test_through_the_fixture(gpu_case):
    verdict = gpu_case.run("cpu")
    assert verdict.failed, verdict.outcome.summary
    assert "pinned run" in verdict.outcome.summary
"""


def _pinned(root: Path) -> Path:
    return write_case(root, "pinned", PINNED_TOML, PINNED_PY,
                      {"x": torch.arange(8, dtype=torch.float32)})


@pytest.mark.slow
def test_a_hook_variable_reaches_the_item_its_ablation_and_the_fixture(
        pytester: pytest.Pytester) -> None:
    """The review's reproduction: the item failed while its ablation said "passes unchanged"
    and gpu_case.run("cpu") passed. Now all three see the hook's variable."""
    pytester.makeconftest(HOOK)
    _pinned(pytester.path)
    pytester.makepyfile(test_fixture=FIXTURE_TEST)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-ablate", "cases", "test_fixture.py",
                                           "-p", "no:randomly", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "pinned run: DEMO_PIN is 1" in out
    assert "gpucase ablation" in out
    assert "nothing to ablate" not in out
    assert "fails under every change tried" in out   # the variable is no precision change


@pytest.mark.slow
def test_the_commands_give_their_env_to_every_run(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """gpucase ablate and minimize load no conftest: --env gives the variable a hook would,
    and the commands then agree with the item; without it they see a passing case."""
    path = _pinned(tmp_path)
    assert main(["ablate", str(path), "--device", "cpu"]) == 1
    assert "nothing to ablate" in capsys.readouterr().out
    assert main(["ablate", str(path), "--device", "cpu", "--env", "DEMO_PIN=1"]) == 0
    assert "RuntimeError" in capsys.readouterr().out
    smaller = tmp_path / "pinned_min"
    assert main(["minimize", str(path), "-o", str(smaller), "--env", "DEMO_PIN=1",
                 "--max-tries", "20"]) == 0
    assert load_case(smaller).inputs_file.exists()
    assert main(["minimize", str(path), "-o", str(tmp_path / "other"), "--max-tries", "5"]) == 1
    assert "passes unchanged" in capsys.readouterr().out


def test_env_is_composed_in_one_order(tmp_path: Path) -> None:
    """The run's own variables, then the pin (device runs only), then the hook's, then what
    every replay sets: each later source wins."""
    case = load_case(_pinned(tmp_path))
    seen: list[RunSpec] = []

    def hook(spec: RunSpec) -> dict[str, str]:
        seen.append(spec)
        return {"A": "hook", "B": "hook"}

    ctx = RunContext("fork", "cuda", pin={"CUDA_VISIBLE_DEVICES": "1", "A": "pin"},
                     run_env=hook)
    on_cpu = ctx.env(RunSpec(case, "cpu", "float32", cast=False, env={"A": "own", "C": "own"}))
    assert on_cpu == {"A": "hook", "B": "hook", "C": "own", REPLAY_ENV: "1"}
    on_gpu = ctx.env(RunSpec(case, "cuda", "float32", cast=False, env={"C": "own"}))
    assert on_gpu == {"A": "hook", "B": "hook", "C": "own", "CUDA_VISIBLE_DEVICES": "1",
                      REPLAY_ENV: "1"}
    assert len(seen) == 2


def test_a_cases_own_memory_limit_wins(tmp_path: Path) -> None:
    case = load_case(_pinned(tmp_path))
    ctx = RunContext("fork", "cpu", memory_limit=2**30)
    assert ctx.memory_limit_for(case) == 2**30
    limited = dataclasses.replace(case, memory_limit=2**20)
    assert ctx.memory_limit_for(limited) == 2**20


def test_a_fresh_context_reuses_no_child() -> None:
    pool = object()
    ctx = RunContext("fork", "cpu", isolation="worker", pool=pool)  # type: ignore[arg-type]
    assert ctx.reuses()
    assert not ctx.fresh().reuses() and ctx.fresh().pool is None
    assert not dataclasses.replace(ctx, start_method="spawn").reuses()


def test_here_forks_unless_cuda_is_initialized(tmp_path: Path) -> None:
    ctx = RunContext.here("cpu", env={"X": "1"})
    assert ctx.start_method == "fork" and not ctx.localize
    case = load_case(_pinned(tmp_path))
    assert ctx.env(RunSpec(case, "cpu", "float32", cast=False))["X"] == "1"


def test_settings_has_one_typed_field_per_table_row() -> None:
    names = [field.name for field in dataclasses.fields(Settings)]
    assert names == [spec.name for spec in SETTINGS]
    defaults = Settings.defaults()
    assert defaults.gpu_isolation == "item" and defaults.gpu_start_method == "auto"
    assert defaults.gpu_cases_paths == () and defaults.gpu_devices is None
    with pytest.raises(TypeError, match="gpu_nope"):
        Settings.defaults(gpu_nope=1)


def test_no_option_is_read_by_its_string_outside_the_table() -> None:
    """Every option is an attribute of ``Settings``, which mypy checks; a lookup by string
    would pass a typo in silence."""
    import re

    package = Path(__file__).resolve().parent.parent / "pytest_gpucase"
    found = [f"{path.relative_to(package)}:{number}"
             for path in package.rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"""settings\[["']gpu_""", line)]
    assert found == []


@pytest.mark.parametrize("folder", ["pinned", "we[ird]-name"])
def test_an_item_id_reads_back_as_its_record(tmp_path: Path, folder: str) -> None:
    """The item id is built (``RunSpec.item_name``) and read back (``ItemId.parse``) in one
    module: a record made from the id equals the one made from the run."""
    from pytest_gpucase.case.variants import Variant
    from pytest_gpucase.plugin.records import item_fields, spec_fields

    path = _pinned(tmp_path)
    case = dataclasses.replace(load_case(path), name=folder)
    for spec in (RunSpec(case, "cuda", "bfloat16", cast=True),
                 RunSpec(case, "cpu", "float32", cast=False, variant=Variant("batch", 1)),
                 RunSpec(case, "cpu", "float64", cast=False,
                         variant=Variant("boundary", -1))):
        nodeid = f"cases/{folder}/case.toml::{spec.item_name()}"
        assert item_fields(nodeid) == spec_fields(spec, f"cases/{folder}")
    assert item_fields("tests/test_x.py::test_y") is None
    broken = item_fields(f"cases/{folder}/case.toml::{folder}")
    assert broken is not None and broken["device"] == broken["dtype"] == "all"

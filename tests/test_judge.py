"""How the child judges a run (run/judge.py): what it holds while the reference runs."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.judge import Judged


def test_the_run_inputs_are_let_go_of_as_the_reference_inputs_are_made(tmp_path: Path) -> None:
    """A model case's state is held once as the run's inputs and once as their float64
    copy, not a third time; a second look that needs the run's inputs loads them again."""
    (tmp_path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
    (tmp_path / "case.py").write_text("def run(x):\n    return x * 2\n")
    payload.save(tmp_path / "inputs.safetensors", {"x": torch.ones(4)})
    spec = RunSpec(load_case(tmp_path), "cpu", "float32", cast=False)
    x = torch.ones(1024)
    held = weakref.ref(x)
    run_inputs = {"x": x}
    del x
    reloads: list[int] = []

    def reload() -> dict[str, torch.Tensor]:
        reloads.append(1)
        return {"x": torch.full((1024,), 3.0)}

    judged = Judged(spec, len, len, lambda: run_inputs, {}, {}, torch.float32, "",
                    reload=reload)
    inputs = judged.reference_inputs_releasing()
    gc.collect()
    assert held() is None and not run_inputs
    assert inputs["x"].dtype == torch.float64 and bool((inputs["x"] == 1).all())
    assert not reloads
    assert bool((judged.saved()["x"] == 3).all()) and reloads == [1]
    # Without a way to load them again, they are kept.
    kept = {"x": torch.ones(4)}
    plain = Judged(spec, len, len, lambda: kept, {}, {}, torch.float32, "")
    assert plain.reference_inputs_releasing()["x"].dtype == torch.float64 and kept

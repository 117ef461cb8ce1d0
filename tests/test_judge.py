"""How the child judges a run (run/judge.py): what it holds while the reference runs."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.judge import Judged, _identical


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


def test_a_golden_is_taken_for_the_reference_only_when_it_holds_the_same_values() -> None:
    """A golden identical to the reference (structure, types, dtypes, values) is judged by the
    reference's comparison; anything a comparison could tell apart is compared on its own."""
    x = torch.tensor([1.0, -2.0, 3.5])
    reference = {"out": {"a": x, "b": [x.clone(), 2, None]}, "grad": {"x": x * 2}}
    same = {"out": {"a": x.clone(), "b": [x.clone(), 2, None]}, "grad": {"x": x * 2}}
    assert _identical(same, reference)
    for other in (
        {"out": {"b": [x, 2, None], "a": x}, "grad": {"x": x * 2}},  # key order
        {"out": {"a": x, "b": (x, 2, None)}, "grad": {"x": x * 2}},  # list vs tuple
        {"out": {"a": x.double(), "b": [x, 2, None]}, "grad": {"x": x * 2}},  # dtype
        {"out": {"a": x.reshape(3, 1), "b": [x, 2, None]}, "grad": {"x": x * 2}},  # shape
        {"out": {"a": x + 1e-7, "b": [x, 2, None]}, "grad": {"x": x * 2}},  # one ulp
        {"out": {"a": x, "b": [x, 2.0, None]}, "grad": {"x": x * 2}},  # int vs float
        {"out": {"a": x, "b": [x, 2, None]}},  # a key fewer
    ):
        assert not _identical(other, reference)
    nan = torch.tensor([float("nan")])
    assert not _identical({"out": nan}, {"out": nan.clone()})  # NaN: compared on its own

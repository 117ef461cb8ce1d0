"""A dict of tensors passed to a watched call (``fn(x, params={"w": ..., "b": ...})``) is saved
tensor by tensor and rebuilt into the same dict by the replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.case import payload
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.case.load import load_case
from pytest_gpucase.run.child import load_inputs, prepare
from pytest_gpucase.run.calls import upcast
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.tools.validate import validate
from tests.helpers import read_toml, replay_cpu


def lookup(ids: torch.Tensor, params: dict[str, torch.Tensor], scale: float = 1.0
           ) -> torch.Tensor:
    """A functional embedding with its weights in a dict, as torch.func.functional_call takes."""
    return F.embedding(ids, params["table"]) * scale + params["bias"]


class Scaled(torch.nn.Module):
    """A module whose forward takes extra tensors as a dict (adapter weights, say)."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(x) @ extra["adapter"] + extra["shift"][x.shape[0] * 4]


def params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"table": torch.randn(5, 4, generator=gen), "bias": torch.randn(4, generator=gen)}


@pytest.mark.slow
def test_a_dict_of_tensors_is_saved_and_rebuilt_and_its_failure_replays(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases")
    watched = rec.watch(lookup)
    weights = params()
    with pytest.raises(IndexError, match="index out of range"):
        watched(torch.tensor([[0, 5]]), params=weights, scale=2.0)

    case_dir = tmp_path / "cases" / "lookup"
    doc = read_toml(case_dir)
    assert doc["inputs"]["params"] == {"gpucase_tensors": {"table": "dict.params.table",
                                                           "bias": "dict.params.bias"}}
    assert doc["inputs"]["scale"] == 2.0
    assert "skipped_inputs" not in doc["origin"] and "incomplete" not in doc["origin"]
    assert doc["origin"]["inputs"]["dict.params.table"] == "float32 (5, 4) stride (4, 1) cpu"
    saved = payload.load(case_dir / "inputs.safetensors")
    assert sorted(saved) == ["context.rng_cpu", "dict.params.bias", "dict.params.table", "ids"]

    rebuilt = load_inputs(load_case(case_dir))
    assert sorted(rebuilt) == ["ids", "params", "scale"]
    assert sorted(rebuilt["params"]) == ["bias", "table"]
    assert all(torch.equal(rebuilt["params"][k], weights[k]) for k in weights)
    assert validate([case_dir]) == []

    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


@pytest.mark.slow
def test_the_fixed_call_matches_its_float64_reference_through_the_dict(tmp_path: Path) -> None:
    """The dict's tensors are cast and upcast like plain inputs, so the reference really runs
    in float64, and the replay of the fix passes against it."""
    rec = Recorder(tmp_path / "cases")
    watched = rec.watch(lookup)
    with pytest.raises(IndexError):
        watched(torch.tensor([[0, 5]]), params=params())
    case_dir = tmp_path / "cases" / "lookup"
    payload.save(case_dir / "inputs.safetensors",
                 {**payload.load(case_dir / "inputs.safetensors"), "ids": torch.tensor([[0, 4]])})
    text = (case_dir / "case.toml").read_text()
    (case_dir / "case.toml").write_text("\n".join(line for line in text.splitlines()
                                                  if not line.startswith("xfail =")))
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.status == "passed", verdict.outcome.summary + verdict.outcome.details
    inputs = load_inputs(load_case(case_dir))
    assert {t.dtype for t in upcast(inputs)["params"].values()} == {torch.float64}
    assert {t.dtype for t in prepare(inputs, "cpu", "bfloat16")["params"].values()} == {
        torch.bfloat16}
    assert prepare(inputs, "cpu", "bfloat16")["ids"].dtype == torch.int64


@pytest.mark.slow
def test_a_module_forward_dict_argument_replays(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Scaled()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    extra = {"adapter": torch.eye(3), "shift": torch.zeros(4)}
    with pytest.raises(IndexError, match="out of bounds"):
        model(torch.ones(2, 3), extra=extra)
    case_dir = tmp_path / "cases" / "Scaled"
    doc = read_toml(case_dir)
    assert doc["inputs"]["extra"] == {"gpucase_tensors": {"adapter": "dict.extra.adapter",
                                                          "shift": "dict.extra.shift"}}
    saved = payload.load(case_dir / "inputs.safetensors")
    assert {"state.lin.weight", "dict.extra.adapter", "dict.extra.shift"} <= set(saved)
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


@pytest.mark.slow
def test_a_table_naming_a_missing_tensor_is_a_broken_case(tmp_path: Path) -> None:
    case_dir = tmp_path / "named"
    case_dir.mkdir()
    (case_dir / "case.toml").write_text(
        'format = 1\ncall = "tests.test_tensor_dicts:lookup"\n[inputs]\n'
        'params = { gpucase_tensors = { table = "dict.params.table", bias = "dict.params.b" } }\n')
    payload.save(case_dir / "inputs.safetensors",
                 {"ids": torch.tensor([0]), "dict.params.table": torch.ones(2, 4)})
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.broken_case
    assert "[inputs] params.gpucase_tensors" in verdict.outcome.summary
    assert "dict.params.b" in verdict.outcome.summary

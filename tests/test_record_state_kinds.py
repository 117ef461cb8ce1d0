"""Issue 30: state a safetensors file cannot hold as it is (complex128, sparse, quantized) is
saved exactly, or makes the case incomplete naming it; never a rebuild with the
constructor's values that could pass as "fixed"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.tools.record import Recorder
from tests import model_targets
from tests.helpers import read_toml, replay_cpu

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]  # sparse/quantized betas


def _exact(saved: torch.Tensor, value: torch.Tensor) -> bool:
    if saved.dtype != value.dtype or saved.layout != value.layout or saved.shape != value.shape:
        return False
    if value.is_quantized:
        return (torch.equal(saved.int_repr(), value.int_repr())
                and saved.qscheme() == value.qscheme()
                and torch.equal(saved.dequantize(), value.dequantize()))
    if value.layout != torch.strided:
        return torch.equal(saved.to_dense(), value.to_dense())
    if value.dtype == torch.complex32:
        return torch.equal(torch.view_as_real(saved), torch.view_as_real(value))
    return torch.equal(saved, value) and saved.stride() == value.stride()


def test_the_kinds_safetensors_lacks_round_trip_exactly(tmp_path: Path) -> None:
    tensors = {
        "c128": torch.randn(3, 4, dtype=torch.complex128)[:, 1:3],
        "c32": torch.randn(5, dtype=torch.complex64).to(torch.complex32),
        "conj": torch.randn(4, dtype=torch.complex128).conj(),
        "coo": torch.randn(3, 4).relu().to_sparse(),
        "coo_complex": torch.randn(3, 4, dtype=torch.complex128).to_sparse(),
        "csr": torch.randn(3, 4).relu().to_sparse_csr(),
        "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8),
        "q_channel": torch.quantize_per_channel(
            torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64),
            torch.tensor([0, 1, 2]), 0, torch.quint8),
        "stored": torch.randn(2**17, dtype=torch.complex128),  # big enough for the store
    }
    (tmp_path / "case").mkdir()
    file = tmp_path / "case" / "inputs.safetensors"
    payload.save(file, tensors, store=True)
    loaded = payload.load(file)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert _exact(loaded[name], value), name
    infos = {info.name: info for info in payload.describe(file)}
    assert set(infos) == set(tensors)  # the parts are no inputs of their own
    assert infos["c128"].shape == (3, 2) and infos["q_channel"].dtype == "U8"


def test_unstorable_names_what_no_form_holds() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert "nested" in str(payload.unstorable(nested))
    assert "meta" in str(payload.unstorable(torch.empty(2, device="meta")))
    assert payload.unstorable((torch.ones(1),)) == "a tuple, not a tensor"
    assert payload.unstorable(torch.ones(2, dtype=torch.complex128)) is None


@pytest.mark.parametrize("trained", ["spectrum", "mask", "graph", "codes"])
def test_a_failure_that_depends_on_trained_state_of_any_kind_replays(
        tmp_path: Path, trained: str) -> None:
    """The state a failure depends on is a complex, sparse or quantized tensor training
    changed: the case holds it exactly, so its replay fails as captured (never XPASS with
    the constructor's values), and validate finds nothing missing."""
    torch.manual_seed(0)
    model = model_targets.KindsModel()
    with torch.no_grad():
        if trained == "spectrum":
            model.spectrum.mul_(20j)
        elif trained == "mask":
            model.mask = (torch.eye(4) * 50).to_sparse()
        elif trained == "graph":
            model.graph = (torch.eye(4) * 50).to_sparse_csr()
        else:
            model.codes = torch.quantize_per_tensor(torch.full((4,), 30.0), 0.5, 0, torch.qint8)
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model, name="kinds")
    with pytest.raises(ValueError, match=f"{trained} grew to"), rec.step(0):
        model(torch.ones(2, 4))
    case_dir = tmp_path / "cases" / "kinds"
    doc = read_toml(case_dir)
    assert "incomplete" not in doc["origin"] and "xfail" in doc
    saved = payload.load(case_dir / "inputs.safetensors")
    assert _exact(saved[f"state.{trained}"], getattr(model, trained).detach())
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "ValueError", verdict.outcome.summary
    assert f"{trained} grew to" in (verdict.outcome.error_message or "")
    assert is_known_failure(load_case(case_dir), verdict)


def test_state_no_payload_holds_makes_the_case_incomplete_and_validate_says_so(
        tmp_path: Path) -> None:
    """An extra state (an object) and a packed quantized Linear's parameters (a tuple) have
    no exact form in a payload: the case is incomplete naming them, has no xfail that a
    rebuild with the constructor's values would XPASS, and validate reports it."""
    model = model_targets.ExtraStateModel()
    model.calls = 5
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model, name="extra")
    with pytest.raises(ValueError, match="called 5 times"), rec.step(0):
        model(torch.ones(1, 3))
    doc = read_toml(tmp_path / "cases" / "extra")
    assert "xfail" not in doc
    assert doc["summary"].startswith("INCOMPLETE: the state of extra holds what a case cannot")
    assert doc["origin"]["unsaved_state"] == {"_extra_state": "a dict, not a tensor"}
    done = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "validate",
                           str(tmp_path / "cases")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "_extra_state (a dict, not a tensor)" in done.stdout + done.stderr

    packed = torch.nn.Sequential(torch.ao.nn.quantized.Linear(3, 3))
    found = __import__("pytest_gpucase.tools.record.rebuild",
                       fromlist=["module_state"]).module_state(packed)
    assert found.unsaved == {"0._packed_params._packed_params": "a tuple, not a tensor",
                             "0._packed_params.dtype": "a dtype, not a tensor"}
    assert "0._packed_params._packed_params (a tuple, not a tensor)" in str(
        found.why_incomplete("packed"))


def test_the_item_of_an_incomplete_case_says_what_is_missing(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: the item of a case whose state was not saved says so, naming it."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent))
    model = model_targets.ExtraStateModel()
    model.calls = 5
    rec = Recorder(pytester.path / "cases", narrow=False)
    rec.watch(model, name="extra")
    with pytest.raises(ValueError), rec.step(0):
        model(torch.ones(1, 3))
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-p", "no:randomly")
    out = result.stdout.str()
    assert "This case is INCOMPLETE ([origin] incomplete)" in out
    assert "_extra_state (a dict, not a tensor)" in out


def test_a_model_case_whose_replay_passes_is_incomplete_never_a_false_fix(
        tmp_path: Path) -> None:
    """State outside the state dict (a non-persistent buffer training advanced, an attribute
    set after construction) was rebuilt from the constructor: the case's replay passed with
    no fix, and its strict xfail read XPASS, "fixed". The capture now replays the case once
    in a fresh child: a replay that passes makes it incomplete, with no xfail line, and the
    item fails saying so."""
    from pytest_gpucase.run.parent import incomplete_pass

    table = model_targets.StepTable()
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(table, name="table")
    with pytest.raises(IndexError):
        for step in range(4):
            with rec.step(step):
                table(torch.ones(1, 3))
    annealed = model_targets.Annealed()
    rec = Recorder(tmp_path / "cases", narrow=False, nonfinite=True)
    rec.watch(annealed, name="annealed")
    annealed.temperature = 0.0
    with pytest.raises(FloatingPointError), rec.step(0):
        annealed(torch.ones(1, 3))
    for name in ("table", "annealed"):
        case_dir = tmp_path / "cases" / name
        doc = read_toml(case_dir)
        assert "xfail" not in doc, doc
        assert any("its replay in a fresh child, checked when it was captured, passes" in why
                   for why in doc["origin"]["incomplete"])
        verdict = incomplete_pass(replay_cpu(case_dir))
        assert verdict.failed and verdict.outcome.error_type == "IncompleteCase"


def test_a_model_case_that_reproduces_keeps_its_xfail_line(tmp_path: Path) -> None:
    """The same check leaves a case whose replay fails as captured as it was."""
    model = model_targets.TinyLM()
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model, name="lm")
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[1, 9]]))
    doc = read_toml(tmp_path / "cases" / "lm")
    assert doc["xfail"].startswith("captured failure: IndexError")
    assert "incomplete" not in doc["origin"]

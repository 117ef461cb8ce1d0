"""gpucase data-check: a case whose saved batch holds the offending value becomes a regression
case without those samples (expected to pass) and the data contract they broke."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.checks import check_batch
from pytest_gpucase.cli import main
from pytest_gpucase.tools.datacheck import NotADataFailure, data_check
from tests import datafix_targets
from tests.helpers import read_toml
from tests.datafix_targets import IDS, record, tokens

pytestmark = pytest.mark.slow  # the Recorder and the new case's run start processes


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def nanogpt_case(root: Path) -> Path:
    """A model case whose sample ex0042 holds target 19 of 19 classes (ignore_index -1)."""
    torch.manual_seed(0)
    targets = torch.tensor([[1, 2, 3], [4, 19, -1], [1, 1, 1]])
    return record(root / "cases", datafix_targets.TinyGPT(), tokens(5), targets)


def test_a_data_failure_becomes_a_passing_case_and_a_contract(tmp_path: Path) -> None:
    case = nanogpt_case(tmp_path)
    before = digest(case)
    result = data_check(case)
    assert digest(case) == before   # the original is never touched
    assert result.case == case.with_name("TinyGPT_clean") and result.passes is True
    assert result.dropped == (1,) and result.dropped_ids == ("ex0042",)
    doc = read_toml(result.case)
    assert "xfail" not in doc and doc["expect"]["outcome"] == "matches"
    assert doc["origin"]["sample_ids"] == ["ex0041", "ex0043"]
    made = doc["origin"]["data_check_from"]
    assert made["case"] == "../TinyGPT" and made["dropped_sample_ids"] == ["ex0042"]
    assert made["contract"] == "../TinyGPT.contract.toml"
    saved = payload.load(result.case / "inputs.safetensors")
    original = payload.load(case / "inputs.safetensors")
    for name in ("idx", "targets"):   # both cut along the batch axis, the rest kept
        assert torch.equal(saved[name], original[name][[0, 2]])
    assert torch.equal(saved["state.wte.weight"], original["state.wte.weight"])
    assert load_case(result.case).xfail is None

    contract = case.with_name("TinyGPT.contract.toml")
    assert result.contract == contract
    text = contract.read_text()
    assert "# sample ex0042 holds target 19, the loss's input has 19 classes." in text
    assert read_toml_file(contract)["fields"] == {"targets": {
        "dtype": "int64", "min": 0, "max": 18, "allowed": [-1],
        "reason": "the loss's input has 19 classes"}}
    check_batch({"targets": saved["targets"]}, contract)
    with pytest.raises(ValueError, match=r"targets holds 1 value outside 0\.\.18 or -1 \(the "
                       r"loss's input has 19 classes\): 19 at \(1, 1\) \(sample ex0042\)"):
        check_batch({"targets": original["targets"]}, contract, sample_ids=IDS)
    rendered = result.render()
    assert "offending entries on axis 0: 1 (sample ex0042)" in rendered
    assert "2 of 3 entries kept, expected to pass" in rendered and "it passes here" in rendered


def read_toml_file(path: Path) -> dict[str, object]:
    return tomllib.loads(path.read_text())


def test_an_op_case_cuts_its_indices_and_keeps_the_weight(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens())
    op_case = model_case.with_name("TinyGPT.aten.embedding.default")
    result = data_check(op_case, output=tmp_path / "regression", contract=tmp_path / "c.toml")
    assert result.case == tmp_path / "regression" and result.passes is True
    saved = payload.load(tmp_path / "regression" / "inputs.safetensors")
    assert saved["arg0"].shape == (19, 4) and saved["arg1"].tolist() == [[1, 2, 3], [1, 1, 1]]
    # The contract names the model's input, which the user's batches hold.
    assert read_toml_file(tmp_path / "c.toml")["fields"] == {"idx": {
        "dtype": "int64", "min": 0, "max": 18, "reason": "wte has 19 rows"}}


def test_the_cli_writes_both_and_never_overwrites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    case = nanogpt_case(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["data-check", "cases/TinyGPT", "--no-run"]) == 0
    out = capsys.readouterr().out
    assert "wrote cases/TinyGPT_clean: 2 of 3 entries kept, expected to pass" in out
    assert 'check_batch(batch, "cases/TinyGPT.contract.toml")' in out
    assert "cases/TinyGPT is kept: delete it once the data is fixed" in out
    assert main(["data-check", "cases/TinyGPT", "--no-run"]) == 2
    assert "cases/TinyGPT.contract.toml exists; data-check never overwrites" in \
        capsys.readouterr().err
    assert case.exists()


def test_all_samples_offending_leaves_the_contract_alone(tmp_path: Path) -> None:
    case = record(tmp_path / "cases", torch.nn.Embedding(5, 2), torch.tensor([[5], [6], [9]]))
    result = data_check(case)
    assert result.case is None and result.contract is not None
    assert "every entry holds an offending value" in result.render()


@pytest.mark.parametrize(("make", "match"), [
    (lambda root: record(root, datafix_targets.ShiftedGPT(), tokens(18)),
     "no saved input holds the offending value .*the model computed it, so a data fix "
     "cannot be the fix"),
    (lambda root: record(root, torch.nn.Linear(4, 3), torch.zeros(2, 5)),
     r"its failure \(RuntimeError: .*\) is not an index, target or class-range error"),
    (lambda root: record(root, datafix_targets.TinyGPT(), tokens(), narrow=False),
     "the offending value cannot be named from this case"),
])
def test_a_case_that_is_no_data_failure_is_refused_with_the_reason(tmp_path: Path, make: object,
                                                                   match: str) -> None:
    torch.manual_seed(0)
    case = make(tmp_path / "cases")  # type: ignore[operator]
    with pytest.raises(NotADataFailure, match=match):
        data_check(case)
    assert sorted(p.name for p in case.parent.iterdir() if "clean" in p.name
                  or p.name.endswith(".toml")) == []


def test_a_shifted_label_is_cut_from_the_batch_that_holds_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    labels = torch.tensor([[1, 2, 3], [4, 5, 19], [1, 1, 1]])
    case = record(tmp_path / "cases", datafix_targets.ShiftedLabelsLM(), tokens(5), labels)
    result = data_check(case)
    assert result.dropped_ids == ("ex0042",) and result.passes is True


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                            "ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_lightning_contract_names_the_batch_keys_the_loader_yields(
        tmp_path: Path, kind: str) -> None:
    """A Lightning step case saves its batch under internal names (``nested.batch.targets``,
    ``dict.batch.1``...); the contract names the batch's own key paths, so that
    ``check_batch`` takes the very batch the DataLoader yields."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from pytest_gpucase.integrations.lightning import GpuCaseCallback
    from tests import lightning_targets

    if kind == "dict":
        model: object = lightning_targets.DictLit(dropout=0.0)
        data = DataLoader(lightning_targets.DictSamples(), batch_size=4)
    else:
        model = lightning_targets.TinyLit(dropout=0.0)
        data = lightning_targets.loader(bad_target=True, batches=3)
    callback = GpuCaseCallback(tmp_path / "lcases", narrow=True, ids=(
        (lambda batch: batch["id"]) if kind == "dict" else None))
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    torch.manual_seed(0)
    with pytest.raises(IndexError):
        trainer.fit(model, data)
    case = tmp_path / "lcases" / f"{type(model).__name__}.training_step"
    saved = {info.name for info in payload.describe(case / "inputs.safetensors")}
    assert ("nested.batch.targets" if kind == "dict" else "nested.batch.1") in saved
    result = data_check(case, run=False)
    assert result.contract is not None
    fields = read_toml_file(result.contract)["fields"]
    field = "targets" if kind == "dict" else "1"
    assert list(fields) == [field] and (fields[field]["min"], fields[field]["max"]) == (0, 15)
    batches = list(data)
    bad = batches[1] if kind == "dict" else batches[2]
    for good in (batches[0], *batches[2 if kind == "dict" else 3:]):
        check_batch(good, result.contract)      # the batch as the loader yields it
    with pytest.raises(ValueError, match=f"^{field} holds 1 value outside 0..15"):
        check_batch(bad, result.contract)
    # Triage and show name it as the step's code reaches it, not by the payload's name.
    from pytest_gpucase.tools.offending import item_notes

    named = "batch['targets'] holds 16" if kind == "dict" else "batch[1] holds 99"
    assert item_notes(load_case(case))[0].startswith(f"offending value: {named} at ")
    if kind == "dict":
        assert result.dropped_ids == ("s0005",)
        assert "# sample s0005 holds target 16" in result.contract.read_text()

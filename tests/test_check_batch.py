"""check_batch: a data contract (the TOML file gpucase data-check writes) applied to a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pytest_gpucase
from pytest_gpucase.checks import check_batch, load_contract

CONTRACT = """\
# written by hand, as gpucase data-check writes it
format = 1
case = "TinyGPT"

[fields.idx]
dtype = "int64"
min = 0
max = 18
reason = "wte has 19 rows"

[fields.targets]
dtype = "int64"
min = 0
max = 18
allowed = [-1]
reason = "the loss's input has 19 classes"
"""


@pytest.fixture
def contract(tmp_path: Path) -> Path:
    path = tmp_path / "TinyGPT.contract.toml"
    path.write_text(CONTRACT)
    return path


def test_a_batch_within_the_contract_passes(contract: Path) -> None:
    idx = torch.tensor([[0, 18], [3, 4]])
    check_batch({"idx": idx, "targets": torch.tensor([[1, -1], [18, 0]]), "extra": 1.0},
                contract)
    check_batch({"idx": idx.int(), "targets": idx}, str(contract))   # any integer dtype
    assert pytest_gpucase.check_batch is check_batch


def test_each_offending_value_is_named_with_its_position_and_sample(contract: Path) -> None:
    idx = torch.tensor([[1, 2, 3], [4, 19, 5], [1, 1, 1]])
    targets = torch.tensor([[1, 2, 3], [4, 5, -1], [-2, 1, 1]])
    with pytest.raises(ValueError) as raised:
        check_batch({"idx": idx, "targets": targets}, contract,
                    sample_ids=["ex0041", "ex0042", "ex0043"])
    assert str(raised.value) == (
        "idx holds 1 value outside 0..18 (wte has 19 rows): 19 at (1, 1) (sample ex0042); "
        "targets holds 1 value outside 0..18 or -1 (the loss's input has 19 classes): -2 at "
        "(2, 0) (sample ex0043)")


def test_one_tensor_checks_a_contract_of_one_field(tmp_path: Path) -> None:
    fields = {"fields": {"labels": {"min": 0, "max": 3}}}
    check_batch(torch.tensor([0, 3]), fields)
    with pytest.raises(ValueError, match=r"labels holds 2 values outside 0\.\.3: 4 at "
                       r"position 1, 9 at position 2"):
        check_batch(torch.tensor([0, 4, 9]), fields)


@pytest.mark.parametrize(("batch", "error", "match"), [
    ({"idx": torch.zeros(2, 3), "targets": torch.zeros(2, dtype=torch.long)}, ValueError,
     "idx must hold integers"),
    ({"x": torch.zeros(2, dtype=torch.long)}, ValueError,
     r"batch has no 'idx' \(it has x\); give the tensors the contract's names"),
    (torch.zeros(2, dtype=torch.long), TypeError, "the contract names idx, targets"),
    ([torch.zeros(2)], ValueError, r"batch has no 'idx' \(it has items 0\.\.0\)"),
    ("idx", TypeError, "batch must be the batch as the DataLoader yields it"),
])
def test_a_batch_the_contract_cannot_read_is_told_how(contract: Path, batch: object,
                                                     error: type[Exception],
                                                     match: str) -> None:
    with pytest.raises(error, match=match):
        check_batch(batch, contract)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "match"), [
    ("format = 2\n[fields.a]\nmax = 1\n", "format 2 is not 1"),
    ("format = 1\n", r"no \[fields.NAME\] table"),
    ("[fields.a]\nmax = 1.5\n", "fields.a.max must be an integer"),
    ("[fields.a]\nmaximum = 1\n", "fields.a: unknown key 'maximum'"),
    ("[fields.a]\nallowed = -1\n", "fields.a.allowed must be a list of integers"),
    ("[fields.a\n", "not a readable data contract"),
])
def test_a_broken_contract_names_its_file_and_the_fix(tmp_path: Path, text: str,
                                                      match: str) -> None:
    path = tmp_path / "bad.contract.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as raised:
        load_contract(path)
    assert str(path) in str(raised.value)


def test_key_paths_reach_into_the_batch_the_loader_yields() -> None:
    # gpucase data-check names a Lightning step's tensors by their key paths in its batch.
    second = {"fields": {"1": {"min": 0, "max": 3}}}
    nested = {"fields": {"extra.ids": {"min": 0, "max": 9}}}
    check_batch([torch.zeros(2), torch.tensor([0, 3]), {"x": 1}], second)
    check_batch({"1": torch.tensor([3])}, second)   # a key, as a whole, first
    with pytest.raises(ValueError, match=r"^1 holds 1 value outside 0\.\.3: 4 at position 1"):
        check_batch((torch.zeros(2), torch.tensor([0, 4])), second)
    check_batch({"extra": {"ids": torch.tensor([9])}}, nested)
    with pytest.raises(ValueError, match=r"^extra\.ids holds 1 value outside 0\.\.9"):
        check_batch({"extra": {"ids": torch.tensor([10])}}, nested)
    with pytest.raises(ValueError, match=r"batch has no '1' \(it has items 0\.\.0\)"):
        check_batch((torch.zeros(2),), second)

"""Checkpoints written without a manifest (plain ``torch.save``, safetensors from another
tool): a weaker verdict, LOADABLE, that still loads them safely and checks them."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pytest_gpucase.cli import main
from pytest_gpucase.tools.checkpoint import (
    NO_MANIFEST,
    UNPROVEN,
    newest_valid,
    save,
    survey,
    validate,
)


class GPTConfig:
    """Stands for a user's config class pickled into a checkpoint: no weights-only global."""

    n_layer = 2


class Planted:
    """A pickle that, unpickled in full, makes a folder: the proof it was never unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def nanogpt_checkpoint(nan: bool = False) -> dict[str, object]:
    """What karpathy/nanoGPT's train.py saves: model and optimizer state dicts, numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    model[1].weight = model[0].weight   # tied, as nanoGPT's wte and lm_head: one storage
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    if nan:
        state["state"][1]["exp_avg"][:2] = float("nan")
    return {"model": model.state_dict(), "optimizer": state,
            "model_args": {"n_layer": 2, "vocab_size": 16}, "iter_num": 2000,
            "best_val_loss": torch.tensor(1.25), "config": {"learning_rate": 6e-4}}


def test_plain_torch_save_is_a_restart_point_with_the_caveat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(nanogpt_checkpoint(), "ckpt.pt")
    torch.save(nanogpt_checkpoint(), "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("ckpt.pt", "legacy.pt"):
        result = validate(name)
        assert (result.verdict, result.problems, result.caveat) == ("LOADABLE", (), UNPROVEN)
        assert result and not result.proven
    assert UNPROVEN == ("no manifest: loadable and finite, but the write's completeness is "
                        "not proven")
    os.utime("legacy.pt", (1_700_000_000, 1_700_000_000))
    assert newest_valid(".") == Path("ckpt.pt")
    assert newest_valid(".", require_manifest=True) is None

    assert main(["checkpoint", "ckpt.pt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[3:] == ["LOADABLE", "weights", "+", "optimizer", "+", "iter_num",
                                    "2000", *UNPROVEN.split()]
    assert lines[-1] == f"restart from: ckpt.pt ({UNPROVEN})"
    assert main(["checkpoint", "--require-manifest", "ckpt.pt"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no checkpoint with a manifest (--require-manifest): nothing to restart from")


def test_a_newer_plain_checkpoint_names_the_older_proven_one(tmp_path: Path) -> None:
    save(nanogpt_checkpoint(), tmp_path / "step-1.pt")
    os.utime(tmp_path / "step-1.pt", (1_700_000_000, 1_700_000_000))
    torch.save(nanogpt_checkpoint(), tmp_path / "step-2.pt")
    found = survey([str(tmp_path)])
    assert [r.verdict for r in found.results] == ["LOADABLE", "VALID"]
    assert found.restart is found.results[0]
    assert found.render().splitlines()[-1] == (
        f"restart from: {tmp_path / 'step-2.pt'} ({UNPROVEN}; {tmp_path / 'step-1.pt'}, "
        "older, is proven by its manifest)")
    strict = survey([str(tmp_path)], require_manifest=True)
    assert strict.restart is strict.results[1]


def test_plain_checkpoint_names_its_non_finite_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save(nanogpt_checkpoint(nan=True), path)
    result = validate(path)
    assert result.verdict == "INVALID"
    assert result.problems == ("optimizer.state.1.exp_avg: 2 NaN, 0 inf", NO_MANIFEST)


def test_plain_checkpoint_needing_full_unpickling_is_not_loaded(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    path = tmp_path / "ckpt.pt"
    torch.save({"model": nn.Linear(2, 2).state_dict(), "config": GPTConfig(),
                "hook": Planted(marker)}, path)
    result = validate(path)
    assert not marker.exists()
    assert result.verdict == "UNCHECKED" and not result
    assert len(result.problems) == 1
    assert result.problems[0].startswith(
        "needs full unpickling, so not loaded: torch.load(weights_only=True) refuses it (")
    assert "a full load may run any code its pickle names" in result.problems[0]
    assert survey([str(path)]).render().splitlines()[-1] == (
        "no valid checkpoint: nothing to restart from")


def test_plain_checkpoint_cut_or_damaged_is_invalid(tmp_path: Path) -> None:
    whole = tmp_path / "whole.pt"
    torch.save(nanogpt_checkpoint(), whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert validate(cut).problems == (
        f"not a whole zip archive: its directory, which torch.save writes last, is missing "
        f"({len(data) // 2} bytes): truncated write?", NO_MANIFEST)

    with zipfile.ZipFile(whole) as archive:   # one byte of a tensor flipped on disk
        record = max((info for info in archive.infolist() if "/data/" in info.filename),
                     key=lambda info: info.file_size)
    local = record.header_offset   # the local header: its name and extra field lengths
    at = (local + 30 + int.from_bytes(data[local + 26:local + 28], "little")
          + int.from_bytes(data[local + 28:local + 30], "little") + 5)
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    assert validate(damaged).problems[0] == (
        f"record {record.filename} is damaged (its CRC does not match): corrupted on disk?")

    # A whole zip whose tensor record lost bytes: torch maps the next record's bytes in
    # silently, or refuses to when the file ends first.
    assert validate(cut_record(whole, record.filename, tmp_path / "short.pt")).problems[0] == (
        "its tensors hold 1740 bytes but the archive's tensor records 1236: a record was cut "
        "short or rewritten (torch reads past its end)")
    last = tmp_path / "last.pt"
    torch.save({"w": torch.randn(1000)}, last)
    assert validate(cut_record(last, "last/data/0", tmp_path / "cut-last.pt")).problems[0] == (
        "cannot load: a tensor's record in the archive holds fewer bytes than the tensor: the "
        "file was cut short or rewritten (torch.load: Trying to resize storage that is not "
        "resizable)")


def cut_record(source: Path, name: str, target: Path) -> Path:
    """``source`` rewritten as a whole zip in which record ``name`` keeps 8 bytes."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as out:
        for info in src.infolist():
            body = src.read(info.filename)
            out.writestr(info.filename, body[:8] if info.filename == name else body)
    return target


def test_safetensors_from_another_writer(tmp_path: Path) -> None:
    """A file from safetensors' own writer (as transformers saves model.safetensors)."""
    path = tmp_path / "model.safetensors"
    tensors = {"wte.weight": torch.randn(16, 8), "lm_head.bias": torch.zeros(16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert validate(path).verdict == "LOADABLE"
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    problem = validate(cut).problems[0]
    assert problem.startswith("cannot load: ") and "(truncated?)" in problem
    tensors["lm_head.bias"][3] = float("inf")
    save_file(tensors, str(path))
    assert validate(path).problems == ("lm_head.bias: 0 NaN, 1 inf", NO_MANIFEST)


TINY_LM = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight   # tied, as GPT-2's


def model():
    torch.manual_seed(0)
    return TinyLM()
'''


def tied_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """A project whose model module ``name`` is at its root (pyproject.toml with a pytest
    table), as a user runs ``gpucase checkpoint --model name:model`` from it."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (root / f"{name}.py").write_text(TINY_LM)
    # Each test restores the path and forgets the module it imported.
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path
                                     if p not in ("", ".", str(root))])
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return root


def test_tied_weights_saved_once_by_safetensors_are_not_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_model, save_model

    root = tied_project(tmp_path, monkeypatch, "tiedlm_a")
    (root / "scripts").mkdir()
    monkeypatch.chdir(root / "scripts")   # the project root is found above the working dir
    __import__("sys").path.insert(0, str(root))
    from tiedlm_a import model  # type: ignore[import-not-found]
    __import__("sys").path.remove(str(root))
    net = model()
    save_model(net, str(root / "model.safetensors"))   # drops lm_head.weight, the alias
    load_model(model(), str(root / "model.safetensors"))  # and restores it: a valid file
    result = survey([str(root / "model.safetensors")], model="tiedlm_a:model")
    assert result.results[0].verdict == "LOADABLE", result.results[0].problems
    # A file that really lacks a weight is still refused.
    save_file({"wte.weight": torch.zeros(16, 8)}, str(root / "short.safetensors"))
    short = survey([str(root / "short.safetensors")], model="tiedlm_a:model").results[0]
    assert short.problems[0] == "missing keys: ln_f.weight, ln_f.bias"
    assert main(["checkpoint", "--model", "tiedlm_a:model", str(root / "model.safetensors")]) == 0
    assert "LOADABLE" in capsys.readouterr().out
    # The other way round: the reference saved once, the checkpoint keeps both names.
    torch.save({"model": net.state_dict(), "iter_num": 3}, root / "full.pt")
    both = survey([str(root / "full.pt")], model=str(root / "model.safetensors")).results[0]
    assert both.verdict == "LOADABLE", both.problems


def test_model_import_path_is_found_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tied_project(tmp_path, monkeypatch, "tiedlm_b")
    monkeypatch.chdir(root)
    torch.save({"wte.weight": torch.zeros(16, 8), "ln_f.weight": torch.ones(8),
                "ln_f.bias": torch.zeros(8), "lm_head.weight": torch.zeros(16, 8)}, "w.pt")
    assert main(["checkpoint", "--model", "tiedlm_b:model", "w.pt"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[3] == "LOADABLE"


def test_restart_point_says_what_it_holds(tmp_path: Path) -> None:
    """A weights-only export written just after a full checkpoint: the restart line says a
    restart from it loses the optimizer, and names the full one."""
    full = tmp_path / "ckpt_400.pt"
    torch.save(nanogpt_checkpoint(), full)
    os.utime(full, (1_700_000_000, 1_700_000_000))
    weights = tmp_path / "model_400.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    os.utime(weights, (1_700_000_001, 1_700_000_001))
    found = survey([str(tmp_path)])
    assert [r.holds for r in found.results] == [
        "weights only", "weights + optimizer + iter_num 2000"]
    assert found.render().splitlines()[-1] == (
        f"restart from: {weights} ({UNPROVEN}; it holds weights only: a restart from it "
        f"starts the optimizer afresh; {full}, older, holds weights + optimizer + iter_num "
        "2000: restart from it to resume)")


def test_every_problem_of_a_file_is_shown(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    state = {f"layer{i}.weight": torch.full((2,), float("nan")) for i in range(7)}
    torch.save(state, path)
    assert validate(path).problems[-1] == NO_MANIFEST
    lines = survey([str(path)]).render().splitlines()
    assert lines[1].endswith("layer0.weight: 2 NaN, 0 inf")
    assert [line.strip() for line in lines[2:-1]] == [
        *(f"layer{i}.weight: 2 NaN, 0 inf" for i in range(1, 5)),
        "... and 3 more problems (--all-problems lists them)"]
    every = survey([str(path)]).render(all_problems=True).splitlines()
    assert [line.strip() for line in every[2:-1]] == [
        *(f"layer{i}.weight: 2 NaN, 0 inf" for i in range(1, 7)), NO_MANIFEST]
    torch.save({"w": torch.tensor([float("nan")])}, path)
    # Two problems: both on screen, the missing manifest no longer hidden behind "+1 more".
    assert [line.strip() for line in survey([str(path)]).render().splitlines()[1:3]][1] == (
        NO_MANIFEST)

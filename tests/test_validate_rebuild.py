"""``gpucase validate`` builds a module case's model as its replay does, in a child, and holds
it against the saved state (issue 30 item 4): a model whose code gained a buffer, changed a
shape or dropped a layer since the capture is named before a run fails on it; a case whose
code is as captured has no problem."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from pytest_gpucase.tools.validate import validate
from tests.helpers import python_in

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

pytestmark = pytest.mark.slow  # the capture runs in a fresh interpreter, the rebuild in a child


MODEL = '''
import torch


class Net(torch.nn.Module):
    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, 3)
        self.register_buffer("scale", torch.ones(dim))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, tokens):
        return self.head(self.emb(tokens) * self.scale)
'''

TRAIN = '''
import torch
from pytest_gpucase import Recorder
from netmod import Net

torch.manual_seed(0)
rec = Recorder("cases", narrow=False)
model = rec.watch(Net())
model.scale.mul_(2)  # trained, as running statistics are: not the constructor's value
model(torch.tensor([[1, 9]]))
'''


def _project(root: Path, module: str, source: str, train: str) -> Path:
    """A project with a pytest.ini, ``module``.py holding ``source`` and a train.py; the
    training run once, as a user runs it (its stderr returned by ``_train``)."""
    project = root / "project"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / f"{module}.py").write_text(source)
    (project / "train.py").write_text(train)
    return project


def _train(project: Path) -> str:
    """Run the project's train.py in a fresh interpreter; its stderr."""
    return python_in(project, "train.py").stderr


@pytest.fixture(scope="module")
def _once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose train.py fails in Net's forward: its case, captured once."""
    project = _project(tmp_path_factory.mktemp("captured"), "netmod", MODEL, TRAIN)
    stderr = _train(project)
    assert "IndexError" in stderr, stderr
    assert (project / "cases" / "Net" / "case.toml").is_file(), stderr
    return project


@pytest.fixture
def captured(_once: Path, tmp_path: Path) -> Path:
    """A copy of the captured project, this test's to edit."""
    return Path(shutil.copytree(_once, tmp_path / "project"))


def _edit(project: Path, old: str, new: str) -> None:
    source = (project / "netmod.py").read_text()
    assert old in source
    (project / "netmod.py").write_text(source.replace(old, new))


def test_a_clean_model_case_has_no_problem(captured: Path) -> None:
    project = captured
    assert validate([project / "cases"]) == []


def test_a_buffer_the_model_gained_after_the_capture_is_a_problem(captured: Path) -> None:
    project = captured
    _edit(project, '        self.register_buffer("cache"',
          '        self.register_buffer("offset", torch.zeros(3))\n'
          '        self.register_buffer("cache"')
    problems = validate([project / "cases"])
    assert len(problems) == 1, problems
    assert "[inputs] gpucase_module" in problems[0]
    assert "has offset (buffer [3] float32), which the saved state lacks" in problems[0]
    done = python_in(project, "-m", "pytest_gpucase.cli", "validate", str(project / "cases"))
    assert done.returncode == 1 and "offset (buffer [3] float32)" in done.stdout, done


def test_a_changed_shape_and_a_dropped_layer_are_problems(captured: Path) -> None:
    project = captured
    _edit(project, "torch.nn.Linear(dim, 3)", "torch.nn.Linear(dim, 5)")
    _edit(project, 'self.register_buffer("scale", torch.ones(dim))', "")
    _edit(project, " * self.scale", "")
    problems = validate([project / "cases"])
    assert any("head.weight is [3, 4] in the saved state but [5, 4]" in p for p in problems)
    assert any("the saved state holds scale, which the model built" in p for p in problems)


def test_a_buffer_the_code_owns_is_the_code_s_to_change(captured: Path) -> None:
    """A buffer equal to the constructor's value at capture (a mask, a constant table) is
    replayed from the code: changing or dropping it is a fix, not a stale case."""
    project = captured
    _edit(project, 'self.register_buffer("scale", torch.ones(dim))',
          'self.register_buffer("scale", torch.ones(dim))\n'
          '        self.register_buffer("mask", torch.ones(2, 2))')
    shutil.rmtree(project / "cases")  # recorded again, with the mask
    stderr = _train(project)
    assert "IndexError" in stderr, stderr
    doc = tomllib.loads((project / "cases" / "Net" / "case.toml").read_text())
    assert doc["inputs"]["gpucase_module"]["code_owned"] == ["mask"]
    _edit(project, 'self.register_buffer("mask", torch.ones(2, 2))',
          'self.register_buffer("mask", torch.zeros(3, 3), persistent=False)')
    assert validate([project / "cases"]) == []


def test_a_model_that_no_longer_builds_is_a_problem(captured: Path) -> None:
    project = captured
    _edit(project, "super().__init__()", "super().__init__()\n        raise ValueError('gone')")
    (problem,) = validate([project / "cases"])
    assert "raised ValueError: gone" in problem, problem


def test_without_rebuild_validate_runs_no_case_code(captured: Path) -> None:
    project = captured
    _edit(project, "super().__init__()", "super().__init__()\n        raise ValueError('gone')")
    assert validate([project / "cases"], rebuild=False) == []


def test_the_cli_without_rebuild_runs_no_case_code(captured: Path) -> None:
    project = captured
    _edit(project, "super().__init__()", "super().__init__()\n        raise ValueError('gone')")
    done = python_in(project, "-m", "pytest_gpucase.cli", "validate", "--no-rebuild",
                     str(project / "cases"))
    assert done.returncode == 0 and "no problems" in done.stdout, done


def test_a_buffer_of_another_dtype_kind_is_a_note_not_a_problem(captured: Path) -> None:
    """The replay assigns the saved tensor, dtype and all, so it replays as captured: the
    changed code is said, and the case has no problem."""
    project = captured
    _edit(project, 'torch.ones(dim))', 'torch.ones(dim, dtype=torch.long))')
    notes: list[str] = []
    assert validate([project / "cases"], notes) == []
    assert any("scale is float32 in the saved state but int64" in note for note in notes), notes


LIT_MODEL = '''
import lightning.pytorch as pl
import torch
import torch.nn.functional as F


class Lit(pl.LightningModule):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        return F.cross_entropy(self.head(self.emb(tokens)).flatten(0, 1), target.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''

LIT_TRAIN = '''
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from pytest_gpucase.integrations.lightning import GpuCaseCallback
from litmod import Lit

tokens = torch.randint(0, 16, (8, 3), generator=torch.Generator().manual_seed(0))
target = tokens.clone()
target[5, 1] = 99
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     callbacks=[GpuCaseCallback("cases", narrow=False)])
trainer.fit(Lit(dim=6), DataLoader(TensorDataset(tokens, target), batch_size=4))
'''


def test_a_lightning_case_whose_module_no_longer_takes_its_state_is_a_problem(
        tmp_path: Path) -> None:
    """Issue 30: the LightningModule's code changed after the capture (a wider head): its
    training_step case can no longer load its state, and validate says so."""
    pytest.importorskip("lightning")
    project = _project(tmp_path, "litmod", LIT_MODEL, LIT_TRAIN)
    stderr = _train(project)
    cases = project / "cases"
    assert (cases / "Lit.training_step" / "case.toml").is_file(), stderr
    assert validate([cases]) == []
    source = (project / "litmod.py").read_text()
    (project / "litmod.py").write_text(source.replace("Linear(dim, vocab)",
                                                      "Linear(dim, vocab + 1)"))
    (problem,) = validate([cases])
    assert "head.weight is [16, 6] in the saved state but [17, 6]" in problem, problem
    assert "head.bias is [16] in the saved state but [17]" in problem, problem


def test_a_state_referenced_in_a_checkpoint_is_held_against_the_rebuild(
        tmp_path: Path) -> None:
    """A large state lives in the user's checkpoint (state_limit): the rebuild is held
    against the checkpoint's tensors; arguments that no longer fit it are a problem."""
    import torch
    from safetensors.torch import save_file

    from pytest_gpucase import Recorder
    from tests import model_targets

    pytest.importorskip("numpy", reason="safetensors.torch.save_file needs numpy")
    torch.manual_seed(0)
    model = model_targets.TinyLM(vocab=64, dim=16)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    rec = Recorder(tmp_path / "cases", state_limit=1024, narrow=False)
    rec.watch(model, checkpoint=tmp_path / "model.safetensors")
    with pytest.raises(IndexError):
        model(torch.tensor([[64]]))
    case_file = tmp_path / "cases" / "TinyLM" / "case.toml"
    assert "[inputs.gpucase_module.checkpoint]" in case_file.read_text()
    assert validate([tmp_path / "cases"]) == []
    case_file.write_text(case_file.read_text().replace("vocab = 64", "vocab = 65"))
    (problem,) = validate([tmp_path / "cases"])
    assert "emb.weight is [64, 16] in the saved state but [65, 16]" in problem, problem
    assert "head.weight is [64, 16] in the saved state but [65, 16]" in problem, problem


def test_a_model_whose_library_this_machine_cannot_load_is_a_note(captured: Path) -> None:
    """A case captured on a GPU machine, validated on one whose loader refuses the model's
    compiled library: the run calls that the environment's failure, so validate notes it
    and finds no problem with the case."""
    project = captured
    _edit(project, "import torch\n", "import torch\nraise ImportError('libcudart.so.12: cannot "
          "open shared object file: No such file or directory')\n")
    notes: list[str] = []
    assert validate([project / "cases"], notes) == []
    assert any("rebuild was not checked here" in note and "libcudart" in note
               for note in notes), notes

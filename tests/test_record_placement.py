"""A Recorder says, before any training, when its cases could not import the user's model:
the model's module was found in the script's folder, and the case folder lies outside the
project that would put that folder on a replay's path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.helpers import python_in

pytestmark = pytest.mark.slow  # each test runs a script in a fresh interpreter


MODEL_PY = '''
import torch


class Tiny(torch.nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.emb = torch.nn.Embedding(8, dim)

    def forward(self, tokens):
        return self.emb(tokens)
'''

TRAIN_PY = '''
import sys

import torch
from model import Tiny
from pytest_gpucase import Recorder

rec = Recorder(sys.argv[1])
model = rec.watch(Tiny())
print("watched", flush=True)
'''


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (project / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (project / "train.py").write_text(textwrap.dedent(TRAIN_PY))
    return project


def _run(cwd: Path, *args: str) -> str:
    done = python_in(cwd, *args, check=True)
    assert "watched" in done.stdout
    return done.stderr


def test_cases_outside_the_project_of_the_model_are_said_to_be_unreplayable(
        tmp_path: Path) -> None:
    _project(tmp_path)
    err = _run(tmp_path, "proj/train.py", "cases")  # cases/ beside proj/, not in it
    assert "gpucase: warning: model was imported from proj" in err, err
    assert "will not find it: no pytest configuration above it names a project" in err, err
    assert err.count("model was imported from") == 1


def test_cases_inside_the_project_say_nothing(tmp_path: Path) -> None:
    project = _project(tmp_path)
    assert "imported from" not in _run(tmp_path, "proj/train.py", str(project / "cases"))
    assert "imported from" not in _run(project, "train.py", "cases")

"""Models built from a config object are rebuilt without a factory (issue 33 item 1): each
kind of config (a dataclass, nested too; a SimpleNamespace; a named tuple; a typed dict; a
pydantic model; a Hugging Face config) is kept in model.json as its kind, its importable
class and its plain-data fields, and built again from them; a field that is no plain data
makes the rebuild impossible, with the reason naming the field."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpucase.run.replay import build_model, import_target
from pytest_gpucase.tools.record.rebuild import rebuild_files, rebuild_of
from tests import config_targets as targets
from tests.helpers import python_in


def _rebuilt(tmp_path: Path, model: torch.nn.Module) -> tuple[dict[str, Any], Any]:
    """model.json as the Recorder writes it, and the model a replay builds from it."""
    rebuild = rebuild_of(model, None, None)
    assert rebuild.factory is not None, rebuild.why_not
    if rebuild.recipe is None:  # plain keyword arguments: the class, with case.toml's kwargs
        return dict(rebuild.kwargs), import_target(rebuild.factory)(**rebuild.kwargs)
    case = tmp_path / "cases" / "GPT"
    case.mkdir(parents=True)
    for name, text in rebuild_files(rebuild, tmp_path / "cases").items():
        (case / name).write_text(text)
    assert "model.json" in (case / "case.py").read_text()
    return json.loads((case / "model.json").read_text()), build_model(case / "model.json")


def _same(model: torch.nn.Module, built: Any) -> None:
    assert built.head.weight is built.emb.weight  # tied again by the constructor
    assert type(built) is type(model)
    assert {k: v.shape for k, v in built.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()}


def test_a_nested_dataclass_config_is_rebuilt_from_its_fields(tmp_path: Path) -> None:
    model = targets.GPT(targets.GPTConfig(targets.Sizes(vocab=8, dim=6), dropout=0.1))
    recipe, built = _rebuilt(tmp_path, model)
    config = recipe["kwargs"]["config"]
    assert config["gpucase_config"] == "dataclass"
    assert config["class"] == "tests.config_targets:GPTConfig"
    assert config["fields"]["sizes"] == {"gpucase_config": "dataclass",
                                         "class": "tests.config_targets:Sizes",
                                         "fields": {"vocab": 8, "dim": 6}}
    _same(model, built)
    assert built.config == model.config


def test_enum_and_dtype_fields_are_kept_by_name(tmp_path: Path) -> None:
    config = targets.GPTConfig(targets.Sizes(vocab=8, dim=6), act=targets.Act.RELU,
                               extra=torch.bfloat16)
    recipe, built = _rebuilt(tmp_path, targets.GPT(config))
    fields = recipe["kwargs"]["config"]["fields"]
    assert fields["act"] == {"gpucase_config": "enum", "class": "tests.config_targets:Act",
                             "fields": {"name": "RELU"}}
    assert fields["extra"]["fields"] == {"name": "bfloat16"}
    assert built.config == config and built.config.extra is torch.bfloat16


@pytest.mark.parametrize("config", [
    types.SimpleNamespace(vocab=8, dim=6),
    targets.TupleConfig(vocab=8, dim=6),
    targets.DictConfig(vocab=8, dim=6),
], ids=["namespace", "namedtuple", "typeddict"])
def test_a_config_of_each_plain_kind_is_rebuilt(tmp_path: Path, config: Any) -> None:
    model = targets.GPT(config)
    _, built = _rebuilt(tmp_path, model)
    _same(model, built)
    assert built.config == config and type(built.config) is type(config)


def test_a_pydantic_config_is_rebuilt_with_model_validate(tmp_path: Path) -> None:
    pytest.importorskip("pydantic")
    model = targets.GPT(targets.pydantic_config())
    recipe, built = _rebuilt(tmp_path, model)
    assert recipe["kwargs"]["config"]["gpucase_config"] == "pydantic"
    _same(model, built)
    assert built.config == model.config


def test_a_hugging_face_config_of_a_custom_model_is_rebuilt_from_its_dict(
        tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=8, n_embd=6, n_layer=1, n_head=2,
                                     n_positions=16)
    model = targets.GPT(config)
    recipe, built = _rebuilt(tmp_path, model)
    assert recipe["kwargs"]["config"]["gpucase_config"] == "hf_config"
    assert recipe["kwargs"]["config"]["class"].endswith(":GPT2Config")
    _same(model, built)
    assert built.config.to_dict() == config.to_dict()


def test_a_config_kept_under_another_name_is_found(tmp_path: Path) -> None:
    """GPT(config) that keeps self.cfg: the one config object the module keeps."""
    model = targets.RenamedGPT(targets.GPTConfig(targets.Sizes(vocab=8, dim=6)))
    recipe, built = _rebuilt(tmp_path, model)
    assert recipe["kwargs"]["config"]["class"] == "tests.config_targets:GPTConfig"
    assert built.cfg == model.cfg


@pytest.mark.parametrize("extra, what", [
    (torch.zeros(2), "config.extra is a tensor"),
    (torch.nn.functional.gelu, "config.extra is a function or callable (gelu)"),
    ([1, object()], "config.extra[1] is a object object"),
], ids=["tensor", "function", "object"])
def test_a_config_field_that_is_no_plain_data_is_named(extra: Any, what: str) -> None:
    model = targets.GPT(targets.GPTConfig(targets.Sizes(vocab=8, dim=6), extra=extra))
    rebuild = rebuild_of(model, None, None)
    assert rebuild.factory is None
    assert what in rebuild.why_not, rebuild.why_not
    assert "GPT(config=...)" in rebuild.why_not and "factory=" in rebuild.why_not


@pytest.mark.slow  # the Recorder probes its environment in a child
def test_a_secret_config_field_is_scrubbed_and_the_rebuild_kept(tmp_path: Path) -> None:
    """A config field that looks secret is written <secret> in model.json and listed in
    [origin] scrubbed; the rebuild, which reads no such field, stays complete."""
    from pytest_gpucase import Recorder
    from tests.helpers import read_toml

    token = "hf_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7"
    model = targets.GPT(targets.GPTConfig(targets.Sizes(vocab=8, dim=6), api_key=token))
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model)
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 8]]))
    case = tmp_path / "cases" / "GPT"
    text = (case / "model.json").read_text()
    assert token not in text
    assert json.loads(text)["kwargs"]["config"]["fields"]["api_key"] == "<secret>"
    doc = read_toml(case)
    assert "incomplete" not in doc["origin"], doc["origin"]
    assert any("api_key" in place for place in doc["origin"]["scrubbed"])


# -- a nanoGPT-shaped project, run as a user runs it ----------------------------------------

_MODEL_PY = '''
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 20
    n_embd: int = 8
    n_head: int = 2
    bias: bool = True
    init: Any = None


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size,
                                                           config.block_size)))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.bias[:T, :T] == 0, float("-inf")).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([CausalSelfAttention(config)]),
            ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = x + block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''

_TRAIN_PY = '''
import torch
from model import GPT, GPTConfig
from pytest_gpucase import Recorder

model = GPT(GPTConfig(INIT))
rec = Recorder("cases")
rec.watch(model)
for it in range(3):
    with rec.step(it):
        idx = torch.randint(0, 20, (2, 8))
        if it == 2:
            idx[1, 3] = 20   # a token id equal to the vocabulary size
        model(idx, idx).backward()
'''


def _nano_project(tmp_path: Path, init: str, config: bool = True) -> tuple[Path, str]:
    """Run a nanoGPT-shaped train.py (GPT(GPTConfig(...)), tied head) that fails on a token
    id equal to the vocabulary size; its cases folder and its stderr."""
    import textwrap

    project = tmp_path / "project"
    project.mkdir()
    (project / "model.py").write_text(textwrap.dedent(_MODEL_PY))
    if config:
        (project / "pytest.ini").write_text("[pytest]\n")  # the rootdir a replay imports from
    (project / "train.py").write_text(textwrap.dedent(_TRAIN_PY).replace("INIT", init))
    done = python_in(project, "train.py")
    assert "IndexError" in done.stderr, done.stderr
    return project / "cases", done.stderr


@pytest.mark.slow  # runs a training script and replays its cases in children
def test_a_nanogpt_model_is_rebuilt_from_its_dataclass_config(tmp_path: Path) -> None:
    from pytest_gpucase.tools.validate import validate
    from tests.helpers import read_toml, replays

    cases, stderr = _nano_project(tmp_path, "")
    assert "warning" not in stderr and "note: GPT imports" not in stderr, stderr
    case = cases / "GPT"
    doc = read_toml(case)
    assert "incomplete" not in doc["origin"], doc["origin"]
    config = json.loads((case / "model.json").read_text())["kwargs"]["config"]
    assert config["gpucase_config"] == "dataclass" and config["class"] == "model:GPTConfig"
    assert validate([cases]) == []
    replays(case, "IndexError")


@pytest.mark.slow  # runs a training script and replays its cases in children
def test_a_model_that_cannot_be_rebuilt_still_gets_its_narrowed_cases(
        tmp_path: Path) -> None:
    """Issue 33 item 1: the model case is incomplete (a config field is a function), but
    the nn.Embedding and the ATen op need no rebuild of GPT: both are written, and replay."""
    from tests.helpers import read_toml, replays

    cases, stderr = _nano_project(tmp_path, "init=torch.nn.init.normal_")
    assert "config.init is a function" in stderr, stderr
    assert "incomplete" in read_toml(cases / "GPT")["origin"]
    replays(cases / "GPT.transformer.wte", "IndexError")
    replays(cases / "GPT.aten.embedding.default", "IndexError")


@pytest.mark.slow  # the Recorder probes its environment in a child
def test_an_op_case_not_written_is_named_with_its_reason(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """No submodule raised and the model cannot be rebuilt: the op that raised is found by
    replaying a case, and none can be; a note says so instead of nothing."""
    from pytest_gpucase import Recorder

    model = targets.Lookup(targets.GPTConfig(targets.Sizes(vocab=8, dim=6), extra=torch.ones(1)))
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 8]]))
    err = capfd.readouterr().err
    assert "gpucase: note: no op case written" in err, err
    assert "Lookup cannot be rebuilt" in err and "config.extra is a tensor" in err
    assert sorted(p.name for p in (tmp_path / "cases").iterdir()
                  if not p.name.startswith(".")) == ["Lookup"]


@pytest.mark.slow  # runs a training script
def test_a_project_module_a_replay_would_not_find_is_said_when_saved(tmp_path: Path) -> None:
    """nanoGPT has no pytest configuration: train.py imports model from its own folder,
    which pytest --gpu-cases would not put on the path. Said when the model is watched."""
    _, stderr = _nano_project(tmp_path, "", config=False)
    assert "gpucase: warning: model was imported from . (the script's folder" in stderr, stderr
    assert "no pytest configuration above it names a project" in stderr
    assert stderr.count("model was imported from") == 1

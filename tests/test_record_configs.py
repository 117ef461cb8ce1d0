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

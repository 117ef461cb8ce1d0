"""The Hugging Face callback in real Trainer runs and Accelerate in a plain loop (CPU, tiny
config-built models): the model is rebuilt from its config.json, tied weights stay tied,
bf16 is the case's autocast (issue 22 items 4-6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from pytest_gpucase import Recorder  # noqa: E402
from pytest_gpucase.case import payload  # noqa: E402
from pytest_gpucase.integrations.transformers import GpuCaseCallback  # noqa: E402
from pytest_gpucase.tools.validate import validate  # noqa: E402
from tests import transformers_targets as targets  # noqa: E402
from tests.helpers import read_toml as toml  # noqa: E402
from tests.helpers import replays  # noqa: E402

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.slow,  # real training runs and replays in children
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(autouse=True)
def _fresh_accelerate() -> Any:
    """Accelerate keeps one process-wide state: each test (a Trainer in float32 or bf16, a
    plain loop) starts from none, as a script does."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def train(tmp_path: Path, model: Any, data: Any, bf16: bool = False,
          **options: Any) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1,
        report_to=[], use_cpu=True, bf16=bf16, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[GpuCaseCallback(tmp_path / "cases")])
    trainer.train()


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_a_trainer_failure_is_the_model_case_rebuilt_from_its_config(
        tmp_path: Path, bf16: bool) -> None:
    torch.manual_seed(0)
    model = transformers.BertForTokenClassification(targets.bert_config())
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        train(tmp_path, model, targets.Tokens(bad_label=True), bf16=bf16)
    case_dir = tmp_path / "cases" / "BertForTokenClassification"
    doc = toml(case_dir)
    assert doc["inputs"]["gpucase_module"]["factory"] == "case.py:make_model"
    recipe = json.loads((case_dir / "model.json").read_text())
    assert recipe["class"] == ("transformers.models.bert.modeling_bert:"
                               "BertForTokenClassification")
    config = json.loads((case_dir / "config.json").read_text())  # the config's own JSON
    assert config["hidden_dropout_prob"] == 0.2 and len(config["id2label"]) == 3
    assert doc["origin"]["iteration"] == 2
    # Issue 33 item 3: the user's model and method, never Accelerate's wrapper of forward.
    assert doc["summary"].startswith("BertForTokenClassification.forward raised IndexError")
    assert "convert_outputs_to_fp32" not in (case_dir / "case.toml").read_text()
    if bf16:
        assert doc["context"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16",
                                              "enabled": True}
    else:
        assert "autocast" not in doc["context"]
    assert validate([tmp_path / "cases"]) == []
    replays(case_dir, "IndexError")


def test_bf16_under_torch_compile_is_the_case_context(tmp_path: Path) -> None:
    """Compiled, no submodule hook runs eagerly to read Accelerate's autocast: the callback
    says it from the Trainer's arguments, so the case replays in bfloat16."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(targets.gpt2_config())
    with pytest.raises(IndexError):
        train(tmp_path, model, targets.Tokens(bad_token=True), bf16=True, torch_compile=True,
              torch_compile_backend="eager")
    doc = toml(tmp_path / "cases" / "GPT2LMHeadModel")
    assert doc["context"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16",
                                          "enabled": True}


def test_tied_embeddings_of_a_causal_lm_are_stored_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(targets.gpt2_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(IndexError):
        train(tmp_path, model, targets.Tokens(bad_token=True, causal=True))
    case_dir = tmp_path / "cases" / "GPT2LMHeadModel"
    recipe = toml(case_dir)["inputs"]["gpucase_module"]
    assert recipe["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert "state.lm_head.weight" not in payload.load(case_dir / "inputs.safetensors")
    replays(case_dir, "IndexError")


def test_a_backward_failure_leaving_train_is_recorded(tmp_path: Path) -> None:
    """The Trainer has no exception callback: the exception leaving trainer.train() in a
    script is recorded on its way out, and the case runs forward and backward again."""
    script = tmp_path / "train.py"
    script.write_text(f'''
import sys, torch, transformers
sys.path.insert(0, {str(ROOT)!r})
from pytest_gpucase.integrations.transformers import GpuCaseCallback
from tests import transformers_targets as targets

class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a custom backward rejected its gradient")

torch.manual_seed(0)
model = transformers.BertForTokenClassification(targets.bert_config())
model.classifier.register_forward_hook(lambda m, a, out: Boom.apply(out))
args = transformers.TrainingArguments(output_dir={str(tmp_path / "out")!r},
    per_device_train_batch_size=4, num_train_epochs=1, report_to=[], use_cpu=True,
    save_strategy="no", logging_strategy="no", disable_tqdm=True)
trainer = transformers.Trainer(model=model, args=args, train_dataset=targets.Tokens(),
    callbacks=[GpuCaseCallback({str(tmp_path / "cases")!r})])
trainer.train()
''')
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          check=False)
    assert done.returncode == 1 and "a custom backward rejected" in done.stderr, done.stderr
    case_dir = tmp_path / "cases" / "BertForTokenClassification"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["backward"] is True and recipe["loss"] == "output"
    assert recipe["loss_index"] == 0  # BERT's output: (loss, logits)
    assert not doc["summary"].startswith("INCOMPLETE")
    assert doc["origin"]["grad_output"].startswith("recomputed")


def test_accelerate_bf16_in_a_plain_loop_is_recorded(tmp_path: Path) -> None:
    """Accelerate enters autocast inside the model's forward (its wrapper): the context is
    read where the model computes, so the case replays in bfloat16."""
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    model = transformers.BertForTokenClassification(targets.bert_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    data = targets.Tokens(bad_label=True)
    with pytest.raises(IndexError):
        for it in range(4):
            batch = {k: torch.stack([data[4 * it + i][k] for i in range(4)])
                     for k in ("input_ids", "labels")}
            with rec.step(it):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    doc = toml(tmp_path / "cases" / "BertForTokenClassification")
    assert doc["context"]["autocast"]["dtype"] == "bfloat16"
    replays(tmp_path / "cases" / "BertForTokenClassification", "IndexError")


def test_a_config_holding_a_hub_token_writes_no_secret(tmp_path: Path) -> None:
    """Issue 30: a config that carries a Hub token (set on it by a training script) is
    written as config.json with <secret> in its place, listed, and the case replays."""
    torch.manual_seed(0)
    config = targets.bert_config()
    config.hub_token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
    model = transformers.BertForTokenClassification(config)
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        train(tmp_path, model, targets.Tokens(bad_label=True))
    case_dir = tmp_path / "cases" / "BertForTokenClassification"
    written = json.loads((case_dir / "config.json").read_text())
    assert written["hub_token"] == "<secret>"
    assert "AbCdEfGhIjKlMnOpQrStUvWxYz" not in (case_dir / "config.json").read_text()
    assert "config.json: hub_token" in toml(case_dir)["origin"]["scrubbed"]
    replays(case_dir, "IndexError")


def test_a_model_that_cannot_be_rebuilt_is_named_with_the_factory_to_pass(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 30 item 4: a head replaced after construction makes the config's rebuild
    another model; the warning, said when training begins, names the Hugging Face class,
    its config class and the factory to pass, to rec.watch and to the callback."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(targets.gpt2_config())
    model.lm_head = torch.nn.Linear(16, 50, bias=True)  # not what the config builds
    train(tmp_path, model, targets.Tokens(causal=True), max_steps=1)
    warning = next(line for line in capfd.readouterr().err.splitlines()
                   if line.startswith("gpucase: warning:"))
    assert "GPT2LMHeadModel is a Hugging Face model" in warning, warning
    assert "GPT2LMHeadModel(GPT2Config(...))" in warning
    assert 'rec.watch(model, factory="mypkg.models:build"' in warning
    assert 'GpuCaseCallback(factory="mypkg.models:build"' in warning

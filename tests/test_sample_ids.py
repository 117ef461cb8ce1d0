"""Sample ids from the training frameworks' batches, as docs/recorder.md shows them: the
Lightning callback's ``ids=``, and a Hugging Face Trainer whose dataset has a sample_id
column (with sequential sampling, iteration N holds samples N*B...)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import read_toml as toml

pytestmark = [pytest.mark.slow,  # real training runs; the Recorder checks cases in children
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

RECORDER_MD = Path(__file__).resolve().parents[1] / "docs" / "recorder.md"


def test_lightning_ids_of_a_tensor_column_are_its_numbers(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from pytest_gpucase.integrations.lightning import GpuCaseCallback
    from tests.lightning_targets import TinyLit

    class IdLit(TinyLit):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens, target, _ids = batch
            return super().training_step((tokens, target), batch_idx)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (16, 3), generator=generator)
    target = torch.randint(0, 16, (16, 3), generator=generator)
    target[9, 1] = 99
    data = DataLoader(TensorDataset(tokens, target, torch.arange(16) + 1000), batch_size=4)
    callback = GpuCaseCallback(tmp_path / "cases", ids=lambda batch: batch[2])  # as documented
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    torch.manual_seed(0)
    with pytest.raises(IndexError):
        trainer.fit(IdLit(dropout=0.0), data)
    origin = toml(tmp_path / "cases" / "IdLit.training_step")["origin"]
    assert origin["sample_ids"] == [1008, 1009, 1010, 1011]   # not "tensor(1008)"


def test_hf_trainer_ids_from_a_column_as_documented(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from tests import transformers_targets as targets

    block = re.search(r"\*Sample ids for Trainer batches\.\*.*?```python\n(.*?)```",
                      RECORDER_MD.read_text(encoding="utf-8"), re.S)
    assert block is not None
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(block[1], str(RECORDER_MD), "exec"), scope)   # the documented IdTrainer

    class WithIds(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.tokens = targets.Tokens(bad_token=True, causal=True)   # sample 9 is bad

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {**self.tokens[i], "sample_id": 1000 + i}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, train_sampling_strategy="sequential")
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(targets.gpt2_config())
    trainer = scope["IdTrainer"](model=model, args=args, train_dataset=WithIds(),
                                 callbacks=[scope["callback"]])
    try:
        with pytest.raises(IndexError):
            trainer.train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    case = toml(tmp_path / "cases" / "GPT2LMHeadModel")
    # Sequential sampling: iteration 2 of batches of 4 holds samples 8 to 11, 9 the bad one.
    assert case["origin"]["iteration"] == 2
    assert case["origin"]["sample_ids"] == [1008, 1009, 1010, 1011]

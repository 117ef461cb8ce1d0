"""Train a tiny tagger with Lightning; the gpucase callback saves the first failure as a case.

    python train.py                 # fails at iteration 2 and writes cases/Tagger.training_step
    pytest --gpu-cases cases -rxX   # replays it (see README.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from pytest_gpucase.integrations.lightning import GpuCaseCallback

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
PAD = -1  # what the data pads the tags of short sentences with


class Tagger(pl.LightningModule):
    """Embedding, one GRU layer and a linear head over TAGS, per token."""

    def __init__(self, vocab: int = 64, dim: int = 16, dropout: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.drop = torch.nn.Dropout(dropout)
        self.rnn = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, len(TAGS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.drop(self.embed(tokens)))
        return self.head(hidden)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor],
                      batch_idx: int) -> torch.Tensor:
        tokens, tags = batch
        logits = self(tokens)
        # The bug: padded tags are PAD (-1), but cross_entropy ignores -100 by default.
        loss = F.cross_entropy(logits.reshape(-1, len(TAGS)).float(), tags.reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def sentences() -> TensorDataset:
    """32 sentences of 6 tokens; sentence 9 is 4 tokens long, its last 2 tags padded."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 64, (32, 6), generator=generator)
    tags = torch.randint(0, len(TAGS), (32, 6), generator=generator)
    tokens[9, 4:], tags[9, 4:] = 0, PAD
    return TensorDataset(tokens, tags)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=Path("cases"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, precision="bf16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[GpuCaseCallback(args.cases)])
    trainer.fit(Tagger(), DataLoader(sentences(), batch_size=4))


if __name__ == "__main__":
    main()

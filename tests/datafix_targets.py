"""Models a replay imports, and the recording helper of tests/test_offending.py and
tests/test_datacheck.py: a nanoGPT-shaped
language model whose token ids index an embedding and whose targets reach cross_entropy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.tools.record import Recorder


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, a head, the loss computed inside forward when targets
    are given (nanoGPT's layout: ``logits.view(-1, V)`` against ``targets.view(-1)``)."""

    def __init__(self, vocab: int = 19, block: int = 12, dim: int = 4) -> None:
        super().__init__()
        self.vocab, self.block, self.dim = vocab, block, dim
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(block, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        logits: torch.Tensor = self.head(self.wte(idx) + self.wpe(pos))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)


class ShiftedGPT(TinyGPT):
    """TinyGPT that adds one to every token id inside forward: an out-of-range index made
    by the model, not held by the batch."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx + 1, targets)


class Lookup(torch.nn.Module):
    """A token embedding of the user's own: the case of this module is no nn.Embedding's."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


class LookupLM(torch.nn.Module):
    """A model whose token ids reach a custom Lookup module."""

    def __init__(self, vocab: int = 19, dim: int = 4) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.lookup = Lookup(vocab, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lookup(idx)
        return out


class ShiftedLabelsLM(TinyGPT):
    """A Hugging Face-style causal LM: the loss compares each position's logits with the
    next label (``labels[..., 1:]``), so the op gets a slice of the batch's labels."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(idx)
        assert targets is not None
        shifted = logits[:, :-1].reshape(-1, logits.size(-1))
        return F.cross_entropy(shifted, targets[:, 1:].reshape(-1))


class Table(torch.nn.Module):
    """A table of 5 rows indexed by the batch: index_select, plain indexing or gather."""

    def __init__(self, how: str = "select") -> None:
        super().__init__()
        self.how = how
        self.rows = torch.nn.Parameter(torch.randn(5, 2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.how == "select":
            return self.rows.index_select(0, idx)
        if self.how == "index":
            return self.rows[idx]
        return torch.gather(self.rows, 0, idx)


IDS = ["ex0041", "ex0042", "ex0043"]


def record(root: Path, model: torch.nn.Module, *args: torch.Tensor,
           narrow: bool = True) -> Path:
    """The cases a Recorder writes for one failing step of ``model``: the model's case, and
    its narrowed module and op cases beside it."""
    rec = Recorder(root, narrow=narrow)
    rec.watch(model)
    with pytest.raises((IndexError, RuntimeError)), rec.step(7, sample_ids=IDS):
        model(*args)
    assert rec.case_dir is not None
    return rec.case_dir


def tokens(bad: int = 19) -> torch.Tensor:
    return torch.tensor([[1, 2, 3], [4, bad, 5], [1, 1, 1]])


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A plain loop's loss: cross entropy over (B, T, V) logits, averaged where ``mask``."""
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           reduction="none")
    return (loss * mask.reshape(-1)).sum() / mask.sum()

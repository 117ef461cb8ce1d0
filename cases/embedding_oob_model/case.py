"""The model of the case: a token embedding and a vocabulary head, sized for the tokenizer
as it was before it grew a padding token."""

from __future__ import annotations

import torch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A token id >= vocab: an IndexError on the CPU, a device-side assert on CUDA
        # (Indexing.cu, `srcIndex < srcSelectDimSize`) reported at a later call.
        return self.head(self.emb(tokens))


def make_model(vocab: int, dim: int) -> TinyLM:
    """The factory the replay calls ([inputs.gpucase_module] factory = "case.py:make_model")."""
    return TinyLM(vocab, dim)

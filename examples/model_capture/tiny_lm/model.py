"""The model: character embedding, one self-attention layer, mean pooling, a linear head."""

from __future__ import annotations

import torch
from torch import nn

from . import data


class TokenEmbedding(nn.Embedding):
    """An embedding looked up by character code: the vocabulary maps codes to rows.

    The vocabulary is a non-persistent buffer built by the constructor, so a model
    rebuilt from this code (as a replay does) gets the vocabulary as the code builds it
    now, with the saved weights.
    """

    def __init__(self, alphabet: str, embedding_dim: int) -> None:
        super().__init__(len(alphabet), embedding_dim)
        self.alphabet = alphabet
        self.register_buffer("rows", data.build_vocab(alphabet), persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return super().forward(self.rows[codes])


class TinyLM(nn.Module):
    """Character codes (batch, length) in, one logit per class out."""

    def __init__(self, alphabet: str = data.ALPHABET, dim: int = 16,
                 classes: int = data.CLASSES) -> None:
        super().__init__()
        self.alphabet, self.dim, self.classes = alphabet, dim, classes
        self.embed = TokenEmbedding(alphabet, dim)
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.embed(codes)
        x, _ = self.attn(x, x, x, need_weights=False)
        out: torch.Tensor = self.head(x.mean(dim=1))
        return out

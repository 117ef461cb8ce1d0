"""Importable models and functions for tests/test_model_capture.py (a replay imports them)."""

from __future__ import annotations

from typing import Any

import torch


class TinyLM(torch.nn.Module):
    """An embedding and a linear head: a token id >= vocab raises inside the embedding."""

    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(grad).all():
            raise FloatingPointError("non-finite gradient reached Boom.backward")
        return grad * 2


class BackwardBoom(torch.nn.Module):
    """Raises in backward when the gradient that reaches it is not finite."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(self.lin(x))  # type: ignore[no-any-return]


def mixed_matmul(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bf16 activations times fp32 weights: fine under autocast, a dtype error without it."""
    return torch.mm(x, w)[rows]

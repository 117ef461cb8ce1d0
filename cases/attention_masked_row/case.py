"""Attention with a causal mask over left-padded sequences, as a decoder batches them."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    # The bug under test: a query whose every key is masked (a padding position of a
    # left-padded row sees only padding under the causal mask) softmaxes a row of -inf,
    # which is NaN, and the NaN reaches the loss through the next layer.
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return weights @ v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """The fix: a fully masked row attends to nothing and gives zeros (what
    torch.nn.functional.scaled_dot_product_attention returns for such a row)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    weights = weights.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return weights @ v

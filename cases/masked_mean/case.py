"""Mean pooling of token embeddings under a padding mask, as a sentence encoder does."""

from __future__ import annotations

import torch


def pool(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(x.dtype).unsqueeze(-1)
    # A row whose kept tokens are all padding (a short input cut to its first
    # tokens) would divide by zero: the first version of this function returned
    # NaN embeddings for it, which then poisoned the contrastive loss.
    count = weights.sum(dim=1).clamp_min(1.0)
    return (x * weights).sum(dim=1) / count

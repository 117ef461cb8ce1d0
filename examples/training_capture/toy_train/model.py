"""The model and its loss: a two-layer MLP with a 4-class head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import data

NUM_CLASSES = 4


class MLP(nn.Module):
    """Features in, one logit per class out."""

    def __init__(self, features: int = data.FEATURES, hidden: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                    nn.Linear(hidden, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the batch's annotation labels.

    The label mapping runs inside the loss on purpose: a captured case freezes the
    loss's inputs, so the code under suspicion must run inside the watched call for
    a fix to show in the replay.
    """
    return F.cross_entropy(logits, data.class_index(labels))

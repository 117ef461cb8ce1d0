"""The training step's loss, as the project now writes it: class indices checked first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytest_gpucase.checks import class_indices


def run(logits: torch.Tensor, target: torch.Tensor, num_classes: int,
        ignore_index: int) -> torch.Tensor:
    # On CUDA an out-of-range target is a device-side assert that poisons the
    # process; checking on the tensor's own device turns it into a clear ValueError.
    class_indices(target, num_classes, ignore_index=ignore_index)
    return F.cross_entropy(logits, target, ignore_index=ignore_index)

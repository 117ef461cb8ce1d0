"""A vocabulary lookup whose token ids come from a tokenizer with a larger vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytest_gpucase.checks import index_within


def lookup(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # Unchecked, an id >= table.shape[0] is an IndexError on the CPU but a
    # device-side assert (IndexKernel.cu) on CUDA, reported at a later call.
    index_within(tokens, table.shape[0], name="tokens")
    return F.embedding(tokens, table)

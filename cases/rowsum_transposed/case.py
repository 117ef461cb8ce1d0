"""A fast row sum that walks memory as if its input were contiguous."""

from __future__ import annotations

import torch


def row_sums(x: torch.Tensor) -> torch.Tensor:
    # The bug under test: reading the storage in row-major order is only right
    # for a contiguous input; a transposed view is silently summed by columns.
    flat = torch.as_strided(x, (x.shape[0], x.shape[1]), (x.shape[1], 1), x.storage_offset())
    return flat.sum(dim=1)


def reference(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=1)

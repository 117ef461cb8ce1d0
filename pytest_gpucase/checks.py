"""Data-contract checks for your own training code: each raises a ``ValueError`` naming the
offending values and positions (public; implemented in ``pytest_gpucase.tools.checks``)."""

from __future__ import annotations

from pytest_gpucase.tools.checks import (
    check_batch,
    class_indices,
    finite,
    index_within,
    load_contract,
    same_device,
)

__all__ = ["check_batch", "class_indices", "finite", "index_within", "load_contract",
           "same_device"]

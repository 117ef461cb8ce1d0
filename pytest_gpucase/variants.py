"""Edge variants of a case: last partial batch, short and long inputs, class-index boundaries.

``expand`` turns a case's ``[variants]`` tables into ``Variant`` values at
collection time (no tensor is read); ``apply`` builds a variant's inputs from
the saved ones inside the child. A variant never invents data: it takes the
first entries, repeats saved entries cyclically, or sets one class index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .case import Expectation, VariantTables

if TYPE_CHECKING:
    import torch


class VariantNotApplicable(Exception):
    """The saved inputs cannot give this variant (e.g. batch=8 of a 3-entry batch)."""


@dataclass(frozen=True)
class Variant:
    """One edge variant: its kind, the size or value it sets, and the outcome it must give."""

    kind: Literal["batch", "length", "boundary"]
    value: int
    axis: int = 0
    input: str | None = None          # boundary: the class-index input
    ignore_index: int | None = None   # boundary: entries equal to this are left alone
    reject: Expectation | None = None  # boundary: the value is out of range and must be rejected

    @property
    def label(self) -> str:
        """The id token, e.g. ``batch=1`` or ``boundary=4``."""
        return f"{self.kind}={self.value}"


def expand(tables: VariantTables) -> list[Variant]:
    """Every variant the case's ``[variants]`` tables ask for, in a stable order."""
    found: list[Variant] = []
    if tables.batch is not None:
        found += [Variant("batch", size, axis=tables.batch.axis) for size in tables.batch.sizes]
    if tables.length is not None:
        found += [Variant("length", size, axis=tables.length.axis) for size in tables.length.sizes]
    bounds = tables.boundaries
    if bounds is not None:
        accepted = [0, bounds.classes - 1]
        if bounds.ignore_index is not None:
            accepted.append(bounds.ignore_index)
        rejected = [-1, bounds.classes]
        seen: set[int] = set()
        for value, reject in [(v, None) for v in accepted] + [(v, tables.reject) for v in rejected]:
            if value in seen:
                continue
            seen.add(value)
            found.append(Variant("boundary", value, input=bounds.input,
                                 ignore_index=bounds.ignore_index, reject=reject))
    return found


def _saved_size(inputs: Mapping[str, Any], axis: int) -> int | None:
    """The batch size (or length) on ``axis``: that of the largest tensor input having the axis.

    The largest input is the data itself (activations, logits); parameters and
    targets are smaller, and only those sharing its size on ``axis`` are resized.
    """
    import torch

    tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.dim() > axis]
    if not tensors:
        return None
    return int(max(tensors, key=lambda t: t.numel()).shape[axis])


def apply(variant: Variant, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs of ``variant``, built from the saved ``inputs`` (which stay untouched)."""
    if variant.kind == "boundary":
        return _set_boundary(variant, inputs)
    import torch

    saved = _saved_size(inputs, variant.axis)
    if saved is None:
        raise VariantNotApplicable(f"{variant.label}: no tensor input has an axis {variant.axis}")
    if variant.kind == "batch" and variant.value > saved:
        raise VariantNotApplicable(
            f"{variant.label}: the saved batch holds {saved} entries on axis {variant.axis}")
    result = dict(inputs)
    for name, tensor in inputs.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() <= variant.axis:
            continue
        if tensor.shape[variant.axis] != saved:
            continue
        result[name] = _resize(tensor, variant.axis, variant.value)
    return result


def _resize(tensor: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Take the first ``size`` entries along ``axis``, repeating saved entries when longer."""
    import torch

    current = tensor.shape[axis]
    if size <= current:
        return tensor.narrow(axis, 0, size)
    index = torch.arange(size, device=tensor.device) % current
    return tensor.index_select(axis, index)


def _set_boundary(variant: Variant, inputs: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    name = variant.input
    target = inputs.get(name) if name is not None else None
    if not isinstance(target, torch.Tensor):
        raise VariantNotApplicable(f"{variant.label}: no tensor input named '{name}'")
    flat = target.reshape(-1)
    candidates = torch.arange(flat.numel(), device=flat.device)
    if variant.ignore_index is not None:
        candidates = candidates[flat != variant.ignore_index]
    if candidates.numel() == 0:
        raise VariantNotApplicable(f"{variant.label}: every entry of '{name}' is ignore_index")
    flat_index, position = int(candidates[0]), []
    for size in reversed(target.shape):
        position.append(flat_index % size)
        flat_index //= size
    changed = target.clone()  # keeps the saved strides
    changed[tuple(reversed(position))] = variant.value
    return {**inputs, name: changed}

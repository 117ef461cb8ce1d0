"""Edge variants of a case: last partial batch, short and long inputs, class-index boundaries.

``expand`` turns a case's ``[variants]`` tables into ``Variant`` values at
collection time (no tensor is read); ``apply`` builds a variant's inputs from
the saved ones inside the child. A variant never invents data: it takes the
first entries, repeats saved entries cyclically, or sets one class index. The
saved tensors are never written to.

Which inputs follow the axis of a ``batch`` or ``length`` variant
------------------------------------------------------------------
A case names the axis, not the inputs that carry it, so ``members`` reads them
off the shapes:

1. The saved size is that of one tensor, the *anchor*: the ``boundaries`` input
   when the case has one with that axis (a class-index target is per sample by
   construction), else the largest tensor input having the axis (the data:
   activations, logits).
2. A tensor input follows the axis when its sizes up to and including the axis
   equal the anchor's: a mask ``(B, T)`` follows ``x (B, T, D)`` on axis 1, a
   bias ``(T, T)`` does not.
3. Except a floating input of lower rank than the largest input whose shape is
   that input's trailing shape (a class weight ``(C,)`` beside logits
   ``(B, C)``, a LayerNorm weight ``(D,)``): it broadcasts over the batch
   rather than indexing it, and stays whole. This settles what sizes alone
   cannot, a batch as large as the class count (``B == C``). Integer and bool
   inputs (targets, masks, indices) are never taken for such parameters.

What shapes cannot tell stays ambiguous: a per-sample float weight ``(B,)``
beside logits ``(B, B)`` is taken for a class weight, and a linear weight
``(B, D)`` beside ``x (B, D)`` follows the batch.

``batch = k`` takes the first ``k`` entries of every member (``k`` larger than
the saved batch is not applicable); ``length = n`` takes the first ``n``, or
repeats the saved entries cyclically up to ``n``. Both are views or gathers of
the saved tensors, which keep their strides where the size is not larger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .case import MAX_VARIANT_ELEMENTS, Expectation, VariantTables

if TYPE_CHECKING:
    import torch


# The variant kinds, in the order a case's items list them; one home (markers read it).
VARIANT_KINDS: tuple[Literal["batch", "length", "boundary"], ...] = ("batch", "length",
                                                                      "boundary")


class VariantNotApplicable(Exception):
    """The saved inputs cannot give this variant (e.g. batch=8 of a 3-entry batch)."""


class VariantTooLarge(ValueError):
    """The variant's resized inputs would hold more than ``MAX_VARIANT_ELEMENTS`` elements."""


# A tensor input as the rules see it: its shape, and whether it is floating (or complex).
Shape = tuple[tuple[int, ...], bool]


@dataclass(frozen=True)
class Variant:
    """One edge variant: its kind, the size or value it sets, and the outcome it must give."""

    kind: Literal["batch", "length", "boundary"]
    value: int
    axis: int = 0
    input: str | None = None          # boundary: the class-index input; batch/length: the anchor
    ignore_index: int | None = None   # boundary: entries equal to this are left alone
    reject: Expectation | None = None  # boundary: the value is out of range and must be rejected

    @property
    def label(self) -> str:
        """The variant in words, as reports show it: ``batch=1``, ``boundary=-1``."""
        return f"{self.kind}={self.value}"

    @property
    def id(self) -> str:
        """The item-id token, ``batch[1]``, ``boundary[-1]``: only characters ``-k`` accepts,
        and closed by ``]`` so that ``-k "boundary[-1]"`` never also selects ``boundary[-100]``."""
        return f"{self.kind}[{self.value}]"


def expand(tables: VariantTables) -> list[Variant]:
    """Every variant the case's ``[variants]`` tables ask for, in a stable order.

    Batch sizes, then lengths, as listed; then the boundaries: accepted values
    ``0``, ``classes - 1`` and ``ignore_index``, then rejected ones ``-1`` and
    ``classes``, each value once (the first role wins: ``ignore_index = -1`` is
    accepted). Rejected values need ``[variants] reject`` to say how they fail.
    """
    bounds = tables.boundaries
    anchor = bounds.input if bounds is not None else None
    found: list[Variant] = []
    if tables.batch is not None:
        found += [Variant("batch", size, axis=tables.batch.axis, input=anchor)
                  for size in tables.batch.sizes]
    if tables.length is not None:
        found += [Variant("length", size, axis=tables.length.axis, input=anchor)
                  for size in tables.length.sizes]
    if bounds is None:
        return found
    values: list[tuple[int, Expectation | None]] = [(0, None), (bounds.classes - 1, None)]
    if bounds.ignore_index is not None:
        values.append((bounds.ignore_index, None))
    if tables.reject is not None:
        values += [(-1, tables.reject), (bounds.classes, tables.reject)]
    seen: set[int] = set()
    for value, reject in values:
        if value not in seen:
            seen.add(value)
            found.append(Variant("boundary", value, input=bounds.input,
                                 ignore_index=bounds.ignore_index, reject=reject))
    return found


def members(inputs: Mapping[str, Any], axis: int,
            anchor: str | None = None) -> tuple[int, tuple[str, ...]] | None:
    """The saved size on ``axis`` and the tensor inputs that follow it (rules in the module doc).

    ``anchor`` names the input whose size is the saved size (the boundaries
    input); ``None`` when no tensor input has the axis.
    """
    return members_of(shapes_of(inputs), axis, anchor)


def shapes_of(inputs: Mapping[str, Any]) -> dict[str, Shape]:
    """The tensor inputs as ``members_of`` sees them."""
    import torch

    return {name: (tuple(t.shape), t.is_floating_point() or t.is_complex())
            for name, t in inputs.items() if isinstance(t, torch.Tensor)}


def members_of(shapes: Mapping[str, Shape], axis: int,
               anchor: str | None = None) -> tuple[int, tuple[str, ...]] | None:
    """``members`` from shapes alone, as a payload's header gives them (no tensor read)."""
    having = {name: shape for name, shape in shapes.items() if len(shape[0]) > axis}
    if not having:
        return None
    largest = max(having.values(), key=lambda shape: (_numel(shape[0]), len(shape[0])))[0]
    base = anchor if anchor is not None and anchor in having else next(
        name for name, shape in having.items() if shape[0] == largest)
    lead = having[base][0][:axis + 1]

    def follows(name: str) -> bool:
        if name == base:
            return True
        shape, floating = having[name]
        if shape[:axis + 1] != lead:
            return False
        parameter = (floating and len(shape) < len(largest)
                     and shape == largest[len(largest) - len(shape):])
        return not parameter

    return int(lead[axis]), tuple(name for name in having if follows(name))


def resized_elements(variant: Variant, shapes: Mapping[str, Shape]) -> int:
    """Elements the resized inputs of a ``batch`` or ``length`` variant hold, all together."""
    found = members_of(shapes, variant.axis, variant.input)
    if variant.kind == "boundary" or found is None or found[0] == 0:
        return 0
    saved, names = found
    return sum(_numel(shapes[name][0]) // saved * variant.value for name in names)


def check_size(variant: Variant, shapes: Mapping[str, Shape]) -> None:
    """Raise ``VariantTooLarge`` when the variant's inputs are over ``MAX_VARIANT_ELEMENTS``."""
    total = resized_elements(variant, shapes)
    if total > MAX_VARIANT_ELEMENTS:
        raise VariantTooLarge(f"{variant.label}: the resized inputs would hold {total} elements, "
                              f"over the limit of {MAX_VARIANT_ELEMENTS}; try a smaller size")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def apply(variant: Variant, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs of ``variant``, built from the saved ``inputs`` (which stay untouched).

    Raises ``VariantTooLarge`` before any allocation when the resized inputs
    would be over ``MAX_VARIANT_ELEMENTS``.
    """
    if variant.kind == "boundary":
        return _set_boundary(variant, inputs)
    shapes = shapes_of(inputs)
    found = members_of(shapes, variant.axis, variant.input)
    if found is None:
        raise VariantNotApplicable(f"{variant.label}: no tensor input has an axis {variant.axis}")
    saved, names = found
    if variant.kind == "batch" and variant.value > saved:
        raise VariantNotApplicable(
            f"{variant.label}: the saved batch holds {saved} entries on axis {variant.axis}")
    if saved == 0:
        raise VariantNotApplicable(
            f"{variant.label}: the saved inputs are empty on axis {variant.axis}")
    check_size(variant, shapes)
    return {**inputs, **{name: _resize(inputs[name], variant.axis, variant.value)
                         for name in names}}


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
    if name is None or not isinstance(target, torch.Tensor):
        raise VariantNotApplicable(f"{variant.label}: no tensor input named '{name}'")
    if target.dtype == torch.bool or target.is_complex():
        raise VariantNotApplicable(f"{variant.label}: '{name}' holds {target.dtype}, "
                                   "not class indices")
    if not target.is_floating_point():
        info = torch.iinfo(target.dtype)
        if not info.min <= variant.value <= info.max:
            # Assigning would wrap silently (uint8: -1 becomes 255) and test another value.
            raise VariantNotApplicable(f"{variant.label}: '{name}' is {target.dtype}, which "
                                       f"cannot hold {variant.value}")
    if target.numel() == 0:
        raise VariantNotApplicable(f"{variant.label}: '{name}' is empty")
    flat = target.reshape(-1)
    candidates = torch.arange(flat.numel(), device=flat.device)
    if variant.ignore_index is not None:
        candidates = candidates[flat != variant.ignore_index]
    if candidates.numel() == 0:
        raise VariantNotApplicable(f"{variant.label}: every entry of '{name}' is ignore_index "
                                   f"({variant.ignore_index})")
    flat_index, position = int(candidates[0]), []
    for size in reversed(target.shape):
        position.append(flat_index % size)
        flat_index //= size
    changed = _copy_keeping_layout(target)
    changed[tuple(reversed(position))] = variant.value
    return {**inputs, name: changed}


def _copy_keeping_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape, strides and storage offset, sharing no memory with ``tensor``.

    A view whose elements overlap (an expanded target) is copied contiguously
    instead: setting one of its entries would set every entry sharing the memory.
    """
    import torch

    if _overlaps(tensor):
        return tensor.clone(memory_format=torch.contiguous_format)
    whole = tensor.untyped_storage().nbytes() // tensor.element_size()
    storage = tensor.as_strided((whole,), (1,), 0).clone()
    return storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether two indices may reach one element (a sufficient test for "they do not")."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(),
                                                          strict=True) if size > 1)
    reach = 0  # the furthest element reached by the dims of smaller stride
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False

"""Data-contract checks to call in training code before the values reach a kernel."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from pytest_gpucase.base.tensors import named_tensors

__all__ = ["class_indices", "finite", "index_within", "same_device"]

# Offenders named in a message; the total count is always given.
_SHOWN = 10
# Tensor names listed per device in a same_device message before "and N more".
_NAMES_PER_DEVICE = 5


def class_indices(target: torch.Tensor, num_classes: int, ignore_index: int = -100) -> None:
    """Raise ValueError unless target is a 1-D batch of class indices that a loss can take."""
    __tracebackhide__ = True
    _require_tensor("target", target)
    _require_positive("num_classes", num_classes)
    # cross_entropy and nll_loss take int64 or uint8 targets on CPU and CUDA alike; int32 is
    # rejected on CPU and has no CUDA kernel, so it fails here rather than mid-step.
    if target.dtype not in (torch.int64, torch.uint8):
        raise ValueError(f"target must hold class indices as int64 (long); found {target.dtype}")
    if target.dim() != 1:
        raise ValueError(
            f"target must be 1-D (one class index per sample); found shape {_shape(target)}"
        )
    if target.numel() == 0:
        raise ValueError(
            "target is empty: the loss would be NaN (reduction='mean') or 0 (reduction='sum')"
        )
    values = target.long()
    kept = values != ignore_index
    bad = kept & ((values < 0) | (values >= num_classes))
    # One device-to-host transfer of two counts: cheap, and on CUDA it runs before any loss
    # kernel could assert.
    kept_count, bad_count = (int(n) for n in torch.stack((kept.sum(), bad.sum())).tolist())
    if bad_count:
        where = bad.nonzero().squeeze(1)[:_SHOWN]
        shown = torch.stack((values[where], where)).tolist()
        offenders = ", ".join(f"{v} at position {p}" for v, p in zip(*shown, strict=True))
        raise ValueError(
            f"target holds {_count(bad_count, 'value')} out of range [0, {num_classes}) "
            f"(ignore_index={ignore_index}): {offenders}{_more(bad_count)}"
        )
    if kept_count == 0:
        raise ValueError(
            f"target holds only ignore_index ({ignore_index}) in all "
            f"{_count(target.numel(), 'entry', 'entries')}: the loss would be NaN "
            "(reduction='mean') or 0 (reduction='sum')"
        )


def index_within(index: torch.Tensor, size: int, *, name: str = "index") -> None:
    """Raise ValueError unless every entry of an integer index tensor lies in [0, size)."""
    __tracebackhide__ = True
    _require_tensor(name, index)
    _require_positive("size", size)
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise ValueError(f"{name} must be an integer tensor; found {index.dtype}")
    bad = (index < 0) | (index >= size)
    bad_count = int(bad.sum().item())
    if not bad_count:
        return
    if index.dim() == 0:
        raise ValueError(f"{name} is {int(index.item())}, out of range [0, {size})")
    where = bad.nonzero()[:_SHOWN]
    values = index[tuple(where.t())].tolist()
    offenders = ", ".join(f"{v} at {_at(p)}" for v, p in zip(values, where.tolist(), strict=True))
    raise ValueError(
        f"{name} holds {_count(bad_count, 'value')} out of range [0, {size}): "
        f"{offenders}{_more(bad_count)}"
    )


def same_device(**tensors: object) -> None:
    """Raise ValueError unless every named tensor (in lists, dicts or modules) is on one device."""
    __tracebackhide__ = True
    by_device: dict[torch.device, list[str]] = {}
    for name, tensor in _named_tensors(tensors):
        by_device.setdefault(tensor.device, []).append(name)
    if len(by_device) <= 1:
        return
    parts: list[str] = []
    for device, names in by_device.items():
        parts.extend(f"{name} on {device}" for name in names[:_NAMES_PER_DEVICE])
        if len(names) > _NAMES_PER_DEVICE:
            parts.append(f"and {len(names) - _NAMES_PER_DEVICE} more on {device}")
    raise ValueError(f"tensors on different devices: {', '.join(parts)}")


def finite(**tensors: object) -> None:
    """Raise ValueError naming each given tensor (in lists, dicts or modules) that holds NaN/inf."""
    __tracebackhide__ = True
    problems = [
        problem
        for name, tensor in _named_tensors(tensors)
        if (problem := _non_finite(name, tensor)) is not None
    ]
    if problems:
        raise ValueError("; ".join(problems))


def _non_finite(name: str, tensor: torch.Tensor) -> str | None:
    # Integer and bool tensors cannot hold NaN; meta tensors hold no values to look at.
    if tensor.is_meta or not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    nan_count, inf_count = (
        int(n) for n in torch.stack((tensor.isnan().sum(), tensor.isinf().sum())).tolist()
    )
    if not (nan_count or inf_count):
        return None
    if tensor.dim() == 0:
        return f"{name} is {tensor.item()}"
    kinds = " and ".join(
        f"{count} {kind}" for count, kind in ((nan_count, "NaN"), (inf_count, "inf")) if count
    )
    where = (~tensor.isfinite()).nonzero()[:_SHOWN]
    values = tensor[tuple(where.t())].tolist()
    offenders = ", ".join(f"{v} at {_at(p)}" for v, p in zip(values, where.tolist(), strict=True))
    return (
        f"{name} holds {kinds} (of {tensor.numel()} values): "
        f"{offenders}{_more(nan_count + inf_count)}"
    )


def _named_tensors(items: Mapping[str, object]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor with the path a user would write to reach it; other values are skipped."""
    for name, item in items.items():
        yield from named_tensors(item, name, sequences=(Sequence,), modules=True)


def _require_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _at(position: list[int]) -> str:
    if len(position) == 1:
        return f"position {position[0]}"
    return str(tuple(position))


def _count(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n} {singular if n == 1 else (plural or singular + 's')}"


def _more(total: int) -> str:
    return f" (first {_SHOWN} shown)" if total > _SHOWN else ""

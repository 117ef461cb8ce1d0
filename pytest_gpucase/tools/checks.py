"""Data-contract checks to call in training code before the values reach a kernel."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pytest_gpucase.base.tensors import named_tensors

__all__ = ["CONTRACT_FORMAT", "check_batch", "class_indices", "finite", "index_within",
           "load_contract", "same_device"]

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


# The version of a data contract file (``gpucase data-check`` writes them; docs/recorder.md).
CONTRACT_FORMAT = 1
_FIELD_KEYS = ("dtype", "min", "max", "allowed", "reason")


def load_contract(contract: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A data contract's fields (name -> rule), read from its TOML file or taken as a mapping
    already read; ValueError naming the file, the key and the fix when it is not one."""
    where = "the contract"
    if isinstance(contract, Mapping):
        doc: Mapping[str, Any] = contract
    else:
        where = os.fspath(contract)
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            doc = tomllib.loads(Path(where).read_text(encoding="utf-8"))
        except (OSError, UnicodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{where}: not a readable data contract: {exc}") from None
    if doc.get("format", CONTRACT_FORMAT) != CONTRACT_FORMAT:
        raise ValueError(f"{where}: format {doc.get('format')!r} is not {CONTRACT_FORMAT}, the "
                         "one this version reads; upgrade pytest-gpucase")
    fields = doc.get("fields")
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError(f"{where}: no [fields.NAME] table; write one per checked tensor, "
                         "e.g. [fields.idx] min = 0, max = 18")
    for name, rule in fields.items():
        if not isinstance(rule, Mapping):
            raise ValueError(f"{where}: fields.{name} must be a table (min, max, allowed)")
        unknown = sorted(set(rule) - set(_FIELD_KEYS))
        if unknown:
            raise ValueError(f"{where}: fields.{name}: unknown key {unknown[0]!r}; the keys are "
                             f"{', '.join(_FIELD_KEYS)}")
        for key in ("min", "max"):
            if key in rule and (isinstance(rule[key], bool) or not isinstance(rule[key], int)):
                raise ValueError(f"{where}: fields.{name}.{key} must be an integer")
        allowed = rule.get("allowed", [])
        if not isinstance(allowed, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in allowed):
            raise ValueError(f"{where}: fields.{name}.allowed must be a list of integers")
    return {str(name): dict(rule) for name, rule in fields.items()}


def check_batch(batch: Mapping[str, object] | Sequence[object] | torch.Tensor,
                contract: str | os.PathLike[str] | Mapping[str, Any], *,
                sample_ids: Sequence[object] | None = None) -> None:
    """Raise ValueError unless every tensor the contract names holds integers within its
    range (``min``..``max``, or one of ``allowed``: an ignore_index), naming each offending
    value, its position and, with ``sample_ids`` (one per entry of the first axis), its
    sample. ``batch``: the batch as the DataLoader yields it, whose tensors the contract
    names by their key paths (``targets``; ``1`` for the second item of a tuple,
    ``inputs.ids`` nested), or a dict of the tensors by those names, or one tensor for a
    contract of one field; ``contract``: the TOML file ``gpucase data-check`` wrote, or its
    fields."""
    __tracebackhide__ = True
    fields = load_contract(contract)
    if isinstance(batch, torch.Tensor):
        if len(fields) != 1:
            raise TypeError(f"the contract names {', '.join(fields)}: pass a dict of these "
                            "tensors, e.g. {" + ", ".join(f"{n!r}: ..." for n in fields) + "}")
        batch = {next(iter(fields)): batch}
    if not isinstance(batch, Mapping | list | tuple):
        raise TypeError("batch must be the batch as the DataLoader yields it (a dict, tuple "
                        "or list) or a dict of tensors by the contract's names (e.g. "
                        f"{{{next(iter(fields))!r}: x}}); got {type(batch).__name__}")
    problems = []
    for name, rule in fields.items():
        value = _at_path(batch, name)
        if value is _MISSING:
            has = (", ".join(map(str, batch)) if isinstance(batch, Mapping)
                   else f"items 0..{len(batch) - 1}" if batch else "") or "nothing"
            raise ValueError(f"batch has no {name!r} (it has {has}); give the tensors the "
                             "contract's names")
        problem = _outside(name, value, rule, sample_ids)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ValueError("; ".join(problems))


_MISSING = object()


def _at_path(batch: Mapping[str, object] | Sequence[object], name: str) -> object:
    """The value at the key path ``name`` (``targets``, ``1``, ``inputs.ids``): a key of a
    dict first as a whole, else dot-separated steps through dicts, tuples and lists."""
    if isinstance(batch, Mapping) and name in batch:
        return batch[name]
    value: object = batch
    for step in name.split("."):
        if isinstance(value, Mapping) and step in value:
            value = value[step]
        elif (isinstance(value, list | tuple) and step.isdigit()
              and int(step) < len(value)):
            value = value[int(step)]
        else:
            return _MISSING
    return value


def _outside(name: str, tensor: object, rule: Mapping[str, Any],
             sample_ids: Sequence[object] | None) -> str | None:
    _require_tensor(name, tensor)
    assert isinstance(tensor, torch.Tensor)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        return (f"{name} must hold integers ({rule.get('dtype', 'an integer dtype')}); found "
                f"{tensor.dtype}")
    values = tensor.detach().long()
    bad = torch.zeros_like(values, dtype=torch.bool)
    if "min" in rule:
        bad |= values < int(rule["min"])
    if "max" in rule:
        bad |= values > int(rule["max"])
    for allowed in rule.get("allowed", []):
        bad &= values != int(allowed)
    count = int(bad.sum())
    if not count:
        return None
    if values.dim() == 0:
        offenders = f"{int(values)}"
    else:
        where = bad.nonzero()[:_SHOWN]
        shown = values[tuple(where.t())].tolist()
        ids = list(sample_ids) if sample_ids is not None else []
        offenders = ", ".join(
            f"{v} at {_at(p)}" + (f" (sample {ids[p[0]]})" if len(ids) == values.shape[0]
                                  else "")
            for v, p in zip(shown, where.tolist(), strict=True))
    low, high = rule.get("min", "-inf"), rule.get("max", "inf")
    valid = f"{low}..{high}" + "".join(f" or {v}" for v in rule.get("allowed", []))
    reason = f" ({rule['reason']})" if rule.get("reason") else ""
    return (f"{name} holds {_count(count, 'value')} outside {valid}{reason}: "
            f"{offenders}{_more(count)}")


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

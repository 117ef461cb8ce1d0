"""Tensors a safetensors file cannot hold as they are, held exactly as plain parts.

safetensors holds strided tensors of its dtypes. The other kinds a model's state or a call's
inputs may hold have exact plain forms, each part a strided tensor a payload stores as any
other (its layout, the store), named ``<name>::<part>``:

- a complex tensor of a dtype safetensors lacks (complex128, complex32): its real view
  (``torch.view_as_real``, the last axis real and imaginary), which keeps its layout;
- a sparse COO tensor: ``indices`` and ``values``, with its size and whether it is
  coalesced; a sparse CSR one: ``crow_indices``, ``col_indices`` and ``values``;
- a quantized tensor: its integers (``int_repr``) with its scale and zero point, or, per
  channel, ``scales`` and ``zero_points`` tensors and its axis.

The payload's metadata (``KINDS_KEY``) says which names are so held, and how; loading
joins the parts again. A part may itself be a kind (complex values of a sparse tensor).
What has no exact form here (a nested tensor, a meta tensor, a tensor subclass, a packed
quantized dtype) is named by ``unstorable``, so that its case says it was not saved.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS_KEY", "PART", "join", "kind_of", "split", "unstorable"]

KINDS_KEY = "gpucase.kinds"
PART = "::"
_COMPLEX = ("complex128", "complex32")
_QUANTIZED = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def kind_of(tensor: torch.Tensor) -> str | None:
    """``"complex"``, ``"sparse_coo"``, ``"sparse_csr"`` or ``"quantized"`` for a tensor this
    module holds as parts; None for any other (a plain one, or one ``unstorable`` names)."""
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_nested:
        return None
    if tensor.device.type == "meta":
        return None
    if tensor.layout == torch.sparse_coo:
        return "sparse_coo"
    if tensor.layout == torch.sparse_csr:
        return "sparse_csr"
    if tensor.layout != torch.strided:
        return None
    if tensor.is_quantized:
        scheme = tensor.qscheme()
        plain = _dtype_name(tensor.dtype) in _QUANTIZED
        return "quantized" if plain and scheme in (torch.per_tensor_affine,
                                                   torch.per_channel_affine) else None
    if _dtype_name(tensor.dtype) in _COMPLEX:
        return "complex"
    return None


def unstorable(tensor: Any, dtypes: frozenset[str] | set[str]) -> str | None:
    """Why a payload cannot hold ``tensor`` exactly (its kind, layout or dtype, in words), or
    None when it can: as it is (strided, of one of ``dtypes``) or as parts (``kind_of``)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return f"a {type(tensor).__qualname__}, not a tensor"
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(tensor).__qualname__} (a tensor subclass), {_dtype_name(tensor.dtype)}"
    if tensor.is_nested:
        return f"a nested tensor of {_dtype_name(tensor.dtype)}"
    if tensor.device.type == "meta":
        return f"a meta tensor of {_dtype_name(tensor.dtype)}: it has a shape but no values"
    if kind_of(tensor) is not None:
        return None
    if tensor.layout != torch.strided:
        return f"a {_dtype_name(tensor.layout)} tensor of {_dtype_name(tensor.dtype)}"
    if tensor.is_quantized:
        return (f"a quantized tensor of {_dtype_name(tensor.dtype)}, "
                f"{_dtype_name(tensor.qscheme())}")
    if _dtype_name(tensor.dtype) not in dtypes:
        return f"a tensor of {_dtype_name(tensor.dtype)}"
    return None


def split(tensors: Mapping[str, torch.Tensor],
          ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """``tensors`` with each one of a kind replaced by its plain parts, and what each such name
    holds (for ``KINDS_KEY``); parts of a kind are split again."""
    plain: dict[str, torch.Tensor] = {}
    kinds: dict[str, dict[str, Any]] = {}
    pending = list(tensors.items())
    while pending:
        name, tensor = pending.pop(0)
        found = _parts(tensor) if isinstance(tensor, _torch().Tensor) else None
        if found is None:
            plain[name] = tensor
            continue
        described, parts = found
        kinds[name] = described
        pending.extend((f"{name}{PART}{part}", value) for part, value in parts.items())
    return plain, kinds


def _torch() -> Any:
    import torch

    return torch


def _parts(tensor: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    torch = _torch()
    kind = kind_of(tensor)
    if kind is None:
        return None
    tensor = tensor.detach()
    if kind == "complex":
        return ({"kind": kind, "dtype": _dtype_name(tensor.dtype)},
                {"real": torch.view_as_real(tensor.resolve_conj().resolve_neg())})
    if kind == "sparse_coo":
        return ({"kind": kind, "size": list(tensor.shape), "coalesced": tensor.is_coalesced()},
                {"indices": tensor._indices(), "values": tensor._values()})
    if kind == "sparse_csr":
        return ({"kind": kind, "size": list(tensor.shape)},
                {"crow_indices": tensor.crow_indices(), "col_indices": tensor.col_indices(),
                 "values": tensor.values()})
    described: dict[str, Any] = {"kind": kind, "dtype": _dtype_name(tensor.dtype)}
    parts = {"int_repr": tensor.int_repr()}
    if tensor.qscheme() == torch.per_tensor_affine:
        described.update(scale=float(tensor.q_scale()), zero_point=int(tensor.q_zero_point()))
    else:
        described["axis"] = int(tensor.q_per_channel_axis())
        parts["scales"] = tensor.q_per_channel_scales()
        parts["zero_points"] = tensor.q_per_channel_zero_points()
    return described, parts


def join(tensors: dict[str, torch.Tensor], text: str) -> dict[str, torch.Tensor]:
    """The tensors a payload held, its parts joined again as ``text`` (the ``KINDS_KEY``
    metadata) says; ValueError, in words, when they cannot be."""
    try:
        kinds = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"metadata '{KINDS_KEY}' is not JSON ({exc})") from None
    if not isinstance(kinds, dict) or not all(isinstance(v, dict) for v in kinds.values()):
        raise ValueError(f"metadata '{KINDS_KEY}' is not a JSON object of objects")
    tensors = dict(tensors)
    # The longest names first: a part's own parts are joined before the part is used.
    for name in sorted(kinds, key=len, reverse=True):
        prefix = f"{name}{PART}"
        parts = {key[len(prefix):]: tensors.pop(key) for key in list(tensors)
                 if key.startswith(prefix) and PART not in key[len(prefix):]}
        try:
            tensors[name] = _joined(kinds[name], parts)
        except Exception as exc:
            raise ValueError(f"tensor '{name}': its {kinds[name].get('kind')} parts "
                             f"({', '.join(sorted(parts)) or 'none'}) cannot be joined "
                             f"({type(exc).__name__}: {exc})") from None
    return tensors


def _joined(described: Mapping[str, Any], parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    torch = _torch()
    kind = described.get("kind")
    if kind == "complex":
        dtype = described.get("dtype")
        if dtype not in _COMPLEX:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_COMPLEX)}")
        real = parts["real"]
        joined = torch.view_as_complex(real)
        if _dtype_name(joined.dtype) != dtype:
            raise ValueError(f"its real view of {_dtype_name(real.dtype)} makes "
                             f"{_dtype_name(joined.dtype)}, not {dtype}")
        return joined
    if kind == "sparse_coo":
        return torch.sparse_coo_tensor(parts["indices"], parts["values"],
                                       _size(described), check_invariants=True,
                                       is_coalesced=bool(described.get("coalesced")))
    if kind == "sparse_csr":
        return torch.sparse_csr_tensor(parts["crow_indices"], parts["col_indices"],
                                       parts["values"], _size(described), check_invariants=True)
    if kind == "quantized":
        dtype = described.get("dtype")
        ints = parts["int_repr"]
        if _QUANTIZED.get(str(dtype)) != _dtype_name(ints.dtype):
            raise ValueError(f"{dtype!r} is not held as {_dtype_name(ints.dtype)}")
        if "axis" in described:
            return torch._make_per_channel_quantized_tensor(
                ints.contiguous(), parts["scales"], parts["zero_points"], int(described["axis"]))
        return torch._make_per_tensor_quantized_tensor(
            ints.contiguous(), float(described["scale"]), int(described["zero_point"]))
    raise ValueError(f"unknown kind {kind!r}")


def _size(described: Mapping[str, Any]) -> list[int]:
    size = described.get("size")
    if not isinstance(size, list) or not all(isinstance(n, int) and n >= 0 for n in size):
        raise ValueError(f"size {size!r} is not a list of sizes >= 0")
    return size

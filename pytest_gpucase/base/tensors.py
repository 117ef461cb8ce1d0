"""Tensors in nested values, named by their paths; facts about one tensor read without a copy.

The one walk over nested outputs (dicts, lists, tuples of tensors) is ``named_tensors``;
nothing here imports torch at module level.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

__all__ = [
    "dotted", "field_names", "indexed", "is_tensor", "named_tensors", "nbytes", "readable_address",
    "tensor_versions", "tensors_in", "tuple_fields",
]


def dotted(prefix: str, key: object) -> str:
    """``out.0.logits``: the names of a state dict."""
    return f"{prefix}.{key}" if prefix else str(key)


def indexed(prefix: str, key: object) -> str:
    """``out['logits'][0]``: the names a user would write to reach the value."""
    return f"{prefix}[{key!r}]"


def named_tensors(value: object, prefix: str = "",
                  name: Callable[[str, object], str] = indexed,
                  sequences: tuple[type, ...] = (list, tuple), *,
                  modules: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested mappings and sequences, with its path (``name`` spells it).

    ``sequences`` are the types walked into by position (any ``Sequence`` for
    checks, lists and tuples elsewhere); with ``modules``, an ``nn.Module``
    gives its parameters and buffers as ``prefix.path``.
    """
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif modules and isinstance(value, torch.nn.Module):
        for path, tensor in (*value.named_parameters(), *value.named_buffers()):
            yield f"{prefix}.{path}", tensor
    elif type(value) is dict or isinstance(value, Mapping):  # a dict: no ABC asked
        for key, item in value.items():
            yield from named_tensors(item, name(prefix, key), name, sequences, modules=modules)
    elif isinstance(value, sequences) and not isinstance(value, (str, bytes)):
        for position, item in enumerate(cast("Iterable[object]", value)):
            yield from named_tensors(item, name(prefix, position), name, sequences,
                                     modules=modules)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of storage the view reaches: what a copy to the host moves (a sparse tensor's:
    its indices' and values')."""
    layout = str(tensor.layout)
    if layout == "torch.sparse_coo":
        return nbytes(tensor._indices()) + nbytes(tensor._values())
    if layout in ("torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr", "torch.sparse_bsc"):
        return sum(nbytes(part) for part in (*_compressed(tensor), tensor.values()))
    if tensor.numel() == 0:
        return 0
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    span = 1 + sum((int(size) - 1) * int(step) for size, step in pairs)
    return (int(tensor.storage_offset()) + span) * tensor.element_size()


def _compressed(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two index tensors of a compressed sparse tensor (rows or columns first)."""
    if str(tensor.layout) in ("torch.sparse_csr", "torch.sparse_bsr"):
        return tensor.crow_indices(), tensor.col_indices()
    return tensor.ccol_indices(), tensor.row_indices()


def tensor_versions(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Each tensor's version counter by ``id``: a read, what an in-place change increments
    (an inference tensor has none, and is left out)."""
    found: dict[int, int] = {}
    for tensor in tensors:
        try:  # noqa: SIM105 - no context manager to run per tensor
            found[id(tensor)] = int(tensor._version)
        except RuntimeError:
            pass
    return found


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor, without importing torch (nothing is, until it is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in nested mappings, lists and tuples, in ``named_tensors``' order."""
    if is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def tuple_fields(x: object) -> tuple[str, ...] | None:
    """A named tuple's fields: a declared type, compared (and stored) with its class."""
    fields = getattr(type(x), "_fields", None)
    if isinstance(x, tuple) and isinstance(fields, tuple):
        return tuple(str(f) for f in fields)
    return None


def field_names(x: object) -> tuple[str, ...] | None:
    """The names that spell the items of tuple ``x`` on a path (``out.values``): a named
    tuple's fields, or a structseq's (``torch.return_types.max``, ``os.stat_result``), which
    has no ``_fields`` but lists its named items in ``__match_args__``; None for a plain
    tuple, or a structseq with an unnamed item (its names would not line up)."""
    fields = tuple_fields(x)
    if fields is not None or not isinstance(x, tuple):
        return fields
    cls = type(x)
    names = getattr(cls, "__match_args__", None)
    if (isinstance(names, tuple) and len(names) == len(x)
            and getattr(cls, "n_sequence_fields", None) == len(x)
            and all(isinstance(name, str) and name.isidentifier() for name in names)):
        return names
    return None


def readable_address(tensor: torch.Tensor, nbytes: int) -> int | None:
    """The address of ``tensor``'s ``nbytes`` of values, or None when it has no readable
    memory of that size: a tensor type C++ builds without storage (zero tensors,
    functionalized or functorch-wrapped ones) has a null or unreadable pointer, and a
    storage resized under its view (``untyped_storage().resize_(0)``) is too small."""
    try:
        address = tensor.data_ptr()
        storage = tensor.untyped_storage()
        start = tensor.storage_offset() * tensor.element_size()
        if address == 0 or storage.data_ptr() == 0 or start + nbytes > storage.nbytes():
            return None
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return int(address)

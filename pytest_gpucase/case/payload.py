"""Tensors on disk with their exact layout: dtype, shape, stride, storage offset and values.

A payload is a plain ``safetensors`` file. A tensor whose view is plain (C
contiguous, at offset 0 of its storage, no conjugate or negative bit) is stored
as it is, in its own shape, so that any safetensors reader sees it as it was
saved. safetensors stores contiguous tensors only, so any other view is stored
as the flat run of its storage that it reads, ``[storage_offset, storage_offset
+ extent)``, and its view (shape, stride, storage offset) is kept in the file's
metadata under ``gpucase.layout``, with ``stored_from`` saying where the stored
run begins in the original storage; one file may hold both kinds. Loading
rebuilds the very same view with ``as_strided`` over a storage whose first
``stored_from`` elements are zeros: the offset (and so the alignment kernels
see) is exact, and the file holds nothing the view does not read, so a slice
of a batch never carries the other samples. A payload written by plain
``safetensors.torch.save_file`` (no layout) loads as the contiguous tensors it
holds, and so do files of earlier versions, which stored every tensor flat with
a layout entry. Nothing here goes through pickle.

The file is written here rather than by ``safetensors.torch.save_file``, whose
metadata map is written in a random order: the same tensors must give the same
bytes, so that ``content_hash`` is stable and a regenerated case does not show
up as changed. safetensors itself reads the files back (``load``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.errors import CaseFormatError, link_inside, printable, regular_file
from pytest_gpucase.base.files import NotRegularFile, open_regular, read_head, stat_signature
from pytest_gpucase.base.files import (
    write_atomic as _write_atomic,  # a module name: tests slow it down
)
from pytest_gpucase.base.tensors import readable_address
from pytest_gpucase.case import kinds

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "LAYOUT_KEY", "STORE_DIR", "STORE_FROM", "STORE_KEY", "TensorInfo",
           "content_hash", "describe", "encode", "load", "load_small", "read_header", "readable",
           "save", "store_files", "store_info", "to_device", "unstorable"]

LAYOUT_KEY = "gpucase.layout"
# Tensors a payload names in the store of its capture folder instead of holding them: the
# metadata maps each name to the hex sha256 of the store file that holds it, named so.
STORE_KEY = "gpucase.store"
STORE_DIR = ".gpucase-store"
STORE_FROM = 2**20  # bytes: smaller tensors stay in the payload
STORED_NAME = "tensor"  # the one tensor of a store file
_HEX = re.compile(r"[0-9a-f]{64}")
# Bounds, checked from the header before anything is allocated (the table "Bounds" in
# docs/case-format.md); a case is a minimal reproduction, not a dataset. MAX_ELEMENTS bounds
# each declared shape (stored or viewed) and the storage a view is rebuilt in: its
# storage_offset, stored_from, and stored_from plus the stored elements (the zeros before
# the stored run are allocated, not read from the file).
MAX_ELEMENTS = 2**34
# A header is parsed whole, in the collecting process, at about nine times its size in
# memory: 16 MiB holds some 100,000 tensors' entries.
MAX_HEADER_BYTES = 16 * 2**20
# The zeros allocated before a stored run (``stored_from`` elements) cost memory but hold
# nothing from the file: a 220-byte payload must not make a child allocate gigabytes.
MAX_PADDING_BYTES = 2**30
# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I16": ("int16", 2), "U16": ("uint16", 2), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I32": ("int32", 4), "U32": ("uint32", 4), "F32": ("float32", 4),
    "I64": ("int64", 8), "U64": ("uint64", 8), "F64": ("float64", 8), "C64": ("complex64", 8),
}
_RESAVE = "save the tensors again with pytest_gpucase.payload.save"


@dataclass(frozen=True)
class TensorInfo:
    """What the header says of one tensor, readable without loading any data."""

    name: str
    dtype: str  # the safetensors code: "F32", "BF16", "I64", ...
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    stored_from: int = 0  # where the stored run begins in the original storage

    @property
    def contiguous(self) -> bool:
        """Whether the view is C-contiguous, as ``torch.Tensor.is_contiguous`` judges it."""
        if any(size == 0 for size in self.shape):
            return True
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a view reaches past its offset (0 for an empty view)."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _reached(tensor: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The run of storage a view reads, ``[start, offset + extent)``, as a flat plain tensor.

    A conjugate or negative view reads its storage through a lazy bit, which a
    flat run over the storage does not carry: the run is conjugated (negated)
    instead, so that the same view over it reads the same values.
    """
    import torch

    span = tensor.storage_offset() + _extent(tuple(tensor.shape), tuple(tensor.stride()))
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    flat.set_(tensor.untyped_storage(), start, (max(span - start, 0),), (1,))
    if tensor.is_conj():
        flat = flat.conj_physical()
    if tensor.is_neg():
        flat = flat.neg()
    return flat


def save(path: Path, tensors: Mapping[str, torch.Tensor],
         metadata: Mapping[str, str] | None = None, *, store: bool = False,
         store_from: int = STORE_FROM) -> None:
    """Write ``tensors`` to ``path`` atomically, each with its exact layout.

    With ``store``, each tensor of ``store_from`` bytes or more is written once to the
    capture's store instead (``STORE_DIR`` beside the case directory that holds ``path``),
    in a file named by its content hash, and the payload names it (``STORE_KEY``).
    """
    header_meta = dict(metadata or {})
    header_meta.pop(STORE_KEY, None)
    tensors = _split_kinds(tensors, header_meta)
    if store:
        kept: dict[str, torch.Tensor] = {}
        stored: dict[str, str] = {}
        for name, tensor in tensors.items():
            if _reach_bytes(tensor) >= store_from:
                stored[name] = _store(Path(path).parent.parent / STORE_DIR, tensor, name)
            else:
                kept[name] = tensor
        if stored:
            header_meta[STORE_KEY] = json.dumps(stored, sort_keys=True)
        tensors = kept
    chunks, alive = _serialized(tensors, header_meta)
    _write_atomic(Path(path), chunks)
    del alive


def encode(tensors: Mapping[str, torch.Tensor],
           metadata: Mapping[str, str] | None = None) -> list[bytes | memoryview]:
    """The bytes ``save`` writes (without a store), in order, for a caller that wraps them
    and writes them itself; each view keeps the tensor it reads alive."""
    header_meta = dict(metadata or {})
    return _serialized(_split_kinds(tensors, header_meta), header_meta)[0]


def unstorable(tensor: Any) -> str | None:
    """Why a payload cannot hold ``tensor`` exactly (what it is, in words), or None when it
    can: as it is, or as the parts of its kind (``case.kinds``)."""
    return kinds.unstorable(tensor, {name for name, _ in DTYPES.values()})


def _split_kinds(tensors: Mapping[str, torch.Tensor],
                 header_meta: dict[str, str]) -> Mapping[str, torch.Tensor]:
    """``tensors`` with the kinds safetensors cannot hold as they are (complex128, sparse,
    quantized: ``case.kinds``) as their plain parts, said in ``header_meta``."""
    header_meta.pop(kinds.KINDS_KEY, None)
    plain, found = kinds.split(tensors)
    if found:
        header_meta[kinds.KINDS_KEY] = json.dumps(found, sort_keys=True)
    return plain


def _join_kinds(path: Path, tensors: dict[str, torch.Tensor],
                metadata: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The tensors of a payload with the parts of each kind joined again (``case.kinds``)."""
    if kinds.KINDS_KEY not in metadata:
        return tensors
    try:
        return kinds.join(tensors, metadata[kinds.KINDS_KEY])
    except ValueError as exc:
        raise CaseFormatError(path, f"{exc}; {_RESAVE}") from None


def _described_kinds(infos: list[TensorInfo], metadata: Mapping[str, str]) -> list[TensorInfo]:
    """One entry per tensor held as parts (``case.kinds``), named as it was saved: its first
    part's dtype and its own shape; the parts themselves are not inputs a call takes."""
    if kinds.KINDS_KEY not in metadata:
        return infos
    try:
        table = json.loads(metadata[kinds.KINDS_KEY])
    except (ValueError, RecursionError):
        return infos
    if not isinstance(table, dict):
        return infos
    by_name = {info.name: info for info in infos}

    def main(name: str) -> TensorInfo | None:  # the part that holds the values
        for part in ("values", "real", "int_repr"):
            key = f"{name}{kinds.PART}{part}"
            if key in by_name:
                return by_name[key]
            if key in table:
                return main(key)
        return None

    kept = [info for info in infos if kinds.PART not in info.name]
    for name, described in table.items():
        values = main(name)
        if kinds.PART in name or values is None or not isinstance(described, dict):
            continue
        shape = described.get("size")
        if not isinstance(shape, list):
            shape = list(values.shape[:-1] if described.get("kind") == "complex"
                         else values.shape)
        shape_t = tuple(int(n) for n in shape)
        kept.append(TensorInfo(name, values.dtype, shape_t, _contiguous_stride(shape_t), 0))
    return kept


def _reach_bytes(tensor: Any) -> int:
    from pytest_gpucase.base.tensors import nbytes

    try:
        return nbytes(tensor)
    except Exception:
        return 0


def _store(folder: Path, tensor: torch.Tensor, name: str) -> str:
    """Write ``tensor`` to the store ``folder`` under the hex sha256 of its file (once: a file
    of that name holds the same bytes already), and return that hex."""
    chunks, alive = _serialized({STORED_NAME: tensor}, {}, name)
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    hexdigest = digest.hexdigest()
    target = folder / f"{hexdigest}.safetensors"
    if not target.is_file() or target.is_symlink():
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(target, chunks)
    del alive
    return hexdigest


def _serialized(tensors: Mapping[str, torch.Tensor], header_meta: dict[str, str],
                label: str | None = None,
                ) -> tuple[list[bytes | memoryview], list[torch.Tensor]]:
    """The bytes of a payload holding ``tensors``, each with its exact layout, and the
    tensors those bytes are views of (to be kept alive while the bytes are used)."""
    import torch

    codes = {getattr(torch, name): code for code, (name, _) in DTYPES.items()
             if hasattr(torch, name)}
    runs: list[tuple[str, str, torch.Tensor]] = []
    layout: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"{key!r}: tensor names must be strings")
        name = label or key
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise TypeError(f"{name}: only strided (dense) tensors can be saved, "
                            f"not {tensor.layout}")
        code = codes.get(tensor.dtype)
        if code is None:
            raise TypeError(f"{name}: safetensors cannot store {tensor.dtype}")
        if tensor.numel() > MAX_ELEMENTS:  # load would refuse the file: never write it
            raise TypeError(f"{name}: its shape {tuple(tensor.shape)} declares "
                            f"{tensor.numel()} elements, over the limit of {MAX_ELEMENTS} a "
                            "case payload is read with; save a smaller tensor (an expanded "
                            "one: the tensor it expands)")
        tensor = readable(tensor, name)
        with _outside_transforms():  # inside torch.func.grad an op's result is wrapped again
            tensor = tensor.detach()
            if _plain(tensor):  # stored in its own shape: any safetensors reader sees it
                runs.append((key, code, tensor.cpu().contiguous()))
                continue
            offset = int(tensor.storage_offset())
            if offset * tensor.element_size() > MAX_PADDING_BYTES:
                raise ValueError(f"{name}: its storage offset is "
                                 f"{offset * tensor.element_size()} bytes, past the "
                                 f"{MAX_PADDING_BYTES}-byte bound of a case payload; save a "
                                 ".clone() of it unless the offset is what the case is about")
            runs.append((key, code, _reached(tensor, offset).cpu().contiguous()))
        layout[key] = {"shape": list(tensor.shape), "stride": list(tensor.stride()),
                       "storage_offset": offset, "stored_from": offset}
    for key, value in header_meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata {key!r}: keys and values must be strings")
    header_meta.pop(LAYOUT_KEY, None)
    if layout:
        header_meta[LAYOUT_KEY] = json.dumps(layout, sort_keys=True)
    # Widest elements first, as safetensors does, so that every tensor is aligned.
    runs.sort(key=lambda run: (-DTYPES[run[1]][1], run[0]))
    header: dict[str, Any] = {"__metadata__": dict(sorted(header_meta.items()))}
    begin = 0
    for name, code, flat in runs:
        end = begin + flat.numel() * flat.element_size()
        header[name] = {"dtype": code, "shape": list(flat.shape), "data_offsets": [begin, end]}
        begin = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return ([len(raw).to_bytes(8, "little"), raw,
             *(_bytes_of(flat, name) for name, _, flat in runs)], [flat for _, _, flat in runs])


def _plain(tensor: torch.Tensor) -> bool:
    """Whether a view needs no layout entry: C contiguous at offset 0, no lazy conj/neg bit."""
    return (tensor.storage_offset() == 0 and not tensor.is_conj() and not tensor.is_neg()
            and tensor.is_contiguous())


def _bytes_of(flat: torch.Tensor, name: str = "tensor") -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy)."""
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    address = readable_address(flat, nbytes)
    if address is None:  # ``readable`` let it through: reading it would crash the process
        raise TypeError(f"{name}: its {nbytes} bytes of values have no readable memory")
    values = (ctypes.c_char * nbytes).from_address(address)
    values.tensor = flat  # type: ignore[attr-defined]  # the memory lives as long as the view
    return memoryview(values).cast("B")


def readable(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """``tensor`` itself when the memory its view reads can be read as it is, else its
    values as a plain contiguous tensor (on the CPU); TypeError, naming ``name``, when
    they cannot be had.

    Reading a tensor's storage directly (``_bytes_of``, ``_reached``) is only safe
    for a plain tensor whose storage holds its whole view: a zero tensor
    (``torch._efficientzerotensor``, what autograd gives for an unused input), a
    functionalized or functorch-wrapped one has a null or unreadable pointer and
    reading it is a segmentation fault. Their values are had through torch
    itself: zeros, the synced functional value, a copy. A plain tensor whose
    storage was freed or shrunk under it, or a meta tensor, has no values: torch
    would read past the storage too, so it is refused.
    """
    import torch

    reach = tensor.element_size() * _extent(tuple(tensor.shape), tuple(tensor.stride()))
    if readable_address(tensor, reach) is not None or (
            reach == 0 and _unwrapped(tensor) and tensor.device.type != "meta"):
        return tensor
    if torch._is_zerotensor(tensor):
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    if torch._is_functional_tensor(tensor):
        torch._functionalize_sync(tensor)  # its pending writes, into the wrapped tensor
        return readable(torch._from_functional_tensor(tensor), name)
    functorch = torch._C._functorch
    if (getattr(functorch, "is_gradtrackingtensor", None) is not None
            and functorch.is_functorch_wrapped_tensor(tensor)
            and functorch.is_gradtrackingtensor(tensor)):
        # Inside torch.func.grad: the wrapper holds a tensor of the same values and shape.
        inner = functorch.get_unwrapped(tensor)
        if tuple(inner.shape) == tuple(tensor.shape) and inner.dtype == tensor.dtype:
            return readable(inner, name)
    problem = "has no memory to read"
    if not _unwrapped(tensor):  # a wrapper (functorch's, a subclass): torch reads it for us
        try:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            problem = f"cannot be read ({str(exc).splitlines()[0]})"
        else:
            if readable_address(copy, copy.numel() * copy.element_size()) is not None:
                return copy
    elif tensor.device.type == "meta":
        problem = "is a meta tensor: it has a shape but no values"
    else:
        problem = (f"reads {reach} bytes from a storage of "
                   f"{_storage_bytes(tensor)} bytes (freed or resized under it)")
    raise TypeError(f"{name}: a {tensor.dtype} tensor of shape {list(tensor.shape)} that "
                    f"{problem}; save a plain copy of its values (.clone() of a tensor "
                    "that still has them)")


def _outside_transforms() -> contextlib.AbstractContextManager[object]:
    """Run plain tensors' ops as plain ones, also inside a torch.func transform (where
    their results would be wrapped at its level, with no memory of their own to read)."""
    import torch

    disable = getattr(torch._C, "_DisableFuncTorch", None)
    return disable() if disable is not None else contextlib.nullcontext()


def _unwrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor, its storage its own (no wrapper inside)."""
    import torch

    return (type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
            and not torch._is_functional_tensor(tensor) and not torch._is_zerotensor(tensor))


def _storage_bytes(tensor: torch.Tensor) -> int | str:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return "unknown"


def read_header(path: Path, data: bytes | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and check a safetensors header (tensor entries, metadata) without reading data.

    Every entry is checked against the file: a known dtype, a shape of at most
    ``MAX_ELEMENTS`` elements, and data offsets inside the file that hold
    exactly that many bytes. A file that is not safetensors (a ``torch.save``
    pickle, say) is refused from its first bytes and never unpickled. ``data``: the
    file's bytes, read (and checked) already by the caller; ``path`` then only names it.
    """
    path = Path(path)
    if data is None:
        link_inside(path, path.parent)  # a payload lives in its case directory
    try:
        if data is None:
            size = regular_file(path, f"replace it with the safetensors file; {_RESAVE}").st_size
        else:
            size = len(data)
        with _open_regular(path) if data is None else io.BytesIO(data) as handle:
            start = handle.read(8)
            if len(start) < 8:
                raise _not_safetensors(path, start, f"is {size} bytes, too short for a "
                                       f"safetensors file; {_RESAVE}")
            length = int.from_bytes(start, "little")
            if length > size - 8:
                raise _not_safetensors(path, start, f"header declares {length} bytes but the "
                                       f"file holds {size - 8} after its length field "
                                       "(truncated or not safetensors)")
            if length > MAX_HEADER_BYTES:
                raise _not_safetensors(path, start, f"header of {length} bytes is over the "
                                       f"limit of {MAX_HEADER_BYTES}; not a case payload")
            raw = handle.read(length)
    except OSError as exc:
        raise CaseFormatError(path, f"cannot be read: {exc}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _not_safetensors(path, start, f"header is not JSON ({exc}); not a safetensors "
                               "file") from None
    if not isinstance(header, dict):
        raise CaseFormatError(path, "header is not a JSON object; not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
        raise CaseFormatError(path, "header __metadata__ is not a map of strings to strings")
    data_size = size - 8 - length
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
    return header, metadata


def _open_regular(path: Path) -> Any:
    """Open for reading without blocking, refused unless the open file is a regular file
    (should a FIFO replace the file after its ``stat``): ``base.files.open_regular``."""
    return open_regular(path)


def _not_safetensors(path: Path, start: bytes, problem: str) -> CaseFormatError:
    """The error for a file that fails to parse, naming a pickle when it starts like one."""
    # A zip archive is what torch.save writes; a pickle starts with PROTO 2..5.
    if start.startswith((b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")):
        problem = ("is a torch.save (pickle) file, not safetensors; it is not loaded, since "
                   f"unpickling runs code: {_RESAVE}")
    return CaseFormatError(path, problem)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    """Refuse a header entry whose dtype, shape or data offsets do not fit the file."""
    if not isinstance(entry, dict):
        raise CaseFormatError(path, f"tensor '{name}': header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CaseFormatError(path, f"tensor '{name}': unsupported dtype {json.dumps(dtype)}; "
                              f"expected one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise CaseFormatError(path, f"tensor '{name}': shape {json.dumps(shape)} is not a list "
                              "of sizes >= 0")
    numel = _numel(shape)
    if numel > MAX_ELEMENTS:
        raise CaseFormatError(path, f"tensor '{name}': declared shape {shape} has {numel} "
                              f"elements, over the limit of {MAX_ELEMENTS}; refusing to allocate")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise CaseFormatError(path, f"tensor '{name}': data_offsets {json.dumps(offsets)} is not "
                              "[begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise CaseFormatError(path, f"tensor '{name}' declares bytes {begin}..{end} but the "
                              f"file holds {data_size} bytes of data (truncated?)")
    if end - begin != numel * DTYPES[dtype][1]:
        raise CaseFormatError(path, f"tensor '{name}': {end - begin} bytes of data for shape "
                              f"{shape} of {dtype}, which needs {numel * DTYPES[dtype][1]}")


def describe(path: Path) -> list[TensorInfo]:
    """List the tensors of a payload with their saved layout, reading only its header (and
    the headers of the store files it names, each once: ``store_info``)."""
    header, metadata = read_header(path)
    infos = _infos(path, header, metadata)
    for name, blob in store_files(path, metadata).items():
        infos.append(dataclasses.replace(store_info(blob), name=name))
    return _described_kinds(infos, metadata)


# A store file's header names one tensor and at most its layout: a few hundred bytes.
MAX_STORE_HEADER_BYTES = 2**16
# Each store file as last checked, under what ``os.stat`` said of it then: a capture's
# cases share store files, and collection asks for each name (``store_info``).
_STORE_CHECKED: dict[str, tuple[tuple[int, int, int, int, int], TensorInfo]] = {}
_NOT_STORE = "not a store file; capture the case again"


def store_info(blob: Path) -> TensorInfo:
    """The one tensor of a store file, checked as a store file before any use: a regular
    file (no link; ``store_files`` found it in the store), a header within
    ``MAX_STORE_HEADER_BYTES`` holding exactly the tensor ``STORED_NAME`` and no store
    reference (its metadata names its layout at most), and a size of exactly its header and
    that tensor's data (trailing bytes would be hashed and never used). Read once per file
    and version (its ``stat`` signature) in a process."""
    try:
        signature = stat_signature(os.stat(blob, follow_symlinks=False))
    except OSError as exc:
        raise CaseFormatError(blob, f"cannot be read: {exc}") from None
    checked = _STORE_CHECKED.get(str(blob))
    if checked is not None and checked[0] == signature:
        return checked[1]
    try:
        head, found = read_head(blob, 8 + MAX_STORE_HEADER_BYTES)
    except NotRegularFile as exc:
        raise CaseFormatError(blob, f"is {exc.kind}, not a regular file; {_NOT_STORE}") from None
    except OSError as exc:
        raise CaseFormatError(blob, f"cannot be read: {exc}") from None
    length, header = _store_header(blob, head, found.st_size)
    metadata = header.pop("__metadata__", None) or {}
    _check_store_holds(blob, header, metadata)
    data_size = found.st_size - 8 - length
    _check_entry(blob, STORED_NAME, header[STORED_NAME], data_size)
    if header[STORED_NAME]["data_offsets"] != [0, data_size]:
        raise CaseFormatError(blob, f"is {found.st_size} bytes, not the {8 + length} of its "
                              f"header and the {header[STORED_NAME]['data_offsets'][1]} of its "
                              f"tensor; {_NOT_STORE}")
    [info] = _infos(blob, header, metadata)
    _STORE_CHECKED[str(blob)] = (signature, info)
    return info


def _store_header(blob: Path, head: bytes, size: int) -> tuple[int, dict[str, Any]]:
    """The declared length and the JSON object of a store file's header, if both are sound."""
    length = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if not 0 <= length <= MAX_STORE_HEADER_BYTES:
        raise CaseFormatError(blob, f"header of {length} bytes is not within the "
                              f"{MAX_STORE_HEADER_BYTES} a store file's holds; {_NOT_STORE}")
    if len(head) < 8 + length:
        raise CaseFormatError(blob, f"is {size} bytes, shorter than its header "
                              f"declares; {_NOT_STORE}")
    try:
        header = json.loads(head[8:8 + length])
    except (ValueError, RecursionError) as exc:
        raise CaseFormatError(blob, f"header is not JSON ({exc}); {_NOT_STORE}") from None
    if not isinstance(header, dict):
        raise CaseFormatError(blob, f"header is not a JSON object; {_NOT_STORE}")
    return length, header


def _check_store_holds(blob: Path, header: dict[str, Any], metadata: Any) -> None:
    """Whether a store file's header holds exactly its one tensor and at most its layout."""
    if (not isinstance(metadata, dict) or set(header) != {STORED_NAME}
            or not set(metadata) <= {LAYOUT_KEY}
            or not all(isinstance(value, str) for value in metadata.values())):
        held = ", ".join(sorted(map(str, header))[:5]) or "no tensor"
        keys = ", ".join(sorted(map(str, metadata))[:5]) if isinstance(metadata, dict) else "?"
        raise CaseFormatError(blob, f"holds {held} (metadata: {keys or 'none'}): a store file "
                              f"holds exactly one tensor '{STORED_NAME}' and no store "
                              f"reference; {_NOT_STORE}")


def store_files(path: Path, metadata: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The store files a payload names: tensor name -> file (``STORE_KEY``), each checked to
    be a regular file of the store beside the case directory, named by a sha256."""
    if metadata is None:
        metadata = read_header(path)[1]
    if STORE_KEY not in metadata:
        return {}
    try:
        table = json.loads(metadata[STORE_KEY])
    except (ValueError, RecursionError) as exc:
        raise CaseFormatError(path, f"metadata '{STORE_KEY}' is not JSON ({exc}); "
                              f"{_RESAVE}") from None
    if not isinstance(table, dict):
        raise CaseFormatError(path, f"metadata '{STORE_KEY}' is not a JSON object; {_RESAVE}")
    store = Path(path).parent.parent / STORE_DIR
    found: dict[str, Path] = {}
    for name, digest in table.items():
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise CaseFormatError(path, f"tensor '{name}': store entry {json.dumps(digest)} is "
                                  "not a sha256 in hex")
        blob = store / f"{digest}.safetensors"
        if blob.is_symlink() or store.is_symlink() or not blob.is_file():
            raise CaseFormatError(path, f"tensor '{name}' is kept in {STORE_DIR}/{digest[:12]}… "
                                  "beside the case directory, which is missing: keep the "
                                  f"capture folder's {STORE_DIR} with its cases (copy them "
                                  "together)")
        found[str(name)] = blob
    return found


def _stored_tensor(name: str, blob: Path) -> torch.Tensor:
    """The tensor of a store file, after it is checked as one (``store_info``) and its
    content against its name."""
    store_info(blob)  # before the hash: a file of holes is refused, not hashed
    digest = content_hash(blob)
    if digest != f"sha256:{blob.stem}":
        raise CaseFormatError(blob, f"content hash {digest} differs from the file's name: the "
                              f"store file of '{name}' changed or is corrupted; capture the "
                              "case again")
    return load(blob)[STORED_NAME]


def _infos(path: Path, header: Mapping[str, Any], metadata: Mapping[str, str]) -> list[TensorInfo]:
    """Each tensor's view: from the layout metadata, checked against the header, else contiguous."""
    layout: Any = {}
    if LAYOUT_KEY in metadata:
        try:
            layout = json.loads(metadata[LAYOUT_KEY])
        except (ValueError, RecursionError) as exc:
            raise CaseFormatError(path, f"metadata '{LAYOUT_KEY}' is not JSON ({exc}); "
                                  f"{_RESAVE}") from None
        if not isinstance(layout, dict):
            raise CaseFormatError(path, f"metadata '{LAYOUT_KEY}' is not a JSON object; {_RESAVE}")
    for name in layout:
        if name not in header:
            raise CaseFormatError(path, f"layout names tensor '{name}' that the file does not "
                                  f"hold; {_RESAVE}")
    infos = []
    for name, entry in header.items():
        stored = tuple(entry["shape"])
        if name not in layout:
            infos.append(TensorInfo(name, entry["dtype"], stored, _contiguous_stride(stored), 0))
            continue
        info = _view(path, name, entry["dtype"], layout[name])
        padding = info.stored_from * DTYPES[entry["dtype"]][1]
        if padding > MAX_PADDING_BYTES:
            raise CaseFormatError(path, f"tensor '{name}': layout stored_from {info.stored_from} "
                                  f"asks for {padding} bytes of zeros before the stored data, "
                                  f"over the limit of {MAX_PADDING_BYTES}; refusing to allocate "
                                  "(save a .clone() of the tensor unless its offset is what the "
                                  "case is about)")
        if info.stored_from + _numel(stored) > MAX_ELEMENTS:
            raise CaseFormatError(path, f"tensor '{name}': layout stored_from {info.stored_from} "
                                  f"and {_numel(stored)} stored elements make a storage of "
                                  f"{info.stored_from + _numel(stored)} elements, over the limit "
                                  f"of {MAX_ELEMENTS}; refusing to allocate")
        needed = info.storage_offset - info.stored_from + _extent(info.shape, info.stride)
        if needed > _numel(stored):
            raise CaseFormatError(path, f"tensor '{name}': its view (shape {list(info.shape)}, "
                                  f"stride {list(info.stride)}, offset {info.storage_offset}) "
                                  f"reaches {needed} elements but only {_numel(stored)} are "
                                  "stored")
        infos.append(info)
    return infos


def _view(path: Path, name: str, dtype: str, view: Any) -> TensorInfo:
    """One layout entry, checked: integer sizes, strides and offset, none negative."""
    def bad(problem: str) -> CaseFormatError:
        return CaseFormatError(path, f"tensor '{name}': layout {problem}; {_RESAVE}")

    if not isinstance(view, dict) or not {"shape", "stride", "storage_offset"} <= view.keys():
        raise bad("entry needs shape, stride and storage_offset")
    shape, stride, offset = view["shape"], view["stride"], view["storage_offset"]
    for key, values in (("shape", shape), ("stride", stride)):
        if not isinstance(values, list) or not all(map(_is_int, values)):
            raise bad(f"{key} {json.dumps(values)} is not a list of integers")
        if any(n < 0 for n in values):
            raise bad(f"{key} {values} has a negative entry")
    if not _is_int(offset) or offset < 0:
        raise bad(f"storage_offset {json.dumps(offset)} is not an integer >= 0")
    if offset > MAX_ELEMENTS:
        raise CaseFormatError(path, f"tensor '{name}': layout storage_offset {offset} is over the "
                              f"limit of {MAX_ELEMENTS}; refusing to allocate")
    stored_from = view.get("stored_from", 0)
    if not _is_int(stored_from) or not 0 <= stored_from <= offset:
        raise bad(f"stored_from {json.dumps(stored_from)} is not an integer in [0, {offset}]")
    if len(shape) != len(stride):
        raise bad(f"shape {shape} and stride {stride} differ in length")
    if _numel(shape) > MAX_ELEMENTS:
        raise CaseFormatError(path, f"tensor '{name}': declared shape {shape} has "
                              f"{_numel(shape)} elements, over the limit of {MAX_ELEMENTS}; "
                              "refusing to allocate")
    return TensorInfo(name, dtype, tuple(shape), tuple(stride), offset, stored_from)


def load(path: Path, device: str = "cpu", data: bytes | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a payload with its exact saved layout, on ``device`` (``data``:
    the file's bytes, read already, as for ``read_header``)."""
    import torch
    from safetensors import SafetensorError

    if data is None:
        data = _small_file(path)
    header, metadata = read_header(path, data)
    infos = _infos(path, header, metadata)  # every check runs before any data is read
    tensors: dict[str, torch.Tensor] = {}
    try:
        with contextlib.ExitStack() as stack:
            stored_tensor = _reader(path, stack, data)
            for info in infos:
                stored = stored_tensor(info.name)
                if info.stored_from:  # zeros stand for the part of the storage not read
                    full = torch.zeros(info.stored_from + stored.numel(), dtype=stored.dtype)
                    full[info.stored_from:] = stored.reshape(-1)
                    stored = full
                elif stored.storage_offset() != 0:  # as_strided counts from the storage's start
                    stored = stored.clone()
                tensors[info.name] = stored.as_strided(info.shape, info.stride,
                                                       info.storage_offset)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CaseFormatError(path, f"cannot load tensors: {exc}") from None
    loaded: dict[Path, torch.Tensor] = {}
    for name, blob in store_files(path, metadata).items():
        if blob in loaded:  # a tensor saved under two names: one file, read once
            tensors[name] = loaded[blob].clone()
            continue
        tensors[name] = loaded[blob] = _stored_tensor(name, blob)
    tensors = _join_kinds(path, tensors, metadata)
    if device != "cpu":
        tensors = {name: to_device(t, device) if t.layout == torch.strided and not t.is_quantized
                   else t.to(device) for name, t in tensors.items()}
    return tensors


# A payload up to this size is read whole, in one read, and parsed from memory: for the
# few bytes of a small case, opening it again to map it costs more than the bytes.
_SMALL_PAYLOAD = 64 << 10


def _small_file(path: Path) -> bytes | None:
    """The bytes of ``path`` when it is a regular file of at most ``_SMALL_PAYLOAD`` bytes (the
    checks ``read_header`` makes of a path), else None: it is then read as a path."""
    path = Path(path)
    try:
        link_inside(path, path.parent)
        if regular_file(path, f"replace it with the safetensors file; {_RESAVE}"
                        ).st_size > _SMALL_PAYLOAD:
            return None
        with _open_regular(path) as handle:
            data: bytes = handle.read(_SMALL_PAYLOAD + 1)
    except (OSError, CaseFormatError):
        return None  # read_header says what is wrong, as before
    return data if len(data) <= _SMALL_PAYLOAD else None


def load_small(path: Path) -> dict[str, torch.Tensor] | None:
    """``load(path)`` for a payload of at most 64 KiB that holds its tensors itself (no
    store files), else None; None too where ``load`` would refuse it (it then says why)."""
    data = _small_file(path)
    if data is None:
        return None
    try:
        if STORE_KEY in read_header(path, data)[1]:
            return None
        return load(path, data=data)
    except CaseFormatError:
        return None


def _reader(path: Path, stack: contextlib.ExitStack,
            data: bytes | None = None) -> Callable[[str], torch.Tensor]:
    """Reads stored tensors by name, as safetensors reads them (``read_header`` checked them)."""
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    if data is not None:
        held: dict[str, torch.Tensor] = load_bytes(data)
        return held.__getitem__
    text = str(path)
    if text != printable(text):
        # safetensors takes a path as UTF-8 text: a directory name that is not is read as bytes.
        with _open_regular(path) as handle:
            tensors: dict[str, torch.Tensor] = load_bytes(handle.read())
        return tensors.__getitem__
    handle = stack.enter_context(safe_open(text, framework="pt", device="cpu"))
    return handle.get_tensor  # type: ignore[no-any-return]


def to_device(tensor: torch.Tensor, device: str, *, copy: bool = False) -> torch.Tensor:
    """Move a tensor keeping its exact strides and storage offset (a tensor without
    memory of its own, a zero tensor say, has none to keep: its values come contiguous).
    ``copy``: a copy even when it is on ``device`` already (a snapshot of its values); a
    host one is one memcpy, not a torch op: torch's thread pool hangs in a forked child of
    a process that used it (a DataLoader worker, a test's child), and a snapshot may be
    taken there."""
    import torch

    plain = readable(tensor)
    if plain is not tensor:
        return plain.detach().to(device, copy=copy)
    flat = _reached(tensor.detach())
    if copy and device == "cpu" and flat.device.type == "cpu" and flat.numel():
        moved = torch.frombuffer(bytearray(_bytes_of(flat)), dtype=flat.dtype)
    else:
        moved = flat.to(device, copy=copy)
    return moved.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def content_hash(path: Path) -> str:
    """The sha256 of a file's bytes, as ``sha256:<hex>``."""
    digest = hashlib.sha256()
    link_inside(path, path.parent)
    regular_file(path, f"replace it with the safetensors file; {_RESAVE}")
    with _open_regular(path) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"

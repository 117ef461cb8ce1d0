"""Payloads: exact round trips of layout and values, hostile files refused before any allocation."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pytest_gpucase.case import payload
from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.case.payload import LAYOUT_KEY, TensorInfo
from pytest_gpucase.base.tensors import readable_address

CASES = Path(__file__).resolve().parents[1] / "cases"
RESAVE = "save the tensors again with pytest_gpucase.payload.save"


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1834)


def _specials() -> torch.Tensor:
    tiny = torch.finfo(torch.float32).tiny / 4  # a subnormal
    return torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), tiny, 1.5])


TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "contiguous": lambda: torch.randn(4, 6, generator=_gen()),
    "transposed": lambda: torch.randn(4, 6, generator=_gen()).t(),
    "sliced_with_offset": lambda: torch.randn(5, 7, generator=_gen())[1:4, 2:6],
    "stepped": lambda: torch.randn(20, generator=_gen())[3:15:4],
    "expanded": lambda: torch.randn(3, 1, generator=_gen()).expand(3, 5),
    "expanded_scalar": lambda: torch.tensor(2.5).expand(4, 4),
    "channels_last": lambda: torch.randn(2, 3, 4, 5, generator=_gen()).contiguous(
        memory_format=torch.channels_last),
    "scalar": lambda: torch.tensor(3.25, dtype=torch.float64),
    "scalar_view_with_offset": lambda: torch.randn(5, generator=_gen())[3],
    "empty": lambda: torch.empty(0, 3),
    "empty_with_offset": lambda: torch.randn(5, 4, generator=_gen())[5:],
    "bool": lambda: torch.tensor([[True, False], [False, True]]).t(),
    "int8": lambda: torch.tensor([-128, -1, 0, 127], dtype=torch.int8)[1:],
    "uint8": lambda: torch.tensor([0, 1, 254, 255], dtype=torch.uint8),
    "int32": lambda: torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
    "int64": lambda: torch.tensor([-(2**62), 2**62, -100, 4], dtype=torch.int64).view(2, 2).t(),
    "float16": lambda: torch.randn(3, 4, generator=_gen()).half()[:, 1:],
    "bfloat16": lambda: torch.randn(3, 4, generator=_gen()).bfloat16().t(),
    "float32_specials": _specials,
    "float64": lambda: torch.randn(2, 3, dtype=torch.float64, generator=_gen()),
    "complex64": lambda: torch.randn(3, 3, dtype=torch.complex64, generator=_gen())[1:],
    "conj_view": lambda: torch.randn(4, 3, dtype=torch.complex64, generator=_gen())[1:].t().conj(),
    "neg_view": lambda: torch.randn(4, dtype=torch.complex64, generator=_gen()).conj().imag,
    "requires_grad": lambda: torch.randn(3, 2, requires_grad=True, generator=_gen()).t() * 2,
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor reads, so that nan, -0.0 and subnormals compare exactly."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def assert_same(loaded: torch.Tensor, saved: torch.Tensor) -> None:
    assert loaded.dtype == saved.dtype
    assert loaded.shape == saved.shape
    assert loaded.stride() == saved.stride()
    assert loaded.storage_offset() == saved.storage_offset()
    assert torch.equal(bits(loaded), bits(saved))


def write_raw(path: Path, header: dict[str, Any] | bytes, data: bytes = b"",
              length: int | None = None) -> Path:
    """A safetensors-like file made by hand: length field, header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def with_layout(path: Path, layout: Any, stored: int = 6) -> Path:
    """A float32 tensor 'x' of ``stored`` elements with the given layout metadata."""
    text = layout if isinstance(layout, str) else json.dumps(layout)
    return write_raw(path, {"__metadata__": {LAYOUT_KEY: text},
                            "x": {"dtype": "F32", "shape": [stored],
                                  "data_offsets": [0, 4 * stored]}}, bytes(4 * stored))


@pytest.fixture
def no_data_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if tensor data is read: a refusal must come from the header alone."""
    import safetensors

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(safetensors, "safe_open", refuse)


# --- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", TENSORS)
def test_round_trip_keeps_layout_and_values(tmp_path: Path, kind: str) -> None:
    saved = TENSORS[kind]()
    payload.save(tmp_path / "p.safetensors", {"t": saved})
    loaded = payload.load(tmp_path / "p.safetensors")
    assert list(loaded) == ["t"]
    assert_same(loaded["t"], saved)
    assert not loaded["t"].requires_grad
    assert not loaded["t"].is_conj() and not loaded["t"].is_neg()


@pytest.mark.parametrize("kind", TENSORS)
def test_describe_reads_the_saved_layout(tmp_path: Path, kind: str) -> None:
    saved = TENSORS[kind]()
    payload.save(tmp_path / "p.safetensors", {"t": saved})
    [info] = payload.describe(tmp_path / "p.safetensors")
    offset = int(saved.storage_offset())
    assert info == TensorInfo("t", info.dtype, tuple(saved.shape), saved.stride(), offset,
                              stored_from=offset)
    assert payload.DTYPES[info.dtype][0] == str(saved.dtype).removeprefix("torch.")
    assert info.contiguous == saved.is_contiguous()


def test_many_tensors_in_one_file(tmp_path: Path) -> None:
    saved = {kind: make() for kind, make in TENSORS.items()}
    path = tmp_path / "p.safetensors"
    payload.save(path, saved)
    loaded = payload.load(path)
    assert sorted(loaded) == sorted(saved)
    for name, tensor in saved.items():
        assert_same(loaded[name], tensor)


def test_views_of_one_storage_are_saved_apart(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    path = tmp_path / "p.safetensors"
    payload.save(path, {"a": base.view(3, 4), "b": base.view(3, 4).t(), "c": base[4:8]})
    loaded = payload.load(path)
    assert_same(loaded["b"], base.view(3, 4).t())
    assert_same(loaded["c"], base[4:8])
    loaded["a"][0, 0] = 100.0  # loaded tensors own their memory
    assert loaded["b"][0, 0] == 0.0 and base[0] == 0.0


def test_loaded_tensors_do_not_depend_on_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.arange(4.0)})
    loaded = payload.load(path)
    payload.save(path, {"x": torch.zeros(4)})
    assert torch.equal(loaded["x"], torch.arange(4.0))


def _save_plain(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A file as any safetensors writer makes it (safetensors.torch.save_file needs numpy)."""
    codes = {torch.float32: "F32", torch.int64: "I64"}
    header: dict[str, object] = {}
    data = b""
    for name, t in tensors.items():
        raw = bytes(payload._bytes_of(t.contiguous()))
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_plain_safetensors_file_loads_as_contiguous(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    weight, index = torch.randn(3, 4, generator=_gen()), torch.arange(5)
    _save_plain({"weight": weight, "index": index, "scalar": torch.tensor(7.0)}, path)
    loaded = payload.load(path)
    assert_same(loaded["weight"], weight)
    assert_same(loaded["index"], index)
    assert_same(loaded["scalar"], torch.tensor(7.0))
    infos = {info.name: info for info in payload.describe(path)}
    assert infos["weight"] == TensorInfo("weight", "F32", (3, 4), (4, 1), 0)
    assert infos["index"] == TensorInfo("index", "I64", (5,), (1,), 0)
    assert infos["scalar"] == TensorInfo("scalar", "F32", (), (), 0)


def test_written_files_are_plain_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    x = torch.randn(5, 7, generator=_gen())[1:4, 2:6]
    payload.save(path, {"x": x, "i": torch.arange(3, dtype=torch.int16)})
    flat = load_file(str(path))  # the run of storage the view reads, as safetensors reads it
    assert flat["x"].shape == (2 * 7 + 3 + 1,)
    assert torch.equal(flat["x"].as_strided(x.shape, x.stride(), 0), x)
    assert torch.equal(flat["i"], torch.arange(3, dtype=torch.int16))


def test_user_metadata_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.ones(2, 3).t(), "plain": torch.ones(2)},
                 metadata={"origin": "iteration 1834", "z": ""})
    header, metadata = payload.read_header(path)
    assert set(header) == {"x", "plain"}
    assert metadata["origin"] == "iteration 1834" and metadata["z"] == ""
    # Only the view that needs it has a layout entry.
    assert json.loads(metadata[LAYOUT_KEY]) == {
        "x": {"shape": [3, 2], "stride": [1, 3], "storage_offset": 0, "stored_from": 0}}


def test_plain_tensors_are_stored_in_their_own_shape(tmp_path: Path) -> None:
    """safetensors' own readers see a contiguous input as it is: a [1, 8] input reads [1, 8]."""
    path = tmp_path / "p.safetensors"
    row = torch.arange(8, dtype=torch.float32).reshape(1, 8)
    payload.save(path, {"row": row, "scalar": torch.tensor(2.5)})
    assert LAYOUT_KEY not in payload.read_header(path)[1]
    read = load_file(str(path))
    assert read["row"].shape == (1, 8) and torch.equal(read["row"], row)
    assert read["scalar"].shape == () and float(read["scalar"]) == 2.5
    with safe_open(str(path), framework="pt") as handle:
        assert handle.get_slice("row").get_shape() == [1, 8]
    assert_same(payload.load(path)["row"], row)


@pytest.mark.parametrize("kind", ["transposed", "sliced_with_offset", "expanded", "conj_view",
                                  "neg_view", "scalar_view_with_offset"])
def test_only_views_that_need_it_carry_a_layout(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "p.safetensors"
    view, plain = TENSORS[kind](), torch.randn(2, 3, generator=_gen())
    payload.save(path, {"view": view, "plain": plain})
    assert set(json.loads(payload.read_header(path)[1][LAYOUT_KEY])) == {"view"}
    loaded = payload.load(path)
    assert_same(loaded["view"], view)
    assert_same(loaded["plain"], plain)


def _save_old_format(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A payload as earlier versions wrote it: every tensor flat, every one with a layout."""
    layout, header, data, begin = {}, {}, b"", 0
    for name, tensor in tensors.items():
        offset = tensor.storage_offset()
        span = offset + 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(),
                                                            strict=True))
        flat = torch.empty(0, dtype=tensor.dtype)
        flat.set_(tensor.untyped_storage(), offset, (span - offset,), (1,))
        raw = bytes(flat.contiguous().view(torch.uint8).tolist())
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[tensor.dtype],
                        "shape": [flat.numel()], "data_offsets": [begin, begin + len(raw)]}
        layout[name] = {"shape": list(tensor.shape), "stride": list(tensor.stride()),
                        "storage_offset": offset, "stored_from": offset}
        data, begin = data + raw, begin + len(raw)
    header["__metadata__"] = {LAYOUT_KEY: json.dumps(layout, sort_keys=True)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_old_format_payloads_load_as_before(tmp_path: Path) -> None:
    path = tmp_path / "old.safetensors"
    row = torch.arange(8, dtype=torch.float32).reshape(1, 8)
    sliced = torch.randn(5, 7, generator=_gen())[1:4, 2:6]
    target = torch.tensor([[0, 2, 4]])
    _save_old_format({"row": row, "sliced": sliced, "target": target}, path)
    assert load_file(str(path))["row"].shape == (8,)  # flat, as it was written
    loaded = payload.load(path)
    assert_same(loaded["row"], row)
    assert_same(loaded["sliced"], sliced)
    assert_same(loaded["target"], target)
    infos = {info.name: info for info in payload.describe(path)}
    assert infos["row"] == TensorInfo("row", "F32", (1, 8), (8, 1), 0, 0)
    assert infos["sliced"] == TensorInfo("sliced", "F32", (3, 4), (7, 1), 9, 9)


def test_a_slice_does_not_carry_the_rest_of_its_batch(tmp_path: Path) -> None:
    batch = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": batch[97:99]})  # two samples at the end of a large batch
    assert load_file(str(path))["x"].numel() == 20
    loaded = payload.load(path)["x"]
    assert loaded.storage_offset() == 970 and torch.equal(loaded, batch[97:99])


def test_empty_mapping(tmp_path: Path) -> None:
    payload.save(tmp_path / "p.safetensors", {})
    assert payload.load(tmp_path / "p.safetensors") == {}
    assert payload.describe(tmp_path / "p.safetensors") == []


@pytest.mark.parametrize("name", sorted(p.parent.name for p in CASES.glob("*/inputs.safetensors")))
def test_bundled_payloads_load(name: str) -> None:
    path = CASES / name / "inputs.safetensors"
    loaded = payload.load(path)
    for info in payload.describe(path):
        tensor = loaded[info.name]
        assert (tensor.shape, tensor.stride(), tensor.storage_offset()) == (
            info.shape, info.stride, info.storage_offset)


def test_transposed_bundled_payload_keeps_its_strides() -> None:
    [info] = payload.describe(CASES / "rowsum_transposed" / "inputs.safetensors")
    assert info == TensorInfo("x", "F32", (5, 6), (1, 5), 1, stored_from=1)
    assert not info.contiguous


# --- TensorInfo ------------------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "stride", "contiguous"), [
    ((2, 3), (3, 1), True),
    ((2, 3), (1, 2), False),
    ((3, 1), (1, 7), True),  # a size-1 dim's stride does not matter, as in torch
    ((0, 3), (1, 9), True),
    ((), (), True),
    ((4,), (2,), False),
    ((4,), (0,), False),
])
def test_tensor_info_contiguous_agrees_with_torch(
        shape: tuple[int, ...], stride: tuple[int, ...], contiguous: bool) -> None:
    assert TensorInfo("t", "F32", shape, stride, 0).contiguous is contiguous
    assert torch.empty(64).as_strided(shape, stride).is_contiguous() is contiguous


# --- devices ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["transposed", "sliced_with_offset", "expanded", "channels_last",
                                  "scalar_view_with_offset", "empty_with_offset", "conj_view"])
def test_to_device_keeps_the_layout(kind: str) -> None:
    tensor = TENSORS[kind]()
    moved = payload.to_device(tensor, "meta")
    assert moved.device.type == "meta"
    assert (moved.dtype, moved.shape, moved.stride(), moved.storage_offset()) == (
        tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset())
    assert_same(payload.to_device(tensor, "cpu"), tensor)


def test_load_onto_a_device(tmp_path: Path) -> None:
    x = TENSORS["sliced_with_offset"]()
    payload.save(tmp_path / "p.safetensors", {"x": x})
    moved = payload.load(tmp_path / "p.safetensors", device="meta")["x"]
    assert (moved.device.type, moved.stride(), moved.storage_offset()) == (
        "meta", x.stride(), x.storage_offset())


GPU_SCRIPT = """
import sys, torch
from pathlib import Path
from pytest_gpucase.case import payload
if not torch.cuda.is_available():
    sys.exit(3)
path = Path(sys.argv[1])
x = torch.randn(5, 7)[1:4, 2:6].t()
on_gpu = payload.to_device(x, "cuda")
assert on_gpu.is_cuda and on_gpu.stride() == x.stride()
assert on_gpu.storage_offset() == x.storage_offset() and torch.equal(on_gpu.cpu(), x)
payload.save(path, {"x": on_gpu, "c": on_gpu.to(torch.complex64).conj()})
loaded = payload.load(path, device="cuda")
assert loaded["x"].is_cuda and loaded["x"].stride() == x.stride()
assert torch.equal(loaded["x"].cpu(), x)
assert torch.equal(loaded["c"].cpu(), x.to(torch.complex64).conj().resolve_conj())
"""


@pytest.mark.gpu
def test_gpu_round_trip(tmp_path: Path) -> None:
    # In a child: CUDA initialized in the pytest process would poison every later fork.
    if not any(Path(dev).exists() for dev in ("/dev/nvidiactl", "/dev/kfd")):
        pytest.skip("no GPU device node here")
    done = subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(tmp_path / "g.safetensors")],
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode == 3:
        pytest.skip("torch sees no CUDA device")
    assert done.returncode == 0, done.stderr


# --- content hash and determinism ------------------------------------------------------------

def test_same_tensors_give_the_same_bytes(tmp_path: Path) -> None:
    # safetensors.torch.save_file writes its metadata map in a random order.
    tensors = {"b": torch.ones(2).t(), "a": torch.arange(6).view(2, 3).t(),
               "h": torch.zeros(3, dtype=torch.bfloat16)}
    metadata = {f"key{i}": str(i) for i in range(8)}
    hashes = set()
    for i in range(4):
        payload.save(tmp_path / f"{i}.safetensors", tensors, metadata)
        hashes.add(payload.content_hash(tmp_path / f"{i}.safetensors"))
    assert len(hashes) == 1


def test_content_hash(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.arange(4.0)})
    digest = payload.content_hash(path)
    assert digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert payload.content_hash(path) == digest
    payload.save(path, {"x": torch.arange(4.0) + 1})
    assert payload.content_hash(path) != digest


# --- saving: atomic, umask, refusals ---------------------------------------------------------

def test_save_leaves_only_the_file(tmp_path: Path) -> None:
    payload.save(tmp_path / "p.safetensors", {"x": torch.ones(3)})
    payload.save(tmp_path / "p.safetensors", {"x": torch.zeros(3)})
    assert os.listdir(tmp_path) == ["p.safetensors"]


def _quiet(make: Any) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # quantized tensors are deprecated, BSR is beta
        warnings.simplefilter("ignore")
        return make()  # type: ignore[no-any-return]


@pytest.mark.parametrize(("tensors", "metadata", "expected"), [
    ({"x": torch.ones(2), "y": [1, 2]}, None, "y: expected a tensor, got list"),
    # complex128, sparse COO and CSR, quantized: saved as their exact parts (case.kinds).
    ({"x": _quiet(lambda: torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.quint4x2))},
     None,
     "x: safetensors cannot store torch.quint4x2"),
    ({"s": _quiet(lambda: torch.eye(2).to_sparse_bsr((1, 1)))}, None,
     "s: only strided (dense) tensors can be saved, not torch.sparse_bsr"),
    ({3: torch.ones(2)}, None, "3: tensor names must be strings"),
    ({"x": torch.ones(2)}, {"origin": 3}, "metadata 'origin': keys and values must be strings"),
])
def test_refused_save_writes_nothing(tmp_path: Path, tensors: Any, metadata: Any,
                                     expected: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        payload.save(tmp_path / "p.safetensors", tensors, metadata)
    assert str(excinfo.value) == expected
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [OSError("No space left on device"), KeyboardInterrupt()])
def test_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              error: BaseException) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.ones(3)})
    before = path.read_bytes()

    def fail(fd: int) -> None:
        raise error

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(type(error)):
        payload.save(path, {"x": torch.zeros(3)})
    assert os.listdir(tmp_path) == ["p.safetensors"]
    assert path.read_bytes() == before


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_file_mode_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        payload.save(tmp_path / "p.safetensors", {"x": torch.ones(1)})
    finally:
        os.umask(previous)
    assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == mode


# --- hostile files ---------------------------------------------------------------------------

HOSTILE: list[tuple[str, Callable[[Path], Path], str]] = [
    ("empty", lambda p: (p.write_bytes(b""), p)[1],
     f"is 0 bytes, too short for a safetensors file; {RESAVE}"),
    ("three_bytes", lambda p: (p.write_bytes(b"abc"), p)[1],
     f"is 3 bytes, too short for a safetensors file; {RESAVE}"),
    ("header_longer_than_file", lambda p: write_raw(p, {"x": 1}, length=1000),
     ("header declares 1000 bytes but the file holds 8 after its length field (truncated or "
     "not safetensors)")),
    ("header_not_json", lambda p: write_raw(p, b"{not json"),
     ("header is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)); not a safetensors file")),
    ("header_not_object", lambda p: write_raw(p, b"[]"),
     "header is not a JSON object; not a safetensors file"),
    ("metadata_not_strings", lambda p: write_raw(p, {"__metadata__": {"a": 1}}),
     "header __metadata__ is not a map of strings to strings"),
    ("entry_not_object", lambda p: write_raw(p, {"x": [1]}),
     "tensor 'x': header entry is not a JSON object"),
    ("unknown_dtype", lambda p: write_raw(
        p, {"x": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16)),
     ("tensor 'x': unsupported dtype \"F128\"; expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, "
     "F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64")),
    ("dtype_not_string", lambda p: write_raw(
        p, {"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
     ("tensor 'x': unsupported dtype [\"F32\"]; expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, "
     "F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64")),
    ("negative_size", lambda p: write_raw(
        p, {"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
     "tensor 'x': shape [-1] is not a list of sizes >= 0"),
    ("huge_shape", lambda p: write_raw(
        p, {"x": {"dtype": "U8", "shape": [2**20, 2**20], "data_offsets": [0, 2**40]}}),
     ("tensor 'x': declared shape [1048576, 1048576] has 1099511627776 elements, over the limit "
     "of 17179869184; refusing to allocate")),
    ("offsets_beyond_file", lambda p: write_raw(
        p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
     "tensor 'x' declares bytes 0..16 but the file holds 8 bytes of data (truncated?)"),
    ("offsets_reversed", lambda p: write_raw(
        p, {"x": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)),
     "tensor 'x' declares bytes 8..0 but the file holds 8 bytes of data (truncated?)"),
    ("offsets_not_a_pair", lambda p: write_raw(
        p, {"x": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, bytes(4)),
     "tensor 'x': data_offsets [\"0\", \"4\"] is not [begin, end]"),
    ("offsets_missing", lambda p: write_raw(p, {"x": {"dtype": "F32", "shape": [1]}}, bytes(4)),
     "tensor 'x': data_offsets null is not [begin, end]"),
    ("bytes_do_not_fit_shape", lambda p: write_raw(
        p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),
     "tensor 'x': 8 bytes of data for shape [4] of F32, which needs 16"),
    ("layout_not_json", lambda p: with_layout(p, "{oops"),
     ("metadata 'gpucase.layout' is not JSON (Expecting property name enclosed in double quotes: "
     f"line 1 column 2 (char 1)); {RESAVE}")),
    ("layout_not_object", lambda p: with_layout(p, []),
     f"metadata 'gpucase.layout' is not a JSON object; {RESAVE}"),
    ("layout_names_missing_tensor", lambda p: with_layout(
        p, {"y": {"shape": [2], "stride": [1], "storage_offset": 0}}),
     f"layout names tensor 'y' that the file does not hold; {RESAVE}"),
    ("layout_entry_incomplete", lambda p: with_layout(p, {"x": {"shape": [2]}}),
     f"tensor 'x': layout entry needs shape, stride and storage_offset; {RESAVE}"),
    ("layout_entry_not_object", lambda p: with_layout(p, {"x": [2]}),
     f"tensor 'x': layout entry needs shape, stride and storage_offset; {RESAVE}"),
    ("negative_stride", lambda p: with_layout(
        p, {"x": {"shape": [2], "stride": [-1], "storage_offset": 1}}),
     f"tensor 'x': layout stride [-1] has a negative entry; {RESAVE}"),
    ("negative_view_size", lambda p: with_layout(
        p, {"x": {"shape": [-2], "stride": [1], "storage_offset": 0}}),
     f"tensor 'x': layout shape [-2] has a negative entry; {RESAVE}"),
    ("negative_offset", lambda p: with_layout(
        p, {"x": {"shape": [2], "stride": [1], "storage_offset": -1}}),
     f"tensor 'x': layout storage_offset -1 is not an integer >= 0; {RESAVE}"),
    ("fractional_stride", lambda p: with_layout(
        p, {"x": {"shape": [2], "stride": [1.5], "storage_offset": 0}}),
     f"tensor 'x': layout stride [1.5] is not a list of integers; {RESAVE}"),
    ("boolean_size", lambda p: with_layout(
        p, {"x": {"shape": [True], "stride": [1], "storage_offset": 0}}),
     f"tensor 'x': layout shape [true] is not a list of integers; {RESAVE}"),
    ("rank_mismatch", lambda p: with_layout(
        p, {"x": {"shape": [2, 3], "stride": [1], "storage_offset": 0}}),
     f"tensor 'x': layout shape [2, 3] and stride [1] differ in length; {RESAVE}"),
    ("view_outside_storage", lambda p: with_layout(
        p, {"x": {"shape": [2, 3], "stride": [3, 1], "storage_offset": 1}}),
     ("tensor 'x': its view (shape [2, 3], stride [3, 1], offset 1) reaches 7 elements but only "
     "6 are stored")),
    ("view_offset_outside_empty_storage", lambda p: with_layout(
        p, {"x": {"shape": [0], "stride": [1], "storage_offset": 9}}),
     ("tensor 'x': its view (shape [0], stride [1], offset 9) reaches 9 elements but only 6 are "
     "stored")),
    ("huge_view", lambda p: with_layout(
        p, {"x": {"shape": [10**6, 10**6], "stride": [0, 0], "storage_offset": 0}}),
     ("tensor 'x': declared shape [1000000, 1000000] has 1000000000000 elements, over the limit "
     "of 17179869184; refusing to allocate")),
    # 220 bytes that would have the loader allocate 2**40 zeros before the stored run.
    ("huge_stored_from", lambda p: with_layout(
        p, {"x": {"shape": [2], "stride": [1], "storage_offset": 2**40, "stored_from": 2**40}}),
     ("tensor 'x': layout storage_offset 1099511627776 is over the limit of 17179869184; "
      "refusing to allocate")),
    # The 220-byte payload: 4 GiB of zeros before two stored floats.
    ("padding_of_gigabytes", lambda p: with_layout(
        p, {"x": {"shape": [2], "stride": [1], "storage_offset": 2**30, "stored_from": 2**30}}),
     ("tensor 'x': layout stored_from 1073741824 asks for 4294967296 bytes of zeros before the "
      "stored data, over the limit of 1073741824; refusing to allocate (save a .clone() of the "
      "tensor unless its offset is what the case is about)")),
]


@pytest.mark.usefixtures("no_data_read")
@pytest.mark.parametrize(("make", "problem"), [(make, problem) for _, make, problem in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])
@pytest.mark.parametrize("reader", [payload.load, payload.describe])
def test_hostile_file_is_refused_from_its_header(
        tmp_path: Path, reader: Callable[[Path], Any], make: Callable[[Path], Path],
        problem: str) -> None:
    path = make(tmp_path / "p.safetensors")
    with pytest.raises(CaseFormatError) as excinfo:
        reader(path)
    assert str(excinfo.value) == f"{path}: {problem}"
    assert excinfo.value.path == path


@pytest.mark.usefixtures("no_data_read")
def test_header_over_the_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    length = payload.MAX_HEADER_BYTES + 1
    write_raw(path, b"{", length=length)
    os.truncate(path, 8 + length)  # sparse: nothing is written
    with pytest.raises(CaseFormatError) as excinfo:
        payload.describe(path)
    assert str(excinfo.value) == (f"{path}: header of {length} bytes is over the limit of "
                                  f"{payload.MAX_HEADER_BYTES}; not a case payload")


@pytest.mark.usefixtures("no_data_read")
def test_deeply_nested_header(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "p.safetensors", b"[" * 100_000)
    with pytest.raises(CaseFormatError) as excinfo:
        payload.describe(path)
    assert str(excinfo.value).startswith(f"{path}: header is not JSON (maximum recursion depth")


def test_element_limit_applies_to_stored_tensors(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.zeros(3, 4)})
    monkeypatch.setattr(payload, "MAX_ELEMENTS", 10)
    monkeypatch.setattr(torch, "empty", _no_allocation)
    with pytest.raises(CaseFormatError) as excinfo:
        payload.load(path)
    assert str(excinfo.value) == (f"{path}: tensor 'x': declared shape [3, 4] has 12 elements, "
                                  "over the limit of 10; refusing to allocate")


def test_element_limit_applies_to_views(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 20 x 20 view of one stored element loads under the real limit ...
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.tensor(1.0).expand(20, 20)})
    assert payload.load(path)["x"].shape == (20, 20)
    # ... and is refused, before any data is read, under a lower one.
    monkeypatch.setattr(payload, "MAX_ELEMENTS", 100)
    monkeypatch.setattr(torch, "empty", _no_allocation)
    with pytest.raises(CaseFormatError) as excinfo:
        payload.load(path)
    assert str(excinfo.value) == (f"{path}: tensor 'x': declared shape [20, 20] has 400 "
                                  "elements, over the limit of 100; refusing to allocate")


def _no_allocation(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("allocated")


def test_save_refuses_an_offset_past_the_padding_bound() -> None:
    storage = torch.empty(2**28 + 4, dtype=torch.float32)
    view = storage[2**28 + 1:]
    with pytest.raises(ValueError, match="past the 1073741824-byte bound of a case payload"):
        payload.save(Path("unused.safetensors"), {"x": view})


def test_inconsistent_offsets_are_caught_by_safetensors(tmp_path: Path) -> None:
    # Each entry fits the file, but both claim the same bytes: safetensors refuses on load.
    path = write_raw(tmp_path / "p.safetensors", {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }, bytes(8))
    assert [info.name for info in payload.describe(path)] == ["a", "b"]
    with pytest.raises(CaseFormatError) as excinfo:
        payload.load(path)
    assert str(excinfo.value).startswith(f"{path}: cannot load tensors: ")


# --- pickles are refused, never unpickled ----------------------------------------------------

class MakesMarker:
    """Unpickling this creates a directory: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


PICKLE_WRITERS: dict[str, Callable[[Path, Any], object]] = {
    "torch_save": lambda path, obj: torch.save({"x": obj}, path),
    "torch_save_legacy": lambda path, obj: torch.save(
        {"x": obj}, path, _use_new_zipfile_serialization=False),
    "pickle_protocol_2": lambda path, obj: path.write_bytes(pickle.dumps(obj, protocol=2)),
    "pickle_protocol_5": lambda path, obj: path.write_bytes(pickle.dumps(obj, protocol=5)),
}


@pytest.mark.parametrize("writer", PICKLE_WRITERS)
@pytest.mark.parametrize("reader", [payload.load, payload.describe])
def test_pickle_is_refused_and_never_unpickled(
        tmp_path: Path, writer: str, reader: Callable[[Path], Any]) -> None:
    live = tmp_path / "proof_the_pickle_is_live"
    pickle.loads(pickle.dumps(MakesMarker(live)))
    assert live.is_dir()
    marker = tmp_path / "unpickled"
    path = tmp_path / "inputs.safetensors"
    PICKLE_WRITERS[writer](path, MakesMarker(marker))
    with pytest.raises(CaseFormatError) as excinfo:
        reader(path)
    assert str(excinfo.value) == (
        f"{path}: is a torch.save (pickle) file, not safetensors; it is not loaded, since "
        f"unpickling runs code: {RESAVE}")
    assert not marker.exists()


# --- describe reads the header only ----------------------------------------------------------

class CountingReads(io.FileIO):
    """A file that counts the bytes read through it."""

    counts: list[int]

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.counts.append(len(data or b""))
        return data or b""


@pytest.mark.usefixtures("no_data_read")
def test_describe_reads_only_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.zeros(1000, 100)})
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    counts: list[int] = []

    def counting_open(file: Any, mode: str = "r") -> CountingReads:
        handle = CountingReads(file, mode.replace("b", ""))
        handle.counts = counts
        return handle

    from pytest_gpucase.base import files

    monkeypatch.setattr(files, "open", counting_open, raising=False)  # payload's one opener
    assert [info.shape for info in payload.describe(path)] == [(1000, 100)]
    assert sum(counts) == 8 + header_len < path.stat().st_size


@pytest.mark.usefixtures("no_data_read")
def test_describe_does_not_check_the_data(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.zeros(4)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-16] + b"\xff" * 16)
    assert [info.name for info in payload.describe(path)] == ["x"]


@pytest.mark.usefixtures("no_data_read")
def test_truncated_data_region_is_refused_from_the_header(tmp_path: Path) -> None:
    # The sizes in the header and the file's length are enough to see a truncated copy;
    # refusing it at collection gives one broken-case item instead of a failure per run.
    path = tmp_path / "p.safetensors"
    payload.save(path, {"x": torch.zeros(4)})
    os.truncate(path, path.stat().st_size - 4)
    with pytest.raises(CaseFormatError) as excinfo:
        payload.describe(path)
    assert str(excinfo.value) == (
        f"{path}: tensor 'x' declares bytes 0..16 but the file holds 12 bytes of data "
        "(truncated?)")


@pytest.mark.usefixtures("no_data_read")
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_special_files_are_refused_before_opening(tmp_path: Path, kind: str) -> None:
    """A FIFO would block the reader forever and a device never ends: refused from the stat."""
    path = tmp_path / "inputs.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")  # a link to it is refused earlier (next test)
    else:
        path.mkdir()
    what = {"fifo": "a FIFO (named pipe)", "device": "a character device",
            "directory": "a directory"}[kind]
    for read in (payload.describe, payload.load, payload.content_hash):
        with pytest.raises(CaseFormatError) as excinfo:
            read(path)
        assert str(excinfo.value) == (
            f"{path}: is {what}, not a regular file; replace it with the safetensors file; "
            f"{RESAVE}")


def test_a_payload_linked_from_outside_its_case_directory_is_refused(tmp_path: Path) -> None:
    # As case.toml and case.py are: a copy of the case would lose the file, and the case
    # would read whatever its author pointed at. A link inside the directory is read.
    outside, case_dir = tmp_path / "elsewhere", tmp_path / "case"
    outside.mkdir()
    case_dir.mkdir()
    payload.save(outside / "inputs.safetensors", {"x": torch.ones(2)})
    payload.save(case_dir / "saved.safetensors", {"x": torch.ones(3)})
    for target in (outside / "inputs.safetensors", Path("/dev/zero"), Path("../elsewhere")):
        link = case_dir / "inputs.safetensors"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        for read in (payload.describe, payload.load, payload.content_hash):
            with pytest.raises(CaseFormatError) as excinfo:
                read(link)
            assert str(excinfo.value) == (
                f"{link}: is a symlink to {target}, outside the case directory; replace it "
                "with the file itself")
    link.unlink()
    link.symlink_to("saved.safetensors")
    assert payload.load(link)["x"].shape == (3,)
    # A chain whose first hop is inside names where it ends; a loop is refused, not a crash.
    (case_dir / "hop").symlink_to(outside / "inputs.safetensors")
    link.unlink()
    link.symlink_to("hop")
    with pytest.raises(CaseFormatError, match=r"is a symlink to hop \(which leads to "
                       r".*elsewhere/inputs\.safetensors\), outside the case directory"):
        payload.describe(link)
    link.unlink()
    link.symlink_to("inputs.safetensors")
    for read in (payload.describe, payload.load, payload.content_hash):
        with pytest.raises(CaseFormatError) as excinfo:
            read(link)
        assert str(excinfo.value) == (f"{link}: is a symlink to inputs.safetensors that leads "
                                      "back to itself (a loop); replace it with the file itself")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "inputs.safetensors"
    with pytest.raises(CaseFormatError) as excinfo:
        payload.describe(path)
    assert str(excinfo.value) == (
        f"{path}: cannot be read: [Errno 2] No such file or directory: '{path}'")


# --- tensors whose memory is not plainly readable ----------------------------------------------
# Reading their storage directly is a segmentation fault (a null or dangling pointer): their
# values are had through torch, or they are refused by name.

def _functional() -> torch.Tensor:
    inner = torch.arange(4.0)
    wrapped = torch._to_functional_tensor(inner)
    wrapped.add_(1)  # pending in the wrapper until synced
    return wrapped


def _escaped_from_grad() -> torch.Tensor:
    escaped: list[torch.Tensor] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        escaped.append(x * 2)  # a functorch wrapper outliving its transform
        return x.sum()

    torch.func.grad(loss)(torch.arange(3.0))
    return escaped[0]


UNREADABLE: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]] = {
    "zero_tensor": (lambda: torch._efficientzerotensor(4), torch.zeros(4)),
    "zero_tensor_transposed": (lambda: torch._efficientzerotensor(2, 3, dtype=torch.float64).t(),
                               torch.zeros(3, 2, dtype=torch.float64)),
    "zero_tensor_conj": (lambda: torch._efficientzerotensor(3, dtype=torch.complex64).conj(),
                         torch.zeros(3, dtype=torch.complex64)),
    "functional": (_functional, torch.arange(1.0, 5.0)),
    "functorch_wrapper": (_escaped_from_grad, torch.arange(3.0) * 2),
}


@pytest.mark.parametrize("kind", UNREADABLE)
def test_a_tensor_without_readable_memory_is_saved_by_its_values(tmp_path: Path,
                                                                  kind: str) -> None:
    make, values = UNREADABLE[kind]
    tensor = make()
    assert readable_address(tensor, tensor.numel() * tensor.element_size()) is None
    payload.save(tmp_path / "p.safetensors", {"x": tensor, "y": torch.ones(2)})
    loaded = payload.load(tmp_path / "p.safetensors")
    assert torch.equal(loaded["x"], values) and loaded["x"].is_contiguous()
    assert torch.equal(loaded["y"], torch.ones(2))
    assert torch.equal(payload.to_device(make(), "cpu"), values)


@pytest.mark.parametrize("kind", ["contiguous", "sliced_with_offset", "conj_view", "neg_view",
                                  "empty", "empty_with_offset"])
def test_a_readable_tensor_is_read_in_place(kind: str) -> None:
    tensor = TENSORS[kind]()
    assert payload.readable(tensor) is tensor  # no copy: its own layout is what is saved


def _freed() -> torch.Tensor:
    view = torch.arange(6.0)[2:]
    view.untyped_storage().resize_(0)  # what FSDP does to a sharded parameter
    return view


def _shrunk() -> torch.Tensor:
    tensor = torch.arange(6.0)
    tensor.untyped_storage().resize_(8)  # two of its six elements are left
    return tensor


def _escaped_from_vmap() -> torch.Tensor:
    escaped: list[torch.Tensor] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        escaped.append(x * 3)  # batched: it has no value outside vmap
        return x

    torch.func.vmap(body)(torch.ones(2, 3))
    return escaped[0]


@pytest.mark.parametrize(("make", "problem"), [
    (_freed, "reads 16 bytes from a storage of 0 bytes (freed or resized under it)"),
    (_shrunk, "reads 24 bytes from a storage of 8 bytes (freed or resized under it)"),
    (lambda: torch.empty(3, device="meta"), "is a meta tensor: it has a shape but no values"),
    (_escaped_from_vmap, "cannot be read (Either your tensor may have escaped"),
])
def test_a_tensor_whose_values_cannot_be_had_is_refused_by_name(
        tmp_path: Path, make: Callable[[], torch.Tensor], problem: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        payload.save(tmp_path / "p.safetensors", {"ok": torch.ones(2), "out[0]": make()})
    message = str(excinfo.value)
    assert message.startswith("out[0]: a torch.float32 tensor of shape [")
    assert problem in message and "save a plain copy of its values" in message
    assert os.listdir(tmp_path) == []



def test_a_tensor_load_would_refuse_is_never_written(tmp_path: Path) -> None:
    """An expanded tensor declares 2**40 elements: written, every later load refused it."""
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match=r"declares 1099511627776 elements, over the limit"):
        payload.save(path, {"x": torch.tensor(1.0).expand(2**20, 2**20)})
    assert not path.exists()


def test_tensors_inside_torch_func_grad_are_saved_by_their_values(tmp_path: Path) -> None:
    """A case captured inside a grad transform: its tensors are wrappers, and an op on a
    plain tensor there is wrapped again; saved, they read back as their values."""
    path = tmp_path / "inside.safetensors"

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        payload.save(path, {"x": x, "y": y, "strided": y[::2]})
        return y.sum()

    torch.func.grad(step)(torch.arange(3.0))
    back = payload.load(path)
    assert torch.equal(back["x"], torch.arange(3.0))
    assert torch.equal(back["y"], torch.arange(3.0) * 2)
    assert torch.equal(back["strided"], torch.tensor([0.0, 4.0]))


def test_a_small_payload_is_loaded_whole_and_a_large_one_not(tmp_path: Path) -> None:
    small, large = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    x = torch.arange(12.0).reshape(3, 4).t()  # a layout of its own: kept
    payload.save(small, {"x": x})
    payload.save(large, {"y": torch.zeros(1 << 15)})  # 128 KiB
    loaded = payload.load_small(small)
    assert loaded is not None and torch.equal(loaded["x"], x)
    assert loaded["x"].stride() == payload.load(small)["x"].stride() == x.stride()
    assert payload.load_small(large) is None
    assert payload.load_small(tmp_path / "absent.safetensors") is None

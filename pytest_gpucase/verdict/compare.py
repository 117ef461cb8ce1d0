"""Nested output comparison with per-dtype tolerances and a mismatch report.

The comparison walks actual and expected outputs together (tensors, Python
numbers, None, strings, sequences, mappings), checks structure and tensor
attributes before values, and collects every mismatch with its path.

Tensor values are compared on the actual tensor's device in chunks, fast path
first: a chunk whose values are equal costs one equality test (which also
proves it holds no NaN; on the CPU a ``memcmp`` and a sum, several times
faster than ``torch.equal``); any other chunk costs one screening pass of a few
cache-resident elementwise ops and one fused reduction that yields its
greatest absolute, relative and excess-over-tolerance errors. Only a chunk
the screen cannot clear is decided element by element, and its accounting is
bounded: a sum counts its mismatches, one max reduction finds its worst
element, and the few worst candidates are drawn only from chunks that can
still hold one of them. No temporary is ever the size of the tensor, and
nothing but a few scalars reaches the host. On the CPU, a tensor of several
chunks is shared by worker threads that each run single-threaded torch ops:
one barrier per call instead of one per op, which is what keeps a comparison
fast while other processes compete for the cores. Small tensors of one dtype
in a nested output are batched into one flat pass. A single pair skips the
walk when the equality test (up to one chunk) or the screen alone (up to
65,536 elements) settles it: a few torch calls, the same ops and verdict as
the walk's chunk.

What counts as close (the tolerances and the rule that applies them) is
``tolerance``'s.
"""

from __future__ import annotations

import cmath
import ctypes
import dataclasses
import functools
import math
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pytest_gpucase.base import backends
from pytest_gpucase.base.tensors import field_names, readable_address, tuple_fields
from pytest_gpucase.verdict.stats import NonFinite, TensorStats
from pytest_gpucase.verdict.tolerance import (
    DEFAULT_TOLERANCES,
    EXACT,
    Tolerance,
    compute_dtype,
    is_nan,
    nan_max,
    relative,
    scalar_close,
    spacing,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "DEFAULT_TOLERANCES",
    "DEVICE_CHUNK_ELEMENTS",
    "SMALL_ELEMENTS",
    "Comparison",
    "Mismatch",
    "Tolerance",
    "combine",
    "compare",
]

# Elements per chunk on the CPU: small enough that a chunk's scratch rows stay
# in cache between the few elementwise passes, large enough that per-op
# dispatch stays a small part (measured by benchmarks/bench_compare.py).
CHUNK_ELEMENTS = 1 << 18
# Elements per chunk on accelerators, where bandwidth is high and every chunk
# costs kernel launches and a host synchronization.
DEVICE_CHUNK_ELEMENTS = 1 << 22
# Tensors of at most this many elements in a nested output are batched with
# the others of their dtype and device into one flat pass: per call, a torch
# op costs microseconds whatever its size.
SMALL_ELEMENTS = 1 << 12
# A batch is compared once it holds this many elements.
_BATCH_ELEMENTS = 1 << 18
# Worker threads are started only for tensors of at least this many chunks
# each: on a loaded machine starting one costs as much as several chunks.
_MIN_CHUNKS_PER_WORKER = 8
# Below torch's grain size (32768 elements) an op runs in the calling thread
# anyway; a chunk's ops reduce several rows at once.
_GRAIN_ELEMENTS = 1 << 12
# A chunk whose NaN and inf are at most one in this many elements decides them
# by index, and the rest as a finite chunk; with more, every test on every element.
_SPECIAL_SHARE = 4


@dataclass(frozen=True)
class Mismatch:
    """One problem found at one path of the output."""

    path: str
    kind: str  # "structure" | "type" | "shape" | "dtype" | "device" | "values"
    message: str
    mismatched: int = 0
    total: int = 0
    max_abs: float | None = None
    max_rel: float | None = None


@dataclass(frozen=True)
class Comparison:
    """Every mismatch between two outputs, and how far apart their values were."""

    mismatches: tuple[Mismatch, ...]
    # Greatest absolute and relative difference over all compared tensors and
    # numbers, passing or not (for JSON results); None when nothing numeric.
    # Matching specials (inf == inf, NaN with equal_nan) count as 0; a NaN
    # difference anywhere makes these NaN, as the failure text says.
    max_abs: float | None
    max_rel: float | None

    @property
    def ok(self) -> bool:
        """Whether the outputs matched everywhere."""
        return not self.mismatches

    def headline(self) -> str:
        """The first mismatch in one line, for a failure's summary line (``-r``, a CI log,
        junit's message): where, and how many elements by how much; the count of the rest."""
        if not self.mismatches:
            return "nothing differs"
        first = self.mismatches[0]
        if first.kind == "values" and first.total > 1:
            line = f"{first.path}: {first.mismatched} / {first.total} elements differ"
            if first.max_abs is not None:
                line += f", greatest absolute difference {_num(first.max_abs)}"
        else:
            line = first.message.split("\n", 1)[0]
        more = len(self.mismatches) - 1
        if more:
            line += f"; {more} more path{'s' if more > 1 else ''} differ{'' if more > 1 else 's'}"
        return line

    def report(self) -> str:
        """Return all mismatch messages, top-down, ready for a pytest failure; with more
        than a few, a first line says how many (a long report is clipped in the middle)."""
        lines = [m.message for m in self.mismatches]
        if len(lines) > _COUNTED_FROM:
            lines.insert(0, f"{len(lines)} paths of the output differ:")
        return "\n".join(lines)


def combine(parts: Iterable[Comparison]) -> Comparison:
    """One Comparison of several, in order; a NaN greatest difference stays NaN."""
    parts = list(parts)
    return Comparison(
        mismatches=tuple(m for p in parts for m in p.mismatches),
        max_abs=_greatest(p.max_abs for p in parts),
        max_rel=_greatest(p.max_rel for p in parts),
    )


def _greatest(values: Iterable[float | None]) -> float | None:
    result: float | None = None
    for value in values:
        if value is not None:
            result = value if result is None else nan_max(result, value)
    return result


def compare(
    actual: object,
    expected: object,
    *,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
    equal_nan: bool = False,
    check_dtype: bool = True,
    path: str = "out",
    worst: int = 5,
) -> Comparison:
    """Compare a nested output against the expected one and collect every mismatch."""
    if worst < 0:
        raise ValueError(f"worst must be >= 0, got {worst}")
    table = {**DEFAULT_TOLERANCES, **tolerances} if tolerances else DEFAULT_TOLERANCES
    try:
        if _equal_tensors(actual, expected):
            return Comparison((), 0.0, 0.0)
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            close = _small_close(actual, expected, table, check_dtype)
            if close is not None:
                return close
    except _TORCH_REFUSALS:
        pass  # a dtype or layout torch cannot compare: the walk says so at its path
    walk = _Walk(
        tolerances=table,
        equal_nan=equal_nan,
        check_dtype=check_dtype,
        worst=worst,
    )
    # Outputs may carry autograd history; out= kernels refuse such inputs.
    with torch.no_grad():
        walk.value(actual, expected, path)
        walk.flush()
    mismatches = tuple(
        item if isinstance(item, Mismatch) else item.mismatch
        for item in walk.items
        if isinstance(item, Mismatch) or item.mismatch is not None
    )
    return Comparison(mismatches, walk.max_abs, walk.max_rel)  # type: ignore[arg-type]


def _equal_tensors(actual: object, expected: object) -> bool:
    """The fast path of a single tensor pair: equal values (so no NaN) in one cheap call.

    Up to one chunk: the walk would judge such a pair as one chunk, whose
    first test is this one, so an unequal pair pays one early-stopping read
    of at most a chunk twice; beyond, the walk's own whole-tensor test does it.
    """
    return (
        isinstance(actual, torch.Tensor)
        and isinstance(expected, torch.Tensor)
        and actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and actual.device == expected.device
        and actual.layout == torch.strided
        and expected.layout == torch.strided
        and not actual.is_meta
        and 0 < actual.numel() <= _chunk_elements(actual.device)
        and _equal(actual, expected)
    )


# Beyond this many mismatching paths, a report starts with their count.
_COUNTED_FROM = 10
_SCREENED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Up to this many elements the walk's own bookkeeping costs more than the screen, which
# the shortcut then saves; beyond, a pair the screen cannot clear would pay it twice.
_SCREEN_ONLY_ELEMENTS = 1 << 16


def _small_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: Mapping[torch.dtype, Tolerance],
    check_dtype: bool,
) -> Comparison | None:
    """The fast path of a small single floating pair that is close: the screen alone.

    The same ops and the same test as the screen of the full path's one
    chunk (`_Judge.floating_chunk`), so the same verdict and the same
    greatest differences, with none of the walk's bookkeeping: a handful of
    torch calls, single-threaded past torch's grain size as the walk's are.
    None when the screen cannot clear the pair (a mismatch, a NaN or inf, a
    value near the bound): the full path then decides and words the message.
    """
    if not (
        actual.dtype in _SCREENED_DTYPES
        and expected.dtype in _SCREENED_DTYPES
        and (actual.dtype == expected.dtype or not check_dtype)
        and actual.shape == expected.shape
        and actual.device == expected.device
        and actual.layout == torch.strided
        and expected.layout == torch.strided
        and not actual.is_meta
        and 0 < actual.numel() <= min(_SCREEN_ONLY_ELEMENTS, _chunk_elements(actual.device))
    ):
        return None
    threads = torch.get_num_threads()
    if actual.numel() <= _GRAIN_ELEMENTS or threads <= 1 or actual.device.type != "cpu":
        return _screened(actual, expected, tolerances)
    torch.set_num_threads(1)  # as _compare_values does: no barrier per op under load
    try:
        return _screened(actual, expected, tolerances)
    finally:
        torch.set_num_threads(threads)


def _screened(
    actual: torch.Tensor, expected: torch.Tensor, tolerances: Mapping[torch.dtype, Tolerance]
) -> Comparison | None:
    tol = tolerances.get(actual.dtype, EXACT)
    screen = _screen(actual.dtype, expected.dtype, actual.device, tol)
    a, e = actual, expected
    if a.requires_grad or e.requires_grad:  # no graph is built for a verdict
        a, e = a.detach(), e.detach()
    if a.dtype != screen.cdt:
        a = a.to(screen.cdt)
    if e.dtype != screen.cdt:
        e = e.to(screen.cdt)
    diff = torch.sub(a, e).abs_()
    scale = torch.abs(e)
    rows = torch.stack((diff, torch.div(diff, scale)))
    # reshape: a channels_last or permuted pair stacks into rows no view can flatten.
    max_abs, max_rel = (rows if a.dim() == 1 else rows.reshape(2, -1)).amax(1).tolist()
    if not math.isfinite(max_abs):
        return None
    if math.isnan(max_rel):  # 0/0 where both sides hold an exact zero
        max_rel = float(rows[1].nan_to_num_(nan=0.0, posinf=math.inf).amax())
    # The third test's row only when the first two cannot clear the pair.
    if not screen.clears(max_abs, max_rel, math.inf):
        max_excess = float(torch.add(diff, scale, alpha=-tol.rtol).amax())
        if not screen.clears(max_abs, max_rel, max_excess):
            return None
    return Comparison((), nan_max(0.0, max_abs), nan_max(0.0, max_rel))


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp, or None where there is none to load (the test falls back)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, TypeError, AttributeError):
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _load_memcmp()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_BYTES_ARE_VALUES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


# Below this many bytes torch.equal's call costs no more than memcmp's.
_MEMCMP_BYTES = 1 << 12


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold equal values and no NaN.

    True is always right; False may also answer equal values whose bytes
    differ (-0.0 against 0.0), which every caller then judges the slow way.
    On the CPU, ``torch.equal`` reads at a fraction of memory speed (about
    a tenth of a sum's, measured by benchmarks/bench_compare.py); the C
    library's ``memcmp`` reads at memory speed and releases the GIL, and for
    floating dtypes a finite sum proves the equal bytes hold no NaN.
    """
    nbytes = actual.numel() * actual.element_size()
    if (
        _MEMCMP is None
        or nbytes < _MEMCMP_BYTES
        or actual.device.type != "cpu"
        or expected.device.type != "cpu"
        # Only dtypes whose bytes are their values (not quantized codes, whose
        # scale lives elsewhere, nor packed 4-bit ones, whose element_size lies).
        or actual.dtype not in _BYTES_ARE_VALUES
        or actual.dtype != expected.dtype
        or actual.shape != expected.shape
        # Only plain tensors: a subclass's data_ptr may be a wrapper's, a negative
        # view's bytes are the negation of its values.
        or type(actual) not in _PLAIN_TENSORS
        or type(expected) not in _PLAIN_TENSORS
        or actual.layout != torch.strided
        or expected.layout != torch.strided
        or actual.is_neg()
        or expected.is_neg()
        or not actual.is_contiguous()
        or not expected.is_contiguous()
    ):
        return torch.equal(actual, expected)
    a_ptr, e_ptr = readable_address(actual, nbytes), readable_address(expected, nbytes)
    if a_ptr is None or e_ptr is None:
        return torch.equal(actual, expected)
    if _MEMCMP(a_ptr, e_ptr, nbytes) != 0:
        return False
    if not actual.dtype.is_floating_point:
        return True
    # Equal bytes: NaN is the only way their values can differ.
    values = actual.detach()  # a reduction for a verdict builds no graph
    if actual.dtype == torch.float16:
        # Its sums overflow (65504); a max is NaN exactly where a NaN is.
        return not math.isnan(float(values.amax()))
    if actual.dtype in (torch.bfloat16, torch.float32, torch.float64):
        # A sum, the cheapest reduction (in bfloat16 several times cheaper
        # than a max, and than one accumulating in float32), is finite only
        # without NaN; an inf or an overflow leaves it to torch.equal.
        return math.isfinite(float(values.sum())) or torch.equal(actual, expected)
    return torch.equal(actual, expected)


# --------------------------------------------------------------------------
# Walking nested values


@dataclass
class _Leaf:
    """A small tensor pair waiting for its batch; its mismatch, once known."""

    path: str
    actual: torch.Tensor
    expected: torch.Tensor
    tol: Tolerance
    mismatch: Mismatch | None = None


@dataclass
class _Walk:
    """The state of one compare() call."""

    tolerances: Mapping[torch.dtype, Tolerance]
    equal_nan: bool
    check_dtype: bool
    worst: int
    # Mismatches in walk order, with the batched leaves in their places.
    items: list[Mismatch | _Leaf] = field(default_factory=list)
    max_abs: float | None = None
    max_rel: float | None = None
    scratch: _Scratch = field(default_factory=lambda: _Scratch())
    batches: dict[tuple[object, ...], list[_Leaf]] = field(default_factory=dict)
    batched: dict[tuple[object, ...], int] = field(default_factory=dict)

    def fail(self, path: str, kind: str, message: str) -> None:
        self.items.append(Mismatch(path, kind, f"{path}: {message}"))

    def note(self, max_abs: float, max_rel: float) -> None:
        self.max_abs = max_abs if self.max_abs is None else nan_max(self.max_abs, max_abs)
        self.max_rel = max_rel if self.max_rel is None else nan_max(self.max_rel, max_rel)

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, EXACT)

    def value(self, actual: object, expected: object, path: str) -> None:
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            if actual.is_nested or expected.is_nested:
                # A nested tensor is a list of tensors of different lengths: compared as one.
                if actual.is_nested and expected.is_nested:
                    self.sequence(actual.unbind(), expected.unbind(), path)
                else:
                    self.fail(path, "type", "type differs: actual "
                              f"{'nested ' if actual.is_nested else ''}Tensor vs expected "
                              f"{'nested ' if expected.is_nested else ''}Tensor")
                return
            try:
                self.tensor(actual, expected, path)
            except _TORCH_REFUSALS as exc:
                self.fail(path, "type", _refusal(actual, expected, exc))
        elif isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
            self.type_differs(actual, expected, path)
        elif actual is None or expected is None:
            if actual is not expected:
                self.type_differs(actual, expected, path)
        elif _is_number(actual) or _is_number(expected):
            self.number(actual, expected, path)
        elif isinstance(actual, (str, bytes)) or isinstance(expected, (str, bytes)):
            if type(actual) is not type(expected):
                self.type_differs(actual, expected, path)
            elif actual != expected:
                self.fail(
                    path, "values", f"values differ: actual {actual!r} vs expected {expected!r}"
                )
        elif isinstance(actual, Mapping) and isinstance(expected, Mapping):
            self.mapping(actual, expected, path)
        elif isinstance(actual, Sequence) and isinstance(expected, Sequence):
            self.sequence(actual, expected, path)
        else:
            self.other(actual, expected, path)

    def type_differs(self, actual: object, expected: object, path: str) -> None:
        self.fail(
            path,
            "type",
            f"type differs: actual {_type_name(actual)} vs expected {_type_name(expected)}",
        )

    def mapping(
        self, actual: Mapping[object, object], expected: Mapping[object, object], path: str
    ) -> None:
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append("missing " + ", ".join(repr(k) for k in missing))
            if extra:
                parts.append("extra " + ", ".join(repr(k) for k in extra))
            self.fail(path, "structure", "keys differ: " + "; ".join(parts))
            return
        for key in expected:
            self.value(actual[key], expected[key], f"{path}[{key!r}]")

    def sequence(self, actual: Sequence[object], expected: Sequence[object], path: str) -> None:
        # list and tuple are interchangeable (as in torch.testing); a named
        # tuple is a declared type, and its fields name the paths.
        fields = tuple_fields(expected)
        if (fields is not None or tuple_fields(actual) is not None) and type(actual) is not type(
            expected
        ):
            self.type_differs(actual, expected, path)
            return
        if len(actual) != len(expected):
            self.fail(
                path,
                "structure",
                f"length differs: actual {len(actual)} vs expected {len(expected)}",
            )
            return
        # A torch.return_types structseq (torch.max(x, dim=0)) names its items too, though
        # it is compared as a plain tuple: a golden stores it as one.
        names = fields or field_names(expected) or field_names(actual)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            sub = f"{path}.{names[i]}" if names is not None else f"{path}[{i}]"
            self.value(a, e, sub)

    def other(self, actual: object, expected: object, path: str) -> None:
        if type(actual) is not type(expected):
            self.type_differs(actual, expected, path)
            return
        if dataclasses.is_dataclass(actual) and not isinstance(actual, type):
            # Field by field, with tolerances: a dataclass's own == compares tensors
            # exactly, broadcasts them, or cannot decide at all.
            for item in dataclasses.fields(actual):
                self.value(getattr(actual, item.name), getattr(expected, item.name),
                           f"{path}.{item.name}")
            return
        by_value = ("outputs compared by value are tensors, numbers, strings, and lists, "
                    "tuples, dicts or dataclasses of them")
        if isinstance(actual, torch.nn.Module):
            self.fail(path, "type", f"cannot compare values of type {_type_name(actual)} (a "
                      f"module): return its outputs or its state_dict(); {by_value}")
            return
        try:
            equal = bool(actual == expected)
        except Exception as exc:  # an elementwise ==, or a user's __eq__ that fails
            self.fail(
                path,
                "type",
                f"cannot compare values of type {_type_name(actual)}: {type(exc).__name__}: {exc}",
            )
            return
        if equal:
            return
        shown_a, shown_e = _safe_repr(actual), _safe_repr(expected)
        note = ""
        if type(actual).__eq__ is object.__eq__ and " at 0x" in shown_a:
            # Only the same object is equal: right for an enum member or a dtype (which
            # say who they are), never for a generator or a plain object (shown by address).
            note = (f" (type {_type_name(actual)} defines no ==, so only the same object is "
                    f"equal; {by_value})")
        self.fail(path, "values", f"values differ: actual {shown_a} vs expected {shown_e}{note}")

    # -- Python numbers ------------------------------------------------------

    def number(self, actual: object, expected: object, path: str) -> None:
        kind_a, kind_e = _number_kind(actual), _number_kind(expected)
        if kind_a is None or kind_a != kind_e:
            self.type_differs(actual, expected, path)
            return
        if kind_a in ("bool", "int"):
            assert isinstance(actual, int) and isinstance(expected, int)
            gap = _as_float(abs(actual - expected))
            rel = relative(gap, _as_float(abs(expected)))
            if kind_a == "int":
                self.note(gap, rel)
            if actual != expected:
                message = f"{path}: values differ: actual {actual!r} vs expected {expected!r}"
                self.items.append(Mismatch(path, "values", message, 1, 1, gap, rel))
            return
        assert isinstance(actual, (float, complex)) and isinstance(expected, (float, complex))
        dtype = torch.float64 if kind_a == "float" else torch.complex128
        tol = self.tolerance(dtype)
        try:
            abs(actual), abs(expected), abs(actual - expected)
        except OverflowError:  # complex(1.5e308, 1.5e308): a modulus beyond a float's range
            if actual != expected:
                self.fail(path, "values", f"values differ: actual {actual!r} vs expected "
                          f"{expected!r} (a modulus beyond a float's range: not measured)")
            return
        diff = abs(actual - expected)
        verdict = scalar_close(actual, expected, diff, tol, self.equal_nan, dtype)
        # Matching specials count as no difference; a NaN or inf mismatch as itself.
        effective = 0.0 if verdict and not math.isfinite(diff) else diff
        self.note(effective, relative(effective, abs(expected)))
        if not verdict:
            message = _scalar_message(
                path, actual, expected, dtype, dtype, tol, self.equal_nan, exact=False
            )
            self.items.append(
                Mismatch(path, "values", message, 1, 1, diff, relative(diff, abs(expected)))
            )

    # -- tensors -------------------------------------------------------------

    def tensor(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        # Each attribute read once: this runs per tensor of a nested output, thousands
        # of times for a model's state, where each read of a tensor attribute counts.
        shape, a_dtype, e_dtype = actual.shape, actual.dtype, expected.dtype
        if shape != expected.shape:
            self.fail(
                path,
                "shape",
                f"shape differs: actual {tuple(shape)} vs expected {tuple(expected.shape)}",
            )
            return
        if a_dtype != e_dtype and self.check_dtype:
            self.fail(path, "dtype", f"dtype differs: actual {a_dtype} vs expected {e_dtype}")
            return
        if a_dtype != e_dtype and {a_dtype, e_dtype} & _WIDENED_UNSIGNED and {
                a_dtype, e_dtype} <= _WIDENED_INTEGERS:
            # torch promotes no uint16/uint32 with another integer; int64 holds both exactly.
            actual, expected = actual.to(torch.int64), expected.to(torch.int64)
            a_dtype = e_dtype = torch.int64
        if a_dtype == torch.complex32 or e_dtype == torch.complex32:
            # Few CPU ops take complex32; complex64 holds its values exactly.
            actual = actual.to(torch.complex64) if a_dtype == torch.complex32 else actual
            expected = expected.to(torch.complex64) if e_dtype == torch.complex32 else expected
            a_dtype, e_dtype = actual.dtype, expected.dtype
        if actual.is_quantized or expected.is_quantized:
            # A quantized tensor's values are its codes times its scale: compared as such.
            actual = actual.dequantize() if actual.is_quantized else actual
            expected = expected.dequantize() if expected.is_quantized else expected
            a_dtype, e_dtype = actual.dtype, expected.dtype
        if a_dtype != e_dtype:
            kind_a, kind_e = _dtype_kind(a_dtype), _dtype_kind(e_dtype)
            if kind_a != kind_e:
                self.fail(
                    path,
                    "dtype",
                    f"dtype kind differs: actual {a_dtype} ({kind_a}) "
                    f"vs expected {e_dtype} ({kind_e})",
                )
                return
        if actual.is_meta or expected.is_meta:
            side = "actual" if actual.is_meta else "expected"
            self.fail(path, "device", f"{side} is a meta tensor: it holds no values to compare")
            return
        layout = actual.layout
        if layout != expected.layout:
            self.fail(
                path,
                "type",
                f"layout differs: actual {layout} vs expected {expected.layout}",
            )
            return
        if layout != torch.strided:
            if actual.numel() > _DENSE_ELEMENTS:
                self.sparse(actual, expected, path)
                return
            # A sparse output of moderate size: its dense form is compared.
            actual, expected = actual.to_dense(), expected.to_dense()
        floating = a_dtype.is_floating_point or a_dtype.is_complex
        tol = self.tolerance(a_dtype) if floating else EXACT
        numel = actual.numel()
        if numel <= SMALL_ELEMENTS:
            leaf = _Leaf(path, actual, expected, tol)
            self.items.append(leaf)
            key = (a_dtype, e_dtype, actual.device, expected.device)
            batch = self.batches.get(key)
            if batch is None:
                batch = self.batches[key] = []
            batch.append(leaf)
            size = self.batched.get(key, 0) + numel
            self.batched[key] = size
            if size >= _BATCH_ELEMENTS:
                self.flush_batch(key)
            return
        self.leaf(_Leaf(path, actual, expected, tol), record=True)

    def sparse(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        """A sparse pair too large to make dense (a graph's adjacency matrix): the stored
        positions must agree, then their values are compared with the tolerances."""
        a = (actual if actual.layout == torch.sparse_coo else actual.to_sparse()).coalesce()
        e = (expected if expected.layout == torch.sparse_coo else expected.to_sparse()).coalesce()
        if not torch.equal(a.indices(), e.indices()):
            self.fail(path, "structure", f"sparsity differs: actual stores {a._nnz()} "
                      f"positions, expected {e._nnz()}, not the same ones (a tensor of "
                      f"{actual.numel()} elements is too large to compare densely)")
            return
        self.value(a.values(), e.values(), f"{path}.values()")

    def leaf(self, leaf: _Leaf, record: bool = False) -> None:
        """Compare one tensor pair on its own; record its mismatch (in place or appended)."""
        try:
            stats = _compare_values(
                leaf.actual, leaf.expected, leaf.tol, self.equal_nan, max(self.worst, 1),
                self.scratch,
            )
        except _TORCH_REFUSALS as exc:
            message = _refusal(leaf.actual, leaf.expected, exc)
            leaf.mismatch = Mismatch(leaf.path, "type", f"{leaf.path}: {message}")
            if record:
                self.items.append(leaf.mismatch)
            return
        if stats.compared:
            self.note(stats.max_abs, stats.max_rel)
        if stats.mismatched:
            leaf.mismatch = _values_mismatch(
                leaf.path, leaf.actual, leaf.expected, leaf.tol, stats, self.worst, self.equal_nan
            )
            if record:
                self.items.append(leaf.mismatch)

    def flush(self) -> None:
        for key in list(self.batches):
            self.flush_batch(key)

    def flush_batch(self, key: tuple[object, ...]) -> None:
        leaves = self.batches.pop(key, [])
        self.batched.pop(key, None)
        self.judge_batch(leaves)

    def judge_batch(self, leaves: list[_Leaf]) -> None:
        """One flat pass over many small pairs; halves are judged again only where one fails."""
        if len(leaves) == 1:
            self.leaf(leaves[0])
            return
        if not leaves:
            return
        try:
            actual = torch.cat([_flat(leaf.actual) for leaf in leaves])
            expected = torch.cat([_flat(leaf.expected) for leaf in leaves])
            stats = _compare_values(actual, expected, leaves[0].tol, self.equal_nan, 1,
                                    self.scratch)
        except _TORCH_REFUSALS:
            for leaf in leaves:  # each says what torch refused
                self.leaf(leaf)
            return
        if not stats.mismatched:
            if stats.compared:
                self.note(stats.max_abs, stats.max_rel)
            return
        half = len(leaves) // 2
        self.judge_batch(leaves[:half])
        self.judge_batch(leaves[half:])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one row for ``torch.cat``: itself when it is one already (no view made)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _is_number(x: object) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _number_kind(x: object) -> str | None:
    # bool before int: bool is an int subclass, but True vs 1 is a type change.
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("complex", complex)):
        if isinstance(x, types):
            return kind
    return None


# What torch raises for an operation a dtype, layout or tensor kind does not support
# ("equal_cpu" not implemented for 'ComplexHalf', a promotion of uint32, a nested
# tensor's sizes): a failure of that output, said as such, never a crash of the comparison.
_TORCH_REFUSALS = (RuntimeError, NotImplementedError, TypeError)
_WIDENED_UNSIGNED = frozenset({torch.uint16, torch.uint32})
# A sparse pair of more elements than this is compared by its stored values, not densely.
_DENSE_ELEMENTS = 1 << 26
_WIDENED_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                               torch.uint16, torch.uint32})


def _refusal(actual: torch.Tensor, expected: torch.Tensor, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"cannot compare {_a(_tensor_kind(actual))} with {_a(_tensor_kind(expected))}: torch "
            f"says {first}; return a tensor torch can compare (e.g. .to(torch.float32))")


def _tensor_kind(t: torch.Tensor) -> str:
    layout = "" if t.layout == torch.strided else f"{str(t.layout).removeprefix('torch.')} "
    nested = "nested " if getattr(t, "is_nested", False) else ""
    return f"{nested}{layout}{str(t.dtype).removeprefix('torch.')} tensor on {t.device.type}"


def _a(noun: str) -> str:
    return f"an {noun}" if noun.startswith("int") else f"a {noun}"


def _as_float(x: int) -> float:
    """An int as a float; inf where it is beyond a float's range (an int of 400 digits)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _safe_repr(x: object) -> str:
    """``repr(x)``, or a placeholder when the object's own ``__repr__`` fails."""
    try:
        return repr(x)
    except Exception as exc:
        return f"<{_type_name(x)} whose repr raised {type(exc).__name__}>"


def _type_name(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return "Tensor"
    return type(x).__qualname__


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


# --------------------------------------------------------------------------
# Scalars (Python numbers; also the 0-dim tensor message)


def _scalar_message(
    path: str,
    actual: complex,
    expected: complex,
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
    equal_nan: bool,
    exact: bool,
) -> str:
    diff = _abs_diff(actual, expected)
    lines = [
        "{}: values differ: actual {} vs expected {}".format(
            path, *_fmt_pair(actual, expected, actual_dtype, expected_dtype))
    ]
    if exact:
        return lines[0]
    ulps_only = _ulps_only(tol)
    lines.append(f"  Absolute difference: {_num(diff)}{_allowed(tol.atol, ulps_only)}")
    lines.append(f"  Relative difference: {_num(relative(diff, abs(expected)))}"
                 f"{_allowed(tol.rtol, ulps_only)}")
    lines.append(f"  Tolerance: {_tolerance_text(tol, actual_dtype)}")
    a_nan, e_nan = is_nan(actual), is_nan(expected)
    counts = NonFinite(
        nan_actual=int(a_nan),
        nan_both=int(a_nan and e_nan),
        inf_actual=int(not a_nan and math.isinf(abs(actual))),
        inf_expected_too=int(
            not a_nan and math.isinf(abs(actual)) and not math.isfinite(abs(expected))
        ),
        nan_expected_only=int(e_nan and not a_nan),
    )
    lines.extend(_nonfinite_lines(counts, 1, expected_dtype, equal_nan))
    ulp = _ulp_line(diff, expected, actual_dtype, expected_dtype, tol)
    if ulp is not None:
        lines.append(f"  Difference is {ulp}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Tensor values: chunks, each settled by the cheapest test that can


class _Scratch:
    """Per-chunk buffers reused across the chunks and tensors of one worker."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n]

    def rows(self, count: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`count` rows of n elements, contiguous, so that one reduction covers several."""
        return self.get("rows", count * n, dtype, device).view(count, n)

    def load(
        self, name: str, piece: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return the piece as a flat contiguous tensor of that dtype on that device."""
        if piece.dtype == dtype and piece.device == device and piece.is_contiguous():
            return piece.view(-1)
        if piece.device != device and piece.dtype != dtype:
            # Convert where the piece lives: some backends (MPS) hold no float64.
            piece = piece.to(dtype)
        buf = self.get(name, piece.numel(), dtype, device)
        buf.view(piece.shape).copy_(piece)
        return buf


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


def _pieces(
    actual: torch.Tensor, expected: torch.Tensor, chunk: int, offset: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (flat offset, actual piece, expected piece) in row-major order, <= chunk each.

    Pieces are views: a non-contiguous one is copied into a chunk-sized buffer
    only when its values are needed, so no copy the size of the tensor is made.
    """
    n = actual.numel()
    if n == 0:
        return
    if actual.is_contiguous() and expected.is_contiguous():
        flat_a, flat_e = actual.view(-1), expected.view(-1)
        for start in range(0, n, chunk):
            yield offset + start, flat_a[start : start + chunk], flat_e[start : start + chunk]
        return
    # A non-contiguous tensor is cut along its leading dimension.
    rows = actual.shape[0]
    inner = n // rows
    if inner <= chunk:
        step = max(1, chunk // inner)
        for r in range(0, rows, step):
            yield offset + r * inner, actual[r : r + step], expected[r : r + step]
    else:
        for r in range(rows):
            yield from _pieces(actual[r], expected[r], chunk, offset + r * inner)


def _compare_values(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    equal_nan: bool,
    keep: int,
    scratch: _Scratch,
) -> TensorStats:
    """Compare the values of two strided tensors of one shape; return what they add up to."""
    stats = TensorStats(keep)
    n = actual.numel()
    if n == 0:
        return stats
    chunk = _chunk_elements(actual.device)
    if (
        n > chunk
        and actual.dtype == expected.dtype
        and actual.device == expected.device
        and _equal(actual, expected)
    ):
        # Equal tensors, the common case of a fixed bug: one read, and one
        # parallel region; unequal ones stop at their first difference.
        stats.note(0.0, 0.0)
        return stats
    judge = _Judge(actual, expected, tol, equal_nan)
    pieces = _pieces(actual, expected, chunk)
    cpu = actual.device.type == "cpu" and expected.device.type == "cpu"
    threads = torch.get_num_threads() if cpu and n > _GRAIN_ELEMENTS else 1
    if threads <= 1:
        for offset, a, e in pieces:
            judge(scratch, stats, offset, a, e)
        return stats
    # Every op of a chunk would be one parallel region of `threads` threads;
    # while another process holds a core, each region waits for its slowest
    # thread. Single-threaded ops, in as many threads as torch would use, each
    # taking the next chunk when done, share the work without a barrier per
    # op and skip none of it when one of them is descheduled.
    workers = min(threads, -(-n // chunk) // _MIN_CHUNKS_PER_WORKER)
    torch.set_num_threads(1)  # this thread's own setting (OpenMP's is per thread)
    try:
        if workers <= 1:
            for offset, a, e in pieces:
                judge(scratch, stats, offset, a, e)
        else:
            _in_threads(judge, pieces, workers, stats)
    finally:
        # torch.set_num_threads also sets the default of threads started
        # later, ours included: put back the caller's.
        torch.set_num_threads(threads)
    return stats


def _in_threads(
    judge: _Judge,
    pieces: Iterator[tuple[int, torch.Tensor, torch.Tensor]],
    workers: int,
    stats: TensorStats,
) -> None:
    """Judge the pieces in `workers` threads (this one included), each taking the next piece."""
    lock = threading.Lock()
    results: list[TensorStats] = []
    errors: list[BaseException] = []

    def work() -> None:
        local, local_scratch = TensorStats(stats.keep), _Scratch()
        try:
            torch.set_num_threads(1)
            while not errors:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    break
                judge(local_scratch, local, *piece)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        with lock:
            results.append(local)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers - 1)]
    for thread in threads:
        thread.start()
    try:
        work()
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    for result in results:
        stats.merge(result)


@functools.cache
def _ranks(real: torch.dtype) -> tuple[float, float, float]:
    """eps of a dtype, and the ranks of NaN and inf mismatches: above every number."""
    info = torch.finfo(real)
    top = torch.tensor(info.max, dtype=real)
    return info.eps, info.max, float(torch.nextafter(top, torch.zeros_like(top)))


@dataclass(frozen=True)
class _Screen:
    """What proves a floating chunk close from its three greatest errors alone.

    Each test alone proves closeness; the margins cover the rounding of the
    screen's own arithmetic (done in `real`), so no mismatch slips through.
    """

    cdt: torch.dtype  # the dtype differences are computed in
    real: torch.dtype  # its real part's dtype
    atol: float
    abs_bound: float
    rel_bound: float
    slack: float  # per unit of max_abs + atol

    def clears(self, max_abs: float, max_rel: float, max_excess: float) -> bool:
        """Whether the chunk is close everywhere; max_abs finite, max_rel not NaN."""
        return (
            max_abs <= self.abs_bound
            or max_rel <= self.rel_bound
            or max_excess <= self.atol - self.slack * (max_abs + self.atol)
        )


@functools.lru_cache(maxsize=256)
def _screen(
    actual: torch.dtype, expected: torch.dtype, device: torch.device, tol: Tolerance
) -> _Screen:
    cdt = compute_dtype(actual, expected, device)
    real = cdt.to_real()
    eps = _ranks(real)[0]
    margin = 1 - 4 * eps
    ulp_rel = 0.0
    if tol.ulps is not None:
        # The spacing at |e| is more than |e| * eps / 2 in the actual dtype.
        ulp_rel = tol.ulps * torch.finfo(actual.to_real()).eps / 2
    return _Screen(
        cdt=cdt,
        real=real,
        atol=tol.atol,
        abs_bound=tol.atol * margin,
        rel_bound=max(tol.rtol, ulp_rel) * margin,
        slack=8 * eps,
    )


class _Judge:
    """Decides the chunks of one tensor pair; its constants are computed once."""

    def __init__(
        self, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, equal_nan: bool
    ) -> None:
        self.device = actual.device
        self.actual_dtype, self.expected_dtype = actual.dtype, expected.dtype
        self.floating = actual.dtype.is_floating_point or actual.dtype.is_complex
        # Equal values prove a chunk equal, and (NaN != NaN) free of NaN.
        self.screen_equal = actual.dtype == expected.dtype and actual.device == expected.device
        self.tol, self.equal_nan = tol, equal_nan
        if self.floating:
            self.screen: _Screen | None = _screen(actual.dtype, expected.dtype, actual.device, tol)
            self.cdt, self.real = self.screen.cdt, self.screen.real
        else:
            self.screen = None
            self.cdt = actual.dtype
            self.real = torch.float64 if backends.float64_on(actual.device.type) else torch.float32
        _, self.nan_rank, self.inf_rank = _ranks(self.real)

    def __call__(
        self,
        scratch: _Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        if self.screen_equal and _equal(a_piece, e_piece):
            stats.note(0.0, 0.0)
            return
        if self.floating:
            self.floating_chunk(scratch, stats, offset, a_piece, e_piece)
        else:
            self.exact_chunk(scratch, stats, offset, a_piece, e_piece)

    def floating_chunk(
        self,
        scratch: _Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        tol = self.tol
        a = scratch.load("a", a_piece, self.cdt, self.device)
        e = scratch.load("e", e_piece, self.cdt, self.device)
        n = a.numel()
        rows = scratch.rows(5, n, self.real, self.device)
        diff, rel, excess, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        # The screen: four cache-resident passes and one reduction of three rows.
        if self.cdt.is_complex:
            torch.abs(torch.sub(a, e), out=diff)
        else:
            torch.sub(a, e, out=diff).abs_()
        torch.abs(e, out=scale)
        torch.div(diff, scale, out=rel)
        torch.add(diff, scale, alpha=-tol.rtol, out=excess)  # |a - e| - rtol * |e|
        max_abs, max_rel, max_excess = rows[:3].amax(dim=1).tolist()
        finite = math.isfinite(max_abs)
        if finite:
            if math.isnan(max_rel):  # 0/0 where both sides hold an exact zero
                max_rel = float(rel.nan_to_num_(nan=0.0, posinf=math.inf).amax())
            assert self.screen is not None
            if self.screen.clears(max_abs, max_rel, max_excess):
                stats.note(max_abs, max_rel)
                return
        # Element by element, as torch.isclose decides; 1.0 marks a mismatch.
        allowed = excess
        if self.cdt.is_complex:
            torch.abs(torch.mul(e, tol.rtol), out=allowed).add_(tol.atol)
        else:
            torch.mul(scale, tol.rtol, out=allowed).add_(tol.atol)
        if finite:
            self.finite_mismatch(diff, allowed, scale, mismatch)
            torch.nan_to_num(rel, posinf=self.inf_rank, out=scale)
            self.account(stats, offset, mismatch, diff, scale, allowed)
            stats.note(max_abs, max_rel)
            return
        # NaN and inf are usually few: found in one pass and decided by index,
        # the rest as in the finite case, with the specials set to no difference.
        # diff > max is False at NaN: 1.0 at every finite difference, counted by a sum.
        count = n - int(torch.le(diff, torch.finfo(self.real).max, out=mismatch).sum())
        if count > n // _SPECIAL_SHARE:
            self.nonfinite_chunk(stats, offset, a, e, rows)
            return
        special = _nonzero_positions(mismatch.neg_().add_(1.0), count)
        a_s, e_s = a.index_select(0, special), e.index_select(0, special)
        diff_s = diff.index_select(0, special)
        diff.index_fill_(0, special, 0.0)
        rel.index_fill_(0, special, 0.0).nan_to_num_(nan=0.0, posinf=math.inf)
        # The greatest differences of the finite elements, passing or not: with
        # the specials' (NaN or inf, where one mismatches) they make the chunk's.
        finite_abs, finite_rel = rows[:2].amax(dim=1).tolist()
        if finite_abs >= self.inf_rank or self.inf_rank <= finite_rel < math.inf:
            # A finite difference ranked as NaN or inf: the general code words it.
            diff.index_copy_(0, special, diff_s)
            rel.index_copy_(0, special, torch.where(torch.isinf(diff_s), math.inf, math.nan))
            self.nonfinite_chunk(stats, offset, a, e, rows)
            return
        self.finite_mismatch(diff, allowed, scale, mismatch)
        torch.nan_to_num(rel, posinf=self.inf_rank, out=scale)
        # A special is close only when both sides are equal (infinities of one
        # sign) or, with equal_nan, both NaN; it ranks as NaN or inf.
        close_s = a_s == e_s
        if self.equal_nan:
            close_s |= torch.isnan(a_s) & torch.isnan(e_s)
        mismatched_s = close_s.logical_not_()
        rank_s = torch.nan_to_num(diff_s, nan=self.nan_rank, posinf=self.inf_rank)
        mismatch.index_copy_(0, special, mismatched_s.to(mismatch.dtype))
        diff.index_copy_(0, special, rank_s)
        scale.index_copy_(0, special, rank_s)
        worst_abs, worst_rel = self.account(stats, offset, mismatch, diff, scale, allowed)
        stats.note(
            nan_max(finite_abs, self.unrank(worst_abs)), nan_max(finite_rel, self.unrank(worst_rel))
        )
        if special.numel() <= _FEW_SPECIALS:  # a few numbers: counted on the host
            stats.nonfinite.add(
                _nonfinite_of(a_s.tolist(), e_s.tolist(), mismatched_s.tolist())
            )
        else:
            stats.nonfinite.add(_nonfinite_counts(a_s, e_s, mismatched_s))

    def finite_mismatch(
        self, diff: torch.Tensor, allowed: torch.Tensor, scale: torch.Tensor, mismatch: torch.Tensor
    ) -> None:
        """Write 1.0 where a finite difference is past the tolerance, 0.0 elsewhere."""
        # Comparisons written to a float row: several times faster than to bool.
        torch.gt(diff, allowed, out=mismatch)
        if self.tol.ulps is not None:
            mismatch.mul_(diff > _spacing_tensor(scale, self.actual_dtype).mul_(self.tol.ulps))

    def nonfinite_chunk(
        self,
        stats: TensorStats,
        offset: int,
        a: torch.Tensor,
        e: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Decide a chunk where NaN or inf are many: every test on every element."""
        tol = self.tol
        diff, rel, allowed, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        excess = allowed
        close = diff <= allowed
        if tol.ulps is not None:
            close |= diff <= _spacing_tensor(scale, self.actual_dtype).mul_(tol.ulps)
        close &= torch.isfinite(diff)  # inf - inf and NaN are never "close"
        close |= a == e
        if self.equal_nan:
            close |= torch.isnan(a) & torch.isnan(e)
        torch.logical_not(close, out=mismatch)
        rel.masked_fill_(torch.isinf(diff), math.inf)  # inf / inf: infinitely far, not NaN
        # Matching specials count as no difference, mismatches as themselves.
        passing_abs = float(torch.nan_to_num(diff * close, nan=0.0, posinf=0.0).amax())
        passing_rel = float(torch.nan_to_num(rel * close, nan=0.0, posinf=math.inf).amax())
        torch.nan_to_num(rel, nan=self.nan_rank, posinf=self.inf_rank, out=scale)
        torch.nan_to_num(diff, nan=self.nan_rank, posinf=self.inf_rank, out=excess)
        worst_abs, worst_rel = self.account(stats, offset, mismatch, excess, scale, excess)
        stats.note(nan_max(passing_abs, self.unrank(worst_abs)),
                   nan_max(passing_rel, self.unrank(worst_rel)))
        if worst_abs > 0:
            stats.nonfinite.add(_nonfinite_counts(a, e, ~close))

    def unrank(self, rank: float) -> float:
        if rank >= self.nan_rank:
            return math.nan
        return math.inf if rank >= self.inf_rank else max(rank, 0.0)

    def exact_chunk(
        self,
        scratch: _Scratch,
        stats: TensorStats,
        offset: int,
        a_piece: torch.Tensor,
        e_piece: torch.Tensor,
    ) -> None:
        wide = self.real
        a = scratch.load("a", a_piece, wide, self.device)
        e = scratch.load("e", e_piece, wide, self.device)
        n = a.numel()
        rows = scratch.rows(5, n, wide, self.device)
        diff, rel, key, scale, mismatch = rows[0], rows[1], rows[2], rows[3], rows[4]
        # Equality in the dtypes themselves: float64 cannot tell 2**62 from 2**62 + 1.
        torch.ne(a_piece, e_piece.to(self.device), out=mismatch.view(a_piece.shape))
        torch.sub(a, e, out=diff).abs_()
        if self.actual_dtype == torch.bool:
            rel.copy_(diff)  # a relative difference of bools means nothing: 0 or 1
        else:
            torch.div(diff, torch.abs(e, out=scale), out=rel)
            rel.nan_to_num_(nan=0.0, posinf=math.inf)
        max_abs, max_rel = rows[:2].amax(dim=1).tolist()
        stats.note(max_abs, max_rel)
        # Ranked one above the difference: a mismatch of 2**62 + 1 against 2**62
        # differs by 0 in float64 and must still rank above the matches.
        torch.add(diff, 1.0, out=key)
        torch.nan_to_num(rel, posinf=self.inf_rank, out=scale).add_(1.0)
        self.account(stats, offset, mismatch, key, scale, key)

    def account(
        self,
        stats: TensorStats,
        offset: int,
        mismatch: torch.Tensor,
        rank: torch.Tensor,
        rel_rank: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[float, float]:
        """Count a chunk's mismatches and keep its worst: a few reductions, however many.

        `mismatch` holds 1.0 at mismatches and 0.0 elsewhere; `rank` and
        `rel_rank` rank the elements (positive at every mismatch); `key` may
        be `rank` itself. `rel_rank`, `key` and `mismatch` are overwritten.
        Returns the chunk's greatest ranks among mismatches.
        """
        count = int(mismatch.sum())
        if not count:
            return 0.0, 0.0
        stats.mismatched += count
        torch.mul(rel_rank, mismatch, out=rel_rank)
        worst_rel = float(rel_rank.amax())
        if stats.worst_rel is None or worst_rel > stats.worst_rel[0]:
            stats.add_rel(worst_rel, offset + _first_max(rel_rank))
        key = torch.mul(rank, mismatch, out=key)
        # One max per chunk; indices only while this chunk can still hold one
        # of the worst `keep` (the first chunk, or one worse than all kept).
        worst = float(key.amax())
        if not stats.admits(worst):
            return worst, worst_rel
        # The chunk's worst by (-rank, index), as add_worst orders them: the
        # greatest ranks, and where ranks tie at the edge (torch's topk picks
        # any of them), the first of the tied ones by index.
        take = min(stats.keep, count)
        values, indices = _top(key, min(take + 1, key.numel()))
        if take < len(values) and values[take] == values[take - 1]:
            edge = values[take - 1]
            above = [(v, i) for v, i in zip(values, indices, strict=True) if v > edge]
            tied = _first_hits(torch.eq(key, edge, out=mismatch), take - len(above))
            for value, index in [*above, *((edge, i) for i in tied)]:
                stats.add_worst(value, offset + index)
        else:
            for value, index in zip(values[:take], indices[:take], strict=True):
                stats.add_worst(value, offset + index)
        return worst, worst_rel


# Up to this many NaN and inf in a chunk are counted one by one on the host.
_FEW_SPECIALS = 64


def _nonfinite_of(a: list[complex], e: list[complex], mismatched: list[bool]) -> NonFinite:
    """_nonfinite_counts of a few values on the host, where each torch op costs more."""
    counts = NonFinite()
    for x, y, bad in zip(a, e, mismatched, strict=True):
        if not bad:
            continue
        if cmath.isnan(x):
            counts.nan_actual += 1
            counts.nan_both += cmath.isnan(y)
            continue
        if cmath.isinf(x):
            counts.inf_actual += 1
            counts.inf_expected_too += not cmath.isfinite(y)
        counts.nan_expected_only += cmath.isnan(y)
    return counts


# Rows longer than this many blocks are searched block by block: a max per
# block is as cheap as a sum, while argmax, topk and nonzero over a whole
# chunk cost ten to twenty times as much.
_BLOCK = 1 << 10


def _block_maxima(row: torch.Tensor) -> torch.Tensor:
    """The greatest value of each block of _BLOCK elements of a flat row (the last may be short)."""
    full = row.numel() - row.numel() % _BLOCK
    head = row[:full].view(-1, _BLOCK).amax(dim=1)
    return head if full == row.numel() else torch.cat((head, row[full:].amax().view(1)))


def _block_elements(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The flat indices of the elements of these blocks of a row of n, in the blocks' order."""
    steps = torch.arange(_BLOCK, device=blocks.device)
    indices = (blocks.view(-1, 1) * _BLOCK + steps).view(-1)
    return indices if n % _BLOCK == 0 else indices[indices < n]


def _top(row: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """torch.topk's values and indices of a flat row: drawn from its k greatest blocks.

    The k greatest values lie in the k blocks of greatest maxima (each of
    those holds a value at least as great as any outside them).
    """
    if row.numel() <= 8 * _BLOCK:
        values, indices = torch.topk(row, k)
        return values.tolist(), indices.tolist()
    maxima = _block_maxima(row)
    candidates = _block_elements(torch.topk(maxima, min(k, maxima.numel())).indices, row.numel())
    values, at = torch.topk(row.index_select(0, candidates), k)
    return values.tolist(), candidates.index_select(0, at).tolist()


def _first_max(row: torch.Tensor) -> int:
    """The index of the first greatest value of a flat row, as argmax: in its first block."""
    if row.numel() <= 8 * _BLOCK:
        return int(row.argmax())
    block = int(_block_maxima(row).argmax())
    return block * _BLOCK + int(row[block * _BLOCK : (block + 1) * _BLOCK].argmax())


def _first_hits(flags: torch.Tensor, k: int) -> list[int]:
    """The indices of the first k nonzero elements of a flat row of 0.0 and 1.0."""
    if flags.numel() <= 8 * _BLOCK:
        return flags.nonzero()[:k].view(-1).tolist()
    blocks = _block_maxima(flags).nonzero()[:k].view(-1)  # each holds at least one
    candidates = _block_elements(blocks, flags.numel())
    return candidates[flags.index_select(0, candidates).nonzero()[:k].view(-1)].tolist()


def _nonzero_positions(flags: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` nonzero elements of a flat row of 0.0 and 1.0, in order."""
    if flags.numel() <= 8 * _BLOCK or count * 8 > flags.numel() // _BLOCK:
        return flags.nonzero().view(-1)
    candidates = _block_elements(_block_maxima(flags).nonzero().view(-1), flags.numel())
    return candidates[flags.index_select(0, candidates).nonzero().view(-1)]


def _nonfinite_counts(a: torch.Tensor, e: torch.Tensor, mismatched: torch.Tensor) -> NonFinite:
    """Where mismatched elements are NaN or infinite, on either side."""
    a_nan, a_inf = torch.isnan(a) & mismatched, torch.isinf(a) & mismatched
    e_nan = torch.isnan(e)
    return NonFinite(
        nan_actual=int(a_nan.sum()),
        nan_both=int((a_nan & e_nan).sum()),
        inf_actual=int(a_inf.sum()),
        inf_expected_too=int((a_inf & ~torch.isfinite(e)).sum()),
        nan_expected_only=int((e_nan & mismatched & ~torch.isnan(a)).sum()),
    )


def _spacing_tensor(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance to the next representable value of dtype, at each magnitude."""
    info = torch.finfo(dtype.to_real())
    mantissa_bits = round(-math.log2(info.eps))
    # Below the smallest normal the spacing is constant (the smallest subnormal),
    # which is the spacing of the smallest normal's binade.
    _, exponent = torch.frexp(magnitude.clamp_min(info.tiny))
    # frexp gives |x| = m * 2**exponent with m in [0.5, 1): the binade is exponent - 1.
    return torch.exp2((exponent - (1 + mantissa_bits)).to(magnitude.dtype))


# --------------------------------------------------------------------------
# The values message


def _ulps_only(tol: Tolerance) -> bool:
    return tol.ulps is not None and tol.atol == 0 and tol.rtol == 0


def _allowed(bound: float, ulps_only: bool) -> str:
    return "" if ulps_only else f" (up to {_num(bound)} allowed)"


def _tolerance_text(tol: Tolerance, dtype: torch.dtype) -> str:
    """Which tolerance was applied and where it came from."""
    name = _dtype_name(dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        return f"none: {name} values must be equal"
    source = tol.source or "compare(tolerances=...)"
    if _ulps_only(tol):
        return f"ulps={tol.ulps:g} in {name} ({source}); atol and rtol not used"
    text = f"atol={tol.atol:g}, rtol={tol.rtol:g} ({source})"
    if tol.ulps is not None:
        text += f", or within ulps={tol.ulps:g} in {name}"
    return text


def _nonfinite_lines(
    counts: NonFinite, mismatched: int, expected_dtype: torch.dtype, equal_nan: bool
) -> list[str]:
    """Say whether expected is non-finite where actual is, and what equal_nan would change."""
    lines = []
    theirs = f"expected ({_dtype_name(expected_dtype)})"
    if counts.nan_actual:
        where = _positions(counts.nan_actual)
        if counts.nan_both == 0:
            lines.append(f"  actual is NaN at {where}; {theirs} is a number at all of them")
        else:
            share = "all" if counts.nan_both == counts.nan_actual else str(counts.nan_both)
            lines.append(
                f"  actual is NaN at {where}; {theirs} is NaN at {share} of these "
                "positions too: the input itself is degenerate"
            )
        if counts.nan_both and not equal_nan:
            remain = mismatched - counts.nan_both
            lines.append(
                f"  equal_nan = true would accept the {counts.nan_both} where both are NaN "
                f"({remain} mismatch{'' if remain == 1 else 'es'} would remain)"
            )
        elif not counts.nan_both:
            lines.append(
                "  equal_nan = true would not change this: it accepts NaN against NaN only"
            )
    if counts.nan_expected_only:
        lines.append(
            f"  {theirs} is NaN at {_positions(counts.nan_expected_only)} where actual is not: "
            "the reference itself is degenerate there"
        )
    if counts.inf_actual:
        lines.append(
            f"  actual is infinite at {_positions(counts.inf_actual)}; {theirs} is infinite "
            f"or NaN at {counts.inf_expected_too} of these too"
        )
    return lines


def _positions(count: int) -> str:
    return f"{count} mismatched position{'' if count == 1 else 's'}"


def _values_mismatch(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    stats: TensorStats,
    worst: int,
    equal_nan: bool,
) -> Mismatch:
    indices = [i for _, i in stats.worst]
    rel_index = stats.worst_rel[1] if stats.worst_rel is not None else indices[0]
    flat = [*indices, rel_index]
    a_values = _gather(actual, flat)
    e_values = _gather(expected, flat)
    diffs = [_abs_diff(a, e) for a, e in zip(a_values, e_values, strict=True)]
    max_abs = float(diffs[0])
    max_rel = relative(float(diffs[-1]), abs(e_values[-1]))
    total = actual.numel()
    exact = actual.dtype == torch.bool or not (
        actual.dtype.is_floating_point or actual.dtype.is_complex
    )

    if actual.dim() == 0:
        message = _scalar_message(
            path, a_values[0], e_values[0], actual.dtype, expected.dtype, tol, equal_nan, exact
        )
        return Mismatch(path, "values", message, stats.mismatched, total, max_abs, max_rel)

    shape = tuple(actual.shape)
    ulps_only = _ulps_only(tol)
    lines = [
        f"{path}: values differ",
        f"  Mismatched elements: {stats.mismatched} / {total} ({stats.mismatched / total:.1%})",
    ]
    if actual.dtype != torch.bool:
        lines.append(
            f"  Greatest absolute difference: {_num(diffs[0])} at index "
            f"{_unravel(indices[0], shape)}{_allowed(tol.atol, ulps_only)}"
        )
        lines.append(
            f"  Greatest relative difference: {_num(max_rel)} at index "
            f"{_unravel(rel_index, shape)}{_allowed(tol.rtol, ulps_only)}"
        )
    lines.append(f"  Tolerance: {_tolerance_text(tol, actual.dtype)}")
    lines.extend(_nonfinite_lines(stats.nonfinite, stats.mismatched, expected.dtype, equal_nan))
    if worst:
        lines.append("  Worst elements (index: actual vs expected, abs error):")
        for i, index in enumerate(indices[:worst]):
            shown_a, shown_e = _fmt_pair(a_values[i], e_values[i], actual.dtype, expected.dtype)
            lines.append(f"    {_unravel(index, shape)}: {shown_a} vs {shown_e}, {_num(diffs[i])}")
    if not exact:
        # A NaN at the top says nothing about rounding: measure the worst finite one.
        finite = [i for i, d in enumerate(diffs[:-1]) if math.isfinite(d)]
        at = finite[0] if finite else 0
        ulp = _ulp_line(diffs[at], e_values[at], actual.dtype, expected.dtype, tol)
        if ulp is not None:
            lines.append(f"  Worst {'' if at == 0 else 'finite '}element is {ulp}")
    return Mismatch(path, "values", "\n".join(lines), stats.mismatched, total, max_abs, max_rel)


def _ulp_line(
    diff: float,
    expected: complex,
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
) -> str | None:
    """Say how many units in the last place apart, to tell rounding from a bug."""
    real = actual_dtype.to_real()
    if real not in (torch.float16, torch.bfloat16) and tol.ulps is None:
        return None
    name = _dtype_name(actual_dtype)
    if not (math.isfinite(diff) and math.isfinite(abs(expected))):
        return f"not finite, so no ULP distance in {name}"
    unit = spacing(abs(expected), real)
    return (
        f"{_num(diff / unit)} ULP off in {name} "
        f"(spacing {_num(unit)} at {_fmt_value(expected, expected_dtype)})"
    )


def _gather(t: torch.Tensor, flat: list[int]) -> list[complex]:
    """Fetch a few elements by flat index: the only values that cross to the host.

    One indexing op and one transfer for all of them, whatever the tensor's strides.
    """
    if t.dim() == 0:
        return [t.item()] * len(flat)
    shape = tuple(t.shape)
    columns = zip(*(_coords(i, shape) for i in flat), strict=True)
    index = tuple(torch.tensor(column, device=t.device) for column in columns)
    values: list[complex] = t[index].tolist()
    return values


def _abs_diff(a: complex, e: complex) -> float:
    if isinstance(a, bool) or isinstance(e, bool):
        return float(a != e)
    return abs(a - e)


def _coords(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        flat, c = divmod(flat, size)
        coords.append(c)
    return tuple(reversed(coords))


def _unravel(flat: int, shape: tuple[int, ...]) -> str:
    return str(_coords(flat, shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _num(x: float) -> str:
    """A derived quantity (difference, tolerance) to four significant digits."""
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def _fmt_pair(
    a: complex, e: complex, a_dtype: torch.dtype, e_dtype: torch.dtype
) -> tuple[str, str]:
    """Two elements as ``_fmt_value`` writes them, unless that writes different values
    alike (bfloat16 1.1015625 and float64 1.1 both read "1.1"): then in full."""
    shown = _fmt_value(a, a_dtype), _fmt_value(e, e_dtype)
    if shown[0] == shown[1] and not (a == e or (a != a and e != e)):
        return repr(a), repr(e)
    return shown


def _fmt_value(x: complex, dtype: torch.dtype) -> str:
    """An element as the shortest text that reads back to the same value in its dtype."""
    if isinstance(x, (bool, int)):
        return repr(x)
    if isinstance(x, complex):
        real = dtype.to_real()
        re, im = _shortest(x.real, real), _shortest(x.imag, real)
        sign = "" if im.startswith("-") else "+"
        return f"({re}{sign}{im}j)"
    return _shortest(x, dtype)


def _shortest(x: float, dtype: torch.dtype) -> str:
    if dtype == torch.float64 or not math.isfinite(x):
        return repr(x)
    if dtype == torch.float32 and math.frexp(x)[0] not in (0.5, -0.5):
        # Off a power of two the values that round to x lie within the same
        # distance on both sides, and each added digit lands no farther from x:
        # once a count of digits reads back, every greater one does. So the
        # fewest is found by halving 1..9 (9 always read back a float32).
        low, high = 1, 9
        while low < high:
            middle = (low + high) // 2
            if _round(float(f"{x:.{middle}g}"), dtype) == x:
                high = middle
            else:
                low = middle + 1
        candidate = float(f"{x:.{low}g}")
        if _round(candidate, dtype) == x:
            return repr(candidate)
    for digits in range(1, 18):
        candidate = float(f"{x:.{digits}g}")
        if _round(candidate, dtype) == x:
            return repr(candidate)
    return repr(x)


_FLOAT32 = struct.Struct("f")
_FLOAT16 = struct.Struct("e")
_UINT32 = struct.Struct("I")


def _round(x: float, dtype: torch.dtype) -> float:
    """x rounded to dtype as torch rounds a Python float: through float32 for 16-bit dtypes."""
    try:
        if dtype == torch.float32:
            return float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])
        if dtype == torch.float16:
            x = float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])
            return float(_FLOAT16.unpack(_FLOAT16.pack(x))[0])
        if dtype == torch.bfloat16:
            (bits,) = _UINT32.unpack(_FLOAT32.pack(x))
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
            return float(_FLOAT32.unpack(_UINT32.pack((bits & 0xFFFF) << 16))[0])
    except OverflowError:  # beyond float16's range
        return math.copysign(math.inf, x)
    return float(torch.tensor(x, dtype=dtype).item())

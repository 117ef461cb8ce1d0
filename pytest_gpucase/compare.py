"""Nested output comparison with per-dtype tolerances and a mismatch report.

The comparison walks actual and expected outputs together (tensors, Python
numbers, None, strings, sequences, mappings), checks structure and tensor
attributes before values, and collects every mismatch with its path.

Tensor values are compared on the actual tensor's device in one chunked pass:
each chunk yields a few scalars (greatest errors, a mismatch count, the worst
few candidates), so neither a full-size temporary nor a whole device tensor
ever reaches the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "BLOCK_ELEMENTS",
    "CHUNK_ELEMENTS",
    "DEFAULT_TOLERANCES",
    "DEVICE_CHUNK_ELEMENTS",
    "Comparison",
    "Mismatch",
    "Tolerance",
    "compare",
]

# Elements per chunk on the CPU: small enough that a chunk's scratch rows stay
# in cache between the few elementwise passes, large enough that per-op
# dispatch overhead stays small (measured by benchmarks/bench_compare.py).
CHUNK_ELEMENTS = 1 << 19
# Elements per screening block on the CPU: a bitwise-equal block costs one
# torch.equal and one NaN check (few parallel regions, which matters when
# other processes compete for the cores); only differing blocks are chunked.
BLOCK_ELEMENTS = 1 << 21
# Elements per chunk (and block) on accelerators, where bandwidth is high and
# every chunk costs kernel launches and a host synchronization.
DEVICE_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Tolerance:
    """How far one dtype's values may be from the expected ones."""

    rtol: float = 0.0
    atol: float = 0.0
    # When set, also pass when |a - e| <= ulps * spacing(e) in the actual dtype.
    ulps: float | None = None

    def __post_init__(self) -> None:
        for name in ("rtol", "atol", "ulps"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # also refuses NaN
                raise ValueError(f"Tolerance.{name} must be >= 0, got {value!r}")


# torch.testing.assert_close's table; integer and bool dtypes compare exactly.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(rtol=1e-3, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-5),
    torch.float32: Tolerance(rtol=1.3e-6, atol=1e-5),
    torch.float64: Tolerance(rtol=1e-7, atol=1e-7),
    torch.complex32: Tolerance(rtol=1e-3, atol=1e-5),
    torch.complex64: Tolerance(rtol=1.3e-6, atol=1e-5),
    torch.complex128: Tolerance(rtol=1e-7, atol=1e-7),
}


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
    max_abs: float | None
    max_rel: float | None

    @property
    def ok(self) -> bool:
        """Whether the outputs matched everywhere."""
        return not self.mismatches

    def report(self) -> str:
        """Return all mismatch messages, top-down, ready for a pytest failure."""
        return "\n".join(m.message for m in self.mismatches)


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
    walk = _Walk(
        tolerances={**DEFAULT_TOLERANCES, **(tolerances or {})},
        equal_nan=equal_nan,
        check_dtype=check_dtype,
        worst=worst,
    )
    # Outputs may carry autograd history; out= kernels refuse such inputs.
    with torch.no_grad():
        walk.value(actual, expected, path)
    return Comparison(tuple(walk.mismatches), walk.max_abs, walk.max_rel)


# --------------------------------------------------------------------------
# Walking nested values


@dataclass
class _Walk:
    """The state of one compare() call."""

    tolerances: Mapping[torch.dtype, Tolerance]
    equal_nan: bool
    check_dtype: bool
    worst: int
    mismatches: list[Mismatch] = field(default_factory=list)
    max_abs: float | None = None
    max_rel: float | None = None
    scratch: _Scratch = field(default_factory=lambda: _Scratch())

    def fail(self, path: str, kind: str, message: str) -> None:
        self.mismatches.append(Mismatch(path, kind, f"{path}: {message}"))

    def note(self, max_abs: float, max_rel: float) -> None:
        self.max_abs = max_abs if self.max_abs is None else max(self.max_abs, max_abs)
        self.max_rel = max_rel if self.max_rel is None else max(self.max_rel, max_rel)

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, _EXACT)

    def value(self, actual: object, expected: object, path: str) -> None:
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            self.tensor(actual, expected, path)
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
        fields = _fields(expected)
        if (fields is not None or _fields(actual) is not None) and type(actual) is not type(
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
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            sub = f"{path}.{fields[i]}" if fields is not None else f"{path}[{i}]"
            self.value(a, e, sub)

    def other(self, actual: object, expected: object, path: str) -> None:
        if type(actual) is not type(expected):
            self.type_differs(actual, expected, path)
            return
        try:
            equal = bool(actual == expected)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. an elementwise ==
            self.fail(
                path,
                "type",
                f"cannot compare values of type {_type_name(actual)}: {type(exc).__name__}: {exc}",
            )
            return
        if not equal:
            self.fail(path, "values", f"values differ: actual {actual!r} vs expected {expected!r}")

    # -- Python numbers ------------------------------------------------------

    def number(self, actual: object, expected: object, path: str) -> None:
        kind_a, kind_e = _number_kind(actual), _number_kind(expected)
        if kind_a is None or kind_a != kind_e:
            self.type_differs(actual, expected, path)
            return
        if kind_a in ("bool", "int"):
            assert isinstance(actual, int) and isinstance(expected, int)
            gap = float(abs(actual - expected))
            rel = _rel(gap, float(abs(expected)))
            if kind_a == "int":
                self.note(gap, rel)
            if actual != expected:
                message = f"{path}: values differ: actual {actual!r} vs expected {expected!r}"
                self.mismatches.append(Mismatch(path, "values", message, 1, 1, gap, rel))
            return
        assert isinstance(actual, (float, complex)) and isinstance(expected, (float, complex))
        dtype = torch.float64 if kind_a == "float" else torch.complex128
        tol = self.tolerance(dtype)
        diff = abs(actual - expected)
        verdict = _scalar_close(actual, expected, diff, tol, self.equal_nan, dtype)
        effective = _effective_diff(diff, verdict)
        self.note(effective, _rel(effective, abs(expected)))
        if not verdict:
            message = _scalar_message(path, actual, expected, dtype, dtype, tol)
            self.mismatches.append(
                Mismatch(path, "values", message, 1, 1, diff, _rel(diff, abs(expected)))
            )

    # -- tensors -------------------------------------------------------------

    def tensor(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        if actual.shape != expected.shape:
            self.fail(
                path,
                "shape",
                f"shape differs: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}",
            )
            return
        if self.check_dtype and actual.dtype != expected.dtype:
            self.fail(
                path, "dtype", f"dtype differs: actual {actual.dtype} vs expected {expected.dtype}"
            )
            return
        kind_a, kind_e = _dtype_kind(actual.dtype), _dtype_kind(expected.dtype)
        if kind_a != kind_e:
            self.fail(
                path,
                "dtype",
                f"dtype kind differs: actual {actual.dtype} ({kind_a}) "
                f"vs expected {expected.dtype} ({kind_e})",
            )
            return
        for side, t in (("actual", actual), ("expected", expected)):
            if t.is_meta:
                self.fail(path, "device", f"{side} is a meta tensor: it holds no values to compare")
                return
        if actual.layout != expected.layout:
            self.fail(
                path,
                "type",
                f"layout differs: actual {actual.layout} vs expected {expected.layout}",
            )
            return
        if actual.layout != torch.strided:
            # Sparse outputs are rare and small; their dense form is compared.
            actual, expected = actual.to_dense(), expected.to_dense()
        tol = self.tolerance(actual.dtype) if kind_a in ("floating", "complex") else _EXACT
        stats = _TensorStats()
        _compare_values(
            actual, expected, tol, self.equal_nan, max(self.worst, 1), self.scratch, stats
        )
        if stats.compared:
            self.note(stats.max_abs, stats.max_rel)
        if stats.mismatched:
            self.mismatches.append(_values_mismatch(path, actual, expected, tol, stats, self.worst))


_EXACT = Tolerance()


def _is_number(x: object) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _number_kind(x: object) -> str | None:
    # bool before int: bool is an int subclass, but True vs 1 is a type change.
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("complex", complex)):
        if isinstance(x, types):
            return kind
    return None


def _fields(x: object) -> tuple[str, ...] | None:
    fields = getattr(type(x), "_fields", None)
    if isinstance(x, tuple) and isinstance(fields, tuple):
        return tuple(str(f) for f in fields)
    return None


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


def _rel(diff: float, scale: float) -> float:
    """Relative difference, with 0/0 read as no difference."""
    if diff == 0:
        return 0.0
    if math.isnan(diff) or scale == 0:
        return math.inf
    return diff / scale


def _effective_diff(diff: float, close: bool) -> float:
    """Difference as it counts for the run summary: matching specials are 0, others inf."""
    if math.isfinite(diff):
        return diff
    return 0.0 if close else math.inf


def _scalar_close(
    actual: complex,
    expected: complex,
    diff: float,
    tol: Tolerance,
    equal_nan: bool,
    dtype: torch.dtype,
) -> bool:
    if actual == expected:
        return True
    if equal_nan and _isnan(actual) and _isnan(expected):
        return True
    if not math.isfinite(diff):
        return False
    if diff <= tol.atol + tol.rtol * abs(expected):
        return True
    return tol.ulps is not None and diff <= tol.ulps * _spacing(abs(expected), dtype)


def _isnan(x: complex) -> bool:
    return math.isnan(x.real) or math.isnan(x.imag)


def _scalar_message(
    path: str,
    actual: complex,
    expected: complex,
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
) -> str:
    diff = abs(actual - expected)
    lines = [
        (
            f"{path}: values differ: actual {_fmt_value(actual, actual_dtype)} "
            f"vs expected {_fmt_value(expected, expected_dtype)}"
        ),
        f"  Absolute difference: {_num(diff)} (up to {_num(tol.atol)} allowed)",
        (
            f"  Relative difference: {_num(_rel(diff, abs(expected)))} "
            f"(up to {_num(tol.rtol)} allowed)"
        ),
    ]
    if tol.ulps is not None:
        lines.append(f"  Also accepted: within {_num(tol.ulps)} ULP in {_dtype_name(actual_dtype)}")
    ulp = _ulp_line(diff, expected, actual_dtype, expected_dtype, tol)
    if ulp is not None:
        lines.append(f"  Difference is {ulp}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Tensor values: one chunked pass


@dataclass
class _TensorStats:
    """What the chunks of one tensor pair add up to."""

    compared: bool = False
    max_abs: float = 0.0  # over all elements, for the run summary
    max_rel: float = 0.0
    mismatched: int = 0
    # (rank, flat index) of the worst mismatches seen, greatest error first
    # once sorted; a few per chunk, so the final list is small.
    worst: list[tuple[float, int]] = field(default_factory=list)
    worst_rel: tuple[float, int] | None = None

    def note(self, max_abs: float, max_rel: float) -> None:
        self.compared = True
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)


class _Scratch:
    """Per-chunk buffers reused across chunks and tensors of one compare() call."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n]

    def load(
        self, name: str, block: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return the block as a contiguous tensor of that dtype on that device."""
        if block.dtype == dtype and block.device == device and block.is_contiguous():
            return block
        if block.device != device and block.dtype != dtype:
            # Convert where the block lives: some backends (MPS) hold no float64.
            block = block.to(dtype)
        return self.get(name, block.numel(), dtype, device).copy_(block)


def _chunk_elements(device: torch.device) -> tuple[int, int]:
    """Elements per chunk and per screening block on this device."""
    if device.type == "cpu":
        return CHUNK_ELEMENTS, max(CHUNK_ELEMENTS, BLOCK_ELEMENTS)
    # A device's torch.equal allocates a mask: blocks no larger than chunks.
    return DEVICE_CHUNK_ELEMENTS, DEVICE_CHUNK_ELEMENTS


def _blocks(
    actual: torch.Tensor, expected: torch.Tensor, chunk: int, offset: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (flat offset, actual block, expected block) in row-major order, 1-D each."""
    n = actual.numel()
    if n == 0:
        return
    if actual.is_contiguous() and expected.is_contiguous():
        flat_a, flat_e = actual.view(-1), expected.view(-1)
        for start in range(0, n, chunk):
            yield offset + start, flat_a[start : start + chunk], flat_e[start : start + chunk]
        return
    # A non-contiguous tensor is cut along its leading dimension so that only
    # chunk-sized pieces are ever copied into contiguous form.
    rows = actual.shape[0]
    inner = n // rows
    if inner <= chunk:
        step = max(1, chunk // inner)
        for r in range(0, rows, step):
            yield (
                offset + r * inner,
                actual[r : r + step].reshape(-1),
                expected[r : r + step].reshape(-1),
            )
    else:
        for r in range(rows):
            yield from _blocks(actual[r], expected[r], chunk, offset + r * inner)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, e: torch.Tensor) -> bool:
    """Bitwise equality of two contiguous blocks of one dtype: a single cheap read."""
    try:
        # Wide words compare fastest; the view needs an aligned, divisible block.
        return torch.equal(a.view(torch.int64), e.view(torch.int64))
    except RuntimeError:
        bits = _BITS.get(a.element_size(), torch.int64)
        return torch.equal(a.view(bits), e.view(bits))


def _has_nan(block: torch.Tensor) -> bool:
    if block.is_complex():
        block = torch.view_as_real(block)
    if block.element_size() == 1:
        block = block.float()  # float8 has no reductions
    return bool(torch.isnan(block.amax()).item())


def _compute_dtype(actual: torch.dtype, expected: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype differences are computed in: at least 32-bit, so no rounding of its own."""
    try:
        dtype = torch.promote_types(actual, expected)
    except RuntimeError:  # mixed float8 formats
        dtype = torch.float32
    if dtype.is_complex:
        if dtype == torch.complex32:
            dtype = torch.complex64
    elif dtype.itemsize < 4:
        dtype = torch.float32
    if device.type == "mps":
        dtype = {torch.float64: torch.float32, torch.complex128: torch.complex64}.get(dtype, dtype)
    return dtype


def _compare_values(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    equal_nan: bool,
    keep: int,
    scratch: _Scratch,
    stats: _TensorStats,
) -> None:
    floating = actual.dtype.is_floating_point or actual.dtype.is_complex
    chunk, block = _chunk_elements(actual.device)
    if floating:
        size = min(chunk, actual.numel())
        float_chunk = _FloatChunks(actual, expected, size, tol, equal_nan, keep, scratch, stats)
    # Bitwise-equal data (the common case for a fixed bug) is recognised by
    # one read of large blocks; only blocks that differ are cut into chunks.
    screen = actual.dtype == expected.dtype and actual.device == expected.device

    def same(a: torch.Tensor, e: torch.Tensor) -> bool:
        # Equal bits mean equal values, except that NaN == NaN needs equal_nan.
        return _same_bits(a, e) and (equal_nan or not floating or not _has_nan(a))

    for offset, a_block, e_block in _blocks(actual, expected, block):
        if screen and same(a_block, e_block):
            stats.note(0.0, 0.0)
            continue
        for start in range(0, a_block.numel(), chunk):
            a, e = a_block[start : start + chunk], e_block[start : start + chunk]
            if screen and same(a, e):
                stats.note(0.0, 0.0)
            elif floating:
                float_chunk(a, e, offset + start)
            else:
                _exact_chunk(a, e, offset + start, keep, stats)


class _FloatChunks:
    """Compares floating (or complex) chunks of one tensor pair; constants hoisted."""

    def __init__(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        size: int,
        tol: Tolerance,
        equal_nan: bool,
        keep: int,
        scratch: _Scratch,
        stats: _TensorStats,
    ) -> None:
        self.device = actual.device
        self.actual_dtype = actual.dtype
        self.cdt = _compute_dtype(actual.dtype, expected.dtype, actual.device)
        real = self.cdt.to_real()
        eps = torch.finfo(real).eps
        self.eps = eps
        # Each bound alone proves closeness; the margin covers the rounding of
        # these screens against the exact rule, so no mismatch slips through.
        self.abs_bound = tol.atol * (1 - 4 * eps)
        self.rel_bound = tol.rtol * (1 - 4 * eps)
        self.tol, self.equal_nan, self.keep = tol, equal_nan, keep
        self.scratch, self.stats = scratch, stats
        # Two rows reduced by one kernel: |a - e| and |a - e| / |e|.
        self.rows = scratch.get("rows", 2 * size, real, self.device).view(2, size)

    def __call__(self, a: torch.Tensor, e: torch.Tensor, offset: int) -> None:
        n, tol, stats = a.numel(), self.tol, self.stats
        a = self.scratch.load("a", a, self.cdt, self.device)
        e = self.scratch.load("e", e, self.cdt, self.device)
        rows = self.rows[:, :n]
        diff, rel = rows[0], rows[1]
        # Every pass after the first reads cache-resident rows: a passing chunk
        # costs one read of its inputs and four cheap passes.
        if self.cdt.is_complex:
            torch.abs(a - e, out=diff)
        else:
            torch.sub(a, e, out=diff).abs_()
        torch.abs(e, out=rel)
        torch.div(diff, rel, out=rel)
        max_diff, max_rel = rows.amax(dim=1).tolist()
        finite = math.isfinite(max_diff)
        if finite:
            if math.isnan(max_rel):  # 0/0 where both sides hold an exact zero
                max_rel = float(rel.nan_to_num_(nan=0.0, posinf=math.inf).amax())
            stats.note(max_diff, max_rel)
            if max_diff <= self.abs_bound or max_rel <= self.rel_bound:
                return
            excess = torch.abs(e, out=rel)  # the row is free again: reuse it
            torch.add(diff, excess, alpha=-tol.rtol, out=excess)  # |a - e| - rtol * |e|
            slack = 8 * self.eps * (max_diff + tol.atol)
            if float(excess.amax()) <= tol.atol - slack:
                return
        # A possible mismatch, NaN or inf: decide element by element, like torch.isclose.
        scale = e.abs()
        allowed = torch.mul(scale, tol.rtol).add_(tol.atol)
        if finite:
            # All finite: a == e implies |a - e| = 0, which every tolerance allows.
            close = diff <= allowed
            if tol.ulps is not None:
                close |= diff <= _spacing_tensor(scale, self.actual_dtype).mul_(tol.ulps)
        else:
            in_range = torch.isfinite(diff)  # inf - inf and NaN are never "close"
            close = (a == e) | (in_range & (diff <= allowed))
            if tol.ulps is not None:
                spacing = _spacing_tensor(scale, self.actual_dtype).mul_(tol.ulps)
                close |= in_range & (diff <= spacing)
            if self.equal_nan:
                close |= torch.isnan(a) & torch.isnan(e)
        _record(diff, scale, close, offset, self.keep, stats, noted=finite)


def _exact_chunk(
    a: torch.Tensor, e: torch.Tensor, offset: int, keep: int, stats: _TensorStats
) -> None:
    e = e.to(a.device)
    close = a == e
    if bool(close.all()):
        stats.note(0.0, 0.0)
        return
    wide = torch.float32 if a.device.type == "mps" else torch.float64
    scale = e.to(wide).abs()
    diff = (a.to(wide) - e.to(wide)).abs_()
    _record(diff, scale, close, offset, keep, stats, noted=False)


def _record(
    diff: torch.Tensor,
    scale: torch.Tensor,
    close: torch.Tensor,
    offset: int,
    keep: int,
    stats: _TensorStats,
    noted: bool,
) -> None:
    """Fold one chunk's exact verdicts into the tensor's statistics."""
    if not noted:
        # The run summary counts matching specials (inf == inf, NaN with
        # equal_nan) as no difference; mismatches are added below.
        plain = diff.nan_to_num(nan=0.0, posinf=0.0)
        rel = (plain / scale).nan_to_num_(nan=0.0, posinf=math.inf)
        stats.note(float(plain.amax()), float(rel.amax()))
    where = (~close).nonzero().squeeze(1)
    count = where.numel()
    if not count:
        return
    # Only the (usually few) mismatches are ranked; NaN or infinite ones rank
    # as infinitely far.
    gap = diff[where]
    gap = torch.where(torch.isfinite(gap), gap, math.inf)
    rel = torch.where(torch.isfinite(gap), gap / scale[where], math.inf)
    stats.note(float(gap.amax()), float(rel.amax()))
    stats.mismatched += count
    values, indices = gap.topk(min(keep, count))
    positions = (i + offset for i in where[indices].tolist())
    stats.worst.extend(zip(values.tolist(), positions, strict=True))
    value, index = rel.max(dim=0)
    if stats.worst_rel is None or float(value) > stats.worst_rel[0]:
        stats.worst_rel = (float(value), int(where[index]) + offset)


def _spacing_tensor(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance to the next representable value of dtype, at each magnitude."""
    info = torch.finfo(dtype.to_real())
    mantissa_bits = round(-math.log2(info.eps))
    # Below the smallest normal the spacing is constant (the smallest subnormal),
    # which is the spacing of the smallest normal's binade.
    _, exponent = torch.frexp(magnitude.clamp_min(info.tiny))
    # frexp gives |x| = m * 2**exponent with m in [0.5, 1): the binade is exponent - 1.
    return torch.exp2((exponent - (1 + mantissa_bits)).to(magnitude.dtype))


def _spacing(magnitude: float, dtype: torch.dtype) -> float:
    info = torch.finfo(dtype.to_real())
    mantissa_bits = round(-math.log2(info.eps))
    if magnitude < info.tiny:
        return float(info.tiny * info.eps)
    _, exponent = math.frexp(magnitude)
    return math.ldexp(1.0, exponent - 1 - mantissa_bits)


# --------------------------------------------------------------------------
# The values message


def _values_mismatch(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    stats: _TensorStats,
    worst: int,
) -> Mismatch:
    worst_list = sorted(stats.worst, key=lambda c: (-c[0], c[1]))[: max(worst, 1)]
    indices = [i for _, i in worst_list]
    rel_index = stats.worst_rel[1] if stats.worst_rel is not None else indices[0]
    flat = [*indices, rel_index]
    a_values = _gather(actual, flat)
    e_values = _gather(expected, flat)
    diffs = [_abs_diff(a, e) for a, e in zip(a_values, e_values, strict=True)]
    max_abs = float(diffs[0])
    max_rel = _rel(float(diffs[-1]), abs(e_values[-1]))
    total = actual.numel()
    exact = actual.dtype == torch.bool or not (
        actual.dtype.is_floating_point or actual.dtype.is_complex
    )

    if actual.dim() == 0:
        if exact:
            message = (
                f"{path}: values differ: actual {_fmt_value(a_values[0], actual.dtype)} "
                f"vs expected {_fmt_value(e_values[0], expected.dtype)}"
            )
        else:
            message = _scalar_message(
                path, a_values[0], e_values[0], actual.dtype, expected.dtype, tol
            )
        return Mismatch(path, "values", message, stats.mismatched, total, max_abs, max_rel)

    shape = tuple(actual.shape)
    lines = [
        f"{path}: values differ",
        f"  Mismatched elements: {stats.mismatched} / {total} ({stats.mismatched / total:.1%})",
    ]
    if actual.dtype != torch.bool:
        lines.append(
            f"  Greatest absolute difference: {_num(diffs[0])} at index "
            f"{_unravel(indices[0], shape)} (up to {_num(tol.atol)} allowed)"
        )
        lines.append(
            f"  Greatest relative difference: {_num(max_rel)} at index "
            f"{_unravel(rel_index, shape)} (up to {_num(tol.rtol)} allowed)"
        )
    if tol.ulps is not None:
        lines.append(f"  Also accepted: within {_num(tol.ulps)} ULP in {_dtype_name(actual.dtype)}")
    if worst:
        lines.append("  Worst elements (index: actual vs expected, abs error):")
        for i, index in enumerate(indices):
            lines.append(
                f"    {_unravel(index, shape)}: {_fmt_value(a_values[i], actual.dtype)} "
                f"vs {_fmt_value(e_values[i], expected.dtype)}, {_num(diffs[i])}"
            )
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
    spacing = _spacing(abs(expected), real)
    return (
        f"{_num(diff / spacing)} ULP off in {name} "
        f"(spacing {_num(spacing)} at {_fmt_value(expected, expected_dtype)})"
    )


def _gather(t: torch.Tensor, flat: list[int]) -> list[complex]:
    """Fetch a few elements by flat index: the only values that cross to the host."""
    if t.dim() == 0:
        return [t.item()] * len(flat)
    coords = list(zip(*(_coords(i, tuple(t.shape)) for i in flat), strict=True))
    index = tuple(torch.tensor(c, dtype=torch.long, device=t.device) for c in coords)
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
    for digits in range(1, 18):
        candidate = float(f"{x:.{digits}g}")
        if torch.tensor(candidate, dtype=dtype).item() == x:
            return repr(candidate)
    return repr(x)

"""The words of a mismatch: what differs, by how much, and under which tolerance.

``Mismatch`` is one problem at one path of an output, with its message. Here
are the messages of a value that differs: a number's (``scalar_message``) and
a tensor's (``values_mismatch``: mismatched count, greatest differences with
their index and the allowed tolerance, NaN and inf, worst elements, ULPs),
the text of a tolerance and where it came from, and numbers written as the
shortest text that reads back in their dtype. The comparison decides; this
module only words what it found, fetching the few elements it shows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pytest_gpucase.base.dtypes import DTYPE_TABLE
from pytest_gpucase.verdict.stats import NonFinite, TensorStats
from pytest_gpucase.verdict.tolerance import Tolerance, is_nan, relative, spacing

__all__ = ["Mismatch", "num", "range_lines", "scalar_message", "values_mismatch",
           "with_note"]


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
    # What the one-line summary says of it, where its count of elements would mislead (a
    # leaf wrong by a little everywhere): None, the count.
    summary: str | None = dataclasses.field(default=None, repr=False)


def with_note(mismatch: Mismatch, note: str) -> Mismatch:
    """The mismatch with one more line at the end of its message."""
    return dataclasses.replace(mismatch, message=f"{mismatch.message}\n  {note}")


def wrong_everywhere(mismatch: Mismatch, problem: str, elements_within: bool) -> Mismatch:
    """The mismatch of a leaf whose RMS error is past what rounding explains (``problem``,
    ``Budget.rms_problem``): said first in its message and in its one-line summary, where a
    count of the elements past their own budgets (a few, or none) would hide that every
    element is off."""
    head, _, rest = mismatch.message.partition("\n")
    which = ("every element within its own rounding budget, but" if elements_within
             else f"{mismatch.mismatched} of {mismatch.total} elements past their own rounding "
             "budget, and")
    message = f"{head}\n  wrong by a little everywhere: {which} {problem}"
    return dataclasses.replace(
        mismatch, message=message + (f"\n{rest}" if rest else ""),
        summary=f"wrong by a little everywhere ({problem.split(':', 1)[0]})")


# --------------------------------------------------------------------------
# Scalars (Python numbers; also the 0-dim tensor message)


def scalar_message(
    path: str,
    actual: complex,
    expected: complex,
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
    equal_nan: bool,
    exact: bool,
) -> str:
    """The message of one number that differs: a Python number, or a 0-dim tensor's."""
    diff = _abs_diff(actual, expected)
    lines = [
        "{}: values differ: actual {} vs expected {}".format(
            path, *_fmt_pair(actual, expected, actual_dtype, expected_dtype))
    ]
    if exact:
        return lines[0]
    ulps_only = _ulps_only(tol)
    lines.append(f"  Absolute difference: {num(diff)}{_bound(tol, expected, ulps_only)}")
    lines.append(f"  Relative difference: {num(relative(diff, abs(expected)))}"
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
    if counts.inf_actual and not counts.inf_expected_too:
        lines.extend(range_lines(actual_dtype, abs(expected)))
    ulp = _ulp_line(diff, expected, actual_dtype, expected_dtype, tol)
    if ulp is not None:
        lines.append(f"  Difference is {ulp}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The values message


def _ulps_only(tol: Tolerance) -> bool:
    return tol.ulps is not None and tol.atol == 0 and tol.rtol == 0


def _allowed(bound: float, ulps_only: bool) -> str:
    return "" if ulps_only else f" (up to {num(bound)} allowed)"


def _bound(tol: Tolerance, expected: complex, ulps_only: bool) -> str:
    """What an element was held to where it differs most: atol + rtol x |expected| there
    (the tolerance line names both)."""
    if ulps_only:
        return ""
    size = abs(expected)
    if tol.rtol == 0 or not math.isfinite(size):
        return _allowed(tol.atol, ulps_only)
    return f" (up to {num(tol.atol + tol.rtol * size)} allowed there)"


def _magnitude(expected: torch.Tensor) -> float:
    """The greatest finite |expected|: the size of the output, next to which a difference
    reads as rounding or as a bug."""
    if expected.numel() == 0:
        return 0.0
    size = expected.detach().abs()  # a new tensor, rewritten in place below
    if not size.dtype.is_floating_point:
        size = size.to(torch.float64)
    # |x| is never -inf: NaN and +inf are the non-finite ones, counted as 0.
    return float(size.nan_to_num_(nan=0.0, posinf=0.0).amax())


def _scale_line(diff: float, size: float) -> str:
    if size == 0:
        return "  Expected values: all 0"
    share = diff / size
    said = f"{share:.1%}" if share >= 1e-3 else f"{share:.3g} of that"
    return f"  Expected values: up to {num(size)} in magnitude; the greatest difference is {said}"


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


def range_lines(dtype: torch.dtype, greatest: float) -> list[str]:
    """A line saying that ``dtype`` cannot hold a result of magnitude ``greatest`` (the
    reference's, where the run is infinite): an overflow of the dtype, not a rounding."""
    if not (dtype.is_floating_point or dtype.is_complex) or not math.isfinite(greatest):
        return []
    largest = float(torch.finfo(dtype.to_real()).max)
    if greatest <= largest:
        return []
    name = _dtype_name(dtype)
    return [f"  {name} cannot hold the result: the reference reaches {num(greatest)} in "
            f"magnitude, past {name}'s largest value {num(largest)}: an overflow of the "
            "dtype, not a rounding (compute or accumulate in a wider dtype, or scale)"]


def _finite_max(t: torch.Tensor) -> float:
    size = t.detach().abs()
    size = size.to(torch.float64) if size.device.type == "cpu" else size.float()
    size = torch.where(torch.isfinite(size), size, 0)
    return float(size.max()) if size.numel() else 0.0


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


def values_mismatch(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    stats: TensorStats,
    worst: int,
    equal_nan: bool,
) -> Mismatch:
    """The mismatch of a tensor pair whose values differ, worded from its tally."""
    indices = [i for _, i in stats.worst]
    rel_index = stats.worst_rel[1] if stats.worst_rel is not None else indices[0]
    flat = [*indices, rel_index]
    shape = tuple(actual.shape)
    coords = [_coords(i, shape) for i in flat]
    a_values, e_values = _gather(actual, expected, flat, coords)
    diffs = [_abs_diff(a, e) for a, e in zip(a_values, e_values, strict=True)]
    max_abs = float(diffs[0])
    max_rel = relative(float(diffs[-1]), abs(e_values[-1]))
    total = actual.numel()
    exact = actual.dtype == torch.bool or not (
        actual.dtype.is_floating_point or actual.dtype.is_complex
    )

    if actual.dim() == 0:
        message = scalar_message(
            path, a_values[0], e_values[0], actual.dtype, expected.dtype, tol, equal_nan, exact
        )
        return Mismatch(path, "values", message, stats.mismatched, total, max_abs, max_rel)

    ulps_only = _ulps_only(tol)
    lines = [
        f"{path}: values differ",
        f"  Mismatched elements: {stats.mismatched} / {total} ({stats.mismatched / total:.1%})",
    ]
    size = 0.0
    if actual.dtype != torch.bool:
        held = _allowed(tol.atol, ulps_only) if exact else _bound(tol, e_values[0], ulps_only)
        lines.append(
            f"  Greatest absolute difference: {num(diffs[0])} at index "
            f"{coords[0]}{held}"
        )
        lines.append(
            f"  Greatest relative difference: {num(max_rel)} at index "
            f"{coords[-1]}{_allowed(tol.rtol, ulps_only)}"
        )
        if not exact:
            size = _magnitude(expected)
            if math.isfinite(diffs[0]):
                lines.append(_scale_line(float(diffs[0]), size))
    lines.append(f"  Tolerance: {_tolerance_text(tol, actual.dtype)}")
    lines.extend(_nonfinite_lines(stats.nonfinite, stats.mismatched, expected.dtype, equal_nan))
    if stats.nonfinite.inf_actual > stats.nonfinite.inf_expected_too:
        lines.extend(range_lines(actual.dtype, _finite_max(expected)))
    if worst:
        lines.append("  Worst elements (index: actual vs expected, abs error):")
        for i in range(min(worst, len(indices))):
            shown_a, shown_e = _fmt_pair(a_values[i], e_values[i], actual.dtype, expected.dtype)
            lines.append(f"    {coords[i]}: {shown_a} vs {shown_e}, {num(diffs[i])}")
    if not exact:
        lines.extend(_worst_ulp_lines(diffs, e_values, actual.dtype, expected.dtype, tol, size))
    return Mismatch(path, "values", "\n".join(lines), stats.mismatched, total, max_abs, max_rel)


def _worst_ulp_lines(
    diffs: list[float],
    e_values: list[complex],
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
    size: float,
) -> list[str]:
    """The line (if any) that measures the worst finite element in units of rounding."""
    # A NaN at the top says nothing about rounding: measure the worst finite one.
    finite = [i for i, d in enumerate(diffs[:-1]) if math.isfinite(d)]
    at = finite[0] if finite else 0
    ulp = _ulp_line(diffs[at], e_values[at], actual_dtype, expected_dtype, tol, size)
    if ulp is None:
        return []
    return [f"  Worst {'' if at == 0 else 'finite '}element is {ulp}"]


def _ulp_line(
    diff: float,
    expected: complex,
    actual_dtype: torch.dtype,
    expected_dtype: torch.dtype,
    tol: Tolerance,
    size: float = 0.0,
) -> str | None:
    """Say how many units in the last place apart, to tell rounding from a bug.

    Measured at the expected value when it is a normal number of the dtype; at zero or
    below the normal range the spacing there (the smallest subnormal's) says nothing of a
    computation's rounding, so the units are those of the output's greatest magnitude
    (``size``), and the line says so; with no magnitude at all, no ULP figure is given.
    """
    real = actual_dtype.to_real()
    if real not in (torch.float16, torch.bfloat16) and tol.ulps is None:
        return None
    name = _dtype_name(actual_dtype)
    if not (math.isfinite(diff) and math.isfinite(abs(expected))):
        return f"not finite, so no ULP distance in {name}"
    if abs(expected) >= float(torch.finfo(real).tiny):
        unit = spacing(abs(expected), real)
        return (
            f"{num(diff / unit)} ULP off in {name} "
            f"(spacing {num(unit)} at {_fmt_value(expected, expected_dtype)})"
        )
    shown = _fmt_value(expected, expected_dtype)
    if not size >= float(torch.finfo(real).tiny):
        return (f"at expected {shown}, below {name}'s normal range: no ULP figure (the "
                f"spacing there is no rounding of this computation)")
    unit = spacing(size, real)
    return (f"at expected {shown}, below {name}'s normal range; at the output's scale it "
            f"is {num(diff / unit)} ULP off (spacing {num(unit)} at |expected| "
            f"{num(size)}, the greatest)")


def _gather(
    actual: torch.Tensor,
    expected: torch.Tensor,
    flat: list[int],
    coords: list[tuple[int, ...]],
) -> tuple[list[complex], list[complex]]:
    """Fetch a few elements of both tensors by flat index (``coords``: the same as
    coordinates): the only values that cross to the host.

    One indexing op and one transfer for all of them on each side, whatever the strides.
    """
    if actual.dim() == 0:
        return [actual.item()] * len(flat), [expected.item()] * len(flat)
    flat_index: torch.Tensor | None = None
    index: tuple[torch.Tensor, ...] | None = None
    values: list[list[complex]] = []
    for t in (actual, expected):
        if t.is_contiguous():  # a flat view: one index tensor, however many dimensions
            if flat_index is None or flat_index.device != t.device:
                flat_index = torch.tensor(flat, device=t.device)
            values.append(t.view(-1)[flat_index].tolist())
        else:
            if index is None or index[0].device != t.device:
                index = tuple(torch.tensor(column, device=t.device)
                              for column in zip(*coords, strict=True))
            values.append(t[index].tolist())
    return values[0], values[1]


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def num(x: float) -> str:
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
    rounder = _ROUNDERS.get(dtype)
    if rounder is None:
        rounder = functools.partial(_round, dtype=dtype)
    elif math.frexp(x)[0] not in (0.5, -0.5):
        # Off a power of two the values that round to x lie within the same
        # distance on both sides, and each added digit lands no farther from x:
        # once a count of digits reads back, every greater one does. So the
        # fewest is found by halving 1..most (most always reads back: 9 digits
        # a float32, 5 a float16, 4 a bfloat16; every 16-bit value was checked),
        # first trying one less than most, the count most values need.
        high = _MOST_DIGITS[dtype] - 1
        best = float(f"{x:.{high}g}")
        if rounder(best) != x:
            best = float(f"{x:.{high + 1}g}")
            if rounder(best) == x:
                return repr(best)
        else:
            low = 1
            while low < high:
                middle = (low + high) // 2
                candidate = float(f"{x:.{middle}g}")
                if rounder(candidate) == x:
                    high, best = middle, candidate
                else:
                    low = middle + 1
            return repr(best)
    for digits in range(1, 18):
        candidate = float(f"{x:.{digits}g}")
        if rounder(candidate) == x:
            return repr(candidate)
    return repr(x)


_FLOAT32 = struct.Struct("f")
_FLOAT16 = struct.Struct("e")
_UINT32 = struct.Struct("I")


def _round_float32(x: float) -> float:
    try:
        return float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])
    except OverflowError:  # beyond float32's range
        return math.copysign(math.inf, x)


def _round_float16(x: float) -> float:
    try:
        x = float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])
        return float(_FLOAT16.unpack(_FLOAT16.pack(x))[0])
    except OverflowError:  # beyond float16's range
        return math.copysign(math.inf, x)


def _round_bfloat16(x: float) -> float:
    try:
        (bits,) = _UINT32.unpack(_FLOAT32.pack(x))
    except OverflowError:
        return math.copysign(math.inf, x)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return float(_FLOAT32.unpack(_UINT32.pack((bits & 0xFFFF) << 16))[0])


_ROUNDERS: dict[torch.dtype, Callable[[float], float]] = {
    torch.float32: _round_float32,
    torch.float16: _round_float16,
    torch.bfloat16: _round_bfloat16,
}
_MOST_DIGITS = {getattr(torch, row.name): row.digits   # base.dtypes.DTYPE_TABLE
                for row in DTYPE_TABLE if row.digits is not None}


def _round(x: float, dtype: torch.dtype) -> float:
    """x rounded to dtype as torch rounds a Python float: through float32 for 16-bit dtypes."""
    rounder = _ROUNDERS.get(dtype)
    if rounder is not None:
        return rounder(x)
    return float(torch.tensor(x, dtype=dtype).item())

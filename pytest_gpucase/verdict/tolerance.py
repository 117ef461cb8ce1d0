"""What counts as close: the tolerances, their defaults, and the rule that applies them.

This module owns the rule; ``compare`` walks the outputs and applies it, and
``_kernel`` applies the same rule to whole tensors, only faster.
``scalar_close`` is the rule for one pair of numbers, written out.

Verdicts. An element passes when ``|actual - expected| <= atol + rtol *
|expected|``, or it is within ``ulps`` units in the last place of the actual
dtype, or both are equal (infinities of one sign), or both are NaN with
``equal_nan``: ``torch.isclose``'s rule. The arithmetic is done in the
promoted dtype of the pair, but never below float32 (``compute_dtype``). For
float32, float64, integer and bool pairs, and for a low-precision output
against a float64 reference (the plugin's own path), that is exactly what
``torch.testing.assert_close`` computes, and the verdicts are the same. For a
bfloat16 or float16 output against an expected tensor of the same dtype,
assert_close computes the difference and the bound in that dtype, rounding
both to 8 (bfloat16) or 11 (float16) significant bits; gpucase computes
them from the same stored values in float32. Both read the same tolerance,
so they disagree only on pairs within a rounding of the bound, and there
gpucase is the exact one, and deliberately stricter (in 400,000 constructed
pairs near the bound, never the other way): bfloat16 ``1e-5`` against ``0``
fails here (the difference, 1.0014e-5, exceeds atol = 1e-5; assert_close
rounds the bound up to 1.0014e-5 too), and ``0.24707`` against ``0.24316``
fails here (0.0039062 > 0.0039006) where assert_close rounds the bound to
0.0039062. Exactness makes the verdict depend on the values only, not on
their storage: the same bfloat16 output gets the same verdict against a
bfloat16 golden as against the float64 reference (assert_close included),
and a stated atol means what it says.

Tolerances. ``ulps`` alone (atol = rtol = 0) means only the ULP test
applies; with atol and rtol it is a second way to pass. Every failure
message names the tolerance it applied and where it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pytest_gpucase.base.dtypes import DTYPE_TABLE
from pytest_gpucase.base import backends

__all__ = [
    "DEFAULT_TOLERANCES",
    "EXACT",
    "Tolerance",
    "compute_dtype",
    "is_nan",
    "nan_max",
    "relative",
    "scalar_close",
    "spacing",
]


@dataclass(frozen=True)
class Tolerance:
    """How far one dtype's values may be from the expected ones."""

    rtol: float = 0.0
    atol: float = 0.0
    # When set, also pass when |a - e| <= ulps * spacing(e) in the actual dtype;
    # with atol = rtol = 0 it is the only test.
    ulps: float | None = None
    # Where the values came from, for failure messages ("float32 defaults",
    # "case.toml [expect.tolerance.bfloat16]"); not part of equality.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("rtol", "atol", "ulps"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # also refuses NaN
                raise ValueError(f"Tolerance.{name} must be >= 0, got {value!r}")


def _defaults(dtype: torch.dtype, rtol: float, atol: float) -> Tolerance:
    return Tolerance(rtol=rtol, atol=atol, source=f"{str(dtype).removeprefix('torch.')} defaults")


# torch.testing.assert_close's table; integer and bool dtypes compare exactly.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {   # base.dtypes.DTYPE_TABLE
    getattr(torch, row.name): _defaults(getattr(torch, row.name), row.rtol, row.atol)
    for row in DTYPE_TABLE
}

# The tolerance of integer and bool values, and of a dtype the table leaves out.
EXACT = Tolerance(source="exact")


def scalar_close(
    actual: complex,
    expected: complex,
    diff: float,
    tol: Tolerance,
    equal_nan: bool,
    dtype: torch.dtype,
) -> bool:
    """Whether one number is close to the expected one; ``diff`` is ``|actual - expected|``."""
    if actual == expected:
        return True
    if equal_nan and is_nan(actual) and is_nan(expected):
        return True
    if not math.isfinite(diff):
        return False
    if diff <= tol.atol + tol.rtol * abs(expected):
        return True
    return tol.ulps is not None and diff <= tol.ulps * spacing(abs(expected), dtype)


def is_nan(x: complex) -> bool:
    """Whether a real or complex number is NaN (in either part)."""
    return math.isnan(x.real) or math.isnan(x.imag)


def spacing(magnitude: float, dtype: torch.dtype) -> float:
    """Distance to the next representable value of dtype at this magnitude: one ULP."""
    info = torch.finfo(dtype.to_real())
    mantissa_bits = round(-math.log2(info.eps))
    if magnitude < info.tiny:
        return float(info.tiny * info.eps)
    _, exponent = math.frexp(magnitude)
    return math.ldexp(1.0, exponent - 1 - mantissa_bits)


def relative(diff: float, scale: float) -> float:
    """Relative difference: 0 for no difference, NaN for NaN, inf for inf or a zero scale."""
    if diff == 0:
        return 0.0
    if math.isnan(diff):
        return math.nan
    if math.isinf(diff) or scale == 0:
        return math.inf
    return diff / scale


def nan_max(a: float, b: float) -> float:
    """max() in which NaN wins, whatever the order (Python's max is order-dependent)."""
    if a != a or b != b:  # NaN is the one value unequal to itself
        return math.nan
    return a if a >= b else b


def compute_dtype(actual: torch.dtype, expected: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype differences are computed in: the pair's promoted dtype, at least 32-bit."""
    try:
        dtype = torch.promote_types(actual, expected)
    except RuntimeError:  # mixed float8 formats
        dtype = torch.float32
    if dtype.is_complex:
        if dtype == torch.complex32:
            dtype = torch.complex64
    elif dtype.itemsize < 4:
        dtype = torch.float32
    if not backends.float64_on(device.type):
        dtype = {torch.float64: torch.float32, torch.complex128: torch.complex64}.get(dtype, dtype)
    return dtype

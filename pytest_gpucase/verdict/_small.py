"""A small, plain pair judged in Python's floats: ``compare``'s fast path for a clean pass.

``compare`` clears a small single floating pair by ``_kernel.small_close`` (the screen
of the full path's one chunk) and, with a second look, ``allowance.unclean`` (its RMS
error against its RMS size). Each of their torch ops is cheap in a warm process; in the
fresh child every run is judged in, each is a first touch of torch's pages (about 300
page faults and a millisecond for a 4-element tensor). Here the same arithmetic is done
on ``tolist()``'s Python floats, which are IEEE float64 as the compute dtype's (float64
on the CPU) are: the same differences, the same greatest ones, the same bounds.

Only a clear, clean pass is decided here, and only where the float64 arithmetic is
bit for bit torch's: CPU tensors of exactly ``torch.Tensor``, strided, one floating
dtype the screen knows on each side, at most ``PLAIN_ELEMENTS`` elements, no NaN or
inf anywhere, no subnormal value or intermediate (flush-to-zero, if a case set it,
would change torch's), cleared by the screen's first two tests (its third one's fused
multiply-add is not reproduced), and an RMS error exactly zero or clearly below its
bound (a sum's order is torch's own: a margin of 1e-9 covers its rounding). Anything
else is None, and the full path judges and words it as before.
"""

from __future__ import annotations

import math

import torch

from pytest_gpucase.verdict._kernel import screen_of
from pytest_gpucase.verdict.allowance import least_step
from pytest_gpucase.verdict.rounding import CLEAN, unit_roundoff
from pytest_gpucase.verdict.tolerance import Tolerance

__all__ = ["PLAIN_ELEMENTS", "clean_small"]

# Up to this many elements: beyond, a few torch ops cost less than a Python loop.
PLAIN_ELEMENTS = 64
# The least normal magnitude of each dtype judged here (finfo's smallest_normal).
_NORMAL = {torch.float64: 2.2250738585072014e-308, torch.float32: 1.1754943508222875e-38,
           torch.bfloat16: 1.1754943508222875e-38, torch.float16: 6.103515625e-05}
_LEAST = _NORMAL[torch.float64]
# An RMS error this close to its bound (relative) is left to torch's own sums.
_MARGIN = 1e-9


def clean_small(actual: object, expected: object, tol: Tolerance, check_dtype: bool,
                held: torch.dtype | None) -> tuple[float, float] | None:
    """The greatest absolute and relative differences of a small plain pair that
    ``small_close`` clears and, with ``held`` (the dtype of a second look's
    ``unclean``), that ``unclean`` finds clean; None where this cannot say so."""
    if not _plain(actual, expected, check_dtype):
        return None
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    screen = screen_of(actual.dtype, expected.dtype, actual.device, tol)
    if screen.cdt != torch.float64:
        return None
    a, e = _values(actual), _values(expected)
    found = None if a is None or e is None else _differences(
        a, e, _NORMAL[actual.dtype], _NORMAL[expected.dtype])
    if found is None:
        return None
    max_abs, max_rel, squares, sizes = found
    if not (max_abs <= screen.abs_bound or max_rel <= screen.rel_bound):
        return None  # the screen's third test, or no pass: the full path decides
    if held is not None and (held.is_floating_point or held.is_complex) and not _rms_clean(
            squares, sizes, actual.dtype, held):
        return None
    return max_abs, max_rel


def _plain(actual: object, expected: object, check_dtype: bool) -> bool:
    """Whether the pair is one this module may judge (see the module's docstring)."""
    return (type(actual) is torch.Tensor and type(expected) is torch.Tensor
            and actual.dtype in _NORMAL and expected.dtype in _NORMAL
            and (actual.dtype == expected.dtype or not check_dtype)
            and actual.layout == torch.strided and expected.layout == torch.strided
            and actual.device.type == "cpu" and expected.device.type == "cpu"
            and actual.shape == expected.shape and 0 < actual.numel() <= PLAIN_ELEMENTS)


def _differences(a: list[float], e: list[float], a_least: float, e_least: float
                 ) -> tuple[float, float, list[float], list[float]] | None:
    """The greatest absolute and relative differences (as ``small_close``'s screen computes
    them) and the squares ``unclean`` sums; None at a value this module leaves to torch."""
    max_abs = max_rel = 0.0
    squares: list[float] = []
    sizes: list[float] = []
    for x, y in zip(a, e, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)) or (
                x and abs(x) < a_least) or (y and abs(y) < e_least):
            return None
        diff, scale = abs(x - y), abs(y)
        # 0/0 is NaN in torch, which small_close counts as 0; d/0 is inf
        rel = diff / scale if scale else (math.inf if diff else 0.0)
        square, size_square = diff * diff, y * y
        if not math.isfinite(diff) or any(0 < value < _LEAST for value in (
                diff, rel, square, size_square)):
            return None
        max_abs, max_rel = max(max_abs, diff), max(max_rel, rel)
        squares.append(square)
        sizes.append(size_square)
    return max_abs, max_rel, squares, sizes


def _rms_clean(squares: list[float], sizes: list[float], dtype: torch.dtype,
               held: torch.dtype) -> bool:
    """Whether ``unclean`` finds the pair clean, clearly: its RMS error exactly zero, or
    below its bound by more than torch's sums can be off (else False: torch decides)."""
    error, size = math.fsum(squares), math.fsum(sizes)
    if not error:
        return True
    if not (math.isfinite(error) and math.isfinite(size)):
        return False
    count = len(squares)
    error, size = math.sqrt(error / count), math.sqrt(size / count)
    bound = CLEAN * unit_roundoff(held) * size + least_step(dtype, held)
    return error <= bound * (1 - _MARGIN)


def _values(t: torch.Tensor) -> list[float] | None:
    """The tensor's values in its logical order, flat, as Python floats."""
    found = t.tolist()
    for _ in range(t.dim() - 1):
        found = [value for row in found for value in row]
    if t.dim() == 0:
        found = [found]
    return found if all(type(value) is float for value in found) else None

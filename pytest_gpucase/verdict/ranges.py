"""A result the dtype cannot hold: a failure caused by the range of the run's precision, told
apart from rounding and from a wrong formula, and named (``OVERFLOW``, ``UNDERFLOW``).

Two findings name it. The run is infinite where the float64 reference is finite but past the
dtype's largest value (``result_overflow``: ``exp`` of 12 in float16, ``tan``'s gradient near
its pole): the result itself cannot be held. Or the reference run again with every
operation's result stored as the dtype's range stores it, and nothing rounded
(``rounding.HeldAsStored``: past the largest value an infinity, below the smallest normal a
subnormal or 0) is off the reference as the run is (``range_failure``): a value of the
computation cannot be held, though the result could (a hand-written RMS norm of values near
1e-4 in float16, whose squares are 0 there). Either fails: it is a real bug at that dtype,
and the advice is the fix (compute that part in float32, scale, a fused operation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pytest_gpucase.verdict.allowance import least_step, wide64
from pytest_gpucase.verdict.messages import num
from pytest_gpucase.verdict.rounding import RULE, RangeEvent, coarser, unit_roundoff

__all__ = ["ADVICE", "OVERFLOW", "RANGE_CLASSES", "UNDERFLOW", "RangeFailure", "non_finite",
           "range_failure", "result_overflow"]

OVERFLOW = "overflow"
UNDERFLOW = "underflow"
RANGE_CLASSES = (OVERFLOW, UNDERFLOW)
ADVICE = ("compute that part in float32 (.float(), then back), scale the values into the "
          "dtype's range first (divide by the largest before squaring or exponentiating), "
          "or use a fused operation (torch.nn.functional.rms_norm, softmax, logsumexp) whose "
          "kernel keeps its intermediate values in float32")


@dataclass(frozen=True)
class RangeFailure:
    """One leaf that fails because its dtype cannot hold a value of its computation."""

    path: str
    kind: str  # OVERFLOW | UNDERFLOW
    message: str


def _tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return None
        if value.layout != torch.strided:   # compared by its dense values
            value = value.to_dense()
        return wide64(value)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _held(actual: object, precision: torch.dtype | None) -> torch.dtype | None:
    """The dtype the run held the leaf in: the coarser of its own and the run's precision."""
    if isinstance(actual, torch.Tensor):
        if not actual.is_floating_point():
            return None
        return coarser(actual.dtype, precision)
    return precision if precision is not None and precision.is_floating_point else None


def non_finite(actual: object, expected: object) -> bool:
    """Whether the run is NaN or infinite somewhere the reference is finite."""
    a, e = _tensor(actual), _tensor(expected)
    if a is None or e is None or a.shape != e.shape:
        return False
    return bool((~torch.isfinite(a) & torch.isfinite(e)).any())


def result_overflow(path: str, actual: object, expected: object,
                    precision: torch.dtype | None) -> RangeFailure | None:
    """An overflow of the result itself: the run is infinite where the reference is finite
    and past the largest value of the dtype the run held it in."""
    a, e, held = _tensor(actual), _tensor(expected), _held(actual, precision)
    if a is None or e is None or held is None or a.shape != e.shape or a.is_complex():
        return None
    largest = float(torch.finfo(held).max)
    past = torch.isinf(a) & torch.isfinite(e) & (e.abs() > largest)
    if not bool(past.any()):
        return None
    reach = float(e.abs().masked_fill(~past, 0).amax())
    name = _name(held)
    return RangeFailure(path, OVERFLOW, (
        f"{path}: {name} cannot hold the result ({OVERFLOW}): the run is infinite at "
        f"{int(past.sum())} element{'s' if int(past.sum()) != 1 else ''} where the float64 "
        f"reference reaches {num(reach)}, past {name}'s largest value {num(largest)}; "
        f"{ADVICE}"))


def _rms(t: torch.Tensor) -> float:
    return float(t.square().mean().sqrt()) if t.numel() else 0.0


def range_failure(path: str, actual: object, expected: object, limited: object,
                  precision: torch.dtype | None,
                  events: Mapping[str, RangeEvent]) -> RangeFailure | None:
    """The leaf's failure told as its dtype's range, or None.

    ``limited``: the leaf of the reference run again under ``HeldAsStored`` at ``precision``
    (with its ``events``). It is the range's doing when the run is off the reference by more
    than ``RULE`` units of the output's spacing at its RMS size (``u`` x size plus the
    dtype's smallest subnormal: an output itself below the normal range is judged as the
    dtype holds it), or non-finite where the reference is finite; the range-limited
    reference is off as far (or non-finite at at least half of the same places); and the run
    is nearer the range-limited reference than the reference itself. The first operation
    that lost a value (an overflow or an underflow) names the class."""
    a, e, r = _tensor(actual), _tensor(expected), _tensor(limited)
    held = _held(actual, precision)
    if (a is None or e is None or r is None or held is None or not events
            or not (a.shape == e.shape == r.shape) or a.is_complex() or e.numel() == 0):
        return None
    finite_e = torch.isfinite(e)
    scale = (unit_roundoff(held) * _rms(torch.where(finite_e, e.abs(), 0))
             + least_step(held, precision))
    broken = ~torch.isfinite(a) & finite_e
    if bool(broken.any()):
        also = broken & ~torch.isfinite(r)
        if int(also.sum()) * 2 < int(broken.sum()):
            return None
        how = (f"the run is non-finite at {int(broken.sum())} element"
               f"{'s' if int(broken.sum()) != 1 else ''} where the float64 reference is "
               f"finite, and so is the reference with {_name(held)}'s range at "
               f"{int(also.sum())} of them")
    else:
        both = torch.isfinite(a) & torch.isfinite(r) & finite_e
        run_error = _rms(torch.where(both, a - e, 0))
        range_error = _rms(torch.where(both, r - e, 0))
        if not (run_error > RULE * scale and range_error > RULE * scale
                and _rms(torch.where(both, a - r, 0)) < run_error / 2):
            return None
        units = run_error / scale
        how = (f"its RMS error {num(run_error)} is {units:.3g} units of roundoff of its RMS "
               f"size in {_name(held)}, past the rule's {RULE:g}, and the float64 reference "
               f"with {_name(held)}'s range is {num(range_error)} off too: not a rounding")
    kind = next(iter(events))
    event = events[kind]
    info = torch.finfo(held)
    if kind == OVERFLOW:
        what = (f"{event.op} makes {num(event.value)}, past {_name(held)}'s largest value "
                f"{num(float(info.max))}")
    else:
        what = (f"{event.op} makes values up to {num(event.value)} in magnitude that "
                f"{_name(held)} holds as a subnormal or 0 (its smallest normal is "
                f"{num(float(info.smallest_normal))}), losing at least half of each")
    return RangeFailure(path, kind, (
        f"{path}: {_name(held)} cannot hold a value of this computation ({kind}): {what}; "
        f"{how} (the reference run again with every operation's result stored as "
        f"{_name(held)}'s range stores it, nothing rounded); {ADVICE}"))

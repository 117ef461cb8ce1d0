"""The second look at one leaf: whether it is wrong by a little everywhere (a clean pass
or not, ``CLEAN``), how far each element is from its budget (``element_tally``), and what
a report says of a leaf judged by its budget (``budget_record``). ``compare`` walks the
outputs and asks these; ``rounding`` makes the budget."""

from __future__ import annotations

import math

import torch

from pytest_gpucase.verdict.messages import num
from pytest_gpucase.verdict.rounding import (CLEAN, Budget, RmsCheck, coarser, rms_size,
                                             unit_roundoff)
from pytest_gpucase.verdict.stats import TensorStats
from pytest_gpucase.verdict.tolerance import Tolerance

__all__ = ["budget_notes", "budget_record", "element_tally", "least_step", "unclean",
           "unclean_message", "wide64"]


def wide64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


# Above this many elements, the RMS of a clean pass is taken in pieces of this many.
_RMS_PIECE = 1 << 20


def unclean(actual: torch.Tensor, expected: torch.Tensor,
             precision: torch.dtype) -> tuple[float, float] | None:
    """The RMS error and the RMS size of a pair whose RMS error is past ``CLEAN`` units of
    roundoff of its RMS size at ``precision`` (over the elements finite on both sides),
    else None: what a default tolerance lets through by its atol, a constant relative
    error of 1e-4 of a float32 output of size 0.1, is not a clean pass."""
    if actual.shape != expected.shape or actual.numel() == 0:
        return None
    if not (precision.is_floating_point or precision.is_complex):
        return None
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    wide = torch.complex128 if (a.is_complex() or e.is_complex()) else torch.float64
    if a.device.type != "cpu":
        wide = torch.complex64 if wide == torch.complex128 else torch.float32
    error = size = 0.0
    for start in range(0, a.numel(), _RMS_PIECE):
        x = a[start:start + _RMS_PIECE].to(wide)
        y = e[start:start + _RMS_PIECE].to(device=x.device, dtype=wide)
        both = torch.isfinite(x) & torch.isfinite(y)
        error += float(torch.where(both, (x - y).abs(), 0).square().sum())
        size += float(torch.where(torch.isfinite(y), y.abs(), 0).square().sum())
    error, size = math.sqrt(error / a.numel()), math.sqrt(size / a.numel())
    if error <= CLEAN * unit_roundoff(precision) * size + least_step(actual.dtype, precision):
        return None
    return error, size


def least_step(dtype: torch.dtype, precision: torch.dtype | None) -> float:
    """The spacing of the coarser dtype's values at zero (its smallest subnormal): an error
    below it is one the dtype cannot show (a product of 125 numbers below 1 is 1e-57 in
    float64 and 0 in float32, correctly)."""
    held = coarser(dtype, precision)
    if not (held.is_floating_point or held.is_complex):
        return 0.0
    info = torch.finfo(held.to_real())
    return float(info.smallest_normal) * float(info.eps)


def unclean_message(path: str, error: float, size: float, precision: torch.dtype) -> str:
    u = unit_roundoff(precision)
    name = str(precision).removeprefix("torch.")
    units = error / (u * size) if size > 0 else math.inf
    return (f"{path}: values differ by a little everywhere: within the default tolerance "
            f"element by element, but its RMS error {num(error)} is {units:.3g} units of "
            f"roundoff of its RMS size {num(size)} in {name}, past the {CLEAN:g} a clean "
            "pass allows, and past what rounding of this computation explains")


def budget_record(path: str, actual: object, expected: object, budget: Budget,
                  checks: list[RmsCheck] | None = None) -> dict[str, object]:
    """What a report says of a leaf judged by its rounding budget: its precision and
    multiplier, the RMS error it was allowed (``multiplier`` x RMS spread + one rounding of
    its RMS size) and had, their ratio (above 1 fails), and the constant relative error
    the budget lets through in units of roundoff (``rule_units``; past the precision's
    detectability rule, ``wide``). ``checks``: the leaf's ``Budget.rms_checks``, made
    already."""
    if checks is None:
        checks = budget.rms_checks(actual, expected)
    # the binding one of the leaf's RMS tests (``Budget.rms_checks``)
    check = max(checks, key=lambda c: c.ratio if c.ratio is not None else math.inf,
                default=None)
    units = budget.rule_units(expected)
    return {"path": path, "precision": str(budget.precision).removeprefix("torch."),
            "multiplier": check.multiplier if check else budget.multiplier,
            "rms_error": check.error if check else None,
            "rms_allowed": check.allowed if check else None,
            "ratio": check.ratio if check else None,
            "left_out": check.left_out if check else 0,
            "rule_units": units, "wide": units is not None and units > budget.rule}


def budget_notes(path: str, expected: torch.Tensor, budget: Budget) -> list[str]:
    """What a pass within its budget says of itself: that the budget is as large as the
    output's own RMS size (at that precision the inputs decide the output only to within
    its size), or wider than the detectability rule (``Budget.rule``) allows; else nothing."""
    size = rms_size(wide64(expected))
    name = str(budget.precision).removeprefix("torch.")
    if budget.rms * budget.multiplier >= size > 0:
        return [f"{path} passed within a rounding budget (RMS {num(budget.multiplier)} x "
                f"{num(budget.rms)}) as large as its own RMS size ({num(size)}): in {name} "
                "this computation decides it only to within its size, so the check says "
                "little; judge it in a finer dtype"]
    units = budget.rule_units(expected)
    if units is not None and units > budget.rule:
        return [f"{path} passed within a rounding budget wider than the detectability rule: "
                f"it lets a constant relative error of {units:.3g} units of roundoff of its "
                f"RMS size through in {name}, past the rule's {budget.rule:g} "
                "(docs/verdicts.md); one rounding of this computation moves it that much"]
    return []


def element_tally(actual: torch.Tensor, expected: torch.Tensor, default: Tolerance,
                  budget: Budget, allowance: torch.Tensor,
                  keep: int) -> tuple[TensorStats, Tolerance]:
    """The leaf judged element by element against its budget (``Budget.allowance``, at
    least the default atol or CLEAN roundings of the leaf's RMS size, whichever is less) or
    its default tolerance, whichever is larger at each element: the tally, and the
    tolerance at the worst element."""
    a, e = wide64(actual), wide64(expected)
    both = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.where(both, (a - e).abs(), 0).reshape(-1)
    size = torch.where(torch.isfinite(e), e.abs(), 0).reshape(-1)
    rms_size = float(size.square().mean().sqrt()) if size.numel() else 0.0
    floor = max(min(default.atol, CLEAN * unit_roundoff(budget.precision) * rms_size),
                least_step(actual.dtype, budget.precision))
    atol = torch.clamp(allowance, min=floor)
    # The budget or the default tolerance, whichever is larger: each may justify an element,
    # never their sum (bfloat16's rtol is 8 roundings, and the budget of a sum of products
    # as much again: one element of a matmul 13 roundings off passed both added up).
    allowed = torch.maximum(atol, default.atol + default.rtol * size)
    bad = diff > allowed
    stats = TensorStats(keep=keep)
    if diff.numel():
        rel = torch.where(size > 0, diff / size, torch.where(diff > 0, math.inf, 0.0))
        stats.note(float(diff.max()), float(rel.max()))
    count = int(bad.sum())
    stats.mismatched = count
    if not count:
        return stats, default
    ranked = torch.where(bad, diff, -1.0)
    top = torch.topk(ranked, min(stats.keep, count)).indices.tolist()
    for index in top:
        stats.add_worst(float(diff[index]), index)
    rel_index = int(torch.where(bad, rel, -1.0).argmax())
    stats.add_rel(float(rel[rel_index]), rel_index)
    at = top[0]
    name = str(budget.precision).removeprefix("torch.")
    source = (f"{default.source or 'defaults'}, or where it is larger the rounding budget "
              f"per element: {budget.multiplier:g} x the greatest change, when every input "
              f"and every operation's result is rounded once to {name}, of the elements no "
              f"larger than twice this one ({num(float(atol[at]))} at the worst element; "
              f"{num(float(atol.max()))} at most)")
    # As an atol beside the default rtol, so that the bound shown at the worst element is
    # the one it was held to.
    shown = max(float(allowed[at]) - default.rtol * float(size[at]), default.atol)
    return stats, Tolerance(rtol=default.rtol, atol=shown, ulps=None, source=source)

"""The child's extra runs behind a verdict: the cotangents of a gradient check, the draws
of a rounding budget, the CPU's own run in the same dtype, and a float64 gradient check.

What they are for, and the rules that judge by them, are ``verdict.rounding``'s; here
they are run, each only when a verdict needs it (``Look`` computes nothing until the
comparison asks), and handed to the reference cache by ``run.child``.

Cotangents. With ``[expect] gradients = true`` the call and the reference are
differentiated along the same random direction: each output tensor's cotangent is
drawn in float64 from a seed made of its path and shape, rounded to the run's
precision (the coarser of it and the output's dtype, so that the call's cotangent
holds exactly those values) and given to the reference as those values in float64.
The sum of the outputs, the cotangent before, differentiates a softmax or a
normalization to exactly zero, where only rounding noise is left to compare.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
from torch.autograd.gradcheck import GradcheckError, gradcheck

from pytest_gpucase.verdict.rounding import (
    NEEDED,
    Needed,
    Budget,
    HeldAsStored,
    RangeEvent,
    RoundEveryOp,
    coarser,
    draw_seeds,
    element_spread,
    perturbed,
    spread,
    unit_roundoff,
)
from pytest_gpucase.verdict.structure import named_leaves

__all__ = [
    "GRADCHECK_INPUTS",
    "GRADCHECK_SECONDS",
    "GRADIENT_RTOL",
    "PROBES",
    "STEP",
    "Abandoned",
    "Look",
    "NotChecked",
    "cotangent",
    "drawn",
    "element_spreads_of",
    "gradient_check",
    "leaves_of",
    "range_limited",
    "spreads_of",
]

# A float64 gradcheck in fast mode evaluates the call twice per floating input: with more
# inputs than this (a model's every parameter), or an estimated cost above this many
# seconds, it is not run, and the item says so.
GRADCHECK_INPUTS = 64
GRADCHECK_SECONDS = 60.0
# The gradient check: random directions per input, the central differences' step relative
# to the input's RMS size, and the relative agreement asked of the backward (a backward 1%
# off is 10 times past it; central differences in float64 agree to about 1e-8).
PROBES = 2
STEP = 1e-6
GRADIENT_RTOL = 1e-3
_ROUNDOFF = 2.0 ** -52
_PROBE_SEED = 0x9D1C


def cotangent(path: str, value: torch.Tensor, precision: torch.dtype | None) -> torch.Tensor:
    """The cotangent of the output at ``path``: seeded by the path and the shape, drawn in
    float64 on the CPU and rounded to the coarser of ``precision`` and the output's dtype."""
    seed = int.from_bytes(hashlib.sha256(f"{path}|{tuple(value.shape)}".encode()).digest()[:8],
                          "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    real = value.dtype.to_real()
    rounded = coarser(real, precision.to_real() if precision is not None else None)
    drawn = torch.randn(value.shape, generator=generator, dtype=torch.float64)
    if value.is_complex():
        imag = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        return torch.complex(drawn.to(rounded).double(), imag.to(rounded).double())
    return drawn.to(rounded).double()


def leaves_of(results: Mapping[str, Any]) -> dict[str, object]:
    """A run's results (``{"out": ..., "grad": ...}``) as leaf path -> tensor or number, with
    the paths the comparison reports (``out['logits']``, ``grad['x']``)."""
    found: dict[str, object] = {}
    for key, value in results.items():
        found.update(named_leaves(value, key))
    # A sparse leaf is compared by its dense values: its spreads and baseline are too.
    return {path: value.to_dense() if isinstance(value, torch.Tensor)
            and value.layout != torch.strided else value for path, value in found.items()}


def spreads_of(reference: Mapping[str, Any], draw: Callable[[int], Mapping[str, Any]],
               wanted: Collection[str] | None = None) -> dict[str, tuple[float, float]]:
    """Each leaf's spread: its greatest change over the draws, and its RMS change over all of
    them (``draw(seed)`` runs one). ``wanted``: the leaves to measure (those that need a
    budget), all when None. ``elements_of`` gives the change of each element."""
    found = element_spreads_of(reference, draw, wanted)
    return {path: (greatest, rms) for path, (greatest, rms, _) in found.items()}


def element_spreads_of(reference: Mapping[str, Any], draw: Callable[[int], Mapping[str, Any]],
                       wanted: Collection[str] | None = None,
                       ) -> dict[str, tuple[float, float, torch.Tensor | None]]:
    """``spreads_of``, with each tensor leaf's greatest change of each element over the draws
    (float64, the leaf's shape; None for a number or a non-finite spread)."""
    expected = leaves_of(reference)
    if wanted is not None:
        expected = {path: value for path, value in expected.items() if path in wanted}
    greatest = dict.fromkeys(expected, 0.0)
    square = dict.fromkeys(expected, 0.0)
    elements: dict[str, torch.Tensor | None] = dict.fromkeys(expected)
    seeds = draw_seeds()
    for seed in seeds:
        drawn = leaves_of(draw(seed))
        for path, value in expected.items():
            found = drawn.get(path)
            most, rms = (math.inf, math.inf) if found is None else spread(value, found)
            greatest[path] = max(greatest[path], most)
            square[path] += rms * rms / len(seeds)
            if math.isfinite(most) and isinstance(value, torch.Tensor):
                moved = element_spread(value, found)
                before = elements[path]
                elements[path] = moved if before is None else torch.maximum(before, moved)
    return {path: (greatest[path], math.sqrt(square[path]),
                   elements[path] if math.isfinite(greatest[path]) else None)
            for path in expected}


def drawn(call: Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]], Mapping[str, Any]],
          inputs: Callable[[], Mapping[str, Any]], cotangents: Mapping[str, torch.Tensor],
          precision: torch.dtype,
          events: dict[str, RangeEvent] | None = None,
          autocast: bool = False) -> Callable[[int], Mapping[str, Any]]:
    """One draw of the rounding budget: ``call`` on the inputs and cotangents each rounded
    once, every operation's result rounded once (``RoundEveryOp``), at ``precision``.

    ``inputs`` is asked for on the first draw, once: a run that passes without a budget
    never makes them (loading a case's inputs again is most of what a draw would cost it).
    ``events``: where the draws note the first operations whose result ``precision`` cannot
    hold (``RoundEveryOp``): a failure then looks at the dtype's range (``range_limited``).

    ``autocast``: the call is an autocast run (of dtype ``precision``) and ``call`` its
    float32 reference. Each value is then rounded at the precision of the dtype the run
    holds it in (``verdict.held``), and the inputs not at all: the run reads them as they
    are, as its reference does."""
    u = unit_roundoff(precision)
    made: list[Mapping[str, Any]] = []

    def run(seed: int) -> Mapping[str, Any]:
        if not made:
            try:
                made.append(inputs())
            except Exception as exc:  # the case's own inputs, not the code under perturbation
                raise Abandoned(exc) from exc
        generator = torch.Generator().manual_seed(seed)
        inputs_now = perturbed(dict(made[0]), 0.0 if autocast else u, generator, precision)
        cotangents_now = perturbed(dict(cotangents), u, generator, precision)
        with RoundEveryOp(u, generator, precision, events,
                          autocast=precision if autocast else None):
            return call(inputs_now, cotangents_now)

    return run


def range_limited(call: Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]],
                                  Mapping[str, Any]],
                  inputs: Mapping[str, Any], cotangents: Mapping[str, torch.Tensor],
                  precision: torch.dtype) -> tuple[dict[str, object], dict[str, RangeEvent]]:
    """The reference's leaves with every operation's result stored as ``precision``'s range
    stores it, nothing rounded (``HeldAsStored``), and the first operations that overflowed
    and underflowed: one more run of the reference, made for a failing leaf only
    (``verdict.ranges`` reads it)."""
    mode = HeldAsStored(precision)
    with mode:
        found = call(inputs, cotangents)
    return leaves_of(found), dict(mode.events)


class Abandoned(Exception):
    """The run's own failure, met while a draw or the baseline was made (the case's inputs
    cannot be loaded again; the code overwrote what it returned before): not the user's code
    failing under perturbation, which ``Look`` says and passes over. The caller raises
    ``error`` again."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Look:
    """The second look of one comparison (``verdict.rounding.SecondLook``): data only. The
    comparison asks for a leaf's budget or baseline; what is not computed yet is answered
    ``NEEDED`` (and remembered), and ``settle`` computes it (``spreads(paths)`` runs the
    draws for those leaves only, ``baseline()`` the CPU's run) outside the comparison, which
    is then asked again (``run.judge``). A look read from the cache computes nothing that
    runs the user's code."""

    def __init__(self, *, precision: torch.dtype, fresh: bool = False,
                 spreads: Callable[[Collection[str]], Mapping[str, tuple[Any, ...]]]
                 | None = None,
                 baseline: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.precision, self.fresh = precision, fresh  # fresh: computed here, to be kept
        self._spreads_fn, self._baseline_fn = spreads, baseline
        # path -> (greatest, RMS) spread, and the spread of each element when known.
        self.spreads: dict[str, tuple[Any, ...]] | None = None
        self.baseline_results: Mapping[str, Any] | None = None
        self._baseline_leaves: dict[str, object] | None = None
        self.wanted: set[str] = set()  # answered NEEDED, not computed yet
        self._asked: set[str] = set()  # given to spreads(), found or not
        self._baseline_wanted = self._baseline_done = self._spreads_failed = False
        self.computed: set[str] = set()  # "spreads", "baseline": what to store
        self.seconds: dict[str, float] = {}
        self.problems: list[str] = []

    def budget(self, path: str) -> Budget | Needed | None:
        value = (self.spreads or {}).get(path)
        if value is not None:
            greatest, rms, *elements = value
            return Budget(greatest, rms, self.precision, elements[0] if elements else None)
        if self._spreads_fn is None or self._spreads_failed or path in self._asked:
            return None
        self.wanted.add(path)
        return NEEDED

    def baseline(self, path: str) -> object | Needed | None:
        if not self._baseline_done:
            if self._baseline_fn is None:
                return None
            self._baseline_wanted = True
            return NEEDED
        if self.baseline_results is None:
            return None
        if self._baseline_leaves is None:
            self._baseline_leaves = leaves_of(self.baseline_results)
        return self._baseline_leaves.get(path)

    @property
    def waiting(self) -> bool:
        """Whether the comparison asked for something not computed yet."""
        return bool(self.wanted) or self._baseline_wanted

    def settle(self) -> None:
        """Compute what the comparison asked for: the user's code runs here, never inside
        the comparison. Raises ``Abandoned`` for the run's own failure."""
        if self.wanted and self._spreads_fn is not None:
            paths, spreads_fn = sorted(self.wanted), self._spreads_fn
            self.wanted.clear()
            self._asked.update(paths)
            found = self._computed("spreads", lambda: spreads_fn(paths),
                                   "the rounding budget could not be computed")
            if found is None:
                self._spreads_failed = True
            self.spreads = {**(self.spreads or {}), **(found or {})}
        if self._baseline_wanted and self._baseline_fn is not None:
            self._baseline_wanted, self._baseline_done = False, True
            self.baseline_results = self._computed(
                "baseline", self._baseline_fn,
                "the same call could not run on the CPU in the same dtype (no baseline)")

    def _computed(self, what: str, compute: Callable[[], Any], failed: str) -> Any:
        began = time.perf_counter()
        try:
            found = compute()
        except Abandoned:
            raise
        except Exception as exc:  # the user's code under perturbation: said, never raised
            self.problems.append(f"{failed}: {type(exc).__name__}: {_first(exc)}")
            return None
        self.computed.add(what)
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - began
        return found

    @property
    def unstable(self) -> list[str]:
        """The leaves whose reference one rounding makes non-finite: no budget for them."""
        return [path for path, (greatest, *_) in (self.spreads or {}).items()
                if not math.isfinite(greatest)]

    def notes(self) -> Iterator[str]:
        """What the second look could not do, for the item's notes."""
        yield from self.problems
        if self.unstable:
            name = str(self.precision).removeprefix("torch.")
            yield (f"one rounding of every value at {name} makes the reference non-finite at "
                   f"{', '.join(self.unstable[:5])}: no rounding budget there, the default "
                   "tolerance alone judged it")


class NotChecked(Exception):
    """A gradcheck that was not run, and why (said in the item's notes)."""


def gradient_check(call: Callable[[Mapping[str, Any]], Any], inputs: Mapping[str, Any],
                   names: list[str], rng: torch.Tensor | None,
                   seconds_per_call: float) -> str | None:
    """Check the call's backward against central differences of its forward in float64 on
    the CPU: None when they agree, else why not (the analytical and numerical values, the
    tolerance, the sizes).

    For each differentiated input, ``PROBES`` random directions ``d``: the backward along a
    random cotangent ``v`` of every output gives ``<J^T v, d>`` (analytical), central
    differences of the forward give ``<v, (f(x + h d) - f(x - h d)) / 2h>`` (numerical). They
    must agree to ``GRADIENT_RTOL`` of the analytical value plus the differences' own
    noise (float64 roundoff of the outputs over the step, ``1e-6`` of the directional
    derivative's size, and the gap to the differences at twice the step, which bounds their
    truncation error): a tolerance that scales with the Jacobian, where torch's fast
    gradcheck held a product of size 1e-4 to an atol of 1e-5 and let a backward 10% off
    through. Complex inputs are checked by ``torch.autograd.gradcheck`` (fast mode).

    ``inputs`` are the float64 inputs; ``call(inputs)`` returns the outputs; ``names`` are
    the inputs differentiated (those the call gave a gradient: an input it uses as a
    constant, copied into a module under no_grad say, is left out). The RNG state
    (``rng``, the saved one, else the current) is restored before each evaluation, so that
    a dropout draws the same mask in every one. Raises ``NotChecked`` when the check would
    cost too much (``GRADCHECK_INPUTS``, ``GRADCHECK_SECONDS``).
    """
    names = [name for name in names if isinstance(inputs.get(name), torch.Tensor)
             and inputs[name].dtype in (torch.float64, torch.complex128)]
    if not names:
        return None
    _check_cost(names, seconds_per_call)
    state = rng if rng is not None else torch.get_rng_state()

    def function(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        torch.set_rng_state(state)
        out = call({**inputs, **dict(zip(names, values, strict=True))})
        found = tuple(t for _, t in named_leaves(out) if isinstance(t, torch.Tensor)
                      and t.requires_grad)
        return found

    values = tuple(inputs[name].detach().clone().requires_grad_() for name in names)
    with torch.enable_grad():
        if any(v.is_complex() for v in values):
            return _complex_gradcheck(function, values, names)
        outputs = function(*values)
        if not outputs:
            return None
        differences = _Differences(function, values, outputs)
        for index, (name, value) in enumerate(zip(names, values, strict=True)):
            if value.numel() == 0:
                continue
            found = differences.check(index, name)
            if found is not None:
                return found
    return None


def _check_cost(names: list[str], seconds_per_call: float) -> None:
    """Refuse a gradcheck of too many inputs or too many seconds (``NotChecked``)."""
    if len(names) > GRADCHECK_INPUTS:
        raise NotChecked(f"{len(names)} floating inputs, above {GRADCHECK_INPUTS}")
    estimate = (4 * PROBES * len(names) + 4) * seconds_per_call
    if estimate > GRADCHECK_SECONDS:
        raise NotChecked(f"about {estimate:.0f} s of float64 runs, above {GRADCHECK_SECONDS:g} s")


class _Differences:
    """The backward of a real call against central differences of its forward, per input."""

    def __init__(self, function: Callable[..., tuple[torch.Tensor, ...]],
                 values: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        self.function, self.values, self.outputs = function, values, outputs
        self.generator = torch.Generator().manual_seed(_PROBE_SEED)
        self.cotangents = [torch.randn(o.shape, generator=self.generator, dtype=torch.float64
                                       ).to(o.dtype) for o in outputs]
        self.grads = torch.autograd.grad(outputs, values, self.cotangents, allow_unused=True)
        sizes = [o.detach() for o in outputs]
        self.v_norm = math.sqrt(sum(float(c.double().square().sum()) for c in self.cotangents))
        self.f_norm = math.sqrt(sum(float(o.double().abs().square().sum()) for o in sizes))
        if not math.isfinite(self.f_norm):
            raise NotChecked("the outputs are not finite")

    def evaluated(self, index: int, step: torch.Tensor) -> list[torch.Tensor]:
        """The outputs with input ``index`` moved by ``step``."""
        moved = [v.detach().clone().requires_grad_() for v in self.values]
        with torch.no_grad():
            moved[index] += step
        found = self.function(*moved)
        if len(found) != len(self.outputs):
            raise NotChecked("the call returns other outputs on a moved input")
        return [t.detach() for t in found]

    def directional(self, index: int, h: float, direction: torch.Tensor) -> tuple[float, float]:
        """``<v, (f(x + h d) - f(x - h d)) / 2h>`` and the norm of the difference."""
        ahead = self.evaluated(index, h * direction)
        behind = self.evaluated(index, -h * direction)
        slopes = [(p - m) / (2 * h) for p, m in zip(ahead, behind, strict=True)]
        found = sum(float((c * d).sum()) for c, d in zip(self.cotangents, slopes, strict=True))
        return found, math.sqrt(sum(float(d.square().sum()) for d in slopes))

    def check(self, index: int, name: str) -> str | None:
        """Whether input ``index`` passes its ``PROBES`` directions: None, else why not."""
        value, grad = self.values[index], self.grads[index]
        scale = float(value.detach().abs().square().mean().sqrt()) or 1.0
        h = STEP * scale
        for _ in range(PROBES):
            direction = torch.randn(value.shape, generator=self.generator, dtype=torch.float64)
            analytical = (float((grad * direction).sum()) if grad is not None else 0.0)
            numerical, slope_norm = self.directional(index, h, direction)
            # The same at twice the step: central differences are off by a term in h^2,
            # four times larger there, so a third of the gap is the step's own error
            # (tan near its pole, where 1e-6 is not small).
            coarse, _ = self.directional(index, 2 * h, direction)
            if not (math.isfinite(numerical) and math.isfinite(slope_norm)
                    and math.isfinite(coarse)):
                raise NotChecked(f"the forward is not finite a step of {h:.3g} away from "
                                 f"{name} (a pole or a domain's edge)")
            noise = (8 * _ROUNDOFF * self.v_norm * self.f_norm / h
                     + 1e-6 * self.v_norm * slope_norm + abs(coarse - numerical))
            tolerance = GRADIENT_RTOL * abs(analytical) + noise
            if not abs(numerical - analytical) <= tolerance:
                total = sum(o.numel() for o in self.outputs)
                return (f"the gradient with respect to {name} along a random direction "
                        f"(a random cotangent of the outputs) is {analytical:.6g} by the "
                        f"backward (analytical) and {numerical:.6g} by central "
                        f"differences of the forward (numerical, step {h:.3g}): "
                        f"{abs(numerical - analytical):.3g} apart, past the tolerance "
                        f"{tolerance:.3g} ({GRADIENT_RTOL:g} of the analytical value "
                        f"plus the differences' noise {noise:.3g}); {name} has "
                        f"{value.numel()} elements, the outputs {total}")
        return None


# torch.autograd.gradcheck's tolerance, given explicitly so that a failure can state it.
_COMPLEX_ATOL = 1e-5
_COMPLEX_RTOL = 1e-3
_MISMATCH = re.compile(
    r"(?P<head>.*?Jacobian mismatch for output (?P<output>\d+) with respect to input "
    r"(?P<input>\d+)),?\s*numerical:\s*(?P<numerical>\S+)\s*analytical:\s*"
    r"(?P<analytical>\S+)", re.DOTALL)


def _complex_gradcheck(function: Callable[..., tuple[torch.Tensor, ...]],
                       values: tuple[torch.Tensor, ...], names: list[str]) -> str | None:
    outputs = function(*values)
    if not outputs:
        return None
    try:
        gradcheck(function, values, atol=_COMPLEX_ATOL, rtol=_COMPLEX_RTOL, fast_mode=True,
                  check_undefined_grad=False, check_batched_grad=False, raise_exception=True)
    except GradcheckError as exc:
        return _complex_problem(str(exc), values, names, outputs)
    return None


def _complex_problem(text: str, values: tuple[torch.Tensor, ...], names: list[str],
                     outputs: tuple[torch.Tensor, ...]) -> str:
    """torch's gradcheck failure told as the real check tells one: the analytical and the
    numerical value, how far apart against which tolerance, and the sizes."""
    total = sum(o.numel() for o in outputs)
    tolerance = (f"torch.autograd.gradcheck's tolerance atol {_COMPLEX_ATOL:g} + rtol "
                 f"{_COMPLEX_RTOL:g} x |numerical|, in fast mode: along random vectors")
    found = _MISMATCH.search(text)
    if found is None:
        lines = [line for line in text.splitlines() if line.strip()]
        sizes = ", ".join(f"{name} has {v.numel()} elements"
                          for name, v in zip(names, values, strict=True))
        return f"{' '.join(lines[:2])} ({tolerance}; {sizes}, the outputs {total})"
    index = int(found["input"])
    name = names[index] if index < len(names) else f"input {index}"
    size = values[index].numel() if index < len(values) else 0
    try:
        analytical, numerical = complex(found["analytical"]), complex(found["numerical"])
    except ValueError:
        return (f"{found['head']} ({name}): {found['analytical']} by the backward "
                f"(analytical) and {found['numerical']} by finite differences (numerical), "
                f"past {tolerance}; {name} has {size} elements, the outputs {total}")
    allowed = _COMPLEX_ATOL + _COMPLEX_RTOL * abs(numerical)
    return (f"{found['head']} ({name}): {analytical:.6g} by the backward (analytical) and "
            f"{numerical:.6g} by finite differences of the forward (numerical): "
            f"{abs(analytical - numerical):.3g} apart, past the tolerance {allowed:.3g} "
            f"({tolerance}); {name} has {size} elements, the outputs {total}")


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""

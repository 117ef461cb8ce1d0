"""``compare``'s Python fast path for a small clean pair (``verdict._small``) against the
full path: over a generated corpus, the same verdict, message and figures either way."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_gpucase.verdict import _small
from pytest_gpucase.verdict import compare as compare_module
from pytest_gpucase.verdict.compare import Comparison, compare
from pytest_gpucase.verdict.rounding import NEEDED, Budget
from pytest_gpucase.verdict.tolerance import Tolerance

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class Look:
    """A second look that knows a budget for some paths, has not computed others."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def budget(self, path: str) -> Any:
        return self.answer

    def baseline(self, path: str) -> Any:
        return None


LOOKS = (None, Look(None), Look(NEEDED), Look(Budget(1e-6, 1e-7, torch.float32)))


def _values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Expected values: random of a random magnitude, now and then a special value."""
    scale = 10.0 ** float(torch.randint(-45, 45, (), generator=gen))
    e = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if float(torch.rand((), generator=gen)) < 0.3 and e.numel():
        flat = e.reshape(-1)
        specials = (math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-310, 1e-39, 3e-5,
                    1e300, 6.5e4, 3.4e38, 2.0 ** -126)
        for _ in range(int(torch.randint(1, 3, (), generator=gen))):
            index = int(torch.randint(0, flat.numel(), (), generator=gen))
            flat[index] = specials[int(torch.randint(0, len(specials), (), generator=gen))]
    return e.to(dtype)  # type: ignore[no-any-return]


def _actual(gen: torch.Generator, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The expected values in ``dtype``, off by nothing, by a rounding, or by more."""
    noise = (0.0, 0.0, 1e-16, 1e-9, 1e-7, 3e-6, 1e-5, 1e-4, 1e-3, 0.1)
    factor = noise[int(torch.randint(0, len(noise), (), generator=gen))]
    wide = expected.double()
    moved = wide * (1 + factor * torch.randn(wide.shape, generator=gen, dtype=torch.float64))
    if float(torch.rand((), generator=gen)) < 0.2:  # an absolute offset
        moved = moved + factor * 1e-6 * torch.randn(wide.shape, generator=gen,
                                                     dtype=torch.float64)
    return moved.to(dtype)


def corpus(count: int) -> Iterator[tuple[object, object, dict[str, Any]]]:
    gen = torch.Generator().manual_seed(35)
    shapes: tuple[tuple[int, ...], ...] = ((), (1,), (4,), (2, 3), (3, 1, 2), (8, 8), (65,))
    for index in range(count):
        shape = shapes[int(torch.randint(0, len(shapes), (), generator=gen))]
        e_dtype = (torch.float64 if index % 3 else
                   FLOATS[int(torch.randint(0, 4, (), generator=gen))])
        a_dtype = FLOATS[int(torch.randint(0, 4, (), generator=gen))]
        expected = _values(gen, shape, e_dtype)
        t = _actual(gen, expected, a_dtype)
        actual: object = t
        pick = int(torch.randint(0, 20, (), generator=gen))
        if pick == 0 and expected.dim() == 2:
            actual, expected = t.t(), expected.t()
        elif pick == 1:
            actual = t.reshape(-1)[:-1] if expected.numel() > 1 else t
        elif pick == 2:
            actual = (t * 1000).to(torch.int64)
        elif pick == 3:
            actual = t != 0
        elif pick == 4:
            actual = torch.nn.Parameter(t, requires_grad=False)
        elif pick == 5:
            actual = t.requires_grad_()
        elif pick == 6:
            actual = float(t.reshape(-1)[0]) if expected.numel() else 0.0
        options: dict[str, Any] = {
            "equal_nan": bool(index % 2),
            "check_dtype": bool(index % 5 == 0),
            "precision": (None, torch.float32, torch.bfloat16, torch.float16,
                          torch.float64)[index % 5],
            "second_look": LOOKS[index % len(LOOKS)],
        }
        if index % 7 == 0:
            options["tolerances"] = {a_dtype: Tolerance(rtol=1e-3, atol=1e-6, source="given")}
        elif index % 7 == 1:
            options["tolerances"] = {torch.float32: Tolerance(rtol=0.0, atol=0.0, ulps=4,
                                                              source="given")}
        yield actual, expected, options


def _seen(found: Comparison) -> tuple[str, str, tuple[str, ...]]:
    # repr: NaN figures compare equal as text; budgets and pending are kept out of it
    return repr(found), repr(found.budgets), found.pending


def test_the_fast_path_judges_as_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    decided = []

    def counted(*args: Any) -> tuple[float, float] | None:
        found = _small.clean_small(*args)
        decided.append(found is not None)
        return found

    pairs = list(corpus(2500))
    with torch.no_grad():
        monkeypatch.setattr(compare_module, "clean_small", counted)
        fast = [_seen(compare(a, e, **options)) for a, e, options in pairs]
        monkeypatch.setattr(compare_module, "clean_small", lambda *args: None)
        full = [_seen(compare(a, e, **options)) for a, e, options in pairs]
    for (a, e, options), one, other in zip(pairs, fast, full, strict=True):
        assert one == other, (a, e, options)
    # The corpus reaches both sides: many clean passes decided fast, the rest not.
    assert 0.15 * len(decided) < sum(decided) < 0.85 * len(decided), sum(decided)


@pytest.mark.parametrize("a_dtype", FLOATS)
def test_a_borderline_pair_is_left_to_the_full_path(a_dtype: torch.dtype) -> None:
    """At the tolerance's bound, at a subnormal, at NaN and inf: no fast verdict."""
    tol = compare_module.DEFAULT_TOLERANCES[a_dtype]
    e = torch.tensor([1e3, 2e3, 3e3, 4e3], dtype=torch.float64)
    at_bound = e + (tol.rtol * e + tol.atol / 2)  # past rtol, within both: its third test
    assert _small.clean_small(at_bound, e, tol, False, None) is None
    assert compare(at_bound, e, tolerances={torch.float64: tol}).ok
    tiny = torch.finfo(a_dtype).smallest_normal / 4
    for a_row, e_row in (([tiny, 1.0], [0.0, 1.0]), ([math.nan, 1.0], [math.nan, 1.0]),
                         ([math.inf, 1.0], [math.inf, 1.0])):
        actual = torch.tensor(a_row, dtype=torch.float64).to(a_dtype)
        expected = torch.tensor(e_row, dtype=torch.float64)
        assert actual[0] != 0 or math.isnan(actual[0])
        found = _small.clean_small(actual, expected, tol, False, torch.float32)
        assert found is None, (actual, expected)


def test_a_small_clean_pass_runs_one_torch_op_per_side() -> None:
    """The point of the fast path: in a fresh child each distinct torch op is a first touch
    of its pages; a clean 4-element pair is judged with tolist() of each side alone."""
    ops: list[str] = []

    class Record(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    actual = torch.ones(4) + 1
    expected = torch.ones(4, dtype=torch.float64) + 1 + 1e-9
    with Record():  # type: ignore[no-untyped-call]
        found = compare(actual, expected, check_dtype=False, precision=torch.float32,
                        second_look=Look(None))
    assert found.ok and found.max_abs == pytest.approx(1e-9)
    assert len(ops) <= 2, ops


@pytest.mark.parametrize("precision", [None, torch.float32, torch.bfloat16])
def test_a_cpu_runs_screens_are_made_before_any_child_is_forked(
        precision: torch.dtype | None) -> None:
    """Made at import in the pytest process (``_kernel``): a forked child finds the screen
    of its pair made (90 page faults and 0.3 ms when it makes it)."""
    from pytest_gpucase.verdict import _kernel

    for a_dtype in FLOATS:
        before = _kernel._screen_numbers.cache_info().misses
        compare(torch.ones(4, dtype=a_dtype) + 1, torch.ones(4, dtype=torch.float64) + 1,
                check_dtype=False, precision=precision, second_look=Look(None))
        assert _kernel._screen_numbers.cache_info().misses == before, a_dtype

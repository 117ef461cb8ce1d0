"""Unit tests for pytest_gpucase.compare: every kind of value, every rule, exact messages."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

from pytest_gpucase.verdict import _kernel
from pytest_gpucase.verdict import compare as compare_module
from pytest_gpucase.verdict.compare import (
    DEFAULT_TOLERANCES,
    Comparison,
    Mismatch,
    Tolerance,
    combine,
    compare,
)

NAN = float("nan")
INF = float("inf")


class Output(NamedTuple):
    logits: torch.Tensor
    loss: float


# The same fields under another name: a different declared type.
Other = namedtuple("Other", ["logits", "loss"])


def only(result: Comparison) -> Mismatch:
    __tracebackhide__ = True
    assert len(result.mismatches) == 1, result.report()
    return result.mismatches[0]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 64 elements, so small tensors span many, judged without batching."""
    monkeypatch.setattr(_kernel, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(_kernel, "SMALL_ELEMENTS", 0)
    return 64


class TestTolerances:
    def test_table_is_torch_testing_s(self) -> None:
        table = {
            torch.float16: Tolerance(1e-3, 1e-5),
            torch.bfloat16: Tolerance(1.6e-2, 1e-5),
            torch.float32: Tolerance(1.3e-6, 1e-5),
            torch.float64: Tolerance(1e-7, 1e-7),
            torch.complex32: Tolerance(1e-3, 1e-5),
            torch.complex64: Tolerance(1.3e-6, 1e-5),
            torch.complex128: Tolerance(1e-7, 1e-7),
        }
        assert table == DEFAULT_TOLERANCES

    def test_tolerance_is_frozen(self) -> None:
        with pytest.raises(AttributeError):
            Tolerance().rtol = 1.0  # type: ignore[misc]

    @pytest.mark.parametrize(
        ("fields", "message"),
        [
            ({"rtol": -1.0}, "Tolerance.rtol must be >= 0, got -1.0"),
            ({"atol": NAN}, "Tolerance.atol must be >= 0, got nan"),
            ({"ulps": -0.5}, "Tolerance.ulps must be >= 0, got -0.5"),
        ],
    )
    def test_negative_or_nan_tolerances_are_refused(
        self, fields: dict[str, float], message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            Tolerance(**fields)

    def test_override_replaces_the_default_for_that_dtype(self) -> None:
        actual, expected = torch.tensor([1.01]), torch.tensor([1.0])
        assert not compare(actual, expected).ok
        assert compare(actual, expected, tolerances={torch.float32: Tolerance(0.02, 0.0)}).ok
        # Another dtype's entry changes nothing here.
        assert not compare(actual, expected, tolerances={torch.float64: Tolerance(1.0, 1.0)}).ok

    def test_the_actual_dtype_chooses_the_tolerance(self) -> None:
        actual = torch.tensor([20.25], dtype=torch.bfloat16)
        reference = torch.tensor([20.0], dtype=torch.float64)
        # bfloat16 allows 1e-5 + 1.6e-2 * 20 = 0.32; float64's table would fail it.
        assert compare(actual, reference, check_dtype=False).ok
        tight = {torch.bfloat16: Tolerance(rtol=0.0, atol=0.1)}
        assert not compare(actual, reference, check_dtype=False, tolerances=tight).ok

    def test_rule_is_atol_plus_rtol_times_expected(self) -> None:
        tol = {torch.float64: Tolerance(rtol=0.5, atol=0.25)}
        expected = torch.tensor([2.0], dtype=torch.float64)
        assert compare(torch.tensor([3.25], dtype=torch.float64), expected, tolerances=tol).ok
        assert not compare(torch.tensor([3.26], dtype=torch.float64), expected, tolerances=tol).ok
        # Relative to the expected value, not the actual one.
        assert not compare(torch.tensor([0.74], dtype=torch.float64), expected, tolerances=tol).ok


class TestUlps:
    def test_one_ulp_in_bfloat16(self) -> None:
        # bfloat16 has 7 mantissa bits: at 20 (binade [16, 32)) the spacing is 2**(4-7) = 0.125.
        expected = torch.tensor([20.0], dtype=torch.bfloat16)
        one_off = torch.tensor([20.125], dtype=torch.bfloat16)
        two_off = torch.tensor([20.25], dtype=torch.bfloat16)
        exact = {torch.bfloat16: Tolerance(rtol=0.0, atol=0.0)}
        one_ulp = {torch.bfloat16: Tolerance(rtol=0.0, atol=0.0, ulps=1)}
        # bfloat16's default (0.32 allowed at 20) accepts both: the ULP rule matters
        # when the tolerance is tight.
        assert compare(one_off, expected).ok
        assert compare(two_off, expected).ok
        assert not compare(one_off, expected, tolerances=exact).ok
        assert compare(one_off, expected, tolerances=one_ulp).ok
        assert not compare(two_off, expected, tolerances=one_ulp).ok

    def test_spacing_is_the_actual_dtype_s_against_a_float64_reference(self) -> None:
        reference = torch.tensor([20.0, 1000.0], dtype=torch.float64)
        actual = torch.tensor([20.125, 1004.0], dtype=torch.bfloat16)  # 1 ULP each
        one_ulp = {torch.bfloat16: Tolerance(rtol=0.0, atol=0.0, ulps=1)}
        assert compare(actual, reference, check_dtype=False, tolerances=one_ulp).ok

    def test_near_zero_the_spacing_is_the_smallest_subnormal(self) -> None:
        tiny = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps
        actual = torch.tensor([tiny, 2 * tiny, 0.0])
        expected = torch.tensor([0.0, 0.0, 0.0])
        one_ulp = {torch.float32: Tolerance(rtol=0.0, atol=0.0, ulps=1)}
        result = compare(actual, expected, tolerances=one_ulp)
        assert only(result).mismatched == 1
        assert "Greatest absolute difference: 2.803e-45 at index (1,)" in result.report()

    def test_python_floats_use_float64_spacing(self) -> None:
        one_ulp = {torch.float64: Tolerance(rtol=0.0, atol=0.0, ulps=1)}
        assert compare(math.nextafter(1.0, 2.0), 1.0, tolerances=one_ulp).ok
        assert not compare(1.0 + 4 * 2.0**-52, 1.0, tolerances=one_ulp).ok

    def test_ulps_lines_for_float32_when_ulps_are_allowed(self) -> None:
        actual, expected = torch.tensor([1.0 + 2**-21]), torch.tensor([1.0])
        result = compare(actual, expected, tolerances={torch.float32: Tolerance(0, 0, ulps=2)})
        assert result.report() == textwrap.dedent(
            """\
            out: values differ
              Mismatched elements: 1 / 1 (100.0%)
              Greatest absolute difference: 4.768e-07 at index (0,)
              Greatest relative difference: 4.768e-07 at index (0,)
              Expected values: up to 1 in magnitude; the greatest difference is 4.77e-07 of that
              Tolerance: ulps=2 in float32 (compare(tolerances=...)); atol and rtol not used
              Worst elements (index: actual vs expected, abs error):
                (0,): 1.0000005 vs 1.0, 4.768e-07
              Worst element is 4 ULP off in float32 (spacing 1.192e-07 at 1.0)"""
        )
        assert compare(actual, expected, tolerances={torch.float32: Tolerance(0, 0, ulps=4)}).ok


class TestTensorMessages:
    def test_values_block(self) -> None:
        expected = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        actual = expected.clone()
        actual[1, 2] = 6.5
        actual[0, 0] = 1.25
        mismatch = only(compare({"logits": actual}, {"logits": expected}))
        assert mismatch.message == textwrap.dedent(
            """\
            out['logits']: values differ
              Mismatched elements: 2 / 6 (33.3%)
              Greatest absolute difference: 0.5 at index (1, 2) (up to 1.78e-05 allowed there)
              Greatest relative difference: 0.25 at index (0, 0) (up to 1.3e-06 allowed)
              Expected values: up to 6 in magnitude; the greatest difference is 8.3%
              Tolerance: atol=1e-05, rtol=1.3e-06 (float32 defaults)
              Worst elements (index: actual vs expected, abs error):
                (1, 2): 6.5 vs 6.0, 0.5
                (0, 0): 1.25 vs 1.0, 0.25"""
        )
        assert (mismatch.path, mismatch.kind, mismatch.mismatched, mismatch.total) == (
            "out['logits']",
            "values",
            2,
            6,
        )
        assert (mismatch.max_abs, mismatch.max_rel) == (0.5, 0.25)

    def test_bfloat16_block_ends_with_the_ulp_line(self) -> None:
        expected = torch.full((2, 4), 20.0, dtype=torch.float64)
        actual = expected.to(torch.bfloat16)
        actual[1, 3] = 22.0
        mismatch = only(compare(actual, expected, check_dtype=False))
        assert mismatch.message == textwrap.dedent(
            """\
            out: values differ
              Mismatched elements: 1 / 8 (12.5%)
              Greatest absolute difference: 2 at index (1, 3) (up to 0.32 allowed there)
              Greatest relative difference: 0.1 at index (1, 3) (up to 0.016 allowed)
              Expected values: up to 20 in magnitude; the greatest difference is 10.0%
              Tolerance: atol=1e-05, rtol=0.016 (bfloat16 defaults)
              Worst elements (index: actual vs expected, abs error):
                (1, 3): 22.0 vs 20.0, 2
              Worst element is 16 ULP off in bfloat16 (spacing 0.125 at 20.0)"""
        )

    def test_float16_mismatch_has_a_ulp_line(self) -> None:
        actual = torch.tensor([1.0, 1.5], dtype=torch.float16)
        expected = torch.tensor([1.0, 1.0], dtype=torch.float16)
        report = compare(actual, expected).report()
        # float16: 10 mantissa bits, spacing 2**-10 in [1, 2).
        assert report.splitlines()[-1] == (
            "  Worst element is 512 ULP off in float16 (spacing 0.0009766 at 1.0)"
        )

    def test_no_ulp_figure_at_a_spacing_of_zero(self) -> None:
        """A gradient element that is 0.0 in float64 and rounding noise in bfloat16 was
        "5.732e+36 ULP off in bfloat16 (spacing 9.184e-41 at 0.0)": the spacing at zero is the
        smallest subnormal's, no rounding of the computation. The units are those of the
        output's scale, and the line says so."""
        expected = torch.tensor([0.0, 2.0, -3.0], dtype=torch.float64)
        actual = torch.tensor([5.264e-3, 2.0, -3.0]).to(torch.bfloat16)
        report = compare(actual, expected, check_dtype=False).report()
        assert "e+36" not in report and "9.184e-41" not in report
        assert report.splitlines()[-1] == (
            "  Worst element is at expected 0.0, below bfloat16's normal range; at the output's "
            "scale it is 0.3359 ULP off (spacing 0.01562 at |expected| 3, the greatest)")
        zeros = compare(actual[:1], expected[:1], check_dtype=False).report()
        assert zeros.splitlines()[-1] == (
            "  Worst element is at expected 0.0, below bfloat16's normal range: no ULP figure "
            "(the spacing there is no rounding of this computation)")

    def test_every_failure_shows_the_outputs_scale(self) -> None:
        """The issue's matmul message, "86.68 (up to 1e-05 allowed)", said nothing of an output
        of size 3e7: the bound at the worst element and the output's magnitude are shown."""
        expected = torch.tensor([3.2e7, -1.0e7, 5.0], dtype=torch.float64)
        actual = (expected + torch.tensor([86.68, 0.0, 0.0], dtype=torch.float64)).float()
        lines = compare(actual, expected, check_dtype=False).report().splitlines()
        assert lines[2] == ("  Greatest absolute difference: 86 at index (0,) (up to 41.6 "
                            "allowed there)")
        assert lines[4] == ("  Expected values: up to 3.2e+07 in magnitude; the greatest "
                            "difference is 2.69e-06 of that")

    def test_worst_elements_are_ranked_and_limited(self) -> None:
        expected = torch.zeros(10)
        actual = torch.tensor([0.0, 1.0, 0.0, 5.0, 2.0, 0.0, 4.0, 3.0, 0.0, 0.0])
        report = compare(actual, expected, worst=3).report()
        assert report.splitlines()[-3:] == [
            "    (3,): 5.0 vs 0.0, 5",
            "    (6,): 4.0 vs 0.0, 4",
            "    (7,): 3.0 vs 0.0, 3",
        ]
        terse = compare(actual, expected, worst=0).report()
        assert "Worst elements" not in terse
        assert "Greatest absolute difference: 5 at index (3,)" in terse

    def test_negative_worst_is_refused(self) -> None:
        with pytest.raises(ValueError, match="worst must be >= 0"):
            compare(1, 1, worst=-1)

    def test_zero_dim_tensor_reads_like_a_scalar(self) -> None:
        mismatch = only(compare(torch.tensor(1.5), torch.tensor(1.0)))
        assert mismatch.message == textwrap.dedent(
            """\
            out: values differ: actual 1.5 vs expected 1.0
              Absolute difference: 0.5 (up to 1.13e-05 allowed there)
              Relative difference: 0.5 (up to 1.3e-06 allowed)
              Tolerance: atol=1e-05, rtol=1.3e-06 (float32 defaults)"""
        )

    def test_values_print_in_their_own_dtype(self) -> None:
        # float32(0.1) prints as 0.1, not 0.10000000149011612.
        report = compare(torch.tensor([0.1]), torch.tensor([0.2])).report()
        assert "(0,): 0.1 vs 0.2, 0.1" in report

    def test_shape_differs(self) -> None:
        mismatch = only(compare([torch.zeros(2, 3)], [torch.zeros(3, 2)]))
        assert mismatch.message == "out[0]: shape differs: actual (2, 3) vs expected (3, 2)"
        assert (mismatch.path, mismatch.kind) == ("out[0]", "shape")

    def test_shape_is_checked_before_dtype(self) -> None:
        result = compare(torch.zeros(2), torch.zeros(3, dtype=torch.float64))
        assert only(result).kind == "shape"

    def test_dtype_differs(self) -> None:
        mismatch = only(compare(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)))
        assert (
            mismatch.message
            == "out: dtype differs: actual torch.bfloat16 vs expected torch.float32"
        )
        assert mismatch.kind == "dtype"

    def test_without_check_dtype_only_the_kind_must_match(self) -> None:
        assert compare(
            torch.ones(2, dtype=torch.bfloat16),
            torch.ones(2, dtype=torch.float64),
            check_dtype=False,
        ).ok
        assert compare(
            torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int64), check_dtype=False
        ).ok
        mismatch = only(compare(torch.ones(2, dtype=torch.int64), torch.ones(2), check_dtype=False))
        assert mismatch.message == (
            "out: dtype kind differs: "
            "actual torch.int64 (integer) vs expected torch.float32 (floating)"
        )
        mismatch = only(
            compare(torch.ones(2, dtype=torch.complex64), torch.ones(2), check_dtype=False)
        )
        assert mismatch.kind == "dtype"
        mismatch = only(
            compare(
                torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.uint8), check_dtype=False
            )
        )
        assert "(bool) vs expected torch.uint8 (integer)" in mismatch.message

    def test_meta_tensors_hold_no_values(self) -> None:
        mismatch = only(compare(torch.zeros(2, device="meta"), torch.zeros(2)))
        assert mismatch.kind == "device"
        assert mismatch.message == "out: actual is a meta tensor: it holds no values to compare"

    def test_tensors_with_autograd_history(self) -> None:
        weight = torch.ones(3, requires_grad=True)
        assert compare(weight * 2, torch.full((3,), 2.0)).ok
        assert not compare(weight * 3, torch.full((3,), 2.0)).ok

    def test_sparse_tensors_compare_densely(self) -> None:
        dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
        assert compare(dense.to_sparse(), dense.to_sparse()).ok
        other = dense.clone()
        other[0, 1] = 3.0
        assert only(compare(other.to_sparse(), dense.to_sparse())).mismatched == 1
        assert only(compare(dense.to_sparse(), dense)).kind == "type"

    def test_empty_tensors_are_equal(self) -> None:
        result = compare(torch.zeros(0, 3), torch.zeros(0, 3))
        assert result.ok
        assert result.max_abs is None


class TestSpecialValues:
    def test_nan_positions_must_match_and_nan_is_not_equal_to_nan_by_default(self) -> None:
        actual = torch.tensor([1.0, NAN, 3.0])
        same = actual.clone()  # bitwise equal: the fast path must still see the NaN
        result = compare(actual, same)
        assert only(result).mismatched == 1
        assert "Greatest absolute difference: nan at index (1,)" in result.report()
        assert compare(actual, same, equal_nan=True).ok

    def test_nan_against_a_number_fails_even_with_equal_nan(self) -> None:
        actual = torch.tensor([1.0, NAN])
        expected = torch.tensor([1.0, 2.0])
        assert only(compare(actual, expected, equal_nan=True)).mismatched == 1
        assert only(compare(expected, actual, equal_nan=True)).mismatched == 1

    def test_infinities(self) -> None:
        expected = torch.tensor([INF, -INF, INF, 1.0])
        assert compare(expected.clone(), expected).ok
        assert compare(expected.double(), expected.double()).ok
        flipped = torch.tensor([-INF, -INF, INF, 1.0])
        assert only(compare(flipped, expected)).mismatched == 1
        finite = torch.tensor([INF, -INF, 3e38, 1.0])
        # An infinite expected value would allow an infinite error: it must not.
        assert only(compare(finite, expected)).mismatched == 1
        assert only(compare(expected, finite)).mismatched == 1

    def test_signed_zeros_are_equal(self) -> None:
        assert compare(torch.tensor([-0.0, 0.0]), torch.tensor([0.0, -0.0])).ok

    def test_python_floats(self) -> None:
        assert not compare(NAN, NAN).ok
        assert compare(NAN, NAN, equal_nan=True).ok
        assert not compare(NAN, 1.0, equal_nan=True).ok
        assert compare(INF, INF).ok
        assert not compare(INF, -INF).ok
        assert not compare(1e308, INF).ok

    def test_summary_counts_matching_specials_as_zero_and_mismatching_as_inf(self) -> None:
        expected = torch.tensor([INF, NAN, 1.0])
        matching = compare(expected.clone(), expected, equal_nan=True)
        assert (matching.max_abs, matching.max_rel) == (0.0, 0.0)
        broken = compare(torch.tensor([1.0, NAN, 1.0]), expected, equal_nan=True)
        assert broken.max_abs == INF


class TestKinds:
    def test_complex_uses_the_magnitude_of_the_difference(self) -> None:
        expected = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
        # |(3e-6 + 4e-6j)| = 5e-6 < 1e-5 + 1.3e-6 * |e|
        assert compare(expected + (3e-6 + 4e-6j), expected).ok
        # |(3e-5 + 4e-5j)| = 5e-5: too far
        actual = expected.clone()
        actual[1] += 3e-5 + 4e-5j
        mismatch = only(compare(actual, expected))
        assert mismatch.max_abs == pytest.approx(5e-5, rel=1e-3)
        assert "    (1,): (2.00003-0.99996j) vs (2.0-1.0j), 5.00" in mismatch.message

    def test_python_complex(self) -> None:
        assert compare(1 + 1j, 1 + 1j).ok
        assert only(compare(1 + 2j, 1 + 1j)).message.startswith(
            "out: values differ: actual (1.0+2.0j) vs expected (1.0+1.0j)\n"
            "  Absolute difference: 1 (up to 2.414e-07 allowed there)"
        )

    def test_integers_are_exact(self) -> None:
        expected = torch.arange(8)
        actual = expected.clone()
        actual[4] = 7
        mismatch = only(compare(actual, expected))
        assert mismatch.message == textwrap.dedent(
            """\
            out: values differ
              Mismatched elements: 1 / 8 (12.5%)
              Greatest absolute difference: 3 at index (4,) (up to 0 allowed)
              Greatest relative difference: 0.75 at index (4,) (up to 0 allowed)
              Tolerance: none: int64 values must be equal
              Worst elements (index: actual vs expected, abs error):
                (4,): 7 vs 4, 3"""
        )
        # A tolerance table entry does not loosen integers.
        assert not compare(actual, expected, tolerances={torch.int64: Tolerance(1, 10)}).ok

    def test_large_integers_stay_exact(self) -> None:
        big = torch.tensor([2**62, 2**62 + 1])
        assert compare(big, big.clone()).ok
        assert not compare(big, torch.tensor([2**62, 2**62])).ok

    def test_bools_are_exact(self) -> None:
        mismatch = only(compare(torch.tensor([True, False]), torch.tensor([True, True])))
        assert mismatch.message == textwrap.dedent(
            """\
            out: values differ
              Mismatched elements: 1 / 2 (50.0%)
              Tolerance: none: bool values must be equal
              Worst elements (index: actual vs expected, abs error):
                (1,): False vs True, 1"""
        )

    def test_python_numbers(self) -> None:
        assert compare(3, 3).ok
        assert only(compare(3, 4)).message == "out: values differ: actual 3 vs expected 4"
        assert only(compare(True, False)).message == (
            "out: values differ: actual True vs expected False"
        )
        assert compare(1.0 + 1e-8, 1.0).ok
        mismatch = only(compare({"loss": 1.5}, {"loss": 1.0}))
        assert mismatch.message == textwrap.dedent(
            """\
            out['loss']: values differ: actual 1.5 vs expected 1.0
              Absolute difference: 0.5 (up to 2e-07 allowed there)
              Relative difference: 0.5 (up to 1e-07 allowed)
              Tolerance: atol=1e-07, rtol=1e-07 (float64 defaults)"""
        )

    def test_number_types_must_match(self) -> None:
        assert only(compare(1, 1.0)).message == "out: type differs: actual int vs expected float"
        assert only(compare(True, 1)).message == "out: type differs: actual bool vs expected int"
        assert only(compare(1.0, torch.tensor(1.0))).message == (
            "out: type differs: actual float vs expected Tensor"
        )

    def test_none_and_strings(self) -> None:
        assert compare(None, None).ok
        assert compare("mean", "mean").ok
        assert compare(b"\x00", b"\x00").ok
        assert only(compare(None, torch.zeros(1))).message == (
            "out: type differs: actual NoneType vs expected Tensor"
        )
        assert only(compare("sum", "mean")).message == (
            "out: values differ: actual 'sum' vs expected 'mean'"
        )
        assert only(compare("a", b"a")).kind == "type"

    def test_other_objects_compare_with_eq(self) -> None:
        assert compare(torch.float32, torch.float32).ok
        mismatch = only(compare(torch.float32, torch.float16))
        assert mismatch.message == (
            "out: values differ: actual torch.float32 vs expected torch.float16"
        )
        assert only(compare(torch.float32, "float32")).kind == "type"


class TestOutputsFromTheWild:
    """Outputs a hostile tester returned from a case: each is judged, none crashes."""

    def test_dataclasses_are_compared_field_by_field(self) -> None:
        @dataclasses.dataclass
        class Out:
            logits: torch.Tensor
            steps: int = 1

        x = torch.randn(5, generator=torch.Generator().manual_seed(2))
        # Their own == compared tensors exactly (a float32 output never equalled its
        # float64 reference) and broadcast shapes (ones(1) "equalled" ones(1, 1, 1)).
        assert compare(Out(x / 3), Out((x / 3).double()), check_dtype=False).ok
        shape = only(compare(Out(torch.ones(1)), Out(torch.ones(1, 1, 1))))
        assert (shape.path, shape.kind) == ("out.logits", "shape")
        steps = only(compare(Out(x, 2), Out(x, 3)))
        assert steps.path == "out.steps"
        values = only(compare(Out(torch.zeros(4)), Out(torch.ones(4))))
        assert values.mismatched == 4

    def test_objects_without_values_say_what_to_return(self) -> None:
        module = only(compare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
        assert "a module" in module.message and "state_dict()" in module.message

        def numbers() -> Iterator[int]:
            yield 1

        generator = only(compare(numbers(), numbers())).message
        assert "defines no ==, so only the same object is equal" in generator

        class Color(enum.Enum):
            RED = 1
            BLUE = 2

        assert compare(Color.RED, Color.RED).ok
        assert only(compare(Color.RED, Color.BLUE)).message == (
            "out: values differ: actual <Color.RED: 1> vs expected <Color.BLUE: 2>")

    def test_a_users_eq_or_repr_that_raises_is_a_failure_not_a_crash(self) -> None:
        class RaisingEq:
            def __eq__(self, other: object) -> bool:
                raise KeyError("no such field")

        class RaisingRepr:
            def __eq__(self, other: object) -> bool:
                return False

            def __repr__(self) -> str:
                raise ValueError("no repr")

        assert "KeyError: 'no such field'" in only(compare(RaisingEq(), RaisingEq())).message
        assert "whose repr raised ValueError" in only(
            compare(RaisingRepr(), RaisingRepr())).message

    def test_numbers_beyond_a_float(self) -> None:
        assert compare(10**400, 10**400).ok
        assert only(compare(10**400, 10**400 + 1)).max_abs == 1.0
        huge = complex(1.5e308, 1.5e308)
        assert compare(huge, huge).ok
        assert "beyond a float's range" in only(compare(huge, 0j)).message

    def test_a_report_of_many_paths_says_how_many(self) -> None:
        expected = {f"k{i}": i for i in range(40)}
        actual = {key: value + 1 for key, value in expected.items()}
        report = compare(actual, expected).report()
        assert report.splitlines()[0] == "40 paths of the output differ:"
        few = compare({"a": 1, "b": 2}, {"a": 0, "b": 0}).report()
        assert few.startswith("out['a']: values differ")

    @pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
    def test_a_sparse_output_too_large_to_make_dense(self) -> None:
        """A graph's adjacency matrix of 10**12 elements: made dense, it asked for 4 TB."""
        where = torch.tensor([[0, 999_999], [5, 3]])
        shape = (10**6, 10**6)
        stored = torch.sparse_coo_tensor(where, torch.tensor([1.0, 2.0]), shape,
                                         check_invariants=True)
        near = torch.sparse_coo_tensor(where, torch.tensor([1.0, 2.0]) * 1.0000001, shape,
                                       check_invariants=True)
        assert compare(stored, near).ok
        assert compare(stored.to_sparse_csr(), near.to_sparse_csr()).ok
        far = torch.sparse_coo_tensor(where, torch.tensor([1.0, 4.0]), shape,
                                      check_invariants=True)
        assert only(compare(stored, far)).path == "out.values()"
        moved = torch.sparse_coo_tensor(torch.tensor([[1], [1]]), torch.tensor([1.0]), shape,
                                        check_invariants=True)
        assert only(compare(stored, moved)).message.startswith("out: sparsity differs")

    def test_values_that_print_alike_are_shown_in_full(self) -> None:
        """bfloat16 1.1015625 reads back as "1.1", as float64 1.1 does: a message saying
        "1.1 vs 1.1" is no help; both are written in full then."""
        tight = {torch.bfloat16: Tolerance(rtol=1e-4, atol=0.0, source="case")}
        for actual, expected in ((torch.tensor([1.1015625], dtype=torch.bfloat16),
                                  torch.tensor([1.1], dtype=torch.float64)),
                                 (torch.tensor(1.1015625, dtype=torch.bfloat16),
                                  torch.tensor(1.1, dtype=torch.float64))):
            message = only(compare(actual, expected, check_dtype=False,
                                   tolerances=tight)).message
            assert re.search(r"1\.1015625 vs (expected )?1\.1\b", message), message
            assert not re.search(r"\b1\.1 vs (expected )?1\.1\b", message), message

    @pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
    def test_dtypes_torch_compares_poorly(self) -> None:
        half = torch.randn(8, dtype=torch.complex64).to(torch.complex32)
        assert compare(half, half.clone()).ok  # complex64 holds complex32 exactly
        assert only(compare(half, torch.zeros(8, dtype=torch.complex32))).mismatched == 8
        wide = torch.arange(5000)
        assert compare(wide.to(torch.uint32), wide, check_dtype=False).ok
        off = wide.clone()
        off[3] = 7
        assert only(compare(wide.to(torch.uint16), off, check_dtype=False)).mismatched == 1
        bits = torch.zeros(8, dtype=torch.int16).view(torch.bits16)
        refused = only(compare(bits, bits.clone()))
        assert refused.kind == "type"
        assert refused.message.startswith("out: cannot compare a bits16 tensor on cpu with")
        assert "uint64" in only(compare(wide.to(torch.uint64), wide, check_dtype=False)).message
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype
            for layout in (torch.strided, torch.jagged):  # jagged sizes are symbolic
                nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                    layout=layout)
                other = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)],
                                                   layout=layout)
                assert compare(nested, nested.clone()).ok, layout
                assert [m.path for m in compare(nested, other).mismatches] == ["out[1]"]
                assert only(compare(nested, torch.ones(2))).kind == "type"
        # In a dict too, next to tensors that compare fine.
        mixed = compare({"bits": bits, "ok": torch.ones(3)}, {"bits": bits, "ok": torch.ones(3)})
        assert [m.path for m in mixed.mismatches] == ["out['bits']"]


class TestStructure:
    def test_missing_and_extra_keys(self) -> None:
        mismatch = only(compare({"a": 1, "b": 2, "z": 0}, {"a": 1, "c": 3, "d": 4, "b": 2}))
        assert mismatch.message == "out: keys differ: missing 'c', 'd'; extra 'z'"
        assert (mismatch.path, mismatch.kind) == ("out", "structure")
        assert only(compare({}, {"x": 1})).message == "out: keys differ: missing 'x'"
        assert only(compare({1: 0}, {})).message == "out: keys differ: extra 1"

    def test_nothing_below_a_structural_mismatch_is_compared(self) -> None:
        result = compare({"a": 1, "extra": 2}, {"a": 5})
        assert only(result).kind == "structure"

    def test_mapping_types_are_interchangeable(self) -> None:
        assert compare(OrderedDict(a=torch.ones(1)), {"a": torch.ones(1)}).ok

    def test_length_differs(self) -> None:
        mismatch = only(compare({"h": [1, 2, 3]}, {"h": [1, 2]}))
        assert mismatch.message == "out['h']: length differs: actual 3 vs expected 2"
        assert mismatch.kind == "structure"

    def test_list_and_tuple_are_interchangeable(self) -> None:
        assert compare([1, 2], (1, 2)).ok

    def test_named_tuples_report_field_names(self) -> None:
        expected = Output(torch.zeros(2), 0.5)
        actual = Output(torch.tensor([0.0, 1.0]), 0.5)
        mismatch = only(compare(actual, expected))
        assert mismatch.path == "out.logits"
        assert mismatch.message.startswith("out.logits: values differ\n")

    def test_structseq_fields_name_the_paths(self) -> None:
        """torch.max(x, dim=0) returns a torch.return_types structseq, which has no _fields:
        its items were spelled out[0] and out[1]."""
        x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
        actual, expected = torch.max(x, dim=0), torch.max(x + torch.tensor([0.5, 0.0]), dim=0)
        mismatch = only(compare(actual, expected))
        assert mismatch.path == "out.values"
        assert mismatch.message.startswith("out.values: values differ\n")
        # A golden stores it as a plain tuple: still compared, by either side's names.
        assert only(compare(actual, tuple(expected))).path == "out.values"
        assert only(compare(tuple(actual), expected)).path == "out.values"
        assert compare(actual, tuple(actual)).ok
        # A structseq with an unnamed item keeps its indices.
        stat = os.stat(".")
        assert only(compare(stat, (*stat[:6], -1, *stat[7:]))).path == "out[6]"

    def test_named_tuple_type_must_match(self) -> None:
        mismatch = only(compare(Other(torch.zeros(2), 0.5), Output(torch.zeros(2), 0.5)))
        assert mismatch.message == "out: type differs: actual Other vs expected Output"
        assert only(compare((torch.zeros(2), 0.5), Output(torch.zeros(2), 0.5))).kind == "type"

    def test_container_against_a_leaf(self) -> None:
        mismatch = only(compare({"a": [1]}, {"a": {"b": 1}}))
        assert mismatch.message == "out['a']: type differs: actual list vs expected dict"

    def test_every_mismatch_is_collected_top_down(self) -> None:
        expected = {
            "logits": torch.zeros(2, 2),
            "aux": [torch.zeros(3), None, 1.0],
            "meta": {"step": 3, "tag": "x"},
            "extra": (1, 2),
        }
        actual = {
            "logits": torch.ones(2, 2),
            "aux": [torch.zeros(4), torch.zeros(1), 1.0],
            "meta": {"step": 4},
            "extra": (1, 2, 3),
        }
        result = compare(actual, expected, path="result")
        assert [(m.path, m.kind) for m in result.mismatches] == [
            ("result['logits']", "values"),
            ("result['aux'][0]", "shape"),
            ("result['aux'][1]", "type"),
            ("result['meta']", "structure"),
            ("result['extra']", "structure"),
        ]
        assert not result.ok
        report = result.report()
        assert report == "\n".join(m.message for m in result.mismatches)
        assert report.splitlines()[0] == "result['logits']: values differ"

    def test_equal_nested_outputs(self) -> None:
        value = {"x": (torch.arange(4.0), [1, 2.5, None, "s"]), "y": torch.ones(2, 2)}
        result = compare(
            value, {"x": (torch.arange(4.0), [1, 2.5, None, "s"]), "y": torch.ones(2, 2)}
        )
        assert result.ok
        assert result.report() == ""
        assert (result.max_abs, result.max_rel) == (0.0, 0.0)


class TestSummary:
    def test_greatest_differences_cover_passing_elements(self) -> None:
        expected = torch.tensor([1.0, 2.0, 0.0])
        actual = torch.tensor([1.0, 2.0 + 2e-6, 0.0])
        result = compare(actual, expected)
        assert result.ok
        assert result.max_abs == pytest.approx(2e-6, rel=0.1)
        assert result.max_rel == pytest.approx(1e-6, rel=0.1)

    def test_greatest_over_several_outputs(self) -> None:
        result = compare([torch.tensor([1.0]), 2.0], [torch.tensor([1.5]), 2.0])
        assert result.max_abs == 0.5
        assert result.max_rel == pytest.approx(1 / 3)

    def test_nothing_numeric(self) -> None:
        result = compare(None, None)
        assert (result.ok, result.max_abs, result.max_rel) == (True, None, None)

    def test_zero_expected_gives_infinite_relative_difference(self) -> None:
        result = compare(torch.tensor([1e-6, 0.0]), torch.tensor([0.0, 0.0]))
        assert result.ok
        assert result.max_rel == INF


class TestLayoutAndChunks:
    def test_non_contiguous_tensors(self) -> None:
        base = torch.arange(60.0).reshape(3, 4, 5)
        expected = base.clone()
        actual = base.clone()
        actual[2, 1, 4] += 1
        # Transposed, strided and expanded views compare by logical index.
        mismatch = only(compare(actual.transpose(0, 2), expected.transpose(0, 2).contiguous()))
        assert "at index (4, 1, 2)" in mismatch.message
        assert compare(base[:, ::2, 1:], expected[:, ::2, 1:].clone()).ok
        assert compare(torch.zeros(4, 3), torch.zeros(1, 3).expand(4, 3)).ok

    def test_non_contiguous_across_chunks(self, small_chunks: int) -> None:
        expected = torch.randn(7, 300, generator=torch.Generator().manual_seed(0))
        actual = expected.clone()
        actual[6, 299] += 1
        actual[3, 0] += 2
        # Each row (300) is larger than a chunk (64): rows are cut further.
        view_a, view_e = actual.t(), expected.t()
        mismatch = only(compare(view_a, view_e))
        assert mismatch.message == textwrap.dedent(
            """\
            out: values differ
              Mismatched elements: 2 / 2100 (0.1%)
              Greatest absolute difference: 2 at index (0, 3) (up to 1.273e-05 allowed there)
              Greatest relative difference: 1.95 at index (299, 6) (up to 1.3e-06 allowed)
              Expected values: up to 4.101 in magnitude; the greatest difference is 48.8%
              Tolerance: atol=1e-05, rtol=1.3e-06 (float32 defaults)
              Worst elements (index: actual vs expected, abs error):
                (0, 3): -0.10093808 vs -2.100938, 2
                (299, 6): 1.5129519 vs 0.51295185, 1"""
        )

    def test_non_contiguous_rows_larger_than_a_block(self, small_chunks: int) -> None:
        base = torch.arange(4 * 40 * 30, dtype=torch.float64).reshape(4, 40, 30)
        actual = base.clone()
        actual[3, 39, 29] = -1.0
        actual[0, 0, 1] = -2.0
        # Each leading row holds 1200 elements (> a 256-element block): cut deeper.
        view_a, view_e = actual.transpose(1, 2), base.transpose(1, 2)
        mismatch = only(compare(view_a, view_e))
        assert mismatch.mismatched == 2
        assert mismatch.message.splitlines()[-2:] == [
            "    (3, 29, 39): -1.0 vs 4799.0, 4800",
            "    (0, 1, 0): -2.0 vs 1.0, 3",
        ]

    def test_single_mismatch_in_the_last_chunk(self, small_chunks: int) -> None:
        n = small_chunks * 20 + 7  # 21 chunks, the last one short
        expected = torch.linspace(-1, 1, n)
        actual = expected.clone()
        actual[n - 1] = 5.0
        mismatch = only(compare(actual, expected))
        assert (mismatch.mismatched, mismatch.total) == (1, n)
        assert f"at index ({n - 1},)" in mismatch.message
        # Exactly on a chunk boundary, and the first element of a chunk.
        for index in (small_chunks - 1, small_chunks, 4 * small_chunks):
            actual = expected.clone()
            actual[index] += 1
            assert f"at index ({index},)" in only(compare(actual, expected)).message

    def test_counts_and_worst_elements_merge_across_chunks(self, small_chunks: int) -> None:
        expected = torch.zeros(1000)
        actual = torch.linspace(0.001, 1.0, 1000)  # every element mismatches
        mismatch = only(compare(actual, expected, worst=3))
        assert (mismatch.mismatched, mismatch.total) == (1000, 1000)
        lines = mismatch.message.splitlines()
        assert lines[-3:] == [
            "    (999,): 1.0 vs 0.0, 1",
            "    (998,): 0.999 vs 0.0, 0.999",
            "    (997,): 0.998 vs 0.0, 0.998",
        ]

    def test_close_but_not_equal_data_passes_in_every_chunk(self, small_chunks: int) -> None:
        gen = torch.Generator().manual_seed(1)
        expected = torch.randn(5000, generator=gen)
        actual = expected * (1 + 1e-6 * torch.rand(5000, generator=gen)) + 5e-6
        result = compare(actual, expected)
        assert result.ok
        torch.testing.assert_close(actual, expected)

    def test_nan_in_a_later_chunk_of_bitwise_equal_data(self, small_chunks: int) -> None:
        expected = torch.zeros(1000)
        expected[900] = NAN
        assert only(compare(expected.clone(), expected)).mismatched == 1
        assert compare(expected.clone(), expected, equal_nan=True).ok

    def test_mixed_dtypes_across_chunks(self, small_chunks: int) -> None:
        reference = torch.linspace(-4, 4, 1000, dtype=torch.float64)
        actual = reference.to(torch.bfloat16)
        assert compare(actual, reference, check_dtype=False).ok
        actual[777] = 100.0
        mismatch = only(compare(actual, reference, check_dtype=False))
        assert "at index (777,)" in mismatch.message
        assert mismatch.message.splitlines()[-1].startswith("  Worst element is ")

    def test_verdicts_agree_with_torch_isclose(self, small_chunks: int) -> None:
        gen = torch.Generator().manual_seed(2)
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            tol = DEFAULT_TOLERANCES[dtype]
            expected = torch.randn(2000, generator=gen).to(dtype)
            # Errors straddling the boundary atol + rtol * |e|.
            scale = torch.rand(2000, generator=gen, dtype=torch.float64) * 2
            bound = tol.atol + tol.rtol * expected.double().abs()
            actual = (expected.double() + scale * bound).to(dtype)
            # torch.isclose computes in the inputs' dtype; compare() in at least
            # float32, so half precision is checked against float32 inputs.
            wide = torch.float32 if dtype.itemsize < 4 else dtype
            close = torch.isclose(actual.to(wide), expected.to(wide), rtol=tol.rtol, atol=tol.atol)
            assert 0 < int((~close).sum()) < 2000
            assert only(compare(actual, expected)).mismatched == int((~close).sum()), dtype


def _assert_close_passes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        torch.testing.assert_close(actual, expected, check_dtype=False)
    except AssertionError:
        return False
    return True


def _layouts(
    actual: torch.Tensor, expected: torch.Tensor
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The same 48 values as six layouts: flat, 2-D, transposed, strided, 0-dim, expanded."""
    grid_a, grid_e = actual.reshape(6, 8), expected.reshape(6, 8)
    return [
        ("flat", actual, expected),
        ("2-D", grid_a, grid_e),
        ("transposed", grid_a.t(), grid_e.t()),
        ("strided", grid_a[::2, 1::3], grid_e[::2, 1::3]),
        ("0-dim", actual[5], expected[5]),
        ("expanded", actual[:8].expand(3, 8), expected[:8].expand(3, 8)),
    ]


def _pair(dtype: torch.dtype, reference: bool, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """48 values whose errors straddle the tolerance bound, with a few specials."""
    base = torch.randn(48, generator=gen, dtype=torch.float64) * 10 ** torch.randint(
        -3, 3, (48,), generator=gen
    )
    if dtype in (torch.int64, torch.bool):
        expected = (base > 0) if dtype == torch.bool else base.round().to(dtype)
        actual = expected.clone()
        flip = torch.rand(48, generator=gen) < 0.1
        actual[flip] = ~actual[flip] if dtype == torch.bool else actual[flip] + 1
        return actual, expected
    tol = DEFAULT_TOLERANCES[dtype]
    expected64 = base.to(dtype).double() if not reference else base
    bound = tol.atol + tol.rtol * expected64.abs()
    # Errors from 0 to 2x the bound: about a quarter of them past it.
    scale = torch.rand(48, generator=gen, dtype=torch.float64) * 2
    sign = torch.randint(0, 2, (48,), generator=gen) * 2 - 1
    actual = (expected64 + sign * scale * bound * 0.6).to(dtype)
    expected = expected64 if reference else expected64.to(dtype)
    special = torch.rand(48, generator=gen)
    actual[special < 0.02] = math.nan
    expected[(special < 0.01) | (special > 0.99)] = math.nan
    actual[(special > 0.97) & (special < 0.98)] = math.inf
    expected[(special > 0.975) & (special < 0.98)] = math.inf
    return actual, expected


def _documented(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ours and assert_close's verdicts differ as compare.py documents.

    Same-dtype bfloat16 or float16: assert_close computes in that dtype, we
    in float32. Then ours must be torch.isclose in float32 and theirs in the
    dtype.
    """
    if actual.dtype != expected.dtype or actual.dtype not in (torch.bfloat16, torch.float16):
        return False
    tol = DEFAULT_TOLERANCES[actual.dtype]
    wide = torch.isclose(actual.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)
    narrow = torch.isclose(actual, expected, rtol=tol.rtol, atol=tol.atol)
    return bool(wide.all()) != bool(narrow.all())


class TestVerdictParity:
    PATHS = (
        (torch.float32, False),
        (torch.float64, False),
        (torch.bfloat16, False),
        (torch.float16, False),
        (torch.int64, False),
        (torch.bool, False),
        (torch.bfloat16, True),  # the plugin's path: low precision vs a float64 reference
        (torch.float16, True),
        (torch.float32, True),
    )

    def test_verdicts_equal_assert_close_s_except_where_documented(self) -> None:
        gen = torch.Generator().manual_seed(11)
        pairs = documented = failing = 0
        for dtype, reference in self.PATHS:
            for _ in range(8):
                actual, expected = _pair(dtype, reference, gen)
                for layout, a, e in _layouts(actual, expected):
                    ours = compare(a, e, check_dtype=False).ok
                    theirs = _assert_close_passes(a, e)
                    pairs += 1
                    failing += not theirs
                    if ours != theirs:
                        assert _documented(a, e), (dtype, reference, layout, a, e)
                        documented += 1
        assert pairs == 432
        # Both verdicts occur: the pairs straddle the bound.
        assert 0 < failing < pairs
        # The documented difference is rare: rounding of the bound only.
        assert documented < pairs // 20

    @pytest.mark.parametrize(
        ("actual", "expected", "bound"),
        [(1e-5, 0.0, 1e-5), (0.24707, 0.24316, 0.0039006)],
    )
    def test_same_dtype_bfloat16_is_judged_exactly(
        self, actual: float, expected: float, bound: float
    ) -> None:
        a = torch.tensor([actual], dtype=torch.bfloat16)
        e = torch.tensor([expected], dtype=torch.bfloat16)
        exact_diff = abs(a.double() - e.double()).item()
        assert exact_diff > bound  # past the stated tolerance ...
        assert _assert_close_passes(a, e)  # ... which bfloat16 arithmetic rounds away
        mismatch = only(compare(a, e))
        assert mismatch.mismatched == 1
        # The same bfloat16 values against a float64 reference: the same verdict,
        # here and in assert_close (which computes in float64 then).
        assert not compare(a, e.double(), check_dtype=False).ok
        assert not _assert_close_passes(a, e.double())


class TestToleranceMessages:
    def test_the_source_of_a_given_tolerance_is_named(self) -> None:
        tol = Tolerance(rtol=0.0, atol=0.01, source="case.toml [expect.tolerance.bfloat16]")
        actual = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        report = compare(
            actual, torch.ones(2, dtype=torch.bfloat16), tolerances={torch.bfloat16: tol}
        ).report()
        assert "  Tolerance: atol=0.01, rtol=0 (case.toml [expect.tolerance.bfloat16])" in report

    def test_ulps_alone_is_the_only_test_and_says_so(self) -> None:
        tol = Tolerance(ulps=2, source="case.toml [expect.tolerance.bfloat16]")
        expected = torch.tensor([20.0, 20.0], dtype=torch.bfloat16)
        two_off = torch.tensor([20.25, 20.0], dtype=torch.bfloat16)  # spacing 0.125
        assert compare(two_off, expected, tolerances={torch.bfloat16: tol}).ok
        three_off = torch.tensor([20.375, 20.0], dtype=torch.bfloat16)
        report = compare(three_off, expected, tolerances={torch.bfloat16: tol}).report()
        assert (
            "  Tolerance: ulps=2 in bfloat16 (case.toml [expect.tolerance.bfloat16]); "
            "atol and rtol not used" in report
        )
        # No "allowed" figures for bounds that are not used.
        assert "allowed" not in report
        assert "Worst element is 3 ULP off in bfloat16" in report

    def test_ulps_beside_atol_and_rtol_is_a_second_way_to_pass(self) -> None:
        tol = Tolerance(rtol=0.0, atol=1e-3, ulps=1)
        expected = torch.tensor([20.0, 0.0], dtype=torch.bfloat16)
        actual = torch.tensor([20.125, 5e-4], dtype=torch.bfloat16)  # 1 ULP; within atol
        assert compare(actual, expected, tolerances={torch.bfloat16: tol}).ok
        actual = torch.tensor([20.25, 5e-4], dtype=torch.bfloat16)
        report = compare(actual, expected, tolerances={torch.bfloat16: tol}).report()
        assert (
            "  Tolerance: atol=0.001, rtol=0 (compare(tolerances=...)), "
            "or within ulps=1 in bfloat16" in report
        )

    def test_integers_name_no_tolerance(self) -> None:
        report = compare(torch.tensor([1, 2]), torch.tensor([1, 3])).report()
        assert "  Tolerance: none: int64 values must be equal" in report


class TestNonFiniteMessages:
    def test_nan_where_the_float64_reference_is_nan_too(self) -> None:
        reference = torch.tensor([1.0, math.nan, math.nan, 4.0, 5.0], dtype=torch.float64)
        actual = torch.tensor([1.0, math.nan, math.nan, math.nan, 5.0])
        result = compare(actual, reference, check_dtype=False)
        report = result.report()
        assert (
            "  actual is NaN at 3 mismatched positions; expected (float64) is NaN at 2 of "
            "these positions too: the input itself is degenerate"
        ) in report
        assert (
            "  equal_nan = true would accept the 2 where both are NaN (1 mismatch would "
            "remain)" in report
        )
        assert "Greatest absolute difference: nan at index (1,)" in report
        # The summary the JSON report is written from says nan too, not inf.
        assert math.isnan(result.max_abs)  # type: ignore[arg-type]
        assert math.isnan(result.max_rel)  # type: ignore[arg-type]
        assert math.isnan(only(result).max_abs)  # type: ignore[arg-type]
        with_equal_nan = compare(actual, reference, check_dtype=False, equal_nan=True)
        assert only(with_equal_nan).mismatched == 1

    def test_nan_everywhere_the_reference_is_nan(self) -> None:
        reference = torch.tensor([math.nan, 2.0], dtype=torch.float64)
        report = compare(torch.tensor([math.nan, 2.0]), reference, check_dtype=False).report()
        assert (
            "expected (float64) is NaN at all of these positions too: the input itself "
            "is degenerate" in report
        )
        assert "(0 mismatches would remain)" in report

    def test_nan_made_by_this_run(self) -> None:
        report = compare(torch.tensor([math.nan, 2.0]), torch.tensor([1.0, 2.0])).report()
        assert (
            "  actual is NaN at 1 mismatched position; expected (float32) is a number at "
            "all of them" in report
        )
        assert "  equal_nan = true would not change this: it accepts NaN against NaN only" in report

    def test_nan_in_the_reference_only(self) -> None:
        reference = torch.tensor([math.nan, 2.0], dtype=torch.float64)
        report = compare(torch.tensor([1.0, 2.0]), reference, check_dtype=False).report()
        assert (
            "  expected (float64) is NaN at 1 mismatched position where actual is not: "
            "the reference itself is degenerate there" in report
        )
        assert "actual is NaN" not in report

    def test_infinities(self) -> None:
        actual = torch.tensor([math.inf, -math.inf, 1.0])
        expected = torch.tensor([1.0, math.inf, 1.0])
        result = compare(actual, expected)
        assert (
            "  actual is infinite at 2 mismatched positions; expected (float32) is "
            "infinite or NaN at 1 of these too" in result.report()
        )
        assert result.max_abs == math.inf
        assert "Greatest absolute difference: inf" in result.report()

    def test_python_float_nan_summary_is_nan(self) -> None:
        result = compare(math.nan, 1.0)
        assert math.isnan(result.max_abs)  # type: ignore[arg-type]
        assert "  Absolute difference: nan" in result.report()
        assert "  actual is NaN at 1 mismatched position" in result.report()

    def test_nan_wins_the_summary_in_any_order(self) -> None:
        nan_part = compare(torch.tensor([math.nan]), torch.tensor([1.0]))
        big_part = compare(torch.tensor([100.0]), torch.tensor([1.0]))
        for parts in ([nan_part, big_part], [big_part, nan_part]):
            merged = combine(parts)
            assert math.isnan(merged.max_abs)  # type: ignore[arg-type]
            assert len(merged.mismatches) == 2
        both = compare([torch.tensor([100.0]), math.nan], [torch.tensor([1.0]), 1.0])
        assert math.isnan(both.max_abs)  # type: ignore[arg-type]
        assert combine([]).max_abs is None


class TestFastPaths:
    def test_many_small_tensors_keep_their_paths_and_order(self) -> None:
        expected = {f"t{i}": torch.full((10,), float(i)) for i in range(300)}
        actual = {k: v.clone() for k, v in expected.items()}
        actual["t7"][3] += 1
        actual["t250"] = torch.zeros(11)  # a shape mismatch between value mismatches
        actual["t299"][9] = math.nan
        result = compare(actual, expected)
        assert [(m.path, m.kind) for m in result.mismatches] == [
            ("out['t7']", "values"),
            ("out['t250']", "shape"),
            ("out['t299']", "values"),
        ]
        assert "at index (3,)" in result.mismatches[0].message
        assert result.mismatches[0].mismatched == 1
        assert math.isnan(result.max_abs)  # type: ignore[arg-type]
        # Batched leaves of one dtype next to another dtype's.
        mixed = {"a": torch.ones(4), "b": torch.ones(4, dtype=torch.float64), "c": torch.ones(4)}
        assert compare(mixed, {k: v.clone() for k, v in mixed.items()}).ok

    def test_threads_are_restored(self, small_chunks: int) -> None:
        saved = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            expected = torch.randn(500 * small_chunks, generator=torch.Generator().manual_seed(3))
            actual = expected * (1 + 1e-7)
            actual[-1] += 1
            assert only(compare(actual, expected)).mismatched == 1
            assert torch.get_num_threads() == 2
            # Threads started later begin with the caller's setting too.
            seen = []
            thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            assert seen == [2]
        finally:
            torch.set_num_threads(saved)

    def test_all_mismatched_bools_list_the_first_by_index(self, small_chunks: int) -> None:
        expected = torch.zeros(1000, dtype=torch.bool)
        mismatch = only(compare(~expected, expected, worst=3))
        assert mismatch.mismatched == 1000
        assert mismatch.message.splitlines()[-3:] == [
            "    (0,): True vs False, 1",
            "    (1,): True vs False, 1",
            "    (2,): True vs False, 1",
        ]

    def test_large_integers_mismatch_where_float64_sees_no_difference(
        self, small_chunks: int
    ) -> None:
        expected = torch.full((500,), 2**62)
        actual = expected.clone()
        actual[321] += 1
        mismatch = only(compare(actual, expected))
        assert mismatch.mismatched == 1
        assert "(321,): 4611686018427387905 vs 4611686018427387904, 1" in mismatch.message

    def test_worst_elements_across_chunks_and_threads(self, small_chunks: int) -> None:
        gen = torch.Generator().manual_seed(5)
        expected = torch.randn(64 * small_chunks, generator=gen)
        actual = expected + torch.rand(expected.shape, generator=gen) + 1  # all mismatched
        mismatch = only(compare(actual, expected, worst=4))
        diff = (actual - expected).abs()
        top = diff.topk(4).indices.tolist()
        assert mismatch.mismatched == expected.numel()
        assert [line.split(":")[0].strip() for line in mismatch.message.splitlines()[-4:]] == [
            f"({i},)" for i in top
        ]


def _full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn off the single-pair fast paths: every pair goes through the walk."""
    monkeypatch.setattr(_kernel, "small_close", lambda *args: None)


def _fast_path_pairs() -> list[tuple[str, object, object, dict[torch.dtype, Tolerance] | None]]:
    """Small single pairs over every rule the fast path must not change."""
    gen = torch.Generator().manual_seed(17)
    pairs: list[tuple[str, object, object, dict[torch.dtype, Tolerance] | None]] = []
    for dtype, reference in TestVerdictParity.PATHS:
        for k in range(4):
            actual, expected = _pair(dtype, reference, gen)
            if k % 2 and dtype.is_floating_point:
                # The same values without specials: mostly close, some within a rounding.
                finite = torch.isfinite(actual) & torch.isfinite(expected)
                actual, expected = actual[finite], expected[finite]
            for layout, a, e in _layouts(actual, expected) if actual.numel() == 48 else []:
                pairs.append((f"{dtype} ref={reference} {layout} {k}", a, e, None))
            pairs.append((f"{dtype} ref={reference} flat {k}", actual, expected, None))
    e32 = torch.randn(100, generator=gen)
    big = torch.randn(20_000, generator=gen)
    wide = torch.randn(300, 200, generator=gen)
    wide_off = wide.clone()
    wide_off[299, 199] += 1
    close = e32 + 1e-6 * torch.rand(100, generator=gen)
    pairs += [
        ("close", close, e32, None),
        ("close 2-D", close.reshape(10, 10), e32.reshape(10, 10), None),
        ("close transposed", close.reshape(10, 10).t(), e32.reshape(10, 10).t(), None),
        ("close 0-dim", close[3], e32[3], None),
        ("close float64 ref", close, e32.double() + 1e-7, None),
        ("close bfloat16 ref", e32.bfloat16(), e32.double(), None),
        ("close float16 ref", e32.half(), e32.double(), None),
        ("zero-size", torch.zeros(0, 3), torch.zeros(0, 3), None),
        # One chunk but past the batching size, and past torch's grain size.
        ("close 20,000", big + 1e-6, big, None),
        ("close 60,000 transposed", wide.t() * (1 + 1e-7), wide.t(), None),
        ("one off in 60,000", wide_off, wide, None),
        ("equal 60,000", wide.clone(), wide, None),
        (
            "-0.0 and 0.0 beside a difference",
            torch.tensor([-0.0, 1.0]),
            torch.tensor([0.0, 1.0 + 1e-6]),
            None,
        ),
        (
            "zeros on both sides, 0/0",
            torch.tensor([0.0, 2.0]),
            torch.tensor([0.0, 2.0 + 2e-6]),
            None,
        ),
        (
            "a difference at a zero expected",
            torch.tensor([1e-6, 1.0]),
            torch.tensor([0.0, 1.0]),
            None,
        ),
        ("NaN against NaN", torch.tensor([NAN, 1.0]), torch.tensor([NAN, 1.0 + 1e-6]), None),
        ("inf against inf", torch.tensor([INF, 1.0]), torch.tensor([INF, 1.0 + 1e-6]), None),
        ("inf against a number", torch.tensor([INF, 1.0]), torch.tensor([3.0, 1.0]), None),
        ("requires grad", close.clone().requires_grad_(), e32, None),
        ("integers", torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), None),
        ("bools", torch.tensor([True, False]), torch.tensor([True, True]), None),
        ("dtype differs", close, e32.double(), None),
    ]
    ulps = {
        torch.float32: Tolerance(ulps=2, source="ulps only"),
        torch.bfloat16: Tolerance(ulps=1, source="ulps only"),
    }
    one_ulp = torch.tensor([1.0 + 2**-23, 20.0])
    pairs += [
        ("ulps only, 1 ulp", one_ulp, torch.tensor([1.0, 20.0]), ulps),
        ("ulps only, 3 ulps", torch.tensor([1.0 + 3 * 2**-23]), torch.tensor([1.0]), ulps),
        (
            "ulps only, bfloat16",
            torch.tensor([20.125], dtype=torch.bfloat16),
            torch.tensor([20.0], dtype=torch.bfloat16),
            ulps,
        ),
        (
            "ulps beside atol",
            one_ulp,
            torch.tensor([1.0, 20.0 + 2e-6]),
            {torch.float32: Tolerance(rtol=0.0, atol=1e-7, ulps=1)},
        ),
    ]
    return pairs


class TestSinglePairFastPath:
    """compare() of one small pair takes shortcuts; they must say what the walk says."""

    def test_results_equal_the_full_path_s(self, monkeypatch: pytest.MonkeyPatch) -> None:
        taken = []
        small_close = _kernel.small_close

        def spy(*args: object) -> tuple[float, float] | None:
            result = small_close(*args)  # type: ignore[arg-type]
            taken.append(result is not None)
            return result

        monkeypatch.setattr(_kernel, "small_close", spy)
        pairs = _fast_path_pairs()
        fast = {}
        for name, a, e, tol in pairs:
            fast[name] = compare(a, e, check_dtype=name != "dtype differs", tolerances=tol)
        # repr: NaN equals NaN there, and every field and message is compared.
        with monkeypatch.context() as full:
            _full_path(full)
            for name, a, e, tol in pairs:
                slow = compare(a, e, check_dtype=name != "dtype differs", tolerances=tol)
                assert repr(fast[name]) == repr(slow), name
        # Both outcomes of the shortcut occur: it clears pairs and hands others on.
        assert 10 < sum(taken) < len(taken) - 10

    def test_verdicts_on_both_paths_equal_assert_close_s(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name, a, e, tol in _fast_path_pairs():
            if tol is not None or name == "dtype differs":
                continue
            assert isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)
            ours = compare(a, e, check_dtype=False).ok
            if ours != _assert_close_passes(a.detach(), e):
                assert _documented(a, e), name

    def test_a_close_pair_is_cleared_without_the_walk(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def no_walk(*args: object, **kwargs: object) -> None:
            raise AssertionError("the walk was used")

        monkeypatch.setattr(compare_module, "_Walk", no_walk)
        expected = torch.randn(100, generator=torch.Generator().manual_seed(3))
        result = compare(expected + 1e-6, expected)
        assert result.ok
        assert result.max_abs == float((expected + 1e-6 - expected).abs().max())
        assert compare((expected + 1e-6).bfloat16(), expected.double(), check_dtype=False).ok


    def test_memory_formats_and_permuted_views(self) -> None:
        """The shortcut's rows of a channels_last or permuted pair cannot be viewed flat
        (a RuntimeError from inside the comparison, for every convolution output)."""
        gen = torch.Generator().manual_seed(4)
        for t in (torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
                  torch.randn(1, 2, 3, 4, 5, generator=gen).to(
                      memory_format=torch.channels_last_3d),
                  torch.randn(2, 4, 5, 3, generator=gen).permute(0, 3, 1, 2)):
            assert compare(t, t.double() * 1.0000001, check_dtype=False).ok
            off = t.double().contiguous()
            off.view(-1)[7] += 1.0
            assert only(compare(t, off, check_dtype=False)).mismatched == 1


class TestEqualityTest:
    """compare()'s first test on the CPU: memcmp and a sum; True must mean equal values, no NaN."""

    @pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "torch.equal"])
    def test_equal_bytes_and_equal_values(
        self, memcmp: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        if not memcmp:
            monkeypatch.setattr(_kernel, "_MEMCMP", None)
        elif _kernel._MEMCMP is None:
            pytest.skip("no C library memcmp to load here")
        gen = torch.Generator().manual_seed(23)
        n = 100_000  # past the 4 KiB where memcmp starts, in one chunk and in several
        for size in (n, 3 * _kernel.CHUNK_ELEMENTS + 5):
            base = torch.randn(size, generator=gen)
            assert compare(base.clone(), base).ok
            with_nan = base.clone()
            with_nan[size - 2] = NAN  # equal bytes, unequal values
            assert only(compare(with_nan.clone(), with_nan)).mismatched == 1
            assert compare(with_nan.clone(), with_nan, equal_nan=True).ok
            with_inf = base.clone()
            with_inf[7], with_inf[8] = INF, -INF  # a sum of NaN, equal values
            result = compare(with_inf.clone(), with_inf)
            assert result.ok and result.max_abs == 0.0
            signed = base.clone()
            signed[size // 2] = 0.0
            negative = signed.clone()
            negative[size // 2] = -0.0  # unequal bytes, equal values
            result = compare(negative, signed)
            assert result.ok and (result.max_abs, result.max_rel) == (0.0, 0.0)
            big = torch.full((size,), 3e38)  # a float32 sum overflows: decided exactly
            assert compare(big.clone(), big).ok
            for dtype in (torch.float16, torch.bfloat16, torch.float64):
                low = with_nan.to(dtype)
                assert only(compare(low.clone(), low)).mismatched == 1, dtype
                assert compare(base.to(dtype), base.to(dtype)).ok, dtype
            ones = torch.ones(size, dtype=torch.float16)  # a float16 sum overflows
            assert compare(ones.clone(), ones).ok
            ints = torch.randint(-(2**62), 2**62, (size,), generator=gen)
            assert compare(ints.clone(), ints).ok
            off = ints.clone()
            off[size - 1] += 1
            assert only(compare(off, ints)).mismatched == 1
            flags = ints > 0
            assert compare(flags.clone(), flags).ok
            assert only(compare(~flags, flags)).mismatched == size
            # Views: an offset into the storage, and a non-contiguous one.
            assert compare(base[1:].clone(), base[1:]).ok
            assert not compare(base[1:], base[:-1]).ok
            strided = base.reshape(-1, 5)[:, ::2] if size % 5 == 0 else base[::2]
            assert compare(strided.clone(), strided).ok

    def test_only_bytes_that_are_the_values_are_compared_as_bytes(self) -> None:
        """A negative view's bytes are its negation; a subclass may wrap other storage;
        a parameter's reduction must build no graph (a warning under -W error)."""
        base = torch.randn(50_000, generator=torch.Generator().manual_seed(5))
        negated = torch._neg_view(base)
        assert negated.is_neg()
        assert compare(negated, -base).ok
        assert not compare(negated, base.clone()).ok

        class Wrapped(torch.Tensor):
            pass

        assert compare(base.as_subclass(Wrapped), base.clone()).ok
        weight = torch.nn.Parameter(base.clone())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert compare(weight, base).ok
            assert compare(base.clone(), weight).ok

    @pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
    def test_tensors_without_plain_memory_are_never_read_as_bytes(self) -> None:
        """Each of these crashed the process (a null or short buffer) or passed unequal
        values when memcmp read them: they take torch's own comparison instead."""
        zeros = torch.zeros(8192)
        assert compare(torch._efficientzerotensor(8192), zeros).ok  # no storage at all
        functional = torch._to_functional_tensor(zeros.clone())  # a null data pointer
        assert compare(functional, torch._to_functional_tensor(zeros.clone())).ok
        results: list[bool] = []

        def inside_grad(x: torch.Tensor) -> torch.Tensor:  # a functorch wrapper
            results.append(compare(x, zeros).ok)
            return x.sum()

        torch.func.grad(inside_grad)(zeros.clone())
        assert results == [True]
        packed = torch.quantize_per_tensor(torch.rand(1 << 16), 1 / 15, 0, torch.quint4x2)
        assert compare(packed, packed).ok  # element_size says twice its storage

    @pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
    def test_quantized_tensors_are_compared_by_their_values(self) -> None:
        x = torch.randn(8192, generator=torch.Generator().manual_seed(9))
        codes = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
        assert compare(codes, torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)).ok
        doubled = torch.quantize_per_tensor(2 * x, 0.2, 0, torch.qint8)  # the same codes
        assert torch.equal(codes.int_repr(), doubled.int_repr())
        result = compare(codes, doubled)
        assert not result.ok and result.max_rel == pytest.approx(0.5)
        assert compare(codes, codes.dequantize(), check_dtype=False).ok
        assert only(compare(codes, codes.dequantize())).kind == "dtype"


def _cuda_available() -> bool:
    # The NVML-based check does not initialize CUDA here: this process forks
    # children in other tests, and a CUDA-initialized parent poisons them.
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if saved is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


_ON_DEVICE = textwrap.dedent(
    """
    import json, resource
    import torch
    from pytest_gpucase.verdict.compare import compare

    def host_peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    n = (1 << 30) // 4  # 1 GiB of float32 on each side
    actual = torch.randn(n, device="cuda")
    expected = actual.clone()
    torch.cuda.synchronize()
    host_before = host_peak_mib()
    device_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    equal = compare(actual, expected)
    expected[n - 1] += 1.0
    expected[n // 3] = float("nan")
    differing = compare(actual, expected)
    device_growth = (torch.cuda.max_memory_allocated() - device_before) / 2**20
    host_growth = host_peak_mib() - host_before
    del actual, expected
    # A bfloat16 run against a float64 reference held on the host.
    reference = torch.linspace(-4, 4, 1 << 24, dtype=torch.float64)
    low = reference.to("cuda", torch.bfloat16)
    mixed_ok = compare(low, reference, check_dtype=False).ok
    low[-1] = 100.0
    mixed = compare(low, reference, check_dtype=False)
    print(json.dumps({
        "equal_ok": equal.ok,
        "paths": [m.path for m in differing.mismatches],
        "mismatched": differing.mismatches[0].mismatched,
        "report": differing.report(),
        "mixed_ok": mixed_ok,
        "mixed_report": mixed.report(),
        "device_growth_mib": device_growth,
        "host_growth_mib": host_growth,
    }))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
class TestOnDevice:
    def test_a_gib_pair_compares_on_the_device(self) -> None:
        # A child process, so this pytest process never initializes CUDA.
        done = subprocess.run(
            [sys.executable, "-c", _ON_DEVICE],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.splitlines()[-1])
        n = (1 << 30) // 4
        assert result["equal_ok"]
        assert result["paths"] == ["out"]
        assert result["mismatched"] == 2
        assert f"at index ({n // 3},)" in result["report"]
        assert f"({n - 1},): " in result["report"]
        assert result["mixed_ok"]
        assert f"at index ({(1 << 24) - 1},)" in result["mixed_report"]
        # Chunk-sized scratch only: a full-size mask would be 256 MiB, a copy 1 GiB.
        assert result["device_growth_mib"] < 160, result
        # Nothing the size of the tensors came to the host.
        assert result["host_growth_mib"] < 200, result


# --------------------------------------------------------------------------
# Snapshot of failing-path verdicts and messages (issue 15): every field of
# compare()'s result, byte for byte, for a few hundred seeded pairs, captured
# from the element-by-element code before it was made faster. The file keeps a
# digest of each result's repr (the texts were 400 KB); a differing label's
# current text is shown. Regenerate (only when a change of output is intended) with
#   python tests/test_compare.py --write-snapshot

_SNAPSHOT = os.path.join(os.path.dirname(__file__), "data", "compare_snapshot.json")
_SNAPSHOT_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
_FLOAT_PATTERNS = ("few", "all", "noisy", "nan", "inf", "-inf", "mixed", "allnan", "manyinf")
_NAN_PATTERNS = ("nan", "inf", "-inf", "mixed", "allnan")  # NaN on both sides somewhere


def _snapshot_values(
    dtype: torch.dtype, ref64: bool, pattern: str, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One seeded pair of n flat values of `pattern`, as the snapshot records it."""
    if dtype == torch.bool:
        expected = torch.rand(n, generator=gen) < 0.5
        actual = expected.clone()
        where = torch.randint(0, n, (3,), generator=gen) if pattern == "few" else slice(None)
        actual[where] = ~actual[where]
        return actual, expected
    if dtype == torch.int64:
        base = 2**62 if pattern == "big" else 0
        expected = torch.randint(-1000, 1000, (n,), generator=gen) + base
        actual = expected.clone()
        if pattern == "few":
            actual[torch.randint(0, n, (3,), generator=gen)] += torch.tensor([5, -7, 1])
        elif pattern == "big":
            actual[torch.randint(0, n, (2,), generator=gen)] += 1
        else:  # all, with ties
            actual += 100
        return actual, expected
    real = torch.float64
    shape = (n, 2) if dtype.is_complex else (n,)
    scale = 10.0 ** torch.randint(-3, 3, shape, generator=gen).to(real)
    reference = torch.randn(shape, generator=gen, dtype=real) * scale
    reference[torch.rand(shape, generator=gen) < 0.05] = 0.0  # exact zeros: 0/0
    if dtype.is_complex:
        reference = torch.view_as_complex(reference)
    stored = dtype if not ref64 else torch.float64
    expected = reference.to(dtype).to(stored)
    wide = expected.to(torch.complex128 if dtype.is_complex else torch.float64)
    tol = DEFAULT_TOLERANCES[dtype]
    bound = tol.atol + tol.rtol * wide.abs()
    noise = torch.rand(n, generator=gen, dtype=torch.float64)
    actual = wide + (noise - 0.5) * bound  # close everywhere
    if pattern in ("noisy", "mixed"):
        actual = wide + (noise - 0.5) * 4 * bound  # about half past the bound
    elif pattern == "all":
        actual = wide + 100
    positions = torch.randperm(n, generator=gen)
    few = positions[: max(1, min(4, n // 2))]
    if pattern in ("few", "mixed"):
        actual[few[:3]] += 100 * (1 + wide[few[:3]].abs())
    actual = actual.to(dtype)
    nan, inf = math.nan, math.inf
    if pattern in ("nan", "mixed"):
        actual[few[:3]] = nan
        expected[few[1:2]] = nan  # NaN on both sides
        expected[positions[-1:]] = nan  # the reference only
    if pattern in ("inf", "-inf", "mixed"):
        sign = -1.0 if pattern == "-inf" else 1.0
        at = positions[n // 2 : n // 2 + 3] if pattern == "mixed" else few
        actual[at] = sign * inf
        expected[at[:1]] = sign * inf  # a match of specials
        expected[at[1:2]] = -sign * inf  # infinities of opposite sign
        expected[at[2:3]] = nan
        actual[positions[-2:-1]] = 0.5
        expected[positions[-2:-1]] = inf  # infinite only in the reference
    if pattern == "allnan":
        actual[:] = nan
        expected[positions[: n // 2]] = nan
    if pattern == "manyinf":
        actual[positions[: n // 2]] = inf
        expected[positions[: n // 4]] = inf
        expected[positions[n // 4 : n // 3]] = -inf
    return actual, expected


def _snapshot_cases() -> Iterator[tuple[str, object, object, dict[str, object], int]]:
    """(name, actual, expected, compare() keywords, chunk) for every recorded pair."""
    gen = torch.Generator().manual_seed(2024)
    tolerances: dict[str, dict[torch.dtype, Tolerance] | None] = {
        "default": None,
        "ulps": {
            d: Tolerance(ulps=4, source="snapshot ulps")
            for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        },
        "both": {
            d: Tolerance(rtol=1e-3, atol=1e-5, ulps=2, source="snapshot both")
            for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        },
    }
    for name, dtype in _SNAPSHOT_DTYPES.items():
        if dtype == torch.bool:
            patterns: tuple[str, ...] = ("few", "all")
        elif dtype == torch.int64:
            patterns = ("few", "all", "big")
        else:
            patterns = _FLOAT_PATTERNS
        low = dtype in (torch.bfloat16, torch.float16, torch.float32)
        refs = (False, True) if low else (False,)
        for pattern in patterns:
            for ref64 in refs:
                for equal_nan in (False, True) if pattern in _NAN_PATTERNS else (False,):
                    for size in (1, 7, 300, 4097):
                        a, e = _snapshot_values(dtype, ref64, pattern, size, gen)
                        kind = "flat"
                        if size == 300:  # non-contiguous: a transposed view
                            a, e = a.reshape(20, 15).t(), e.reshape(20, 15).t()
                            kind = "transposed"
                        elif size == 1:
                            a, e = a[0], e[0]
                            kind = "0-dim"
                        tol = "default"
                        if dtype.is_floating_point and size in (7, 4097):
                            tol = ("default", "ulps", "both")[(size + len(pattern)) % 3]
                        keywords = {
                            "equal_nan": equal_nan,
                            "check_dtype": not ref64,
                            "tolerances": tolerances[tol],
                            "worst": (5, 0, 2, 7)[(len(pattern) + size) % 4],
                        }
                        label = f"{name}{' ref64' if ref64 else ''} {pattern} {kind} {size}"
                        label += f" equal_nan={equal_nan} tol={tol} worst={keywords['worst']}"
                        yield label, a, e, keywords, 0
    # Chunk boundaries: real chunks (CHUNK_ELEMENTS +- 1, several) and chunks of 64.
    chunk = _kernel.CHUNK_ELEMENTS
    for dtype, pattern, size in (
        (torch.float32, "few", chunk - 1),
        (torch.float32, "mixed", chunk + 1),
        (torch.bfloat16, "all", chunk + 1),
        (torch.float32, "nan", 3 * chunk + 5),
        (torch.int64, "all", chunk + 1),
        (torch.int64, "few", 2 * chunk + 3),
        (torch.float16, "manyinf", chunk - 1),
        (torch.float64, "noisy", 2 * chunk + 1),
    ):
        a, e = _snapshot_values(dtype, False, pattern, size, gen)
        label = f"{_snapshot_name(dtype)} {pattern} flat {size}"
        yield label, a, e, {}, 0
    for name, dtype in _SNAPSHOT_DTYPES.items():
        patterns = ("few", "all") if not dtype.is_floating_point else ("few", "nan", "mixed")
        for pattern in patterns:
            for size in (63, 65, 64 * 80 + 1):
                a, e = _snapshot_values(dtype, False, pattern, size, gen)
                yield f"{name} {pattern} flat {size} chunk=64", a, e, {"worst": 3}, 64
    # A nested output: batched leaves, halves judged again.
    leaves = {}
    for i, pattern in enumerate(("few", "nan", "noisy", "inf", "few", "mixed")):
        leaves[f"t{i}"] = _snapshot_values(torch.float32, False, pattern, 50 + i, gen)
    yield (
        "nested float32",
        {k: a for k, (a, _) in leaves.items()},
        {k: e for k, (_, e) in leaves.items()},
        {},
        0,
    )


def _snapshot_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _snapshot_results() -> dict[str, str]:
    results = {}
    for label, actual, expected, keywords, chunk in _snapshot_cases():
        saved = _kernel.CHUNK_ELEMENTS, _kernel.SMALL_ELEMENTS
        if chunk:
            _kernel.CHUNK_ELEMENTS, _kernel.SMALL_ELEMENTS = chunk, 0
        try:
            result = compare(actual, expected, **keywords)  # type: ignore[arg-type]
        finally:
            _kernel.CHUNK_ELEMENTS, _kernel.SMALL_ELEMENTS = saved
        assert label not in results, label
        results[label] = repr(result)
    return results


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class TestFailingPathSnapshot:
    def test_every_field_and_message_is_as_recorded(self) -> None:
        with open(_SNAPSHOT, encoding="utf-8") as file:
            recorded = json.load(file)
        made_with = recorded.pop("__torch__")
        if not torch.__version__.startswith(made_with + "."):
            # The pairs come from torch's seeded generators, whose streams may change.
            pytest.skip(f"recorded with torch {made_with}; regenerate the snapshot to use it "
                        f"with torch {torch.__version__}")
        results = _snapshot_results()
        assert sorted(results) == sorted(recorded)
        differing = [label for label in recorded if _digest(results[label]) != recorded[label]]
        assert not differing, (f"{len(differing)} results changed; the first, "
                               f"{differing[0]}, now reads:\n{results[differing[0]]}")
        # The snapshot holds failures of every kind, not only passes.
        failing = [r for r in results.values() if "mismatches=()" not in r]
        assert len(failing) > len(recorded) * 3 // 4
        assert any("actual is infinite" in r for r in failing)
        assert any("is NaN at all of these" in r for r in failing)


class TestSpecialsByIndex:
    """A chunk with few NaN or inf decides them by index: as if every test ran everywhere."""

    @staticmethod
    def both_ways(
        monkeypatch: pytest.MonkeyPatch, actual: torch.Tensor, expected: torch.Tensor, **kw: object
    ) -> tuple[str, str]:
        by_index = repr(compare(actual, expected, **kw))  # type: ignore[arg-type]
        with monkeypatch.context() as patch:
            patch.setattr(_kernel, "_SPECIAL_SHARE", 1 << 62)  # every chunk the long way
            everywhere = repr(compare(actual, expected, **kw))  # type: ignore[arg-type]
        return by_index, everywhere

    def test_seeded_pairs_are_judged_alike(self, monkeypatch: pytest.MonkeyPatch) -> None:
        gen = torch.Generator().manual_seed(15)
        specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1e30, -3e38])
        failing = 0
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64):
            for k in range(12):
                n = 5000 + k
                expected = torch.randn(n, generator=gen).to(dtype)
                actual = expected + (torch.rand(n, generator=gen) < 0.01) * (k + 1)
                for side in (actual, expected):
                    at = torch.randint(0, n, (k,), generator=gen)
                    side[at] = specials[torch.randint(0, 6, (k,), generator=gen)].to(dtype)
                for equal_nan in (False, True):
                    ours, theirs = self.both_ways(
                        monkeypatch, actual, expected, equal_nan=equal_nan, worst=k % 7
                    )
                    assert ours == theirs, (dtype, k, equal_nan)
                    failing += "mismatches=()" not in ours
        assert failing > 100

    @pytest.mark.parametrize(
        ("actual", "expected"),
        [
            # A finite difference as great as float32's largest: ranked with the NaN.
            ([3.4028234663852886e38, 1.0, NAN, 2.0], [0.0, 1.0, 1.0, 2.0]),
            ([1.7014117331926443e38, 1.0, NAN, 2.0], [0.25, 1.0, 1.0, 2.0]),
            # A difference that overflows: infinite though both sides are finite.
            ([3.4e38, -3.4e38, 1.0, INF], [-3.4e38, 3.4e38, 1.0, INF]),
            ([INF, -INF, NAN, 1.0, 0.0], [INF, INF, NAN, 0.0, 0.0]),
        ],
    )
    def test_extremes_are_judged_alike(
        self, monkeypatch: pytest.MonkeyPatch, actual: list[float], expected: list[float]
    ) -> None:
        a, e = torch.tensor(actual), torch.tensor(expected)
        for equal_nan in (False, True):
            ours, theirs = self.both_ways(monkeypatch, a, e, equal_nan=equal_nan)
            assert ours == theirs
            assert "values differ" in ours


if __name__ == "__main__" and sys.argv[1:] == ["--write-snapshot"]:
    os.makedirs(os.path.dirname(_SNAPSHOT), exist_ok=True)
    with open(_SNAPSHOT, "w", encoding="utf-8") as out:
        digests = {label: _digest(text) for label, text in _snapshot_results().items()}
        digests["__torch__"] = ".".join(torch.__version__.split(".")[:2])
        json.dump(digests, out, indent=0, sort_keys=True)
        out.write("\n")


class TestHeadline:
    """The one line a failure's summary carries (pytest -r, a CI log, junit's message)."""

    def test_a_tensor_says_where_how_many_and_how_far(self) -> None:
        expected = torch.zeros(2, 4)
        actual = expected.clone()
        actual[1, 2] = 0.5
        result = compare({"logits": actual}, {"logits": expected})
        assert result.headline() == ("out['logits']: 1 / 8 elements differ, greatest absolute "
                                     "difference 0.5")
        assert "\n" not in result.headline()

    def test_the_other_paths_are_counted(self) -> None:
        result = compare([torch.ones(3), torch.ones(2), 1.0], [torch.zeros(3), torch.ones(3), 2.0])
        assert len(result.mismatches) == 3
        first = result.mismatches[0].message.splitlines()[0]
        assert result.headline().startswith("out[0]: 3 / 3 elements differ")
        assert result.headline().endswith("; 2 more paths differ"), first
        two = compare([torch.ones(3), torch.ones(2)], [torch.zeros(3), torch.ones(3)])
        assert two.headline().endswith("; 1 more path differs")

    def test_a_scalar_or_a_shape_is_its_message_first_line(self) -> None:
        scalar = compare(3, 4)
        assert scalar.headline() == only(scalar).message.splitlines()[0]
        assert "3" in scalar.headline() and "4" in scalar.headline()
        shape = compare(torch.ones(2), torch.ones(3))
        assert only(shape).kind == "shape"
        assert shape.headline() == only(shape).message.splitlines()[0]

    def test_a_nan_is_told_as_nan(self) -> None:
        result = compare(torch.tensor([1.0, NAN]), torch.tensor([1.0, 2.0]))
        assert result.headline() == ("out: 1 / 2 elements differ, greatest absolute "
                                     "difference nan")


def _benchmark() -> ModuleType:
    """benchmarks/bench_compare.py, whose grid this test holds to assert_close's verdicts:
    its own pairs, so that what is timed there is what is judged here."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compare.py"
    spec = importlib.util.spec_from_file_location("gpucase_bench_compare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [1_000, 70_000, 300_000])  # the small, screened, chunked paths
def test_verdicts_on_the_benchmark_grid_equal_assert_close_s(n: int) -> None:
    grid = _benchmark()
    gen = torch.Generator().manual_seed(n)
    rows = [(dtype, False) for dtype in (torch.float32, torch.bfloat16, torch.float16,
                                         torch.int64, torch.bool)]
    rows += [(torch.bfloat16, True), (torch.float16, True)]
    for dtype, reference in rows:
        for pattern in grid.PATTERNS:
            pair = grid._pair(pattern, dtype, reference, n, gen)
            if pair is None:  # close and NaN: not patterns of int64 and bool
                continue
            actual, expected = pair
            ours = compare(actual, expected, check_dtype=False).ok
            if ours != _assert_close_passes(actual, expected):
                assert _documented(actual, expected), (n, dtype, reference, pattern)

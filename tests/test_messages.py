"""The words of a mismatch, in parts: what test_compare.py's messages are made of."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_gpucase.verdict import messages


def _shortest_by_every_count(x: float, dtype: torch.dtype) -> str:
    """The shortest text that reads back to x in dtype, trying 1, 2, ... digits, torch rounding."""
    for digits in range(1, 18):
        candidate = float(f"{x:.{digits}g}")
        if torch.tensor(candidate, dtype=dtype).item() == x:
            return repr(candidate)
    return repr(x)


class TestShortestValues:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_the_fewest_digits_as_by_trying_every_count(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(21)
        bits = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=gen, dtype=torch.int64)
        values = bits.to(torch.int32).view(torch.float32).to(dtype)  # every binade
        info = torch.finfo(dtype)
        powers = [2.0**k for k in range(-30, 30)] + [info.max, info.tiny, info.tiny * info.eps]
        extra = torch.tensor([*powers, *(-p for p in powers), 0.1, 1 / 3, 0.0], dtype=dtype)
        checked = 0
        for x in torch.cat((values, extra)).tolist():
            if math.isfinite(x):
                assert messages._shortest(x, dtype) == _shortest_by_every_count(x, dtype), x
                checked += 1
        assert checked > 2000  # float16 leaves out what overflows it

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_every_16_bit_value_as_by_trying_every_count(self, dtype: torch.dtype) -> None:
        # The halving search's premise (once a count of digits reads back, every greater
        # one does), checked where it can be: on every value of the 16-bit dtypes.
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        values = [x for x in bits.view(dtype).tolist() if math.isfinite(x)]
        assert len(values) > 63000
        wrong = [x for x in values if messages._shortest(x, dtype) != _shortest_by_every_count(
            x, dtype)]
        assert wrong == []

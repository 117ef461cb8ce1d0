"""The one table of dtypes: every per-dtype fact lives here, once, as ``BACKEND_TABLE`` holds
the backends'. By name (no torch at import); the modules that need ``torch.dtype`` keys make
them from these rows (``verdict.tolerance``, ``verdict.rounding``, ``verdict.messages``,
``verdict._kernel``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPE_TABLE", "FLOAT_DTYPES", "LOW_PRECISION", "Dtype", "dtype_row"]


@dataclass(frozen=True)
class Dtype:
    """One dtype and what differs with it."""

    name: str                      # torch's name: "bfloat16"
    rtol: float                    # the default tolerance (torch.testing's for the dtype)
    atol: float
    run: bool = False              # a dtype a run may compute in ([matrix] dtypes, --gpu-dtypes)
    low_precision: bool = False    # a half-precision dtype (autocast's, ablation's "precision")
    # The rounding budget's multiple of the spread of its draws (verdict.rounding), for a run
    # computing in this dtype.
    budget_multiplier: float | None = None
    # The detectability rule (docs/verdicts.md): a constant relative error of more than this
    # many units of roundoff of an output's RMS size fails, for a run computing in this
    # dtype, wherever the rounding budget is narrower than that (a pass on a wider one says so).
    rule: float | None = None
    # The most significant digits a value of this dtype needs to read back exactly
    # (verdict.messages words the shortest that do); None: Python's repr.
    digits: int | None = None
    screened: bool = False         # the comparison kernel's fast screen handles it (_kernel)


DTYPE_TABLE: tuple[Dtype, ...] = (
    Dtype("float16", 1e-3, 1e-5, run=True, low_precision=True, budget_multiplier=4.0,
          rule=16.0, digits=5, screened=True),
    Dtype("bfloat16", 1.6e-2, 1e-5, run=True, low_precision=True, budget_multiplier=4.0,
          rule=16.0, digits=4, screened=True),
    Dtype("float32", 1.3e-6, 1e-5, run=True, budget_multiplier=16.0, rule=32.0, digits=9,
          screened=True),
    Dtype("float64", 1e-7, 1e-7, run=True, budget_multiplier=16.0, rule=32.0, screened=True),
    Dtype("complex32", 1e-3, 1e-5),
    Dtype("complex64", 1.3e-6, 1e-5),
    Dtype("complex128", 1e-7, 1e-7),
)

_BY_NAME = {row.name: row for row in DTYPE_TABLE}
FLOAT_DTYPES: tuple[str, ...] = tuple(row.name for row in DTYPE_TABLE if row.run)
LOW_PRECISION: tuple[str, ...] = tuple(row.name for row in DTYPE_TABLE if row.low_precision)


def dtype_row(name: str) -> Dtype | None:
    """The row of ``name`` ("bfloat16", or "torch.bfloat16"), or None."""
    return _BY_NAME.get(name.removeprefix("torch."))

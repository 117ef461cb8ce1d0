"""What rounding at the run's precision may do to an output: the rounding budget, and the
rule that holds a device run to the CPU's own error in the same dtype.

The default check (``tolerance``'s table, as ``torch.testing``) knows the dtype of an
output, not the computation that made it: a float32 matmul of 1024 terms of size 1e3
is off the float64 result by tens, correctly; a float32 layer norm of 1e3 + N(0, 1)
by 1e-4. A leaf that fails the default check gets a second look:

**The rounding budget.** The float64 reference is computed again ``DRAWS`` times with
every floating input (and cotangent) value the run's precision cannot hold exactly
multiplied by ``1 + u z``, every floating result of every operation it runs multiplied by
``1 + u z'`` where that precision cannot hold it exactly (``RoundEveryOp``; below the
precision's smallest normal, rounded as the dtype stores it), and the operands of
operations that add up many terms rounded once more (``_ACCUMULATES``: the roundings of the
terms inside the kernel), where ``u`` is the unit roundoff of the run's precision and ``z``,
``z'`` are seeded standard normal draws. Each element's greatest change over the draws,
and the leaf's RMS change, are its *spread*. An element then passes when it is within
``MULTIPLIER[precision]`` times the greatest spread of the elements no larger than
``WINDOW`` times its size (``Budget.allowance``) plus the default ``rtol``, and the leaf
when its RMS error is within the multiplier times its RMS spread plus one rounding of its
RMS size (``Budget.rms_problem``). The multiplier covers what the draws cannot see: a
kernel's order of accumulation and the draws' own sampling. Non-finite mismatches (NaN
or inf against a finite value, or the reverse) always fail. A leaf within its default
tolerance but past ``CLEAN`` roundings of its RMS size in RMS error gets the same look.

**The same-dtype baseline.** On a device other than the CPU, the same call runs again
on the CPU in the same dtype, as ``torch._dynamo.utils.same(fp64_ref=...)`` judges a
compiled model against its eager run: what this precision achieves with the CPU's
kernels. A device leaf past the default check fails when its error against the float64
reference is more than ``BASELINE_MULTIPLE`` times the baseline's own (greatest and
RMS, each with a floor of one unit in the last place of the output's scale), so a CUDA
result ten times worse than the CPU's fails even where the budget would allow it; and
where the CPU's own result is past the budget (a computation the budget underrates),
the device run is held to the baseline alone.

Pure functions on tensors, and the dispatch mode that rounds; the runs themselves are
the child's (``run.second_look``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_gpucase.base.dtypes import DTYPE_TABLE
from pytest_gpucase.verdict.held import LOWER_PRECISION, HeldDtypes, coarser_than
from pytest_gpucase.verdict.tolerance import Tolerance

__all__ = [
    "BASELINE_MULTIPLE",
    "CLEAN",
    "DECOMPOSE_BELOW",
    "DRAWS",
    "ELEMENT_BUDGETS_UP_TO",
    "MULTIPLIER",
    "NEEDED",
    "RMS_ELEMENTS",
    "RMS_SHARE",
    "RULE",
    "RULES",
    "SHARED",
    "SHARED_SHARE",
    "WINDOW",
    "Budget",
    "HeldAsStored",
    "Needed",
    "RangeEvent",
    "RmsCheck",
    "RoundEveryOp",
    "SecondLook",
    "baseline_problem",
    "coarser",
    "draw_seeds",
    "element_spread",
    "perturbed",
    "rms_size",
    "spread",
    "unit_roundoff",
]

# The budget's multiplier per precision. float32 and float64 reductions accumulate in
# their own dtype, so their error grows with the reduction's length inside one operation,
# unseen by the draws: measured on the CPU (benchmarks/bench_verdicts.py needs), torch's
# float32 matmul of 1024 terms needs 2.6 times the spread of a float64 matmul, a loop
# accumulating one float32 product at a time (as a naive GPU kernel does) 8. bfloat16 and
# float16 are storage formats whose kernels accumulate in float32: their error is the
# rounding of what they read and write, which the draws see (measured needs up to 1.2).
MULTIPLIER: Mapping[torch.dtype, float] = {   # base.dtypes.DTYPE_TABLE
    getattr(torch, row.name): row.budget_multiplier for row in DTYPE_TABLE
    if row.budget_multiplier is not None
}
# The detectability rule per precision (docs/verdicts.md), in units of roundoff.
RULES: Mapping[torch.dtype, float] = {   # base.dtypes.DTYPE_TABLE
    getattr(torch, row.name): row.rule for row in DTYPE_TABLE if row.rule is not None
}
# Wrong by a little everywhere, once more: a leaf of at least RMS_ELEMENTS elements is held,
# over all but its largest sixteenth of errors (SHARED_SHARE), to RMS_SHARE of the
# multiplier. Its RMS spread is then a mean over many elements and draws, where the
# greatest spread of one element is the largest of two draws: the multiplier's margin for
# that sampling is not needed, only its margin for what the draws cannot see (a kernel's
# order of accumulation: RMS needs of at most 0.6 in bfloat16 and 2.7 in float32,
# benchmarks/bench_verdicts.py needs). The largest errors are left to the element rule: a
# few ill-conditioned elements (a batch norm over two samples whose two values are one unit
# apart) make an RMS no constant error does. Not where the budget is as large as the output
# itself (the computation decides it only to within its size).
RMS_ELEMENTS = 64
RMS_SHARE = 0.5
# Draws of the rounding budget: each a run of the float64 reference.
DRAWS = 2
# A floating leaf within its default tolerance element by element passes at once only when
# its RMS error is within CLEAN units of roundoff (of the run's precision) of its RMS size;
# past that it gets the second look, as a leaf past its default tolerance does. The default
# atol (1e-5) says nothing of an output of size 1e-6, or of a float32 softmax wrong by 1e-4
# relative everywhere.
CLEAN = 16.0
# The detectability rule of float32 and float64 (``RULES``: each precision's): a constant
# relative error above RULE units of roundoff of the output's RMS size fails wherever the
# budget is narrower than that; a pass within a budget wider than RULE says so in the item's
# notes. ``ranges`` holds a range finding to it in every precision.
RULE = RULES[torch.float32]
# The per-element budget: an element shares the spread of the elements no larger than WINDOW
# times its size; the smallest max(SHARED, n / SHARED_SHARE) share theirs.
WINDOW = 2.0
SHARED = 8
SHARED_SHARE = 16
# Above this many elements a leaf is held to one figure (its greatest spread), as before the
# per-element budget: sorting and six float64 copies of a larger leaf cost more than its draws.
ELEMENT_BUDGETS_UP_TO = 1 << 22
# How much worse than the CPU's own same-dtype error a device run may be.
BASELINE_MULTIPLE = 4.0
_SEED = 0x6A7C5E


class Needed:
    """``NEEDED``: what a second look answers for a leaf whose budget or baseline it has not
    computed yet (``compare`` lists the leaf in ``Comparison.pending``)."""

    def __repr__(self) -> str:
        return "NEEDED"


NEEDED: Final = Needed()


class SecondLook(Protocol):
    """What the comparison asks for a leaf that failed the default check (``compare``): data
    only. The comparison never runs the user's code: a leaf whose budget or baseline is not
    known yet is answered ``NEEDED``, and listed in ``Comparison.pending``, for the caller to
    compute (``run.judge``) and ask the comparison again."""

    def budget(self, path: str) -> Budget | Needed | None:
        """The rounding budget of the leaf at ``path``; None when none is known; ``NEEDED``
        when it can be computed and has not been."""

    def baseline(self, path: str) -> object | Needed | None:
        """The same call's value at ``path`` in the same dtype on the CPU; None when there
        is no baseline (a CPU run, or a call that could not run on the CPU); ``NEEDED`` when
        it can be computed and has not been."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next value of ``dtype``: one rounding's relative size."""
    return float(torch.finfo(dtype.to_real()).eps) / 2


def coarser(a: torch.dtype, b: torch.dtype | None) -> torch.dtype:
    """Of two floating dtypes, the one with fewer significant bits (``a`` on a tie, or when
    ``b`` is None or not floating); the real dtype of a complex one is what counts."""
    if b is None or not (b.is_floating_point or b.is_complex):
        return a
    if not (a.is_floating_point or a.is_complex):
        return b
    return b if coarser_than(b, a) else a


def perturbed(value: Any, u: float, generator: torch.Generator,
              exact_in: torch.dtype | None = None) -> Any:
    """``value`` with every floating tensor (in dicts, lists and tuples too) multiplied by
    ``1 + u z``, z standard normal from ``generator``; integers and other values as they are.

    ``exact_in``: the run's precision. An element that dtype holds exactly is left as it is:
    the call reads that very value (a bfloat16 input is read as itself by the bfloat16 call
    and by its float64 reference), so it is no rounding source, and perturbing it would only
    measure the problem's conditioning (``exp`` of 9 moves by 9 u for a 1 u change of its
    input) as if it were an error the run can make."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
            return value
        t = value.detach()
        keep = _held_exactly(t, exact_in)
        return _rounded(t, u, generator, keep).requires_grad_(value.requires_grad)
    if isinstance(value, Mapping):
        return {key: perturbed(item, u, generator, exact_in) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(perturbed(item, u, generator, exact_in) for item in value)
    return value


def _underflow(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | float:
    """What storing ``t`` in ``dtype`` loses below its smallest normal value (a subnormal's
    absolute spacing, a flush to zero): an error no relative rounding shows, which a float16
    backward of ``x ** 5`` of 0.02 makes (1e-9, a subnormal of spacing 6e-8)."""
    if dtype is None or t.is_complex() or not dtype.is_floating_point:
        return 0.0
    if not coarser_than(dtype, t.dtype):
        return 0.0
    with torch.no_grad():
        small = t.abs() < torch.finfo(dtype).smallest_normal
        if not bool(small.any()):
            return 0.0
        return torch.where(small, t.to(dtype).to(t.dtype) - t, 0)


def _held_exactly(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Where ``t``'s values are exactly values of ``dtype`` (None: nowhere, or no dtype)."""
    if dtype is None or t.is_complex():
        return None
    real = dtype.to_real()
    if not real.is_floating_point or not coarser_than(real, t.dtype):
        return torch.ones_like(t, dtype=torch.bool)  # a finer dtype holds all of them
    with torch.no_grad():
        return t.to(real).to(t.dtype) == t


def _rounded(t: torch.Tensor, u: float, generator: torch.Generator,
             keep: torch.Tensor | None = None) -> torch.Tensor:
    # A product, not t + t * (u z): an infinity (a masked score) stays itself, never
    # inf - inf = NaN. The draws are made for every element (the same stream with or
    # without ``keep``), and not applied where ``keep`` is set.
    noise = torch.randn(t.shape, generator=generator, dtype=t.dtype.to_real())
    if keep is not None:
        noise.masked_fill_(keep.to(noise.device), 0)
    return t * noise.mul_(u).add_(1).to(t.device)  # in place: a draw pays this per operation


# Operations that only move values (no rounding happens in any dtype): not perturbed,
# so that a value copied many times is not counted as rounded each time.
_MOVES = frozenset({
    "aten::clone", "aten::_to_copy", "aten::copy_", "aten::lift_fresh_copy", "aten::cat",
    "aten::stack", "aten::index_select", "aten::gather", "aten::index", "aten::embedding",
    "aten::constant_pad_nd", "aten::zeros_like", "aten::ones_like", "aten::empty_like",
    "aten::zeros", "aten::ones", "aten::empty", "aten::full", "aten::scalar_tensor",
    "aten::empty_strided", "aten::new_zeros", "aten::new_empty", "aten::new_empty_strided",
    "aten::fill_", "aten::zero_", "aten::masked_fill", "aten::masked_fill_", "aten::where",
    "aten::slice_scatter", "aten::select_scatter", "aten::expand_copy",
    "aten::_unsafe_view", "aten::repeat", "aten::contiguous", "aten::detach", "aten::alias",
})


# Fused operations run as torch's own decompositions (torch._decomp) under RoundEveryOp, so
# that their intermediate values are rounded too: a CPU kernel folds batch norm into
# x * (w * invstd) + (b - mean * w * invstd), whose cancellation one rounding of the fused
# op's output does not show. Normalizations, softmax and the losses built on them; never
# random ops, whose decomposition would draw other numbers. Only at float32's precision or
# finer (``DECOMPOSE_BELOW``): a bfloat16 or float16 kernel keeps its intermediate values in
# float32 (torch's "opmath"), so rounding them at the storage format's precision would
# budget for errors no kernel makes (a bfloat16 cross-entropy's budget doubles).
_DECOMPOSED = (
    "native_batch_norm.default", "_native_batch_norm_legit.default",
    "_native_batch_norm_legit.no_stats", "_native_batch_norm_legit_no_training.default",
    "native_batch_norm_backward.default", "native_layer_norm.default",
    "native_layer_norm_backward.default", "native_group_norm.default",
    "native_group_norm_backward.default", "_fused_rms_norm.default", "_softmax.default",
    "_softmax_backward_data.default", "_log_softmax.default",
    "_log_softmax_backward_data.default", "_safe_softmax.default", "nll_loss_forward.default",
    "nll_loss_backward.default",
)


DECOMPOSE_BELOW = 2.0 ** -20  # unit roundoffs below it (float32's, float64's) decompose
# Above it, the batch norms in training, whose CPU kernel keeps the batch mean in the storage
# dtype: a bfloat16 batch norm over two samples 2.016 and 1.992 rounds their mean 2.004 to
# 2.0 and is 19% off the exact result at an output of 2 (-1.62 against -1.99), where one
# rounding of its result moves it by 0.4%.
_DECOMPOSED_LOW = ("native_batch_norm.default", "_native_batch_norm_legit.default",
                   "_native_batch_norm_legit.no_stats")

# Operations that accumulate many terms: their operands are rounded once more as they are
# read, which stands for the rounding of each product and partial sum inside the kernel (a
# float32 matmul of 512 terms is off by about sqrt(512) roundings of its terms, which one
# rounding of its result does not show; a bfloat16 layer norm's backward on the CPU sums its
# bias gradient in bfloat16, 0.04 off a sum of 32 terms of size 1, at an element of 0.02). A
# user's input is not perturbed where the run holds it exactly (``exp`` reads it as it is);
# an accumulating operation still rounds what it adds up.
_ACCUMULATES = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::convolution", "aten::_convolution",
    "aten::convolution_backward", "aten::sum", "aten::mean", "aten::cumsum", "aten::prod",
    "aten::cumprod", "aten::var", "aten::std", "aten::var_mean", "aten::std_mean",
    "aten::linalg_vector_norm", "aten::norm", "aten::logsumexp", "aten::_cdist_forward",
    "aten::avg_pool2d", "aten::avg_pool1d", "aten::avg_pool3d", "aten::_adaptive_avg_pool2d",
    "aten::trace", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::avg_pool2d_backward", "aten::avg_pool3d_backward", "aten::embedding_dense_backward",
    "aten::_adaptive_avg_pool2d_backward", "aten::_adaptive_avg_pool3d_backward",
    "aten::adaptive_max_pool2d_backward", "aten::max_pool2d_with_indices_backward",
    "aten::max_pool3d_with_indices_backward", "aten::upsample_nearest2d_backward",
    "aten::upsample_bilinear2d_backward", "aten::upsample_linear1d_backward",
    "aten::upsample_nearest1d_backward", "aten::upsample_bicubic2d_backward",
    "aten::_upsample_bilinear2d_aa_backward", "aten::index_add", "aten::scatter_add",
    "aten::scatter_reduce", "aten::index_put", "aten::_index_put_impl_", "aten::col2im",
    "aten::_embedding_bag", "aten::_embedding_bag_backward", "aten::segment_reduce",
    "aten::cumsum_", "aten::logcumsumexp", "aten::_cdist_backward", "aten::_pdist_forward",
    # Fused normalizations and backward passes below float32's precision (above it they run
    # decomposed, their sums rounded so): a bfloat16 batch norm over two samples is 0.37 off
    # at an output of 2 where the two values are one unit apart. Softmax keeps its sum in
    # float32 (torch's "opmath") after subtracting the maximum: rounding its inputs would
    # only measure their conditioning (exp of 9 moves by 9 u).
    "aten::native_layer_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_group_norm",
    "aten::_fused_rms_norm",
    "aten::native_layer_norm_backward", "aten::native_batch_norm_backward",
    "aten::native_group_norm_backward", "aten::_fused_rms_norm_backward",
    "aten::_softmax_backward_data", "aten::_log_softmax_backward_data",
    "aten::nll_loss_forward", "aten::nll_loss_backward", "aten::nll_loss2d_forward",
    "aten::nll_loss2d_backward", "aten::mse_loss", "aten::mse_loss_backward",
    "aten::binary_cross_entropy", "aten::binary_cross_entropy_backward",
    "aten::smooth_l1_loss", "aten::huber_loss", "aten::kl_div",
})


# Reductions whose bfloat16 and float16 kernels add up in float32 (torch's "opmath" type,
# on the CPU and in CUDA alike) and round only their result: at those precisions their
# operands are not rounded once more (a float32 run's are: its kernel adds in float32, term
# by term). Matmuls and convolutions keep theirs: a GPU's low-precision GEMM may reduce its
# split-K partial sums in the storage dtype (torch.backends.cuda.matmul.
# allow_bf16_reduced_precision_reduction), as do atomic index_add and scatter_add.
_OPMATH_REDUCTIONS = frozenset({
    "aten::sum", "aten::mean", "aten::cumsum", "aten::cumsum_", "aten::prod",
    "aten::cumprod", "aten::var", "aten::std", "aten::var_mean", "aten::std_mean",
    "aten::linalg_vector_norm", "aten::norm", "aten::logsumexp", "aten::logcumsumexp",
    "aten::avg_pool1d", "aten::avg_pool2d", "aten::avg_pool3d", "aten::_adaptive_avg_pool2d",
    "aten::trace",
})


@functools.cache
def _decompositions(low: bool = False) -> dict[Any, Any]:
    from torch._decomp import decomposition_table

    found = {}
    for name in _DECOMPOSED_LOW if low else _DECOMPOSED:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None and op in decomposition_table:
            found[op] = decomposition_table[op]
    return found


@dataclass(frozen=True)
class RangeEvent:
    """One operation whose result ``dtype`` cannot hold: past its largest value
    (``overflow``), or below its normal range and stored with most of it lost
    (``underflow``: a subnormal's spacing, or 0)."""

    kind: str  # "overflow" | "underflow"
    op: str  # the operation that made it (aten::mul)
    value: float  # the greatest magnitude it made past the range, or lost below it


class RoundEveryOp(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Multiply every floating result of every operation run under it by ``1 + u z``:
    the reference's computation as if each value it makes were rounded once at the run's
    precision. Views and pure data movement are left as they are; a result an operation
    writes into an argument (``add_``, ``out=``) is perturbed where it was written; at
    float32's precision, a fused normalization or softmax runs as its decomposition, each
    part rounded (``_DECOMPOSED``). With ``exact_in`` (the run's precision), an element of
    a result that dtype holds exactly is left as it is: a correctly rounded operation at that
    precision makes that very value (``amax``, ``relu``, a sum of small integers), so it was
    not rounded.

    With ``autocast`` (the autocast dtype of a run whose float32 reference this is), each
    value is rounded at the precision of the dtype the run holds it in (``held.HeldDtypes``):
    a lower-precision operation's operands where its cast rounds them, and its results, at
    the autocast dtype; every other result at its operands' promoted dtype (float32: not
    rounded, the reference computes it as the run does)."""

    def __init__(self, u: float, generator: torch.Generator,
                 exact_in: torch.dtype | None = None,
                 events: dict[str, RangeEvent] | None = None,
                 autocast: torch.dtype | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.u, self.generator, self.exact_in = u, generator, exact_in
        self.held = HeldDtypes(autocast) if autocast is not None else None
        self.decomposed = (_decompositions(u >= DECOMPOSE_BELOW) if self.held is None
                           else {})
        # With ``events``: the first operations whose result ``exact_in`` cannot hold (past
        # its largest value, or below its normal range with half of it lost), noted there.
        self.events, self._op = events, ""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says
        # no; the wrapper's first call imports torch._dynamo, 2 s paid again in every forked
        # child that makes a budget, with patches of torch._C's classes a reused worker
        # would take for state a case left. The draws run eager float64 code, never a
        # compiled frame of this method.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self.held is not None:
            return self._held_dispatch(self.held, func, args, kwargs or {})
        decomposition = self.decomposed.get(func)
        if decomposition is not None:
            with self:  # its parts come back here, each rounded
                out = decomposition(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        schema = func._schema
        if schema.name in _ACCUMULATES and not (
                self.u >= DECOMPOSE_BELOW and schema.name in _OPMATH_REDUCTIONS):
            args, kwargs = _operands_rounded(args, kwargs or {}, self.u, self.generator)
        out = func(*args, **(kwargs or {}))
        if schema.name in _MOVES or func.is_view:
            return out
        self._op = schema.name
        return self._result_rounded(schema, out)

    def _held_dispatch(self, held: HeldDtypes, func: Any, args: Any,
                       kwargs: dict[str, Any]) -> Any:
        """One operation of an autocast run's float32 reference, each value rounded at the
        precision of the dtype the run holds it in."""
        schema = func._schema
        dtype = held.result(func, args, kwargs)  # of the operands as the run holds them
        if schema.name in LOWER_PRECISION:
            # autocast's cast of an operand held finer (a float32 weight) rounds it; one
            # already held in the autocast dtype is rounded once more as an accumulation's
            # operand, below, as in a run all in that dtype
            args, kwargs = _operands_rounded(args, kwargs, self.u, self.generator,
                                             held.finer_than_autocast, held.autocast)

        def rounds_terms(t: torch.Tensor) -> bool:  # not a copy the cast made (held as t)
            return _coarser_than(held.of(t), t)

        if schema.name in _ACCUMULATES and schema.name not in _OPMATH_REDUCTIONS:
            args, kwargs = _operands_rounded(args, kwargs, self.u, self.generator,
                                             rounds_terms)
        out = func(*args, **kwargs)
        if schema.name in _MOVES or func.is_view:
            held.mark(out, dtype)
            return out
        self._op = schema.name
        writes = _writes(schema)
        # a result written into an argument is kept in the dtype the argument is held in
        out = self._result_rounded(schema, out, held.of if writes else lambda _: dtype)
        if writes is False:
            held.mark(out, dtype)
        return out

    def _result_rounded(self, schema: Any, out: Any,
                        held_in: Callable[[torch.Tensor], torch.dtype | None] | None = None,
                        ) -> Any:
        """The result of an operation that computed, rounded: in place where it was written.
        ``held_in``: the dtype the run holds a result in (autocast), each rounded at that
        dtype's precision, and not at all where that is its own dtype or finer; None: every
        result at the run's precision."""
        writes = _writes(schema)
        if writes is None:
            return out  # a view or an alias of an argument: nothing was rounded
        results = out if isinstance(out, (tuple, list)) else (out,)

        def dtype_of(t: torch.Tensor) -> torch.dtype | None:
            return held_in(t) if held_in is not None else None

        def rounds(t: object) -> bool:
            if not (isinstance(t, torch.Tensor) and _roundable(t)):
                return False
            return held_in is None or _coarser_than(held_in(t), t)

        if writes:
            for result in results:
                if rounds(result):
                    data = result.data  # not tracked by autograd, as a rounding is not
                    data.copy_(self.rounded(data, dtype_of(result)))
            return out
        rounded = [self.rounded(t, dtype_of(t)) if rounds(t) else t for t in results]
        return type(out)(rounded) if isinstance(out, (tuple, list)) else rounded[0]

    def rounded(self, t: torch.Tensor, held: torch.dtype | None = None) -> torch.Tensor:
        """``t`` rounded once at the run's precision, or at ``held``'s where given."""
        dtype = held if held is not None else self.exact_in
        u = unit_roundoff(held) if held is not None else self.u
        out = _rounded(t, u, self.generator, _held_exactly(t, dtype))
        shift = _underflow(t, dtype)
        if self.events is not None and dtype is not None and not t.is_complex():
            _note_ranges(t, shift, dtype, self._op, self.events)
        return out + shift


def _note_ranges(t: torch.Tensor, shift: torch.Tensor | float, dtype: torch.dtype, op: str,
                 events: dict[str, RangeEvent]) -> None:
    """Note in ``events`` an overflow or underflow of ``dtype`` in the result ``t`` (``shift``:
    what storing it loses below the normal range), the first of each kind only."""
    if not dtype.is_floating_point:
        return
    with torch.no_grad():
        limit = float(torch.finfo(dtype).max)
        # One pass with no copy (the greatest |t|); the finite values only if that is past it.
        if "overflow" not in events and float(torch.linalg.vector_norm(t, math.inf)) > limit:
            largest = float(torch.where(torch.isfinite(t), t.abs(), 0).amax())
            if largest > limit:
                events["overflow"] = RangeEvent("overflow", op, largest)
        if "underflow" not in events and isinstance(shift, torch.Tensor):
            lost = (shift != 0) & (shift.abs() >= t.abs() / 2)
            if bool(lost.any()):
                events["underflow"] = RangeEvent(
                    "underflow", op, float(t.abs().masked_fill(~lost, 0).amax()))


class HeldAsStored(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Store every floating result of every operation run under it as ``dtype``'s range
    stores it, and nothing else: past the largest value, an infinity; below the smallest
    normal, the subnormal (or 0) the dtype holds; every other value exactly as computed (no
    rounding). The float64 reference under it is the computation with ``dtype``'s range and
    float64's precision: where it is far off the reference, the range of ``dtype``, not its
    rounding, is what the computation cannot have. ``events`` are the first operations that
    overflowed and underflowed (an underflow that lost at least half of a value). Fused
    operations are one operation, as in ``RoundEveryOp`` below float32's precision: their
    kernels keep intermediate values in float32."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype = dtype
        self.events: dict[str, RangeEvent] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as RoundEveryOp's: no torch._dynamo import in a child

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if schema.name in _MOVES or func.is_view:
            return out
        written = [r.alias_info is not None and r.alias_info.is_write for r in schema.returns]
        if any(r.alias_info is not None for r in schema.returns) and not any(written):
            return out
        results = out if isinstance(out, (tuple, list)) else (out,)
        stored = [self.stored(t, schema.name) if _roundable(t) else t for t in results]
        if any(written):
            for before, after in zip(results, stored, strict=True):
                if after is not before:
                    before.data.copy_(after)
            return out
        if isinstance(out, (tuple, list)):
            return type(out)(stored)
        return stored[0]

    def stored(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if t.is_complex() or not self.dtype.is_floating_point:
            return t
        info = torch.finfo(self.dtype)
        if info.eps <= torch.finfo(t.dtype).eps and info.max >= torch.finfo(t.dtype).max:
            return t
        with torch.no_grad():
            finite = torch.isfinite(t)
            over = finite & torch.isinf(t.to(self.dtype))
            small = finite & (t.abs() < info.smallest_normal) & (t != 0)
            if not bool(over.any() or small.any()):
                return t
            out = t.clone()
            if bool(over.any()):
                self.events.setdefault("overflow", RangeEvent(
                    "overflow", op, float(t.abs().masked_fill(~over, 0).amax())))
                out = torch.where(over, torch.copysign(torch.full_like(t, math.inf), t), out)
            if bool(small.any()):
                held = t.to(self.dtype).to(t.dtype)
                out = torch.where(small, held, out)
                lost = small & ((held - t).abs() >= t.abs() / 2)
                if bool(lost.any()):
                    self.events.setdefault("underflow", RangeEvent(
                        "underflow", op, float(t.abs().masked_fill(~lost, 0).amax())))
        return out


def _operands_rounded(args: Any, kwargs: dict[str, Any], u: float,
                      generator: torch.Generator,
                      which: Callable[[torch.Tensor], bool] | None = None,
                      exact_in: torch.dtype | None = None) -> tuple[Any, dict[str, Any]]:
    """The floating tensor operands of an accumulating operation, each rounded once more
    (those ``which`` names, when given; not where ``exact_in`` holds them exactly: a cast
    to it does not round those)."""
    def each(value: Any) -> Any:
        if (isinstance(value, torch.Tensor) and _roundable(value)
                and (which is None or which(value))):
            return _rounded(value, u, generator, _held_exactly(value, exact_in))
        if isinstance(value, (list, tuple)):
            return type(value)(each(item) for item in value)
        return value

    return tuple(each(a) for a in args), {key: each(v) for key, v in kwargs.items()}


def _writes(schema: Any) -> bool | None:
    """Whether an operation writes its result into an argument (``add_``, ``out=``); None
    when its result is a view or an alias of an argument that it does not write."""
    written = [r.alias_info is not None and r.alias_info.is_write for r in schema.returns]
    if any(r.alias_info is not None for r in schema.returns) and not any(written):
        return None
    return any(written)


def _coarser_than(dtype: torch.dtype | None, t: torch.Tensor) -> bool:
    """Whether holding ``t`` in ``dtype`` rounds it (the reference computes in ``t.dtype``)."""
    return dtype is not None and coarser_than(dtype, t.dtype)


def _roundable(t: object) -> bool:
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
            and t.device.type == "cpu" and t.numel() > 0
            and (t.dtype in (torch.float32, torch.float64)
                 or t.dtype in (torch.complex64, torch.complex128)))


def spread(reference: object, drawn: object) -> tuple[float, float]:
    """The greatest and the RMS change of one leaf (a tensor or a number) in a draw; inf when
    the draw made it non-finite where the reference is finite (or the reverse)."""
    if isinstance(reference, torch.Tensor) and isinstance(drawn, torch.Tensor):
        if reference.shape != drawn.shape:
            return math.inf, math.inf
        if reference.numel() == 0:
            return 0.0, 0.0
        r, d = _wide(reference), _wide(drawn)
        both = torch.isfinite(r) & torch.isfinite(d)
        if not bool((both | (r == d)).all()):
            return math.inf, math.inf
        moved = torch.where(both, (d - r).abs(), 0)
        return float(moved.amax()), float(moved.square().mean().sqrt())
    if isinstance(reference, (int, float, complex)) and isinstance(drawn, (int, float, complex)):
        if reference == drawn:
            return 0.0, 0.0
        change = float(abs(drawn - reference))
        return (change, change) if math.isfinite(change) else (math.inf, math.inf)
    return math.inf, math.inf


def element_spread(reference: torch.Tensor, drawn: object) -> torch.Tensor:
    """How far each element of one leaf moved in a draw (float64, the leaf's shape): 0 where
    either side is not finite (a draw that made a finite value non-finite has no budget at
    all: ``spread`` says inf)."""
    if not isinstance(drawn, torch.Tensor) or drawn.shape != reference.shape:
        return torch.zeros(reference.shape, dtype=torch.float64)
    r, d = _wide(reference), _wide(drawn)
    both = torch.isfinite(r) & torch.isfinite(d)
    return torch.where(both, (d - r).abs(), 0).to(torch.float64)


def _wide(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64)


@dataclass(frozen=True)
class Budget:
    """What one rounding of every value at ``precision`` moves one leaf of the reference: its
    greatest and its RMS change over the draws (its spread)."""

    greatest: float
    rms: float
    precision: torch.dtype
    # The greatest change of each element over the draws (the leaf's shape), when known:
    # the budget is then given element by element (``allowance``).
    elements: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def multiplier(self) -> float:
        return MULTIPLIER.get(self.precision.to_real(), MULTIPLIER[torch.float32])

    @property
    def rule(self) -> float:
        """The detectability rule at this precision, in units of roundoff (``RULES``)."""
        return RULES.get(self.precision.to_real(), RULE)

    def rms_multiplier(self, expected: object) -> float:
        """The least multiple of the RMS spread the leaf's RMS error is held to: ``RMS_SHARE``
        of the multiplier for a leaf of ``RMS_ELEMENTS`` or more whose budget is smaller than
        it (over all but its largest errors: ``rms_checks``), else the multiplier."""
        e = _as_tensor(expected)
        if e is None or e.numel() < RMS_ELEMENTS:
            return self.multiplier
        if self.multiplier * self.rms >= rms_size(e):
            return self.multiplier
        return self.multiplier * RMS_SHARE

    def rms_checks(self, actual: object, expected: object) -> list[RmsCheck]:
        """The leaf's RMS error against what its budget allows: over every element at the
        multiplier, and over all but its largest errors at ``rms_multiplier`` where that is
        smaller; empty when the leaf cannot be judged so (no finite spread, another shape)."""
        a, e = _as_tensor(actual), _as_tensor(expected)
        if a is None or e is None or a.shape != e.shape or e.numel() == 0:
            return []
        if not math.isfinite(self.rms):
            return []
        u = unit_roundoff(self.precision)
        _, error = _errors(a, e)
        checks = [RmsCheck(error, self.multiplier * self.rms + u * rms_size(e),
                           self.multiplier, 0)]
        share = self.rms_multiplier(e)
        if share >= self.multiplier or not math.isfinite(error):
            return checks
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)
        both = torch.isfinite(flat_a) & torch.isfinite(flat_e)
        errors = torch.where(both, (flat_a - flat_e).abs(), 0)
        left_out = errors.numel() // SHARED_SHARE
        kept = torch.argsort(errors)[:errors.numel() - left_out]
        rms = self.rms
        if self.elements is not None and self.elements.numel() == errors.numel():
            spreads = self.elements.reshape(-1).to(torch.float64)
            whole = float(spreads.square().mean().sqrt())
            if whole > 0:  # the RMS spread of the kept elements, as a share of the whole's
                rms *= float(spreads[kept].square().mean().sqrt()) / whole
        checks.append(RmsCheck(float(errors[kept].square().mean().sqrt()),
                               share * rms + u * rms_size(flat_e[kept]), share, left_out))
        return checks

    def tolerance(self, default: Tolerance) -> Tolerance | None:
        """The leaf's tolerance under its budget: the default's rtol, and an atol widened to
        ``multiplier`` times the greatest spread; None when the spread is not finite (the
        reference is not stable under one rounding: nothing to judge by)."""
        if not math.isfinite(self.greatest):
            return None
        atol = self.multiplier * self.greatest
        name = str(self.precision).removeprefix("torch.")
        how = ("atol widened to" if atol > default.atol else "atol kept: above")
        source = (f"{default.source or 'defaults'}; {how} the rounding budget "
                  f"{self.multiplier:g} x {self.greatest:.4g}, the greatest change of the "
                  f"reference when every input and every operation's result is rounded once "
                  f"to {name}")
        return Tolerance(rtol=default.rtol, atol=max(atol, default.atol), ulps=default.ulps,
                         source=source)

    def allowance(self, expected: torch.Tensor) -> torch.Tensor | None:
        """The absolute error each element of the leaf may have (``multiplier`` times a
        spread), flat, in float64; None when no element spreads are known.

        An element is allowed the greatest change, over the draws, of the elements of the
        leaf no larger than ``WINDOW`` times its own size (itself included; the smallest
        ``SHARED`` of the leaf share theirs): one large element (``exp`` of 9 beside ``exp``
        of -1) widens the allowance of no smaller one, while an element whose own two draws
        happened to land near zero borrows the spread of its peers, which rounding moves
        alike (a cancellation's absolute error, shared by every smaller element too)."""
        if (self.elements is None or self.elements.shape != expected.shape
                or expected.numel() > ELEMENT_BUDGETS_UP_TO):
            return None
        spread_of = self.elements.reshape(-1).to(torch.float64)
        size = _wide(expected).abs().reshape(-1)
        size = torch.where(torch.isfinite(size), size, math.inf)
        n = size.numel()
        if n == 0:
            return spread_of
        order = torch.argsort(size)
        ranked = size[order]
        running = torch.cummax(spread_of[order], 0).values
        reach = torch.searchsorted(ranked, size * WINDOW, right=True) - 1
        shared = min(n, max(SHARED, n // SHARED_SHARE))
        reach = reach.clamp(min=shared - 1, max=n - 1)
        return self.multiplier * running[reach]

    def rule_units(self, expected: object) -> float | None:
        """The constant relative error this budget lets through by the RMS rule, in units of
        roundoff of the output's RMS size (``1 + multiplier x RMS spread / (u x size)``);
        None for an output of size 0 or an unknown spread."""
        e = _as_tensor(expected)
        if e is None or e.numel() == 0 or not math.isfinite(self.rms):
            return None
        size = rms_size(e)
        if size == 0:
            return None
        return 1 + self.rms_multiplier(e) * self.rms / (unit_roundoff(self.precision) * size)

    def rms_problem(self, actual: object, expected: object, broad_only: bool = False,
                    checks: list[RmsCheck] | None = None) -> str | None:
        """Why the leaf's RMS error is past what its budget allows (``rms_checks``, or
        ``checks`` made already), or None: a formula wrong everywhere by a little less than
        the greatest spread is still far past the typical one. ``broad_only``: only the test
        that leaves the largest errors out counts (where some elements are past their own
        allowance, the RMS over all of them says nothing more)."""
        if checks is None:
            checks = self.rms_checks(actual, expected)
        failing = [check for check in checks
                   if check.error > check.allowed and (check.left_out or not broad_only)]
        if not failing:
            return None
        check = failing[0]
        name = str(self.precision).removeprefix("torch.")
        over = (f" over all but its {check.left_out} largest errors" if check.left_out
                else "")
        return (f"its RMS error{over} {_num(check.error)} is past {_num(check.allowed)}: "
                f"{check.multiplier:g} x its RMS change when every value of the reference is "
                f"rounded once to {name}, plus one rounding of the output's RMS size; wrong "
                "by a little everywhere is not rounding")


@dataclass(frozen=True)
class RmsCheck:
    """One RMS test of a leaf: its RMS ``error`` (over all but its ``left_out`` largest
    errors) against the ``allowed`` RMS error, ``multiplier`` times its RMS spread plus one
    rounding of its RMS size."""

    error: float
    allowed: float
    multiplier: float
    left_out: int

    @property
    def ratio(self) -> float | None:
        """``error / allowed``: above 1 fails."""
        if self.allowed > 0:
            return self.error / self.allowed
        return 0.0 if self.error == 0 else None


def baseline_problem(actual: object, expected: object, baseline: object,
                     precision: torch.dtype, device: str = "the device") -> str | None:
    """Why a device run's leaf is markedly worse than the CPU's own run in the same dtype
    (both against the float64 reference), or None when it is not.

    It fails when its greatest or its RMS error exceeds ``BASELINE_MULTIPLE`` times the
    baseline's plus one unit in the last place of the output's greatest (or RMS) size in
    ``precision``: a floor, so that a baseline that happens to be exact does not fail a
    result one rounding off. A baseline that is not finite where the reference is holds
    the run to nothing here.
    """
    a, e, b = _as_tensor(actual), _as_tensor(expected), _as_tensor(baseline)
    if a is None or e is None or b is None or not (a.shape == e.shape == b.shape):
        return None
    if e.numel() == 0:
        return None
    run_max, run_rms = _errors(a, e)
    base_max, base_rms = _errors(b, e)
    if not (math.isfinite(base_max) and math.isfinite(run_max)):
        return None
    eps = float(torch.finfo(precision.to_real()).eps)
    size = e.abs()
    finite = torch.isfinite(size)
    size = torch.where(finite, size, 0)
    floor_max = eps * float(size.amax())
    floor_rms = eps * float(size.square().mean().sqrt())
    allowed_max = BASELINE_MULTIPLE * base_max + floor_max
    allowed_rms = BASELINE_MULTIPLE * base_rms + floor_rms
    if run_max <= allowed_max and run_rms <= allowed_rms:
        return None
    name = str(precision).removeprefix("torch.")
    which = "greatest" if run_max > allowed_max else "RMS"
    ratio = (run_max / base_max if which == "greatest" else run_rms / base_rms) if (
        base_max if which == "greatest" else base_rms) else math.inf
    times = f"{ratio:.3g} times" if math.isfinite(ratio) else "infinitely"
    return (f"{device}'s {which} error against the float64 reference is {times} the CPU's own "
            f"in {name} (greatest {_num(run_max)} against {_num(base_max)}, RMS "
            f"{_num(run_rms)} against {_num(base_rms)}); at most {BASELINE_MULTIPLE:g} times, "
            "plus one unit in the last place of the output's size, is allowed")


def _as_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return _wide(value)
    if isinstance(value, (int, float, complex)) and not isinstance(value, bool):
        return torch.tensor(value, dtype=torch.complex128 if isinstance(value, complex)
                            else torch.float64)
    return None


def rms_size(e: torch.Tensor) -> float:
    """The RMS size of a leaf's finite values."""
    if e.numel() == 0:
        return 0.0
    return float(torch.where(torch.isfinite(e), e.abs(), 0).square().mean().sqrt())


def _errors(value: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    diff = (value - expected).abs()
    both = torch.isfinite(value) & torch.isfinite(expected)
    if not bool((both | (value == expected)).all()):
        return math.inf, math.inf
    diff = torch.where(both, diff, 0)
    return float(diff.amax()), float(diff.square().mean().sqrt())


def _num(x: float) -> str:
    return f"{x:.4g}"


def draw_seeds(draws: int = DRAWS) -> list[int]:
    """The seeds of a rounding budget's draws: fixed, so that a budget is the same each time."""
    return [_SEED + draw for draw in range(draws)]

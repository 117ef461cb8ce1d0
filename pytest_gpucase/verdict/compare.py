"""Nested output comparison with per-dtype tolerances and a mismatch report.

The comparison walks actual and expected outputs together (tensors, Python
numbers, None, strings, sequences, mappings), checks structure and tensor
attributes before values, and collects every mismatch with its path.

What counts as close (the tolerances and the rule that applies them) is
``tolerance``'s; the words of a mismatch are ``messages``'s. Tensor values are
judged by ``_kernel``, which only makes that fast: the walk asks it through a
few names and reads its tally (``stats``). Objects other than dicts, lists and
tuples are walked by the parts ``structure`` finds in them.

The run's precision (``precision``): every floating value, a Python number
included, is held at least to the tolerance of the precision the run computed in,
so that ``loss.item()`` of a bfloat16 run and a float32 logit of a bfloat16
autocast run are judged as bfloat16, not as float64 or float32. A leaf that fails
its default tolerance gets a second look (``second_look``, ``rounding``): the
rounding budget of its computation, and on a device the CPU's own error in the same
dtype. An explicit tolerance for the leaf's dtype (or for the run's precision, when
coarser) is applied as given, with no second look.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pytest_gpucase.base.tensors import field_names, tuple_fields
from pytest_gpucase.case.model import CASE_MODULE_PREFIX
from pytest_gpucase.verdict import _kernel, structure
from pytest_gpucase.verdict._small import clean_small
from pytest_gpucase.verdict.messages import (Mismatch, num, scalar_message, values_mismatch,
                                             with_note, wrong_everywhere)
from pytest_gpucase.verdict.allowance import (
    budget_notes,
    budget_record,
    element_tally,
    least_step,
    unclean,
    unclean_message,
)
from pytest_gpucase.verdict.rounding import (
    CLEAN,
    Needed,
    Budget,
    SecondLook,
    baseline_problem,
    coarser,
    unit_roundoff,
)
from pytest_gpucase.verdict.stats import NonFinite, TensorStats
from pytest_gpucase.verdict.tolerance import (
    DEFAULT_TOLERANCES,
    EXACT,
    Tolerance,
    nan_max,
    relative,
    scalar_close,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "Comparison",
    "Mismatch",
    "Tolerance",
    "combine",
    "compare",
]


@dataclass(frozen=True)
class Comparison:
    """Every mismatch between two outputs, and how far apart their values were."""

    mismatches: tuple[Mismatch, ...]
    # Greatest absolute and relative difference over all compared tensors and
    # numbers, passing or not (for JSON results); None when nothing numeric.
    # Matching specials (inf == inf, NaN with equal_nan) count as 0; a NaN
    # difference anywhere makes these NaN, as the failure text says.
    max_abs: float | None
    max_rel: float | None
    # What a pass says little about: a leaf that passed within a rounding budget as large as
    # its own size (shown with the item, on a pass too).
    notes: tuple[str, ...] = ()
    # Each leaf judged by its rounding budget (``budget_record``): so that a report can tell
    # a clean pass from one that rests on a wide budget.
    budgets: tuple[dict[str, object], ...] = field(default=(), repr=False)
    # The leaves whose budget or baseline the second look had not computed (``NEEDED``):
    # their verdicts here are provisional, until the caller computes them and compares again.
    pending: tuple[str, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        """Whether the outputs matched everywhere."""
        return not self.mismatches

    def headline(self) -> str:
        """The first mismatch in one line, for a failure's summary line (``-r``, a CI log,
        junit's message): where, and how many elements by how much; the count of the rest."""
        if not self.mismatches:
            return "nothing differs"
        first = self.mismatches[0]
        if first.summary is not None:
            line = f"{first.path}: {first.summary}"
        elif first.kind == "values" and first.total > 1:
            line = f"{first.path}: {first.mismatched} / {first.total} elements differ"
            if first.max_abs is not None:
                line += f", greatest absolute difference {num(first.max_abs)}"
        else:
            line = first.message.split("\n", 1)[0]
        more = len(self.mismatches) - 1
        if more:
            line += f"; {more} more path{'s' if more > 1 else ''} differ{'' if more > 1 else 's'}"
        return line

    def where(self) -> str:
        """Where the first mismatch is and of what kind (``out['loss']: values differ``):
        what stays the same when the same bug is met on other inputs (``verdict.failure``),
        where the counts and differences of ``headline`` change."""
        if not self.mismatches:
            return "nothing differs"
        first = self.mismatches[0]
        return f"{first.path}: {first.kind} differ"

    def report(self) -> str:
        """Return all mismatch messages, top-down, ready for a pytest failure; with more
        than a few, a first line says how many (a long report is clipped in the middle)."""
        lines = [m.message for m in self.mismatches]
        if len(lines) > _COUNTED_FROM:
            lines.insert(0, f"{len(lines)} paths of the output differ:")
        return "\n".join(lines)


def combine(parts: Iterable[Comparison]) -> Comparison:
    """One Comparison of several, in order; a NaN greatest difference stays NaN."""
    parts = list(parts)
    if len(parts) == 1:  # most outputs: one leaf, the same comparison (none of the below)
        return parts[0]
    return Comparison(
        mismatches=tuple(m for p in parts for m in p.mismatches),
        max_abs=_greatest(p.max_abs for p in parts),
        max_rel=_greatest(p.max_rel for p in parts),
        notes=tuple(note for p in parts for note in p.notes),
        budgets=tuple(found for p in parts for found in p.budgets),
        pending=tuple(path for p in parts for path in p.pending),
    )


def _greatest(values: Iterable[float | None]) -> float | None:
    result: float | None = None
    for value in values:
        if value is not None:
            result = value if result is None else nan_max(result, value)
    return result


def compare(
    actual: object,
    expected: object,
    *,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
    equal_nan: bool = False,
    check_dtype: bool = True,
    path: str = "out",
    worst: int = 5,
    precision: torch.dtype | None = None,
    second_look: SecondLook | None = None,
    device: str = "cpu",
) -> Comparison:
    """Compare a nested output against the expected one and collect every mismatch.

    ``tolerances`` are the explicit ones (``case.toml``); the rest come from the default
    table. ``precision``: the dtype the run computed in, the least any floating value is
    held to. ``second_look``: asked for a leaf that fails a default tolerance (the
    rounding budget; ``device``'s run against the CPU's own in the same dtype).
    """
    if worst < 0:
        raise ValueError(f"worst must be >= 0, got {worst}")
    table = {**DEFAULT_TOLERANCES, **tolerances} if tolerances else DEFAULT_TOLERANCES
    explicit = frozenset(tolerances or ())
    # Shared with the walk: a screen that cannot clear a single pair is not computed twice.
    scratch = None
    try:
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            tol = _tolerance_for(table, explicit, actual.dtype, precision)
            held = coarser(actual.dtype, precision)
            looks = (second_look is not None
                     and (actual.dtype.is_floating_point or actual.dtype.is_complex)
                     and actual.dtype not in explicit and held not in explicit)
            # A small clean pair in a few Python floats (no torch op), else torch's screens.
            close = clean_small(actual, expected, tol, check_dtype, held if looks else None)
            if close is None and _kernel.equal_tensors(actual, expected):
                close = (0.0, 0.0)
            elif close is None:
                scratch = _kernel.Scratch()
                close = _kernel.small_close(actual, expected, tol, check_dtype, scratch)
                if close is not None and looks and unclean(actual, expected, held):
                    close = None
            if close is not None:
                return Comparison((), *close)
    except _TORCH_REFUSALS:
        pass  # a dtype or layout torch cannot compare: the walk says so at its path
    walk = _Walk(
        tolerances=table,
        equal_nan=equal_nan,
        check_dtype=check_dtype,
        worst=worst,
        explicit=explicit,
        precision=precision,
        second_look=second_look,
        device=device,
        scratch=_kernel.Scratch() if scratch is None else scratch,
    )
    # Outputs may carry autograd history; out= kernels refuse such inputs.
    with torch.no_grad():
        walk.value(actual, expected, path)
        walk.flush()
    mismatches = tuple(
        item if isinstance(item, Mismatch) else item.mismatch
        for item in walk.items
        if isinstance(item, Mismatch) or item.mismatch is not None
    )
    return Comparison(mismatches, walk.max_abs, walk.max_rel,  # type: ignore[arg-type]
                      tuple(walk.notes), tuple(walk.budgets), tuple(walk.pending))


# Beyond this many mismatching paths, a report starts with their count.
_COUNTED_FROM = 10


def _tolerance_for(table: Mapping[torch.dtype, Tolerance], explicit: frozenset[torch.dtype],
                   dtype: torch.dtype, precision: torch.dtype | None) -> Tolerance:
    """The tolerance of a value of ``dtype`` in a run computed in ``precision``: an explicit
    one for its dtype as given; else that of the coarser of the two dtypes (explicit for the
    precision, or its defaults, saying so)."""
    if dtype in explicit or precision is None or not (dtype.is_floating_point
                                                       or dtype.is_complex):
        return table.get(dtype, EXACT)
    held = coarser(dtype, precision)
    if held.to_real() == dtype.to_real():
        return table.get(dtype, EXACT)
    found = table.get(held, EXACT)
    if held in explicit:
        return found
    name = str(held).removeprefix("torch.")
    return Tolerance(rtol=found.rtol, atol=found.atol, ulps=found.ulps,
                     source=f"{name} defaults: the run's precision")


# --------------------------------------------------------------------------
# Walking nested values


@dataclass
class _Leaf:
    """A small tensor pair waiting for its batch; its mismatch, once known."""

    path: str
    actual: torch.Tensor
    expected: torch.Tensor
    tol: Tolerance
    mismatch: Mismatch | None = None


@dataclass
class _Walk:
    """The state of one compare() call."""

    tolerances: Mapping[torch.dtype, Tolerance]
    equal_nan: bool
    check_dtype: bool
    worst: int
    explicit: frozenset[torch.dtype] = frozenset()
    precision: torch.dtype | None = None
    second_look: SecondLook | None = None
    device: str = "cpu"
    # Mismatches in walk order, with the batched leaves in their places.
    items: list[Mismatch | _Leaf] = field(default_factory=list)
    max_abs: float | None = None
    max_rel: float | None = None
    scratch: _kernel.Scratch = field(default_factory=_kernel.Scratch)
    inside: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    budgets: list[dict[str, object]] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    batches: dict[tuple[object, ...], list[_Leaf]] = field(default_factory=dict)
    batched: dict[tuple[object, ...], int] = field(default_factory=dict)

    def fail(self, path: str, kind: str, message: str) -> None:
        self.items.append(Mismatch(path, kind, f"{path}: {message}"))

    def note(self, max_abs: float, max_rel: float) -> None:
        self.max_abs = max_abs if self.max_abs is None else nan_max(self.max_abs, max_abs)
        self.max_rel = max_rel if self.max_rel is None else nan_max(self.max_rel, max_rel)

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return _tolerance_for(self.tolerances, self.explicit, dtype, self.precision)

    def looks_again(self, dtype: torch.dtype) -> bool:
        """Whether a leaf of ``dtype`` that fails gets a second look: a floating one whose
        tolerance is a default, not one the case states."""
        if self.second_look is None or not (dtype.is_floating_point or dtype.is_complex):
            return False
        return dtype not in self.explicit and coarser(dtype, self.precision) not in self.explicit

    def value(self, actual: object, expected: object, path: str) -> None:
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            self.tensor_pair(actual, expected, path)
        elif isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
            self.type_differs(actual, expected, path)
        elif actual is None or expected is None:
            if actual is not expected:
                self.type_differs(actual, expected, path)
        elif _is_number(actual) or _is_number(expected):
            self.number(actual, expected, path)
        elif isinstance(actual, (str, bytes)) or isinstance(expected, (str, bytes)):
            if type(actual) is not type(expected):
                self.type_differs(actual, expected, path)
            elif actual != expected:
                self.fail(path, "values",
                          f"values differ: actual {actual!r} vs expected {expected!r}")
        elif isinstance(actual, Mapping) and isinstance(expected, Mapping):
            self.mapping(actual, expected, path)
        elif isinstance(actual, Sequence) and isinstance(expected, Sequence):
            self.sequence(actual, expected, path)
        else:
            self.other(actual, expected, path)

    def tensor_pair(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        """Two tensors: nested ones as lists of tensors, others by ``tensor`` (or refused)."""
        if actual.is_nested or expected.is_nested:
            # A nested tensor is a list of tensors of different lengths: compared as one.
            if actual.is_nested and expected.is_nested:
                self.sequence(actual.unbind(), expected.unbind(), path)
            else:
                self.fail(path, "type", "type differs: actual "
                          f"{'nested ' if actual.is_nested else ''}Tensor vs expected "
                          f"{'nested ' if expected.is_nested else ''}Tensor")
            return
        try:
            self.tensor(actual, expected, path)
        except _TORCH_REFUSALS as exc:
            self.fail(path, "type", _refusal(actual, expected, exc))

    def type_differs(self, actual: object, expected: object, path: str) -> None:
        self.fail(path, "type",
                  f"type differs: actual {_type_name(actual)} vs expected {_type_name(expected)}")

    def mapping(
        self, actual: Mapping[object, object], expected: Mapping[object, object], path: str
    ) -> None:
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append("missing " + ", ".join(repr(k) for k in missing))
            if extra:
                parts.append("extra " + ", ".join(repr(k) for k in extra))
            self.fail(path, "structure", "keys differ: " + "; ".join(parts))
            return
        for key in expected:
            self.value(actual[key], expected[key], f"{path}[{key!r}]")

    def sequence(self, actual: Sequence[object], expected: Sequence[object], path: str) -> None:
        # list and tuple are interchangeable (as in torch.testing); a named
        # tuple is a declared type, and its fields name the paths.
        fields = tuple_fields(expected)
        if (fields is not None or tuple_fields(actual) is not None) and not _same_type(
                actual, expected):
            self.type_differs(actual, expected, path)
            return
        if len(actual) != len(expected):
            self.fail(path, "structure",
                      f"length differs: actual {len(actual)} vs expected {len(expected)}")
            return
        # A torch.return_types structseq (torch.max(x, dim=0)) names its items too, though
        # it is compared as a plain tuple: a golden stores it as one.
        names = fields or field_names(expected) or field_names(actual)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            sub = f"{path}.{names[i]}" if names is not None else f"{path}[{i}]"
            self.value(a, e, sub)

    def other(self, actual: object, expected: object, path: str) -> None:
        if not _same_type(actual, expected):
            self.type_differs(actual, expected, path)
            return
        if isinstance(actual, torch.device):
            return  # the reference runs on the CPU by design: where a value lives is no value
        if isinstance(actual, torch.dtype):
            assert isinstance(expected, torch.dtype)
            if actual != expected and (self.check_dtype
                                       or _dtype_kind(actual) != _dtype_kind(expected)):
                self.fail(path, "dtype", f"values differ: actual {actual} vs expected {expected}")
            return
        if isinstance(actual, torch.nn.Module):
            self.fail(path, "type", f"cannot compare values of type {_type_name(actual)} (a "
                      f"module): return its outputs or its state_dict(); {_BY_VALUE}")
            return
        if id(actual) in self.inside:
            return  # an object met again inside itself (a back reference): compared once
        found = structure.parts(actual)
        if found is not None:
            self.parts(actual, expected, path, found)
            return
        try:
            equal = bool(actual == expected)
        except Exception as exc:  # an elementwise ==, or a user's __eq__ that fails
            self.fail(path, "type", f"cannot compare values of type {_type_name(actual)}: "
                      f"{type(exc).__name__}: {exc}; {_BY_VALUE}")
            return
        if equal:
            return
        shown_a, shown_e = _safe_repr(actual), _safe_repr(expected)
        note = ""
        if type(actual).__eq__ is object.__eq__ and " at 0x" in shown_a:
            # Only the same object is equal: right for an enum member or a dtype (which
            # say who they are), never for a generator or a plain object (shown by address).
            note = (f" (type {_type_name(actual)} defines no ==, so only the same object is "
                    f"equal, and holds no tensor to compare by; {_BY_VALUE})")
        self.fail(path, "values", f"values differ: actual {shown_a} vs expected {shown_e}{note}")

    def parts(self, actual: object, expected: object, path: str,
              found: list[tuple[str, object]]) -> None:
        """An object made of parts (``found``): compared part by part, if they are the same."""
        # Field by field, with tolerances: a dataclass's own == compares tensors exactly,
        # and a cache object (transformers' DynamicCache) has none at all.
        theirs = structure.parts(expected) or []
        names, their_names = [k for k, _ in found], [k for k, _ in theirs]
        if names != their_names:
            missing = [k for k in their_names if k not in names]
            extra = [k for k in names if k not in their_names]
            self.fail(path, "structure", f"parts of {_type_name(actual)} differ: "
                      + "; ".join(part for part in (
                          f"missing {', '.join(missing)}" if missing else "",
                          f"extra {', '.join(extra)}" if extra else "",
                          "in another order" if not (missing or extra) else "") if part))
            return
        self.inside.add(id(actual))
        try:
            for (suffix, a), (_, e) in zip(found, theirs, strict=True):
                self.value(a, e, path + suffix)
        finally:
            self.inside.discard(id(actual))

    # -- Python numbers ------------------------------------------------------

    def number(self, actual: object, expected: object, path: str) -> None:
        kind_a, kind_e = _number_kind(actual), _number_kind(expected)
        if kind_a is None or kind_a != kind_e:
            self.type_differs(actual, expected, path)
            return
        if kind_a in ("bool", "int"):
            assert isinstance(actual, int) and isinstance(expected, int)
            self.integer(actual, expected, path, kind_a == "int")
            return
        assert isinstance(actual, (float, complex)) and isinstance(expected, (float, complex))
        dtype = torch.float64 if kind_a == "float" else torch.complex128
        tol = self.tolerance(dtype)
        try:
            abs(actual), abs(expected), abs(actual - expected)
        except OverflowError:  # complex(1.5e308, 1.5e308): a modulus beyond a float's range
            if actual != expected:
                self.fail(path, "values", f"values differ: actual {actual!r} vs expected "
                          f"{expected!r} (a modulus beyond a float's range: not measured)")
            return
        diff = abs(actual - expected)
        verdict = scalar_close(actual, expected, diff, tol, self.equal_nan, dtype)
        # Matching specials count as no difference; a NaN or inf mismatch as itself.
        effective = 0.0 if verdict and not math.isfinite(diff) else diff
        self.note(effective, relative(effective, abs(expected)))
        held = coarser(dtype, self.precision)
        rough = (verdict and self.looks_again(dtype) and math.isfinite(diff)
                   and diff > CLEAN * unit_roundoff(held) * abs(expected)
                   + least_step(dtype, self.precision))
        if not verdict or rough:
            self.number_failed(path, actual, expected, diff, tol, dtype, held, rough)

    def number_failed(self, path: str, actual: complex, expected: complex, diff: float,
                      tol: Tolerance, dtype: torch.dtype, held: torch.dtype, rough: bool) -> None:
        """A float past its tolerance (or ``rough``): recorded, unless a second look clears it."""
        if rough:
            message = unclean_message(path, diff, abs(expected), held)
        else:
            message = scalar_message(path, actual, expected, dtype, dtype, tol, self.equal_nan,
                                     exact=False)
        mismatch: Mismatch | None = Mismatch(path, "values", message, 1, 1, diff,
                                             relative(diff, abs(expected)))
        if self.looks_again(dtype) and math.isfinite(diff) and mismatch is not None:
            mismatch = self.number_again(path, actual, expected, diff, tol, dtype, mismatch, rough)
        if mismatch is not None:
            self.items.append(mismatch)

    def integer(self, actual: int, expected: int, path: str, counted: bool) -> None:
        """Two ints (or bools, not ``counted`` in the greatest differences): equal or not."""
        gap = _as_float(abs(actual - expected))
        rel = relative(gap, _as_float(abs(expected)))
        if counted:
            self.note(gap, rel)
        if actual != expected:
            message = f"{path}: values differ: actual {actual!r} vs expected {expected!r}"
            self.items.append(Mismatch(path, "values", message, 1, 1, gap, rel))

    def number_again(self, path: str, actual: complex, expected: complex, diff: float,
                     tol: Tolerance, dtype: torch.dtype, mismatch: Mismatch,
                     unclean_only: bool = False) -> Mismatch | None:
        """A Python number past its default tolerance (or within it, but past ``CLEAN``
        roundings of its size: ``unclean_only``), judged as a tensor leaf is."""
        assert self.second_look is not None
        budget = self.second_look.budget(path)
        if isinstance(budget, Needed):
            self.pending.append(path)
            return mismatch  # provisional: compared again once the budget is known
        widened = budget.tolerance(tol) if budget is not None else None
        if widened is None or budget is None:
            return None if unclean_only else mismatch
        # One element: its budget is its own spread, with the default atol as a floor no
        # larger than CLEAN roundings of its size.
        floor = max(min(tol.atol, CLEAN * unit_roundoff(budget.precision) * abs(expected)),
                    least_step(dtype, budget.precision))
        # The budget or the default tolerance, whichever is larger (never their sum).
        widened = dataclasses.replace(widened, rtol=0.0, atol=max(
            budget.multiplier * budget.greatest, floor, tol.atol + tol.rtol * abs(expected)))
        within = scalar_close(actual, expected, diff, widened, self.equal_nan, dtype)
        checks = budget.rms_checks(actual, expected)  # for the record and the RMS rule
        self.budgets.append(budget_record(path, actual, expected, budget, checks))
        if within and (problem := budget.rms_problem(actual, expected,
                                                     checks=checks)) is not None:
            return with_note(mismatch, f"within its rounding budget, but {problem}")
        if not within:
            message = scalar_message(path, actual, expected, dtype, dtype, widened,
                                     self.equal_nan, exact=False)
            mismatch = dataclasses.replace(mismatch, message=message)
        return self.against_baseline(path, actual, expected, widened, within,
                                     lambda: mismatch)

    # -- tensors -------------------------------------------------------------

    def tensor(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        # Each attribute read once: this runs per tensor of a nested output, thousands
        # of times for a model's state, where each read of a tensor attribute counts.
        shape, a_dtype, e_dtype = actual.shape, actual.dtype, expected.dtype
        if shape != expected.shape:
            self.fail(path, "shape",
                      f"shape differs: actual {tuple(shape)} vs expected {tuple(expected.shape)}")
            return
        if a_dtype != e_dtype and self.check_dtype:
            self.fail(path, "dtype", f"dtype differs: actual {a_dtype} vs expected {e_dtype}")
            return
        if a_dtype != e_dtype and {a_dtype, e_dtype} & _WIDENED_UNSIGNED and {
                a_dtype, e_dtype} <= _WIDENED_INTEGERS:
            # torch promotes no uint16/uint32 with another integer; int64 holds both exactly.
            actual, expected = actual.to(torch.int64), expected.to(torch.int64)
            a_dtype = e_dtype = torch.int64
        if a_dtype == torch.complex32 or e_dtype == torch.complex32:
            # Few CPU ops take complex32; complex64 holds its values exactly.
            actual = actual.to(torch.complex64) if a_dtype == torch.complex32 else actual
            expected = expected.to(torch.complex64) if e_dtype == torch.complex32 else expected
            a_dtype, e_dtype = actual.dtype, expected.dtype
        if actual.is_quantized or expected.is_quantized:
            # A quantized tensor's values are its codes times its scale: compared as such.
            actual = actual.dequantize() if actual.is_quantized else actual
            expected = expected.dequantize() if expected.is_quantized else expected
            a_dtype, e_dtype = actual.dtype, expected.dtype
        if a_dtype != e_dtype:
            kind_a, kind_e = _dtype_kind(a_dtype), _dtype_kind(e_dtype)
            if kind_a != kind_e:
                self.fail(path, "dtype", f"dtype kind differs: actual {a_dtype} ({kind_a}) "
                          f"vs expected {e_dtype} ({kind_e})")
                return
        self.tensor_values(actual, expected, a_dtype, e_dtype, path)

    def tensor_values(self, actual: torch.Tensor, expected: torch.Tensor, a_dtype: torch.dtype,
                      e_dtype: torch.dtype, path: str) -> None:
        """A pair of one shape and dtype kind: its storage checked, its values compared."""
        if actual.is_meta or expected.is_meta:
            side = "actual" if actual.is_meta else "expected"
            self.fail(path, "device", f"{side} is a meta tensor: it holds no values to compare")
            return
        layout = actual.layout
        if layout != expected.layout:
            self.fail(path, "type",
                      f"layout differs: actual {layout} vs expected {expected.layout}")
            return
        if layout != torch.strided:
            if actual.numel() > _DENSE_ELEMENTS:
                self.sparse(actual, expected, path)
                return
            # A sparse output of moderate size: its dense form is compared.
            actual, expected = actual.to_dense(), expected.to_dense()
        floating = a_dtype.is_floating_point or a_dtype.is_complex
        tol = self.tolerance(a_dtype) if floating else EXACT
        numel = actual.numel()
        if numel <= _kernel.SMALL_ELEMENTS:
            leaf = _Leaf(path, actual, expected, tol)
            self.items.append(leaf)
            key = (a_dtype, e_dtype, actual.device, expected.device)
            batch = self.batches.get(key)
            if batch is None:
                batch = self.batches[key] = []
            batch.append(leaf)
            size = self.batched.get(key, 0) + numel
            self.batched[key] = size
            if size >= _kernel.BATCH_ELEMENTS:
                self.flush_batch(key)
            return
        self.leaf(_Leaf(path, actual, expected, tol), record=True)

    def sparse(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        """A sparse pair too large to make dense (a graph's adjacency matrix): the stored
        positions must agree, then their values are compared with the tolerances."""
        a = (actual if actual.layout == torch.sparse_coo else actual.to_sparse()).coalesce()
        e = (expected if expected.layout == torch.sparse_coo else expected.to_sparse()).coalesce()
        if not torch.equal(a.indices(), e.indices()):
            self.fail(path, "structure", f"sparsity differs: actual stores {a._nnz()} "
                      f"positions, expected {e._nnz()}, not the same ones (a tensor of "
                      f"{actual.numel()} elements is too large to compare densely)")
            return
        self.value(a.values(), e.values(), f"{path}.values()")

    def leaf(self, leaf: _Leaf, record: bool = False) -> None:
        """Compare one tensor pair on its own; record its mismatch (in place or appended)."""
        try:
            stats = _kernel.compare_values(
                leaf.actual, leaf.expected, leaf.tol, self.equal_nan, max(self.worst, 1),
                self.scratch,
            )
        except _TORCH_REFUSALS as exc:
            message = _refusal(leaf.actual, leaf.expected, exc)
            leaf.mismatch = Mismatch(leaf.path, "type", f"{leaf.path}: {message}")
            if record:
                self.items.append(leaf.mismatch)
            return
        if stats.compared:
            self.note(stats.max_abs, stats.max_rel)
        if stats.mismatched:
            def worded() -> Mismatch:
                return values_mismatch(leaf.path, leaf.actual, leaf.expected, leaf.tol, stats,
                                       self.worst, self.equal_nan)

            if self.looks_again(leaf.actual.dtype) and not _nonfinite(stats.nonfinite):
                # Worded only if the second look does not clear the leaf: a leaf it clears
                # (low precision within its budget, every run of it) needs no message.
                leaf.mismatch = self.look_again(leaf, functools.cache(worded))
            else:
                leaf.mismatch = worded()
            if record and leaf.mismatch is not None:
                self.items.append(leaf.mismatch)
        elif self.looks_again(leaf.actual.dtype) and not _nonfinite(stats.nonfinite):
            precision = coarser(leaf.actual.dtype, self.precision)
            found = unclean(leaf.actual, leaf.expected, precision)
            if found is not None:
                error, size = found

                def rough() -> Mismatch:
                    return Mismatch(leaf.path, "values", unclean_message(
                        leaf.path, error, size, precision), leaf.actual.numel(),
                        leaf.actual.numel(), stats.max_abs, stats.max_rel)

                leaf.mismatch = self.look_again(leaf, rough, unclean_only=True)
                if record and leaf.mismatch is not None:
                    self.items.append(leaf.mismatch)

    def look_again(self, leaf: _Leaf, worded: Callable[[], Mismatch],
                   unclean_only: bool = False) -> Mismatch | None:
        """A tensor leaf past its default tolerance (``worded``: its mismatch under that
        tolerance), or within it but wrong by a little everywhere (``unclean_only``), judged
        by its rounding budget and, on a device, against the CPU's own run in the same dtype
        (``rounding``). Without a budget, the default tolerance alone decides."""
        assert self.second_look is not None
        budget = self.second_look.budget(leaf.path)
        if isinstance(budget, Needed):
            self.pending.append(leaf.path)
            return worded()  # provisional: compared again once the budget is known
        tol = budget.tolerance(leaf.tol) if budget is not None else None
        if budget is None or tol is None:
            return None if unclean_only else worded()
        allowance = budget.allowance(leaf.expected)
        shown = tol
        if allowance is not None:
            stats, shown = self.within_allowance(leaf, budget, allowance)
        else:
            stats = _kernel.compare_values(leaf.actual, leaf.expected, tol, self.equal_nan,
                                           max(self.worst, 1), self.scratch)
        within = not stats.mismatched
        # The RMS tests once, for the record and the rule (an argsort of the leaf's errors).
        checks = budget.rms_checks(leaf.actual, leaf.expected)
        self.budgets.append(budget_record(leaf.path, leaf.actual, leaf.expected, budget,
                                          checks))
        mismatch = worded
        if not within:
            found = values_mismatch(leaf.path, leaf.actual, leaf.expected, shown, stats,
                                    self.worst, self.equal_nan)
            if (problem := budget.rms_problem(leaf.actual, leaf.expected, broad_only=True,
                                              checks=checks)) is not None:
                found = wrong_everywhere(found, problem, elements_within=False)
            mismatch = lambda: found  # noqa: E731
        elif (problem := budget.rms_problem(leaf.actual, leaf.expected,
                                            checks=checks)) is not None:
            within = False
            noted = wrong_everywhere(worded(), problem, elements_within=True)
            mismatch = lambda: noted  # noqa: E731
        else:
            self.notes.extend(budget_notes(leaf.path, leaf.expected, budget))
        return self.against_baseline(leaf.path, leaf.actual, leaf.expected, tol, within,
                                     mismatch)

    def within_allowance(self, leaf: _Leaf, budget: Budget, allowance: torch.Tensor,
                         ) -> tuple[TensorStats, Tolerance]:
        """The leaf judged element by element against its budget (``element_tally``)."""
        return element_tally(leaf.actual, leaf.expected, leaf.tol, budget, allowance,
                             max(self.worst, 1))

    def against_baseline(self, path: str, actual: object, expected: object, budget: Tolerance,
                         within: bool, mismatch: Callable[[], Mismatch]) -> Mismatch | None:
        """The device rule: past ``BASELINE_MULTIPLE`` times the CPU's own error fails; a run
        the budget refuses passes when the CPU's own run is past the budget too.
        ``mismatch`` words the leaf's failure, asked for only when it fails."""
        assert self.second_look is not None
        baseline = self.second_look.baseline(path) if self.device != "cpu" else None
        if isinstance(baseline, Needed):
            self.pending.append(path)
            return mismatch()  # provisional: compared again once the baseline is known
        if baseline is None:
            return None if within else mismatch()
        precision = coarser(_dtype_of(actual), self.precision)
        problem = baseline_problem(actual, expected, baseline, precision, self.device)
        if problem is not None:
            return with_note(mismatch(), problem)
        if within or not _within(baseline, expected, budget, self.equal_nan):
            return None
        return mismatch()

    def flush(self) -> None:
        for key in list(self.batches):
            self.flush_batch(key)

    def flush_batch(self, key: tuple[object, ...]) -> None:
        leaves = self.batches.pop(key, [])
        self.batched.pop(key, None)
        self.judge_batch(leaves)

    def judge_batch(self, leaves: list[_Leaf]) -> None:
        """One flat pass over many small pairs; halves are judged again only where one fails."""
        if len(leaves) == 1:
            self.leaf(leaves[0])
            return
        if not leaves:
            return
        try:
            actual = torch.cat([_flat(leaf.actual) for leaf in leaves])
            expected = torch.cat([_flat(leaf.expected) for leaf in leaves])
            stats = _kernel.compare_values(actual, expected, leaves[0].tol, self.equal_nan, 1,
                                    self.scratch)
        except _TORCH_REFUSALS:
            for leaf in leaves:  # each says what torch refused
                self.leaf(leaf)
            return
        if not stats.mismatched:
            if stats.compared:
                self.note(stats.max_abs, stats.max_rel)
            if self.looks_again(leaves[0].actual.dtype):
                precision = coarser(leaves[0].actual.dtype, self.precision)
                for leaf in leaves:
                    if unclean(leaf.actual, leaf.expected, precision) is not None:
                        self.leaf(leaf)
            return
        half = len(leaves) // 2
        self.judge_batch(leaves[:half])
        self.judge_batch(leaves[half:])


def _nonfinite(counts: NonFinite) -> bool:
    """Whether any mismatch is NaN or infinite on either side: never rounding, always a failure."""
    return bool(counts.nan_actual or counts.inf_actual or counts.nan_expected_only)


def _dtype_of(value: object) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    return torch.complex128 if isinstance(value, complex) else torch.float64


def _within(value: object, expected: object, tol: Tolerance, equal_nan: bool) -> bool:
    """Whether ``value`` (the CPU's same-dtype run) is within ``tol`` of ``expected``."""
    if isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor):
        if value.shape != expected.shape:
            return False
        stats = _kernel.compare_values(value.detach().cpu(), expected.detach().cpu(), tol,
                                       equal_nan, 1, _kernel.Scratch())
        return not stats.mismatched
    if isinstance(value, (int, float, complex)) and isinstance(expected, (int, float, complex)):
        return scalar_close(value, expected, abs(value - expected), tol, equal_nan,
                            _dtype_of(value))
    return False


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one row for ``torch.cat``: itself when it is one already (no view made)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _is_number(x: object) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _number_kind(x: object) -> str | None:
    # bool before int: bool is an int subclass, but True vs 1 is a type change.
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("complex", complex)):
        if isinstance(x, types):
            return kind
    return None


_BY_VALUE = ("outputs compared by value are tensors, numbers, strings, lists, tuples, dicts and "
             "dataclasses of them, objects registered with torch.utils._pytree, and objects "
             "holding tensors in their attributes; return one of those (the object's tensors "
             "in a dict, say)")

# What torch raises for an operation a dtype, layout or tensor kind does not support
# ("equal_cpu" not implemented for 'ComplexHalf', a promotion of uint32, a nested
# tensor's sizes): a failure of that output, said as such, never a crash of the comparison.
_TORCH_REFUSALS = (RuntimeError, NotImplementedError, TypeError)
# torch.uint16/32/64 came with torch 2.3: read where they exist, so that older releases
# import this module (every case item's verdict) at all.
_WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32")
                       if hasattr(torch, name))
_WIDENED_UNSIGNED = frozenset(_WIDE_UNSIGNED)
# A sparse pair of more elements than this is compared by its stored values, not densely.
_DENSE_ELEMENTS = 1 << 26
_WIDENED_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                               *_WIDE_UNSIGNED})


def _refusal(actual: torch.Tensor, expected: torch.Tensor, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"cannot compare {_a(_tensor_kind(actual))} with {_a(_tensor_kind(expected))}: torch "
            f"says {first}; return a tensor torch can compare (e.g. .to(torch.float32))")


def _tensor_kind(t: torch.Tensor) -> str:
    layout = "" if t.layout == torch.strided else f"{str(t.layout).removeprefix('torch.')} "
    nested = "nested " if getattr(t, "is_nested", False) else ""
    return f"{nested}{layout}{str(t.dtype).removeprefix('torch.')} tensor on {t.device.type}"


def _a(noun: str) -> str:
    return f"an {noun}" if noun.startswith("int") else f"a {noun}"


def _as_float(x: int) -> float:
    """An int as a float; inf where it is beyond a float's range (an int of 400 digits)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _safe_repr(x: object) -> str:
    """``repr(x)``, or a placeholder when the object's own ``__repr__`` fails."""
    try:
        return repr(x)
    except Exception as exc:
        return f"<{_type_name(x)} whose repr raised {type(exc).__name__}>"


def _type_name(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return "Tensor"
    return type(x).__qualname__


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


def _same_type(actual: object, expected: object) -> bool:
    """Whether two values are of one type: the same class, or the same class of a case's own
    module and of its copy, where the reference ran apart from the call (``run.child``):
    a named tuple or dataclass the case's file defines is made once by each."""
    one, other = type(actual), type(expected)
    return one is other or (one.__qualname__ == other.__qualname__
                            and one.__module__ == other.__module__
                            and one.__module__.startswith(CASE_MODULE_PREFIX))

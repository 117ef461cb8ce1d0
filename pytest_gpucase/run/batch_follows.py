"""Whether a ``batch`` variant's outputs follow its batch: the check the variant exists for.

A variant's outputs are compared with the reference on the same variant inputs, and the
reference runs the same code: a model that hard-codes its batch size (``x.view(4, T, C)``,
a broadcast against a ``(4, ...)`` tensor) gives a 1-entry batch 4 output rows in both,
and the comparison passes. This module runs the call (on the CPU, in the reference's
precision: float64, or float32 for an autocast case) on the saved full batch and on the
variant's batch, and compares the two, output by output (``out`` leaves; a gradient has its
input's shape, which autograd itself enforces). ``B`` is the saved batch, ``k`` the
variant's; an output axis of size ``B`` in the full run is a candidate batch axis:

- **shape** (always): the variant's output keeps ``B`` on every candidate axis, the rest of
  its shape unchanged, while its first ``k`` rows along one of them equal the full batch's
  first ``k`` rows (so that axis indexes the samples) and every later row differs from the
  full batch's (they are made from the kept samples, not from the samples they stand for):
  the batch does not follow. Or, with ``k = 1``, the candidate axis is gone (squeezed). An
  output of fixed size whatever the batch (a weight, a ``(T, T)`` mask where ``T`` happens
  to equal ``B``, a sum over the samples) fails neither test, so it is never blamed.
- **rows** (where sound): an output whose batch axes did follow (size ``k``, the rest of
  its shape unchanged) must equal the full batch's output narrowed to the first ``k`` rows
  on those axes, within the run precision's tolerance. Not where the samples of a batch
  meet by design: a batch norm using the batch's statistics ran (training mode, or no
  running statistics), random draws reach the outputs (a dropout mask's order may depend
  on the batch size; the variant's batch runs again from another random state to tell
  them from a model's initialisation, which its saved state overwrites), or ``[variants]
  batch`` says ``independent = false`` (a contrastive loss, statistics over the batch);
  each said in a note.

A failure names the output, the axis, the size expected and the size found. The check runs
only when the variant's verdict passed: a failed comparison already fails the item.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pytest_gpucase.base.tensors import tensor_versions
from pytest_gpucase.case.model import Case
from pytest_gpucase.case.variants import (
    Variant,
    VariantNotApplicable,
    applicable,
    call_shapes,
    shapes_of,
)
from pytest_gpucase.case.variants import apply as apply_variant
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.calls import call, tensors_of
from pytest_gpucase.run.context import grad_mode
from pytest_gpucase.run.isolation import note
from pytest_gpucase.run.judge import reference_inputs
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.verdict.structure import named_leaves
from pytest_gpucase.verdict.tolerance import DEFAULT_TOLERANCES, Tolerance

__all__ = ["BATCH_HELP", "batch_checked", "batch_problems"]

BATCH_HELP = (
    "A batch variant runs the call on the first k entries of the saved batch; its outputs "
    "are compared with the reference on the same entries, which runs the same code, so a "
    "batch size written into the code passes that comparison. This check runs the call on "
    "the CPU in the reference's precision on the saved batch and on the variant's, and "
    "wants every output axis that held the saved batch to hold the variant's, with the "
    "first k rows equal to the full batch's. If the samples of a batch are meant to "
    "interact (statistics over the batch, a contrastive loss), add independent = false to "
    "[variants] batch in case.toml: the rows are then not compared, the shapes still are.")

# Batch norms that use the statistics of the batch when their ``training`` argument (index
# 5 in each signature) is true: the samples of a batch then change each other's outputs.
_BATCH_NORMS = (torch.nn.functional.batch_norm, torch.batch_norm, torch.native_batch_norm)


class _Coupling(TorchFunctionMode):
    """Notes the first call that couples the samples of a batch (a batch norm in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None and func in _BATCH_NORMS:
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            if training:
                self.found = ("a batch norm computes the statistics of the batch (training "
                              "mode, or no running statistics)")
        return func(*args, **kwargs)


def batch_checked(spec: RunSpec, func: Callable[..., Any],
                  loaded: Callable[[], dict[str, Any]], rng: Mapping[str, torch.Tensor],
                  precision: torch.dtype, outcome: Outcome) -> Outcome:
    """``outcome``, failed when a ``batch`` variant's outputs do not follow its batch, with a
    note when the rows could not be compared. ``loaded``: the run's full inputs on the CPU,
    cast as the run casts them, before the variant."""
    variant = spec.variant
    if variant is None or variant.kind != "batch" or outcome.status != "passed":
        return outcome
    batch = spec.case.variants.batch
    independent = batch is None or batch.independent
    note(f"while checking that the outputs of {variant.id} follow its batch")
    try:
        problems, notes = batch_problems(spec.case, func, loaded, rng, variant, precision,
                                         independent)
    except VariantNotApplicable:
        return outcome
    except Exception as exc:  # the user's code on the CPU: said, never raised
        text = str(exc).strip().splitlines()
        notes = [f"{variant.id}: whether the outputs follow the batch was not checked: the "
                 f"call on the CPU raised {type(exc).__name__}"
                 + (f": {text[0][:200]}" if text else "")]
        problems = []
    every = (*outcome.notes, *notes)
    if not problems:
        return dataclasses.replace(outcome, notes=every)
    return Outcome("failed", f"{variant.id}: the outputs do not follow the batch: {problems[0]}",
                   details="\n".join([*problems, "", BATCH_HELP]), notes=every,
                   error_message=problems[0], kind="mismatch")


def batch_problems(case: Case, func: Callable[..., Any], loaded: Callable[[], dict[str, Any]],
                   rng: Mapping[str, torch.Tensor], variant: Variant, precision: torch.dtype,
                   independent: bool = True) -> tuple[list[str], list[str]]:
    """What does not follow the batch, and the notes of what was not checked and why.

    ``loaded`` gives the full batch's inputs (as the call takes them); raises
    ``VariantNotApplicable`` as the variant does."""
    inputs = reference_inputs(case, loaded())  # one copy: the variant's are views of it
    saved, _ = applicable(variant, call_shapes(shapes_of(inputs), inputs))
    size = variant.value
    if size == saved:
        return [], []
    start = rng["cpu"].to(torch.uint8) if "cpu" in rng else torch.get_rng_state()
    versions = tensor_versions(tensors_of(inputs))
    full, coupled_full, drew = _outputs(case, func, inputs, start)
    if tensor_versions(tensors_of(inputs)) != versions:  # the call wrote into its inputs
        inputs = reference_inputs(case, loaded())
    small_inputs = apply_variant(variant, inputs)
    small, coupled, drew_small = _outputs(case, func, small_inputs, start)
    coupled = coupled_full or coupled
    if coupled is None and independent and (drew or drew_small) and _random(
            case, func, small_inputs, small, start):
        coupled = ("the outputs depend on random draws (a dropout?), whose order may depend "
                   "on the batch size")
    tolerance = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES[torch.float32])
    problems: list[str] = []
    rows: list[str] = []
    for path, whole in full.items():
        part = small.get(path)
        if part is None or whole.dim() == 0:
            continue
        found = _shape_problem(path, whole, part, saved, size, tolerance)
        if found is not None:
            problems.append(found)
        elif independent and coupled is None:
            found = _rows_problem(path, whole, part, saved, size, tolerance)
            if found is not None:
                rows.append(found)
    notes = []
    if not independent:
        notes.append(f"{variant.id}: rows not compared with the full batch's ([variants] batch "
                     "independent = false); the shapes were")
    elif coupled is not None:
        notes.append(f"{variant.id}: rows not compared with the full batch's: {coupled}; "
                     "the shapes were")
    return problems + rows, notes


def _outputs(case: Case, func: Callable[..., Any], inputs: Mapping[str, Any],
             state: torch.Tensor) -> tuple[dict[str, torch.Tensor], str | None, bool]:
    """The call's tensor outputs by path from the CPU random state ``state``, why its
    samples may meet (None: no sign), and whether it drew random numbers."""
    torch.set_rng_state(state)
    watch = _Coupling()
    with torch.set_grad_enabled(grad_mode(case.context)), watch:
        out = call(func, inputs, False, "cpu")
    drew = not torch.equal(state, torch.get_rng_state())
    leaves = {path: value for path, value in named_leaves(out["out"], "out")
              if isinstance(value, torch.Tensor) and value.layout == torch.strided}
    return leaves, watch.found, drew


def _random(case: Case, func: Callable[..., Any], inputs: Mapping[str, Any],
            found: Mapping[str, torch.Tensor], start: torch.Tensor) -> bool:
    """Whether the outputs ``found`` change when the call starts from another random state.

    A call that draws numbers only to be overwritten (a model built, then its saved state
    loaded) gives the same outputs: its rows can be compared."""
    other = torch.Generator().manual_seed(_OTHER_SEED).get_state()
    if torch.equal(other, start):
        other = torch.Generator().manual_seed(_OTHER_SEED + 1).get_state()
    again, _, _ = _outputs(case, func, inputs, other)
    return set(again) != set(found) or not all(
        again[path].shape == value.shape and bool(_close(again[path], value, _EXACT).all())
        for path, value in found.items())


# Another random state than the saved one, to see whether the outputs depend on it.
_OTHER_SEED = 0x5EED
_EXACT = Tolerance()


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance) -> torch.Tensor:
    """Element by element, whether ``a`` is within ``tolerance`` of ``b`` (NaN equal NaN)."""
    if a.is_floating_point() or a.is_complex():
        return torch.isclose(a, b.to(a.dtype), rtol=tolerance.rtol, atol=tolerance.atol,
                             equal_nan=True)
    return a == b


def _rows_close(a: torch.Tensor, b: torch.Tensor, axis: int,
                tolerance: Tolerance) -> torch.Tensor:
    """For each entry along ``axis``, whether all of its elements are close."""
    close = _close(a, b, tolerance).movedim(axis, 0)
    return close.reshape(close.shape[0], -1).all(dim=1)


def _shape_problem(path: str, whole: torch.Tensor, part: torch.Tensor, saved: int, size: int,
                   tolerance: Tolerance) -> str | None:
    """How ``part`` (the variant's) fails to follow the batch that ``whole`` held, if it does."""
    shape, got = tuple(whole.shape), tuple(part.shape)
    axes = [axis for axis, n in enumerate(shape) if n == saved]
    if not axes:
        return None
    if size == 1 and len(got) == len(shape) - 1:
        for axis in axes:
            if shape[:axis] + shape[axis + 1:] == got:
                return (f"{path}: axis {axis} should hold 1 entry (the variant's batch), but "
                        f"it is gone: {shape} on the saved batch of {saved}, {got} on a batch "
                        "of 1 (squeezed away?)")
        return None
    if got != shape:
        return None
    for axis in axes:
        head = _rows_close(part.narrow(axis, 0, size), whole.narrow(axis, 0, size), axis,
                           tolerance)
        tail = _rows_close(part.narrow(axis, size, saved - size),
                           whole.narrow(axis, size, saved - size), axis, tolerance)
        if bool(head.all()) and not bool(tail.any()):
            return (f"{path}: axis {axis} should hold {_entries(size)} (the variant's batch), "
                    f"but holds {saved}, as on the saved batch of {saved}: its first {size} "
                    f"match the saved batch's, the other {saved - size} are made from the "
                    f"{size} kept samples (a batch size of {saved} written into the code? a "
                    f"broadcast against a tensor of {saved} entries?)")
    return None


def _rows_problem(path: str, whole: torch.Tensor, part: torch.Tensor, saved: int, size: int,
                  tolerance: Tolerance) -> str | None:
    """Whether ``part``'s rows equal the first ``size`` of ``whole`` on its batch axes."""
    shape, got = tuple(whole.shape), tuple(part.shape)
    if len(got) != len(shape):
        return None
    follow = [axis for axis, n in enumerate(shape) if n == saved and got[axis] == size]
    if not follow or any(got[axis] != shape[axis] for axis in range(len(shape))
                         if axis not in follow):
        return None
    expected = whole
    for axis in follow:
        expected = expected.narrow(axis, 0, size)
    close = _close(part, expected, tolerance)
    if bool(close.all()):
        return None
    axis = follow[0]
    rows = (~_rows_close(part, expected, axis, tolerance)).nonzero().flatten().tolist()
    worst = (part.double() - expected.double()).abs().nan_to_num(nan=float("inf")).max() \
        if part.is_floating_point() else None
    shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
    by = f" (largest difference {float(worst):.3g})" if worst is not None else ""
    which = f"row {shown} on axis {axis} differs" if len(rows) == 1 else (
        f"rows {shown} on axis {axis} differ")
    return (f"{path}: {which} from the same of the saved batch's output{by}: a sample's "
            "output depends on the other samples of its batch (a reshape or view that mixes "
            "samples, a batch size written into the code)")


def _entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"

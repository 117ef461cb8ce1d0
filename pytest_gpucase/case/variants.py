"""Edge variants of a case: last partial batch, short and long inputs, class-index boundaries.

``expand`` turns a case's ``[variants]`` tables into ``Variant`` values at
collection time (no tensor is read); ``apply`` builds a variant's inputs from
the saved ones inside the child. A variant never invents data: it takes the
first entries, repeats saved entries cyclically, or sets one class index. The
saved tensors are never written to.

Which inputs follow the axis of a ``batch`` or ``length`` variant
------------------------------------------------------------------
This is the one rule, shared with ``minimize`` (``members_of``). A case may
name them: ``[variants.batch] inputs = ["x", "target"]`` (likewise
``length``); each named input must be a tensor having the axis, all of one size
on it, and nothing else is resized. Otherwise they are read off the names and
shapes:

1. A *parameter* is never cut: an input whose name (or its last ``.``/``_``
   part) is ``weight``, ``bias``, ``running_mean``, ``running_var``,
   ``num_batches_tracked``, ``gamma`` or ``beta`` (``fc.weight``,
   ``class_weight``), and a floating input of lower rank than the largest input
   whose shape is that input's trailing shape (a class weight ``(C,)`` beside
   logits ``(B, C)``, a LayerNorm weight ``(D,)``): it broadcasts over the
   batch rather than indexing it. Integer and bool inputs (targets, masks,
   indices) are never taken for shape-only parameters.
2. The saved size is that of one tensor, the *anchor*: the ``boundaries`` input
   when the case has one with that axis (a class-index target is per sample by
   construction), else the largest non-parameter tensor input having the axis
   (the data: activations, logits). A model's weights larger than its batch
   therefore never anchor the batch.
3. A tensor input follows the axis when its sizes up to and including the axis
   equal the anchor's and it is not a parameter: a mask ``(B, T)`` follows
   ``x (B, T, D)`` on axis 1, a bias ``(T, T)`` does not.
0. Only per-sample call inputs are candidates. The saved tensors that are not
   are never cut and never anchor (``never_cut``): the RNG states ``[context]
   rng`` names (restored around the call, never passed to it), a dict
   argument's tensors (passed as one dict), and a module case's state dict
   (``state.<name>`` of ``replay_module``: the weights, whatever their sizes).
4. In doubt, nothing is cut and the variant is not applicable, with a message
   asking to add ``inputs = [...]`` to the table (``gpucase minimize`` asks for
   its ``--inputs`` instead, which adds no pytest item): when an input named as a parameter has the
   anchor's leading sizes (a per-sample ``sample_weight`` or a model weight as
   large as the batch?), or when the anchor is alone on the axis while another
   non-parameter input of another size is left whole (samples ``x (2, 16)``
   beside an unnamed ``w1 (64, 16)``: which is the batch?).

``batch = k`` takes the first ``k`` entries of every member (``k`` larger than
the saved batch is not applicable); ``length = n`` takes the first ``n``, or
repeats the saved entries cyclically up to ``n``. Both are views or gathers of
the saved tensors, which keep their strides where the size is not larger.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.case.keys import MODULE_KEY, STATE_PREFIX, tensor_dicts
from pytest_gpucase.case.model import (
    CASE_FILE,
    MAX_VARIANT_ELEMENTS,
    Case,
    Expectation,
    VariantTables,
)
from pytest_gpucase.case.payload import TensorInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "VARIANT_KINDS",
    "BrokenVariant",
    "InputsInDoubt",
    "NotClassIndices",
    "Shape",
    "Variant",
    "VariantNotApplicable",
    "VariantTooLarge",
    "applicable",
    "apply",
    "case_shapes",
    "check_size",
    "class_indices_problem",
    "describe_boundary",
    "describe_resize",
    "describe_saved",
    "expand",
    "header_shapes",
    "index_dtype",
    "members",
    "members_of",
    "named_parameter",
    "passed_apart",
    "quoted",
    "resized_elements",
    "resizes",
    "shapes_of",
]


# The variant kinds, in the order a case's items list them; one home (markers read it).
VARIANT_KINDS: tuple[Literal["batch", "length", "boundary"], ...] = ("batch", "length",
                                                                      "boundary")


class VariantNotApplicable(Exception):
    """The saved inputs cannot give this variant (e.g. batch=8 of a 3-entry batch)."""


class InputsInDoubt(VariantNotApplicable):
    """The rule cannot tell which inputs follow the axis: the case or the command must name them.

    ``reason`` says why, ``candidates`` are inputs of one size on the axis that
    may follow it (an example that works as written); the message adds the fix
    for a variant table, and ``gpucase minimize`` gives its own.
    """

    def __init__(self, reason: str, axis: int, candidates: Sequence[str], table: str) -> None:
        self.reason, self.axis, self.candidates = reason, axis, tuple(candidates)
        super().__init__(f"{reason}; add the inputs that follow axis {axis} to "
                         f"[variants.{table}] in case.toml, e.g. inputs = "
                         f"{quoted(self.candidates)}")


def quoted(names: Sequence[str]) -> str:
    """``["logits", "labels"]``: names as a TOML list, to paste."""
    return "[" + ", ".join(f'"{name}"' for name in names) + "]"


class BrokenVariant(ValueError):
    """A variant table the case itself gets wrong: the run is a broken case, not a skip."""


class VariantTooLarge(BrokenVariant):
    """The variant's resized inputs would hold more than ``MAX_VARIANT_ELEMENTS`` elements."""


class NotClassIndices(BrokenVariant):
    """The ``boundaries`` input is not an integer tensor: a class index written into a float
    (a logit), a bool or a complex value tests nothing the case means."""


def index_dtype(dtype: str) -> bool:
    """Whether a dtype (``int64``, ``torch.int64``) holds class indices: an integer one."""
    return dtype.removeprefix("torch.").startswith(("int", "uint"))


def class_indices_problem(name: str, dtype: str, integers: Sequence[str]) -> str | None:
    """Why ``boundaries`` may not set entries of input ``name`` of ``dtype``; None if it may.

    One wording for ``gpucase validate`` (from the payload's header) and the run;
    ``integers`` are the integer tensor inputs, offered as the fix.
    """
    if index_dtype(dtype):
        return None
    fix = (f"name the integer class-index input, e.g. input = \"{integers[0]}\""
           if integers else "save the class indices as an integer tensor")
    return (f"input '{name}' holds {dtype.removeprefix('torch.')}, not class indices: a boundary "
            f"variant writes class indices (0, classes - 1, -1, classes) into it; {fix}")


# A tensor input as the rules see it: its shape, and whether it is floating (or complex).
Shape = tuple[tuple[int, ...], bool]


@dataclass(frozen=True)
class Variant:
    """One edge variant: its kind, the size or value it sets, and the outcome it must give."""

    kind: Literal["batch", "length", "boundary"]
    value: int
    axis: int = 0
    input: str | None = None          # boundary: the class-index input; batch/length: the anchor
    ignore_index: int | None = None   # boundary: entries equal to this are left alone
    reject: Expectation | None = None  # boundary: the value is out of range and must be rejected
    inputs: tuple[str, ...] | None = None  # batch/length: the inputs named in case.toml

    @property
    def label(self) -> str:
        """The variant in words, as reports show it: ``batch=1``, ``boundary=-1``."""
        return f"{self.kind}={self.value}"

    @property
    def id(self) -> str:
        """The item-id token, ``batch[1]``, ``boundary[-1]``: only characters ``-k`` accepts,
        and closed by ``]`` so that ``-k "boundary[-1]"`` never also selects ``boundary[-100]``."""
        return f"{self.kind}[{self.value}]"


def expand(tables: VariantTables) -> list[Variant]:
    """Every variant the case's ``[variants]`` tables ask for, in a stable order.

    Batch sizes, then lengths, as listed; then the boundaries: accepted values
    ``0``, ``classes - 1`` and ``ignore_index``, then rejected ones ``-1`` and
    ``classes``, each value once (the first role wins: ``ignore_index = -1`` is
    accepted). Rejected values need ``[variants] reject`` to say how they fail.
    """
    bounds = tables.boundaries
    anchor = bounds.input if bounds is not None else None
    found: list[Variant] = []
    if tables.batch is not None:
        found += [Variant("batch", size, axis=tables.batch.axis, input=anchor,
                          inputs=tables.batch.inputs)
                  for size in tables.batch.sizes]
    if tables.length is not None:
        found += [Variant("length", size, axis=tables.length.axis, input=anchor,
                          inputs=tables.length.inputs)
                  for size in tables.length.sizes]
    if bounds is None:
        return found
    values: list[tuple[int, Expectation | None]] = [(0, None), (bounds.classes - 1, None)]
    if bounds.ignore_index is not None:
        values.append((bounds.ignore_index, None))
    if tables.reject is not None:
        values += [(-1, tables.reject), (bounds.classes, tables.reject)]
    seen: set[int] = set()
    for value, reject in values:
        if value not in seen:
            seen.add(value)
            found.append(Variant("boundary", value, input=bounds.input,
                                 ignore_index=bounds.ignore_index, reject=reject))
    return found


def members(inputs: Mapping[str, Any], axis: int, anchor: str | None = None,
            names: tuple[str, ...] | None = None) -> tuple[int, tuple[str, ...]] | None:
    """The saved size on ``axis`` and the tensor inputs that follow it (rules in the module doc).

    ``inputs`` are the call's keyword arguments; ``anchor`` names the input whose
    size is the saved size (the boundaries input), ``names`` the inputs case.toml
    lists; ``None`` when no tensor input has the axis. Raises
    ``VariantNotApplicable`` when the rule is in doubt.
    """
    return members_of(call_shapes(shapes_of(inputs), inputs), axis, anchor, names)


def passed_apart(names: Iterable[str], literals: Mapping[str, Any],
                 rng: Collection[str] = ()) -> frozenset[str]:
    """Which of the saved tensors ``names`` are no call argument of their own: the RNG states
    ``rng`` names (``[context] rng``: restored around the call) and a dict argument's tensors
    (passed inside that argument, which its ``[inputs]`` entry names). Shared by the
    binding check (``validate.binding_problems``) and ``never_cut``."""
    grouped = {str(name) for members in tensor_dicts(literals).values()
               if isinstance(members, Mapping) for name in members.values()}
    return frozenset(name for name in names if name in rng or name in grouped)


def never_cut(names: Iterable[str], literals: Mapping[str, Any],
              rng: Collection[str] = ()) -> frozenset[str]:
    """Which of the saved tensors ``names`` are no per-sample call input (rule 0).

    ``literals`` are the case's ``[inputs]`` (or the call's keyword arguments:
    a module case holds ``gpucase_module`` in both), ``rng`` the payload names
    ``[context] rng`` gives. One home, for the variants in the child, the checks
    of a case's header and ``gpucase minimize``: ``passed_apart``, and a module
    case's state dict (its weights, bound to the call but never per sample).
    """
    names = list(names)
    module = isinstance(literals.get(MODULE_KEY), Mapping)
    return passed_apart(names, literals, rng) | {
        name for name in names if module and name.startswith(STATE_PREFIX)}


def call_shapes(shapes: Mapping[str, Shape], literals: Mapping[str, Any],
                rng: Collection[str] = ()) -> dict[str, Shape]:
    """``shapes`` less the tensors no axis cuts (``never_cut``)."""
    fixed = never_cut(shapes, literals, rng)
    return {name: shape for name, shape in shapes.items() if name not in fixed}


def case_shapes(case: Case, shapes: Mapping[str, Shape]) -> dict[str, Shape]:
    """The saved tensors' ``shapes`` that the rule sees for ``case`` (``never_cut`` left out)."""
    return call_shapes(shapes, case.literals, tuple(case.context.rng.values()))


def shapes_of(inputs: Mapping[str, Any]) -> dict[str, Shape]:
    """The tensor inputs as ``members_of`` sees them."""
    import torch

    return {name: (tuple(t.shape), t.is_floating_point() or t.is_complex())
            for name, t in inputs.items() if isinstance(t, torch.Tensor)}


_FLOAT_CODES = ("F", "BF", "C")  # safetensors dtype codes of floating and complex tensors


def header_shapes(infos: Iterable[TensorInfo]) -> dict[str, Shape]:
    """The tensor inputs as ``members_of`` sees them, from a payload's header (no data read)."""
    return {info.name: (info.shape, info.dtype.startswith(_FLOAT_CODES)) for info in infos}


PARAMETER_NAMES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked",
                   "gamma", "beta")
_PARAMETER = re.compile(rf"(?:^|.*[._])(?:{'|'.join(PARAMETER_NAMES)})")


def named_parameter(name: str) -> bool:
    """Whether an input's name says it is a parameter: ``weight``, ``fc.bias``, ``class_weight``."""
    return _PARAMETER.fullmatch(name) is not None


def _shown(name: str, shape: tuple[int, ...]) -> str:
    return f"{name} {shape}"


def members_of(shapes: Mapping[str, Shape], axis: int, anchor: str | None = None,
               names: tuple[str, ...] | None = None, *,
               table: str = "batch") -> tuple[int, tuple[str, ...]] | None:
    """``members`` from shapes alone, as a payload's header gives them (no tensor read).

    ``shapes`` hold the candidates only (``case_shapes``, ``call_shapes``);
    ``table`` is the variant table a fix would name. Raises ``InputsInDoubt``
    when the rule is in doubt.
    """
    having = {name: shape for name, shape in shapes.items() if len(shape[0]) > axis}
    if names is not None:
        return _named_members(shapes, having, axis, names)
    if not having:
        return None
    largest = max(having.values(), key=lambda shape: (_numel(shape[0]), len(shape[0])))[0]

    candidates = [name for name in having if not named_parameter(name)]
    base = _base_of(having, candidates, axis, anchor, table)
    lead = having[base][0][:axis + 1]
    same = [name for name in having if having[name][0][:axis + 1] == lead]
    _refuse_doubtful(having, largest, same, base, axis, table)
    followers = tuple(name for name in same
                      if name == base or not _parameter(having, largest, name))
    left = [name for name in candidates
            if name not in followers and not _parameter(having, largest, name)]
    if len(followers) == 1 and left and base != anchor:
        raise _doubt(
            having, axis, table,
            f"cannot tell which input holds the samples on axis {axis}: "
            f"{_shown(base, having[base][0])} or "
            f"{', '.join(_shown(n, having[n][0]) for n in left)}", left)
    return int(lead[axis]), followers


def _doubt(having: Mapping[str, Shape], axis: int, table: str, reason: str,
           among: list[str]) -> InputsInDoubt:
    """The doubt to raise, its example naming the inputs of the size most of ``among`` share."""
    # The example names inputs of one size on the axis, so that it works as written:
    # the size most of ``among`` share (several inputs agreeing hint at the samples).
    sizes = [having[name][0][axis] for name in among]
    common = max(sizes, key=sizes.count)
    return InputsInDoubt(reason, axis, [n for n, size in zip(among, sizes, strict=True)
                                        if size == common], table)


def _base_of(having: Mapping[str, Shape], candidates: list[str], axis: int,
             anchor: str | None, table: str) -> str:
    """The input the others are measured against: the anchor, else the largest non-parameter."""
    if anchor is not None and anchor in having:
        return anchor
    if candidates:
        return max(candidates, key=lambda name: (_numel(having[name][0]), len(having[name][0])))
    raise _doubt(having, axis, table,
                 f"every input with an axis {axis} is named as a parameter "
                 f"({', '.join(having)}), which is never cut by inference", list(having))


def _parameter(having: Mapping[str, Shape], largest: tuple[int, ...], name: str) -> bool:
    """Whether an input is a parameter, by name or shape, unless it has the largest's shape."""
    # An input of the largest input's whole shape is data, whatever its name
    # (per_element_weight beside logits).
    shape = having[name][0]
    return shape != largest and (named_parameter(name)
                                 or parameter_by_shape(having[name], largest))


def _refuse_doubtful(having: Mapping[str, Shape], largest: tuple[int, ...], same: list[str],
                     base: str, axis: int, table: str) -> None:
    """Refuse an input named as a parameter that has the base's size on the axis."""
    doubtful = [name for name in same if name != base and named_parameter(name)
                and _parameter(having, largest, name)
                and not parameter_by_shape(having[name], largest)]
    if doubtful:
        raise _doubt(
            having, axis, table,
            f"{', '.join(_shown(n, having[n][0]) for n in doubtful)} is named as a parameter but "
            f"has the size of {_shown(base, having[base][0])} on axis {axis}: cannot tell "
            "whether it follows", same)


def parameter_by_shape(shape: Shape, largest: tuple[int, ...]) -> bool:
    """A floating input shaped as the trailing shape of the largest: it broadcasts (rule 1)."""
    dims, floating = shape
    return floating and len(dims) < len(largest) and dims == largest[len(largest) - len(dims):]


def _named_members(shapes: Mapping[str, Shape], having: Mapping[str, Shape], axis: int,
                   names: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """The inputs case.toml lists, checked: tensors having the axis, all of one size on it."""
    for name in names:
        if name not in shapes:
            raise VariantNotApplicable(f"inputs names '{name}', which is not a tensor input "
                                       f"(tensor inputs: {', '.join(shapes) or 'none'})")
        if name not in having:
            raise VariantNotApplicable(f"inputs names '{name}' {shapes[name][0]}, which has no "
                                       f"axis {axis}")
    sizes = {having[name][0][axis] for name in names}
    if len(sizes) > 1:
        listed = ", ".join(_shown(n, having[n][0]) for n in names)
        raise VariantNotApplicable(f"the inputs listed differ in size on axis {axis}: {listed}")
    return int(sizes.pop()), tuple(names)


def applicable(variant: Variant, shapes: Mapping[str, Shape]) -> tuple[int, tuple[str, ...]]:
    """The saved size and the inputs a ``batch``/``length`` variant resizes, or
    ``VariantNotApplicable`` saying why it does not apply to these saved inputs.

    The one rule of which sizes apply, shared by the run (``apply``), ``gpucase
    show`` (``describe_resize``) and ``gpucase validate``: a batch no larger than
    the saved one (it takes the first entries; only a length repeats them), on
    inputs that are not empty on the axis. The message names no variant: callers
    prefix what they need.
    """
    found = members_of(shapes, variant.axis, variant.input, variant.inputs,
                       table=variant.kind)
    if found is None:
        raise VariantNotApplicable(f"no tensor input has an axis {variant.axis}")
    saved, names = found
    if variant.kind == "batch" and variant.value > saved:
        raise VariantNotApplicable(
            f"the saved batch holds {saved} entries on axis {variant.axis}")
    if saved == 0:
        raise VariantNotApplicable(f"the saved inputs are empty on axis {variant.axis}")
    return saved, names


def resizes(variant: Variant, shapes: Mapping[str, Shape]
            ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """What a ``batch``/``length`` variant resizes: each input's shape before and after.

    Raises ``VariantNotApplicable`` as ``applicable`` does.
    """
    if variant.kind == "boundary":
        return {}
    if members_of(shapes, variant.axis, variant.input, variant.inputs,
                  table=variant.kind) is None:
        return {}
    found = applicable(variant, shapes)
    names = found[1] if variant.inputs else sorted(
        found[1], key=lambda name: -_numel(shapes[name][0]))  # the data first, as listed
    return {name: (shapes[name][0], tuple(variant.value if dim == variant.axis else size
                                          for dim, size in enumerate(shapes[name][0])))
            for name in names}


def describe_resize(variant: Variant, shapes: Mapping[str, Shape]) -> str | None:
    """``batch[1]: resized logits (4, 4) -> (1, 4), target (4,) -> (1,)``; None if none.

    A variant the rule cannot apply says why instead.
    """
    if variant.kind == "boundary":
        return None
    try:
        changed = resizes(variant, shapes)
    except VariantNotApplicable as exc:
        return f"{variant.id}: not applicable: {exc}"
    if not changed:
        return None
    return f"{variant.id}: resized " + ", ".join(
        f"{name} {before} -> {after}" for name, (before, after) in changed.items())


def describe_saved(variant: Variant, case: Case) -> str | None:
    """What ``variant`` did to a case's saved inputs, in words; None if nothing to say.

    A ``batch``/``length`` variant from the payload's header (``describe_resize``);
    a boundary from its saved class indices (``describe_boundary``).
    """
    from pytest_gpucase.case.payload import describe, load

    if not case.inputs_file.exists():
        return describe_boundary(variant, None) if variant.kind == "boundary" else None
    try:
        if variant.kind == "boundary":
            saved = load(case.inputs_file).get(variant.input or "")
            return describe_boundary(variant, saved)
        return describe_resize(variant, case_shapes(case, header_shapes(
            describe(case.inputs_file))))
    except CaseFormatError:
        return None  # a broken payload: the run itself says so


def resized_elements(variant: Variant, shapes: Mapping[str, Shape]) -> int:
    """Elements the resized inputs of a ``batch`` or ``length`` variant hold, all together."""
    if variant.kind == "boundary":
        return 0
    found = members_of(shapes, variant.axis, variant.input, variant.inputs,
                       table=variant.kind)
    if found is None or found[0] == 0:
        return 0
    saved, names = found
    return sum(_numel(shapes[name][0]) // saved * variant.value for name in names)


def check_size(variant: Variant, shapes: Mapping[str, Shape]) -> None:
    """Raise ``VariantTooLarge`` when the variant's inputs are over ``MAX_VARIANT_ELEMENTS``."""
    total = resized_elements(variant, shapes)
    if total > MAX_VARIANT_ELEMENTS:
        raise VariantTooLarge(f"{variant.label}: the resized inputs would hold {total} elements, "
                              f"over the limit of {MAX_VARIANT_ELEMENTS}; try a smaller size")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def apply(variant: Variant, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs of ``variant``, built from the saved ``inputs`` (which stay untouched).

    Raises ``VariantTooLarge`` before any allocation when the resized inputs
    would be over ``MAX_VARIANT_ELEMENTS``.
    """
    if variant.kind == "boundary":
        return _set_boundary(variant, inputs)
    shapes = call_shapes(shapes_of(inputs), inputs)  # the RNG states are out already
    try:
        _, names = applicable(variant, shapes)
    except VariantNotApplicable as exc:
        raise VariantNotApplicable(f"{variant.label}: {exc}") from None
    check_size(variant, shapes)
    return {**inputs, **{name: _resize(inputs[name], variant.axis, variant.value)
                         for name in names}}


def _resize(tensor: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Take the first ``size`` entries along ``axis``, repeating saved entries when longer."""
    import torch

    current = tensor.shape[axis]
    if size <= current:
        # a shorter batch or sequence from a data loader is laid out afresh: a contiguous
        # input stays contiguous (a slice along an inner axis keeps the saved strides, and
        # the user's .view() of it raised "view size is not compatible")
        cut = tensor.narrow(axis, 0, size)
        return cut.contiguous() if tensor.is_contiguous() else cut
    index = torch.arange(size, device=tensor.device) % current
    return tensor.index_select(axis, index)


def _set_boundary(variant: Variant, inputs: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    name = variant.input
    target = inputs.get(name) if name is not None else None
    if name is None or not isinstance(target, torch.Tensor):
        raise VariantNotApplicable(f"{variant.label}: no tensor input named '{name}'")
    integers = [key for key, value in inputs.items() if isinstance(value, torch.Tensor)
                and index_dtype(str(value.dtype))]
    problem = class_indices_problem(name, str(target.dtype), integers)
    if problem is not None:
        raise NotClassIndices(problem)
    info = torch.iinfo(target.dtype)
    if not info.min <= variant.value <= info.max:
        # Assigning would wrap silently (uint8: -1 becomes 255) and test another value.
        raise VariantNotApplicable(f"{variant.label}: '{name}' is {target.dtype}, which "
                                   f"cannot hold {variant.value}")
    position = boundary_position(variant, target)
    changed = _copy_keeping_layout(target)
    changed[position] = variant.value
    return {**inputs, name: changed}


def boundary_position(variant: Variant, target: torch.Tensor) -> tuple[int, ...]:
    """Where a boundary variant writes its value: the first entry of ``target`` (in index
    order) that is not ``ignore_index``. One home for the run and ``describe_boundary``."""
    import torch

    label = variant.label
    if target.numel() == 0:
        raise VariantNotApplicable(f"{label}: '{variant.input}' is empty")
    flat = target.reshape(-1)
    candidates = torch.arange(flat.numel(), device=flat.device)
    if variant.ignore_index is not None:
        candidates = candidates[flat != variant.ignore_index]
    if candidates.numel() == 0:
        raise VariantNotApplicable(f"{label}: every entry of '{variant.input}' is ignore_index "
                                   f"({variant.ignore_index})")
    flat_index, position = int(candidates[0]), []
    for size in reversed(target.shape):
        position.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(position))


def describe_boundary(variant: Variant, target: torch.Tensor | None) -> str:
    """``boundary[-1]: set target[0] = -1 (saved 1); ...``: which entry of the saved class
    indices the variant set, and whether the case accepts or rejects that value.

    ``target`` is the saved input (``None`` when it cannot be read: the entry is then
    described by the rule).
    """
    name = variant.input or "?"
    try:
        if target is None:
            raise VariantNotApplicable("")
        position = boundary_position(variant, target)
        where = f"{name}[{', '.join(map(str, position))}]"
        saved = f" (saved {target[position].item()})"
    except VariantNotApplicable:
        where, saved = f"the first entry of {name}", ""
        if variant.ignore_index is not None:
            where += f" not equal to ignore_index ({variant.ignore_index})"
    text = f"{variant.id}: set {where} = {variant.value}{saved}; "
    if variant.reject is None:
        return text + (f"[variants] boundaries in {CASE_FILE} makes {variant.value} a value the "
                       "case accepts: the call must give the reference's outputs")
    return text + (f"[variants] boundaries in {CASE_FILE} makes {variant.value} an out-of-range "
                   f"class index the case must reject ([variants.reject]: "
                   f"{variant.reject.wanted})")


def _copy_keeping_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape, strides and storage offset, sharing no memory with ``tensor``.

    A view whose elements overlap (an expanded target) is copied contiguously
    instead: setting one of its entries would set every entry sharing the memory.
    """
    import torch

    if _overlaps(tensor):
        return tensor.clone(memory_format=torch.contiguous_format)
    whole = tensor.untyped_storage().nbytes() // tensor.element_size()
    storage = tensor.as_strided((whole,), (1,), 0).clone()
    return storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether two indices may reach one element (a sufficient test for "they do not")."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(),
                                                          strict=True) if size > 1)
    reach = 0  # the furthest element reached by the dims of smaller stride
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False

"""How the user's function is called (with gradients along random cotangents when asked),
and its outputs made safe to walk: detached, checked for depth and cycles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pytest_gpucase.base import backends
from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.base.tensors import field_names, indexed, named_tensors
from pytest_gpucase.case.model import Case
from pytest_gpucase.run import second_look
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.verdict.structure import named_leaves, parts

__all__ = [
    "MAX_OUTPUT_DEPTH", "BadOutput", "NothingDifferentiated", "call", "detached", "each_tensor",
    "synchronize", "tensors_of", "upcast",
]


# How deep outputs may nest. The walks over them (detach here, the comparison, the golden
# file) recurse, so a deeper output, or one that holds itself, would end in a RecursionError
# blamed on the call, which returned normally; 200 levels leave those walks room below
# Python's default limit of 1000 frames, and no real output comes near.
MAX_OUTPUT_DEPTH = 200


class BadOutput(Exception):
    """An output the walks cannot take: nested deeper than ``MAX_OUTPUT_DEPTH``, or holding
    itself. Raised where it is found; each level adds its key on the way out, so that the
    path costs nothing while the walk succeeds."""

    def __init__(self, problem: str, again: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.again = again   # for a cycle: how many keys up the path the value was met first
        self.keys: list[object] = []  # innermost first

    def message(self, whose: str) -> str:
        keys = self.keys[::-1]
        path = _abridged("out", keys)
        if self.again is not None:
            first = _abridged("out", keys[:len(keys) - self.again])
            return (f"{whose} output holds itself: {path} is {first} again; its outputs are "
                    "compared by value and a cycle has no end, so return one without it")
        return (f"{whose} output nests deeper than {MAX_OUTPUT_DEPTH} levels at {path}; its "
                "outputs are walked level by level, so return a flatter value (a tensor, or a "
                "list of them)")

    def outcome(self, whose: str) -> Outcome:
        return Outcome("failed", self.message(whose), kind="bad output")


def _abridged(root: str, keys: list[object]) -> str:
    """``out[0][0]...[0]``: a path spelled as a user reaches the value, its middle left out
    past a dozen levels."""
    shown = keys if len(keys) <= 12 else [*keys[:8], ..., *keys[-2:]]
    path = root
    for key in shown:
        if key is ...:
            path = f"{path}..."
        elif isinstance(key, _Spelled):
            path = f"{path}{key}"
        elif isinstance(key, _Field):
            path = f"{path}.{key}"
        else:
            path = indexed(path, key)
    return path


def each_tensor(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to a tensor input, or to each tensor of a dict input; else ``value``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def upcast(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's inputs: on the CPU, floating tensors in float64 (complex in complex128)."""
    def up(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().cpu()
        if value.is_floating_point():
            return value.to(torch.float64)
        if value.is_complex():
            return value.to(torch.complex128)
        return value

    return {name: each_tensor(value, up) for name, value in inputs.items()}


def synchronize(device: str) -> None:
    """Wait for queued kernels, so an asynchronous error is raised here and not later."""
    backends.synchronize(torch, device)


def call(func: Callable[..., Any], inputs: Mapping[str, Any], gradients: bool,
          device: str, cotangents: dict[str, torch.Tensor] | None = None,
          precision: torch.dtype | None = None) -> dict[str, Any]:
    """Call ``func``; with ``gradients``, also the gradients of its float outputs along a
    random cotangent with respect to its float inputs (``second_look.cotangent``).

    ``cotangents`` (float64, by output path) are filled here when empty (the call, with
    ``precision``) and read when given (the reference, so that both differentiate along the
    same values). In the grad mode the caller set (``grad_mode``): the same for the call
    and the reference.
    """
    if not gradients:
        out = func(**inputs)
        synchronize(device)
        return {"out": detached(out)}
    # Detached first: the walk that finds the tensors to differentiate needs an output
    # detached has checked (depth, cycles).
    leaves = {name: value.detach().requires_grad_()
              for name, value in inputs.items()
              if isinstance(value, torch.Tensor)
              and (value.is_floating_point() or value.is_complex())}
    out = func(**{**inputs, **leaves})
    kept = detached(out)
    outputs = [(path, t) for path, t in named_leaves(out, "out")
               if isinstance(t, torch.Tensor) and t.requires_grad]
    cotangents = {} if cotangents is None else cotangents
    if not cotangents:
        cotangents.update((path, second_look.cotangent(path, t, precision)) for path, t in outputs)
    directions = []
    for path, t in outputs:
        given = cotangents.get(path)
        if given is None or given.shape != t.shape:  # a structure the comparison will refuse
            given = second_look.cotangent(path, t, precision)
        directions.append(given.to(device=t.device, dtype=t.dtype))
    found: tuple[torch.Tensor | None, ...] = ()
    if outputs and leaves:
        found = torch.autograd.grad([t for _, t in outputs], list(leaves.values()),
                                    directions, allow_unused=True)
    if all(grad is None for grad in found):  # some inputs without one are fine, not all
        raise NothingDifferentiated(torch.is_grad_enabled())
    synchronize(device)
    return {"out": kept, "grad": dict(zip(leaves, found, strict=True))}


class NothingDifferentiated(Exception):
    """``gradients = true`` with no gradient at all to compare: no float output depends on a
    float tensor input (an integer output, one computed from other values), or grad mode is
    off. Without it the run compared the outputs alone and passed as if the gradients had
    been checked. Raised by ``call``, which knows no case; told as a broken case."""

    def __init__(self, grad_enabled: bool) -> None:
        super().__init__("nothing differentiated")
        self.grad_enabled = grad_enabled

    def message(self, whose: str) -> str:
        if not self.grad_enabled:
            return (f"true, but {whose} runs with grad mode off ([context] grad = false or "
                    "inference = true), so nothing is differentiated; turn grad mode on, or "
                    "remove gradients = true")
        return (f"true, but no float output of {whose} depends on a float tensor input (a "
                "top-level argument), so there is no gradient to compare; return a float "
                "tensor computed from the inputs, or remove gradients = true")

    def error(self, case: Case, whose: str) -> CaseFormatError:
        return CaseFormatError(case.case_file, self.message(whose), key=self.KEY)

    KEY = "[expect] gradients"


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [tensor for _, tensor in named_tensors(value)]


def detached(value: Any, above: dict[int, int] | None = None) -> Any:
    """``value`` with its tensors detached; raises ``BadOutput`` for one nested deeper than
    ``MAX_OUTPUT_DEPTH`` or holding itself (``above``: id -> depth of the containers on the
    path down to here, the only ones a cycle can return to)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if not isinstance(value, (Mapping, list, tuple)):
        children = _walked_children(value)
        if children is not None:  # walked as the comparison walks it, and kept as it is
            _check_walk(value, children, {} if above is None else above)
        return value
    above = {} if above is None else above
    _enter(value, above)
    key: object = None
    items: list[Any] = []
    try:
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                out[key] = detached(item, above)
            return out
        for item in value:
            items.append(detached(item, above))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    except BadOutput as problem:
        names = field_names(value)
        problem.keys.append(key if isinstance(value, Mapping)
                            else _Field(names[len(items)]) if names else len(items))
        raise
    finally:
        del above[id(value)]


class _Spelled(str):
    """A path suffix spelled already (``.layers``, ``[0]``), as ``structure.parts`` gives it."""


class _Field(str):
    """A dataclass or named tuple field on a path, spelled ``.name``."""


def _walked_children(value: Any) -> list[tuple[object, Any]] | None:
    """What the comparison walks into besides dicts, lists and tuples: a dataclass's fields,
    any other sequence's items (a UserList), the parts of an object registered with pytree
    or holding tensors in its attributes (``structure.parts``); None for a leaf."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(_Field(f.name), getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, Sequence) and not isinstance(
            value, (str, bytes, bytearray, memoryview, range)):
        return list(enumerate(value))
    found = parts(value)
    if found is None:
        return None
    return [(_Spelled(suffix), item) for suffix, item in found]


def _enter(value: Any, above: dict[int, int]) -> None:
    """Step into ``value`` on the walk's path: a container met again on the path is a cycle,
    one past ``MAX_OUTPUT_DEPTH`` too deep; the caller removes it on the way out."""
    depth = len(above)
    if id(value) in above:
        raise BadOutput("cycle", again=depth - above[id(value)])
    if depth >= MAX_OUTPUT_DEPTH:
        raise BadOutput("depth")
    above[id(value)] = depth


def _check_walk(value: Any, children: list[tuple[object, Any]], above: dict[int, int]) -> None:
    """``detached``'s depth and cycle checks for a value it keeps as it is."""
    _enter(value, above)
    walked: list[object] = []
    try:
        for where, item in children:
            walked.append(where)
            detached(item, above)
    except BadOutput as problem:
        problem.keys.append(walked[-1])  # the key being walked when the problem was met
        raise
    finally:
        del above[id(value)]

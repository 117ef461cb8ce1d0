"""How a case's inputs bind to its function's parameters: the one rule the child (a run)
and ``gpucase validate`` (a dry run) share, so that both word a mistake the same way."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Collection
from dataclasses import dataclass

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.case.model import INPUTS_FILE, Case
from pytest_gpucase.case.variants import passed_apart

__all__ = ["Parameters", "binding_problems", "rng_problems"]


@dataclass(frozen=True)
class Parameters:
    """A function's parameters, as keyword arguments bind to them."""

    names: tuple[str, ...]                 # every parameter, in order (for messages)
    keyword: tuple[str, ...]               # those a keyword argument can give
    required: tuple[str, ...]              # keyword parameters without a default
    positional_only: tuple[str, ...]       # required parameters no keyword can give
    var_keyword: bool                      # **kwargs takes any other name

    @classmethod
    def of_signature(cls, signature: inspect.Signature) -> Parameters:
        kinds = inspect.Parameter
        params = list(signature.parameters.values())
        keyword = [p for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
        return cls(
            names=tuple(p.name for p in params if p.kind not in (kinds.VAR_POSITIONAL,
                                                                 kinds.VAR_KEYWORD)),
            keyword=tuple(p.name for p in keyword),
            required=tuple(p.name for p in keyword if p.default is p.empty),
            positional_only=tuple(p.name for p in params
                                  if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty),
            var_keyword=any(p.kind == kinds.VAR_KEYWORD for p in params),
        )

    @classmethod
    def of_function(cls, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Parameters:
        args = node.args
        ordered = [*args.posonlyargs, *args.args]
        first_default = len(ordered) - len(args.defaults)
        required_positional = [a.arg for i, a in enumerate(ordered) if i < first_default]
        required_kwonly = [a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults,
                                                      strict=True) if default is None]
        posonly = {a.arg for a in args.posonlyargs}
        return cls(
            names=tuple(a.arg for a in [*ordered, *args.kwonlyargs]),
            keyword=tuple(a.arg for a in [*args.args, *args.kwonlyargs]),
            required=tuple(n for n in [*required_positional, *required_kwonly]
                           if n not in posonly),
            positional_only=tuple(n for n in required_positional if n in posonly),
            var_keyword=args.kwarg is not None,
        )


def binding_problems(case: Case, target: str, params: Parameters,
                     tensors: Collection[str] | None) -> list[CaseFormatError]:
    """Why the case's inputs (``[inputs]`` literals and the payload's ``tensors``, ``None``
    when there is no payload) do not bind to ``target``'s parameters; empty when they do."""
    if tensors is not None:  # RNG states and a dict argument's tensors are no arguments
        apart = passed_apart(tensors, case.literals, tuple(case.context.rng.values()))
        tensors = [name for name in tensors if name not in apart]
    given = {*case.literals, *(tensors or ())}
    shown = f"{target}({', '.join(params.names)})"
    problems = []
    if not params.var_keyword:
        for name in case.literals:
            if name not in params.keyword:
                problems.append(CaseFormatError(
                    case.case_file, f"[inputs] '{name}' is not a parameter of {shown}; remove it "
                    "or add the parameter"))
        for name in sorted(tensors or ()):
            if name not in params.keyword and name not in case.literals:
                problems.append(CaseFormatError(
                    case.inputs_file, f"tensor '{name}' is not a parameter of {shown}; save the "
                    "tensor under a parameter's name, or add the parameter"))
    holds = (f"holds: {', '.join(sorted(tensors)) or 'no tensors'}"
             if tensors is not None else f"there is no {INPUTS_FILE}")
    for name in params.required:
        if name not in given:
            problems.append(CaseFormatError(
                case.case_file, f"parameter '{name}' of {target} has no value: add it to "
                f"[inputs] or as a tensor in {INPUTS_FILE} ({holds})"))
    for name in params.positional_only:
        problems.append(CaseFormatError(
            case.case_file, f"parameter '{name}' of {target} is positional-only, and a case "
            "passes its inputs by name; make it a regular parameter"))
    return problems


def rng_problems(case: Case, tensors: Collection[str]) -> list[CaseFormatError]:
    """Each ``[context] rng`` state the payload (holding ``tensors``; empty without a payload)
    does not hold: the run cannot restore it, and a random op would draw other numbers.

    Only the name is checked. The run converts a state to uint8 and torch checks
    only its number of bytes, which depends on the torch version and the device:
    a header alone cannot tell a wrong one.
    """
    return [CaseFormatError(case.case_file, f"names '{name}', which {INPUTS_FILE} does not "
                            "hold; save the state there or remove the key",
                            key=f"[context] rng.{device_type}")
            for device_type, name in case.context.rng.items() if name not in tensors]

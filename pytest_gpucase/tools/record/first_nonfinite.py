"""Narrowing a non-finite output: the first submodule that made NaN or inf of finite inputs.

A NaN is no op's error, so ``narrow``'s op search finds nothing for it. Instead, in a
forked child, the watched module's case is replayed with forward hooks on every module
(``torch.nn.modules.module`` global hooks: the rebuilt model's modules are not the
parent's), and the first module to finish (innermost first) whose output holds NaN or inf
while every floating tensor it was passed is finite is the one that made it. Its arguments
come back to the parent, which writes its case as it writes an exception's innermost
submodule's (``narrow.write_narrowed``'s ``entered``), with the finite check on. Where no
submodule qualifies, the child says why: the module's inputs were not finite already, the
value arose in the module's own code between its submodules, or the replay stayed finite.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pytest_gpucase.base.tensors import named_tensors, tensor_versions, tensors_in
from pytest_gpucase.case.keys import REPLAY_ENV
from pytest_gpucase.run.replay import replay_module

__all__ = ["find_first_nonfinite", "nonfinite_names"]


def nonfinite_names(value: Any, name: str) -> list[str]:
    """The names of the floating tensors in ``value`` that hold NaN or inf."""
    import torch

    found = []
    for path, tensor in named_tensors(value, name):
        if (tensor.is_floating_point() or tensor.is_complex()) and not tensor.is_meta \
                and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            found.append(path)
    return found


class _Search:
    """The global hooks' state: each module's argument versions when it was entered, and
    the first module that finished with a non-finite output."""

    def __init__(self) -> None:
        self.versions: dict[int, list[dict[int, int]]] = {}
        self.modules: dict[int, Any] = {}     # every module entered, by id, in order
        self.found: tuple[Any, Any, Any] | None = None   # (module, args, kwargs)
        self.first_bad: tuple[Any, list[str]] | None = None  # first non-finite output
        self.changed: str = ""

    def enter(self, module: Any, args: Any) -> None:
        self.modules.setdefault(id(module), module)
        self.versions.setdefault(id(module), []).append(tensor_versions(list(tensors_in(args))))

    def leave(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        stack = self.versions.get(id(module)) or [{}]
        versions = stack.pop()
        if self.found is not None or not nonfinite_names(output, "out"):
            return
        bad_inputs = nonfinite_names((args, kwargs), "in")
        if self.first_bad is None:
            self.first_bad = (module, bad_inputs)
        if bad_inputs:
            return   # passed on, not made here: an enclosing module made it
        now = tensor_versions(list(tensors_in(args)))
        if any(now.get(key, version) != version for key, version in versions.items()):
            self.changed = type(module).__qualname__
            return
        self.found = (module, args, kwargs)


def _name_in(module: Any, modules: dict[int, Any]) -> tuple[str, Any] | None:
    """``module``'s qualified name in the outermost of ``modules`` that holds it (the
    rebuilt model, or the outermost module its method called), and that one. Each module
    entered is walked once: those inside a walked one are not roots."""
    roots: list[tuple[Any, dict[int, str]]] = []
    inside: set[int] = set()
    for key, candidate in modules.items():
        if key in inside:
            continue
        names = {id(m): n for n, m in candidate.named_modules()}
        inside.update(names)
        roots = [(r, n) for r, n in roots if id(r) not in names]  # it holds an earlier one
        roots.append((candidate, names))
    for root, names in roots:
        if id(module) in names:
            return names[id(module)], root
    return None


def find_first_nonfinite(case_dir: str, out_file: str) -> dict[str, Any] | str:
    """In a child: replay the module case at ``case_dir`` and return the first submodule
    whose output held NaN or inf of finite inputs, ``{"qualname", "type"}``, its arguments
    saved to ``out_file`` (``torch.save`` of ``(args, kwargs)``, detached, loadable with
    ``weights_only``); else why none is, in words."""
    import torch
    from torch.utils._pytree import tree_map_only

    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.child import load_arguments
    from pytest_gpucase.run.context import replay_context

    os.environ[REPLAY_ENV] = "1"
    case = load_case(Path(case_dir))
    inputs, rng = load_arguments(case)
    given = {k: v for k, v in inputs.items() if k != "gpucase_module"
             and not k.startswith(("state.", "context."))}
    search = _Search()
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(search.enter),
             torch.nn.modules.module.register_module_forward_hook(search.leave,
                                                                  with_kwargs=True)]
    try:
        with replay_context(case.context, "cpu", rng):
            replay_module(**inputs)
    except Exception:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    bad_given = nonfinite_names(given, "input")
    if bad_given:
        return (f"the module's inputs already hold NaN or inf ({', '.join(bad_given[:3])}): "
                "it was made before the module was called")
    if search.found is None:
        return _why_none(search)
    module, args, kwargs = search.found
    named = _name_in(module, search.modules)
    if named is None:
        return f"{type(module).__qualname__} made NaN or inf, but it is no part of the model"
    qualname, _ = named
    if not qualname:
        return (f"no submodule's output held NaN or inf of finite inputs: the value arose "
                f"in {type(module).__qualname__}'s own forward, between its submodules")
    # Detached: a tensor autograd computed is not sent to the parent (no pickle of it).
    passed = tree_map_only(torch.Tensor, lambda t: t.detach(), (tuple(args), dict(kwargs)))
    try:
        torch.save(passed, out_file)
        torch.load(out_file, weights_only=True)
    except Exception as exc:
        return (f"{qualname} ({type(module).__qualname__}) made it, but was passed what a "
                f"case cannot hold ({type(exc).__name__}): no submodule case written")
    return {"qualname": qualname, "type": type(module).__qualname__}


def _why_none(search: _Search) -> str:
    """Why no submodule is the one that made the non-finite value."""
    if search.changed:
        return (f"{search.changed} made NaN or inf but changed its inputs in place, so its "
                "inputs as passed are gone")
    if search.first_bad is None:
        return ("no module's output held NaN or inf in the forward pass of the case's replay "
                "on the CPU (a value made in the backward pass, or only on the device it "
                "was recorded on)")
    module, bad_inputs = search.first_bad
    named = _name_in(module, search.modules)
    where = named[0] if named and named[0] else type(module).__qualname__
    return (f"the first module whose output held NaN or inf, {where}, was passed "
            f"{', '.join(bad_inputs[:3])} not finite already: the value arose in code "
            "between modules (a function, not a submodule)")

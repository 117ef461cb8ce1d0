"""Narrowing a watched module's failure: how a replay rebuilds a module (a factory, or a
torch.nn built-in's constructor arguments read back), its state on the host, and the cases
of the innermost submodule that raised and of the single ATen op that raised (found in a
child under a dispatch mode), each written beside the module's case and kept only if it
reproduces the failure class in a fresh child.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.tensors import is_tensor
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import (
    MODULE_KEY,
    OP_KEY,
    REPLAY_ENV,
    REPLAY_MODULE,
    REPLAY_OP,
    STATE_PREFIX,
)
from pytest_gpucase.case.model import INPUTS_FILE
from pytest_gpucase.run.replay import replay_module
from pytest_gpucase.tools.record.inputs import (
    NOT_LITERAL,
    Before,
    as_literal,
    collect,
    numeric_context,
    storable,
)
from pytest_gpucase.tools.record.origin import (
    Context,
    error_line,
    import_name,
    mib,
    read_tail,
    say,
    shown,
    triage_of,
    watched_call,
)
from pytest_gpucase.tools.record.write import (
    Draft,
    case_bytes,
    case_draft,
    context_doc,
    sized,
    write_kept,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Rebuild", "module_state", "note_narrowed_size", "on_host", "rebuild_of",
           "write_narrowed"]

# The narrowed cases of one failure above this size in total get a note: each is a copy.
_NARROWED_NOTE_SIZE = 32 * 2**20


@dataclass(frozen=True)
class Rebuild:
    """How a replay rebuilds a module: an importable factory and its literal arguments."""

    factory: str | None
    kwargs: Mapping[str, Any]
    why_not: str = ""


def rebuild_of(module: torch.nn.Module, factory: str | None,
               kwargs: Mapping[str, Any] | None) -> Rebuild:
    """The factory given at watch time, or the module's class called with the constructor
    arguments read back from its same-named attributes (what torch.nn built-ins keep)."""
    if factory is not None:
        literal = as_literal(dict(kwargs or {}))
        if literal is NOT_LITERAL:
            return Rebuild(None, {}, f"rec.watch(..., kwargs=...) for {factory} holds values "
                           "TOML cannot: pass numbers, strings, booleans and lists only")
        return Rebuild(factory, literal)
    cls = type(module)
    fix = ("pass rec.watch(model, factory=\"package.module:make_model\", kwargs={...}) naming "
           "a function that builds it")
    target, why_not = import_name(cls, cls.__qualname__)
    if target is None:
        return Rebuild(None, {}, f"{cls.__qualname__} cannot be rebuilt by a replay "
                       f"({why_not.split(';')[0]}): {fix}")
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return Rebuild(None, {}, f"the constructor of {cls.__qualname__} has no readable "
                       f"signature: {fix}")
    found: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name in ("device",
                                                                                 "dtype"):
            continue
        value = getattr(module, name, NOT_LITERAL)
        if isinstance(param.default, bool) and not isinstance(value, bool) and (
                value is None or is_tensor(value)):
            value = value is not None  # Linear(bias=True) keeps bias as a Parameter or None
        literal = NOT_LITERAL if value is None else as_literal(value)
        if literal is not NOT_LITERAL:
            found[name] = literal
        elif value is None and param.default is None:
            continue
        elif param.default is param.empty:
            return Rebuild(None, {}, f"{cls.__qualname__}({name}=...) cannot be read back "
                           f"from the module: {fix}")
    return Rebuild(target, found)


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host: itself, detached, when it is there already."""
    return tensor.detach() if tensor.device.type == "cpu" else payload.to_device(tensor, "cpu")


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers on the host, under ``state.<name>``."""
    import torch

    state: dict[str, Any] = module.state_dict(keep_vars=True)
    return {f"{STATE_PREFIX}{name}": on_host(value).clone() for name, value in state.items()
            if isinstance(value, torch.Tensor) and storable(value)}


def write_narrowed(exc: BaseException, case_dir: Path, module: torch.nn.Module,
                   entered: tuple[str, torch.nn.Module, Any, Any, Mapping[int, int]],
                   rng: Mapping[str, torch.Tensor], *, root: Path,
                   stderr_file: Path | None, context: Context,
                   device_names: Mapping[str, str], kept: list[Path],
                   written: list[Path]) -> None:
    """Write the innermost failing submodule's case and its failing op's case beside
    ``case_dir``, each kept only if it reproduces the failure class in a fresh child.

    ``case_dir`` is the case of ``module``, the watched module, which took the RNG states
    ``rng``; ``entered`` is the innermost submodule still open when ``exc`` passed (its
    name, itself, its arguments and their version counters at the call). The cases kept
    are added to ``kept``, and those of them written here to ``written`` too.

    The submodule's inputs are the tensors it was called with, as they are now: when
    its forward changed one in place (its version counter moved since the call), they
    are not what was passed, so no submodule case is written and the op is searched
    for in a replay of the whole module's case, whose inputs were copied before."""
    import torch

    from pytest_gpucase.verdict.triage import failure_class

    qualname, sub, args, kwargs, versions = entered
    failure = failure_class(type(exc).__name__, str(exc), read_tail(stderr_file)
                            if stderr_file is not None else "")
    start = "spawn" if torch.cuda.is_initialized() else "fork"  # type: ignore[no-untyped-call]
    base = case_dir.name
    module_dir = case_dir
    if sub is not module:
        rebuild = rebuild_of(sub, None, None)
        if rebuild.factory is None:
            say(f"gpucase: note: {qualname} not narrowed: {rebuild.why_not}")
            return
        inner = watched_call(sub.forward, f"{base}.{qualname}", REPLAY_MODULE, None)
        recipe = {"factory": rebuild.factory, "kwargs": dict(rebuild.kwargs),
                  "training": bool(sub.training), "backward": False}
        found = triage_of(exc, "")
        inputs = collect(inner, args, kwargs, Before(versions=versions), found, exc)
        if inputs.changed:
            say(f"gpucase: note: {qualname} not narrowed: its forward changed "
                f"{', '.join(inputs.changed)} in place before it raised, so its "
                f"inputs as passed are gone ({shown(case_dir)} holds the "
                "module's inputs as passed)")
            _narrow_op(exc, case_dir, base, failure, start, root=root, kept=kept,
                       written=written)
            return
        numeric, rng_tensors = numeric_context(inputs.devices, rng)
        inputs = dataclasses.replace(
            inputs, tensors={**inputs.tensors, **module_state(sub), **rng_tensors},
            literals={**inputs.literals, MODULE_KEY: recipe})
        draft = case_draft(exc, inner, inputs, context, context.ids, "", device_names)
        draft = dataclasses.replace(draft, context=numeric, origin={
            **draft.origin, "narrowed_from": base, "module": qualname})
        saved, new = write_kept(root, draft, lambda tmp: _reproduces(tmp, failure, start))
        _report(saved, f"module {qualname}", new, kept, written)
        if saved is None:
            return
        module_dir = saved
    _narrow_op(exc, module_dir, base, failure, start, root=root, kept=kept, written=written)


def _narrow_op(exc: BaseException, module_dir: Path, base: str, failure: str | None,
               start: Any, *, root: Path, kept: list[Path], written: list[Path]) -> None:
    """Write the case of the single ATen op that raised in a replay of ``module_dir``."""
    import tempfile

    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.isolation import run_in_child

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / INPUTS_FILE
        child = run_in_child(_find_op, str(module_dir), str(out), timeout=300,
                             start_method=start)
        table = child.value if child.returned else None
        if not isinstance(table, dict) or not out.exists():
            # Nothing was written, so nothing was tried: say why, not "did not reproduce".
            why = (table if isinstance(table, str)
                   else f"the search for the op that raised failed ({child.problem})")
            say(f"gpucase: note: {why}: no op case written")
            return
        tensors = payload.load(out)
    case = load_case(module_dir)
    op = str(table["op"])
    draft = Draft(
        name=f"{base}.{op}", call=REPLAY_OP,
        summary=f"{op} raised {error_line(exc)} (narrowed from {base})",
        xfail=case.xfail, literals={OP_KEY: table},
        origin={**case.origin, "narrowed_from": base, "op": op},
        tensors=tensors, files={},
        context={k: v for k, v in context_doc(case).items() if k != "rng"})
    saved, new = write_kept(root, draft, lambda tmp: _reproduces(tmp, failure, start))
    _report(saved, f"op {op}", new, kept, written)


def _report(saved: Path | None, what: str, new: bool, kept: list[Path],
            written: list[Path]) -> None:
    """Say what became of a narrowed case; ``new``: this call wrote ``saved`` (else it is
    the earlier copy of the same failure, and ``write_kept`` has said so)."""
    if saved is None:
        say(f"gpucase: note: the narrowed case of {what} did not reproduce the "
            "failure in a fresh child, so it was not kept")
        return
    kept.append(saved)
    if new:
        written.append(saved)
        say(f"gpucase: saved {shown(saved)} ({sized(saved)}narrowed to {what})")


def note_narrowed_size(case_dir: Path, written: list[Path]) -> None:
    """One note when the narrowed cases written for one failure are large: each holds
    its own copy of what it needs (a module's weights), so the bytes add up."""
    total = sum(case_bytes(path) for path in written)
    if total <= _NARROWED_NOTE_SIZE:
        return
    count = (f"the {len(written)} narrowed cases" if len(written) > 1
             else "the narrowed case")
    say(
        f"gpucase: note: {count} of this failure ({', '.join(map(shown, written))}) hold "
        f"{mib(total)} beside the {mib(case_bytes(case_dir))} of {shown(case_dir)}: "
        "each narrowed case holds its own copy of the tensors it needs (its module's "
        "weights, its inputs). Keep the narrowest case that reproduces and delete the "
        "others, or pass Recorder(narrow=False) to write the module's case alone")


def _encode_arg(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """An op argument as TOML data; tensors go to ``tensors`` as ``arg<i>``; None if not."""
    import torch

    if isinstance(value, torch.Tensor):
        name = f"arg{len(tensors)}"
        tensors[name] = value.detach().clone()
        return {"tensor": name}
    if value is None:
        return {"none": True}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode_arg(v, tensors) for v in value]
        return None if any(i is None for i in items) else {"list": items}
    literal = as_literal(value)
    return None if literal is NOT_LITERAL else {"value": literal}


def _find_op(case_dir: str, out_file: str) -> dict[str, Any] | str:
    """In a child: replay a module case under a dispatch mode and save the op that raises.

    Returns the ``[inputs] gpucase_op`` table and writes the op's tensors to ``out_file``;
    else why there is no op case: no single op raised (the failure is in Python code, or
    nothing raised), or the op's arguments cannot be saved.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only

    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.child import load_arguments, replay_context

    class Finder(TorchDispatchMode):  # type: ignore[no-untyped-call]
        failed: tuple[Any, Any, Any] | None = None

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            passed = (args, kwargs)
            if self.failed is None and func._schema.is_mutable:
                # An in-place op may write before it raises: keep its arguments as passed.
                passed = tree_map_only(torch.Tensor, lambda t: t.clone(), passed)
            try:
                return func(*args, **kwargs)
            except Exception:
                if self.failed is None:
                    self.failed = (func, *passed)
                raise

    os.environ[REPLAY_ENV] = "1"
    case = load_case(Path(case_dir))
    inputs, rng = load_arguments(case)
    finder = Finder()  # type: ignore[no-untyped-call]
    try:
        with replay_context(case.context, "cpu", rng), finder:
            replay_module(**inputs)
    except Exception:
        pass
    if finder.failed is None:
        return "no single ATen op raised"
    func, args, kwargs = finder.failed
    tensors: dict[str, Any] = {}
    encoded = [_encode_arg(a, tensors) for a in args]
    encoded_kwargs = {k: _encode_arg(v, tensors) for k, v in kwargs.items()}
    if any(e is None for e in [*encoded, *encoded_kwargs.values()]):
        return f"{func} raised, with arguments a case cannot hold"
    payload.save(Path(out_file), tensors)
    table: dict[str, Any] = {"op": str(func), "args": encoded}
    if encoded_kwargs:
        table["kwargs"] = encoded_kwargs
    return table


def _reproduces(case_dir: Path, failure: str | None, start_method: Any) -> bool:
    """Whether a case written to ``case_dir`` raises the captured failure class on the CPU,
    in a fresh child (the check that keeps a narrowed case)."""
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.parent import run_spec
    from pytest_gpucase.verdict.triage import failure_class, same_failure

    if failure is None:
        return False
    case = load_case(case_dir)
    verdict = run_spec(RunSpec(case, "cpu", "float32", cast=False), start_method=start_method,
                       backend="cpu", localize=False)
    outcome = verdict.outcome
    if outcome.error_type is None or outcome.broken_case:
        return False
    found = failure_class(outcome.error_type, outcome.error_message or "", verdict.child.stderr)
    return same_failure(failure, found)

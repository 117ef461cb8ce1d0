"""Narrowing a watched module's failure: the cases of the innermost submodule that raised
and of the single ATen op that raised (found in a child under a dispatch mode), each written
beside the module's case and kept only if it reproduces the same failure in a fresh child:
``verdict.failure.same_failure``, the failure class and the message's shape, so that a
failure no class names (a shape error, EmbeddingBag's range check) is narrowed too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.backends import AUTOCAST_DEVICE_TYPES
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import (
    CODE_OWNED,
    MODULE_KEY,
    OP_KEY,
    REPLAY_ENV,
    REPLAY_MODULE,
    REPLAY_OP,
)
from pytest_gpucase.case.model import INPUTS_FILE
from pytest_gpucase.run.replay import replay_module
from pytest_gpucase.run.runcontext import RunContext
from pytest_gpucase.verdict.failure import Failure, same_failure
from pytest_gpucase.verdict.triage import NONFINITE
from pytest_gpucase.tools.record.inputs import (
    NOT_LITERAL,
    Before,
    as_literal,
    collect,
    numeric_context,
)
from pytest_gpucase.tools.record.origin import (
    Context,
    class_of,
    error_line,
    message_of,
    mib,
    read_tail,
    say,
    shown,
    triage_of,
    watched_call,
)
from pytest_gpucase.tools.record.owned import code_owned
from pytest_gpucase.tools.narrowed import NARROWED_FROM, narrowed_xfail
from pytest_gpucase.tools.record.rebuild import module_state, rebuild_files, rebuild_of
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

__all__ = ["context_doc_of", "find_raising_op", "note_narrowed_size", "replayed_failure",
           "write_narrowed"]

# The narrowed cases of one failure above this size in total get a note: each is a copy.
_NARROWED_NOTE_SIZE = 32 * 2**20
# What the op search finds when nothing in the replay raised from an ATen op.
_NO_OP_RAISED = "no single ATen op raised"


def write_narrowed(exc: BaseException, case_dir: Path, module: torch.nn.Module,
                   entered: tuple[str, torch.nn.Module, Any, Any, Mapping[int, int]] | None,
                   rng: Mapping[str, torch.Tensor], *, root: Path,
                   stderr_file: Path | None, context: Context,
                   device_names: Mapping[str, str], kept: list[Path],
                   written: list[Path], recorded: Failure | None = None,
                   unreplayable: str = "") -> None:
    """Write the innermost failing submodule's case and its failing op's case beside
    ``case_dir``, each kept only if it reproduces the same failure in a fresh child; each
    not written is named on stderr with the reason (a ``gpucase: note:`` line).

    ``case_dir`` is the case of ``module``, the watched module, which took the RNG states
    ``rng``; ``entered`` is the innermost submodule still open when ``exc`` passed (its
    name, itself, its arguments and their version counters at the call), or None when
    only the op is looked for (a compiled forward, whose submodules' hooks do not run; a
    backward pass). The cases kept are added to ``kept``, and those of them written here
    to ``written`` too. ``recorded``, when given, is the failure the narrowed cases must
    keep instead of ``exc``'s (a compiled model's: the eager replay's failure).

    The submodule's inputs are the tensors it was called with, as they are now: when
    its forward changed one in place (its version counter moved since the call), they
    are not what was passed, so no submodule case is written and the op is searched
    for in a replay of the whole module's case, whose inputs were copied before.

    ``unreplayable`` says why the module's case cannot be replayed (the model cannot be
    rebuilt): the submodule's case, which needs no rebuild of the whole model, is written
    all the same, and the op is searched for in it; with no submodule case, no op case.
    """
    before = len(written)
    try:
        _write_narrowed(exc, case_dir, module, entered, rng, root=root,
                        stderr_file=stderr_file, context=context, device_names=device_names,
                        kept=kept, written=written, recorded=recorded,
                        unreplayable=unreplayable)
    except Exception as problem:  # a full disk, a name the file system refuses: said
        done = [shown(path) for path in written[before:]]
        say(f"gpucase: note: narrowing {case_dir.name} stopped: {error_line(problem)}; "
            + (f"written before it stopped: {', '.join(done)}; the narrower ones were not"
               if done else "no narrowed case was written")
            + " (the case itself is saved)")


def _write_narrowed(exc: BaseException, case_dir: Path, module: torch.nn.Module,
                    entered: tuple[str, torch.nn.Module, Any, Any, Mapping[int, int]] | None,
                    rng: Mapping[str, torch.Tensor], *, root: Path,
                    stderr_file: Path | None, context: Context,
                    device_names: Mapping[str, str], kept: list[Path],
                    written: list[Path], recorded: Failure | None,
                    unreplayable: str) -> None:

    if recorded is None:
        recorded = Failure(type(exc).__name__, message_of(exc),
                           read_tail(stderr_file) if stderr_file is not None else "",
                           _device_of(module))
    start = RunContext.here("cpu")
    base = case_dir.name
    module_dir = case_dir
    # A NaN no op raised: the first submodule that made it, found in a replay. No ATen op
    # raises for it either, so the op search then speaks only when it finds one.
    nonfinite = entered is None and class_of(exc) == NONFINITE
    if nonfinite and unreplayable:
        say(f"gpucase: note: no submodule case written for the non-finite value: it is "
            f"found by replaying a case, and {shown(case_dir)} cannot be replayed "
            f"({unreplayable})")
        return
    if nonfinite:
        entered = _first_nonfinite(case_dir, module, start)
    if entered is not None and entered[1] is not module:
        qualname, sub, args, kwargs, versions = entered
        rebuild = rebuild_of(sub, None, None, part_of=shown(case_dir))
        if rebuild.factory is None:
            say(f"gpucase: note: {qualname} not narrowed: {rebuild.why_not}")
            _narrow_op(exc, case_dir, base, recorded, start, root=root, kept=kept,
                       written=written, unreplayable=unreplayable, nonfinite=nonfinite)
            return
        inner = watched_call(sub.forward, f"{base}.{qualname}", REPLAY_MODULE, None)
        recipe: dict[str, Any] = {"factory": rebuild.factory, "kwargs": dict(rebuild.kwargs),
                                  "training": bool(sub.training), "backward": False}
        found = triage_of(exc, "")
        if class_of(exc) == NONFINITE:
            recipe["finite"] = True
        inputs = collect(inner, args, kwargs, Before(versions=versions), found, exc)
        if inputs.changed:
            say(f"gpucase: note: {qualname} not narrowed: its forward changed "
                f"{', '.join(inputs.changed)} in place before it raised, so its "
                f"inputs as passed are gone ({shown(case_dir)} holds the "
                "module's inputs as passed)")
            _narrow_op(exc, case_dir, base, recorded, start, root=root, kept=kept,
                       written=written, unreplayable=unreplayable, nonfinite=nonfinite)
            return
        numeric, rng_tensors = numeric_context(inputs.devices, rng)
        state = module_state(sub)
        if state.unsaved:
            say(f"gpucase: note: {qualname} not narrowed: "
                f"{state.why_incomplete(qualname, part_of=shown(case_dir))}")
            _narrow_op(exc, case_dir, base, recorded, start, root=root, kept=kept,
                       written=written, unreplayable=unreplayable, nonfinite=nonfinite)
            return
        if state.tied:
            recipe["tied"] = state.tied
        owned = code_owned(sub, rebuild, state.tensors)  # replayed from the code (record.owned)
        if owned:
            recipe[CODE_OWNED] = list(owned)
        inputs = dataclasses.replace(
            inputs, tensors={**inputs.tensors, **state.tensors, **rng_tensors},
            literals={**inputs.literals, MODULE_KEY: recipe})
        draft = case_draft(exc, inner, inputs, context, context.ids, "", device_names,
                           files=rebuild_files(rebuild, root))
        numeric.update(context_doc_of(case_dir, "autocast"))
        draft = dataclasses.replace(draft, context=numeric, origin={
            **draft.origin, NARROWED_FROM: base, "module": qualname},
            xfail=draft.xfail and narrowed_xfail(error_line(exc), base, f"module {qualname}"))
        saved, new = write_kept(root, draft, lambda tmp: _reproduces(tmp, recorded, start))
        _report(saved, f"module {qualname}", new, kept, written)
        if saved is not None:
            module_dir, unreplayable = saved, ""
    _narrow_op(exc, module_dir, base, recorded, start, root=root, kept=kept, written=written,
               unreplayable=unreplayable, nonfinite=nonfinite)


def _first_nonfinite(case_dir: Path, module: torch.nn.Module, start: RunContext,
                     ) -> tuple[str, torch.nn.Module, Any, Any, Mapping[int, int]] | None:
    """The first submodule of ``module`` whose output held NaN or inf of finite inputs in a
    replay of ``case_dir`` (``first_nonfinite``), as ``write_narrowed``'s ``entered``: its
    name, the submodule, and the arguments it was passed in the replay; None, said with
    the reason, when there is none."""
    import tempfile

    import torch

    from pytest_gpucase.base.tensors import tensor_versions, tensors_in
    from pytest_gpucase.run.isolation import run_in_child
    from pytest_gpucase.tools.record.first_nonfinite import find_first_nonfinite

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "passed.pt"
        with outside_autocast():
            child = run_in_child(find_first_nonfinite, str(case_dir), str(out), timeout=300,
                                 start_method=start.start_method)
        found = child.value if child.returned else None
        passed = (torch.load(out, weights_only=True)
                  if isinstance(found, dict) and out.exists() else None)
    if not isinstance(found, dict) or passed is None:
        why = (found if isinstance(found, str)
               else f"the search for it failed ({child.problem})")
        say(f"gpucase: note: no submodule case written for the non-finite value: {why}")
        return None
    qualname = str(found["qualname"])
    try:
        sub = module.get_submodule(qualname)
    except AttributeError:
        sub = None
    if sub is None or type(sub).__qualname__ != found["type"]:
        say(f"gpucase: note: no submodule case written for the non-finite value: "
            f"{found['type']} {qualname} made it in the replay, but the model has no such "
            "submodule")
        return None
    say(f"gpucase: note: {qualname} ({found['type']}) is the first submodule whose output "
        "held NaN or inf of finite inputs, in a replay of the model's case")
    args, kwargs = passed
    return qualname, sub, args, kwargs, tensor_versions(tensors_in((args, kwargs)))


def _device_of(module: torch.nn.Module) -> str | None:
    """The device type the module computed on (where the failure happened)."""
    for tensor in module.parameters():
        return str(tensor.device.type)
    return None


def context_doc_of(case_dir: Path, key: str) -> dict[str, Any]:
    """``{key: value}`` of the ``[context]`` of the case at ``case_dir``, if it has it: a
    narrowed case runs in the numeric context its module's case recorded."""
    from pytest_gpucase.case.load import load_case

    try:
        table = context_doc(load_case(case_dir))
    except Exception:
        return {}
    return {key: table[key]} if key in table else {}


def _narrow_op(exc: BaseException, module_dir: Path, base: str,
               recorded: Failure, start: RunContext, *, root: Path, kept: list[Path],
               written: list[Path], unreplayable: str = "", nonfinite: bool = False) -> None:
    """Write the case of the single ATen op that raised in a replay of ``module_dir``; none,
    said with the reason, when that case cannot be replayed (``unreplayable``).

    ``nonfinite``: the failure is a non-finite value no op raised, whose story the notes on
    its first submodule have told; that no ATen op raised is then no news, and is not said
    (an op that does raise, multinomial's check of its probabilities, still gets a case)."""
    if unreplayable:
        say(f"gpucase: note: no op case written: the op that raised is found by replaying "
            f"a case, and {shown(module_dir)} cannot be replayed ({unreplayable})")
        return

    from pytest_gpucase.case.load import load_case

    with outside_autocast():
        found = find_raising_op(module_dir, timeout=300, start=start)
    if isinstance(found, str):
        # Nothing was written, so nothing was tried: say why, not "did not reproduce".
        if not (nonfinite and found == _NO_OP_RAISED):
            say(f"gpucase: note: {found}: no op case written")
        return
    table, tensors = found
    case = load_case(module_dir)
    op = str(table["op"])
    draft = Draft(
        name=f"{base}.{op}", call=REPLAY_OP,
        summary=f"{op} raised {error_line(exc)} (narrowed from {base})",
        xfail=case.xfail and narrowed_xfail(error_line(exc), base, f"op {op}"),
        literals={OP_KEY: table}, origin={**case.origin, NARROWED_FROM: base, "op": op},
        tensors=tensors, files={},
        # The op's arguments are recorded as it received them, after autocast cast them (or
        # not: a region with autocast off): autocast applied again around the op would cast
        # them alike, and a dtype mismatch it raised with would be gone.
        context={k: v for k, v in context_doc(case).items() if k not in ("rng", "autocast")})
    saved, new = write_kept(root, draft, lambda tmp: _reproduces(tmp, recorded, start))
    _report(saved, f"op {op}", new, kept, written)


def find_raising_op(case_dir: Path, *, timeout: float, start: RunContext | None = None,
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | str:
    """The single ATen op that raises in a replay of the case at ``case_dir`` (any case: a
    model's, a function's, one written by hand), found in a fresh child under a dispatch
    mode: its ``[inputs] gpucase_op`` table and the tensors it names; else why not."""
    import tempfile

    from pytest_gpucase.run.isolation import run_in_child

    start = start or RunContext.here("cpu")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / INPUTS_FILE
        child = run_in_child(_find_op, str(case_dir), str(out), timeout=timeout,
                             start_method=start.start_method)
        table = child.value if child.returned else None
        if not isinstance(table, dict) or not out.exists():
            return (table if isinstance(table, str)
                    else f"the search for the op that raised failed ({child.problem})")
        return table, payload.load(out)


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
    """One note when the narrowed cases written for one failure add much beside the module's
    case: the tensors they share with it (a module's weights) are stored once, in the capture
    folder's store, so this counts only what each holds of its own."""
    total = 0
    seen = [case_dir]
    for path in written:
        total += case_bytes(path, besides=seen)
        seen.append(path)
    if total <= _NARROWED_NOTE_SIZE:
        return
    count = (f"the {len(written)} narrowed cases" if len(written) > 1
             else "the narrowed case")
    say(
        f"gpucase: note: {count} of this failure ({', '.join(map(shown, written))}) add "
        f"{mib(total)} beside the {mib(case_bytes(case_dir))} of {shown(case_dir)} (what they "
        "share with it is stored once): keep the narrowest case that reproduces and delete "
        "the others, or pass Recorder(narrow=False) to write the module's case alone")


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
    """In a child: replay a case under a dispatch mode and save the op that raises.

    Returns the ``[inputs] gpucase_op`` table and writes the op's tensors to ``out_file``;
    else why there is no op case: no single op raised (the failure is in Python code, or
    nothing raised), or the op's arguments cannot be saved.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only

    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.child import load_arguments, resolve
    from pytest_gpucase.run.context import replay_context

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
    finder, composite = Finder(), _composite_mode()  # type: ignore[no-untyped-call]
    try:
        # The case's own call: replay_module for a model's case, the function otherwise.
        call = replay_module if case.call == REPLAY_MODULE else resolve(case, case.call, "call")
        with replay_context(case.context, "cpu", rng), composite, finder:
            call(**inputs)
    except Exception:
        pass
    failed = finder.failed or composite.aten()
    if failed is None:
        return _NO_OP_RAISED
    func, args, kwargs = failed
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


def _composite_mode() -> Any:
    from torch.overrides import TorchFunctionMode

    class Composite(TorchFunctionMode):
        """The innermost torch function that raised, for a composite ATen op that raises in
        its own C++ body (``one_hot``'s class check), which no dispatch mode sees: its name is
        the ATen op's (``torch._C._nn.one_hot``, ``aten.one_hot.default``)."""

        failed: tuple[Any, Any, Any] | None = None

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            try:
                return func(*args, **kwargs)
            except Exception:
                if self.failed is None:   # the innermost raises first
                    self.failed = (func, args, kwargs)
                raise

        def aten(self) -> tuple[Any, Any, Any] | None:
            """The ATen op of that name with its ``default`` overload, and its arguments."""
            import torch

            if self.failed is None:
                return None
            func, args, kwargs = self.failed
            packet = getattr(torch.ops.aten, str(getattr(func, "__name__", "")), None)
            op = getattr(packet, "default", None) if packet is not None else None
            return None if op is None else (op, args, kwargs)

    return Composite()


def _reproduces(case_dir: Path, recorded: Failure, ctx: RunContext) -> bool:
    """Whether a case written to ``case_dir`` raises the recorded failure on the CPU, in a
    fresh child (the check that keeps a narrowed case): ``verdict.failure.same_failure``,
    the one definition the verdicts share (the failure class, and the message's shape)."""
    found = replayed_failure(case_dir, ctx)
    return isinstance(found, Failure) and same_failure(recorded, found)


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Autocast off, on every device type, while a replay's child is forked: a failure is
    saved while the training code's autocast region is still entered (a module's hook
    raises inside it), and a forked child inherits that thread's autocast state; the case
    says its own (``[context] autocast``), and an op case none (its arguments are recorded
    in the dtypes autocast gave them)."""
    import torch

    kinds = [kind for kind in AUTOCAST_DEVICE_TYPES if _autocast_enabled(torch, kind)]
    for kind in kinds:
        torch.set_autocast_enabled(kind, False)
    try:
        yield
    finally:
        for kind in kinds:
            torch.set_autocast_enabled(kind, True)


def _autocast_enabled(torch: Any, kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except (RuntimeError, TypeError, ValueError):
        return False  # a device type this build does not know


def replayed_failure(case_dir: Path, ctx: RunContext) -> Failure | str:
    """How the case in ``case_dir`` fails when replayed on the CPU in a fresh child, run as
    every entry point runs a case (``run_spec`` in ``ctx``): its Failure (``failure_of``, the
    one reading of a failed run), or in words why there is none (it passed; the case itself
    is broken)."""
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.parent import failure_of, run_spec

    case = load_case(case_dir)
    with outside_autocast():
        verdict = run_spec(RunSpec(case, "cpu", "float32", cast=False),
                           replace(ctx, localize=False))
    if verdict.outcome.broken_case:
        return f"the case cannot run: {verdict.outcome.summary}"
    found = failure_of(verdict)
    return found if found is not None else "it passes"

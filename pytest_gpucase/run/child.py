"""What a child does for one ``RunSpec``: load inputs, build the variant, cast and move,
call, compute the reference, compare; and return a picklable ``Outcome``.

Runs in the isolated child only: it imports torch and may touch the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Imported at module level on purpose: the parent imports this module before
# forking, so every child inherits torch, safetensors and the comparator
# already loaded instead of importing them again per run.
import safetensors.torch  # noqa: F401
import torch

from pytest_gpucase.base import backends
from pytest_gpucase.base.errors import CaseFormatError, display
from pytest_gpucase.base.tensors import field_names, indexed, named_tensors, tensor_versions
from pytest_gpucase.case import golden, payload, project
from pytest_gpucase.case.binding import Parameters, binding_problems, rng_problems
from pytest_gpucase.case.keys import MODULE_KEY, REPLAY_ENV, REPLAY_MODULE, tensor_dicts
from pytest_gpucase.case.model import Case, Expectation, ReplayContext
from pytest_gpucase.case.variants import (
    BrokenVariant,
    Variant,
    VariantNotApplicable,
)
from pytest_gpucase.case.variants import (
    apply as apply_variant,
)
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import reference_cache
from pytest_gpucase.run.isolation import note
from pytest_gpucase.verdict.compare import Comparison, Tolerance, combine, compare

__all__ = [
    "MAX_OUTPUT_DEPTH",
    "OUTPUT_MARKS",
    "REFERENCE_OUTPUT",
    "SETTINGS",
    "Outcome",
    "load_arguments",
    "load_inputs",
    "prepare",
    "replay_context",
    "resolve",
    "run",
    "upcast",
    "user_traceback",
    "write_golden",
]


@dataclass(frozen=True)
class Outcome:
    """The verdict of one run, as plain data that crosses the process boundary."""

    status: Literal["passed", "failed", "skipped"]
    summary: str                       # one line a person reads first
    details: str = ""                  # the mismatch report or traceback
    error_type: str | None = None      # the exception raised by the call, if any
    # Its text; for outputs that differ, where and what (Comparison.where): what "the same
    # failure" compares (verdict.failure), as the numbers of the summary change with inputs.
    error_message: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    # What happened, for tools that sort failures (minimize, ablate): "passed", "skipped",
    # "mismatch", "golden mismatch", "raises", "reference raises", "no exception",
    # "bad output" (one that cannot be walked: nested too deep, or holding itself),
    # "broken case" (the case itself is wrong: file, import), "crash", "timeout".
    kind: str = ""

    @property
    def broken_case(self) -> bool:
        return self.kind == "broken case"


class _Failed(Exception):
    """Ends a run early with a failed outcome."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.summary)
        self.outcome = outcome


# How deep outputs may nest. The walks over them (detach here, the comparison, the golden
# file) recurse, so a deeper output, or one that holds itself, would end in a RecursionError
# blamed on the call, which returned normally; 200 levels leave those walks room below
# Python's default limit of 1000 frames, and no real output comes near.
MAX_OUTPUT_DEPTH = 200


class _BadOutput(Exception):
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
        elif isinstance(key, _Field):
            path = f"{path}.{key}"
        else:
            path = indexed(path, key)
    return path


def run(spec: RunSpec) -> Outcome:
    """Run ``spec`` in this process and judge its outputs (call it in a fresh child)."""
    # A Recorder in the replayed code must not capture its own replay as a new case.
    os.environ[REPLAY_ENV] = "1"
    # The user's code is imported as every gpucase tool imports it (project.py).
    project.prepend(project.import_paths(spec.case.path))
    try:
        return _run(spec)
    except _Failed as failed:
        return failed.outcome
    except CaseFormatError as exc:
        return Outcome("failed", str(exc), error_type="CaseFormatError", error_message=str(exc),
                       kind="broken case")
    except VariantNotApplicable as exc:
        return Outcome("skipped", str(exc), kind="skipped")


def _run(spec: RunSpec) -> Outcome:
    case = spec.case
    inputs, rng = load_arguments(case)
    expect = case.expect
    if spec.variant is not None:
        try:
            inputs = apply_variant(spec.variant, inputs)
        except BrokenVariant as exc:  # too large, or boundaries on no class indices
            table = "boundaries" if spec.variant.kind == "boundary" else spec.variant.kind
            raise CaseFormatError(case.case_file, str(exc), key=f"[variants] {table}") from None
        if spec.variant.reject is not None:
            expect = spec.variant.reject
        elif spec.variant.kind == "boundary":
            # An in-range class index must be accepted and give the reference's outputs.
            expect = dataclasses.replace(expect, outcome="matches", exception=None, match=None)
    func = resolve(case, case.call, "call")
    check_binding(case, case.call, func, inputs)
    if spec.use_reference and case.reference:
        func = resolve(case, case.reference, "reference")
        check_binding(case, case.reference, func, inputs)
    apply_settings(spec.settings)  # after the imports, so that no module-level code undoes it
    run_inputs = prepare(inputs, spec.device, spec.dtype if spec.cast else None)
    context = case.context
    if expect.outcome == "raises":
        with replay_context(context, spec.device, rng):
            return _check_raises(func, run_inputs, expect, spec.device,
                                 spec.variant if spec.variant and spec.variant.reject else None)
    began = time.perf_counter()
    versions = tensor_versions(_tensors(run_inputs))
    try:
        with replay_context(context, spec.device, rng):
            actual = _call(func, run_inputs, expect.gradients, spec.device)
    except _BadOutput as problem:  # the call returned: what it returned is the problem
        return problem.outcome("the call's")
    except _NothingDifferentiated as problem:
        raise problem.error(case, "the call") from None
    except BaseException as exc:  # SystemExit and the like too: see _raised
        return _raised("the call", exc)
    returned = f"the call itself returned after {time.perf_counter() - began:.3g} s"
    comparing = f"while comparing the outputs ({returned})"
    note(comparing)  # a timeout from here on is not the call's
    reference = func
    if case.reference:
        reference = resolve(case, case.reference, "reference")
        check_binding(case, case.reference, reference, run_inputs)
    cached = reference_cache.entry(spec, reference)
    expected = reference_cache.load(cached)
    comparison = _compare(actual, expected, expect) if expected is not None else None
    if comparison is None or not comparison.ok:
        # Computed here on a miss, and again on a failure: a failure never rests on the cache.
        began = time.perf_counter()
        note(f"while computing the float64 reference on the CPU ({returned})")
        try:
            # The same random draws and grad mode, in float64 on the CPU.
            with (_rng_restored(rng, "cpu"), torch.set_grad_enabled(grad_mode(context)),
                  _labelled_output(REFERENCE_OUTPUT)):
                expected = _call(reference, upcast(_as_saved(spec, run_inputs, versions)),
                                 expect.gradients, "cpu")
        except _BadOutput as problem:
            return problem.outcome("the reference's")
        except _NothingDifferentiated as problem:
            raise problem.error(case, "the reference") from None
        except BaseException as exc:  # SystemExit and the like too: see _raised
            return _raised("the reference (on CPU in float64)", exc, "reference raises")
        reference_cache.store(cached, expected, time.perf_counter() - began)
        note(comparing)
        comparison = _compare(actual, expected, expect)
    if not comparison.ok:
        return Outcome("failed", f"outputs differ from the reference: {comparison.headline()}",
                       details=comparison.report(), error_message=comparison.where(),
                       kind="mismatch",
                       max_abs=comparison.max_abs, max_rel=comparison.max_rel)
    if spec.variant is None and case.expected_file.exists():
        against_golden = _compare(actual, golden.load(case.expected_file), expect)
        if not against_golden.ok:
            return Outcome(
                "failed", f"outputs match the reference but differ from the golden "
                f"{case.expected_file.name}; if the change is intended, rewrite it with "
                "--gpu-cases-regen", details=against_golden.report(),
                error_message=against_golden.where(),
                max_abs=against_golden.max_abs, max_rel=against_golden.max_rel,
                kind="golden mismatch")
        return Outcome("passed", f"outputs match the reference and {case.expected_file.name}",
                       kind="passed",
                       max_abs=comparison.max_abs, max_rel=comparison.max_rel)
    return Outcome("passed", "outputs match the reference", kind="passed",
                   max_abs=comparison.max_abs, max_rel=comparison.max_rel)


def write_golden(case: Case) -> dict[str, str]:
    """Compute the reference results on the saved inputs and write them as the case's golden:
    ``{"written": path}``, or ``{"refused": why}`` for outputs a golden cannot hold (the
    output's problem, not the code's: said in one line, with no traceback)."""
    project.prepend(project.import_paths(case.path))
    inputs = load_inputs(case)
    key = "reference" if case.reference else "call"
    reference = resolve(case, case.reference or case.call, key)
    check_binding(case, case.reference or case.call, reference, inputs)
    not_written = f"{display(case.expected_file)} not written"
    try:
        with torch.set_grad_enabled(grad_mode(case.context)):
            results = _call(reference, upcast(inputs), case.expect.gradients, "cpu")
    except _BadOutput as problem:
        whose = f"the {key}'s"
        return {"refused": f"{not_written}: {problem.message(whose)}"}
    except _NothingDifferentiated as problem:
        return {"refused": f"{not_written}: {problem.KEY}: {problem.message(f'the {key}')}"}
    try:
        golden.save(case.expected_file, results)
    except golden.Unstorable as exc:
        return {"refused": str(exc)}
    return {"written": str(case.expected_file)}


# Written before the reference's output: a case that prints shows its lines twice, from the
# call and from the reference, which is otherwise hard to tell apart.
REFERENCE_OUTPUT = "--- gpucase: the reference (float64 on CPU) runs from here ---\n"
# The capture's marks (isolation): a clipped capture whose omitted middle holds the label
# says so, or its tail, all of it the reference's output, would read as the call's.
OUTPUT_MARKS = {REFERENCE_OUTPUT: "the reference's output (float64 on CPU) begins inside them"}


@contextlib.contextmanager
def _labelled_output(label: str) -> Iterator[None]:
    """Write ``label`` to stdout and to stderr just before the block's first text on each.

    Only a stream the block writes to is labelled, so that a quiet reference adds no captured
    section to a report. Text written through ``sys.stdout``/``sys.stderr`` (print, logging,
    warnings shown) is seen; a write to the file descriptor itself (C code, a subprocess)
    is not, and stays unlabelled as before.
    """
    patched: list[Any] = []
    for stream in {id(s): s for s in (sys.stdout, sys.stderr) if s is not None}.values():
        def labelled(text: str, stream: Any = stream, write: Any = stream.write) -> Any:
            if text:
                delattr(stream, "write")  # the stream's own write again: one label
                write(label)
            return write(text)

        try:
            setattr(stream, "write", labelled)  # noqa: B010 - an instance's method, for a while
        except AttributeError:  # a stream that takes no attribute: labelled at once
            with contextlib.suppress(Exception):
                stream.write(label)
            continue
        patched.append(stream)
    try:
        yield
    finally:
        for stream in patched:
            with contextlib.suppress(AttributeError):  # gone at the first write
                delattr(stream, "write")


def _tf32_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _cudnn_off() -> None:
    torch.backends.cudnn.enabled = False


def _deterministic() -> None:
    # cuBLAS needs a fixed workspace for deterministic results (CUDA >= 10.2).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C,
                                                               "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(True)
    else:
        # The public call imports inductor (about 2 s per child) only to set its flag;
        # inductor reads the same setting from this variable if it is imported later.
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
        torch._C._set_deterministic_algorithms(True)


def _compile_off() -> None:
    if "torch._dynamo" in sys.modules:
        torch._dynamo.config.disable = True
    else:  # read by dynamo's config when it is first imported; importing it costs seconds
        os.environ["TORCH_COMPILE_DISABLE"] = "1"


# Switches a run can turn before the call (one change at a time, for ablation).
SETTINGS: dict[str, Callable[[], None]] = {
    "tf32_off": _tf32_off,
    "cudnn_off": _cudnn_off,
    "deterministic": _deterministic,
    "compile_off": _compile_off,
}


def apply_settings(names: tuple[str, ...]) -> None:
    """Turn the named switches in this (child) process."""
    for name in names:
        SETTINGS[name]()


def load_inputs(case: Case) -> dict[str, Any]:
    """The case's keyword arguments: ``[inputs]`` literals and the saved tensors."""
    return load_arguments(case)[0]


def load_arguments(case: Case) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The case's keyword arguments, and apart from them the RNG states ``[context] rng``
    names in the payload (device type -> uint8 state tensor)."""
    if case.inputs_sha256 is not None:
        if not os.path.lexists(case.inputs_file):
            raise CaseFormatError(case.case_file, f"names a hash but {case.inputs_file.name} is "
                                  "missing; restore the file or remove the key",
                                  key="inputs_sha256")
        found = payload.content_hash(case.inputs_file)
        if found != case.inputs_sha256:
            raise CaseFormatError(case.inputs_file, f"content hash {found} differs from "
                                  f"inputs_sha256 in {case.case_file.name} (changed or corrupted "
                                  "since the case was saved); restore it, or if the change is "
                                  f"intended set inputs_sha256 = \"{found}\"")
    # lexists: a dangling symlink is a broken payload, not an absent one.
    tensors = payload.load(case.inputs_file) if os.path.lexists(case.inputs_file) else {}
    missing = rng_problems(case, tensors)
    if missing:
        raise missing[0]  # validate reports the same, from the header alone
    rng = {device_type: tensors.pop(name) for device_type, name in case.context.rng.items()}
    clash = sorted(set(tensors) & set(case.literals))
    if clash:
        raise CaseFormatError(case.case_file, f"{', '.join(clash)} given both here and in "
                              f"{case.inputs_file.name}; keep one", key="[inputs]")
    literals = dict(case.literals)
    for name, members in tensor_dicts(case.literals).items():
        literals[name] = _tensor_dict(case, name, members, tensors)
    recipe = literals.get(MODULE_KEY)
    if (case.call == REPLAY_MODULE and isinstance(recipe, Mapping)
            and str(recipe.get("factory", "")).partition(":")[0].endswith(".py")):
        # "case.py:make": imported from the case directory, as a "FILE.py" call is.
        literals[MODULE_KEY] = {**recipe, "factory": resolve(
            case, str(recipe["factory"]), f"[inputs] {MODULE_KEY}.factory")}
    return {**literals, **tensors}, rng


def _tensor_dict(case: Case, name: str, members: Any,
                 tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dict argument ``name`` rebuilt from its payload tensors (taken out of ``tensors``)."""
    key = f"[inputs] {name}.gpucase_tensors"
    if not isinstance(members, Mapping) or not all(isinstance(v, str)
                                                   for v in members.values()):
        raise CaseFormatError(case.case_file, "must be a table of dict key = \"payload name\", "
                              "as capture writes it", key=key)
    missing = sorted(set(members.values()) - set(tensors))
    if missing:
        raise CaseFormatError(case.case_file, f"names {', '.join(missing)}, which "
                              f"{case.inputs_file.name} does not hold; save the tensors there "
                              "under those names or correct the table", key=key)
    return {str(k): tensors.pop(v) for k, v in members.items()}


@contextlib.contextmanager
def _rng_restored(rng: Mapping[str, torch.Tensor], device: str) -> Iterator[None]:
    """Set the saved RNG states, so that random ops draw what they drew when captured."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"].to(torch.uint8))
    if "cuda" in rng and device.startswith("cuda"):
        torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))
    yield


@contextlib.contextmanager
def replay_context(context: ReplayContext, device: str,
                   rng: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Apply a case's ``[context]`` around the call, as it was when the failure was captured.

    Autocast is entered for the device type of this run with the captured dtype: a case
    captured under CUDA bf16 autocast computes in bf16 on the CPU too. The grad mode is
    ``grad_mode``'s, which the reference shares. Runs in the child, so the global switches
    (default dtype, TF32, deterministic) need no restoring.
    """
    if context.default_dtype is not None:
        torch.set_default_dtype(getattr(torch, context.default_dtype))
    if context.deterministic:
        _deterministic()
    elif context.deterministic is False:
        torch.use_deterministic_algorithms(False)
    if context.tf32_matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = context.tf32_matmul
    if context.tf32_cudnn is not None:
        torch.backends.cudnn.allow_tf32 = context.tf32_cudnn
    with contextlib.ExitStack() as stack:
        stack.enter_context(_rng_restored(rng, device))
        stack.enter_context(torch.set_grad_enabled(grad_mode(context)))
        if context.inference:
            stack.enter_context(torch.inference_mode())
        if context.autocast is not None:
            stack.enter_context(torch.autocast(
                device_type=device.split(":")[0], dtype=getattr(torch, context.autocast.dtype),
                enabled=context.autocast.enabled))
        yield


def grad_mode(context: ReplayContext) -> bool:
    """Whether autograd records the call, and the reference likewise: ``[context] grad``,
    else torch's default (on; off under ``inference``, as inference mode has it).

    The one switch of the context the reference shares with the call: a function that runs
    its own backward pass needs it to compute at all, whatever the precision.
    """
    if context.grad is not None:
        return context.grad
    return not context.inference


_MISSING = object()


def resolve(case: Case, target: str, key: str) -> Callable[..., Any]:
    """Import ``FILE.py:func`` (inside the case dir) or ``package.module:func``."""
    where, _, qualname = target.partition(":")
    try:
        if where.endswith(".py"):
            file = case.path / where
            name = f"gpucase_case_{re.sub(r'[^0-9A-Za-z_]', '_', case.name)}_{Path(where).stem}"
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, file)
                if module_spec is None or module_spec.loader is None:
                    raise ImportError(f"cannot import {file}")
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except BaseException:  # sys.exit() at import time too: the module is the user's
        detail = traceback.format_exc()
        summary = f"{display(case.case_file)}: {key}: importing '{where}' failed"
        raise _Failed(Outcome("failed", summary, details=detail, error_type="ImportError",
                              kind="broken case")) from None
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise _Failed(Outcome("failed", f"{display(case.case_file)}: {key}: '{where}' has no "
                                  f"'{qualname}'; check the name after the colon",
                                  error_type="AttributeError", kind="broken case"))
    if not callable(obj):
        raise _Failed(Outcome("failed", f"{display(case.case_file)}: {key}: '{target}' is a "
                              f"{type(obj).__name__}, not a function", error_type="TypeError",
                              kind="broken case"))
    return obj  # type: ignore[no-any-return]


def check_binding(case: Case, target: str, func: Callable[..., Any],
                  inputs: Mapping[str, Any]) -> None:
    """Bind the inputs to ``func``'s signature before the call, so that a missing or extra
    input names the case file and the key, not ``run() missing 1 required argument``."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without a signature: the call will say
        return
    try:
        signature.bind(**inputs)
    except TypeError as exc:
        tensors = ([name for name in inputs if name not in case.literals]
                   if os.path.lexists(case.inputs_file) else None)
        problems = binding_problems(case, target, Parameters.of_signature(signature), tensors)
        lines = [str(problem) for problem in problems] or [
            f"{display(case.case_file)}: the inputs do not bind to {target}: {exc}"]
        # The first problem is the summary; the details hold the others (a report prints
        # both, and a single problem was printed twice).
        raise _Failed(Outcome("failed", lines[0], details="\n".join(lines[1:]),
                              error_type="TypeError", error_message=str(exc),
                              kind="broken case")) from None


def prepare(inputs: Mapping[str, Any], device: str, dtype: str | None) -> dict[str, Any]:
    """Move tensors to ``device`` keeping their layout; cast floating ones to ``dtype`` if given."""
    target = getattr(torch, dtype) if dtype else None

    def move(value: torch.Tensor) -> torch.Tensor:
        if device != "cpu":
            value = payload.to_device(value, device)
        if target is not None and value.is_floating_point() and value.dtype != target:
            value = value.to(target)
        return value

    return {name: _each_tensor(value, move) for name, value in inputs.items()}


def _each_tensor(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to a tensor input, or to each tensor of a dict input; else ``value``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def _as_saved(spec: RunSpec, run_inputs: dict[str, Any], versions: Mapping[int, int],
              ) -> dict[str, Any]:
    """``run_inputs``, or loaded again when the call changed them in place (their version
    counters moved): the reference must see the inputs the case holds, not the call's
    changes, or an in-place call that was fixed would never pass."""
    if tensor_versions(_tensors(run_inputs)) == versions:
        return run_inputs
    inputs = load_arguments(spec.case)[0]
    if spec.variant is not None:
        inputs = apply_variant(spec.variant, inputs)
    return prepare(inputs, spec.device, spec.dtype if spec.cast else None)


def upcast(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's inputs: on the CPU, floating tensors in float64 (complex in complex128)."""
    def up(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().cpu()
        if value.is_floating_point():
            return value.to(torch.float64)
        if value.is_complex():
            return value.to(torch.complex128)
        return value

    return {name: _each_tensor(value, up) for name, value in inputs.items()}


def _sync(device: str) -> None:
    """Wait for queued kernels, so an asynchronous error is raised here and not later."""
    backends.synchronize(torch, device)


def _call(func: Callable[..., Any], inputs: Mapping[str, Any], gradients: bool,
          device: str) -> dict[str, Any]:
    """Call ``func``; with ``gradients``, also d(sum of float outputs)/d(float inputs).

    In the grad mode the caller set (``grad_mode``): the same for the call and the reference.
    """
    if not gradients:
        out = func(**inputs)
        _sync(device)
        return {"out": _detach(out)}
    # Detached first: the walk that finds the tensors to differentiate needs an output
    # _detach has checked (depth, cycles).
    leaves = {name: value.detach().requires_grad_()
              for name, value in inputs.items()
              if isinstance(value, torch.Tensor)
              and (value.is_floating_point() or value.is_complex())}
    out = func(**{**inputs, **leaves})
    detached = _detach(out)
    total = sum((t.float().sum() if not t.is_complex() else t.abs().sum())
                for t in _tensors(out) if t.requires_grad)
    found: tuple[torch.Tensor | None, ...] = ()
    if isinstance(total, torch.Tensor) and leaves:
        found = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    if all(grad is None for grad in found):  # some inputs without one are fine, not all
        raise _NothingDifferentiated(torch.is_grad_enabled())
    _sync(device)
    return {"out": detached, "grad": dict(zip(leaves, found, strict=True))}


class _NothingDifferentiated(Exception):
    """``gradients = true`` with no gradient at all to compare: no float output depends on a
    float tensor input (an integer output, one computed from other values), or grad mode is
    off. Without it the run compared the outputs alone and passed as if the gradients had
    been checked. Raised by ``_call``, which knows no case; told as a broken case."""

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


def _tensors(value: Any) -> list[torch.Tensor]:
    return [tensor for _, tensor in named_tensors(value)]


def _detach(value: Any, above: dict[int, int] | None = None) -> Any:
    """``value`` with its tensors detached; raises ``_BadOutput`` for one nested deeper than
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
                out[key] = _detach(item, above)
            return out
        for item in value:
            items.append(_detach(item, above))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    except _BadOutput as problem:
        names = field_names(value)
        problem.keys.append(key if isinstance(value, Mapping)
                            else _Field(names[len(items)]) if names else len(items))
        raise
    finally:
        del above[id(value)]


class _Field(str):
    """A dataclass or named tuple field on a path, spelled ``.name``."""


def _walked_children(value: Any) -> list[tuple[object, Any]] | None:
    """What the comparison walks into besides dicts, lists and tuples: a dataclass's fields,
    any other sequence's items (a UserList); None for a leaf."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(_Field(f.name), getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, Sequence) and not isinstance(
            value, (str, bytes, bytearray, memoryview, range)):
        return list(enumerate(value))
    return None


def _enter(value: Any, above: dict[int, int]) -> None:
    """Step into ``value`` on the walk's path: a container met again on the path is a cycle,
    one past ``MAX_OUTPUT_DEPTH`` too deep; the caller removes it on the way out."""
    depth = len(above)
    if id(value) in above:
        raise _BadOutput("cycle", again=depth - above[id(value)])
    if depth >= MAX_OUTPUT_DEPTH:
        raise _BadOutput("depth")
    above[id(value)] = depth


def _check_walk(value: Any, children: list[tuple[object, Any]], above: dict[int, int]) -> None:
    """``_detach``'s depth and cycle checks for a value it keeps as it is."""
    _enter(value, above)
    walked: list[object] = []
    try:
        for where, item in children:
            walked.append(where)
            _detach(item, above)
    except _BadOutput as problem:
        problem.keys.append(walked[-1])  # the key being walked when the problem was met
        raise
    finally:
        del above[id(value)]


def _compare(actual: dict[str, Any], expected: dict[str, Any], expect: Expectation) -> Comparison:
    tolerances = {}
    for name, override in expect.tolerance.items():
        # ulps alone: only the ULP test applies (atol and rtol 0), as the message says.
        tolerances[getattr(torch, name)] = Tolerance(
            rtol=override.rtol or 0.0, atol=override.atol or 0.0, ulps=override.ulps,
            source=f"case.toml [expect.tolerance.{name}]")
    return combine(compare(actual[key], expected[key], tolerances=tolerances,
                           equal_nan=expect.equal_nan, check_dtype=False, path=key)
                   for key in actual)


def _exception_matches(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` is of the type named ``name`` (bare or dotted), subclasses included."""
    for cls in type(exc).__mro__:
        if name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or what Python's traceback module prints when that raises: the user's
    ``__str__`` may fail, and the report of their exception must not."""
    try:
        return str(exc)
    except BaseException:  # anything at all: it is the user's code
        return "<exception str() failed>"


def _describe(exc: BaseException) -> str:
    """``ValueError: bad``, or the bare name for an empty message, as a traceback ends."""
    text = exception_text(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# The machinery that calls the user's code; its frames only add noise to a traceback.
_MACHINERY = {str(Path(__file__)),
              *(str(path) for path in Path(__file__).with_name("isolation").glob("*.py"))}


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of gpucase's own calling machinery."""
    try:
        tb = traceback.TracebackException.from_exception(exc)
        tb.stack = traceback.StackSummary.from_list(
            [frame for frame in tb.stack if frame.filename not in _MACHINERY])
        return "".join(tb.format())
    except Exception as failed:  # an exception hostile enough to break the traceback module
        return (f"{_describe(exc)}\n(its traceback could not be formatted: "
                f"{_describe(failed)})\n")


def _raised(what: str, exc: BaseException, kind: str = "raises") -> Outcome:
    """``exc``, raised by the user's call or reference, as the run's failure.

    Any ``BaseException``: ``sys.exit()`` in a case, a ``KeyboardInterrupt`` or a
    ``BaseException`` subclass it raises are its result, told as any exception is. A real
    Ctrl-C never arrives as one: the child's SIGINT is at its default action
    (``isolation.child._child_main``), so it ends the child, and pytest, which gets its
    own, stops.
    """
    text = user_traceback(exc)
    return Outcome("failed", f"{what} raised {_describe(exc).splitlines()[0]}", details=text,
                   error_type=type(exc).__name__, error_message=exception_text(exc), kind=kind)


def _check_raises(func: Callable[..., Any], inputs: Mapping[str, Any], expect: Expectation,
                  device: str, variant: Variant | None = None) -> Outcome:
    """``expect``: the case's own, or a reject ``variant``'s (``[variants.reject]``)."""
    wanted = expect.wanted
    try:
        func(**inputs)
        _sync(device)
    except BaseException as exc:  # SystemExit too, when the case expects it (see _run)
        name_ok = _exception_matches(exc, expect.exception or "Exception")
        text = exception_text(exc)
        text_ok = expect.match is None or re.search(expect.match, text) is not None
        if name_ok and text_ok:
            return Outcome("passed", f"raised {_describe(exc).splitlines()[0]}", kind="passed",
                           error_type=type(exc).__name__, error_message=text)
        outcome = _raised("the call", exc)
        return dataclasses.replace(outcome, summary=f"expected {wanted}; {outcome.summary}")
    if variant is not None:
        # Accepting a value the case declares out of range is the bug itself: no [expect]
        # change can be the fix (the item's text says which entry was set, items._failure_text).
        return Outcome("failed", f"{variant.id} is a [variants] reject variant: expected "
                       f"{wanted}, but the call returned normally, accepting {variant.value}, "
                       "a value the case says must be rejected", kind="no exception")
    return Outcome("failed", f"expected {wanted}, but the call returned normally; if the fix "
                   "has landed, set [expect] outcome = \"matches\" in case.toml",
                   kind="no exception")

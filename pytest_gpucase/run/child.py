"""What a child does for one ``RunSpec``: load inputs, build the variant, cast and move,
call, compute the reference, compare; and return a picklable ``Outcome``.

Runs in the isolated child only: it imports torch and may touch the device.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import time
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

# Imported at module level on purpose: the parent imports this module before
# forking, so every child inherits torch, safetensors and the comparator
# already loaded instead of importing them again per run.
import safetensors.torch  # noqa: F401
import torch

from pytest_gpucase.base.errors import CaseFormatError, display
from pytest_gpucase.base.tensors import tensor_versions
from pytest_gpucase.case import golden, payload, project
from pytest_gpucase.case.binding import Parameters, binding_problems, rng_problems
from pytest_gpucase.case.keys import (
    FUNCTION_KEY,
    MODULE_KEY,
    REPLAY_ENV,
    REPLAY_FUNCTION,
    REPLAY_MODULE,
    checkpoint_path,
    tensor_dicts,
)
from pytest_gpucase.case.model import Case, Expectation
from pytest_gpucase.case.variants import (
    BrokenVariant,
    Variant,
    VariantNotApplicable,
)
from pytest_gpucase.case.variants import (
    apply as apply_variant,
)
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import prepared, reference_cache
from pytest_gpucase.run.batch_follows import batch_checked
from pytest_gpucase.run.calls import (
    BadOutput,
    NothingDifferentiated,
    call,
    each_tensor,
    synchronize,
    tensors_of,
)
from pytest_gpucase.run.context import apply_settings, grad_mode, replay_context
from pytest_gpucase.run.isolation import note
from pytest_gpucase.run.judge import (
    Judged,
    reference_inputs,
    run_precision,
)
from pytest_gpucase.run.outcome import (
    CaseSetupError,
    Outcome,
    describe_exception,
    exception_text,
    raised,
)

__all__ = ["check_binding", "load_arguments", "load_inputs", "prepare", "resolve", "run",
           "write_golden"]


class _Failed(Exception):
    """Ends a run early with a failed outcome."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.summary)
        self.outcome = outcome


def run(spec: RunSpec) -> Outcome:
    """Run ``spec`` in this process and judge its outputs (call it in a fresh child)."""
    # A Recorder in the replayed code must not capture its own replay as a new case.
    os.environ[REPLAY_ENV] = "1"
    # The user's code is imported as every gpucase tool imports it (project.py).
    prepared.prepend_import_paths(spec.case)
    reference_cache.take_notes()  # a reused child's earlier run said its own
    outcome = _judged(spec)
    notes = reference_cache.take_notes()
    return dataclasses.replace(outcome, notes=(*outcome.notes, *notes)) if notes else outcome


def _judged(spec: RunSpec) -> Outcome:
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
    versions = tensor_versions(tensors_of(run_inputs))
    precision = run_precision(spec)
    cotangents: dict[str, torch.Tensor] = {}  # filled by the call, given to the reference
    try:
        with replay_context(context, spec.device, rng):
            actual = call(func, run_inputs, expect.gradients, spec.device, cotangents, precision)
    except BadOutput as problem:  # the call returned: what it returned is the problem
        return problem.outcome("the call's")
    except NothingDifferentiated as problem:
        raise problem.error(case, "the call") from None
    except BaseException as exc:  # SystemExit and the like too: see raised
        return raised("the call", exc)
    returned = f"the call itself returned after {time.perf_counter() - began:.3g} s"
    note(f"while comparing the outputs ({returned})")  # a timeout from here on is not the call's
    reference = func
    if case.reference:
        reference = resolve(case, case.reference, "reference")
        check_binding(case, case.reference, reference, run_inputs)
    reference = _Apart(case, case.reference or case.call, reference)
    # The loaded inputs are not needed past here (the run's are in run_inputs, or loaded
    # again): let go of them, so that the reference's float64 copy is not a third copy.
    del inputs
    run = Judged(spec, func, reference, lambda: _as_saved(spec, run_inputs, versions), rng,
                 cotangents, precision, returned, reload=lambda: _loaded_again(spec))
    # A batch variant's outputs must also follow its batch (run.batch_follows).
    return batch_checked(spec, func, lambda: prepare(load_arguments(case)[0], "cpu", (
        spec.dtype if spec.cast else None)), rng, precision, run.verdict(actual))


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
            results = call(reference, reference_inputs(case, inputs), case.expect.gradients,
                           "cpu")
    except BadOutput as problem:
        whose = f"the {key}'s"
        return {"refused": f"{not_written}: {problem.message(whose)}"}
    except NothingDifferentiated as problem:
        return {"refused": f"{not_written}: {problem.KEY}: {problem.message(f'the {key}')}"}
    try:
        golden.save(case.expected_file, results)
    except golden.Unstorable as exc:
        return {"refused": str(exc)}
    return {"written": str(case.expected_file)}


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
    tensors: dict[str, torch.Tensor] | None = prepared.taken(case, "tensors")
    if tensors is None:
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
    # A module's factory ("case.py:make_model") or a function's target ("case.py:run", a
    # function of the script that was run): imported from the case directory, as a
    # "FILE.py" call is.
    for replayer, key, field in ((REPLAY_MODULE, MODULE_KEY, "factory"),
                                 (REPLAY_FUNCTION, FUNCTION_KEY, "target")):
        table = literals.get(key)
        if (case.call == replayer and isinstance(table, Mapping)
                and str(table.get(field, "")).partition(":")[0].endswith(".py")):
            literals[key] = {**table, field: resolve(case, str(table[field]),
                                                     f"[inputs] {key}.{field}")}
    recipe = literals.get(MODULE_KEY)
    if case.call == REPLAY_MODULE and isinstance(recipe, Mapping) and isinstance(
            recipe.get("checkpoint"), Mapping):
        tensors.update(_checkpoint_state(case, recipe["checkpoint"]))
    return {**literals, **tensors}, rng


def _checkpoint_state(case: Case, reference: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state of a model case that references the user's checkpoint instead of holding
    it (``[inputs.gpucase_module] checkpoint``), as ``state.*`` inputs, its hash checked."""
    from pytest_gpucase.run.replay import load_checkpoint

    key = f"[inputs] {MODULE_KEY}.checkpoint"
    path = checkpoint_path(case.path, reference)
    if not path.is_file():
        raise CaseFormatError(case.case_file, f"names {path}, which is not a file here: the "
                              "model's state lives in that checkpoint; make it reachable at "
                              "that path", key=key)
    try:
        return load_checkpoint(path, str(reference.get("sha256", "")),
                               str(reference.get("prefix", "")))
    except ValueError as exc:
        raise CaseFormatError(case.case_file, str(exc), key=key) from None


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


_MISSING = object()


class _Apart:
    """The reference's function, taken when it is first called from a copy of its module
    apart from the call's (``prepared.apart``), where it lies in the case's own ``FILE.py``:
    the call ran first, in its precision, and whatever it left at module level (a table
    cached by length, a memo of results) would otherwise be the float64 reference's too,
    which then agrees with the call by construction. A function of another module (a
    package's) is called as it is. Where the module's body cannot run twice (a custom op
    registered at import), the shared function is called, and ``shared_why`` says so."""

    def __init__(self, case: Case, target: str, shared: Callable[..., Any]) -> None:
        self.case, self.target, self.shared = case, target, shared
        self.__wrapped__ = shared   # what inspect (signature, source) reads: the function
        self.found: Callable[..., Any] | None = None
        self.shared_why: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.found is None:
            self.found = self._take()
        return self.found(*args, **kwargs)

    def _take(self) -> Callable[..., Any]:
        where, _, qualname = self.target.partition(":")
        if not where.endswith(".py"):
            return self.shared
        try:
            obj: Any = prepared.apart(self.case, where)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # the user's module body, run a second time
            self.shared_why = f"{type(exc).__name__}: {str(exc)[:200]}"
            return self.shared
        return obj if callable(obj) else self.shared


def resolve(case: Case, target: str, key: str) -> Callable[..., Any]:
    """Import ``FILE.py:func`` (inside the case dir) or ``package.module:func``."""
    where, _, qualname = target.partition(":")
    try:
        if not where.endswith(".py"):
            module = importlib.import_module(where)
        else:  # compiled by the parent when it could, else imported here
            module = prepared.module(case, where) or prepared.imported(case, where)
    except BaseException as exc:  # sys.exit() at import time too: the module is the user's
        raise _Failed(_import_failure(case, key, where, exc, traceback.format_exc())) from None
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


def _import_failure(case: Case, key: str, where: str, exc: BaseException,
                    detail: str) -> Outcome:
    """The verdict of a ``call`` or ``reference`` whose module did not import.

    A module the dynamic loader refused (an undefined symbol, a library it cannot open, a
    C++ runtime too old: ``triage.loader_words``, searched along the exception's chain) is
    the environment's failure, told in the loader's words with the torch of this run and
    the one the package's build says it was made for; anything else is a broken case.
    """
    from pytest_gpucase.verdict.triage import loader_words

    summary = f"{display(case.case_file)}: {key}: importing '{where}' failed"
    words = None
    seen: BaseException | None = exc
    for _ in range(8):   # the loader's error, re-raised by the package as its own
        if seen is None:
            break
        words = loader_words(exception_text(seen))
        if words is not None:
            break
        seen = seen.__cause__ or seen.__context__
    if words is None:
        return Outcome("failed", summary, details=detail, error_type="ImportError",
                       kind="broken case")
    said = f"{words} (torch {torch.__version__} here{_build_words(case, where)})"
    return Outcome("failed", f"{summary}: {said}", details=detail,
                   error_type=type(exc).__name__, error_message=said, kind="environment")


def _build_words(case: Case, where: str) -> str:
    """``, rowext 2.0 built for torch 2.9``: the package a failed import belongs to (of
    those the target imports, the first with compiled files), its version and the torch
    its build names (``plan.environment.package_build``)."""
    from pytest_gpucase.plan.environment import call_distributions, package_build, package_version

    found = [(name, package_version(name), package_build(name))
             for name in call_distributions(where, case.path)]
    found = [entry for entry in found if entry[1] is not None]
    found.sort(key=lambda entry: entry[2] is None)   # a compiled one first
    if not found:
        return ""
    name, version, build = found[0]
    built = build.get("torch") if build else None
    return f", {name} {version}" + (f" built for torch {built}" if built else "")


def check_binding(case: Case, target: str, func: Callable[..., Any],
                  inputs: Mapping[str, Any]) -> None:
    """Bind the inputs to ``func``'s signature before the call, so that a missing or extra
    input names the case file and the key, not ``run() missing 1 required argument``."""
    if _binds(func, inputs):
        return  # a plain function the inputs bind to: inspect only to explain a failure
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


_VARKEYWORDS = inspect.CO_VARKEYWORDS


def _binds(func: Callable[..., Any], inputs: Mapping[str, Any]) -> bool:
    """Whether ``func(**inputs)`` binds, told from a plain function's code object alone (as
    ``inspect.signature`` reads it, without building the signature: in a forked child each
    object that builds touches costs a page copy). False for anything else (a method, a
    wrapped or partial function, positional-only parameters): ``check_binding`` asks
    ``inspect`` then."""
    if (type(func) is not types.FunctionType or getattr(func, "__wrapped__", None) is not None
            or getattr(func, "__signature__", None) is not None):
        return False
    code = func.__code__
    if code.co_posonlyargcount:
        return False
    count, keyword_only = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames[:count + keyword_only]
    if not code.co_flags & _VARKEYWORDS and not all(name in names for name in inputs):
        return False
    required = names[:count - len(func.__defaults__ or ())]
    defaults = func.__kwdefaults__ or {}
    return all(name in inputs for name in required) and all(
        name in inputs or name in defaults for name in names[count:])


def prepare(inputs: Mapping[str, Any], device: str, dtype: str | None) -> dict[str, Any]:
    """Move tensors to ``device`` keeping their layout; cast floating ones to ``dtype`` if given."""
    target = getattr(torch, dtype) if dtype else None

    def move(value: torch.Tensor) -> torch.Tensor:
        if device != "cpu":
            value = payload.to_device(value, device)
        if target is not None and value.is_floating_point() and value.dtype != target:
            value = value.to(target)
        return value

    return {name: each_tensor(value, move) for name, value in inputs.items()}


def _as_saved(spec: RunSpec, run_inputs: dict[str, Any], versions: Mapping[int, int],
              ) -> dict[str, Any]:
    """``run_inputs``, or loaded again when the call changed them in place (their version
    counters moved): the reference must see the inputs the case holds, not the call's
    changes, or an in-place call that was fixed would never pass."""
    if tensor_versions(tensors_of(run_inputs)) == versions:
        return run_inputs
    return _loaded_again(spec)


def _loaded_again(spec: RunSpec) -> dict[str, Any]:
    """The run's inputs loaded from the case again, as the run prepared them."""
    inputs = load_arguments(spec.case)[0]
    if spec.variant is not None:
        inputs = apply_variant(spec.variant, inputs)
    return prepare(inputs, spec.device, spec.dtype if spec.cast else None)


def _exception_matches(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` is of the type named ``name`` (bare or dotted), subclasses included."""
    for cls in type(exc).__mro__:
        if name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def _check_raises(func: Callable[..., Any], inputs: Mapping[str, Any], expect: Expectation,
                  device: str, variant: Variant | None = None) -> Outcome:
    """``expect``: the case's own, or a reject ``variant``'s (``[variants.reject]``)."""
    wanted = expect.wanted
    try:
        func(**inputs)
        synchronize(device)
    except BaseException as exc:  # SystemExit too, when the case expects it (see _run)
        if isinstance(exc, CaseSetupError):  # the case's setup, never the expected raise
            return raised("the call", exc)
        name_ok = _exception_matches(exc, expect.exception or "Exception")
        text = exception_text(exc)
        text_ok = expect.match is None or re.search(expect.match, text) is not None
        if name_ok and text_ok:
            return Outcome("passed", f"raised {describe_exception(exc).splitlines()[0]}",
                           kind="passed", error_type=type(exc).__name__, error_message=text)
        outcome = raised("the call", exc)
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

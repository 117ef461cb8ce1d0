"""A module's failure as cases: the whole module (its state once, or a reference to the
checkpoint that holds it), a backward pass replayed from the forward where the loss is known,
then the narrowed cases; and a rank's failure that is another rank's consequence.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from pytest_gpucase.base import files
from pytest_gpucase.base.tensors import is_tensor, nbytes
from pytest_gpucase.case.keys import (
    CODE_OWNED,
    FUNCTION_KEY,
    GRAD_PREFIX,
    LOSS_PREFIX,
    MODULE_KEY,
    REPLAY_FUNCTION,
    REPLAY_MODULE,
)
from pytest_gpucase.tools.record.distributed import Rank, without_addresses
from pytest_gpucase.tools.record.inputs import Before, Inputs, collect, numeric_context, unusable
from pytest_gpucase.tools.record.narrow import (
    note_narrowed_size,
    replayed_failure,
    write_narrowed,
)
from pytest_gpucase.tools.record.origin import (
    Context,
    Watched,
    class_of,
    compiled,
    error_line,
    message_of,
    mib,
    say,
    shown,
    triage_of,
)
from pytest_gpucase.tools.record.owned import code_owned
from pytest_gpucase.tools.record.rebuild import (
    case_relative,
    in_framework_words,
    module_state,
    needs_secrets,
    on_host,
    rebuild_files,
    script_function_files,
)
from pytest_gpucase.tools.record.write import mark_incomplete, recapture
from pytest_gpucase.verdict.failure import Failure, same_failure
from pytest_gpucase.verdict.triage import NONFINITE, failure_class

if TYPE_CHECKING:
    import torch

    from pytest_gpucase.tools.record.watch import ModuleWatch

__all__ = ["CONSEQUENCE_FILE", "ModuleSaver", "Saving", "checkpoint_reference", "nested_call",
           "say_notes", "script_call", "with_numeric", "write_consequence"]

CONSEQUENCE_FILE = "consequence.toml"


@dataclass(frozen=True)
class Saving:
    """What the saver needs of its Recorder: its settings, the lists of narrowed cases it
    keeps (shared: the saver appends to them), where this process's cases go, the step's
    context, and how the first failure's case is written. ``Hooks.save_module`` hands the
    Recorder's own over, so that the saver names none of its private members."""

    narrow: bool
    state_limit: int | None
    stderr_file: Path | None
    narrowed: list[Path]           # narrowed cases kept beside the first failure's case
    narrowed_new: list[Path]       # those of them this process wrote
    device_names: dict[str, str]
    case_root: Callable[[], Path]
    context: Callable[[], Context]
    save_first: Callable[..., Path]


def checkpoint_reference(path: str | None, state: Mapping[str, torch.Tensor], root: Path,
                         ) -> tuple[dict[str, str] | None, str]:
    """``{path, sha256}`` of the checkpoint file ``path`` when it holds ``state`` (the
    ``state.<name>`` tensors) exactly, else why it cannot stand for it. The path is written
    relative to a case directory under ``root`` (docs/case-format.md: a case never holds an
    absolute path), so the project moves as a whole."""
    import torch

    from pytest_gpucase.base.files import file_sha256
    from pytest_gpucase.run.replay import load_checkpoint

    if path is None:
        return None, "no checkpoint was named to reference instead (rec.watch(model, " \
                     "checkpoint=PATH))"
    try:
        sha = file_sha256(Path(path))
        theirs = load_checkpoint(Path(path), None)
    except Exception as exc:
        return None, f"its checkpoint {path} cannot be read ({error_line(exc)})"
    missing = sorted(set(state) - set(theirs))
    if missing:
        names = ", ".join(m.partition(".")[2] for m in missing[:3])
        return None, f"its checkpoint {path} lacks {names}"
    for name, tensor in state.items():
        other = theirs[name]
        if other.shape != tensor.shape or not torch.equal(other.to(tensor.dtype), tensor):
            return None, (f"the model has changed since its checkpoint {path} was written "
                          f"({name.partition('.')[2]} differs): training went on after it")
    return {"path": case_relative(str(path), root), "sha256": sha}, ""


class ModuleSaver:
    """Saves one module failure: the module's case, then its narrowed cases."""

    def __init__(self, recorder: Saving, watch: ModuleWatch, args: Any, kwargs: Any,
                 backward: bool, method: str | None, before: Before | None = None,
                 incomplete: tuple[str, ...] = ()) -> None:
        self.rec = recorder
        self.watch = watch
        self.args = args
        self.kwargs = kwargs
        self.backward = backward
        self.method = method
        self.before = before
        self.incomplete = incomplete

    def save(self, exc: BaseException) -> None:
        rec, watch = self.rec, self.watch
        module = watch.module
        found = triage_of(exc, "")
        nan = class_of(exc) == NONFINITE
        rebuild = watch.rebuild
        root = rec.case_root()
        # A LightningModule stepping its own optimizers runs backward inside the call
        # (manual_backward): the replay calls it, with what it asks of its Trainer.
        manual = bool(self.method) and getattr(module, "automatic_optimization", True) is False
        if manual:
            self.backward = False
        recipe: dict[str, Any] = {"factory": rebuild.factory or "",
                                  "kwargs": dict(rebuild.kwargs),
                                  "training": bool(module.training), "backward": self.backward}
        if self.method:
            recipe["method"] = self.method
        if manual:
            recipe["manual_optimization"] = True
        if nan:
            recipe["finite"] = True
        incomplete: list[str] = list(self.incomplete)
        with contextlib.suppress(Exception):
            secret = needs_secrets(module, rebuild)
            if secret is not None:
                incomplete.append(in_framework_words(module, secret))
        origin: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        if unusable(found) is None:
            held = module_state(module)
            state = held.tensors
            unsaved = held.why_incomplete(watch.watched.name)
            if unsaved is not None:
                incomplete.append(in_framework_words(module, unsaved))
                origin["unsaved_state"] = dict(held.unsaved)
            if held.tied:
                recipe["tied"] = held.tied
            owned = code_owned(module, rebuild, state)   # replayed from the code (record.owned)
            if owned:
                recipe[CODE_OWNED] = list(owned)
            size = sum(nbytes(t) for t in state.values())
            limit = rec.state_limit
            if limit is not None and size > limit:
                reference, why = checkpoint_reference(watch.checkpoint, state, root)
                if reference is not None:
                    recipe["checkpoint"] = reference
                    origin["state"] = (f"{mib(size)}, above Recorder(state_limit="
                                       f"{mib(limit)}): referenced in its checkpoint")
                else:
                    incomplete.append(
                        f"the state of {watch.watched.name} ({mib(size)}) is above "
                        f"Recorder(state_limit={mib(limit)}) and {why}, so it was not saved: "
                        "name a checkpoint that holds the model as it is when it fails, or "
                        "raise state_limit")
            else:
                tensors.update(state)
        if self.backward:
            self._gradients(recipe, tensors, origin, incomplete)
        watched = watch.watched
        what: str | None = None
        if self.method:
            bound = getattr(module, self.method)
            with contextlib.suppress(TypeError, ValueError):
                watched = Watched(bound, f"{watched.name}.{self.method}", watched.call,
                                  watched.why_not, inspect.signature(bound), watched.ids)
            what = f"{type(module).__qualname__}.{self.method}"
        if self.backward:
            what = f"the backward pass of {type(module).__qualname__}"
        context: dict[str, Any] = {}
        if watch.inner_context is not None and watch.inner_context[0]:
            kind, dtype = watch.inner_context
            context["autocast"] = {"device_type": kind, "dtype": dtype, "enabled": True}
        case_dir = rec.save_first(
            exc, watched, self.args, self.kwargs,
            self.before if self.before is not None else watch.before, watch.rng,
            module=(tensors, {MODULE_KEY: recipe}), files=rebuild_files(rebuild, root),
            origin=origin, incomplete=incomplete, what=what, context=context)
        recorded = self._checked_replay(exc, case_dir)
        self._narrow(exc, case_dir, recorded)

    def _checked_replay(self, exc: BaseException, case_dir: Path) -> Failure | None:
        """Replay the module's case once in a fresh child on the CPU, as its items will,
        before its xfail line is trusted. A model case rebuilds the model from its code and
        state dict: what the failure depended on beyond them (a non-persistent buffer that
        training advanced, an attribute set after construction, a generator of the
        model's own, a constructor argument that is not plain data, a trainer's state,
        code that ran after the call returned) is not in it, and its replay passes. Such a
        case, captured on the CPU, is marked incomplete (``_not_reproduced``): a pass of it
        would read as "fixed". A case captured on an accelerator is not replayed here
        unless its model was compiled (a CPU pass would be a hint, at the cost of the whole
        model on the CPU). The failure the narrowed cases must keep: a compiled model's
        eager one (``_eager_failure``), else None (``exc``'s)."""
        if not self.watch.rebuild.factory:
            return None
        from pytest_gpucase.case.load import load_case
        from pytest_gpucase.run.runcontext import RunContext

        is_compiled = compiled(exc)
        on_cpu = _computed_on_cpu(self.watch.module, (self.args, self.kwargs))
        try:
            if not (is_compiled or (on_cpu and load_case(case_dir).xfail is not None)):
                return None  # incomplete already (it says why, and its pass fails)
            found = replayed_failure(case_dir, RunContext.here("cpu"))
        except Exception:
            return None
        if is_compiled:
            return self._eager_failure(exc, case_dir, found)
        _not_reproduced(exc, case_dir, found)
        return None

    def _eager_failure(self, exc: BaseException, case_dir: Path,
                       found: Failure | str) -> Failure | None:
        """The case of a compiled model's failure replays the eager module: its failure (an
        IndexError where inductor's kernel said 'index out of bounds', the real error where
        the trace said 'when making fake tensor call') is the captured one; a failure the
        eager module does not have makes the case incomplete. None when left as captured.
        ``found``: how the case's replay failed (``replayed_failure``)."""
        if isinstance(found, str):
            if found == "it passes":
                mark_incomplete(case_dir, (
                    f"the failure happens only under torch.compile ({error_line(exc)}): the "
                    "eager module's replay passes, so this case cannot reproduce it; a "
                    "compiler issue, reproduce it with the compiled call itself"))
                say(f"gpucase: note: {shown(case_dir)} fails only compiled: its eager replay "
                    "passes (marked incomplete)")
            return None
        if found.error_type is None:   # not an exception (a timeout, wrong values): as captured
            say(f"gpucase: note: {shown(case_dir)}: its eager replay fails without an "
                f"exception ({found.message.partition(chr(10))[0][:200]}); left as captured")
            return None
        if same_failure(Failure(type(exc).__name__, message_of(exc), "", found.device), found):
            return None  # the eager module fails as the compiled one did: as captured
        line = f"{found.error_type}: {found.message.strip().partition(chr(10))[0]}"
        recapture(case_dir, line, found.failure_class or failure_class(
            found.error_type or "", found.message, found.stderr), error_line(exc))
        say(f"gpucase: note: {shown(case_dir)}: the compiled model raised {error_line(exc)}; "
            f"its eager replay raises {line}, recorded as the captured failure")
        return found

    def _gradients(self, recipe: dict[str, Any], tensors: dict[str, torch.Tensor],
                   origin: dict[str, Any], incomplete: list[str]) -> None:
        """How the replay starts the backward pass: from the loss it recomputes, where the
        call returns it (a model that computes its loss, a training_step, a loss that is
        the module's output), else from the gradients saved, unless they hold the
        symptom itself (a NaN that the loss sent back)."""
        watch = self.watch
        if self.method or watch.seeded is not None:
            recipe["loss"] = "output"
            if not self.method and watch.seeded is not None:
                recipe["loss_index"] = watch.seeded
            origin["grad_output"] = "recomputed: the replay runs backward from the loss " \
                                    "its call returns"
            return
        if watch.consumer is not None and self._consumer(recipe, tensors, origin):
            return
        grads = {int(i): g for i, g in watch.grad_output.items() if is_tensor(g)}
        names = {str(i): f"{GRAD_PREFIX}{i}" for i in grads}
        for index, grad in grads.items():
            tensors[f"{GRAD_PREFIX}{index}"] = on_host(grad)
        recipe["grad_outputs"] = names
        nonfinite = any(not bool(g.isfinite().all()) for g in grads.values()
                        if g.is_floating_point())
        if nonfinite:
            incomplete.append(
                f"the gradient that reached {watch.watched.name}'s output holds NaN or inf, "
                "sent back by code outside the watched calls (the loss): a replay from it "
                "starts from the symptom and fails forever; compute the loss in the model's "
                "forward, or watch a function that takes the model's output and returns the "
                "loss, so that the replay recomputes it")
            origin["grad_output"] = "saved as captured, not finite"
        else:
            origin["grad_output"] = ("saved as captured: the loss was computed outside the "
                                     "watched calls, so the replay cannot recompute it")

    def _consumer(self, recipe: dict[str, Any], tensors: dict[str, torch.Tensor],
                  origin: dict[str, Any]) -> bool:
        """The loss function that took the module's output, saved to be called again."""
        consumer = self.watch.consumer
        assert consumer is not None
        try:
            inputs = collect(consumer.watched, consumer.args, consumer.kwargs, consumer.before,
                             None, RuntimeError())
        except Exception:
            return False
        if inputs.skipped or inputs.problems:
            return False
        loss: dict[str, Any] = {"call": consumer.watched.call, "output": consumer.name,
                                "index": consumer.index}
        literals = {k: v for k, v in inputs.literals.items() if k != consumer.name}
        if literals:
            loss["inputs"] = literals
        for name, tensor in inputs.tensors.items():
            if name != consumer.name:
                tensors[f"{LOSS_PREFIX}{name}"] = tensor
        recipe["loss"] = loss
        origin["grad_output"] = (f"recomputed: the replay calls {consumer.watched.call} on the "
                                 "module's output again and runs backward from its loss")
        return True

    def _narrow(self, exc: BaseException, case_dir: Path,
                recorded: Failure | None = None) -> None:
        rec, watch = self.rec, self.watch
        if not rec.narrow:
            return
        inner = watch.innermost
        entered = inner[1:] if inner is not None and inner[0] is exc else None
        if self.backward:
            say(f"gpucase: note: the backward failure is not narrowed to a submodule (a "
                "submodule's backward needs the gradient of its output, which only the "
                f"whole model recomputes): {shown(case_dir)} replays forward and backward; "
                "the op that raised is looked for in it")
            entered = None
        if entered is not None and entered[1] is watch.module:
            entered = None
        # A model that cannot be rebuilt still has narrowed cases that need no rebuild of it
        # (an nn.Embedding's, the op's found in that one); write_narrowed names each not written.
        unreplayable = ("" if watch.rebuild.factory else
                        f"{type(watch.module).__qualname__} cannot be rebuilt: "
                        f"{watch.rebuild.why_not}")
        written = len(rec.narrowed_new)
        # write_narrowed says itself when narrowing stops (a full disk, a refused name).
        write_narrowed(exc, case_dir, watch.module, entered, watch.rng,
                       root=rec.case_root(), stderr_file=rec.stderr_file,
                       context=rec.context(), device_names=rec.device_names,
                       kept=rec.narrowed, written=rec.narrowed_new, recorded=recorded,
                       unreplayable=unreplayable)
        with contextlib.suppress(Exception):
            note_narrowed_size(case_dir, rec.narrowed_new[written:])


def _computed_on_cpu(module: Any, arguments: Any) -> bool:
    """Whether the failing call computed on the CPU: every parameter, buffer and tensor
    argument on it (and at least one tensor)."""
    from pytest_gpucase.base.tensors import tensors_in

    devices = {t.device.type for t in [*module.parameters(), *module.buffers()]}
    devices |= {t.device.type for t in tensors_in(arguments)}
    return devices == {"cpu"}


# Why a model case whose replay passes does not hold its failure, and what to do.
_NOT_HELD = (
    "the failure depended on what the case does not hold: state outside the model's state "
    "dict (a non-persistent buffer that training advanced, an attribute set after "
    "construction, a generator of the model's own), a constructor argument that is not "
    "plain data, a trainer's state, or code that ran after the call returned (an "
    "optimizer's step, a metric); so a pass of the case would read as fixed. Record the "
    "failure where the call holds everything it depends on (a persistent buffer, a "
    "constructor argument), or complete the case by hand")


def _not_reproduced(exc: BaseException, case_dir: Path, found: Failure | str) -> None:
    """A model case captured on the CPU whose replay (``found``) does not raise the captured
    failure: incomplete where it passes or cannot run; said where it fails otherwise (its
    strict xfail then reports another failure, loudly)."""
    if isinstance(found, Failure):
        if not same_failure(Failure(type(exc).__name__, message_of(exc), "", "cpu"), found):
            say(f"gpucase: note: {shown(case_dir)}: its replay in a fresh child fails "
                f"otherwise ({found.message.partition(chr(10))[0][:200]}); left as captured")
        return
    what = ("passes" if found == "it passes"
            else f"cannot run ({found.removeprefix('the case cannot run: ')[:300]})")
    mark_incomplete(case_dir, f"its replay in a fresh child, checked when it was captured, "
                              f"{what}: {_NOT_HELD}")
    say(f"gpucase: warning: {shown(case_dir)} does not reproduce the failure: its replay in a "
        f"fresh child {what}, so it is marked incomplete (no xfail line; a pass of it fails "
        "until the case is completed): see [origin] incomplete")


def with_numeric(inputs: Inputs, rng: Mapping[str, Any] | None,
                 module: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
                 ) -> tuple[Inputs, dict[str, Any]]:
    """The inputs with the RNG state and module added, and the numeric context; as far as
    they could be read."""
    numeric: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        # An RNG state without the inputs that draw from it replays nothing.
        numeric, rng_tensors = numeric_context(
            inputs.devices, (rng or {}) if inputs.tensors else {})
        extra_tensors, extra_literals = module or ({}, {})
        inputs = replace(inputs, tensors={**inputs.tensors, **extra_tensors,
                                          **rng_tensors},
                         literals={**inputs.literals, **extra_literals})
    return inputs, numeric


def script_call(watched: Watched, module: object, root: Path,
                files: dict[str, str]) -> tuple[Watched, str | None]:
    """A function of a script, not importable, as the call of the script's copy the case
    holds (its files added to ``files``); else the watched call as it is, and no call."""
    if watched.call is not None or module is not None:
        return watched, None
    script = script_function_files(watched.fn, root)
    if script is None:
        return watched, None
    call, script_files = script
    files.update(script_files)
    return replace(watched, call=call, why_not=""), call


def nested_call(inputs: Inputs, watched: Watched, module: object, finite: bool,
                literals: dict[str, Any]) -> str | None:
    """Whether the case's call goes through the replay function (nested inputs, a finite
    check): REPLAY_FUNCTION with its table put in ``literals``, else None."""
    if module is not None and inputs.nested:
        recipe = inputs.literals.get(MODULE_KEY)
        if isinstance(recipe, dict):
            recipe["nested"] = dict(inputs.nested)
        return None
    if not ((finite or inputs.nested) and watched.call is not None
            and watched.call != REPLAY_MODULE):
        return None
    table: dict[str, Any] = {"target": watched.call}
    if finite:
        table["finite"] = True
    if inputs.nested:
        table["nested"] = dict(inputs.nested)
    literals[FUNCTION_KEY] = table
    return REPLAY_FUNCTION


def say_notes(draft: Any, inputs: Inputs, before: Before, found: Any) -> None:
    """Say what a saved case holds otherwise than passed, its triage, and that it is
    incomplete, where it is."""
    if inputs.changed:
        say(f"gpucase: note: the failing call of {draft.name} changed "
            f"{', '.join(inputs.changed)} in place, so the case holds them as changed, "
            f"not as passed (not copied before the call: {before.why_not})")
    if inputs.shared:
        say(f"gpucase: note: arguments of {draft.name} share memory "
            f"({'; '.join(inputs.shared)}); the case holds each on its own, so a "
            "failure that needs a write through one to show in another may not "
            "replay (pass them apart, or rebuild the view in case.py)")
    if found is not None:
        say(found.render())
    if draft.xfail is None:
        reasons = "".join(f"\n  - {reason}" for reason in draft.origin.get("incomplete", ()))
        say("gpucase: warning: the case is incomplete, so it has no xfail line and its "
            f"replay fails until it is completed:{reasons}")


def write_consequence(root: Path, rank: Rank, exc: BaseException, why: str,
                      context: Context) -> Path | None:
    """Record a rank's failure that another rank's caused: not a case (replayed alone it
    cannot fail so), a ``consequence.toml`` in the rank's folder, and one line."""
    from pytest_gpucase.tools.scrub import capture_text

    folder = root / f"rank{rank.rank}"
    record: dict[str, Any] = {
        "error": capture_text(without_addresses(error_line(exc))),
        "consequence_of": capture_text(why),
        "rank": rank.rank, "local_rank": rank.local_rank, "world_size": rank.world_size,
        "captured": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")}
    if context.iteration is not None:
        record["iteration"] = context.iteration
    path = folder / CONSEQUENCE_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.write_text_atomic(path, tomli_w.dumps({"consequence": record}))
    except OSError:
        return None
    finally:
        say(f"gpucase: {rank.shown()}: {without_addresses(error_line(exc))} is the "
            f"consequence of another rank's failure ({why}); recorded in {shown(path)}, "
            "not saved as a case: the failing rank saves its own")
    return path


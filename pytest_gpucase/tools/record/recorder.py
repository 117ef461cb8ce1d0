"""The Recorder itself: what it watches (functions wrapped, modules hooked and left
themselves), the steps and nested scopes a failure passes through, the first failure saved
once and later ones counted. The case is built by ``inputs`` (the watched call's arguments),
``write`` (the case document, written), ``rebuild`` (how a module is built again), ``step``
(which call a failure outside the watched ones came from) and ``narrow`` (a module's
narrowed cases); ``watch`` holds a module's hooks and ``distributed`` the rank's view.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

from pytest_gpucase.base.files import sweep_temporaries
from pytest_gpucase.base.tensors import is_tensor, tensors_in
from pytest_gpucase.case.keys import (
    REPLAY_ENV,
)
from pytest_gpucase.case.payload import STORE_DIR
from pytest_gpucase.tools.record.distributed import consequence_of, rank_of
from pytest_gpucase.tools.record.hooks import compiling, invisible_to_dynamo, unwrap
from pytest_gpucase.tools.record.inputs import (
    Before,
    Inputs,
    collect,
    rng_state,
    snapshot_before,
    synchronize,
    tensors_of,
)
from pytest_gpucase.tools.record.origin import (
    Context,
    SampleIds,
    Watched,
    call_ids,
    case_name,
    class_of,
    error_line,
    id_tuple,
    message_of,
    read_tail,
    say,
    shown,
    triage_of,
    watched_call,
    where,
)
from pytest_gpucase.tools.record.placement import unreachable
from pytest_gpucase.tools.record.rebuild import (
    Rebuild,
    lightning_module,
    rebuild_of,
    script_function_files,
)
from pytest_gpucase.tools.record.saving import (
    ModuleSaver,
    Saving,
    nested_call,
    say_notes,
    script_call,
    with_numeric,
    write_consequence,
)
from pytest_gpucase.tools.record.step import Found, failing_call, raised_outside
from pytest_gpucase.tools.record.watch import ModuleWatch, nonfinite_problem
from pytest_gpucase.tools.record.write import (
    case_draft,
    origin_only,
    set_later_errors,
    sized,
    write_case,
)
from pytest_gpucase.verdict.triage import NONFINITE

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "DEFAULT_STATE_LIMIT", "NONFINITE_KINDS", "Hooks", "Recorder",
           "Step", "hooks_of"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound="torch.nn.Module")

DEFAULT_SNAPSHOT_LIMIT = 256 * 2**20
DEFAULT_STATE_LIMIT = 4 * 2**30
NONFINITE_KINDS = ("output", "loss", "grad")
_CALL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Outputs of the watched calls of one step kept (weakly) to find where a NaN came from.
_REMEMBERED = 32


@dataclass(frozen=True)
class Step:
    """One stage of one iteration, as a context manager: ``with rec.step(it, "forward"):``."""

    recorder: Recorder
    iteration: int | str
    stage: str | None
    ids: tuple[str | int, ...] | None = None

    def __enter__(self) -> Step:
        self.recorder._enter_step(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Returning None lets the exception go on as it is: same object, same traceback.
        self.recorder._exit_step(self, exc)


class _Local(threading.local):
    """Per-thread nesting of steps and watched calls."""

    def __init__(self) -> None:
        self.depth = 0
        # The exception an inner scope already handled, while it propagates to outer ones.
        self.handled: BaseException | None = None
        self.stages: list[str] = []


@dataclass
class _FunctionCall:
    """The last call of a watched function in this step: where a NaN it returned came from."""

    watched: Watched
    args: Any
    kwargs: Any
    before: Before
    rng: Mapping[str, Any]


def _nonfinite_kinds(value: bool | Iterable[str]) -> frozenset[str]:
    if value is True:
        return frozenset(NONFINITE_KINDS)
    if value is False or value is None:
        return frozenset()
    if isinstance(value, str):
        value = (value,)
    kinds = frozenset(str(v) for v in value)
    unknown = sorted(kinds - set(NONFINITE_KINDS))
    if unknown:
        raise ValueError(f"nonfinite: unknown {', '.join(map(repr, unknown))}; give True, or "
                         f"some of {', '.join(map(repr, NONFINITE_KINDS))}")
    return kinds


class Recorder:
    """Save the first failure of a training loop as a replayable case directory.

    ``snapshot="before"`` copies the tensor arguments of each watched call to the host
    before it runs while they fit ``snapshot_limit`` bytes, so that the case holds them
    as passed (``"after"``: as they are after the failure). ``sync`` synchronizes the
    device when a watched call returns, so that an asynchronous kernel error is raised
    in the call that launched it. ``stderr_file`` is where the process's stderr is
    teed, read back for a kernel's assertion line. ``narrow=False`` writes a watched
    module's case alone, without the cases narrowed to its failing submodule and op.
    ``nonfinite`` makes the first NaN or inf a first failure (``True``, or some of
    ``"output"``: a watched call's outputs, ``"loss"``: a scalar a watched call returns and
    the loss the integrations see, ``"grad"``: the gradients reaching a watched module and
    its parameters): the case is saved, and a ``FloatingPointError`` raised where the value
    appeared. A model whose state holds more than ``state_limit`` bytes is referenced by
    the checkpoint ``rec.watch(model, checkpoint=...)`` names instead of copied (when that
    checkpoint holds the model as it is), or its case is marked incomplete.
    """

    def __init__(self, root: str | os.PathLike[str] = "cases", *,
                 snapshot: Literal["before", "after"] = "before",
                 snapshot_limit: int = DEFAULT_SNAPSHOT_LIMIT,
                 sync: bool = True,
                 stderr_file: str | os.PathLike[str] | None = None,
                 narrow: bool = True,
                 nonfinite: bool | Iterable[str] = False,
                 state_limit: int | None = DEFAULT_STATE_LIMIT) -> None:
        if snapshot not in ("before", "after"):
            raise ValueError(f"snapshot must be 'before' or 'after', not {snapshot!r}")
        if snapshot_limit < 0:
            raise ValueError(f"snapshot_limit must be >= 0 bytes, not {snapshot_limit}")
        if not isinstance(narrow, bool):
            raise TypeError(f"narrow must be True or False, not {narrow!r}: Recorder(narrow=False) "
                            "writes a watched module's case without its narrowed cases")
        if state_limit is not None and state_limit < 0:
            raise ValueError(f"state_limit must be >= 0 bytes or None, not {state_limit}")
        # Resolved now: the loop may change directory before it fails.
        self.root = Path(root).absolute()
        self.snapshot = snapshot
        self.snapshot_limit = snapshot_limit
        self.sync = sync
        self.narrow = narrow
        self.nonfinite_kinds = _nonfinite_kinds(nonfinite)
        self.state_limit = state_limit
        self.stderr_file = None if stderr_file is None else Path(stderr_file).absolute()
        self._fresh()

    def _fresh(self) -> None:
        """The state of a Recorder that has seen nothing (also after unpickling)."""
        self._lock = threading.RLock()
        self._local = _Local()
        self._taken = False
        self._first: BaseException | None = None  # the first failure, while it propagates
        self._case_dir: Path | None = None
        self._later = 0
        self._iteration: int | str | None = None
        self._replaying = bool(os.environ.get(REPLAY_ENV))
        self._last_step: str | None = None  # [origin] last_step: the last step that completed
        self._stage_done_in: int | str | None = None  # the iteration of the last completed stage
        self._ids: tuple[str | int, ...] | None = None
        self._device_names: dict[str, str] = {}
        self._notes_given: set[str] = set()
        self._modules: list[ModuleWatch] = []
        self._outputs: list[tuple[object, list[Any]]] = []
        self._functions: dict[str, _FunctionCall] = {}
        self._owner = Hooks(self)   # what its watches and the integrations call
        self.narrowed: list[Path] = []  # narrowed cases kept beside the first failure's case
        self._narrowed_new: list[Path] = []  # those of them this process wrote

    # A Recorder travels with what holds it (a Lightning callback into ddp_spawn's processes,
    # a deepcopy of a trainer) as its settings: each process watches and records on its own.
    def __getstate__(self) -> dict[str, Any]:
        keep = ("root", "snapshot", "snapshot_limit", "sync", "narrow", "nonfinite_kinds",
                "state_limit", "stderr_file")
        return {key: self.__dict__[key] for key in keep}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    @property
    def case_dir(self) -> Path | None:
        """The case directory written for the first failure, once written."""
        return self._case_dir

    @property
    def later_errors(self) -> int:
        """How many errors came after the first one in this process."""
        return self._later

    @overload
    def watch(self, fn: M, /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None, factory: str | None = None,
              kwargs: Mapping[str, Any] | None = None,
              checkpoint: str | os.PathLike[str] | None = None) -> M: ...

    @overload
    def watch(self, fn: Callable[P, R], /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None, factory: str | None = None,
              kwargs: Mapping[str, Any] | None = None,
              checkpoint: str | os.PathLike[str] | None = None) -> Callable[P, R]: ...

    @overload
    def watch(self, fn: None = None, /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None, factory: str | None = None,
              kwargs: Mapping[str, Any] | None = None,
              checkpoint: str | os.PathLike[str] | None = None,
              ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def watch(self, fn: Any = None, /, *, name: str | None = None,
              call: str | None = None, ids: SampleIds | None = None,
              factory: str | None = None, kwargs: Mapping[str, Any] | None = None,
              checkpoint: str | os.PathLike[str] | None = None) -> Any:
        """Watch ``fn`` so that its first failure is saved; use directly or as ``@rec.watch(...)``.

        A function is wrapped. A ``torch.nn.Module`` is returned itself, with hooks (a DDP,
        FSDP or DataParallel wrapper, or ``torch.compile``'s module, is returned itself too,
        and the module inside it watched): its first failure in forward or backward saves its
        inputs, parameters, buffers and mode, and ``factory`` ("pkg.module:make_model") with
        literal ``kwargs`` says how a replay rebuilds it (else it is found: a torch.nn
        built-in, a Hugging Face model, a LightningModule's hyperparameters, a class of the
        script). ``checkpoint`` is a file holding the model's state (safetensors or
        ``torch.save``), referenced instead of copied above ``state_limit``.
        ``call`` names where a replay imports ``fn`` ("pkg.module:func") when it cannot be
        imported under its own name; ``ids`` is called with the call's arguments on failure
        and returns the sample ids of the batch.
        """
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(fn, torch.nn.Module):
            if factory is not None and not _CALL_RE.match(factory):
                raise ValueError(f"factory={factory!r}: expected 'package.module:function', "
                                 "the place a replay imports the model's builder from")
            if not self._replaying:
                self._watch_module(unwrap(fn), name, factory, kwargs, ids,
                                   None if checkpoint is None else str(Path(checkpoint).absolute()))
            return fn
        if call is not None and (not _CALL_RE.match(call)
                                 or call.partition(":")[0].endswith(".py")):
            # A FILE.py target lives in the case directory, which does not exist yet.
            raise ValueError(f"call={call!r}: expected 'package.module:function', the place a "
                             "replay imports the function from")
        if fn is None:
            def decorate(func: Callable[P, R]) -> Callable[P, R]:
                return self.watch(func, name=name, call=call, ids=ids)
            return decorate
        if not callable(fn):
            raise TypeError(f"rec.watch expects a callable, got {type(fn).__name__}")
        if self._replaying:
            return fn
        watched = watched_call(fn, name, call, ids)
        if watched.call is None and call is None and script_function_files(fn, self.root) is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {watched.why_not}")
        self._note_placement((call or watched.call or "").partition(":")[0]
                             or getattr(fn, "__module__", "") or "")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                return fn(*args, **kwargs)
            return self._watched_call(fn, watched, args, kwargs)
        # Called from a compiled region's frame of its own, the wrapper runs eagerly (fn
        # itself compiled as usual); traced inline, it is fn.
        invisible_to_dynamo(wrapper.__code__, recursive=False)  # type: ignore[attr-defined]
        return wrapper

    def unwatch(self, module: Any) -> None:
        """Remove the hooks ``watch`` put on ``module`` (or the module inside its wrapper)."""
        inner = unwrap(module)
        for watch in [w for w in self._modules if w.module is inner]:
            watch.remove()
            self._modules.remove(watch)

    def step(self, iteration: int, stage: str | None = None, *,
             ids: Iterable[object] | None = None,
             sample_ids: Iterable[object] | None = None) -> Step:
        """A context manager for one iteration (or one stage of it, when ``stage`` is given);
        ``sample_ids`` (or ``ids``) are the ids of the batch, recorded with a failure."""
        try:
            number: int | str = operator.index(iteration)
        except TypeError:
            number = str(iteration)
        given = sample_ids if sample_ids is not None else ids
        if given is not None and is_tensor(given):
            given = given.tolist()  # type: ignore[attr-defined]
        return Step(self, number, None if stage is None else str(stage),
                    None if given is None else id_tuple(given))

    def record(self, exc: BaseException, *, module: Any = None, method: str | None = None,
               args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
               before: Before | None = None, backward: bool = False) -> None:
        """Record ``exc``, caught outside any ``rec.step`` (a framework's exception handler,
        an ``except`` around ``trainer.train()``), as a failure of the current step: saved
        as ``rec.step`` would have, if nothing saved it yet. Never raises.

        A framework integration names the step's call: ``method`` of the watched ``module``
        (a LightningModule's ``training_step``) with ``args`` and ``kwargs`` (copied
        ``before`` it ran), and ``backward`` when the exception came from the backward pass
        of the loss it returned: the case calls that method again (and runs backward)."""
        if not isinstance(exc, Exception) or exc is self._first or self._replaying:
            return
        save: Callable[[BaseException], object]
        if module is not None and method:
            outside = None if backward else raised_outside(exc, unwrap(module), method)
            save = functools.partial(self._owner.save_method, module=module, method=method,
                                     args=args, kwargs=dict(kwargs or {}), before=before,
                                     backward=backward,
                                     incomplete=() if outside is None else (outside,))
        else:
            save = functools.partial(self._save_step, anchored=False)
        self._failed(exc, save)

    def _watched_call(self, fn: Callable[..., Any], watched: Watched, args: Any,
                      kwargs: Any) -> Any:
        # Only methods of this class are called here besides fn: under a compiled caller
        # they run eagerly, and fn is compiled as it would be unwatched.
        if self._taken:
            return self._call_after_first(fn, args, kwargs)
        before, rng = self._before_call(watched, args, kwargs)
        try:
            result = fn(*args, **kwargs)
            self._synchronize(args, kwargs)
        except Exception as exc:
            self._owner.leave(exc, functools.partial(self._save_first, watched=watched, args=args,
                                              kwargs=kwargs, before=before, rng=rng))
            raise
        except BaseException:
            self._owner.leave(None, None)
            raise
        self._returned(watched, args, kwargs, before, rng, result)
        return result

    def _before_call(self, watched: Watched, args: Any,
                     kwargs: Any) -> tuple[Before, Mapping[str, Any]]:
        before = self._owner.snapshot_of(watched, args, kwargs)
        try:
            rng = rng_state(tensors_of(args, kwargs))
        except KeyboardInterrupt:
            raise
        except BaseException as problem:
            self._owner.fault(f"the RNG state before {watched.name}", problem)
            rng = {}
        self._owner.enter_scope()
        return before, rng

    def _synchronize(self, args: Any, kwargs: Any) -> None:
        if self.sync:
            # An asynchronous kernel error surfaces here, in the call that launched it.
            synchronize(tensors_of(args, kwargs))

    def _returned(self, watched: Watched, args: Any, kwargs: Any, before: Before,
                  rng: Mapping[str, Any], result: Any) -> None:
        """A watched call returned: kept as this step's last call of it; its output
        checked when ``nonfinite`` asks (then the case is saved and FloatingPointError
        raised)."""
        problem = None
        try:
            self._functions[watched.name] = _FunctionCall(watched, args, kwargs, before, rng)
            self._owner.remember_output(watched, result)
            for watch in self._modules:
                watch.link_consumer(watched, args, kwargs, before)
            scalar = all(t.dim() == 0 for t in tensors_in(result))
            if self._owner.checks("output") or (self._owner.checks("loss") and scalar):
                problem = nonfinite_problem(
                    f"{'loss' if scalar else 'output'} of {watched.name}", result)
        except KeyboardInterrupt:
            raise
        except BaseException as fault:
            self._owner.fault(f"the output check of {watched.name}", fault)
        self._owner.leave(None, None)
        if problem is not None:
            self._owner.nonfinite(problem, functools.partial(
                self._save_first, watched=watched, args=args, kwargs=kwargs, before=before,
                rng=rng, finite=True))

    def _call_after_first(self, fn: Callable[P, R], args: Any, kwargs: Any) -> R:
        """After the first failure: no snapshots, only counting."""
        self._owner.enter_scope()
        caught: BaseException | None = None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            caught = exc
            raise
        finally:
            self._owner.leave(caught, None)

    def _enter_step(self, step: Step) -> None:
        with self._lock:
            if step.iteration != self._iteration:
                self._ids = None  # a new iteration is a new batch
                self._outputs = []
                self._functions = {}
                self._owner.step_context = {}
            self._iteration = step.iteration
            if step.ids is not None:
                self._ids = step.ids
            if self._local.depth == 0:
                self._first = None  # a new step: the first failure has done propagating
        self._local.stages.append(step.stage or "")
        self._local.depth += 1

    def _exit_step(self, step: Step, exc: BaseException | None) -> None:
        try:
            if exc is None:
                for watch in self._modules:
                    watch.backward_done()
                if self._local.depth <= 1:
                    self._outputs = []  # the step is over: nothing to trace a NaN back to
                with self._lock:
                    if step.stage:
                        self._last_step = step.stage
                        self._stage_done_in = step.iteration
                    elif self._stage_done_in != step.iteration:
                        # A plain rec.step(it): the iteration is the step. Around named
                        # stages of its own, the last of them says more and is kept.
                        self._last_step = f"iteration {step.iteration}"
            caught = exc if isinstance(exc, Exception) else None
            save = (None if caught is None
                    else functools.partial(self._save_step, anchored=True))
            self._owner.leave(caught, save)
        finally:
            # Popped last: a failure is recorded as happening in this stage.
            if self._local.stages:
                self._local.stages.pop()

    def _failed(self, exc: BaseException, save: Callable[[BaseException], object] | None) -> None:
        if self._replaying:
            return
        try:
            with self._lock:
                first = not self._taken
                self._taken = True
                if first:
                    self._first = exc
                else:
                    self._later += 1
                    self._write_later_errors(exc)
            if not first:
                return
            rank = rank_of()
            why = consequence_of(type(exc).__name__, message_of(exc), rank)
            if why is not None and rank is not None:
                write_consequence(self.root, rank, exc, why, self._context())
            elif save is not None:
                save(exc)
        except KeyboardInterrupt:
            raise
        except BaseException as internal:  # never raise over the user's exception
            say(f"gpucase: could not record the failure ({error_line(internal)}); the "
                "original error follows")

    def _write_later_errors(self, exc: BaseException) -> None:
        if self._case_dir is None:
            return  # still being written, or not written: the count is written with it
        if "later" not in self._notes_given:
            self._notes_given.add("later")
            say(f"gpucase: another error after the first failure, counted in "
                f"{shown(self._case_dir)} [origin] later_errors (likely a consequence): "
                f"{error_line(exc)}")
        set_later_errors(self._case_dir, self._later)

    def _context(self) -> Context:
        with self._lock:
            stages = self._local.stages
            return Context(self._iteration, stages[-1] if stages and stages[-1] else None,
                           self._last_step, self._ids)

    def _case_root(self) -> Path:
        """Where this process writes its cases: the root, or its rank's folder in it."""
        rank = rank_of()
        return self.root if rank is None else self.root / f"rank{rank.rank}"

    # -- saving -------------------------------------------------------------------------

    def _save_first(self, exc: BaseException, watched: Watched | None, args: Any, kwargs: Any,
                    before: Before, rng: Mapping[str, Any] | None = None, *,
                    module: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
                    files: Mapping[str, str] | None = None,
                    origin: Mapping[str, Any] | None = None,
                    incomplete: Iterable[str] = (), what: str | None = None,
                    finite: bool = False, context: Mapping[str, Any] | None = None,
                    ) -> Path:
        stderr_text = read_tail(self.stderr_file) if self.stderr_file is not None else ""
        found = triage_of(exc, stderr_text)
        where_now = self._context()
        numeric: dict[str, Any] = {}
        root = self._case_root()
        root.mkdir(parents=True, exist_ok=True)
        files = dict(files or {})
        call: str | None = None
        literals: dict[str, Any] = {}
        if watched is not None:
            inputs = _read_inputs(watched, args, kwargs, before, found, exc)
            ids = call_ids(watched, args, kwargs) if watched.ids is not None else None
            ids = ids if ids is not None else where_now.ids
            inputs, numeric = with_numeric(inputs, rng, module)
            watched, call = script_call(watched, module, root, files)
            call = nested_call(inputs, watched, module, finite, literals) or call
        else:
            inputs, ids = Inputs(), where_now.ids
        if context:
            numeric.update(context)
        for key, value in self._owner.step_context.items():
            numeric.setdefault(key, value)
        draft = case_draft(exc, watched, inputs, where_now, ids, stderr_text,
                           self._device_names, what=what, incomplete=tuple(incomplete),
                           origin=origin, files=files, call=call, literals=literals,
                           rank=rank_of())
        draft = replace(draft, context=numeric)
        for folder in (root, root / STORE_DIR):  # what a capture killed midway left
            sweep_temporaries(folder)
        try:
            case_dir, new = write_case(root, draft)
        except KeyboardInterrupt:
            raise
        except BaseException as problem:  # the origin at least: error, iteration, ids
            draft = origin_only(draft, problem)
            case_dir, new = write_case(root, draft)
        with self._lock:
            self._case_dir = case_dir
            if self._later:
                set_later_errors(case_dir, self._later)
        if new:  # else write_case said which case holds it, and that no copy was written
            rank = rank_of()
            who = f"{rank.shown()}, " if rank is not None else ""
            say(f"gpucase: saved {shown(case_dir)} "
                f"({sized(case_dir)}{who}first failure{where(where_now)})")
        say_notes(draft, inputs, before, found)
        return case_dir

    def _save_step(self, exc: BaseException, anchored: bool) -> None:
        """A failure in a step outside any watched call: the call it came from, found in
        the traceback (``step.failing_call``), or a watched call whose output a guard found
        not finite; else the case says why none can be replayed."""
        nan = _nonfinite_failure(exc)
        # A guard's NaN (clip_grad_norm_(error_if_nonfinite=True) after backward, a check of
        # the loss) that a watched call of this step already output: that call made it.
        # Raised inside backward, the backward case below comes first (it replays the loss).
        producer_first = nan and not _raised_in_backward(exc)
        if producer_first and self._save_producer(exc):
            return
        backward = next((w for w in self._modules if w.backward_open and w.last_call), None)
        if backward is not None and backward.last_call is not None:
            args, kwargs = backward.last_call
            self._owner.save_module(exc, backward, args, kwargs, backward=True)
            return
        watched = {id(w.module): w for w in self._modules}
        found = failing_call(exc, watched, anchored=anchored)
        if isinstance(found, Found) and nan and found.kind == "function" and _holds_nonfinite(
                (found.args, found.kwargs)):
            found = (f"{getattr(found.target, '__qualname__', 'the check')} found a non-finite "
                     "value it was given")  # a check that saw the symptom: find its source
        if isinstance(found, Found):
            self._save_found(exc, found, watched, nan)
            return
        if nan and not producer_first and self._save_producer(exc):
            return
        self._save_first(exc, None, (), {}, Before(), incomplete=(
            f"the failure happened outside any watched call: {found}",))

    def _save_found(self, exc: BaseException, found: Found, watched: Mapping[int, ModuleWatch],
                    nan: bool) -> None:
        origin = {"raised_in": found.where}
        if found.kind == "watched":
            watch = watched[id(found.target)]
            if found.in_hook and not nan:
                self._save_first(exc, None, (), {}, Before(), incomplete=(
                    f"it was raised around {watch.watched.name}'s forward (by a hook "
                    "registered after rec.watch), which a replay of the module does not "
                    "run",), what=watch.watched.name)
                return
            args, kwargs = watch.last_call or (found.args, found.kwargs)
            self._owner.save_module(exc, watch, args, kwargs, backward=False)
            return
        if found.kind == "method":
            watch = watched[id(found.target)]
            self._owner.save_module(exc, watch, found.args, found.kwargs, backward=False,
                             method=found.method)
            return
        if found.kind == "module":
            module = found.target
            rebuild = rebuild_of(module, None, None)
            name = case_name(type(module).__name__)
            watch = ModuleWatch.detached(self._owner, module, name, rebuild)
            self._owner.save_module(exc, watch, found.args, found.kwargs, backward=False)
            return
        call_watched = watched_call(found.target, None, None, None)
        self._save_first(exc, call_watched, found.args, found.kwargs, Before(
            why_not="it was not a watched call"), origin=origin)

    def _save_producer(self, exc: BaseException) -> bool:
        """The watched call of this step whose output holds the NaN a guard found."""
        for key, tensors in self._outputs:
            if not _holds_nonfinite(tensors):
                continue
            if isinstance(key, ModuleWatch) and key.last_call is not None:
                args, kwargs = key.last_call
                self._owner.save_module(exc, key, args, kwargs, backward=False)
                return True
            if isinstance(key, Watched) and key.name in self._functions:
                call = self._functions[key.name]
                self._save_first(exc, call.watched, call.args, call.kwargs, call.before,
                                 call.rng, finite=True)
                return True
        return False

    def _watch_module(self, module: torch.nn.Module, name: str | None, factory: str | None,
                      kwargs: Mapping[str, Any] | None, ids: SampleIds | None,
                      checkpoint: str | None) -> None:
        if any(w.module is module for w in self._modules):
            return  # watched already: a callback's setup runs once per stage
        rebuild: Rebuild = rebuild_of(module, factory, kwargs)
        if rebuild.factory is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {rebuild.why_not}")
        for note in rebuild.notes:
            say(f"gpucase: note: {note}")
        if self._owner.integration != "lightning" and lightning_module(module):
            # Said now: such a failure would raise unsaved, with no line at all.
            say(f"gpucase: note: {type(module).__qualname__} is a LightningModule watched "
                "without GpuCaseCallback: its forward's failures are saved, but one outside "
                "it (a criterion or loss in training_step, the backward, the optimizer step) "
                "only inside `with rec.step(...)`; pass Trainer(callbacks=["
                "GpuCaseCallback(recorder=rec)]) to save those too")
        self._note_placement(type(module).__module__)
        if factory is not None:
            self._note_placement(factory.partition(":")[0])
        case = case_name(name or type(module).__name__)
        self._modules.append(ModuleWatch(self._owner, module, case, rebuild, ids, checkpoint))

    def _note_placement(self, module_name: str) -> None:
        """Say once, before any training, when a replay will not import ``module_name``."""
        if module_name.startswith("pytest_gpucase.") or module_name.endswith(".py"):
            return  # the tool's own replay functions; a file of the case itself
        why = unreachable(module_name, self.root)
        if why is not None:
            self._note_once(f"placement:{module_name.partition('.')[0]}",
                            f"gpucase: warning: {why}")

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._notes_given:
            self._notes_given.add(key)
            say(message)


def _read_inputs(watched: Watched, args: Any, kwargs: Any, before: Before, found: Any,
                 exc: BaseException) -> Inputs:
    """The failing call's inputs, or none with the problem that kept them from being read."""
    try:
        return collect(watched, args, kwargs, before, found, exc)
    except KeyboardInterrupt:
        raise
    except BaseException as internal:
        # The origin is still worth writing: error, iteration, ids, versions.
        return Inputs(problems=(f"the inputs could not be read ({error_line(internal)})",))


def _nonfinite_failure(exc: BaseException) -> bool:
    """Whether a failure is about a NaN or inf (its failure class is ``nonfinite``)."""
    return class_of(exc) == NONFINITE


def _holds_nonfinite(value: Any) -> bool:
    import torch

    with torch.no_grad():
        return any(bool((~t.isfinite()).any()) for t in tensors_in(value)
                   if (t.is_floating_point() or t.is_complex()) and not t.is_meta)


def _raised_in_backward(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while autograd ran a backward pass (not after it, as a
    gradient clip's check is)."""
    import traceback

    return any(frame.f_code.co_name == "_engine_run_backward"
               for frame, _ in traceback.walk_tb(exc.__traceback__))




class Hooks:
    """The Recorder as its watches and the framework integrations see it (``watch.Owner``):
    what a module's hooks ask when a call starts, returns or raises, and where an
    integration says which step it is running. Kept apart from ``Recorder``, whose public
    surface is what docs/recorder.md documents; reached with ``hooks_of(recorder)``."""

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        # [context] entries a framework integration knows for the current step (Lightning's
        # precision="bf16-mixed" is autocast around training_step, not inside the failure).
        self.step_context: dict[str, Any] = {}
        # The call a framework integration makes the current step (Lightning: the module,
        # training_step, its (batch, batch_idx) and their copies), for a watch that sees the
        # step through the module's redirected forward (DDP).
        self.framework_call: tuple[Any, str, tuple[Any, ...], Before] | None = None
        # The framework integration that watches through this Recorder ("lightning"), which
        # sees the steps a plain rec.watch of its module does not.
        self.integration: str | None = None

    def taken(self) -> bool:
        return self._rec._taken

    def _saving(self) -> Saving:
        """What the saver needs of the Recorder (``saving.Saving``)."""
        rec = self._rec
        return Saving(rec.narrow, rec.state_limit, rec.stderr_file, rec.narrowed,
                      rec._narrowed_new, rec._device_names, rec._case_root, rec._context,
                      rec._save_first)

    def step_call(self, module: Any) -> tuple[str, tuple[Any, ...], Before] | None:
        call = self.framework_call
        return None if call is None or call[0] is not module else call[1:]

    def enter_scope(self) -> None:
        self._rec._local.depth += 1

    def checks(self, kind: str) -> bool:
        return kind in self._rec.nonfinite_kinds

    def fault(self, where: str, problem: BaseException) -> None:
        """A fault in the Recorder's own code: said once per place; the call goes on as if
        unwatched."""
        self._rec._note_once("fault", (
            f"gpucase: note: {where} failed ({error_line(problem)}); the call runs as "
            "unwatched there (no snapshot), and training is not affected (said once)"))

    def snapshot_of(self, watched: Watched, args: Any, kwargs: Any) -> Before:
        """The call's tensor arguments as they are before it runs: ``snapshot_before`` under
        this Recorder's settings; no snapshot (with a note) when that fails."""
        try:
            return snapshot_before(watched, args, kwargs, snapshot=self._rec.snapshot,
                                   snapshot_limit=self._rec.snapshot_limit,
                                   device_names=self._rec._device_names, note=self._rec._note_once)
        except KeyboardInterrupt:
            raise
        except BaseException as problem:
            self.fault(f"the snapshot of {watched.name}'s inputs", problem)
            return Before(why_not=f"the snapshot before the call failed ({error_line(problem)})")

    def remember_output(self, key: object, value: Any) -> None:
        """Keep a watched call's floating outputs (detached: no graph) until the step ends,
        for the search of where a NaN that a guard in the step found came from."""
        kept = [t.detach() for t in tensors_in(value) if t.is_floating_point() or t.is_complex()]
        if kept:
            outputs = self._rec._outputs[-(_REMEMBERED - 1):]
            self._rec._outputs = [*[o for o in outputs if o[0] is not key], (key, kept)]

    def leave(self, exc: BaseException | None,
              save: Callable[[BaseException], object] | None) -> None:
        """Close a scope: handle its exception once, however many scopes it crosses."""
        local = self._rec._local
        local.depth -= 1
        try:
            if exc is not None and exc is not local.handled and exc is not self._rec._first:
                self._rec._failed(exc, save)
        finally:
            # Kept only while an enclosing scope may still see the same exception.
            local.handled = exc if exc is not None and local.depth > 0 else None

    def nonfinite(self, problem: str, save: Callable[[BaseException], object]) -> None:
        """A watched value is not finite: save the case as the first failure, then raise a
        FloatingPointError where the value appeared (Recorder(nonfinite=...))."""
        with self._rec._lock:
            iteration = self._rec._iteration
        text = problem if iteration is None else f"{problem} (at iteration {iteration})"
        exc = FloatingPointError(text)
        self._rec._failed(exc, save)
        if self._rec._local.depth > 0:
            self._rec._local.handled = exc
        raise exc

    def save_module(self, exc: BaseException, watch: ModuleWatch, args: Any, kwargs: Any,
                    backward: bool, method: str | None = None,
                    before: Before | None = None, incomplete: tuple[str, ...] = ()) -> None:
        """The whole-module case, then the narrowest module and op cases that reproduce."""
        ModuleSaver(self._saving(), watch, args, kwargs, backward, method, before,
                    incomplete).save(exc)

    def save_method(self, exc: BaseException, module: Any, method: str, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any], before: Before | None, backward: bool,
                    incomplete: tuple[str, ...] = ()) -> None:
        """Save ``exc`` as the case of ``method`` of ``module`` called on ``args`` (for a
        framework's step: ``record`` and ``nonfinite`` call it); ``incomplete``: why its
        replay cannot reproduce the failure."""
        inner = unwrap(module)
        watch = next((w for w in self._rec._modules if w.module is inner), None)
        if watch is None:
            watch = ModuleWatch.detached(self, inner, case_name(type(inner).__name__),
                                         rebuild_of(inner, None, None))
        self.save_module(exc, watch, args, kwargs, backward=backward, method=method,
                         before=before, incomplete=incomplete)

    # -- the steps ------------------------------------------------------------------


def hooks_of(recorder: Recorder) -> Hooks:
    """What a framework integration drives a Recorder through (``Hooks``)."""
    return recorder._owner


def _hide_from_dynamo() -> None:
    """The Recorder's code runs eagerly whoever calls it: under a compiled region's hooks
    nothing of it is compiled. Only the frames that call the user's function let Dynamo
    compile that function as usual."""
    calls_user = {Recorder._watched_call, Recorder._call_after_first}
    for value in [*vars(Recorder).values(), *vars(Hooks).values()]:
        if callable(value) and hasattr(value, "__code__"):
            invisible_to_dynamo(value.__code__, recursive=value not in calls_user)


_hide_from_dynamo()

"""The Recorder itself: what it watches (functions wrapped, modules hooked and left
themselves), the steps and nested scopes a failure passes through, the first failure saved
once and later ones counted. The case is built by ``inputs`` (the watched call's arguments),
``write`` (the case document, written) and ``narrow`` (a module's narrowed cases).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

from pytest_gpucase.base.tensors import is_tensor, tensor_versions, tensors_in
from pytest_gpucase.case.keys import GRAD_PREFIX, MODULE_KEY, REPLAY_ENV, REPLAY_MODULE
from pytest_gpucase.tools.record.inputs import (
    Before,
    Inputs,
    collect,
    numeric_context,
    rng_state,
    snapshot_before,
    synchronize,
    tensors_of,
    unusable,
)
from pytest_gpucase.tools.record.narrow import (
    Rebuild,
    module_state,
    note_narrowed_size,
    on_host,
    rebuild_of,
    write_narrowed,
)
from pytest_gpucase.tools.record.origin import (
    Context,
    SampleIds,
    Watched,
    call_ids,
    case_name,
    error_line,
    id_tuple,
    read_tail,
    say,
    shown,
    triage_of,
    watched_call,
    where,
)
from pytest_gpucase.tools.record.write import case_draft, set_later_errors, sized, write_case

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "Recorder", "Step"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound="torch.nn.Module")

DEFAULT_SNAPSHOT_LIMIT = 256 * 2**20
_CALL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


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


class Recorder:
    """Save the first failure of a training loop as a replayable case directory.

    ``snapshot="before"`` copies the tensor arguments of each watched call to the host
    before it runs while they fit ``snapshot_limit`` bytes, so that the case holds them
    as passed (``"after"``: as they are after the failure). ``sync`` synchronizes the
    device when a watched call returns, so that an asynchronous kernel error is raised
    in the call that launched it. ``stderr_file`` is where the process's stderr is
    teed, read back for a kernel's assertion line. ``narrow=False`` writes a watched
    module's case alone, without the cases narrowed to its failing submodule and op.
    """

    def __init__(self, root: str | os.PathLike[str] = "cases", *,
                 snapshot: Literal["before", "after"] = "before",
                 snapshot_limit: int = DEFAULT_SNAPSHOT_LIMIT,
                 sync: bool = True,
                 stderr_file: str | os.PathLike[str] | None = None,
                 narrow: bool = True) -> None:
        if snapshot not in ("before", "after"):
            raise ValueError(f"snapshot must be 'before' or 'after', not {snapshot!r}")
        if snapshot_limit < 0:
            raise ValueError(f"snapshot_limit must be >= 0 bytes, not {snapshot_limit}")
        if not isinstance(narrow, bool):
            raise TypeError(f"narrow must be True or False, not {narrow!r}: Recorder(narrow=False) "
                            "writes a watched module's case without its narrowed cases")
        # Resolved now: the loop may change directory before it fails.
        self.root = Path(root).absolute()
        self.snapshot = snapshot
        self.snapshot_limit = snapshot_limit
        self.sync = sync
        self.narrow = narrow
        self.stderr_file = None if stderr_file is None else Path(stderr_file).absolute()
        self._lock = threading.RLock()
        self._local = _Local()
        self._taken = False
        self._case_dir: Path | None = None
        self._later = 0
        self._iteration: int | str | None = None
        self._replaying = bool(os.environ.get(REPLAY_ENV))
        self._last_step: str | None = None  # [origin] last_step: the last step that completed
        self._stage_done_in: int | str | None = None  # the iteration of the last completed stage
        self._ids: tuple[str | int, ...] | None = None
        self._device_names: dict[str, str] = {}
        self._notes_given: set[str] = set()
        self._modules: list[_ModuleWatch] = []
        self.narrowed: list[Path] = []  # narrowed cases kept beside the first failure's case
        self._narrowed_new: list[Path] = []  # those of them this process wrote

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
              kwargs: Mapping[str, Any] | None = None) -> M: ...

    @overload
    def watch(self, fn: Callable[P, R], /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None, factory: str | None = None,
              kwargs: Mapping[str, Any] | None = None) -> Callable[P, R]: ...

    @overload
    def watch(self, fn: None = None, /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None, factory: str | None = None,
              kwargs: Mapping[str, Any] | None = None,
              ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def watch(self, fn: Any = None, /, *, name: str | None = None,
              call: str | None = None, ids: SampleIds | None = None,
              factory: str | None = None, kwargs: Mapping[str, Any] | None = None) -> Any:
        """Watch ``fn`` so that its first failure is saved; use directly or as ``@rec.watch(...)``.

        A function is wrapped. A ``torch.nn.Module`` is returned itself, with hooks: its
        first failure in forward or backward saves its inputs, parameters, buffers and mode,
        and ``factory`` ("pkg.module:make_model") with literal ``kwargs`` says how a replay
        rebuilds it (a torch.nn built-in is rebuilt from its constructor arguments).
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
                self._watch_module(fn, name, factory, kwargs, ids)
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
        if watched.call is None and call is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {watched.why_not}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._taken:
                return self._call_after_first(fn, args, kwargs)
            before = self._snapshot_before(watched, args, kwargs)
            rng = rng_state(tensors_of(args, kwargs))
            self._local.depth += 1
            caught: BaseException | None = None
            try:
                result = fn(*args, **kwargs)
                if self.sync:
                    # An asynchronous kernel error surfaces here, in the call that launched it.
                    synchronize(tensors_of(args, kwargs))
                return result
            except Exception as exc:
                caught = exc
                raise
            finally:
                save = None if caught is None else functools.partial(
                    self._save_first, watched=watched, args=args, kwargs=kwargs, before=before,
                    rng=rng)
                self._leave(caught, save)
        return wrapper

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

    def _call_after_first(self, fn: Callable[P, R], args: Any, kwargs: Any) -> R:
        """After the first failure: no snapshots, only counting."""
        self._local.depth += 1
        caught: BaseException | None = None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            caught = exc
            raise
        finally:
            self._leave(caught, None)

    def _enter_step(self, step: Step) -> None:
        with self._lock:
            if step.iteration != self._iteration:
                self._ids = None  # a new iteration is a new batch
            self._iteration = step.iteration
            if step.ids is not None:
                self._ids = step.ids
        self._local.stages.append(step.stage or "")
        self._local.depth += 1

    def _exit_step(self, step: Step, exc: BaseException | None) -> None:
        try:
            if exc is None:
                for watch in self._modules:
                    watch.backward_done()
            if exc is None:
                with self._lock:
                    if step.stage:
                        self._last_step = step.stage
                        self._stage_done_in = step.iteration
                    elif self._stage_done_in != step.iteration:
                        # A plain rec.step(it): the iteration is the step. Around named
                        # stages of its own, the last of them says more and is kept.
                        self._last_step = f"iteration {step.iteration}"
            caught = exc if isinstance(exc, Exception) else None
            save: Callable[[BaseException], object] | None = None
            if caught is not None:
                save = functools.partial(self._save_first, watched=None, args=(), kwargs={},
                                         before=Before())
            # A backward that raised inside a watched module: its hooks cannot see the error.
            backward = next((w for w in self._modules if w.backward_open and w.last_call), None)
            if caught is not None and backward is not None and backward.last_call is not None:
                args, kwargs = backward.last_call
                save = functools.partial(self._save_module, watch=backward, args=args,
                                         kwargs=kwargs, backward=True)
            self._leave(caught, save)
        finally:
            # Popped last: a failure is recorded as happening in this stage.
            if self._local.stages:
                self._local.stages.pop()

    def _leave(self, exc: BaseException | None,
               save: Callable[[BaseException], object] | None) -> None:
        """Close a scope: handle its exception once, however many scopes it crosses."""
        local = self._local
        local.depth -= 1
        try:
            if exc is not None and exc is not local.handled:
                self._failed(exc, save)
        finally:
            # Kept only while an enclosing scope may still see the same exception.
            local.handled = exc if exc is not None and local.depth > 0 else None

    def _failed(self, exc: BaseException, save: Callable[[BaseException], object] | None) -> None:
        if self._replaying:
            return
        try:
            with self._lock:
                first = not self._taken
                self._taken = True
                if not first:
                    self._later += 1
                    self._write_later_errors(exc)
            if first and save is not None:
                save(exc)
        except Exception as internal:  # never raise over the user's exception
            say(f"gpucase: could not record the failure ({type(internal).__name__}: "
                f"{internal}); the original error follows")

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

    def _snapshot_before(self, watched: Watched, args: Any, kwargs: Any) -> Before:
        """The call's tensor arguments as they are before it runs: ``snapshot_before`` under
        this Recorder's snapshot settings."""
        return snapshot_before(watched, args, kwargs, snapshot=self.snapshot,
                               snapshot_limit=self.snapshot_limit,
                               device_names=self._device_names, note=self._note_once)

    def _save_first(self, exc: BaseException, watched: Watched | None, args: Any, kwargs: Any,
                    before: Before, rng: Mapping[str, torch.Tensor] | None = None,
                    module: tuple[Mapping[str, torch.Tensor], Mapping[str, Any]] | None = None,
                    ) -> Path:
        stderr_text = read_tail(self.stderr_file) if self.stderr_file is not None else ""
        found = triage_of(exc, stderr_text)
        context = self._context()
        numeric: dict[str, Any] = {}
        if watched is not None:
            try:
                inputs = collect(watched, args, kwargs, before, found, exc)
            except Exception as internal:
                # The origin is still worth writing: error, iteration, ids, versions.
                problem = f"the inputs could not be read ({error_line(internal)})"
                inputs = Inputs(problems=(problem,))
            ids = call_ids(watched, args, kwargs) if watched.ids is not None else None
            ids = ids if ids is not None else context.ids
            with contextlib.suppress(Exception):
                # An RNG state without the inputs that draw from it replays nothing.
                numeric, rng_tensors = numeric_context(
                    inputs.devices, (rng or {}) if inputs.tensors else {})
                extra_tensors, extra_literals = module or ({}, {})
                inputs = dataclasses.replace(
                    inputs, tensors={**inputs.tensors, **extra_tensors, **rng_tensors},
                    literals={**inputs.literals, **extra_literals})
        else:
            inputs, ids = Inputs(), context.ids
        draft = case_draft(exc, watched, inputs, context, ids, stderr_text, self._device_names)
        draft = dataclasses.replace(draft, context=numeric)
        case_dir, new = write_case(self.root, draft)
        with self._lock:
            self._case_dir = case_dir
            if self._later:
                set_later_errors(case_dir, self._later)
        if new:  # else write_case said which case holds it, and that no copy was written
            say(f"gpucase: saved {shown(case_dir)} "
                f"({sized(case_dir)}first failure{where(context)})")
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
        return case_dir

    def _watch_module(self, module: torch.nn.Module, name: str | None, factory: str | None,
                      kwargs: Mapping[str, Any] | None, ids: SampleIds | None) -> None:
        rebuild = rebuild_of(module, factory, kwargs)
        if rebuild.factory is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {rebuild.why_not}")
        case = case_name(name or type(module).__name__)
        self._modules.append(_ModuleWatch(self, module, case, rebuild, ids))

    def _save_module(self, exc: BaseException, watch: _ModuleWatch, args: Any, kwargs: Any,
                     backward: bool) -> None:
        """The whole-module case, then the narrowest module and op cases that reproduce."""
        found = triage_of(exc, "")
        module = watch.module
        recipe: dict[str, Any] = {"factory": watch.rebuild.factory or "",
                                  "kwargs": dict(watch.rebuild.kwargs),
                                  "training": bool(module.training), "backward": backward}
        tensors = {} if unusable(found) else module_state(module)
        if backward:
            grads = {f"{GRAD_PREFIX}{i}": on_host(g) for i, g in enumerate(watch.grad_output)
                     if is_tensor(g)}
            tensors.update(grads)
            recipe["grad_outputs"] = list(grads)
        case_dir = self._save_first(exc, watch.watched, args, kwargs, watch.before, watch.rng,
                                    (tensors, {MODULE_KEY: recipe}))
        inner = watch.innermost
        if not self.narrow or backward or inner is None or inner[0] is not exc:
            return
        if inner[2] is module and not watch.rebuild.factory:
            return  # nothing narrower than a module that cannot be rebuilt
        written = len(self._narrowed_new)
        with contextlib.suppress(Exception):
            write_narrowed(exc, case_dir, module, inner[1:], watch.rng, root=self.root,
                           stderr_file=self.stderr_file, context=self._context(),
                           device_names=self._device_names, kept=self.narrowed,
                           written=self._narrowed_new)
        with contextlib.suppress(Exception):
            note_narrowed_size(case_dir, self._narrowed_new[written:])

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._notes_given:
            self._notes_given.add(key)
            say(message)


class _ModuleWatch:
    """The hooks of one watched module: nothing is replaced, the module stays itself.

    Forward pre-hooks on the module and each submodule keep the stack of entered modules
    (references only); forward hooks called even on an exception (``always_call``) pop it,
    and the innermost one still open when an exception passes is the narrowest module.
    Gradient hooks on the module's outputs note a backward in progress and its grad_output.
    """

    def __init__(self, recorder: Recorder, module: torch.nn.Module, name: str,
                 rebuild: Rebuild, ids: SampleIds | None) -> None:
        self.recorder = recorder
        self.module = module
        self.rebuild = rebuild
        forward = module.forward
        self.watched = watched_call(forward, name, REPLAY_MODULE if rebuild.factory else None, ids)
        if rebuild.factory is None:
            self.watched = dataclasses.replace(self.watched, call=None,
                                               why_not=rebuild.why_not)
        # (qualname, module, args, kwargs, version counters of the tensors among them)
        self.stack: list[tuple[str, torch.nn.Module, Any, Any, dict[int, int]]] = []
        self.innermost: tuple[BaseException, str, torch.nn.Module, Any, Any,
                              dict[int, int]] | None = None
        self.outer: list[BaseException | None] = []
        self.before = Before()
        self.rng: dict[str, torch.Tensor] = {}
        self.last_call: tuple[Any, Any] | None = None
        self.backward_open = False
        self.grad_output: tuple[Any, ...] = ()
        names = {id(m): n for n, m in module.named_modules()}
        for sub in module.modules():
            qualname = names.get(id(sub), "")
            sub.register_forward_pre_hook(functools.partial(self._enter, qualname),
                                          with_kwargs=True)
            sub.register_forward_hook(functools.partial(self._exit, qualname), with_kwargs=True,
                                      always_call=True)

    def _enter(self, qualname: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        rec = self.recorder
        if module is self.module:
            self.outer.append(sys.exc_info()[1])
            rec._local.depth += 1
            self.backward_open = False
            if not rec._taken:
                self.last_call = (args, kwargs)
                with contextlib.suppress(Exception):
                    self.before = rec._snapshot_before(self.watched, args, kwargs)
                    self.rng = rng_state(tensors_of(args, kwargs))
        if not rec._taken:
            # Version reads only: a narrowed case must not hold inputs its forward changed.
            self.stack.append((qualname, module, args, kwargs,
                               tensor_versions(tensors_of(args, kwargs))))

    def _exit(self, qualname: str, module: torch.nn.Module, args: Any, kwargs: Any,
              result: Any) -> None:
        rec = self.recorder
        outer = self.outer[-1] if self.outer else None
        current = sys.exc_info()[1]
        exc = current if isinstance(current, Exception) and current is not outer else None
        if self.stack and self.stack[-1][1] is module:
            entry = self.stack.pop()
            if exc is not None and (self.innermost is None or self.innermost[0] is not exc):
                self.innermost = (exc, *entry)
        if module is not self.module:
            return
        if self.outer:
            self.outer.pop()
        if exc is None and not rec._taken:
            self._hook_outputs(result)
        save = None
        if exc is not None and not rec._taken:
            save = functools.partial(rec._save_module, watch=self, args=args, kwargs=kwargs,
                                     backward=False)
        rec._leave(exc, save)

    def _hook_outputs(self, result: Any) -> None:
        """Gradient hooks on the outputs: their gradients arrive as the module's backward
        starts, and are its grad_output. (A full backward hook would do the same but warns
        on every step of a model whose inputs need no gradient.)"""
        outputs = [t for t in tensors_in(result) if t.requires_grad]
        grads: list[Any] = [None] * len(outputs)
        self.grad_output = ()

        def arrived(index: int, grad: Any) -> None:
            if not self.recorder._taken:
                grads[index] = grad
                self.backward_open = True
                self.grad_output = tuple(grads)

        for index, tensor in enumerate(outputs):
            tensor.register_hook(functools.partial(arrived, index))  # type: ignore[no-untyped-call]

    def backward_done(self) -> None:
        self.backward_open = False
        self.grad_output = ()

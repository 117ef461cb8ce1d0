"""Record the first failure of a training run as a case that ``pytest --gpu-cases`` replays.

Three lines in a training script::

    rec = Recorder("cases")
    loss_fn = rec.watch(loss_fn, name="ce_class4")
    for it, batch in enumerate(loader):
        with rec.step(it, "forward", ids=batch_ids):
            ...

The first exception raised inside a watched call (or inside ``rec.step``) is
written as a case directory: the call target, its tensor inputs with their exact
layout, its literal inputs, and an ``[origin]`` table with the context (error,
iteration, stage, versions, backend, sample ids). Later exceptions in the same
process are counted in that case (``[origin] later_errors``), not saved again.
The exception always propagates unchanged, and nothing here raises over it.

Expect policy: a captured case is written with ``[expect] outcome = "matches"``
and ``xfail = "captured failure: <type>: <message>; remove this line once fixed"``.
The replay is then a strict xfail while the failure reproduces, the fix shows up
as XPASS(strict), and once the line is deleted the case is a regression test
against the float64 CPU reference. Writing ``outcome = "raises"`` instead would
record the bug as the expected behaviour: the replay would be green while
training is broken, and the fix would turn it red. A case that cannot reproduce
the failure faithfully (call not importable, inputs not saved or skipped) gets
no xfail line: its replay fails loudly until the case is completed, instead of
passing as an expected failure for the wrong reason.

Snapshots: with ``snapshot="before"`` (the default) the tensor arguments, host and
device alike, are copied to the host before each call while together they fit
``snapshot_limit`` (device ones first, when only they fit): a call that changes
its input in place and then raises is saved with the input as it was passed, and
a sticky device error cannot lose a device input. Above the limit, or with
``snapshot="after"``, host tensors are saved as they are after the failure and
device tensors are copied after it if the device still answers. What was not
copied is still guarded, by a read of each tensor's version counter before the
call (no copy): when the failing call changed one in place, ``[origin] snapshot``
and a ``gpucase: note:`` say so, and how to save it as passed.

Narrowing: a watched module's failure also writes the innermost submodule that
raised and the single ATen op that raised, each kept only if it reproduces in a
fresh child. Each of them holds its own copy of the tensors it needs (an
embedding's weight, say), so the saved lines show sizes of 1 MiB and more, a note
says when the narrowed cases of one failure are large, and ``Recorder(narrow=False)``
writes the module's case alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import operator
import os
import platform
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

import tomli_w

from pytest_gpucase.base import backends, files
from pytest_gpucase.case import payload
from pytest_gpucase.case.write import FileContent, write_case_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib
from pytest_gpucase.base.tensors import is_tensor, nbytes, tensor_versions, tensors_in
from pytest_gpucase.case.keys import (
    DICT_PREFIX,
    GRAD_PREFIX,
    MODULE_KEY,
    OP_KEY,
    REPLAY_ENV,
    REPLAY_MODULE,
    REPLAY_OP,
    RNG_NAMES,
    STATE_PREFIX,
    TENSORS_KEY,
)
from pytest_gpucase.case.model import CASE_FILE, INPUTS_FILE, VERSION_KEYS
from pytest_gpucase.run.replay import replay_module
from pytest_gpucase.verdict.triage import Triage, assertion_line, triage

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "Recorder", "Step"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound="torch.nn.Module")

DEFAULT_SNAPSHOT_LIMIT = 256 * 2**20
# Host inputs copied before each call from this size up are named once (the copy is paid at
# every step of a loop that never fails).
_HOST_COPY_NOTE = 64 * 2**20
# A "gpucase: saved" line shows the case's size from this size on.
_SHOWN_SIZE = 2**20
# The narrowed cases of one failure above this size in total get a note: each is a copy.
_NARROWED_NOTE_SIZE = 32 * 2**20
STUB_FILE = "case.py"
_MAX_ERROR_CHARS = 300
_STDERR_TAIL_BYTES = 64 * 1024
_STDERR_LINES = 10
_MAX_NAMES = 10_000
_INT64 = (-(2**63), 2**63 - 1)
_CALL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

SampleIds = Callable[..., Iterable[object]]


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


@dataclass(frozen=True)
class _Watched:
    """A watched callable and what a replay needs to know of it."""

    fn: Callable[..., Any]
    name: str
    call: str | None            # "module:qualname" a replay can import, or None
    why_not: str                # when call is None: why, and what to pass instead
    signature: inspect.Signature | None
    ids: SampleIds | None


@dataclass(frozen=True)
class _Context:
    """Where the training loop was when the failure happened."""

    iteration: int | str | None
    stage: str | None
    last_step: str | None
    ids: tuple[str | int, ...] | None


@dataclass(frozen=True)
class _Inputs:
    """A watched call's arguments, sorted into what a case can hold and what it cannot."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)  # on the host
    literals: Mapping[str, Any] = field(default_factory=dict)
    described: Mapping[str, str] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    snapshot: str | None = None
    problems: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # changed in place by the failing call, saved as changed
    shared: tuple[str, ...] = ()   # "buf, view": arguments sharing memory, held apart in a case


@dataclass(frozen=True)
class _Before:
    """A watched call's tensor arguments as they were before it ran, keyed by ``id``: host
    copies where the snapshot rule took them, and every one's version counter (a read)."""

    copies: Mapping[int, torch.Tensor] = field(default_factory=dict)
    versions: Mapping[int, int] = field(default_factory=dict)
    # Why a tensor without a copy has none, and how to get one: the fix a note names.
    why_not: str = ""


@dataclass(frozen=True)
class _Draft:
    """Everything a case directory will hold, before it is written."""

    name: str
    call: str
    summary: str
    xfail: str | None
    literals: Mapping[str, Any]
    origin: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]
    files: Mapping[str, str]
    context: Mapping[str, Any] = field(default_factory=dict)


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
        watched = _watched(fn, name, call, ids)
        if watched.call is None and call is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {watched.why_not}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._taken:
                return self._call_after_first(fn, args, kwargs)
            before = self._snapshot_before(watched, args, kwargs)
            rng = _rng_state(_tensors_of(args, kwargs))
            self._local.depth += 1
            caught: BaseException | None = None
            try:
                result = fn(*args, **kwargs)
                if self.sync:
                    # An asynchronous kernel error surfaces here, in the call that launched it.
                    _synchronize(_tensors_of(args, kwargs))
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
                    None if given is None else _id_tuple(given))

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
                                         before=_Before())
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
                f"{_shown(self._case_dir)} [origin] later_errors (likely a consequence): "
                f"{_error_line(exc)}")
        _set_later_errors(self._case_dir, self._later)

    def _context(self) -> _Context:
        with self._lock:
            stages = self._local.stages
            return _Context(self._iteration, stages[-1] if stages and stages[-1] else None,
                            self._last_step, self._ids)

    def _snapshot_before(self, watched: _Watched, args: Any, kwargs: Any) -> _Before:
        """The call's tensor arguments as they are before it runs: ``snapshot_before`` under
        this Recorder's snapshot settings."""
        return snapshot_before(watched, args, kwargs, snapshot=self.snapshot,
                               snapshot_limit=self.snapshot_limit,
                               device_names=self._device_names, note=self._note_once)

    def _save_first(self, exc: BaseException, watched: _Watched | None, args: Any, kwargs: Any,
                    before: _Before, rng: Mapping[str, torch.Tensor] | None = None,
                    module: tuple[Mapping[str, torch.Tensor], Mapping[str, Any]] | None = None,
                    ) -> Path:
        stderr_text = _read_tail(self.stderr_file) if self.stderr_file is not None else ""
        found = _triage(exc, stderr_text)
        context = self._context()
        numeric: dict[str, Any] = {}
        if watched is not None:
            try:
                inputs = _collect(watched, args, kwargs, before, found, exc)
            except Exception as internal:
                # The origin is still worth writing: error, iteration, ids, versions.
                problem = f"the inputs could not be read ({_error_line(internal)})"
                inputs = _Inputs(problems=(problem,))
            ids = _call_ids(watched, args, kwargs) if watched.ids is not None else None
            ids = ids if ids is not None else context.ids
            with contextlib.suppress(Exception):
                # An RNG state without the inputs that draw from it replays nothing.
                numeric, rng_tensors = _numeric_context(
                    inputs.devices, (rng or {}) if inputs.tensors else {})
                extra_tensors, extra_literals = module or ({}, {})
                inputs = dataclasses.replace(
                    inputs, tensors={**inputs.tensors, **extra_tensors, **rng_tensors},
                    literals={**inputs.literals, **extra_literals})
        else:
            inputs, ids = _Inputs(), context.ids
        draft = case_draft(exc, watched, inputs, context, ids, stderr_text, self._device_names)
        draft = dataclasses.replace(draft, context=numeric)
        case_dir, new = _write_case(self.root, draft)
        with self._lock:
            self._case_dir = case_dir
            if self._later:
                _set_later_errors(case_dir, self._later)
        if new:  # else _count_seen said which case holds it, and that no copy was written
            say(f"gpucase: saved {_shown(case_dir)} "
                f"({_sized(case_dir)}first failure{_where(context)})")
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
        rebuild = _rebuild(module, factory, kwargs)
        if rebuild.factory is None:
            # Said now, not after hours of training: the case could not be replayed as is.
            say(f"gpucase: warning: {rebuild.why_not}")
        case = _case_name(name or type(module).__name__)
        self._modules.append(_ModuleWatch(self, module, case, rebuild, ids))

    def _save_module(self, exc: BaseException, watch: _ModuleWatch, args: Any, kwargs: Any,
                     backward: bool) -> None:
        """The whole-module case, then the narrowest module and op cases that reproduce."""
        found = _triage(exc, "")
        module = watch.module
        recipe: dict[str, Any] = {"factory": watch.rebuild.factory or "",
                                  "kwargs": dict(watch.rebuild.kwargs),
                                  "training": bool(module.training), "backward": backward}
        tensors = {} if _unusable(found) else _state(module)
        if backward:
            grads = {f"{GRAD_PREFIX}{i}": _host(g) for i, g in enumerate(watch.grad_output)
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


def say(message: str) -> None:
    """Print one of the Recorder's lines on stderr."""
    # A closed or broken stderr must not turn into a second error.
    with contextlib.suppress(Exception):
        print(message, file=sys.stderr, flush=True)


def _watched(fn: Callable[..., Any], name: str | None, call: str | None,
             ids: SampleIds | None) -> _Watched:
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    label = (getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
             or f"a {type(fn).__name__} instance")
    found, why_not = (call, "") if call is not None else _import_name(fn, label)
    case_name = _case_name(name or getattr(fn, "__name__", None) or type(fn).__name__)
    return _Watched(fn, case_name, found, why_not, signature, ids)


def _import_name(fn: Callable[..., Any], label: str) -> tuple[str | None, str]:
    """``module:qualname`` when importing it gives ``fn`` back, else why not and what to do."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    short = getattr(fn, "__name__", None) or "func"
    fix = (f"move {short} into an importable module and watch it from there, or pass "
           f"rec.watch(..., call=\"package.module:{short}\") naming where a replay can import "
           "it")
    if inspect.ismethod(fn):
        return None, (f"{label} is a bound method, which a replay cannot import (it needs the "
                      f"instance); watch a module-level function that takes the tensors: {fix}")
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None, (f"{label} has no module-level name a replay can import; watch a "
                      f"module-level function that calls it instead: {fix}")
    if module_name == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        where = f" of {Path(script).name}" if script else ""
        return None, (f"{label} is defined in __main__{where}, which a replay cannot import; "
                      f"{fix}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        return None, f"{label} is defined inside a function, which a replay cannot import; {fix}"
    module = sys.modules.get(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    # A decorated function is found as its wrapper once the module has finished importing.
    if module is not None and obj is not None and (
            obj is fn or getattr(obj, "__wrapped__", None) is fn):
        return f"{module_name}:{qualname}", ""
    if module is not None and obj is None and getattr(module, "__spec__", None) is not None:
        # Decorated while its module is still executing: the name is bound right after.
        return f"{module_name}:{qualname}", ""
    return None, f"{module_name}:{qualname} does not give back {label} when imported; {fix}"


def _case_name(raw: str) -> str:
    """A safe, visible directory name: no separators, no leading dot."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).strip("._-")
    return name or "case"


def _id_tuple(ids: Iterable[object]) -> tuple[str | int, ...]:
    return tuple(i if isinstance(i, int) and not isinstance(i, bool) and
                 _INT64[0] <= i <= _INT64[1] else str(i) for i in ids)


def _call_ids(watched: _Watched, args: Any, kwargs: Any) -> tuple[str | int, ...] | None:
    try:
        assert watched.ids is not None
        return _id_tuple(watched.ids(*args, **kwargs))
    except Exception as exc:
        say(f"gpucase: the ids callable of {watched.name} raised "
            f"{type(exc).__name__}: {exc}; sample ids not recorded")
        return None


def _error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS - 1] + "…"


def _triage(exc: BaseException, stderr_text: str) -> Triage | None:
    try:
        return triage(type(exc).__name__, str(exc), stderr_text)
    except Exception:
        return None


def _where(context: _Context) -> str:
    """`` at iteration 3, in loss, after forward``: as much of it as is known."""
    parts = []
    # Outside any step once iteration N completed, the failure is after N, not "at" it.
    after_it = context.last_step == f"iteration {context.iteration}"
    if context.iteration is not None and not after_it:
        parts.append(f"at iteration {context.iteration}")
    if context.stage is not None:
        parts.append(f"in {context.stage}")
    if context.last_step is not None:
        parts.append(f"after {context.last_step}")
    return " " + ", ".join(parts) if parts else ""


def _revision() -> str | None:
    """``git describe`` of the working directory, if it is a repository (bounded in time)."""
    from pytest_gpucase.plan.environment import git_revision

    try:
        return git_revision(os.getcwd())
    except OSError:
        return None


def _read_tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _STDERR_TAIL_BYTES))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _stderr_excerpt(text: str) -> str | None:
    """The kernel's assertion line if stderr holds one, else its last few lines."""
    if not text.strip():
        return None
    line = assertion_line(text)
    if line is not None:
        return line
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-_STDERR_LINES:])


def snapshot_before(watched: _Watched, args: Any, kwargs: Any, *, snapshot: str,
                    snapshot_limit: int, device_names: dict[str, str],
                    note: Callable[[str, str], None]) -> _Before:
    """Host copies of the tensor arguments while they fit ``snapshot_limit`` (device ones
    first: a sticky error would lose them), and every one's version counter.

    A host tensor is copied too: the call may change it in place before it raises,
    and the case must hold what was passed. The version counters cost a read each,
    and tell, after a failure, which tensors without a copy the call changed. Each
    device's name is asked for on the way (into ``device_names``); ``note(key, line)`` says
    a line once per key.
    """
    tensors = list({id(t): t for t in _tensors_of(args, kwargs)}.values())
    if not tensors:
        return _Before()
    versions = tensor_versions(tensors)
    try:
        device = [t for t in tensors if t.device.type != "cpu"]
        _remember_device_names(device, device_names)
        if snapshot != "before":
            return _Before(versions=versions, why_not=(
                'snapshot="after"; Recorder(snapshot="before") copies them before each call, '
                "as passed"))
        stored = [t for t in tensors if _storable(t)]
        total = sum(nbytes(t) for t in stored)
        taken = stored
        why_not = ""
        if total > snapshot_limit:
            on_device = [t for t in stored if t.device.type != "cpu"]
            device_total = sum(nbytes(t) for t in on_device)
            taken = on_device if on_device and device_total <= snapshot_limit else []
            what = ("only the device ones are copied before each call" if taken else
                    "they are not copied before the call: device ones are copied after "
                    "a failure, if the device still answers")
            limit = _mib(snapshot_limit)
            why_not = (f"over the snapshot limit of {limit}; Recorder(snapshot_limit=...) "
                       f"of {_mib(total)} or more copies them before each call, "
                       "as passed")
            note(f"limit:{watched.name}", (
                f"gpucase: note: the inputs of {watched.name} hold {_mib(total)}, "
                f"over the snapshot limit of {limit}: {what}, and host ones are saved as "
                "they are after a failure (Recorder(snapshot_limit=...) to change)"))
        copies = {id(t): payload.to_device(t, "cpu", copy=True) for t in taken}
        host = sum(nbytes(t) for t in taken if t.device.type == "cpu")
        if host >= _HOST_COPY_NOTE:
            # Paid by every step of a loop that never fails: said once, with the way out.
            note(f"host-copy:{watched.name}", (
                f"gpucase: note: {_mib(host)} of host inputs of {watched.name} are "
                "copied before each call, so that a failure saves them as passed; "
                "Recorder(snapshot_limit=...) below that size, or snapshot=\"after\", "
                "skips the copy"))
        return _Before(copies, versions, why_not)
    except Exception:
        # The device did not answer before the call; the call itself will tell.
        return _Before(versions=versions, why_not="the copy before the call failed")


def _remember_device_names(tensors: list[torch.Tensor], names: dict[str, str]) -> None:
    """Ask each device its name while it answers, so a sticky error cannot hide it."""
    import torch

    for tensor in tensors:
        device = str(tensor.device)
        if device in names:
            continue
        name = device
        try:
            if tensor.device.type == "cuda":
                name = torch.cuda.get_device_name(tensor.device)
            elif tensor.device.type == "xpu":
                name = torch.xpu.get_device_name(tensor.device)
        except Exception:
            pass
        names[device] = name


def _tensors_of(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among the arguments, and those of any dict-of-tensors argument."""
    import torch

    values = list(args) + list(kwargs.values())
    values += [v for d in values if isinstance(d, Mapping) for v in d.values()]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _tensor_dict(value: Any) -> dict[str, torch.Tensor] | None:
    """``value`` when it is a non-empty dict of tensors under string keys, else None."""
    if (isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value)
            and all(is_tensor(v) for v in value.values())):
        return dict(value)
    return None


def _storable(tensor: torch.Tensor) -> bool:
    import torch

    names = {name for name, _ in payload.DTYPES.values()}
    return tensor.layout == torch.strided and str(tensor.dtype).removeprefix("torch.") in names


def _synchronize(tensors: list[torch.Tensor]) -> None:
    import torch

    for device in {t.device for t in tensors if t.device.type != "cpu"}:
        backends.synchronize(torch, device)


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    text = f"{dtype} {tuple(tensor.shape)} stride {tuple(tensor.stride())}"
    if tensor.storage_offset():
        text += f" offset {tensor.storage_offset()}"
    return f"{text} {tensor.device}"


def _bind(watched: _Watched, args: Any, kwargs: Any,
          ) -> tuple[list[tuple[str, Any, inspect.Parameter | None]], list[str]]:
    """The call's arguments by name, and why some could not be passed by keyword in a replay."""
    problems: list[str] = []
    if watched.signature is None:
        if args:
            problems.append(f"the signature of {watched.name} cannot be read, so its positional "
                            "arguments are saved as arg0, arg1, ...: rename them in the case")
        return ([(f"arg{i}", v, None) for i, v in enumerate(args)]
                + [(k, v, None) for k, v in kwargs.items()], problems)
    try:
        bound = watched.signature.bind(*args, **kwargs)
    except TypeError as exc:
        problems.append(f"the arguments do not fit the signature of {watched.name} ({exc})")
        return ([(f"arg{i}", v, None) for i, v in enumerate(args)]
                + [(k, v, None) for k, v in kwargs.items()], problems)
    named: list[tuple[str, Any, inspect.Parameter | None]] = []
    for name, value in bound.arguments.items():
        param = watched.signature.parameters[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                problems.append(f"*{name} got {len(value)} extra positional arguments, which a "
                                "replay cannot pass by keyword")
                named.extend((f"{name}{i}", v, None) for i, v in enumerate(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            named.extend((key, v, None) for key, v in value.items())
        else:
            if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                problems.append(f"{name} is positional-only, and a replay passes inputs by "
                                "keyword: wrap the function")
            named.append((name, value, param))
    return named, problems


def _collect(watched: _Watched, args: Any, kwargs: Any, before: _Before,
             found: Triage | None, exc: BaseException) -> _Inputs:
    """Sort the arguments into tensors (on the host), literals and skipped values."""
    import torch

    named, problems = _bind(watched, args, kwargs)
    tensors: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    literals: dict[str, Any] = {}
    described: dict[str, str] = {}
    skipped: dict[str, str] = {}
    devices: list[str] = []
    copied: list[str] = []
    host_after: list[str] = []
    device_after: list[str] = []
    changed: list[str] = []
    storages: dict[tuple[str, int], list[str]] = {}

    def take(name: str, value: torch.Tensor) -> None:
        described[name] = _describe(value)
        devices.append(str(value.device))
        with contextlib.suppress(Exception):   # no storage (a functional tensor): no sharing
            where = value.untyped_storage().data_ptr()
            if where:
                storages.setdefault((str(value.device), where), []).append(name)
        if not _storable(value):
            skipped[name] = f"Tensor ({value.layout}, {value.dtype}): not storable"
            return
        if id(value) in before.copies:
            tensors[name] = before.copies[id(value)]
            copied.append(name)
            return
        version = before.versions.get(id(value))
        if version is not None and tensor_versions([value]).get(id(value), version) != version:
            changed.append(name)
        if value.device.type == "cpu":
            tensors[name] = value.detach()
            host_after.append(name)
        else:
            pending[name] = value

    for name, value, param in named:
        if isinstance(value, torch.Tensor):
            take(name, value)
            continue
        group = _tensor_dict(value)
        if group is not None:
            # Each tensor under its own payload name; [inputs] says how to rebuild the dict.
            members = {key: f"{DICT_PREFIX}{name}.{key}" for key in group}
            for key, tensor in group.items():
                take(members[key], tensor)
            literals[name] = {TENSORS_KEY: members}
            continue
        if value is None and param is not None and param.default is None:
            continue  # the replay gets the same None from the default
        literal = _literal(value)
        if literal is _NOT_LITERAL:
            skipped[name] = _type_name(value)
        else:
            literals[name] = literal
    unsaved = None
    if pending:
        reason = _unusable(found)
        if reason is None:
            try:
                for name, value in pending.items():
                    tensors[name] = payload.to_device(value, "cpu")
                device_after.extend(pending)
            except Exception as copy_error:
                reason = (f"{found.clue if found else type(exc).__name__} (copying {name} to the "
                          f"host raised {_error_line(copy_error)})")
                for name in pending:
                    tensors.pop(name, None)
        if reason is not None:
            unsaved = f"not saved: device unusable after {reason}"
            if tensors:
                unsaved += f"; saved from the host: {', '.join(sorted(tensors))}"
    groups = [(label, names) for label, names in (
        ("tensors copied before the call", copied),
        ("host tensors, as they were after the failure", host_after),
        ("device tensors copied after the failure", device_after)) if names]
    snapshot = unsaved
    if snapshot is None and groups:
        snapshot = (groups[0][0] if len(groups) == 1 else
                    "; ".join(f"{label}: {', '.join(names)}" for label, names in groups))
    changed = [name for name in changed if name in tensors]
    if changed and snapshot is not None:
        snapshot += (f"; changed in place by the failing call, so saved as changed: "
                     f"{', '.join(changed)} (not copied before the call: {before.why_not})")
    # A case holds each tensor on its own: a failure that needs a write through one argument
    # to show in another (a buffer and a view of it) cannot replay as captured.
    shared = tuple(", ".join(names) for names in storages.values() if len(names) > 1)
    if shared and snapshot is not None:
        snapshot += f"; shared memory in the call, held apart in the case: {'; '.join(shared)}"
    if skipped:
        problems.append(f"{', '.join(sorted(skipped))} could not be saved (see [origin] "
                        "skipped_inputs): add them to [inputs] or to inputs.safetensors")
    return _Inputs(tensors=tensors, literals=literals, described=described, skipped=skipped,
                   snapshot=snapshot, problems=tuple(problems), devices=tuple(devices),
                   changed=tuple(changed), shared=shared)


def _unusable(found: Triage | None) -> str | None:
    """Why the device must not be touched again, or None when it may still answer."""
    return found.clue if found is not None and found.sticky else None


def _rebuild_hint(inputs: _Inputs, ids: tuple[str | int, ...] | None) -> str:
    missing = sorted(set(inputs.described) - set(inputs.tensors) - set(inputs.skipped))
    names = ", ".join(missing)
    if ids:
        source = (f"rebuild the batch from the {len(ids)} [origin] sample_ids with the same data "
                  "pipeline")
    else:
        source = ("no sample ids were recorded (pass rec.step(it, stage, ids=...) or "
                  "rec.watch(fn, ids=...) next time), so rebuild the batch from the iteration")
    why = (inputs.snapshot or "").removeprefix("not saved: ")
    return (f"{names} not saved ({why}): {source}, then save it with "
            f"pytest_gpucase.payload.save(<case>/{INPUTS_FILE}, {{...}}) under the names {names}")


def _backend(devices: tuple[str, ...], torch: Any) -> str:
    kinds = [d.split(":")[0] for d in devices if not d.startswith("cpu")]
    if not kinds:
        return "cpu"
    return backends.run_backend(kinds[0], backends.detect(torch))


def _stub(reason: str) -> str:
    message = json.dumps(f"gpucase: this case cannot be replayed as captured: {reason}",
                         ensure_ascii=False)
    return (
        '"""Stand-in written by pytest_gpucase.capture: the failing call could not be named."""\n'
        "\n\n"
        "def run(**inputs: object) -> object:\n"
        f"    raise NotImplementedError({message})\n"
    )


def _type_name(value: Any) -> str:
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class _NotLiteral:
    """Marks a value TOML cannot hold."""


_NOT_LITERAL: Any = _NotLiteral()


def _literal(value: Any) -> Any:
    """``value`` as plain TOML data (tuples become arrays), or ``_NOT_LITERAL``."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value) if _INT64[0] <= value <= _INT64[1] else _NOT_LITERAL
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [_literal(v) for v in value]
        return _NOT_LITERAL if any(i is _NOT_LITERAL for i in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _NOT_LITERAL
        table = {k: _literal(v) for k, v in value.items()}
        return _NOT_LITERAL if any(v is _NOT_LITERAL for v in table.values()) else table
    return _NOT_LITERAL


def case_draft(exc: BaseException, watched: _Watched | None, inputs: _Inputs, context: _Context,
               ids: tuple[str | int, ...] | None, stderr_text: str,
               device_names: Mapping[str, str]) -> _Draft:
    """The case of a failure: its call (or a stand-in ``case.py``), summary, xfail line (none
    when the case is incomplete) and ``[origin]`` table; ``device_names`` are the names the
    devices gave while they answered."""
    import torch

    error = _error_line(exc)
    incomplete = list(inputs.problems)
    files: dict[str, str] = {}
    if watched is None:
        name = _case_name(f"step_{context.stage}" if context.stage else "failure")
        incomplete.insert(0, "the failure happened outside any watched call, so no inputs "
                          "were saved: watch the function that raised with rec.watch(fn)")
        what = "a step"
    else:
        name = watched.name
        what = str(getattr(watched.fn, "__qualname__", watched.name))
        what = watched.call if watched.call and watched.call != REPLAY_MODULE else what
        if watched.call is None:
            incomplete.insert(0, watched.why_not)
    if inputs.snapshot is not None and inputs.snapshot.startswith("not saved"):
        incomplete.append(_rebuild_hint(inputs, ids))
    call = watched.call if watched is not None and watched.call else f"{STUB_FILE}:run"
    if call.startswith(STUB_FILE):
        files[STUB_FILE] = _stub(incomplete[0])
    summary = f"{what} raised {error}{_where(context)}"
    if incomplete:
        summary = f"INCOMPLETE: {'; '.join(incomplete)}. Captured: {summary}"
    devices = inputs.devices
    backend = _backend(devices, torch)
    origin: dict[str, Any] = {"error": error}
    with contextlib.suppress(Exception):
        from pytest_gpucase.verdict.triage import failure_class

        kind = failure_class(type(exc).__name__, str(exc), stderr_text)
        if kind is not None:
            origin["failure_class"] = kind
    excerpt = _stderr_excerpt(stderr_text)
    if excerpt:
        origin["stderr"] = excerpt
    if context.iteration is not None:
        origin["iteration"] = context.iteration
    if context.stage is not None:
        origin["stage"] = context.stage
    if context.last_step is not None:
        origin["last_step"] = context.last_step
    revision = _revision()
    if revision:
        origin["revision"] = revision
    origin["python"] = platform.python_version()
    origin["torch"] = torch.__version__
    origin["backend"] = backend
    device = next((d for d in devices if d != "cpu"), None)
    if device is not None:
        origin["device"] = device_names.get(device, device)
    # The build's version _where [matrix] can require it (cuda, hip): backends.py says which.
    row = backends.backend(backend)
    version = getattr(torch.version, row.version, None) if row and row.version else None
    if row is not None and row.version in VERSION_KEYS and version:
        origin[row.version] = version
    if ids is not None:
        origin["sample_ids"] = list(ids)
    if inputs.snapshot is not None:
        origin["snapshot"] = inputs.snapshot
    origin["captured"] = datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    origin["later_errors"] = 0
    if incomplete:
        origin["incomplete"] = incomplete
    if inputs.described:
        origin["inputs"] = dict(inputs.described)
    if inputs.skipped:
        origin["skipped_inputs"] = dict(inputs.skipped)
    xfail = None if incomplete else (f"captured failure: {error}; remove this line once "
                                     "fixed")
    return _Draft(name=name, call=call, summary=summary, xfail=xfail,
                  literals=inputs.literals, origin=origin, tensors=inputs.tensors,
                  files=files)


def _case_document(draft: _Draft) -> dict[str, Any]:
    """The ``case.toml`` document of a draft."""
    doc: dict[str, Any] = {"format": 1, "summary": draft.summary, "call": draft.call}
    if draft.xfail is not None:
        doc["xfail"] = draft.xfail
    if draft.literals:
        doc["inputs"] = dict(draft.literals)
    doc["expect"] = {"outcome": "matches"}
    autocast = draft.context.get("autocast")
    if draft.call == REPLAY_MODULE and isinstance(autocast, Mapping):
        doc["expect"]["tolerance"] = {autocast["dtype"]: _model_tolerance(autocast["dtype"])}
    if draft.context:
        doc["context"] = dict(draft.context)
    doc["origin"] = dict(draft.origin)
    return doc


def _model_tolerance(dtype: str) -> dict[str, float]:
    """What "matches" means for a whole module computed under autocast against float64.

    The dtype's default tolerance is for one op; a module rounds at every layer, so a
    correct model under bf16 autocast lands a few units of epsilon away (4 bf16 ULPs on
    the example's logits). Four epsilons, relative and absolute.
    """
    import torch

    eps = torch.finfo(getattr(torch, dtype)).eps
    return {"rtol": 4 * eps, "atol": 4 * eps}


def _claim(root: Path, name: str) -> Path:
    """Create the first free ``name``, ``name-2``, ... as an empty directory; mkdir is the lock."""
    for number in itertools.count(1):
        candidate = root / (name if number == 1 else f"{name}-{number}")
        try:
            candidate.mkdir()
        except FileExistsError:
            if number >= _MAX_NAMES:
                raise
            continue
        return candidate
    raise AssertionError("unreachable")  # itertools.count never ends


def _write_case(root: Path, draft: _Draft) -> tuple[Path, bool]:
    """Write a case directory atomically under ``root``; never overwrite one. Returns the
    case and whether this call wrote it.

    A rerun that hits the same failure (same call, failure class and inputs) finds the
    case it wrote before: that one's ``[origin] seen`` and ``last_seen`` are updated instead,
    and it is returned with False.
    """
    written, new = _write_kept(root, draft, None)
    assert written is not None  # nothing to refuse without ``keep``
    return written, new


class _NotWritten(Exception):
    """The staged case is not kept: the same failure was saved before, or ``keep`` said no."""

    def __init__(self, existing: Path | None) -> None:
        super().__init__(str(existing))
        self.existing = existing


def _write_kept(root: Path, draft: _Draft, keep: Callable[[Path], bool] | None,
                ) -> tuple[Path | None, bool]:
    """Write a case as ``_write_case`` does, once ``keep(staged directory)`` says yes.

    Returns the case and whether this call wrote it: (None, False) when ``keep`` said
    no, (the earlier case, False) when it holds the same failure.

    ``write_case_dir`` writes it into a hidden temporary directory beside the
    target (hidden directories are not collected), ``case.toml`` last; the directory
    is then renamed onto a freshly claimed empty name.
    """
    files: dict[str, FileContent] = dict(draft.files)
    if draft.tensors:
        tensors = draft.tensors
        files[INPUTS_FILE] = lambda path: payload.save(path, tensors)

    def check(staged: Path) -> None:
        seen = _same_failure_case(root, draft, staged)
        if seen is not None:
            raise _NotWritten(seen)
        if keep is not None and not keep(staged):
            raise _NotWritten(None)

    try:
        return write_case_dir(root / draft.name, _case_document(draft), files,
                                     check=check, claim=lambda: _claim(root, draft.name)), True
    except _NotWritten as stop:
        if stop.existing is not None:
            _count_seen(stop.existing)
        return stop.existing, False


def _read_doc(case_dir: Path) -> dict[str, Any] | None:
    try:
        return tomllib.loads((case_dir / CASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _same_failure_case(root: Path, draft: _Draft, staged: Path) -> Path | None:
    """An earlier case of ``draft.name`` (or ``name-N``) with the same call, failure class
    and inputs hash: the same failure, met again by a rerun."""
    failure = draft.origin.get("failure_class")
    if failure is None:
        return None
    mine = payload.content_hash(staged / INPUTS_FILE) if (staged / INPUTS_FILE).exists() else ""
    pattern = re.compile(rf"{re.escape(draft.name)}(-\d+)?")
    for candidate in sorted(root.iterdir()):
        if not pattern.fullmatch(candidate.name) or not candidate.is_dir():
            continue
        doc = _read_doc(candidate)
        if doc is None or doc.get("call") != draft.call:
            continue
        if doc.get("origin", {}).get("failure_class") != failure:
            continue
        inputs = candidate / INPUTS_FILE
        theirs = payload.content_hash(inputs) if inputs.exists() else ""
        if theirs == mine:
            return candidate
    return None


def _count_seen(case_dir: Path) -> None:
    """``[origin] seen += 1`` and ``last_seen`` = today, rewritten atomically."""
    doc = _read_doc(case_dir)
    if doc is None:
        return
    origin = doc.setdefault("origin", {})
    origin["seen"] = int(origin.get("seen", 1)) + 1
    origin["last_seen"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    files.write_text_atomic(case_dir / CASE_FILE, tomli_w.dumps(doc))
    say(f"gpucase: the same failure as {_shown(case_dir)} (seen {origin['seen']} "
        "times): its [origin] seen and last_seen were updated, no copy written")


def _context_doc(case: Any) -> dict[str, Any]:
    doc = _read_doc(case.path)
    table = doc.get("context", {}) if doc else {}
    return dict(table) if isinstance(table, dict) else {}


def _set_later_errors(case_dir: Path, count: int) -> None:
    """Rewrite ``[origin] later_errors`` of a case in place, atomically (through tomli-w)."""
    file = case_dir / CASE_FILE
    doc = tomllib.loads(file.read_text(encoding="utf-8"))
    origin = doc.get("origin")
    if not isinstance(origin, dict) or "later_errors" not in origin:
        return
    origin["later_errors"] = count
    files.write_text_atomic(file, tomli_w.dumps(doc))


def _case_bytes(case_dir: Path) -> int:
    """The bytes of the files a case directory holds."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(case_dir) if entry.is_file())
    except OSError:
        return 0


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _sized(case_dir: Path) -> str:
    """``"98.1 MiB; "`` for a case of ``_SHOWN_SIZE`` or more (one to commit with care), else
    nothing."""
    size = _case_bytes(case_dir)
    return f"{_mib(size)}; " if size >= _SHOWN_SIZE else ""


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)


# --- numeric context ----------------------------------------------------------------------------

def _rng_state(tensors: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The RNG states random ops will consume, taken before the call (a few KB, no sync)."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is not None:
        with contextlib.suppress(Exception):
            states["cuda"] = torch.cuda.get_rng_state(cuda)
    return states


def _numeric_context(devices: Iterable[str], rng: Mapping[str, torch.Tensor],
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``[context]`` table of the failing call, read while still inside its regions, and
    the RNG state tensors it names (docs/case-format.md, "[context]")."""
    import torch

    kinds = [d.split(":")[0] for d in devices]
    device_type = next((k for k in kinds if k != "cpu"), "cpu")
    context: dict[str, Any] = {}
    for kind in dict.fromkeys((device_type, "cpu")):
        with contextlib.suppress(Exception):  # a device type this build does not know
            if torch.is_autocast_enabled(kind):
                dtype = str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
                context["autocast"] = {"device_type": kind, "dtype": dtype, "enabled": True}
                break
    context["grad"] = torch.is_grad_enabled()
    context["inference"] = torch.is_inference_mode_enabled()
    context["deterministic"] = torch.are_deterministic_algorithms_enabled()
    context["tf32"] = {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                       "cudnn": bool(torch.backends.cudnn.allow_tf32)}
    context["default_dtype"] = str(torch.get_default_dtype()).removeprefix("torch.")
    tensors = {RNG_NAMES[kind]: state for kind, state in rng.items() if kind in RNG_NAMES}
    if tensors:
        context["rng"] = {kind: RNG_NAMES[kind] for kind in rng if kind in RNG_NAMES}
    return context, tensors


# --- modules ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rebuild:
    """How a replay rebuilds a module: an importable factory and its literal arguments."""

    factory: str | None
    kwargs: Mapping[str, Any]
    why_not: str = ""


def _rebuild(module: torch.nn.Module, factory: str | None,
             kwargs: Mapping[str, Any] | None) -> _Rebuild:
    """The factory given at watch time, or the module's class called with the constructor
    arguments read back from its same-named attributes (what torch.nn built-ins keep)."""
    if factory is not None:
        literal = _literal(dict(kwargs or {}))
        if literal is _NOT_LITERAL:
            return _Rebuild(None, {}, f"rec.watch(..., kwargs=...) for {factory} holds values "
                            "TOML cannot: pass numbers, strings, booleans and lists only")
        return _Rebuild(factory, literal)
    cls = type(module)
    fix = ("pass rec.watch(model, factory=\"package.module:make_model\", kwargs={...}) naming "
           "a function that builds it")
    target, why_not = _import_name(cls, cls.__qualname__)
    if target is None:
        return _Rebuild(None, {}, f"{cls.__qualname__} cannot be rebuilt by a replay "
                        f"({why_not.split(';')[0]}): {fix}")
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return _Rebuild(None, {}, f"the constructor of {cls.__qualname__} has no readable "
                        f"signature: {fix}")
    found: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name in ("device",
                                                                                 "dtype"):
            continue
        value = getattr(module, name, _NOT_LITERAL)
        if isinstance(param.default, bool) and not isinstance(value, bool) and (
                value is None or is_tensor(value)):
            value = value is not None  # Linear(bias=True) keeps bias as a Parameter or None
        literal = _NOT_LITERAL if value is None else _literal(value)
        if literal is not _NOT_LITERAL:
            found[name] = literal
        elif value is None and param.default is None:
            continue
        elif param.default is param.empty:
            return _Rebuild(None, {}, f"{cls.__qualname__}({name}=...) cannot be read back "
                            f"from the module: {fix}")
    return _Rebuild(target, found)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.device.type == "cpu" else payload.to_device(tensor, "cpu")


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers on the host, under ``state.<name>``."""
    import torch

    state: dict[str, Any] = module.state_dict(keep_vars=True)
    return {f"{STATE_PREFIX}{name}": _host(value).clone() for name, value in state.items()
            if isinstance(value, torch.Tensor) and _storable(value)}


def write_narrowed(exc: BaseException, case_dir: Path, module: torch.nn.Module,
                   entered: tuple[str, torch.nn.Module, Any, Any, Mapping[int, int]],
                   rng: Mapping[str, torch.Tensor], *, root: Path,
                   stderr_file: Path | None, context: _Context,
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
    failure = failure_class(type(exc).__name__, str(exc), _read_tail(stderr_file)
                            if stderr_file is not None else "")
    start = "spawn" if torch.cuda.is_initialized() else "fork"  # type: ignore[no-untyped-call]
    base = case_dir.name
    module_dir = case_dir
    if sub is not module:
        rebuild = _rebuild(sub, None, None)
        if rebuild.factory is None:
            say(f"gpucase: note: {qualname} not narrowed: {rebuild.why_not}")
            return
        inner = _watched(sub.forward, f"{base}.{qualname}", REPLAY_MODULE, None)
        recipe = {"factory": rebuild.factory, "kwargs": dict(rebuild.kwargs),
                  "training": bool(sub.training), "backward": False}
        found = _triage(exc, "")
        inputs = _collect(inner, args, kwargs, _Before(versions=versions), found, exc)
        if inputs.changed:
            say(f"gpucase: note: {qualname} not narrowed: its forward changed "
                f"{', '.join(inputs.changed)} in place before it raised, so its "
                f"inputs as passed are gone ({_shown(case_dir)} holds the "
                "module's inputs as passed)")
            _narrow_op(exc, case_dir, base, failure, start, root=root, kept=kept,
                       written=written)
            return
        numeric, rng_tensors = _numeric_context(inputs.devices, rng)
        inputs = dataclasses.replace(
            inputs, tensors={**inputs.tensors, **_state(sub), **rng_tensors},
            literals={**inputs.literals, MODULE_KEY: recipe})
        draft = case_draft(exc, inner, inputs, context, context.ids, "", device_names)
        draft = dataclasses.replace(draft, context=numeric, origin={
            **draft.origin, "narrowed_from": base, "module": qualname})
        saved, new = _write_kept(root, draft, lambda tmp: _reproduces(tmp, failure, start))
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
    draft = _Draft(
        name=f"{base}.{op}", call=REPLAY_OP,
        summary=f"{op} raised {_error_line(exc)} (narrowed from {base})",
        xfail=case.xfail, literals={OP_KEY: table},
        origin={**case.origin, "narrowed_from": base, "op": op},
        tensors=tensors, files={},
        context={k: v for k, v in _context_doc(case).items() if k != "rng"})
    saved, new = _write_kept(root, draft, lambda tmp: _reproduces(tmp, failure, start))
    _report(saved, f"op {op}", new, kept, written)


def _report(saved: Path | None, what: str, new: bool, kept: list[Path],
            written: list[Path]) -> None:
    """Say what became of a narrowed case; ``new``: this call wrote ``saved`` (else it is
    the earlier copy of the same failure, and ``_write_kept`` has said so)."""
    if saved is None:
        say(f"gpucase: note: the narrowed case of {what} did not reproduce the "
            "failure in a fresh child, so it was not kept")
        return
    kept.append(saved)
    if new:
        written.append(saved)
        say(f"gpucase: saved {_shown(saved)} ({_sized(saved)}narrowed to {what})")


def note_narrowed_size(case_dir: Path, written: list[Path]) -> None:
    """One note when the narrowed cases written for one failure are large: each holds
    its own copy of what it needs (a module's weights), so the bytes add up."""
    total = sum(_case_bytes(path) for path in written)
    if total <= _NARROWED_NOTE_SIZE:
        return
    count = (f"the {len(written)} narrowed cases" if len(written) > 1
             else "the narrowed case")
    say(
        f"gpucase: note: {count} of this failure ({', '.join(map(_shown, written))}) hold "
        f"{_mib(total)} beside the {_mib(_case_bytes(case_dir))} of {_shown(case_dir)}: "
        "each narrowed case holds its own copy of the tensors it needs (its module's "
        "weights, its inputs). Keep the narrowest case that reproduces and delete the "
        "others, or pass Recorder(narrow=False) to write the module's case alone")


# --- single ATen op -----------------------------------------------------------------------------

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
    literal = _literal(value)
    return None if literal is _NOT_LITERAL else {"value": literal}


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


class _ModuleWatch:
    """The hooks of one watched module: nothing is replaced, the module stays itself.

    Forward pre-hooks on the module and each submodule keep the stack of entered modules
    (references only); forward hooks called even on an exception (``always_call``) pop it,
    and the innermost one still open when an exception passes is the narrowest module.
    Gradient hooks on the module's outputs note a backward in progress and its grad_output.
    """

    def __init__(self, recorder: Recorder, module: torch.nn.Module, name: str,
                 rebuild: _Rebuild, ids: SampleIds | None) -> None:
        self.recorder = recorder
        self.module = module
        self.rebuild = rebuild
        forward = module.forward
        self.watched = _watched(forward, name, REPLAY_MODULE if rebuild.factory else None, ids)
        if rebuild.factory is None:
            self.watched = dataclasses.replace(self.watched, call=None,
                                               why_not=rebuild.why_not)
        # (qualname, module, args, kwargs, version counters of the tensors among them)
        self.stack: list[tuple[str, torch.nn.Module, Any, Any, dict[int, int]]] = []
        self.innermost: tuple[BaseException, str, torch.nn.Module, Any, Any,
                              dict[int, int]] | None = None
        self.outer: list[BaseException | None] = []
        self.before = _Before()
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
                    self.rng = _rng_state(_tensors_of(args, kwargs))
        if not rec._taken:
            # Version reads only: a narrowed case must not hold inputs its forward changed.
            self.stack.append((qualname, module, args, kwargs,
                               tensor_versions(_tensors_of(args, kwargs))))

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

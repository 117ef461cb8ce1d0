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

Snapshots: host tensors are saved as they are after the failure (an in-place
change made by the failing call shows in them). Device tensors are copied to the
host before each call while they fit ``snapshot_limit`` (so that a sticky device
error cannot lose them), else after the failure if the device still answers.
"""

from __future__ import annotations

import contextlib
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

from . import backends, fsutil, payload

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib
from .case import CASE_FILE, INPUTS_FILE, VERSION_KEYS
from .triage import Triage, assertion_line, triage

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SNAPSHOT_LIMIT", "REPLAY_ENV", "Recorder", "Step"]

P = ParamSpec("P")
R = TypeVar("R")

# Set in a replay's child so that a watched function imported there records nothing.
REPLAY_ENV = "GPUCASE_REPLAY"
DEFAULT_SNAPSHOT_LIMIT = 256 * 2**20
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
    stage: str
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


class _Local(threading.local):
    """Per-thread nesting of steps and watched calls."""

    def __init__(self) -> None:
        self.depth = 0
        # The exception an inner scope already handled, while it propagates to outer ones.
        self.handled: BaseException | None = None
        self.stages: list[str] = []


class Recorder:
    """Save the first failure of a training loop as a replayable case directory."""

    def __init__(self, root: str | os.PathLike[str] = "cases", *,
                 snapshot: Literal["before", "after"] = "before",
                 snapshot_limit: int = DEFAULT_SNAPSHOT_LIMIT,
                 sync: bool = True,
                 stderr_file: str | os.PathLike[str] | None = None) -> None:
        if snapshot not in ("before", "after"):
            raise ValueError(f"snapshot must be 'before' or 'after', not {snapshot!r}")
        if snapshot_limit < 0:
            raise ValueError(f"snapshot_limit must be >= 0 bytes, not {snapshot_limit}")
        # Resolved now: the loop may change directory before it fails.
        self.root = Path(root).absolute()
        self.snapshot = snapshot
        self.snapshot_limit = snapshot_limit
        self.sync = sync
        self.stderr_file = None if stderr_file is None else Path(stderr_file).absolute()
        self._lock = threading.RLock()
        self._local = _Local()
        self._taken = False
        self._case_dir: Path | None = None
        self._later = 0
        self._iteration: int | str | None = None
        self._replaying = bool(os.environ.get(REPLAY_ENV))
        self._last_step: str | None = None
        self._ids: tuple[str | int, ...] | None = None
        self._device_names: dict[str, str] = {}
        self._notes_given: set[str] = set()

    @property
    def case_dir(self) -> Path | None:
        """The case directory written for the first failure, once written."""
        return self._case_dir

    @property
    def later_errors(self) -> int:
        """How many errors came after the first one in this process."""
        return self._later

    @overload
    def watch(self, fn: Callable[P, R], /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None) -> Callable[P, R]: ...

    @overload
    def watch(self, fn: None = None, /, *, name: str | None = None, call: str | None = None,
              ids: SampleIds | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def watch(self, fn: Callable[P, R] | None = None, /, *, name: str | None = None,
              call: str | None = None, ids: SampleIds | None = None,
              ) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
        """Wrap ``fn`` so that its first failure is saved; use directly or as ``@rec.watch(...)``.

        ``call`` names where a replay imports ``fn`` ("pkg.module:func") when it cannot be
        imported under its own name; ``ids`` is called with the call's arguments on failure
        and returns the sample ids of the batch.
        """
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
            self._say(f"gpucase: warning: {watched.why_not}")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if self._taken:
                return self._call_after_first(fn, args, kwargs)
            before = self._snapshot_before(watched, args, kwargs)
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
                    self._save_first, watched=watched, args=args, kwargs=kwargs, before=before)
                self._leave(caught, save)
        return wrapper

    def step(self, iteration: int, stage: str, *, ids: Iterable[object] | None = None) -> Step:
        """A context manager for one stage of one iteration; the last completed one is kept."""
        try:
            number: int | str = operator.index(iteration)
        except TypeError:
            number = str(iteration)
        return Step(self, number, str(stage), None if ids is None else _id_tuple(ids))

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
        self._local.stages.append(step.stage)
        self._local.depth += 1

    def _exit_step(self, step: Step, exc: BaseException | None) -> None:
        try:
            if exc is None:
                with self._lock:
                    self._last_step = step.stage
            caught = exc if isinstance(exc, Exception) else None
            save = None if caught is None else functools.partial(
                self._save_first, watched=None, args=(), kwargs={}, before={})
            self._leave(caught, save)
        finally:
            # Popped last: a failure is recorded as happening in this stage.
            if self._local.stages:
                self._local.stages.pop()

    def _leave(self, exc: BaseException | None,
               save: Callable[[BaseException], None] | None) -> None:
        """Close a scope: handle its exception once, however many scopes it crosses."""
        local = self._local
        local.depth -= 1
        try:
            if exc is not None and exc is not local.handled:
                self._failed(exc, save)
        finally:
            # Kept only while an enclosing scope may still see the same exception.
            local.handled = exc if exc is not None and local.depth > 0 else None

    def _failed(self, exc: BaseException, save: Callable[[BaseException], None] | None) -> None:
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
            self._say(f"gpucase: could not record the failure ({type(internal).__name__}: "
                      f"{internal}); the original error follows")

    def _write_later_errors(self, exc: BaseException) -> None:
        if self._case_dir is None:
            return  # still being written, or not written: the count is written with it
        if "later" not in self._notes_given:
            self._notes_given.add("later")
            self._say(f"gpucase: another error after the first failure, counted in "
                      f"{_shown(self._case_dir)} [origin] later_errors (likely a consequence): "
                      f"{_error_line(exc)}")
        _set_later_errors(self._case_dir, self._later)

    def _context(self) -> _Context:
        with self._lock:
            stages = self._local.stages
            return _Context(self._iteration, stages[-1] if stages else None, self._last_step,
                            self._ids)

    def _snapshot_before(self, watched: _Watched, args: Any, kwargs: Any) -> dict[int, Any]:
        """Host copies of the device tensors among the arguments, keyed by ``id``."""
        try:
            tensors = [t for t in _tensors_of(args, kwargs) if t.device.type != "cpu"]
            if not tensors:
                return {}
            self._remember_device_names(tensors)
            if self.snapshot != "before":
                return {}
            total = sum(_nbytes(t) for t in tensors)
            if total > self.snapshot_limit:
                self._note_once(f"limit:{watched.name}", (
                    f"gpucase: note: the device inputs of {watched.name} hold "
                    f"{total / 2**20:.1f} MiB, over the snapshot limit of "
                    f"{self.snapshot_limit / 2**20:.1f} MiB: they are copied after a failure, "
                    "if the device still answers (Recorder(snapshot_limit=...) to change)"))
                return {}
            copies: dict[int, Any] = {}
            for tensor in tensors:
                if _storable(tensor):
                    copies[id(tensor)] = payload.to_device(tensor, "cpu")
            return copies
        except Exception:
            # The device did not answer before the call; the call itself will tell.
            return {}

    def _remember_device_names(self, tensors: list[torch.Tensor]) -> None:
        """Ask each device its name while it answers, so a sticky error cannot hide it."""
        import torch

        for tensor in tensors:
            device = str(tensor.device)
            if device in self._device_names:
                continue
            name = device
            try:
                if tensor.device.type == "cuda":
                    name = torch.cuda.get_device_name(tensor.device)
                elif tensor.device.type == "xpu":
                    name = torch.xpu.get_device_name(tensor.device)
            except Exception:
                pass
            self._device_names[device] = name

    def _save_first(self, exc: BaseException, watched: _Watched | None, args: Any, kwargs: Any,
                    before: Mapping[int, Any]) -> None:
        stderr_text = _read_tail(self.stderr_file) if self.stderr_file is not None else ""
        found = _triage(exc, stderr_text)
        context = self._context()
        if watched is not None:
            try:
                inputs = _collect(watched, args, kwargs, before, found, exc)
            except Exception as internal:
                # The origin is still worth writing: error, iteration, ids, versions.
                problem = f"the inputs could not be read ({_error_line(internal)})"
                inputs = _Inputs(problems=(problem,))
            ids = _call_ids(watched, args, kwargs) if watched.ids is not None else None
            ids = ids if ids is not None else context.ids
        else:
            inputs, ids = _Inputs(), context.ids
        draft = self._draft(exc, watched, inputs, context, ids, stderr_text)
        case_dir = _write_case(self.root, draft)
        with self._lock:
            self._case_dir = case_dir
            if self._later:
                _set_later_errors(case_dir, self._later)
        self._say(f"gpucase: saved {_shown(case_dir)} (first failure{_where(context)})")
        if found is not None:
            self._say(found.render())
        if draft.xfail is None:
            reasons = "".join(f"\n  - {reason}" for reason in draft.origin.get("incomplete", ()))
            self._say("gpucase: warning: the case is incomplete, so it has no xfail line and its "
                      f"replay fails until it is completed:{reasons}")

    def _draft(self, exc: BaseException, watched: _Watched | None, inputs: _Inputs,
               context: _Context, ids: tuple[str | int, ...] | None,
               stderr_text: str) -> _Draft:
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
            what = watched.call or str(getattr(watched.fn, "__qualname__", watched.name))
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
            origin["device"] = self._device_names.get(device, device)
        # The build's version where [matrix] can require it (cuda, hip): backends.py says which.
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

    def _note_once(self, key: str, message: str) -> None:
        if key not in self._notes_given:
            self._notes_given.add(key)
            self._say(message)

    @staticmethod
    def _say(message: str) -> None:
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
        Recorder._say(f"gpucase: the ids callable of {watched.name} raised "
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
    if context.iteration is not None:
        parts.append(f"at iteration {context.iteration}")
    if context.stage is not None:
        parts.append(f"in {context.stage}")
    if context.last_step is not None:
        parts.append(f"after {context.last_step}")
    return " " + ", ".join(parts) if parts else ""


def _revision() -> str | None:
    """``git describe`` of the working directory, if it is a repository (bounded in time)."""
    from .environment import git_revision

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


def _tensors_of(args: Any, kwargs: Any) -> list[torch.Tensor]:
    import torch

    values = list(args) + list(kwargs.values())
    return [v for v in values if isinstance(v, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of storage the view reaches: what a copy to the host moves."""
    if tensor.numel() == 0:
        return 0
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    span = 1 + sum((int(size) - 1) * int(step) for size, step in pairs)
    return (int(tensor.storage_offset()) + span) * tensor.element_size()


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


def _collect(watched: _Watched, args: Any, kwargs: Any, before: Mapping[int, Any],
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
    copied_before = False
    for name, value, param in named:
        if isinstance(value, torch.Tensor):
            described[name] = _describe(value)
            devices.append(str(value.device))
            if not _storable(value):
                skipped[name] = f"Tensor ({value.layout}, {value.dtype}): not storable"
            elif value.device.type == "cpu":
                tensors[name] = value.detach()
            elif id(value) in before:
                tensors[name] = before[id(value)]
                copied_before = True
            else:
                pending[name] = value
            continue
        if value is None and param is not None and param.default is None:
            continue  # the replay gets the same None from the default
        literal = _literal(value)
        if literal is _NOT_LITERAL:
            skipped[name] = _type_name(value)
        else:
            literals[name] = literal
    snapshot = None
    if described:
        snapshot = ("device tensors copied before the call" if copied_before
                    else "host tensors, as they were after the failure")
    if pending:
        reason = _unusable(found)
        if reason is None:
            try:
                for name, value in pending.items():
                    tensors[name] = payload.to_device(value, "cpu")
                snapshot = "device tensors copied after the failure"
            except Exception as copy_error:
                reason = (f"{found.clue if found else type(exc).__name__} (copying {name} to the "
                          f"host raised {_error_line(copy_error)})")
                for name in pending:
                    tensors.pop(name, None)
        if reason is not None:
            snapshot = f"not saved: device unusable after {reason}"
            if tensors:
                snapshot += f"; saved from the host: {', '.join(sorted(tensors))}"
    if skipped:
        problems.append(f"{', '.join(sorted(skipped))} could not be saved (see [origin] "
                        "skipped_inputs): add them to [inputs] or to inputs.safetensors")
    return _Inputs(tensors=tensors, literals=literals, described=described, skipped=skipped,
                   snapshot=snapshot, problems=tuple(problems), devices=tuple(devices))


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


def _case_document(draft: _Draft) -> dict[str, Any]:
    """The ``case.toml`` document of a draft."""
    doc: dict[str, Any] = {"format": 1, "summary": draft.summary, "call": draft.call}
    if draft.xfail is not None:
        doc["xfail"] = draft.xfail
    if draft.literals:
        doc["inputs"] = dict(draft.literals)
    doc["expect"] = {"outcome": "matches"}
    doc["origin"] = dict(draft.origin)
    return doc


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


def _write_case(root: Path, draft: _Draft) -> Path:
    """Write a case directory atomically under ``root`` and return it; never overwrite one.

    ``fsutil.write_case_dir`` writes it into a hidden temporary directory beside the
    target (hidden directories are not collected), ``case.toml`` last; the directory
    is then renamed onto a freshly claimed empty name.
    """
    files: dict[str, fsutil.FileContent] = dict(draft.files)
    if draft.tensors:
        tensors = draft.tensors
        files[INPUTS_FILE] = lambda path: payload.save(path, tensors)
    return fsutil.write_case_dir(root / draft.name, _case_document(draft), files,
                                 claim=lambda: _claim(root, draft.name))


def _set_later_errors(case_dir: Path, count: int) -> None:
    """Rewrite ``[origin] later_errors`` of a case in place, atomically (through tomli-w)."""
    file = case_dir / CASE_FILE
    doc = tomllib.loads(file.read_text(encoding="utf-8"))
    origin = doc.get("origin")
    if not isinstance(origin, dict) or "later_errors" not in origin:
        return
    origin["later_errors"] = count
    fsutil.write_text_atomic(file, tomli_w.dumps(doc))


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)

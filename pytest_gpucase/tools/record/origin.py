"""Where a failure came from, as a case records it: the watched call (its case name, and
the name a replay imports it by or why it has none), where the training loop was, and the
error (its line, its triage, the tail of the teed stderr). Also how the Recorder speaks: its
lines on stderr (``say``), with paths (``shown``) and sizes (``mib``) written one way.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpucase.verdict.triage import Triage, triage

__all__ = ["INT64", "ORIGIN_ERROR_CHARS", "SUMMARY_ERROR_CHARS", "Context", "SampleIds",
           "Watched", "call_ids", "case_name", "class_of",
           "compiled", "error_line", "framework_code", "id_tuple", "import_name",
           "message_of", "mib", "read_tail", "say", "shown", "triage_of", "user_label",
           "watched_call", "where"]

SUMMARY_ERROR_CHARS = 300
# ``[origin] error`` keeps the message's first line whole up to this bound: the replay's
# failure is matched against it (``verdict.failure.same_failure``), which a line cut for a
# summary would make harder; a longer one is cut as ``verdict.failure.cut`` cuts.
ORIGIN_ERROR_CHARS = 4000
_STDERR_TAIL_BYTES = 64 * 1024
# The integers TOML holds; a sample id outside them is written as a string.
INT64 = (-(2**63), 2**63 - 1)

SampleIds = Callable[..., Iterable[object]]


@dataclass(frozen=True)
class Watched:
    """A watched callable and what a replay needs to know of it."""

    fn: Callable[..., Any]
    name: str
    call: str | None            # "module:qualname" a replay can import, or None
    why_not: str                # when call is None: why, and what to pass instead
    signature: inspect.Signature | None
    ids: SampleIds | None


def watched_call(fn: Callable[..., Any], name: str | None, call: str | None,
                 ids: SampleIds | None) -> Watched:
    """``fn`` as a watched call: its case name, its import name or why it has none, its
    signature, and the callable that gives its sample ids."""
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    label = (getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
             or f"a {type(fn).__name__} instance")
    found, why_not = (call, "") if call is not None else import_name(fn, label)
    named = case_name(name or getattr(fn, "__name__", None) or type(fn).__name__)
    return Watched(fn, named, found, why_not, signature, ids)


def import_name(fn: Callable[..., Any], label: str) -> tuple[str | None, str]:
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


# The packages whose functions wrap the user's code (autocast and output casts, module calls,
# compiled frames, strategy wrappers, decorators): told by where their code lies.
_FRAMEWORKS = ("torch", "accelerate", "transformers", "lightning", "pytorch_lightning",
               "lightning_fabric", "deepspeed", "peft", "functools", "contextlib",
               "pytest_gpucase")


def _framework_roots() -> tuple[str, ...]:
    """The folders (or files) the framework packages imported so far were loaded from."""
    roots = []
    for name in _FRAMEWORKS:
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str):
            path = os.path.realpath(file)
            roots.append(os.path.dirname(path) + os.sep
                         if os.path.basename(path).startswith("__init__.") else path)
    return tuple(roots)


def framework_code(filename: str) -> bool:
    """Whether code from ``filename`` is a framework's (``_FRAMEWORKS``), by its location."""
    if not filename or filename.startswith("<"):
        return False
    return os.path.realpath(filename).startswith(_framework_roots())


def user_label(fn: Any) -> str | None:
    """The name the user knows ``fn`` by: a framework's wrapper (its code in a framework's
    files: Accelerate's ``convert_outputs_to_fp32.<locals>.forward``, autocast's, a compiled
    frame's) is looked through along ``__wrapped__``, and a bound method is named by its
    instance's class (``GPT2LMHeadModel.forward``). None when ``fn`` has no name."""
    owner = getattr(fn, "__self__", None)
    inner = fn
    for _ in range(32):  # a chain of wrappers, never a cycle
        function = getattr(inner, "__func__", inner)
        code = getattr(function, "__code__", None)
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is None or (code is not None and not framework_code(code.co_filename)):
            break
        inner = wrapped
    name = getattr(inner, "__name__", None)
    if (owner is not None and not isinstance(owner, type | type(sys))
            and isinstance(name, str) and "<" not in name):
        return f"{type(owner).__qualname__}.{name}"
    qualname = getattr(inner, "__qualname__", None) or name
    return qualname if isinstance(qualname, str) else None


def case_name(raw: str) -> str:
    """A safe, visible directory name: no separators, no leading dot, no secret (a run name
    made from a token: the folder is committed with the cases)."""
    from pytest_gpucase.base.secrets import remove_secrets

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", remove_secrets(raw, urls="keep")).strip("._-")
    return name or "case"


@dataclass(frozen=True)
class Context:
    """Where the training loop was when the failure happened."""

    iteration: int | str | None
    stage: str | None
    last_step: str | None
    ids: tuple[str | int, ...] | None


def id_tuple(ids: Iterable[object]) -> tuple[str | int, ...]:
    """Sample ids as ``[origin] sample_ids`` holds them: integers TOML can hold, else text."""
    return tuple(i if isinstance(i, int) and not isinstance(i, bool) and
                 INT64[0] <= i <= INT64[1] else str(i) for i in ids)


def call_ids(watched: Watched, args: Any, kwargs: Any) -> tuple[str | int, ...] | None:
    """The sample ids ``watched.ids`` gives for the failing call's arguments, or None if it
    raises (said on stderr)."""
    try:
        assert watched.ids is not None
        return id_tuple(watched.ids(*args, **kwargs))
    except Exception as exc:
        say(f"gpucase: the ids callable of {watched.name} raised "
            f"{error_line(exc)}; sample ids not recorded")
        return None


def where(context: Context) -> str:
    """`` at iteration 3, in loss, after forward``: as much of it as is known."""
    parts = []
    # Outside any step once iteration N completed, the failure is after N, not "at" it.
    after_it = context.last_step == f"iteration {context.iteration}"
    if context.iteration is not None and not after_it:
        parts.append(f"at iteration {context.iteration}")
    if context.stage is not None:
        parts.append(f"in {context.stage}")
    # "in training_step, after training_step" says nothing the iteration does not.
    if context.last_step is not None and context.last_step != context.stage:
        parts.append(f"after {context.last_step}")
    return " " + ", ".join(parts) if parts else ""


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in when the exception cannot be printed: its ``__str__`` may
    raise anything, SystemExit included, and the Recorder must not (only KeyboardInterrupt
    goes through: the user asked to stop)."""
    try:
        text = str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as problem:
        try:
            why = type(problem).__name__
        except BaseException:  # pragma: no cover - a type always has a name
            why = "an error"
        return f"<unprintable {type(exc).__name__}: its __str__ raised {why}>"
    return text if isinstance(text, str) else f"<unprintable {type(exc).__name__}>"


def compiled(exc: BaseException) -> bool:
    """Whether ``exc`` came out of code torch.compile made or traced (a frame of Dynamo or
    Inductor, or an Inductor kernel's file, in its traceback or its causes')."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__module__.startswith(("torch._dynamo", "torch._inductor")):
            return True
        tb = current.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
            if ("/torch/_dynamo/" in name or "/torch/_inductor/" in name
                    or "torchinductor_" in name):
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def error_line(exc: BaseException, limit: int = SUMMARY_ERROR_CHARS) -> str:
    """``Type: first line of the message``, cut to a length a summary can hold (``limit``:
    ``ORIGIN_ERROR_CHARS`` for ``[origin] error``)."""
    from pytest_gpucase.verdict.failure import cut

    lines = message_of(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return cut(text, limit)


def triage_of(exc: BaseException, stderr_text: str) -> Triage | None:
    """What to check first for ``exc``, or None; never raises over the failure."""
    try:
        return triage(type(exc).__name__, message_of(exc), stderr_text)
    except Exception:
        return None


def class_of(exc: BaseException, stderr_text: str = "") -> str | None:
    """The failure class of ``exc`` (``verdict.triage.failure_class``), or None; never raises
    over the failure."""
    from pytest_gpucase.verdict.triage import failure_class

    try:
        return failure_class(type(exc).__name__, message_of(exc), stderr_text)
    except Exception:
        return None


def read_tail(path: Path) -> str:
    """The last bytes of the teed stderr file, where a kernel's assertion line lands."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _STDERR_TAIL_BYTES))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def say(message: str) -> None:
    """Print one of the Recorder's lines on stderr."""
    # A closed or broken stderr (or a replaced one that raises) must not become a second error.
    try:
        print(message, file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        raise
    except BaseException:
        pass


def shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)


def mib(size: int) -> str:
    """A size in bytes as the Recorder's lines show it: ``98.1 MiB``."""
    return f"{size / 2**20:.1f} MiB"

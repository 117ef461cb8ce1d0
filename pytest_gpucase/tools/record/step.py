"""A failure of a recorded step outside any watched call: which call raised, read off its
traceback, so that the case replays that call instead of naming none.

The traceback of an exception that leaves ``with rec.step(...)`` starts at the frame that
holds the ``with``. Going down it, the first call that a replay can make again is the one
saved, with its arguments as its frame holds them when it raised:

1. the call of a watched module that raised outside its forward (a forward hook registered
   after ``rec.watch``, say): that module's case, from the inputs copied before the call;
2. a method of a watched module (a LightningModule's ``training_step``): the module rebuilt,
   and that method called; one whose arguments a case cannot hold (``optimizer_step``'s
   optimizer and closure) gives way to the method it ran below it (``training_step``);
3. below the step's own frame, the first call it made that can be made again: a module
   (``criterion(logits, y)``) or an importable function (``F.cross_entropy(...)``,
   ``my_loss(...)``).

What is left is an operation written inline in the step (``(a - b).pow(2)``, a ``raise``
of the step's own): no call to replay, which the case says with the line.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from pytest_gpucase.tools.record.origin import framework_code

__all__ = ["Found", "failing_call", "frame_line", "raised_outside"]

_MODULE_CALLS = ("_wrapped_call_impl", "_call_impl")


@dataclass(frozen=True)
class Found:
    """The call a step failure is saved as."""

    kind: str                 # "watched", "method", "module", "function"
    target: Any               # the module (watched key for "watched"/"method") or function
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    where: str                # file:line of the call in the step
    method: str | None = None
    in_hook: bool = False     # a watched module's call raised outside its forward


def frame_line(frame: FrameType, lineno: int | None = None) -> str:
    """``train.py:42``: where a frame is, by file name."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{lineno or frame.f_lineno}"


def _module_call(frame: FrameType) -> Any:
    """The module a frame of ``nn.Module.__call__`` calls, else None."""
    code = frame.f_code
    if code.co_name not in _MODULE_CALLS or not code.co_filename.replace(
            os.sep, "/").endswith("torch/nn/modules/module.py"):
        return None
    return frame.f_locals.get("self")


def _arguments(frame: FrameType) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Python frame's arguments by name, as its locals hold them now."""
    code = frame.f_code
    names = code.co_varnames
    count = code.co_argcount + code.co_kwonlyargcount
    local = frame.f_locals
    kwargs = {name: local[name] for name in names[:count] if name in local}
    position = count
    args: tuple[Any, ...] = ()
    if code.co_flags & inspect.CO_VARARGS:
        args = tuple(local.get(names[position], ()))
        position += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local.get(names[position], {}))
    return args, kwargs


def _function(frame: FrameType) -> Callable[..., Any] | None:
    """The module-level function a frame runs, found by its code object."""
    code: CodeType = frame.f_code
    candidate = frame.f_globals.get(code.co_name)
    inner = getattr(candidate, "__wrapped__", None)
    for fn in (candidate, inner):
        if getattr(fn, "__code__", None) is code:
            return candidate
    return None


def _method_of(frame: FrameType, watched: Mapping[int, Any]) -> Any:
    """The watched module whose own method (not ``forward``) this frame runs, else None."""
    owner = frame.f_locals.get("self")
    if owner is None or id(owner) not in watched or frame.f_code.co_name == "forward":
        return None
    method = getattr(type(owner), frame.f_code.co_name, None)
    return owner if getattr(method, "__code__", None) is frame.f_code else None


def _replayable(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a method's arguments are what a case can hold: no optimizer, no closure."""
    return not any(callable(value) or hasattr(value, "param_groups")
                   for value in (*args, *kwargs.values()))


def _watched_or_method(index: int, entries: list[tuple[FrameType, int]],
                       watched: Mapping[int, Any]) -> Found | None:
    """Rules 1 and 2 for the frame at ``index``: its watched module call or method, else None."""
    frame, lineno = entries[index]
    module = _module_call(frame)
    if module is not None and id(module) in watched:
        later = {f.f_code for f, _ in entries[index + 1:]}
        forward = getattr(type(module).forward, "__code__", None)
        caller = entries[index - 1] if index else (frame, lineno)
        return Found("watched", module, tuple(frame.f_locals.get("args", ())),
                     dict(frame.f_locals.get("kwargs", {})), frame_line(*caller),
                     in_hook=forward not in later)
    owner = _method_of(frame, watched)
    if owner is None:
        return None
    args, kwargs = _arguments(frame)
    kwargs.pop("self", None)
    if not _replayable(args, kwargs) and any(
            _method_of(f, watched) is not None for f, _ in entries[index + 1:]):
        # Lightning's optimizer_step(epoch, batch_idx, optimizer, closure): the
        # training_step the closure ran, below it, is the call that raised.
        return None
    caller = entries[index - 1] if index else (frame, lineno)
    return Found("method", owner, args, kwargs, frame_line(*caller),
                 method=frame.f_code.co_name)


def _unanchored_reason(entries: list[tuple[FrameType, int]]) -> str:
    """Why an unanchored traceback through no watched module names no call to replay."""
    users = [f.f_code for f, _ in entries
             if not framework_code(f.f_code.co_filename)
             and not any(part in f.f_code.co_filename.replace(os.sep, "/")
                         for part in ("site-packages/", "dist-packages/", "/lib/python"))]
    last = (users or [entries[-1][0].f_code])[-1]
    return (f"the traceback passes through no watched module (the last code of yours "
            f"in it: {last.co_name} in {os.path.basename(last.co_filename)}): where that "
            "is a function, such as a loss given to the Trainer "
            "(compute_loss_func=) or a compute_loss override, watch that function "
            "(compute_loss_func=rec.watch(my_loss), or rec.watch it inside the "
            "override) so that its inputs are saved")


def _step_callee(entries: list[tuple[FrameType, int]], where: str) -> Found | None:
    """Rule 3: the first call below the step's frame that a replay can make again, else None."""
    for frame, _ in entries[1:]:
        module = _module_call(frame)
        if module is not None:
            return Found("module", module, tuple(frame.f_locals.get("args", ())),
                         dict(frame.f_locals.get("kwargs", {})), where)
        if frame.f_code.co_filename.replace(os.sep, "/").endswith(
                ("torch/nn/modules/module.py",)):
            continue
        function = _function(frame)
        if function is not None:
            args, kwargs = _arguments(frame)
            return Found("function", function, args, kwargs, where)
    return None


def failing_call(exc: BaseException, watched: Mapping[int, Any], *,
                 anchored: bool) -> Found | str:
    """The call a failure in a step is saved as (see the module's docstring), or why none.

    ``watched`` maps ``id(module)`` of each watched module to it; ``anchored``: the
    traceback starts at the step's own frame (a ``with rec.step``), whose callee is the
    call rule 3 looks at.
    """
    entries = list(traceback.walk_tb(exc.__traceback__))
    if not entries:
        return "the failure has no traceback to read the call from"
    for index in range(len(entries)):
        found = _watched_or_method(index, entries, watched)
        if found is not None:
            return found
    if not anchored:
        return _unanchored_reason(entries)
    step_frame, step_line = entries[0]
    where = frame_line(step_frame, step_line)
    callee = _step_callee(entries, where)
    if callee is not None:
        return callee
    line = _source_line(step_frame, step_line)
    return (f"it was raised by code written in the step itself ({where}"
            f"{': ' + line if line else ''}), not by a call a replay can make again: "
            "move it into a function (rec.watch it, or call it from the step) and its "
            "inputs are saved")


def _source_line(frame: FrameType, lineno: int) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, lineno).strip()[:120]


def raised_outside(exc: BaseException, module: Any, method: str) -> str | None:
    """Why a framework's step case cannot replay ``exc`` when it was raised after
    ``module.method`` returned (no frame of that call in its traceback: the optimizer's
    step, a trainer's hook), else None."""
    tb = exc.__traceback__
    if tb is None:
        return None
    last = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == method and frame.f_locals.get("self") is module:
            return None
        last = tb
        tb = tb.tb_next
    assert last is not None
    code = last.tb_frame.f_code
    where_raised = f"{code.co_name} ({os.path.basename(code.co_filename)}:{last.tb_lineno})"
    return (f"the failure was raised in {where_raised}, outside "
            f"{type(module).__qualname__}.{method} (after it returned: the optimizer's step "
            f"or a hook of the trainer), so a replay of {method} cannot reproduce it: the "
            "case holds the step's batch and the model's state, to replay that code by hand")

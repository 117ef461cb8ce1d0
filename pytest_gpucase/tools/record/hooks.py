"""How the Recorder attaches to a module without changing what training does with it.

Hooks are plain forward pre-hooks and forward hooks, with three properties a training
stack relies on:

- **Copies are unwatched, and copy.** Each hook dictionary of a watched module is a
  ``HookDict``, an ``OrderedDict`` that leaves the Recorder's entries out when it is
  copied or pickled, as a plain ``OrderedDict``. So ``copy.deepcopy(model)``,
  ``pickle.dumps(model)``, ``torch.save(model, f)``, ``AveragedModel(model)`` (EMA/SWA) and
  the pickling of a spawned process see the module as it was before ``rec.watch``; a file
  written by ``torch.save`` loads where pytest-gpucase is not installed.
- **Invisible to Dynamo.** Inside a region Dynamo traces (a submodule of a compiled
  model), a hook returns at once on ``torch.compiler.is_compiling()``, which Dynamo folds
  to a constant: no graph break, ``fullgraph=True`` holds, one graph stays one graph. Where
  a hook runs as a frame of its own (the top module of ``torch.compile(model)``, whose
  hooks Dynamo calls outside the compiled region), its code is marked for Dynamo to skip,
  with everything it calls: it runs eagerly, and nothing the Recorder does is compiled.
- **Wrappers are seen through.** ``unwrap`` gives the module that runs inside
  ``DistributedDataParallel``, ``DataParallel``, FSDP and compile's ``OptimizedModule``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import CodeType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

__all__ = ["HookDict", "Hooks", "compiling", "install", "invisible_to_dynamo", "unwrap"]

# The hook dictionaries of nn.Module that install() writes to, and which must copy
# without the Recorder's entries (the with_kwargs and always_call ones are keyed by id).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# Wrappers whose ``module`` attribute is the module that runs.
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


class HookDict(OrderedDict):  # type: ignore[type-arg]
    """A module's hook dictionary that copies and pickles without the Recorder's entries.

    ``ours`` holds the handle ids the Recorder registered. ``__reduce__`` rebuilds a plain
    ``OrderedDict`` of the other entries, so a copy or a pickle holds no reference to the
    Recorder (which holds a lock and files) and names no class of this package.
    """

    ours: set[int]

    def __reduce__(self) -> Any:
        theirs = [(key, value) for key, value in self.items() if key not in self.ours]
        return (OrderedDict, (), None, None, iter(theirs))

    def __copy__(self) -> OrderedDict[Any, Any]:
        return OrderedDict((k, v) for k, v in self.items() if k not in self.ours)


def compiling() -> bool:
    """Whether Dynamo (or export) is tracing the caller: folded to a constant when traced."""
    import torch

    # torch.compiler.is_compiling came with torch 2.3; torch._dynamo's, which Dynamo folds
    # too, is older. Without either nothing can be tracing.
    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None:
        found = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return bool(found()) if found is not None else False


def invisible_to_dynamo(code: CodeType, *, recursive: bool = True) -> None:
    """Tell Dynamo to run frames of ``code`` eagerly (and, ``recursive``, all they call).

    The frame-strategy API is Dynamo's own (what ``torch._dynamo.eval_frame.skip_code``
    uses); where this torch build lacks it, nothing is marked, and the hooks still return at
    once while traced.
    """
    with contextlib.suppress(Exception):
        from torch._dynamo import eval_frame

        action = getattr(eval_frame, "FrameAction")  # noqa: B009 - not exported to mypy
        strategy = getattr(eval_frame, "FrameExecStrategy")(  # noqa: B009
            action.SKIP, action.SKIP if recursive else action.DEFAULT)
        getattr(eval_frame, "set_code_exec_strategy")(code, strategy)  # noqa: B009
        return
    with contextlib.suppress(Exception):
        from torch._dynamo.eval_frame import skip_code

        skip_code(code)


class _Enter:
    """A forward pre-hook (with kwargs): ``callback(qualname, module, args, kwargs)``."""

    __slots__ = ("callback", "qualname")

    def __init__(self, callback: Callable[..., None], qualname: str) -> None:
        self.callback = callback
        self.qualname = qualname

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        if compiling():
            return None
        self.callback(self.qualname, module, args, kwargs)
        return None


class _Exit:
    """A forward hook (with kwargs, always called): ``callback(qualname, module, args,
    kwargs, result)``; called on an exception too, which ``sys.exc_info`` then holds."""

    __slots__ = ("callback", "qualname")

    def __init__(self, callback: Callable[..., None], qualname: str) -> None:
        self.callback = callback
        self.qualname = qualname

    def __call__(self, module: Any, args: Any, kwargs: Any, result: Any) -> None:
        if compiling():
            return None
        self.callback(self.qualname, module, args, kwargs, result)
        return None


invisible_to_dynamo(_Enter.__call__.__code__)
invisible_to_dynamo(_Exit.__call__.__code__)


class Hooks:
    """The hooks one ``install`` registered, to remove them again."""

    def __init__(self, handles: list[tuple[torch.nn.Module, RemovableHandle]]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for module, handle in self.handles:
            handle.remove()
            for attr in _HOOK_DICTS:
                table = getattr(module, attr, None)
                if isinstance(table, HookDict):
                    table.ours.discard(handle.id)


def install(module: torch.nn.Module, enter: Callable[..., None], exit: Callable[..., None],
            names: Iterable[tuple[str, torch.nn.Module]]) -> Hooks:
    """Register ``enter`` and ``exit`` on each of ``names`` (qualname, submodule)."""
    handles: list[tuple[torch.nn.Module, RemovableHandle]] = []
    for qualname, sub in names:
        tables: list[HookDict] = []
        for attr in _HOOK_DICTS:
            table = getattr(sub, attr)
            if not isinstance(table, HookDict):
                # Before registering: a handle keeps a weak reference to the dict it is in.
                replacement = HookDict(table)
                replacement.ours = set()
                # object.__setattr__: nn.Module's own would look for parameters first.
                object.__setattr__(sub, attr, replacement)
                table = replacement
            tables.append(table)
        pre = sub.register_forward_pre_hook(_Enter(enter, qualname), with_kwargs=True)
        post = sub.register_forward_hook(_Exit(exit, qualname), with_kwargs=True,
                                         always_call=True)
        for table in tables:
            table.ours.update((pre.id, post.id))
        handles += [(sub, pre), (sub, post)]
    return Hooks(handles)


def unwrap(module: Any) -> Any:
    """The module that runs inside DDP, DataParallel, FSDP or compile's OptimizedModule."""
    for _ in range(16):  # wrappers of wrappers, bounded
        inner = getattr(module, "_orig_mod", None)
        if inner is None and type(module).__name__ in _WRAPPERS:
            inner = getattr(module, "module", None)
        if inner is None or inner is module:
            return module
        module = inner
    return module

"""The hooks of one watched module: what they keep of each call, and what they hand the
Recorder when the call fails or a watched value is not finite.

Forward pre-hooks on the module and each submodule keep the stack of entered modules
(references only); forward hooks called even on an exception (``always_call``) pop it, and
the innermost one still open when an exception passes is the narrowest module. Gradient
hooks on the module's outputs note a backward in progress and its grad_output. Every hook
body is guarded: a fault of the Recorder's own never reaches the training loop (only
KeyboardInterrupt goes through); a snapshot that fails is no snapshot, said once.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pytest_gpucase.base.backends import AUTOCAST_DEVICE_TYPES
from pytest_gpucase.base.tensors import named_tensors, tensor_versions, tensors_in
from pytest_gpucase.case.keys import REPLAY_MODULE
from pytest_gpucase.tools.record.hooks import Hooks, install, invisible_to_dynamo
from pytest_gpucase.tools.record.inputs import Before, autocast_dtype, rng_state, tensors_of
from pytest_gpucase.tools.record.origin import SampleIds, Watched, watched_call
from pytest_gpucase.tools.record.rebuild import Rebuild

if TYPE_CHECKING:
    import torch

__all__ = ["Consumer", "ModuleWatch", "Owner", "autocast_state", "loss_in", "nonfinite_problem"]


class Owner(Protocol):
    """What a watch needs of its Recorder."""

    def taken(self) -> bool: ...
    def enter_scope(self) -> None: ...
    def leave(self, exc: BaseException | None,
              save: Callable[[BaseException], object] | None) -> None: ...
    def snapshot_of(self, watched: Watched, args: Any, kwargs: Any) -> Before: ...
    def fault(self, where: str, problem: BaseException) -> None: ...
    def checks(self, kind: str) -> bool: ...
    def save_module(self, exc: BaseException, watch: ModuleWatch, args: Any, kwargs: Any,
                    backward: bool) -> None: ...
    def nonfinite(self, problem: str, save: Callable[[BaseException], object]) -> None: ...
    def remember_output(self, key: object, value: Any) -> None: ...
    def step_call(self, module: Any) -> tuple[str, tuple[Any, ...], Before] | None: ...
    def save_method(self, exc: BaseException, module: Any, method: str, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any], before: Before | None,
                    backward: bool) -> None: ...


def nonfinite_problem(what: str, value: Any) -> str | None:
    """``"non-finite output of m: out['logits'] holds 3 NaN"`` for the first floating tensors
    in ``value`` that hold NaN or inf, or None.

    One pass over each tensor and one device sync per device: NaN and inf survive a sum,
    so a finite sum of each device's tensors clears them all; only a sum that is not finite
    (a NaN, or finite values that overflowed) looks at each tensor."""
    import torch

    tensors = [(n, t) for n, t in named_tensors(value, "out")
               if (t.is_floating_point() or t.is_complex()) and not t.is_meta and t.numel()]
    if not tensors:
        return None
    with torch.no_grad():
        sums: dict[Any, list[torch.Tensor]] = {}
        for _, tensor in tensors:
            total = (tensor.abs().sum(dtype=torch.float32) if tensor.is_complex()
                     else tensor.sum(dtype=torch.float32))
            sums.setdefault(tensor.device, []).append(total)
        if all(bool(torch.stack(group).sum().isfinite()) for group in sums.values()):
            return None
        problems = []
        for name, tensor in tensors:
            nan, inf = (int(n) for n in torch.stack((tensor.isnan().sum(),
                                                     tensor.isinf().sum())).tolist())
            if nan or inf:
                kinds = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "inf")) if n)
                problems.append(f"{name} holds {kinds}")
    return f"non-finite {what}: {'; '.join(problems[:4])}" if problems else None


def loss_in(value: Any) -> Any:
    """The loss among a call's outputs: a 0-d tensor it returns, or its ``loss`` (a Hugging
    Face model's output, a training step's dict); None when there is none."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.dim() == 0 else None
    loss = value.get("loss") if isinstance(value, dict) else getattr(value, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def autocast_state() -> tuple[str, str] | None:
    """(device type, dtype) of the autocast region the caller runs in, or None."""
    for kind in AUTOCAST_DEVICE_TYPES:
        dtype = autocast_dtype(kind)
        if dtype is not None:
            return kind, dtype
    return None


class ModuleWatch:
    """The hooks of one watched module: nothing is replaced, the module stays itself."""

    def __init__(self, owner: Owner, module: torch.nn.Module, name: str,
                 rebuild: Rebuild, ids: SampleIds | None, checkpoint: str | None, *,
                 hooks: bool = True) -> None:
        self.owner = owner
        self.module = module
        self.rebuild = rebuild
        self.checkpoint = checkpoint
        self.watched = watched_call(module.forward, name, REPLAY_MODULE if rebuild.factory
                                    else None, ids)
        if rebuild.factory is None:
            self.watched = Watched(self.watched.fn, self.watched.name, None, rebuild.why_not,
                                   self.watched.signature, ids)
        # (qualname, module, args, kwargs, version counters of the tensors among them)
        self.stack: list[tuple[str, torch.nn.Module, Any, Any, dict[int, int]]] = []
        self.innermost: tuple[BaseException, str, torch.nn.Module, Any, Any,
                              dict[int, int]] | None = None
        # Per open call of the module: the exception already in flight when it began, and
        # whether its forward was replaced on the instance for it (a redirected step).
        self.outer: list[tuple[BaseException | None, bool]] = []
        self.before = Before()
        self.rng: dict[str, torch.Tensor] = {}
        self.last_call: tuple[Any, Any] | None = None
        self.backward_open = False
        self.grad_output: dict[int, Any] = {}   # output index -> its gradient
        self.seeded: int | None = None  # the output backward started from, as a loss
        # The autocast region the forward computes in, read by the first submodule entered:
        # a wrapper of forward (Accelerate's) may enter it after the module's own pre-hook.
        self.inner_context: tuple[str, str] | None = None
        self.open = 0
        self.saw_forward = False  # a forward ran eagerly (hooks are skipped inside compile)
        self.outputs: list[weakref.ReferenceType[Any]] = []  # the last call's output tensors
        # The watched function that took one of those outputs (the loss): a backward case
        # calls it again, so that the gradient is recomputed rather than saved.
        self.consumer: Consumer | None = None
        self.hooks: Hooks | None = None
        if hooks:
            self.hooks = install(module, self._enter, self._exit, list(module.named_modules()))

    @classmethod
    def detached(cls, owner: Owner, module: torch.nn.Module, name: str,
                 rebuild: Rebuild) -> ModuleWatch:
        """A watch without hooks: for a module a failure's traceback names, unwatched."""
        return cls(owner, module, name, rebuild, None, None, hooks=False)

    def remove(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()

    def _enter(self, qualname: str, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        owner = self.owner
        if module is self.module:
            # A forward replaced on the instance for this call while a framework names the
            # step's call (Lightning's DDP strategies point forward at training_step for one
            # call): that call is the case, not the class's forward. A wrapper that calls
            # the forward itself (Accelerate's autocast) names no step call.
            self.outer.append((sys.exc_info()[1], "forward" in vars(module)
                               and owner.step_call(module) is not None))
            self.open += 1
            owner.enter_scope()
        try:
            taken = owner.taken()
            if module is self.module:
                self.backward_open = False
                self.inner_context = None
                self.saw_forward = True
                if not taken:
                    self.last_call = (args, kwargs)
                    self.before = owner.snapshot_of(self.watched, args, kwargs)
                    try:
                        self.rng = rng_state(tensors_of(args, kwargs))
                    except Exception as problem:
                        self.rng = {}
                        owner.fault("the RNG state before the call", problem)
            elif self.open and self.inner_context is None and not taken:
                self.inner_context = autocast_state() or ("", "")
            if not taken:
                # Version reads only: a narrowed case must not hold inputs its forward changed.
                self.stack.append((qualname, module, args, kwargs,
                                   tensor_versions(tensors_of(args, kwargs))))
        except KeyboardInterrupt:
            raise
        except BaseException as problem:
            owner.fault(f"the hooks of {self.watched.name}", problem)

    def _exit(self, qualname: str, module: torch.nn.Module, args: Any, kwargs: Any,
              result: Any) -> None:
        owner = self.owner
        root = module is self.module
        exc: BaseException | None = None
        save: Callable[[BaseException], object] | None = None
        problem: str | None = None
        try:
            outer, redirected = self.outer[-1] if self.outer else (None, False)
            current = sys.exc_info()[1]
            exc = current if isinstance(current, Exception) and current is not outer else None
            self._pop_entry(module, exc)
            if root and exc is None and not owner.taken():
                problem = self._returned(result)
            if root and exc is not None and not owner.taken() and not redirected:
                save = functools.partial(owner.save_module, watch=self, args=args,
                                         kwargs=kwargs, backward=False)
        except KeyboardInterrupt:
            raise
        except BaseException as fault:
            owner.fault(f"the hooks of {self.watched.name}", fault)
        if not root:
            return
        self._leave_root(module, args, kwargs, exc, save, problem)

    def _pop_entry(self, module: torch.nn.Module, exc: BaseException | None) -> None:
        """Pop the module's stack entry; the innermost one an exception passes is kept."""
        if self.stack and self.stack[-1][1] is module:
            entry = self.stack.pop()
            if exc is not None and (self.innermost is None or self.innermost[0] is not exc):
                self.innermost = (exc, *entry)

    def _returned(self, result: Any) -> str | None:
        """Keep the root call's output; the non-finite problem a check finds in it, or None."""
        owner = self.owner
        self.outputs = [weakref.ref(t) for t in tensors_in(result)]
        self.consumer = None
        self._hook_outputs(result)
        owner.remember_output(self, result)
        if owner.checks("output"):
            return nonfinite_problem(f"output of {self.watched.name}", result)
        if owner.checks("loss"):
            return nonfinite_problem(f"loss of {self.watched.name}", loss_in(result))
        return None

    def _leave_root(self, module: torch.nn.Module, args: Any, kwargs: Any,
                    exc: BaseException | None, save: Callable[[BaseException], object] | None,
                    problem: str | None) -> None:
        """Close the root call's scope: a framework's step call, a non-finite value, or exc."""
        owner = self.owner
        redirected = self.outer.pop()[1] if self.outer else False
        self.open = max(0, self.open - 1)
        if redirected:
            # The call is the step a framework named (rec.step_call): its case calls that
            # method again; with none named, the exception is the step's to record.
            call = owner.step_call(module)
            if exc is None or owner.taken() or call is None:
                owner.leave(None, None)
                return
            method, step_args, before = call
            owner.leave(exc, functools.partial(owner.save_method, module=module, method=method,
                                               args=step_args, kwargs={}, before=before,
                                               backward=False))
            return
        if problem is not None:
            owner.leave(None, None)
            owner.nonfinite(problem, functools.partial(
                owner.save_module, watch=self, args=args, kwargs=kwargs, backward=False))
            return
        owner.leave(exc, save)

    def _hook_outputs(self, result: Any) -> None:
        """Gradient hooks on the outputs: their gradients arrive as the module's backward
        starts, and are its grad_output. (A full backward hook would do the same but warns
        on every step of a model whose inputs need no gradient.)"""
        outputs = [t for t in tensors_in(result) if t.requires_grad]
        self.grad_output = {}
        self.seeded = None
        if not outputs:
            return
        hook = _GradHook(weakref.ref(self))
        for index, tensor in enumerate(outputs):
            tensor.register_hook(functools.partial(hook, index))  # type: ignore[no-untyped-call]

    def arrived(self, index: int, grad: Any) -> None:
        """A gradient reached output ``index``: the module's backward is starting."""
        owner = self.owner
        if owner.taken():
            return
        first = not self.backward_open
        self.backward_open = True
        self.grad_output[index] = grad
        if first:
            # Backward started at this output with a gradient of one: it is the loss, and a
            # replay recomputes everything from it.
            self.seeded = index if (getattr(grad, "dim", lambda: 1)() == 0
                                    and bool((grad == 1).all())) else None
        if not (owner.checks("grad") and first):
            return
        problem = nonfinite_problem(f"gradient of {self.watched.name}'s output", grad)
        if problem is None:
            import torch

            # The parameters' gradients, once the whole backward pass has accumulated them.
            callback = functools.partial(_parameters_done, weakref.ref(self))
            torch.autograd.Variable._execution_engine.queue_callback(callback)
            return
        args, kwargs = self.last_call or ((), {})
        owner.nonfinite(problem, functools.partial(owner.save_module, watch=self, args=args,
                                                   kwargs=kwargs, backward=True))

    def parameters_done(self) -> None:
        owner = self.owner
        if owner.taken():
            return
        grads = {name: p.grad for name, p in self.module.named_parameters()
                 if p.grad is not None}
        problem = nonfinite_problem(f"gradient of {self.watched.name}", grads)
        if problem is None:
            return
        problem = problem.replace("out[", "grad[")
        args, kwargs = self.last_call or ((), {})
        owner.nonfinite(problem, functools.partial(owner.save_module, watch=self, args=args,
                                                   kwargs=kwargs, backward=True))

    def link_consumer(self, watched: Watched, args: Any, kwargs: Any, before: Before) -> None:
        """Note ``watched`` as this module's loss when one of its arguments is one of the
        module's last outputs (the very tensor)."""
        outputs = [r() for r in self.outputs]
        if not outputs or watched.signature is None or watched.call is None:
            return
        try:
            bound = watched.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return
        for name, value in bound.items():
            for index, tensor in enumerate(outputs):
                if tensor is not None and value is tensor:
                    self.consumer = Consumer(watched, name, index, args, kwargs, before)
                    return

    def backward_done(self) -> None:
        self.backward_open = False
        self.grad_output = {}


@dataclass(frozen=True)
class Consumer:
    """The watched function that took a module's output as ``name`` (output ``index``)."""

    watched: Watched
    name: str
    index: int
    args: Any
    kwargs: Any
    before: Before


class _GradHook:
    """The gradient hook of one call's outputs (a weak reference: the graph may outlive the
    watch)."""

    __slots__ = ("watch",)

    def __init__(self, watch: weakref.ReferenceType[ModuleWatch]) -> None:
        self.watch = watch

    def __call__(self, index: int, grad: Any) -> None:
        watch = self.watch()
        if watch is None:
            return
        try:
            watch.arrived(index, grad)
        except (KeyboardInterrupt, FloatingPointError):
            raise
        except BaseException as problem:
            watch.owner.fault(f"the gradient hooks of {watch.watched.name}", problem)


def _parameters_done(watch_ref: weakref.ReferenceType[ModuleWatch]) -> None:
    watch = watch_ref()
    if watch is None:
        return
    try:
        watch.parameters_done()
    except (KeyboardInterrupt, FloatingPointError):
        raise
    except BaseException as problem:
        watch.owner.fault(f"the gradient check of {watch.watched.name}", problem)


invisible_to_dynamo(_GradHook.__call__.__code__)
invisible_to_dynamo(_parameters_done.__code__)

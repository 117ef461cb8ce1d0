"""The numeric context of a replayed call: the switches a run may turn (``SETTINGS``), the
saved random state, and ``[context]`` (autocast, grad mode, TF32, determinism) around it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pytest_gpucase.base.backends import deterministic_env
from pytest_gpucase.case.model import ReplayContext

__all__ = ["SETTINGS", "apply_settings", "grad_mode", "replay_context", "rng_restored"]


def _tf32_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _cudnn_off() -> None:
    torch.backends.cudnn.enabled = False


def _deterministic() -> None:
    for name, value in deterministic_env().items():  # cuBLAS's workspace (base.backends)
        os.environ.setdefault(name, value)
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C,
                                                               "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(True)
    else:
        # The public call imports inductor (about 2 s per child) only to set its flag;
        # inductor reads the same setting from this variable if it is imported later.
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
        torch._C._set_deterministic_algorithms(True)


def _nondeterministic() -> None:
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C,
                                                               "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(False)
    else:
        # The public call imports inductor (a second, some 800 modules) only to set its
        # flag, which is off unless TORCHINDUCTOR_DETERMINISTIC says otherwise.
        os.environ.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        torch._C._set_deterministic_algorithms(False)


def _compile_off() -> None:
    if "torch._dynamo" in sys.modules:
        torch._dynamo.config.disable = True
    else:  # read by dynamo's config when it is first imported; importing it costs seconds
        os.environ["TORCH_COMPILE_DISABLE"] = "1"


# Switches a run can turn before the call (one change at a time, for ablation).
SETTINGS: dict[str, Callable[[], None]] = {
    "tf32_off": _tf32_off,
    "cudnn_off": _cudnn_off,
    "deterministic": _deterministic,
    "compile_off": _compile_off,
}


def apply_settings(names: tuple[str, ...]) -> None:
    """Turn the named switches in this (child) process."""
    for name in names:
        SETTINGS[name]()


def rng_restored(rng: Mapping[str, torch.Tensor],
                 device: str) -> contextlib.AbstractContextManager[None]:
    """Set the saved RNG states, so that random ops draw what they drew when captured (set
    when it is made, for a ``with`` statement: nothing is restored after; not a generator,
    whose machinery each forked child would run)."""
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"].to(torch.uint8))
    if "cuda" in rng and device.startswith("cuda"):
        torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))
    return _NOTHING


_NOTHING = contextlib.nullcontext()


def replay_context(context: ReplayContext, device: str,
                   rng: Mapping[str, torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """Apply a case's ``[context]`` around the call, as it was when the failure was captured
    (entered in a ``with`` at once: the global switches are set when it is made).

    Autocast is entered for the device type of this run with the captured dtype: a case
    captured under CUDA bf16 autocast computes in bf16 on the CPU too. The grad mode is
    ``grad_mode``'s, which the reference shares. Runs in the child, so the global switches
    (default dtype, TF32, deterministic) need no restoring.
    """
    _set_switches(context)
    if not rng and not context.inference and context.autocast is None:
        # The common case: the grad mode alone, without a generator or a stack (each
        # context manager a forked child enters for the first time costs it page copies;
        # no RNG state to set: nothing to restore).
        return torch.set_grad_enabled(grad_mode(context))
    return _full_context(context, device, rng)


def _set_switches(context: ReplayContext) -> None:
    """The global switches of ``[context]``: default dtype, determinism, TF32."""
    if context.default_dtype is not None:
        torch.set_default_dtype(getattr(torch, context.default_dtype))
    if context.deterministic:
        _deterministic()
    elif context.deterministic is False:
        _nondeterministic()
    if context.tf32_matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = context.tf32_matmul
    if context.tf32_cudnn is not None:
        torch.backends.cudnn.allow_tf32 = context.tf32_cudnn


@contextlib.contextmanager
def _full_context(context: ReplayContext, device: str,
                  rng: Mapping[str, torch.Tensor]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(rng_restored(rng, device))
        stack.enter_context(torch.set_grad_enabled(grad_mode(context)))
        if context.inference:
            stack.enter_context(torch.inference_mode())
        if context.autocast is not None:
            stack.enter_context(torch.autocast(
                device_type=device.split(":")[0], dtype=getattr(torch, context.autocast.dtype),
                enabled=context.autocast.enabled))
        yield


def grad_mode(context: ReplayContext) -> bool:
    """Whether autograd records the call, and the reference likewise: ``[context] grad``,
    else torch's default (on; off under ``inference``, as inference mode has it).

    The one switch of the context the reference shares with the call: a function that runs
    its own backward pass needs it to compute at all, whatever the precision.
    """
    if context.grad is not None:
        return context.grad
    return not context.inference

"""The Recorder as a Hugging Face ``TrainerCallback``:
``Trainer(..., callbacks=[GpuCaseCallback("cases")])``.

The model the Trainer trains is watched when training begins (the module inside
Accelerate's or DDP's wrapper), and each optimizer step is a step of the Recorder. A
failure in the model's forward (which computes the loss when the batch holds labels) saves
the model's case, rebuilt from its config (saved as ``config.json``, the config's own JSON)
with its class, and narrowed to the submodule and op that raised. A failure in the backward
pass saves a case that runs forward and backward again from the loss the model returns.
``bf16=True``/``fp16=True`` (Accelerate's autocast around the model's forward) is the case's
autocast context.

The Trainer has no callback for an exception, so one that leaves ``trainer.train()`` is
recorded by a ``sys.excepthook`` installed while training runs (the exception is printed
as before), or, where the script catches it, by ``callback.recorder.record(exc)``.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from transformers import TrainerCallback

from pytest_gpucase.tools.record import Recorder, Step
from pytest_gpucase.tools.record.recorder import hooks_of

__all__ = ["GpuCaseCallback"]


class GpuCaseCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Save the first failure of a Hugging Face ``Trainer`` run as a case that
    ``pytest --gpu-cases`` replays.

    ``root`` and the keyword ``options`` make the ``Recorder`` (``nonfinite=True``, ...);
    or pass one as ``recorder``. ``name``, ``factory``, ``kwargs`` and ``checkpoint`` are
    ``rec.watch``'s for the model.
    """

    def __init__(self, root: str | os.PathLike[str] = "cases", *,
                 recorder: Recorder | None = None, name: str | None = None,
                 factory: str | None = None, kwargs: Mapping[str, Any] | None = None,
                 checkpoint: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self.recorder = recorder if recorder is not None else Recorder(root, **options)
        self._watch: dict[str, Any] = {"name": name, "factory": factory, "kwargs": kwargs,
                       "checkpoint": checkpoint}
        self._model: Any = None
        self._step: Step | None = None
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        if model is not None:
            self._model = model
            self.recorder.watch(model, **self._watch)
        if self._hook is None:
            previous = sys.excepthook
            recorder = self.recorder

            def hook(kind: type[BaseException], exc: BaseException,
                     tb: TracebackType | None) -> None:
                recorder.record(exc)
                previous(kind, exc, tb)

            self._hook = (hook, previous)
            sys.excepthook = hook

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
        self._step = self.recorder.step(int(state.global_step))
        self._step.__enter__()
        # Accelerate's autocast around the forward; said here too, since under
        # torch_compile=True no submodule hook runs eagerly to read it.
        dtype = "bfloat16" if getattr(args, "bf16", False) else (
            "float16" if getattr(args, "fp16", False) else None)
        if dtype is not None:
            device = str(getattr(self._model, "device", "cpu")).split(":")[0]
            hooks_of(self.recorder).step_context["autocast"] = {
                "device_type": device, "dtype": dtype, "enabled": True}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
        if self._model is not None:
            self.recorder.unwatch(self._model)
        if self._hook is not None:
            hook, previous = self._hook
            if sys.excepthook is hook:
                sys.excepthook = previous
            self._hook = None

    def _close(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

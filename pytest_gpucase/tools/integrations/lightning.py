"""The Recorder as a Lightning ``Callback``: ``Trainer(callbacks=[GpuCaseCallback("cases")])``.

Each stage's LightningModule is watched when the Trainer sets it up (in every process:
``ddp``, ``ddp_spawn``). Every training and validation batch is a step: its batch is
copied before ``training_step`` runs, so that a failure of the step saves a case that
calls ``training_step(batch, batch_idx)`` again on that batch (and runs the backward pass
of the loss it returns, when the failure came from there): the forward, the loss, the
metric and the backward are replayed as they ran. A failure in the module's own forward
is the module's case, as ``rec.watch`` makes it. The LightningModule is rebuilt from the
hyperparameters ``save_hyperparameters()`` kept; ``precision="bf16-mixed"`` (or
``"16-mixed"``) is the case's autocast context.

Importing this module imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError:  # pragma: no cover - the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment,no-redef,unused-ignore]
    from pytorch_lightning.utilities.signature_utils import (  # type: ignore[no-redef,unused-ignore]
        is_param_in_hook_signature,
    )

from pytest_gpucase.tools.record import Recorder, Step
from pytest_gpucase.tools.record.recorder import hooks_of
from pytest_gpucase.tools.record.inputs import Before
from pytest_gpucase.tools.record.origin import watched_call

__all__ = ["GpuCaseCallback"]

# Lightning's precision names -> the autocast dtype they compute in.
_AUTOCAST = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


class GpuCaseCallback(Callback):  # type: ignore[misc,unused-ignore]
    """Save the first failure of a Lightning run as a case that ``pytest --gpu-cases``
    replays.

    ``root`` and the keyword ``options`` make the ``Recorder`` (``nonfinite=True``,
    ``narrow=False``, ...); or pass one as ``recorder``. ``name``, ``factory``, ``kwargs``
    and ``checkpoint`` are ``rec.watch``'s for the LightningModule; ``ids`` is called with
    each batch as the DataLoader yields it and returns its sample ids, one per entry (a
    list, or a tensor of integers): ``ids=lambda batch: batch["id"]`` (docs/recorder.md).
    """

    def __init__(self, root: str | os.PathLike[str] = "cases", *,
                 recorder: Recorder | None = None, name: str | None = None,
                 factory: str | None = None, kwargs: Mapping[str, Any] | None = None,
                 checkpoint: str | os.PathLike[str] | None = None,
                 ids: Callable[[Any], Iterable[object]] | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.recorder = recorder if recorder is not None else Recorder(root, **options)
        self._watch: dict[str, Any] = {"name": name, "factory": factory, "kwargs": kwargs,
                       "checkpoint": checkpoint}
        self._ids = ids
        self._step: Step | None = None
        self._in_backward = False

    # -- the module ------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # It sees the steps: no note to the contrary.
        hooks_of(self.recorder).integration = "lightning"
        self.recorder.watch(pl_module, **self._watch)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()
        self.recorder.unwatch(pl_module)

    # -- the steps -------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._open(trainer, pl_module, "training_step", trainer.global_step, batch, batch_idx)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._close()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        # Lightning passes dataloader_idx when there are several loaders: the case passes
        # it too, or its replay runs loader 0's branch.
        extra = ((dataloader_idx,) if _several(getattr(trainer, "num_val_batches", None))
                 else ())
        self._open(trainer, pl_module, "validation_step", f"validation {batch_idx}", batch,
                   batch_idx, *extra)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._close()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._in_backward = True
        hooks = hooks_of(self.recorder)
        if not hooks.checks("loss") or hooks.taken() or self._call is None:
            return
        from pytest_gpucase.tools.record.watch import nonfinite_problem

        problem = nonfinite_problem(f"loss of {type(pl_module).__qualname__}", loss)
        if problem is not None:
            method, args, before = self._call
            hooks.nonfinite(problem, lambda exc: hooks.save_method(
                exc, pl_module, method, args, {}, before, backward=False))

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._in_backward = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Outside a step (a spawned rank's error raised again in the launching process,
        # an error in setup) there is no call of this process to replay.
        if self._call is not None:
            method, args, before = self._call
            self.recorder.record(exception, module=pl_module, method=method, args=args,
                                 before=before, backward=self._in_backward)
        self._close(exception)

    # -- helpers ---------------------------------------------------------------------

    @property
    def _call(self) -> tuple[str, tuple[Any, ...], Before] | None:
        """The current step's call (method, its arguments, their copies), as the Recorder
        holds it for its watches (Hooks.framework_call)."""
        call = hooks_of(self.recorder).framework_call
        return None if call is None else call[1:]

    def _open(self, trainer: Any, pl_module: Any, method: str, iteration: int | str,
              batch: Any, batch_idx: int, *extra: Any) -> None:
        self._close()
        rec, hooks = self.recorder, hooks_of(self.recorder)
        ids = None
        if self._ids is not None:
            try:
                found = self._ids(batch)
                # A tensor's own numbers, not its 0-d elements (read as "tensor(7)").
                ids = found.tolist() if hasattr(found, "tolist") else list(found)
            except Exception:
                ids = None
        self._step = rec.step(iteration, method, sample_ids=ids)  # type: ignore[arg-type]
        self._step.__enter__()
        self._in_backward = False
        # Lightning's own rule: batch_idx only to a step that takes it.
        step = getattr(pl_module, method)
        args = ((batch, batch_idx, *extra)
                if is_param_in_hook_signature(step, "batch_idx", min_args=2)
                else (batch, *extra))
        before = Before()
        if not hooks.taken():
            watched = watched_call(step, method, None, None)
            before = hooks.snapshot_of(watched, args, {})
        hooks.framework_call = (pl_module, method, args, before)
        autocast = _AUTOCAST.get(str(getattr(trainer, "precision", "")))
        if autocast is not None:
            device = str(getattr(pl_module, "device", "cpu")).split(":")[0]
            hooks.step_context["autocast"] = {"device_type": device, "dtype": autocast,
                                              "enabled": True}

    def _close(self, exception: BaseException | None = None) -> None:
        step, self._step = self._step, None
        hooks_of(self.recorder).framework_call = None
        if step is None:
            return
        if exception is None:
            step.__exit__(None, None, None)
        else:
            step.__exit__(type(exception), exception, exception.__traceback__)


def _several(counts: Any) -> bool:
    """Whether the loop runs several dataloaders (``trainer.num_val_batches``: one count each)."""
    return isinstance(counts, list | tuple) and len(counts) > 1


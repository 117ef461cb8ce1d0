"""The dtype each value of an autocast run is held in, followed along its float32 reference.

Under ``torch.autocast`` a run holds its values in several dtypes: the operations on
autocast's lower-precision list (matmuls, convolutions, attention) cast their operands to
the autocast dtype and make results in it; every other operation computes in the dtype its
operands are held in, promoted as torch promotes them (a residual add of a bfloat16 matmul's
result to a float32 stream is float32; a layer norm of that stream is float32 on the CPU).
The reference of an autocast case (``run.judge.autocast_reference``) is the same call in
float32 with no autocast, every value float32. Rounding every one of its values at bfloat16
for the budget's draws (``rounding.RoundEveryOp``) would budget for roundings the run never
makes: a nanoGPT-shaped model under CPU autocast got a budget 14 times its correct run's
error, and passed its logits scaled by 1.1 in bfloat16 only.

``HeldDtypes`` follows, for each tensor the reference makes, the dtype the run holds it in,
so that a draw rounds each result at that dtype's precision, and an operand at the autocast
dtype's precision where a lower-precision operation casts it. The lists are autocast's own
(``aten/src/ATen/autocast_mode.cpp``) as their operations reach a dispatch mode, after
composite operations are decomposed (``linear`` reaches it as ``addmm``, ``matmul`` as
``mm``, ``bmm``, ``mv`` or ``dot``); a backward operation of one is on the list too (its
operands are the lower-precision values of the forward, and its gradient arrives in that
dtype). Autocast's float32 list (the CUDA one holds softmax, layer norm, the losses) is not
followed: those operations are held in their operands' dtype here, which rounds more than a
device run does, never less, so the budget is wider than the run's rounding there, not
narrower.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LOWER_PRECISION", "HeldDtypes", "coarser_than"]

# Autocast's lower-precision operations (CPU and CUDA lists), as a dispatch mode meets them.
LOWER_PRECISION = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::addr", "aten::dot", "aten::vdot", "aten::_addmm_activation",
    "aten::convolution", "aten::_convolution", "aten::convolution_backward",
    "aten::conv_tbc", "aten::prelu", "aten::_prelu_kernel", "aten::_prelu_kernel_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
    "aten::_flash_attention_forward", "aten::_flash_attention_backward",
    "aten::_native_multi_head_attention", "aten::_thnn_fused_lstm_cell",
    "aten::_thnn_fused_gru_cell", "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward",
})


def coarser_than(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether floating dtype ``a`` holds fewer significant bits than ``b`` (so that holding
    a value of ``b`` in ``a`` rounds it); the real dtype of a complex one is what counts."""
    return torch.finfo(a.to_real()).eps > torch.finfo(b.to_real()).eps


def _floating_tensors(value: object) -> Iterator[torch.Tensor]:
    """The floating tensors of an operation's arguments or results (in lists, tuples and
    dicts, as an operator's schema has them), in order: cheaper than a pytree flatten,
    paid on every operation of a draw."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floating_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _floating_tensors(item)


class HeldDtypes:
    """The dtype the run holds each tensor of the reference in: a tensor not followed is held
    in its own dtype (an input, a parameter: autocast keeps them as they are)."""

    def __init__(self, autocast: torch.dtype) -> None:
        self.autocast = autocast
        self._held: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def of(self, t: torch.Tensor) -> torch.dtype:
        found = self._held.get(t)  # type: ignore[no-untyped-call]
        return found if isinstance(found, torch.dtype) else t.dtype

    def mark(self, out: object, dtype: torch.dtype | None) -> None:
        """Note that the floating tensors of ``out`` are held in ``dtype``."""
        if dtype is None:
            return
        for t in _floating_tensors(out):
            if t.dtype.to_real() != dtype.to_real():
                self._held[t] = dtype
            else:
                self._held.pop(t, None)  # type: ignore[no-untyped-call]

    def result(self, func: Any, args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
        """The dtype the run holds the results of ``func`` on these operands in; None when it
        makes no floating value from floating operands (each result is then held as made)."""
        name = func._schema.name
        if name in LOWER_PRECISION:
            return self.autocast
        wanted = kwargs.get("dtype")
        if isinstance(wanted, torch.dtype):
            return wanted if wanted.is_floating_point or wanted.is_complex else None
        if func.is_view:
            base = next(_floating_tensors(args), None)
            return self.of(base) if base is not None else None
        return self.promoted(args, kwargs)

    def promoted(self, args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
        """Of the operands' held dtypes, the one torch promotes them to: the finest among the
        tensors with dimensions, else among those without (a 0-dim float32 tensor times a
        bfloat16 tensor is bfloat16)."""
        dims: list[torch.dtype] = []
        scalars: list[torch.dtype] = []
        for value in _floating_tensors((args, kwargs)):
            (dims if value.dim() else scalars).append(self.of(value))
        found = dims or scalars
        if not found:
            return None
        return min(found, key=lambda d: torch.finfo(d.to_real()).eps)

    def finer_than_autocast(self, t: torch.Tensor) -> bool:
        """Whether a lower-precision operation's cast of ``t`` rounds it (its held dtype is
        finer than the autocast dtype)."""
        return coarser_than(self.autocast, self.of(t))

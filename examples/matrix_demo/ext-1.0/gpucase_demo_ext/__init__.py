"""gpucase-demo-ext 1.0: a fused scaled softmax, as first released."""

import torch


def scaled_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    # The 1.0 kernel exponentiates without subtracting the row maximum:
    # logits above ~88 / scale overflow float32 to inf, and inf / inf is NaN.
    e = torch.exp(x * scale)
    return e / e.sum(dim=-1, keepdim=True)

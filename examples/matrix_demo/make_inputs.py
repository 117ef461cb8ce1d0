"""Write the demo case's payload: attention logits, a few of them large."""

from pathlib import Path

import torch

from pytest_gpucase import payload

x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 4
x[2, 5] = 900.0  # one saturated logit, as seen at long context
payload.save(Path(__file__).parent / "cases" / "softmax_ext" / "inputs.safetensors", {"x": x})

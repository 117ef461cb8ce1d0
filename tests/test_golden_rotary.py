"""A golden is judged by whether the reference still computes it, in the reference's own
precision, never within the run's rounding budget: a rotary attention case under bf16
autocast, its golden regenerated, then its frequency base changed by 10% passed with
'outputs match the reference and expected.safetensors' (RMS 0.045 from the golden within a
budget of 0.748). Unchanged, it passes; moved by a float32 rounding (another machine), too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import golden, payload

pytestmark = pytest.mark.slow  # every test here starts processes

ROTARY = '''
import torch
from torch import nn
from torch.nn import functional as F

BASE = 10000.0


def rotate(x, T, d):
    inv_freq = 1.0 / (BASE ** (torch.arange(0, d, 2, device=x.device).float() / d))
    angles = torch.outer(torch.arange(T, device=x.device).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class RotaryAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        d = C // self.heads
        q, k, v = (t.view(B, T, self.heads, d).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        q, k = rotate(q, T, d), rotate(k, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C)).float()
'''

CASE = '''
format = 1
call = "pytest_gpucase.capture:replay_module"

[inputs.gpucase_module]
factory = "case.py:RotaryAttention"
training = false
kwargs = { dim = 64, heads = 4 }

[context]
autocast = { device_type = "cpu", dtype = "bfloat16", enabled = true }
grad = false
'''


def rotary_case(root: Path) -> Path:
    path = root / "cases" / "rotary"
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(CASE))
    (path / "case.py").write_text(ROTARY)
    namespace: dict[str, object] = {}
    exec(ROTARY, namespace)  # the class the case file defines
    torch.manual_seed(0)
    model = namespace["RotaryAttention"]()  # type: ignore[operator]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    state = {f"state.{k}": v for k, v in model.state_dict().items()}
    payload.save(path / "inputs.safetensors", {"x": torch.randn(2, 32, 64), **state})
    return path


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("--gpu-cases", "cases", "--gpu-devices", "cpu", "-rA",
                                         "-p", "no:cacheprovider", "-p", "no:randomly", *args)


@pytest.fixture
def regenerated(pytester: pytest.Pytester) -> Path:
    path = rotary_case(pytester.path)
    run(pytester, "--gpu-cases-regen").assert_outcomes(passed=1)
    assert (path / "expected.safetensors").exists()
    return path


def test_a_wrong_rotary_frequency_fails_against_the_golden(regenerated: Path,
                                                           pytester: pytest.Pytester) -> None:
    source = regenerated / "case.py"
    source.write_text(source.read_text().replace("BASE = 10000.0", "BASE = 11000.0"))
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the float32 reference (no autocast) differs from the golden "
                                 "expected.safetensors*the computation changed since*"])


def test_an_unchanged_rotary_case_passes_its_golden(regenerated: Path,
                                                    pytester: pytest.Pytester) -> None:
    run(pytester).assert_outcomes(passed=1)


def test_a_golden_written_elsewhere_passes_within_its_dtype(regenerated: Path,
                                                            pytester: pytest.Pytester) -> None:
    """The reference on another machine rounds its float32 sums in another order: the golden
    moved by a float32 ULP here and there is still the reference's result."""
    file = regenerated / "expected.safetensors"
    kept = golden.load(file)
    out = kept["out"]
    step = torch.where(torch.arange(out.numel()).reshape(out.shape) % 3 == 0, 1.0, 0.0)
    moved = torch.nextafter(out, out + step * out.sign())
    assert not torch.equal(moved, out)
    golden.save(file, {**kept, "out": moved})
    run(pytester).assert_outcomes(passed=1)

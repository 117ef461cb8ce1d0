"""Real GPU behaviour: run with `pytest -m gpu` on a machine with a CUDA device.

Each test runs `pytest --gpu-cases` in a subprocess, so this process never
initializes CUDA; without a device the conftest skips them with a reason.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BAD_TARGET = """
import torch.nn.functional as F

def run(logits, target):
    return F.cross_entropy(logits, target)
"""

SOFTMAX = """
import torch

def run(x):
    return torch.softmax(x * 3, dim=-1)
"""


def write_case(root: Path, name: str, toml: str, code: str,
               tensors: dict[str, torch.Tensor]) -> None:
    path = root / "cases" / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(toml).lstrip())
    (path / "case.py").write_text(textwrap.dedent(code).lstrip())
    payload.save(path / "inputs.safetensors", tensors)


def test_device_side_assert_leaves_the_session_healthy(pytester: pytest.Pytester) -> None:
    logits = torch.randn(3, 4)
    write_case(pytester.path, "a_assert", 'format = 1\ncall = "case.py:run"\n', BAD_TARGET,
               {"logits": logits, "target": torch.tensor([0, 2, 4])})
    write_case(pytester.path, "b_after", 'format = 1\ncall = "case.py:run"\n', SOFTMAX,
               {"x": torch.randn(8, 16)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cuda", "-v", "cases")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*a_assert[[]cuda-float32[]] FAILED*",
        "*b_after[[]cuda-float32[]] PASSED*",
    ])
    # The kernel's assertion line (fd 2), the triage, and the launch-blocking rerun.
    result.stdout.fnmatch_lines([
        "*Captured stderr (child) call*",
        "*Assertion `t >= 0 && t < n_classes` failed*",
    ])
    result.stdout.fnmatch_lines(["*gpucase triage*", "clue: device-side assert*"])
    result.stdout.fnmatch_lines(["*gpucase launch-blocking rerun*",
                                 "rerun in a new child with CUDA_LAUNCH_BLOCKING=1:"])


def test_launch_blocking_reaches_the_child(pytester: pytest.Pytester) -> None:
    write_case(pytester.path, "env", """
        format = 1
        call = "case.py:run"
        [expect]
        outcome = "raises"
        exception = "LookupError"
        match = "^1$"
    """, "import os\n\ndef run(x):\n"
         "    raise LookupError(os.environ.get('CUDA_LAUNCH_BLOCKING'))\n",
        {"x": torch.ones(2)})
    plain = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cuda", "cases")
    plain.assert_outcomes(failed=1)
    blocking = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cuda",
                                             "--gpu-launch-blocking", "cases")
    blocking.assert_outcomes(passed=1)


def test_cuda_outputs_checked_against_float64_on_cpu(pytester: pytest.Pytester) -> None:
    write_case(pytester.path, "softmax", """
        format = 1
        call = "case.py:run"
        [expect]
        gradients = true
        [matrix]
        devices = ["cuda"]
        dtypes = ["float32", "bfloat16", "float16"]
    """, SOFTMAX, {"x": torch.randn(64, 128)})
    result = pytester.runpytest_subprocess("--gpu-cases", "-v", "cases")
    result.assert_outcomes(passed=3)


def test_header_names_the_device(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--gpu-cases", "--collect-only", "-q")
    name = torch.cuda.get_device_name(0) if torch.cuda.is_initialized() else "*"
    result.stdout.fnmatch_lines([f"gpucase: cuda backend · torch * · CUDA * {name}*"])


ROUNDING = """
import torch
import torch.nn.functional as F

def run(a, b, x, weight, bias):
    return {"matmul": a @ b, "softmax": torch.softmax(x, -1),
            "layer_norm": F.layer_norm(x, (x.shape[-1],), weight, bias)}
"""


def test_correct_cuda_low_precision_results_pass_by_default(pytester: pytest.Pytester) -> None:
    """The rounding budget and the CPU's same-dtype baseline on a real device: a float32
    matmul at scale and bfloat16/float16 softmax and layer norm with gradients pass."""
    gen = torch.Generator().manual_seed(0)
    write_case(pytester.path, "rounding", """
        format = 1
        call = "case.py:run"
        [expect]
        gradients = true
        [matrix]
        devices = ["cuda"]
        dtypes = ["float32", "bfloat16", "float16"]
    """, ROUNDING, {"a": (torch.rand(512, 512, generator=gen) * 2 - 1) * 10,
                    "b": (torch.rand(512, 512, generator=gen) * 2 - 1) * 10,
                    "x": torch.randn(64, 256, generator=gen) * 2,
                    "weight": 1 + 0.1 * torch.randn(256, generator=gen),
                    "bias": 0.1 * torch.randn(256, generator=gen)})
    result = pytester.runpytest_subprocess("--gpu-cases", "-v", "cases")
    result.assert_outcomes(passed=3)


def test_a_cuda_result_markedly_worse_than_the_cpus_fails(pytester: pytest.Pytester) -> None:
    """On CUDA the call rounds its bfloat16 output through float16's exponent range and back
    with a coarser grid (a deliberately degraded kernel): within the rounding budget, but
    many times the CPU's own bfloat16 error, which the device rule refuses."""
    write_case(pytester.path, "degraded", """
        format = 1
        call = "case.py:run"
        [matrix]
        devices = ["cuda"]
        dtypes = ["bfloat16"]
    """, """
import torch

def run(x):
    out = torch.softmax(x, -1)
    if out.is_cuda:  # a kernel that keeps 4 significant bits where bfloat16 keeps 8
        scale = 2.0 ** torch.floor(torch.log2(out.float().abs().clamp_min(1e-30)))
        out = (torch.round(out.float() / scale * 8) / 8 * scale).to(out.dtype)
    return out
""", {"x": torch.randn(64, 512)})
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cuda's * error against the float64 reference is * times the "
                                 "CPU's own in bfloat16*"])

"""The CUDA-only ablations on a real GPU: TF32 off on a float32 matmul, cuDNN off on a conv.

Both cases are judged against float64 with a tolerance (atol 1e-3) that full
float32 meets with a wide margin (errors near 1e-5 for these sizes) and TF32
(10 significant bits, errors near 1e-2) misses with a wide margin too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_gpucase.tools.ablate import CPU_HINT, PASSES, STILL_FAILS, ablate
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.environment import Environment
from pytest_gpucase.run.probe import probe
from tests.helpers import make_case

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TIGHT = """\
    [expect.tolerance.float32]
    rtol = 1e-5
    atol = 1e-3
    """


@pytest.fixture(scope="module")
def ampere_env() -> Environment:
    """The environment, probed in a child (this process never initializes CUDA)."""
    env = probe()
    if env.backend != "cuda":
        pytest.skip(f"needs an NVIDIA GPU for TF32; this is a {env.backend} build")
    low = [d for d in env.devices if d.capability is None or float(d.capability) < 8.0]
    if low:
        pytest.skip(f"TF32 needs compute capability 8.0 (Ampere) or newer; {low[0].name} is "
                    f"{low[0].capability}")
    return env


MATMUL_PY = """\
    import torch

    # As in many training scripts: TF32 turned on for matmuls when the module is imported.
    torch.backends.cuda.matmul.allow_tf32 = True


    def project(x, w):
        return x @ w
    """


def test_tf32_off_changes_a_float32_matmul_verdict(tmp_path: Path,
                                                   ampere_env: Environment) -> None:
    """A (64x1024) @ (1024x64) float32 matmul with TF32 on misses atol 1e-3; with it off, meets it.

    The project's module turns TF32 on at import, after the child's switches: the
    TF32-off run also sets NVIDIA_TF32_OVERRIDE=0, which cuBLAS obeys whatever the
    code sets. cuDNN plays no part in a matmul, so cuDNN off changes nothing.
    """
    gen = torch.Generator().manual_seed(0)
    path = make_case(tmp_path, "matmul_tf32", f"""\
        format = 1
        call = "case.py:project"

        [matrix]
        devices = ["cuda"]

        {TIGHT}""", MATMUL_PY, {"x": torch.randn(64, 1024, generator=gen),
                                "w": torch.randn(1024, 64, generator=gen)})
    result = ablate(load_case(path), device="cuda", dtype="float32", env=ampere_env)

    verdicts = {row.change: row.verdict for row in result.rows}
    assert result.baseline.failure == "mismatch", result.baseline.summary
    assert verdicts["tf32_off"] == PASSES
    assert verdicts["float64"] == PASSES
    assert verdicts["cudnn_off"] == STILL_FAILS
    assert verdicts["cpu"] == PASSES
    assert {row.change: row.note for row in result.rows}["cpu"] == CPU_HINT
    assert "passes with TF32 off: TF32's 10-bit mantissa" in result.reading
    assert f"passes on the CPU: {CPU_HINT}" in result.reading


CONV_PY = """\
    import torch.nn.functional as F


    def block(x, weight):
        return F.conv2d(x, weight, padding=1)
    """


def test_cudnn_off_changes_a_float32_conv_verdict(tmp_path: Path,
                                                  ampere_env: Environment) -> None:
    """cuDNN convolutions use TF32 by default (torch.backends.cudnn.allow_tf32 = True).

    With cuDNN off the convolution runs as im2col and a cuBLAS matmul, which
    stays in full float32 (float32_matmul_precision "highest"), so it passes; so
    does the run with TF32 off. The reading names both.
    """
    gen = torch.Generator().manual_seed(0)
    path = make_case(tmp_path, "conv_cudnn", f"""\
        format = 1
        call = "case.py:block"

        [matrix]
        devices = ["cuda"]

        {TIGHT}""", CONV_PY, {"x": torch.randn(4, 64, 16, 16, generator=gen),
                              "weight": torch.randn(64, 64, 3, 3, generator=gen)})
    result = ablate(load_case(path), device="cuda", dtype="float32", env=ampere_env)

    verdicts = {row.change: row.verdict for row in result.rows}
    assert result.baseline.failure == "mismatch", result.baseline.summary
    assert verdicts["cudnn_off"] == PASSES
    assert verdicts["tf32_off"] == PASSES
    assert verdicts["float64"] == PASSES
    assert "passes with cuDNN off: suspect the cuDNN kernel for this shape" in result.reading

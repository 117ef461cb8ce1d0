"""A reference that cannot run is never the known failure, and an autocast case gets a reference
that can run the model's own casts: a correct fix turns XPASS(strict), then green."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pytest_gpucase.case import payload

BLOCK = """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)
            self.norm = nn.LayerNorm(dim)

        def forward(self, x):
            h = self.up(x)                                  # bfloat16 under autocast
            h = torch.nn.functional.gelu(h.float())         # the fix: the activation in float32
            return self.norm(self.down(h).float() + x.float())


    class Head(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            return self.proj(x).float()                     # a float32 output of a bf16 matmul


    def make_block(dim):
        return Block(dim)


    def make_head(dim):
        return Head(dim)
    """

CONTEXT = """
    [context]
    autocast = { device_type = "cuda", dtype = "bfloat16", enabled = true }
    grad = false
    """

ORIGIN = ("""
    [origin]
    error = "RuntimeError: expected mat1 and mat2 to have the same dtype, """
          """but got: c10::BFloat16 != float"
    backend = "cuda"
    """)


def module_case(root: Path, name: str, factory: str, module: nn.Module, x: torch.Tensor,
                top: str = "", tables: str = CONTEXT + ORIGIN) -> Path:
    """A module case as the Recorder writes it: replay_module, the state dict in the payload."""
    path = root / "cases" / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(f"""
        format = 1
        call = "pytest_gpucase.capture:replay_module"
        {top}
        [inputs.gpucase_module]
        factory = "case.py:{factory}"
        training = false
        kwargs = {{ dim = 32 }}
        """) + textwrap.dedent(tables))
    (path / "case.py").write_text(textwrap.dedent(BLOCK))
    tensors = {"x": x, **{f"state.{k}": v for k, v in module.state_dict().items()}}
    payload.save(path / "inputs.safetensors", tensors)
    return path


def modules() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(BLOCK), namespace)  # the classes the case file defines
    block = namespace["make_block"](32)  # type: ignore[operator]
    head = namespace["make_head"](32)  # type: ignore[operator]
    return block, head, torch.randn(64, 32)


def test_a_fixed_mixed_precision_model_turns_xpass_strict_then_green(
        pytester: pytest.Pytester) -> None:
    """The captured failure was a dtype clash under autocast, fixed by an explicit .float().
    The float64 reference then met that .float() with "mat1 and mat2 must have the same
    dtype", a failure of the same class, which counted as the captured one: after the fix
    the item stayed a quiet XFAIL."""
    block, _, x = modules()
    path = module_case(pytester.path, "block", "make_block", block, x,
                       top='xfail = "bf16 overflow in the MLP"')
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rA", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*block*bfloat16*XPASS(strict)*"])
    text = (path / "case.toml").read_text().replace('xfail = "bf16 overflow in the MLP"', "")
    (path / "case.toml").write_text(text)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rA", "cases")
    result.assert_outcomes(passed=1)


def test_a_narrowed_case_under_autocast_is_judged_at_the_autocast_dtype(
        pytester: pytest.Pytester) -> None:
    """The submodule the Recorder narrows to returns float32 computed by a bfloat16 matmul:
    judged at float32's tolerance it failed after the fix (2014 / 2048 elements)."""
    _, head, x = modules()
    module_case(pytester.path, "head", "make_head", head, x, tables=CONTEXT)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rA", "cases")
    result.assert_outcomes(passed=1)


def test_a_reference_that_cannot_run_is_its_own_verdict_never_the_known_failure(
        pytester: pytest.Pytester) -> None:
    """Without [context] autocast the model's explicit casts meet float64: the reference
    crashes with a RuntimeError, the same type as the captured one, and that is never the
    known failure of a strict xfail."""
    block, _, x = modules()
    module_case(pytester.path, "block", "make_block", block, x, top='xfail = "known"',
                tables=ORIGIN)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "the float64 reference could not run: RuntimeError: mat1 and mat2 must have the same "
        "dtype, but got Float and Double; name an independent reference = \"case.py:reference\" "
        "in case.toml that runs in float64, or, if the code casts explicitly because it runs "
        "under autocast, set [[]context[]] autocast = { device_type = ..., dtype = ... } so that "
        "its reference runs in float32",
    ])
    result.stdout.fnmatch_lines(["*here the call ran and its reference could not, so nothing "
                                 "judged the call's outputs: this is never counted as the "
                                 "known failure*"])

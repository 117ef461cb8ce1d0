"""Verdicts on real modules and ops, as users meet them: correct low-precision and float32 code
passes by default, code wrong by more than rounding still fails.

Each case runs in a fresh child through the plugin's own path (``run_spec``). Each correct
case here failed before the verdicts learned the computation's rounding (a false alarm of
the default tolerances, a reference that could not run, a cache object that never compared);
each wrong variant fails before and after. ``benchmarks/bench_verdicts.py`` measures the same
ops over many seeds.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext


def judged(root: Path, name: str, code: str, tensors: dict[str, torch.Tensor], toml: str = "",
           dtype: str = "float32", cast: bool = True) -> Outcome:
    """Write a case (``call = "case.py:run"`` and the given tables) and run it on the CPU."""
    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\ntimeout = 300\n'
                                    + textwrap.dedent(toml))
    (path / "case.py").write_text(textwrap.dedent(code))
    payload.save(path / "inputs.safetensors", tensors)
    spec = RunSpec(load_case(path), "cpu", dtype, cast=cast)
    return run_spec(spec, RunContext("fork", "cpu")).outcome


def variant(code: str, old: str, new: str) -> str:
    """``code`` with ``old`` replaced (which it must hold): a variant of a case's code."""
    assert old in code, old
    return code.replace(old, new)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


GRADIENTS = "[expect]\ngradients = true\n"
WITH_REFERENCE = 'reference = "case.py:reference"\n'


@pytest.mark.slow
def test_float32_matmul_at_scale(tmp_path: Path) -> None:
    """1024 x 1024 of values ~1e3 with symmetric signs: each product element is a sum of 1024
    terms of size 1e6; a correct float32 result is off by tens, and every seed failed."""
    g = gen()
    a = (torch.rand(1024, 1024, generator=g, dtype=torch.float64) * 2 - 1) * 1e3
    b = (torch.rand(1024, 1024, generator=g, dtype=torch.float64) * 2 - 1) * 1e3
    inputs = {"a": a.float(), "b": b.float()}
    code = """
        import torch
        def run(a, b):
            return torch.nn.functional.linear(a, b.t())
        def reference(a, b):
            return a @ b
        """
    assert judged(tmp_path, "matmul", code, inputs).status == "passed"
    scaled = judged(tmp_path, "matmul_scaled", variant(
        code, "return torch.nn.functional.linear(a, b.t())", "return (a @ b) * 1.01"),
                    inputs, WITH_REFERENCE)
    assert scaled.status == "failed"
    assert "rounding budget" in scaled.details  # the bound it failed was the widened one
    shifted = judged(tmp_path, "matmul_row", variant(
        code, "return torch.nn.functional.linear(a, b.t())", "return (a @ b).roll(1, 0)"),
        inputs, WITH_REFERENCE)
    assert shifted.status == "failed"  # an off-by-one row


LAYER_NORM = """
    import torch
    from torch import nn

    def run(x):
        norm = nn.LayerNorm(x.shape[-1], elementwise_affine=False).to(x.dtype)
        return norm(x)

    def two_pass(x):
        mean = x.mean(-1, keepdim=True)
        centred = x - mean
        return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)

    def reference(x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],))
    """


@pytest.mark.slow
def test_float32_layer_norm_of_large_offset_values(tmp_path: Path) -> None:
    """1e3 + N(0, 1): one float32 rounding of an input is 6e-5, a 6e-5 change of a normalized
    output; torch's layer norm and a careful two-pass one are off by 1e-4 and failed."""
    x = {"x": (1e3 + torch.randn(64, 1024, generator=gen(1), dtype=torch.float64)).float()}
    assert judged(tmp_path, "ln", LAYER_NORM, x).status == "passed"
    assert judged(tmp_path, "ln_two_pass", variant(
        LAYER_NORM, "def run(x):\n        norm",
        "def run(x):\n        return two_pass(x)\n        norm"),
        x).status == "passed"
    # One pass (E[x^2] - E[x]^2) cancels 1e6 against 1e6 in float32: not rounding.
    one_pass = judged(tmp_path, "ln_one_pass", variant(
        LAYER_NORM, "def run(x):\n        norm",
        "def run(x):\n        m = x.mean(-1, keepdim=True)\n"
        "        v = (x * x).mean(-1, keepdim=True) - m * m\n"
        "        return (x - m) / torch.sqrt(v + 1e-5)\n        norm"), x, WITH_REFERENCE)
    assert one_pass.status == "failed"


BATCH_NORM = """
    import torch
    from torch import nn

    def run(x, weight, bias):
        norm = nn.BatchNorm1d(x.shape[1]).to(x.dtype).train()
        return torch.func.functional_call(norm, {"weight": weight, "bias": bias}, (x,))

    def reference(x, weight, bias):
        mean = x.mean(0)
        var = ((x - mean) ** 2).mean(0)
        return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias
    """


@pytest.mark.slow
def test_batch_norm_training_over_two_samples_with_gradients(tmp_path: Path) -> None:
    """With two samples every normalized output is about +-1 and the gradient of x nearly
    cancels: the float32 gradient was 1.1e-5 off, just past float32's atol."""
    g = gen(2)
    inputs = {"x": torch.randn(2, 64, generator=g), "weight": torch.rand(64, generator=g) + 0.5,
              "bias": torch.randn(64, generator=g)}
    for name, toml in (("bn", GRADIENTS), ("bn_ref", WITH_REFERENCE + GRADIENTS)):
        found = judged(tmp_path, name, BATCH_NORM, inputs, toml)
        assert found.status == "passed", found.details
    # The unbiased variance (N - 1) in place of the biased one: a wrong formula.
    unbiased = variant(
        BATCH_NORM,
        'return torch.func.functional_call(norm, {"weight": weight, "bias": bias}, (x,))',
        "mean = x.mean(0)\n        return (x - mean) / torch.sqrt(x.var(0) + 1e-5) * weight"
        " + bias")
    wrong = judged(tmp_path, "bn_unbiased", unbiased, inputs, WITH_REFERENCE + GRADIENTS)
    assert wrong.status == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_softmax_and_layer_norm_gradients(tmp_path: Path, dtype: str) -> None:
    """The cotangent was the sum of the outputs, which makes these gradients zero in exact
    arithmetic: atol 1e-5 against rounding noise decided (20 of 20 seeds)."""
    code = """
        import torch
        import torch.nn.functional as F

        def run(x, weight, bias):
            return torch.softmax(x, -1), F.layer_norm(x, (x.shape[-1],)), F.layer_norm(
                x, (x.shape[-1],), weight, bias)

        def reference(x, weight, bias):
            return run(x, weight, bias)
        """
    g = gen(3)
    inputs = {"x": torch.randn(32, 256, generator=g) * 2,
              "weight": 1 + 0.1 * torch.randn(256, generator=g),
              "bias": 0.1 * torch.randn(256, generator=g)}
    passed = judged(tmp_path, "norms", code, inputs, GRADIENTS, dtype=dtype)
    assert passed.status == "passed", passed.details
    wrong = judged(tmp_path, "softmax_dim", variant(variant(
        code, "return torch.softmax(x, -1),", "return torch.softmax(x, 0),"),
        "def reference(x, weight, bias):\n            return run(x, weight, bias)",
        "def reference(x, weight, bias):\n            return torch.softmax(x, -1), "
        "F.layer_norm(x, (x.shape[-1],)), F.layer_norm(x, (x.shape[-1],), weight, bias)"),
        inputs, WITH_REFERENCE + GRADIENTS, dtype=dtype)
    assert wrong.status == "failed"
    assert "out[0]" in wrong.summary


@pytest.mark.slow
def test_attention(tmp_path: Path) -> None:
    code = """
        import math
        import torch
        from torch import nn

        def run(x, in_proj, out_proj):
            attention = nn.MultiheadAttention(64, 4, batch_first=True, bias=False).to(x.dtype)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            weights = {"in_proj_weight": in_proj, "out_proj.weight": out_proj}
            return torch.func.functional_call(attention, weights, (x, x, x),
                                              {"attn_mask": mask, "need_weights": False})[0]

        def reference(x, in_proj, out_proj):
            q, k, v = (x @ in_proj.t()).chunk(3, -1)
            split = lambda t: t.unflatten(-1, (4, 16)).transpose(1, 2)
            q, k, v = split(q), split(k), split(v)
            scores = q @ k.transpose(-1, -2) / math.sqrt(16)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
            return (weights @ v).transpose(1, 2).flatten(2) @ out_proj.t()
        """
    g = gen(4)
    inputs = {"x": torch.randn(2, 48, 64, generator=g),
              "in_proj": torch.randn(192, 64, generator=g) / 8,
              "out_proj": torch.randn(64, 64, generator=g) / 8}
    for dtype in ("float32", "bfloat16"):
        found = judged(tmp_path, f"mha_{dtype}", code, inputs, WITH_REFERENCE + GRADIENTS,
                       dtype=dtype)
        assert found.status == "passed", found.details
    unscaled = judged(tmp_path, "mha_unscaled", variant(code, "/ math.sqrt(16)", ""), inputs,
                      WITH_REFERENCE, dtype="bfloat16")
    assert unscaled.status == "failed"  # the reference dropped the 1/sqrt(d) term


@pytest.mark.slow
def test_a_python_number_from_a_bfloat16_run(tmp_path: Path) -> None:
    """loss.item() of a bfloat16 run was judged at float64's 1e-7; as a tensor it passed."""
    code = """
        import torch.nn.functional as F

        def run(logits, target):
            return F.cross_entropy(logits, target).item()
        """
    g = gen(5)
    inputs = {"logits": torch.randn(64, 100, generator=g),
              "target": torch.randint(0, 100, (64,), generator=g)}
    found = judged(tmp_path, "loss_item", code, inputs, dtype="bfloat16")
    assert found.status == "passed", found.details
    wrong = judged(tmp_path, "loss_item_wrong", variant(variant(
        code, ".item()", ".item() * (1.1 if logits.dtype != torch.float64 else 1.0)"),
        "import torch.nn.functional as F", "import torch\nimport torch.nn.functional as F"),
        inputs, dtype="bfloat16")
    assert wrong.status == "failed"


SQUARE = """
    import torch

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * x * {factor}

    def run(x):
        return Square.apply(x).sum(-1)
    """


@pytest.mark.slow
def test_a_custom_function_with_a_wrong_backward_fails_without_a_reference(
        tmp_path: Path) -> None:
    """Checked against its own float64 run, a wrong backward formula always agreed."""
    x = {"x": torch.randn(8, 16, generator=gen(6))}
    right = judged(tmp_path, "square", SQUARE.format(factor=2), x, GRADIENTS)
    assert right.status == "passed" and right.notes == ()
    wrong = judged(tmp_path, "square_wrong", SQUARE.format(factor=1), x, GRADIENTS)
    assert wrong.status == "failed"
    assert wrong.summary.startswith("the gradients disagree with finite differences of the "
                                    "call's own forward (float64 on the CPU)")
    assert "the gradient with respect to x along a random direction" in wrong.summary
    assert "by the backward (analytical)" in wrong.summary and "x has 128 elements" in (
        wrong.summary)


@pytest.mark.slow
def test_gradients_nothing_independent_checked_are_said_so(tmp_path: Path) -> None:
    """Where gradcheck cannot run, the item says so, on a pass too."""
    tensors = {f"x{i}": torch.randn(2, generator=gen(i)) for i in range(70)}
    many = """
        def run(**inputs):
            return sum(t.sum() for t in inputs.values())
        """
    found = judged(tmp_path, "many_inputs", many, tensors, GRADIENTS)
    assert found.status == "passed"
    (note,) = found.notes
    assert note.startswith("the gradients were compared with the call's own run on the CPU, "
                           "whose backward is the same code: nothing independent checked them: "
                           "a float64 gradcheck was not run (70 floating inputs, above 64)")


@pytest.mark.slow
def test_a_causal_lms_cache_object(tmp_path: Path) -> None:
    """A transformers DynamicCache defines no ==: after a fix the replay still failed with
    "out['cache']: values differ: actual DynamicCache(...) vs expected DynamicCache(...)"."""
    pytest.importorskip("transformers")
    code = """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

        def model(state, theta):
            lm = LlamaForCausalLM(LlamaConfig(**CONFIG, rope_theta=theta)).eval()
            lm.load_state_dict(state, assign=True)
            return lm

        def run(input_ids, **state):
            out = model(state, {theta})(input_ids=input_ids, use_cache=True)
            return {{"logits": out.logits, "cache": out.past_key_values}}

        def reference(input_ids, **state):
            out = model(state, 10000.0)(input_ids=input_ids, use_cache=True)
            return {{"logits": out.logits, "cache": out.past_key_values}}
        """
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    state = transformers.LlamaForCausalLM(config).state_dict()
    inputs = {"input_ids": torch.randint(0, 64, (2, 7), generator=gen(7)), **state}
    toml = WITH_REFERENCE + "[context]\ngrad = false\n"
    found = judged(tmp_path, "llm", code.format(theta=10000.0), inputs, toml)
    assert found.status == "passed", found.details
    wrong = judged(tmp_path, "llm_rope", code.format(theta=500.0), inputs, toml)
    assert wrong.status == "failed"
    assert "out['cache'].layers[0].keys: values differ" in wrong.details


def test_the_note_is_shown_with_a_passing_item(pytester: pytest.Pytester) -> None:
    path = pytester.path / "cases" / "many"
    path.mkdir(parents=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n[expect]\n'
                                    'gradients = true\n')
    (path / "case.py").write_text("def run(**inputs):\n"
                                  "    return sum(t.sum() for t in inputs.values())\n")
    payload.save(path / "inputs.safetensors",
                 {f"x{i}": torch.randn(2, generator=gen(i)) for i in range(70)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rP", "cases")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*Captured gpucase notes call*",
                                 "the gradients were compared with the call's own run on the "
                                 "CPU, whose backward is the same code: nothing independent "
                                 "checked them*"])


# --------------------------------------------------------------------------
# Second round: judged in this process by the child's own code (no fork), each a miss of
# the OpInfo corpus (benchmarks/bench_opinfo.py) before.


def judged_here(root: Path, name: str, code: str, tensors: dict[str, torch.Tensor],
                toml: str = "", dtype: str = "float32") -> Outcome:
    """``judged``, in this process (``run.child.run``), the inputs saved in ``dtype``. The
    child's code sets what a child may (GPUCASE_REPLAY, which turns every Recorder of the
    process into a replay's; the case's folder on sys.path): put back after it, or the
    tests that run after it in this worker record nothing."""
    import os
    import sys

    from pytest_gpucase.run.child import run

    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\ntimeout = 300\n'
                                    + textwrap.dedent(toml))
    (path / "case.py").write_text(textwrap.dedent(code))
    payload.save(path / "inputs.safetensors",
                 {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                  for k, v in tensors.items()})
    for module in [m for m in sys.modules if m.startswith("gpucase_case_")]:
        del sys.modules[module]
    environ, path_before = dict(os.environ), list(sys.path)
    try:
        return run(RunSpec(load_case(path), "cpu", dtype, cast=False))
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path_before


SCALED = """
    import torch
    EPS = torch.finfo(torch.{dtype}).eps
    def reference(x):
        return {op}
    def run(x):
        return reference(x) * (1 + {k} * EPS)
    """


def test_a_narrowed_prod_far_past_its_budget_fails(tmp_path: Path) -> None:
    """A prod over 125 values of (0, 1) along a dimension is 1e-5..0.3: the default atol 1e-5
    passed any relative error of those outputs, astronomically past their budget."""
    x = {"x": torch.rand(5, 5, 5, generator=gen(1), dtype=torch.float64) * 0.9 + 0.05}
    code = SCALED.format(dtype="float32", op="torch.prod(x, 0)", k="{k}")
    assert judged_here(tmp_path, "prod", code.format(k=0), x,
                       WITH_REFERENCE).status == "passed"
    wrong = judged_here(tmp_path, "prod_64", code.format(k=64), x, WITH_REFERENCE)
    assert wrong.status == "failed", wrong.summary
    # A narrowed reduction: the last term left out.
    narrowed = judged_here(tmp_path, "prod_narrow", """
        import torch
        def reference(x):
            return torch.prod(x, 0)
        def run(x):
            return torch.prod(x[:-1], 0)
        """, x, WITH_REFERENCE)
    assert narrowed.status == "failed"


def test_a_product_the_dtype_cannot_hold_passes_as_zero(tmp_path: Path) -> None:
    """The prod of all 125 values is 1e-57: float32 holds it as 0, correctly."""
    x = {"x": torch.rand(5, 5, 5, generator=gen(1), dtype=torch.float64) * 0.9 + 0.05}
    code = SCALED.format(dtype="float32", op="torch.prod(x)", k=0)
    assert judged_here(tmp_path, "prod_all", code, x).status == "passed"


@pytest.mark.parametrize("op", ["torch.softmax(x, -1)", "x.mean(-1)", "torch.cumprod(x, -1)",
                                "torch.tanh(x)"])
def test_a_float32_output_scaled_by_64_eps_fails(tmp_path: Path, op: str) -> None:
    """128 units of roundoff of the output everywhere: past what rounding of these
    computations gives (the rule of docs/verdicts.md), though within atol 1e-5."""
    x = {"x": torch.rand(8, 16, generator=gen(2), dtype=torch.float64) * 2 - 1}
    code = SCALED.format(dtype="float32", op=op, k="{k}")
    right = judged_here(tmp_path, "right", code.format(k=0), x, WITH_REFERENCE)
    assert right.status == "passed", right.details
    wrong = judged_here(tmp_path, "wrong", code.format(k=64), x, WITH_REFERENCE)
    assert wrong.status == "failed", wrong.summary


def test_exact_bfloat16_inputs_are_not_a_rounding_source(tmp_path: Path) -> None:
    """bfloat16 inputs are read as themselves by the call and its float64 reference: the
    budget of exp on [7, 9] grew with exp's conditioning (9 u for a 1 u change of its input)
    and passed an output 20% too large; amax, exact, passed a 5% error."""
    x = {"x": torch.rand(64, generator=gen(3), dtype=torch.float64) * 2 + 7}
    exp = SCALED.format(dtype="bfloat16", op="torch.exp(x)", k="{k}").replace(
        "* (1 + {k} * EPS)", "* {k}")
    assert judged_here(tmp_path, "exp", exp.format(k=1), x, WITH_REFERENCE,
                       "bfloat16").status == "passed"
    assert judged_here(tmp_path, "exp_20", exp.format(k=1.2), x, WITH_REFERENCE,
                       "bfloat16").status == "failed"
    amax = SCALED.format(dtype="bfloat16", op="torch.amax(x.reshape(8, 8), 1)",
                         k="{k}").replace("* (1 + {k} * EPS)", "* {k}")
    x = {"x": torch.randn(64, generator=gen(4), dtype=torch.float64)}
    assert judged_here(tmp_path, "amax", amax.format(k=1), x, WITH_REFERENCE,
                       "bfloat16").status == "passed"
    assert judged_here(tmp_path, "amax_5", amax.format(k=1.05), x, WITH_REFERENCE,
                       "bfloat16").status == "failed"


def test_one_large_element_does_not_widen_the_others(tmp_path: Path) -> None:
    """exp on [-1, 9] in bfloat16: the spread at 8103 is 30; an element of 0.4 wrong by 100%
    hid under 8 x 30 when one figure held the whole tensor."""
    x = {"x": torch.linspace(-1, 9, 64, dtype=torch.float64)}
    code = """
        import torch
        def reference(x):
            return torch.exp(x)
        def run(x):
            out = torch.exp(x)
            out[{i}] *= 2
            return out
        """
    wrong = judged_here(tmp_path, "exp_one", code.format(i=0), x, WITH_REFERENCE, "bfloat16")
    assert wrong.status == "failed"


WRONG_BACKWARD = """
    import torch
    import torch.nn.functional as F

    def correct(x, target=None):
        return {op}

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, target):
            ctx.save_for_backward(x, target)
            return correct(x, target)

        @staticmethod
        def backward(ctx, grad):
            x, target = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                (found,) = torch.autograd.grad(correct(x, target), x, grad)
            return found * {factor}, None

    def run(x, target=None):
        return Wrong.apply(x, target)
    """
BACKWARD_OPS = {
    "softmax": ("torch.softmax(x, -1)", {}),
    "tanh": ("torch.tanh(x)", {}),
    "layer_norm": ("F.layer_norm(x, x.shape[-1:])", {}),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(BACKWARD_OPS))
def test_a_backward_one_percent_off_fails_without_a_reference(tmp_path: Path, name: str,
                                                              dtype: str) -> None:
    """Fast gradcheck held products of size 1e-4 to atol 1e-5: a custom backward of softmax
    10% off passed it. The check along random directions holds them to 1e-3 relative."""
    op, _ = BACKWARD_OPS[name]
    x = {"x": torch.randn(5, 10, generator=gen(5), dtype=torch.float64)}
    right = judged_here(tmp_path, "right", WRONG_BACKWARD.format(op=op, factor=1.0), x,
                        GRADIENTS, dtype)
    assert right.status == "passed", right.summary
    wrong = judged_here(tmp_path, "wrong", WRONG_BACKWARD.format(op=op, factor=1.01), x,
                        GRADIENTS, dtype)
    assert wrong.status == "failed"
    assert "by the backward (analytical)" in wrong.summary
    assert "by central differences of the forward (numerical" in wrong.summary


def test_a_cross_entropy_backward_one_percent_off_fails(tmp_path: Path) -> None:
    x = {"x": torch.randn(6, 10, generator=gen(6), dtype=torch.float64),
         "target": torch.randint(0, 10, (6,), generator=gen(6))}
    code = WRONG_BACKWARD.format(op="F.cross_entropy(x, target)", factor="{factor}")
    right = judged_here(tmp_path, "right", code.format(factor=1.0), x, GRADIENTS)
    assert right.status == "passed", right.summary
    wrong = judged_here(tmp_path, "wrong", code.format(factor=1.01), x, GRADIENTS)
    assert wrong.status == "failed", wrong.summary


def test_a_pass_within_a_budget_records_it_for_the_report(tmp_path: Path) -> None:
    """The JSON report said "outputs match the reference" of a clean pass and of one resting
    on a wide budget alike: each output judged by its budget is now recorded."""
    from pytest_gpucase.run.isolation.wire import decode, encode

    x = {"x": torch.rand(8, 16, generator=gen(2), dtype=torch.float64) * 2 - 1}
    clean = judged_here(tmp_path, "clean", SCALED.format(dtype="float32", op="torch.tanh(x)",
                                                         k=0), x, WITH_REFERENCE)
    assert clean.status == "passed" and clean.budgets == ()
    layer_norm = {"x": 1e3 + torch.randn(4, 64, generator=gen(3), dtype=torch.float64)}
    wide = judged_here(tmp_path, "wide", """
        import torch
        def run(x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:])
        """, layer_norm, dtype="bfloat16")
    assert wide.status == "passed"
    (found,) = wide.budgets
    assert found["path"] == "out" and found["precision"] == "bfloat16"
    assert found["multiplier"] == 4.0 and 0 <= found["ratio"] <= 1
    assert found["wide"] is True and found["rule_units"] > 32
    assert decode(json.loads(json.dumps(encode(wide)))).budgets == wide.budgets


def test_the_gradient_check_allows_for_its_own_step_near_a_pole(tmp_path: Path) -> None:
    """tan of a value 1e-5 from its pole: central differences with a step of 1e-6 are off
    by 1% there (their error grows as the step squared), which the check measures at twice
    the step."""
    near = torch.linspace(-1.5, 1.5, 40, dtype=torch.float64)
    near[7] = math.pi / 2 - 1e-5
    x = {"x": near.reshape(4, 10)}
    code = """
        import torch
        def run(x):
            return torch.tan(x)
        """
    found = judged_here(tmp_path, "tan", code, x, GRADIENTS)
    assert found.status == "passed", found.summary


def test_the_json_report_carries_each_budget(pytester: pytest.Pytester) -> None:
    """A pass resting on a wide budget, told apart from a clean one in the JSON report."""
    from pytest_gpucase.report.file import load_report

    for name, values in (("clean", torch.randn(4, 64, generator=gen(3), dtype=torch.float64)),
                         ("wide", 1e3 + torch.randn(4, 64, generator=gen(3),
                                                    dtype=torch.float64))):
        path = pytester.path / "cases" / name
        path.mkdir(parents=True)
        (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                        '[matrix]\ndtypes = ["bfloat16"]\n')
        (path / "case.py").write_text("import torch\ndef run(x):\n"
                                      "    return torch.nn.functional.layer_norm(x, (64,))\n")
        payload.save(path / "inputs.safetensors", {"x": values.to(torch.bfloat16)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-cases-report", "report.json", "cases")
    result.assert_outcomes(passed=2)
    found = {r["case"]: r for r in load_report(pytester.path / "report.json")["results"]}
    assert found["clean"].get("budgets", []) == []
    (wide,) = found["wide"]["budgets"]
    assert wide["path"] == "out" and wide["wide"] is True and wide["ratio"] <= 1


RANGE_OPS = {
    # A float16 result past 65504: exp of 12 is 162755.
    "exp": ("torch.exp(x)", torch.linspace(8, 12, 16, dtype=torch.float64), ""),
    # The same in an intermediate: a naive softmax's exp(12), though the result is in range.
    "naive softmax": ("torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)",
                      torch.linspace(-4, 12, 32, dtype=torch.float64).reshape(4, 8), ""),
    # tan's gradient 1 / cos^2 near pi/2 is 4e5.
    "tan gradient": ("torch.tan(x)", torch.linspace(1.0, 1.569, 16, dtype=torch.float64),
                     GRADIENTS),
}


@pytest.mark.parametrize("name", sorted(RANGE_OPS))
def test_an_overflow_of_the_dtype_fails_as_an_overflow(tmp_path: Path, name: str) -> None:
    """A float16 run infinite or NaN where the float64 reference is finite, because a value
    of the computation is past 65504: a failure of its own class, with the fix, not a plain
    mismatch."""
    op, x, toml = RANGE_OPS[name]
    code = f"import torch\ndef run(x):\n    return {op}\n"
    found = judged_here(tmp_path, "over", code, {"x": x}, toml, "float16")
    assert found.status == "failed" and found.kind == "mismatch"
    assert found.verdict_class == "overflow", found.summary
    assert "(overflow)" in found.summary
    assert "compute that part in float32" in found.details
    # The same code on values the dtype holds throughout passes, and names no class.
    fine = judged_here(tmp_path, "fine", code, {"x": x - 8}, toml, "float16")
    assert fine.status == "passed" and fine.verdict_class == "", fine.summary


RMS_NORM = """
    import torch
    def run(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + {eps})
    """


@pytest.mark.parametrize("eps", ["1e-12", "0.0"])
def test_an_underflow_of_the_dtype_fails_as_an_underflow(tmp_path: Path, eps: str) -> None:
    """A hand-written RMS norm of values near 3e-4 in float16: their squares (1e-7) are
    subnormal or 0 there. With eps 0 the run divides by 0; with 1e-12 (0 in float16) it was
    11% off everywhere and passed, within a budget the underflow itself widened, with a note
    blaming rounding."""
    x = {"x": torch.randn(4, 64, generator=gen(7), dtype=torch.float64) * 3e-4}
    found = judged_here(tmp_path, "rms", RMS_NORM.format(eps=eps), x, dtype="float16")
    assert found.status == "failed", found.summary
    assert found.verdict_class == "underflow", found.summary
    assert "holds as a subnormal or 0" in found.details
    assert not any("passed within a rounding budget" in note for note in found.notes)


def test_what_the_dtype_holds_is_no_range_failure(tmp_path: Path) -> None:
    """The same RMS norm of values near 1e-3 (squares of 1e-6, normal in float16), and
    torch's fused rms_norm (its kernel squares in float32) of values near 3e-4, pass."""
    small = {"x": torch.randn(4, 64, generator=gen(7), dtype=torch.float64) * 3e-4}
    larger = {"x": small["x"] * 4}
    found = judged_here(tmp_path, "rms", RMS_NORM.format(eps="1e-12"), larger,
                        dtype="float16")
    assert found.status == "passed", found.summary
    fused = judged_here(tmp_path, "fused", """
        import torch
        def run(x):
            return torch.nn.functional.rms_norm(x, x.shape[-1:], eps=1e-12)
        """, small, dtype="float16")
    assert fused.status == "passed", fused.summary


@pytest.mark.slow
def test_the_json_report_names_the_class(pytester: pytest.Pytester) -> None:
    from pytest_gpucase.report.file import load_report

    for name, values in (("over", torch.linspace(8, 12, 16, dtype=torch.float64)),
                         ("wrong", torch.linspace(0, 1, 16, dtype=torch.float64))):
        path = pytester.path / "cases" / name
        path.mkdir(parents=True)
        (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                        'reference = "case.py:reference"\n'
                                        '[matrix]\ndtypes = ["float16"]\n')
        (path / "case.py").write_text("import torch\ndef run(x):\n    return torch.exp(x)\n"
                                      "def reference(x):\n    return torch.exp(x) * "
                                      f"{1.0 if name == 'over' else 1.1}\n")
        payload.save(path / "inputs.safetensors", {"x": values.to(torch.float16)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu",
                                           "--gpu-cases-report", "report.json", "cases")
    result.assert_outcomes(failed=2)
    found = {r["case"]: r for r in load_report(pytester.path / "report.json")["results"]}
    assert found["over"]["class"] == "overflow"
    assert found["wrong"]["class"] == "mismatch"


class _WrongSquare(torch.autograd.Function):
    """z * z with a backward 10% off."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        return z * z

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * (2 * z).conj() * 1.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_a_gradient_check_failure_gives_all_four_figures(dtype: torch.dtype) -> None:
    """Each failure of the gradient check gives the analytical and the numerical value, the
    tolerance and the sizes: the complex path (torch's gradcheck) said only "numerical: x"
    and "analytical: y"."""
    from pytest_gpucase.run.second_look import gradient_check

    z = torch.randn(3, 4, generator=gen(8), dtype=dtype)
    problem = gradient_check(lambda inputs: _WrongSquare.apply(inputs["z"]), {"z": z}, ["z"],
                             None, 1e-4)
    assert problem is not None
    assert "by the backward (analytical)" in problem and "(numerical" in problem
    assert "apart, past the tolerance" in problem
    assert "z has 12 elements, the outputs 12" in problem
    assert gradient_check(lambda inputs: inputs["z"] * inputs["z"], {"z": z}, ["z"], None,
                          1e-4) is None


def test_one_element_of_a_bfloat16_matmul_off_fails(tmp_path: Path) -> None:
    """The largest element of a 5 x 5 bfloat16 matmul off by 10% of the output's RMS (13
    roundings of that element): within the default rtol (8 roundings) plus the budget of a
    sum of products (as much again) added up, it passed; it is past either alone."""
    g = gen(0)
    x = {"a": torch.rand(5, 5, generator=g, dtype=torch.float64) * 18 - 9,
         "b": torch.rand(5, 5, generator=g, dtype=torch.float64) * 18 - 9}
    code = """
        import torch
        def reference(a, b):
            return torch.mm(a, b)
        def run(a, b):
            out = reference(a, b).clone()
            flat = out.view(-1)
            flat[int(flat.double().abs().argmax())] += {k} * float(
                out.double().square().mean().sqrt())
            return out
        """
    right = judged_here(tmp_path, "right", code.format(k=0), x, WITH_REFERENCE, "bfloat16")
    assert right.status == "passed", right.summary
    wrong = judged_here(tmp_path, "wrong", code.format(k=0.1), x, WITH_REFERENCE, "bfloat16")
    assert wrong.status == "failed", wrong.summary


@pytest.mark.slow
@pytest.mark.parametrize("op", ["torch.cumsum(x, 0)", "torch.nn.functional.avg_pool2d(x, 3)"])
def test_one_element_off_in_a_bf16_reduction(tmp_path: Path, op: str) -> None:
    """A bfloat16 cumsum or average pool adds up in float32 and rounds only its result: its
    budget no longer rounds its operands once more, so its largest element 10% of the RMS
    off (10 to 20 units of that element's roundoff) fails (the cumsum's passed before, on
    these inputs drawn as OpInfo's are); the correct op still passes."""
    x = (torch.rand(5, 5, 5, generator=gen(2)) * 18 - 9).to(torch.bfloat16)  # as OpInfo's
    correct = f"import torch\ndef run(x):\n    return {op}\ndef reference(x):\n    return {op}\n"
    wrong = variant(correct, f"def run(x):\n    return {op}\n",
                    f"def run(x):\n    out = {op}.clone()\n    flat = out.view(-1)\n"
                    "    i = int(flat.double().abs().argmax())\n"
                    "    flat[i] += 0.1 * float(out.double().square().mean().sqrt())\n"
                    "    return out\n")
    name = op.split("(")[0].rsplit(".", 1)[-1]
    assert judged(tmp_path, name, correct, {"x": x}, dtype="bfloat16",
                  cast=False).status == "passed"
    found = judged(tmp_path, f"{name}_wrong", wrong, {"x": x}, WITH_REFERENCE,
                   dtype="bfloat16", cast=False)
    assert found.status == "failed", found.summary

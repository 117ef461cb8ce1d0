"""The rules of the second look (verdict/rounding.py), on real tensors: the rounding budget,
the run's precision, and a device run held to the CPU's own error in the same dtype."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_gpucase.verdict.compare import compare
from pytest_gpucase.verdict.rounding import (
    HeldAsStored,
    BASELINE_MULTIPLE,
    MULTIPLIER,
    RoundEveryOp,
    baseline_problem,
    Budget,
    coarser,
    perturbed,
    spread,
    unit_roundoff,
)
from pytest_gpucase.verdict.tolerance import DEFAULT_TOLERANCES, Tolerance

GEN = torch.Generator


class Look:
    """A second look with known spreads and baselines, and a record of what was asked."""

    def __init__(self, spreads: dict[str, tuple[float, float]], precision: torch.dtype,
                 baselines: dict[str, object] | None = None) -> None:
        self.spreads, self.precision, self.baselines = spreads, precision, baselines or {}
        self.asked: list[str] = []

    def budget(self, path: str) -> Budget | None:
        self.asked.append(path)
        found = self.spreads.get(path)
        return None if found is None else Budget(*found, self.precision)

    def baseline(self, path: str) -> object | None:
        return self.baselines.get(path)


def matmul_case(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 operands of size ~1e3 with symmetric signs, and their float64 product."""
    gen = GEN().manual_seed(0)
    a = ((torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1) * 1e3).float()
    b = ((torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1) * 1e3).float()
    return a, b


def test_a_device_result_ten_times_worse_than_the_cpus_fails() -> None:
    """The rule the issue states, decided by the function that decides it: the CPU's own
    float32 matmul is the baseline; a result with 10x its error fails, 2x passes."""
    a, b = matmul_case()
    expected = a.double() @ b.double()
    cpu = a @ b
    error = cpu.double() - expected
    assert baseline_problem(cpu, expected, cpu, torch.float32) is None
    twice = (expected + 2 * error).float()
    assert baseline_problem(twice, expected, cpu, torch.float32, "cuda") is None
    worse = (expected + 10 * error).float()
    problem = baseline_problem(worse, expected, cpu, torch.float32, "cuda")
    assert problem is not None
    assert problem.startswith("cuda's greatest error against the float64 reference is 10")
    assert f"at most {BASELINE_MULTIPLE:g} times" in problem


def test_the_baseline_rule_in_bfloat16() -> None:
    gen = GEN().manual_seed(1)
    x = torch.randn(64, 256, generator=gen).bfloat16()
    expected = torch.softmax(x.double(), -1)
    cpu = torch.softmax(x, -1)
    error = cpu.double() - expected
    assert baseline_problem(cpu, expected, cpu, torch.bfloat16) is None
    worse = expected + 10 * error  # held in float64: exactly ten times the CPU's error
    assert baseline_problem(worse, expected, cpu, torch.bfloat16) is not None


def test_an_exact_baseline_allows_one_unit_in_the_last_place() -> None:
    expected = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    exact = expected.float()
    one_ulp = torch.tensor([1.0, 2.0, math.nextafter(4.0, 5.0)]).float()
    assert baseline_problem(one_ulp, expected, exact, torch.float32) is None
    assert baseline_problem(exact + 1e-3, expected, exact, torch.float32) is not None


def test_the_budget_widens_atol_only_and_refuses_an_unstable_reference() -> None:
    default = DEFAULT_TOLERANCES[torch.float32]
    widened = Budget(2.0, 0.5, torch.float32).tolerance(default)
    assert widened is not None
    assert (widened.atol, widened.rtol) == (MULTIPLIER[torch.float32] * 2.0, default.rtol)
    assert "rounding budget 16 x 2" in widened.source
    assert Budget(math.inf, math.inf, torch.float32).tolerance(default) is None
    tiny = Budget(1e-9, 1e-9, torch.float32).tolerance(default)
    assert tiny is not None and tiny.atol == default.atol


def test_a_leaf_past_its_default_gets_the_budget() -> None:
    a, b = matmul_case()
    expected = a.double() @ b.double()
    actual = a @ b
    assert not compare(actual, expected, check_dtype=False).ok  # the false alarm of old
    look = Look({"out": (40.0, 10.0)}, torch.float32)
    assert compare(actual, expected, check_dtype=False, second_look=look).ok
    assert look.asked == ["out"]
    scaled = actual * 1.01  # a 1% scale error
    result = compare(scaled, expected, check_dtype=False, second_look=look)
    (mismatch,) = result.mismatches
    assert "atol widened to the rounding budget 16 x 40" in mismatch.message
    assert mismatch.mismatched > 0.9 * actual.numel()


def test_non_finite_mismatches_and_explicit_tolerances_get_no_second_look() -> None:
    expected = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    look = Look({"out": (1e9, 1e9)}, torch.float32)
    nan = torch.tensor([1.0, math.nan, 3.0])
    assert not compare(nan, expected, check_dtype=False, second_look=look).ok
    inf = torch.tensor([1.0, 2.0, math.inf])
    assert not compare(inf, expected, check_dtype=False, second_look=look).ok
    off = torch.tensor([1.0, 2.5, 3.0])
    stated = {torch.float32: Tolerance(rtol=0.0, atol=1e-3, source="case.toml")}
    assert not compare(off, expected, tolerances=stated, check_dtype=False,
                       second_look=look).ok
    assert look.asked == []


def test_a_device_leaf_is_held_to_the_cpus_own_error() -> None:
    a, b = matmul_case()
    expected = a.double() @ b.double()
    cpu = a @ b
    error = cpu.double() - expected
    generous = Look({"out": (1e6, 1e6)}, torch.float32, {"out": cpu})
    worse = (expected + 10 * error).float()
    assert compare(worse, expected, check_dtype=False, second_look=generous).ok  # on the CPU
    (mismatch,) = compare(worse, expected, check_dtype=False, second_look=generous,
                          device="cuda").mismatches
    assert "cuda's greatest error against the float64 reference is 10" in mismatch.message
    like_cpu = (expected + 1.5 * error).float()
    assert compare(like_cpu, expected, check_dtype=False, second_look=generous,
                   device="cuda").ok
    # A computation the budget underrates (the CPU's own result is past it too): the device
    # run is held to the CPU's error alone.
    stingy = Look({"out": (1e-6, 1e-6)}, torch.float32, {"out": cpu})
    assert compare(like_cpu, expected, check_dtype=False, second_look=stingy,
                   device="cuda").ok
    assert not compare(like_cpu, expected, check_dtype=False, second_look=stingy).ok


def test_numbers_from_a_low_precision_run_are_judged_at_its_precision() -> None:
    """loss.item() of a bfloat16 run was judged at float64's 1e-7; the same value as a
    bfloat16 tensor passed."""
    gen = GEN().manual_seed(2)
    x = torch.randn(4096, generator=gen).bfloat16()
    loss = (x * x).mean()
    expected = float((x.double() * x.double()).mean())
    assert not compare(float(loss), expected).ok
    assert compare(float(loss), expected, precision=torch.bfloat16).ok
    assert compare(loss, torch.tensor(expected, dtype=torch.float64), check_dtype=False).ok
    # A float32 0-d tensor from a bfloat16 run too, and its message says why.
    as_float = loss.float()
    assert compare(as_float, torch.tensor(expected, dtype=torch.float64), check_dtype=False,
                   precision=torch.bfloat16).ok
    far = compare(as_float + 1.0, torch.tensor(expected, dtype=torch.float64),
                  check_dtype=False, precision=torch.bfloat16)
    assert "(bfloat16 defaults: the run's precision)" in far.report()
    # A tolerance stated for float64 is applied to numbers as stated.
    stated = {torch.float64: Tolerance(rtol=0.0, atol=1e-9, source="case.toml")}
    assert not compare(float(loss), expected, tolerances=stated, precision=torch.bfloat16).ok


def test_coarser_and_unit_roundoff() -> None:
    assert coarser(torch.float32, torch.bfloat16) == torch.bfloat16
    assert coarser(torch.float16, torch.float32) == torch.float16
    assert coarser(torch.complex64, torch.bfloat16) == torch.bfloat16
    assert coarser(torch.float64, None) == torch.float64
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert unit_roundoff(torch.float32) == 2.0 ** -24


def test_round_every_op_rounds_results_and_leaves_views_and_integers() -> None:
    x = torch.linspace(1, 2, 64, dtype=torch.float64)
    with RoundEveryOp(1e-3, GEN().manual_seed(0)):
        summed = x + 1.0
        view = x.view(8, 8)
        counted = torch.arange(8) * 3
        acc = torch.zeros(64, dtype=torch.float64)
        acc += x
    assert not torch.equal(summed, x + 1.0)
    assert float((summed - (x + 1.0)).abs().max()) < 1e-2
    assert view.data_ptr() == x.data_ptr() and torch.equal(view.reshape(-1), x)
    assert torch.equal(counted, torch.arange(8) * 3)
    assert not torch.equal(acc, x)  # an in-place result is rounded where it is written


def test_fused_normalizations_are_rounded_by_their_parts() -> None:
    """A layer norm of 1e3 + N(0, 1) loses float32 digits in x - mean, inside the fused op:
    rounding only the fused op's output would see a change the size of the output's last
    place; its decomposition, each part rounded, sees the cancellation."""
    x = 1e3 + torch.randn(32, 256, generator=GEN().manual_seed(0), dtype=torch.float64)
    expected = torch.nn.functional.layer_norm(x, (256,))
    u = unit_roundoff(torch.float32)
    with RoundEveryOp(u, GEN().manual_seed(1)):
        drawn = torch.nn.functional.layer_norm(x, (256,))
    greatest, _ = spread(expected, drawn)
    assert greatest > 100 * u * float(expected.abs().max())  # about u * 1e3, not u * |out|
    assert greatest < 1e-2


def test_low_precision_fused_ops_round_only_what_they_read_and_write() -> None:
    """A bfloat16 kernel keeps a softmax's intermediate values in float32: at bfloat16's
    precision the fused op is rounded as one, where at float32's it runs as its parts."""
    x = 3 * torch.randn(16, 256, generator=GEN().manual_seed(0), dtype=torch.float64)
    assert RoundEveryOp(unit_roundoff(torch.float32), GEN()).decomposed
    low = {str(op) for op in RoundEveryOp(unit_roundoff(torch.bfloat16), GEN()).decomposed}
    assert low and all("batch_norm" in name for name in low), low  # its CPU kernel's mean
    calls: list[str] = []

    class Seen(RoundEveryOp):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    for dtype in (torch.bfloat16, torch.float32):
        calls.clear()
        with Seen(unit_roundoff(dtype), GEN().manual_seed(0)):
            torch.softmax(x, -1)
        parts = {name.split(".")[0] for name in calls}
        assert ("exp" in parts) == (dtype == torch.float32), (dtype, parts)


def test_infinities_stay_infinite_when_rounded() -> None:
    """A masked attention score is -inf: rounding it must not make inf - inf = NaN, in the
    scores or inside softmax's decomposition (x - max)."""
    scores = torch.tensor([[0.5, float("-inf"), 1.0], [float("-inf"), 2.0, 0.0]],
                          dtype=torch.float64)
    expected = torch.softmax(scores, -1)
    gen = GEN().manual_seed(0)
    for _ in range(8):
        with RoundEveryOp(1e-2, gen):
            drawn = torch.softmax(perturbed(scores, 1e-2, gen), -1)
        assert math.isfinite(spread(expected, drawn)[0])
        assert bool((drawn[expected == 0] == 0).all())


def test_perturbed_inputs_keep_integers_and_grad_flags() -> None:
    gen = GEN().manual_seed(0)
    inputs = {"x": torch.ones(4, dtype=torch.float64, requires_grad=True),
              "index": torch.arange(4), "scale": 2.0,
              "params": {"w": torch.ones(2, dtype=torch.float64)}}
    found = perturbed(inputs, 1e-3, gen)
    assert found["x"].requires_grad and not torch.equal(found["x"], inputs["x"])
    assert found["index"] is inputs["index"] and found["scale"] == 2.0
    assert not torch.equal(found["params"]["w"], inputs["params"]["w"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_wrong_formula_in_low_precision_is_past_the_budget(dtype: torch.dtype) -> None:
    """A softmax over the wrong dimension: wrong by the output's own size, far past what one
    rounding of every value at this precision moves the reference."""
    gen = GEN().manual_seed(3)
    x = torch.randn(64, 64, generator=gen).to(dtype)
    expected = torch.softmax(x.double(), -1)
    u = unit_roundoff(dtype)
    greatest = mean_square = 0.0
    for seed in (1, 2):
        generator = GEN().manual_seed(seed)
        with RoundEveryOp(u, generator):
            drawn = torch.softmax(perturbed(x.double(), u, generator), -1)
        found = spread(expected, drawn)
        greatest, mean_square = max(greatest, found[0]), mean_square + found[1] ** 2 / 2
    look = Look({"out": (greatest, math.sqrt(mean_square))}, dtype)
    assert compare(torch.softmax(x, -1), expected, check_dtype=False, second_look=look).ok
    wrong = compare(torch.softmax(x, 0), expected, check_dtype=False, second_look=look)
    assert not wrong.ok
    # Wrong by about the output's own size everywhere: past the budget's RMS, if not past
    # its greatest change at every element.
    assert "wrong by a little everywhere is not rounding" in wrong.report() or (
        "atol widened to the rounding budget" in wrong.report())


# --------------------------------------------------------------------------
# Second round: exact inputs, a clean pass, the budget of each element.


def test_values_the_run_holds_exactly_are_not_perturbed() -> None:
    """A bfloat16 input read by the call and, upcast, by its reference is no rounding
    source: only the values the run's precision cannot hold are perturbed."""
    exact = torch.randn(1000, generator=GEN().manual_seed(0)).to(torch.bfloat16).double()
    assert torch.equal(perturbed(exact, unit_roundoff(torch.bfloat16), GEN().manual_seed(1),
                                 torch.bfloat16), exact)
    finer = exact + 1e-6  # not a bfloat16 value
    moved = perturbed(finer, unit_roundoff(torch.bfloat16), GEN().manual_seed(1),
                      torch.bfloat16)
    assert bool((moved != finer).all())
    # Without the run's precision, every value is perturbed, as before.
    assert not torch.equal(perturbed(exact, unit_roundoff(torch.bfloat16), GEN().manual_seed(1)),
                           exact)


def test_an_exact_operation_is_not_rounded() -> None:
    """amax of bfloat16 values is one of them: a bfloat16 amax makes that very value."""
    x = torch.randn(8, 8, generator=GEN().manual_seed(0)).to(torch.bfloat16).double()
    u = unit_roundoff(torch.bfloat16)
    with RoundEveryOp(u, GEN().manual_seed(1), torch.bfloat16):
        top = torch.amax(x, 1)
        grown = torch.exp(x)
    assert torch.equal(top, torch.amax(x, 1))
    assert not torch.equal(grown, torch.exp(x))  # exp of a bfloat16 value is not one


def test_a_small_output_wrong_everywhere_gets_the_second_look() -> None:
    """An output of size 1e-3 scaled by 1 + 64 eps is within atol 1e-5 everywhere: it passed
    without a second look, whatever its budget."""
    expected = torch.rand(64, generator=GEN().manual_seed(0), dtype=torch.float64) * 1e-3
    actual = (expected * (1 + 64 * torch.finfo(torch.float32).eps)).float()
    assert compare(actual, expected, check_dtype=False).ok  # the default table alone
    u = unit_roundoff(torch.float32)
    look = Look({"out": (u * 1e-3, u * 6e-4)}, torch.float32)
    found = compare(actual, expected, check_dtype=False, precision=torch.float32,
                    second_look=look)
    assert not found.ok and look.asked == ["out"]
    assert "values differ by a little everywhere" in found.report()
    # Within a few roundings it passes at once, asking for no budget.
    near = (expected * (1 + 2 * torch.finfo(torch.float32).eps)).float()
    look = Look({}, torch.float32)
    assert compare(near, expected, check_dtype=False, precision=torch.float32,
                   second_look=look).ok and look.asked == []


def test_each_element_is_held_to_the_spread_of_elements_of_its_size() -> None:
    """One large element's spread no longer widens the allowance of the small ones."""
    expected = torch.exp(torch.linspace(-1, 9, 64, dtype=torch.float64))
    u = unit_roundoff(torch.bfloat16)
    spreads = expected * u  # one rounding of each
    budget = Budget(float(spreads.max()), float(spreads.square().mean().sqrt()),
                    torch.bfloat16, spreads)
    allowed = budget.allowance(expected)
    assert allowed is not None
    assert float(allowed[0]) < 0.1 * float(expected[0])  # the smallest: a few roundings
    assert float(allowed[-1]) == pytest.approx(budget.multiplier * float(spreads.max()))
    # The smallest SHARED elements share their spread, so that one near-zero draw is covered.
    assert bool((allowed[:8] >= budget.multiplier * spreads[7]).all())


@pytest.mark.slow
def test_a_budget_draw_imports_no_dynamo_in_a_fresh_process() -> None:
    """torch wrapped the mode's __torch_dispatch__ in torch._disable_dynamo, whose first call
    imported torch._dynamo: 2 s paid again by every forked child that made a budget."""
    import subprocess
    import sys

    code = ("import sys, time, torch\n"
            "import pytest_gpucase.run.child\n"
            "from pytest_gpucase.verdict.rounding import RoundEveryOp\n"
            "began = time.perf_counter()\n"
            "for precision in (torch.bfloat16, torch.float32):\n"
            "    with RoundEveryOp(1e-3, torch.Generator().manual_seed(0), precision):\n"
            "        torch.softmax(torch.ones(3, 4, dtype=torch.float64), -1).sum()\n"
            "print('torch._dynamo' in sys.modules, time.perf_counter() - began)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    imported, seconds = done.stdout.split()
    assert imported == "False"
    assert float(seconds) < 1.0  # 2.2 s with the import


def test_a_result_past_the_dtypes_range_is_said_to_be_an_overflow() -> None:
    """exp(12) is 1.6e5, past float16's 65504: the run's inf is the dtype's limit, not a
    rounding, and the failure says so."""
    expected = torch.exp(torch.tensor([1.0, 12.0], dtype=torch.float64))
    actual = expected.to(torch.float16)
    found = compare(actual, expected, check_dtype=False, precision=torch.float16)
    assert not found.ok
    assert "float16 cannot hold the result: the reference reaches 1.628e+05" in found.report()
    scalar = compare(float("inf"), 1e39, precision=torch.float32)
    assert "cannot hold" not in scalar.report()  # a Python float is float64: it can


def test_an_underflow_is_in_the_budget() -> None:
    """A float16 value below its smallest normal keeps only its subnormal spacing: the draws
    round it so, where a relative rounding showed nothing."""
    x = torch.tensor([2e-9, 1.0], dtype=torch.float64)
    with RoundEveryOp(0.0, GEN().manual_seed(0), torch.float16):
        y = x * 1.0
    assert float(y[0]) in (0.0, float(torch.tensor(2e-9).to(torch.float16)))
    assert float(y[1]) == 1.0


def test_the_range_of_a_dtype_without_its_rounding() -> None:
    """Under HeldAsStored a float64 computation keeps every value it can hold exactly, and
    stores the rest as float16's range does; the first operations that lost a value are
    named."""
    x = torch.tensor([1e-4, 0.1, 300.0], dtype=torch.float64)
    mode = HeldAsStored(torch.float16)
    with mode:
        squared = x * x
        total = squared.sum()
    assert float(squared[1]) == pytest.approx(0.01, rel=1e-15)  # not rounded to float16
    assert float(squared[0]) in (0.0, float(torch.tensor(1e-8).to(torch.float16)))
    assert math.isinf(float(squared[2])) and math.isinf(float(total))
    assert list(mode.events) == ["overflow", "underflow"]  # in one operation: overflow first
    assert mode.events["overflow"].op == "aten::mul" and mode.events["overflow"].value == 9e4
    with HeldAsStored(torch.float32) as wide:
        assert float((x * x)[0]) == pytest.approx(1e-8, rel=1e-15)
    assert not wide.events


def test_an_autocast_reference_is_rounded_as_the_run_holds_each_value() -> None:
    """Under autocast a run holds a matmul's result in bfloat16 and a residual add of it to
    a float32 stream in float32: the float32 reference's draw rounds the first at bfloat16's
    precision (its float32 operands too: autocast's cast rounds them) and leaves the float32
    operations and the inputs as the reference computes them."""
    g = GEN().manual_seed(0)
    x = torch.randn(8, 32, generator=g)
    w = torch.randn(32, 32, generator=g)
    u = unit_roundoff(torch.bfloat16)

    def model(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.nn.functional.layer_norm(x, (32,))
        projected = stream @ w
        return projected, stream + projected.float()

    expected = model(x, w)
    with RoundEveryOp(u, GEN().manual_seed(1), torch.bfloat16, autocast=torch.bfloat16):
        projected, summed = model(x, w)
        norm_only = torch.nn.functional.layer_norm(x, (32,))
    assert torch.equal(norm_only, torch.nn.functional.layer_norm(x, (32,)))  # float32 held
    moved = float((projected - expected[0]).abs().max() / expected[0].abs().max())
    assert 0.1 * u < moved < 50 * u  # the casts and the result, at bfloat16's precision
    # the add is float32 in the run: the draw moves it only by what the matmul moved
    assert torch.allclose(summed - projected, expected[1] - expected[0], atol=1e-5)
    # the same in a run all in bfloat16 rounds the float32 work too
    with RoundEveryOp(u, GEN().manual_seed(1), torch.bfloat16):
        assert not torch.equal(torch.nn.functional.layer_norm(x, (32,)), norm_only)


def test_a_bf16_batch_norm_over_two_samples_is_within_its_budget() -> None:
    """The CPU's bfloat16 batch norm keeps the batch mean in bfloat16: two samples one unit
    apart make an output 19% off the exact one, which the draws now round too (7 false
    alarms in 20 seeds before)."""
    g = GEN().manual_seed(0)
    x = torch.randn(2, 64, generator=g, dtype=torch.float64).bfloat16()
    weight = (0.5 + torch.rand(64, generator=g, dtype=torch.float64)).bfloat16()
    bias = torch.randn(64, generator=g, dtype=torch.float64).bfloat16()

    def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.batch_norm(x, None, None, w, b, training=True)

    actual = norm(x, weight, bias)
    expected = norm(x.double(), weight.double(), bias.double())
    u = unit_roundoff(torch.bfloat16)
    drawn = []
    for seed in range(2):
        with RoundEveryOp(u, GEN().manual_seed(seed), torch.bfloat16):
            drawn.append(norm(x.double(), weight.double(), bias.double()))
    spreads = torch.stack([(d - expected).abs() for d in drawn]).amax(0)
    worst = int((actual.double() - expected).abs().argmax())
    assert float((actual.double() - expected).abs().flatten()[worst]) > 0.3  # the kernel's
    assert 4 * float(spreads.flatten()[worst]) > 0.3  # within M x its own spread

"""A batch variant checks that the outputs follow the batch (run.batch_follows): a batch size
written into the code passes the comparison with the equally buggy reference, not this."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.model import Case
from pytest_gpucase.case.variants import Variant
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.batch_follows import batch_problems
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext
from tests.helpers import make_case

TOKENS = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0))
POS = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))


def case_of(tmp_path: Path, independent: str = "") -> Case:
    path = tmp_path / "c"
    path.mkdir(parents=True, exist_ok=True)
    (path / "case.py").write_text("def run(x):\n    return x\n")
    (path / "case.toml").write_text(textwrap.dedent(f"""
        format = 1
        call = "case.py:run"
        [variants]
        batch = {{ axis = 0, sizes = [1, 3]{independent} }}
    """))
    return load_case(path)


def problems(tmp_path: Path, func: Any, size: int = 1, independent: bool = True,
             **inputs: Any) -> tuple[list[str], list[str]]:
    return batch_problems(case_of(tmp_path), func, lambda: dict(inputs or {"x": TOKENS}), {},
                          Variant("batch", size), torch.float32, independent)


def per_sample(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def broadcast_against_four(x: torch.Tensor) -> torch.Tensor:
    return x + POS.to(x.dtype)  # a (1, T, C) batch broadcasts to 4 rows


def expand_to_four(x: torch.Tensor) -> torch.Tensor:
    return x.expand(4, *x.shape[1:]) * 3


def mixes_samples(x: torch.Tensor) -> torch.Tensor:
    b, t, c = x.shape
    return x.transpose(0, 1).reshape(b, t, c)  # should be reshape(t, b, c).transpose(0, 1)


def squeezes(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1).squeeze()


def weight_like(x: torch.Tensor) -> dict[str, torch.Tensor]:
    # Outputs of size 4 that are no batch: a sum over the samples, a constant.
    return {"total": x.sum(0), "table": POS[:, 0].to(x.dtype), "loss": x.pow(2).mean()}


def batch_norm_trained(x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, training=True)


def test_a_correct_per_sample_call_follows_the_batch(tmp_path: Path) -> None:
    assert problems(tmp_path, per_sample) == ([], [])
    assert problems(tmp_path, per_sample, size=3) == ([], [])


@pytest.mark.parametrize("func", [broadcast_against_four, expand_to_four])
def test_a_batch_of_one_broadcast_to_the_saved_batch_is_named(tmp_path: Path, func: Any) -> None:
    found, _ = problems(tmp_path, func)
    assert len(found) == 1
    assert found[0].startswith("out: axis 0 should hold 1 entry (the variant's batch), but "
                               "holds 4, as on the saved batch of 4")


def test_a_squeezed_batch_of_one_is_named(tmp_path: Path) -> None:
    found, _ = problems(tmp_path, squeezes)
    assert found and "out: axis 0 should hold 1 entry" in found[0] and "(4, 3)" in found[0]


def test_rows_that_mix_samples_differ_from_the_full_batch(tmp_path: Path) -> None:
    found, notes = problems(tmp_path, mixes_samples, size=3)
    assert notes == []
    assert len(found) == 1 and found[0].startswith("out: rows 1, 2 on axis 0 differ from "
                                                   "the same of the saved batch's output")


def test_outputs_of_a_fixed_size_are_never_blamed(tmp_path: Path) -> None:
    assert problems(tmp_path, weight_like) == ([], [])


def test_rows_are_not_compared_where_the_samples_meet(tmp_path: Path) -> None:
    found, notes = problems(tmp_path, batch_norm_trained, size=3,
                            x=torch.randn(4, 6, generator=torch.Generator().manual_seed(2)))
    assert found == []
    assert len(notes) == 1 and "a batch norm computes the statistics of the batch" in notes[0]
    found, notes = problems(tmp_path, lambda x: x - x.mean(0), size=3, independent=False)
    assert found == [] and "independent = false" in notes[0]


def test_a_call_that_draws_random_numbers_gets_no_rows_check(tmp_path: Path) -> None:
    found, notes = problems(tmp_path, lambda x: F.dropout(mixes_samples(x), 0.5), size=3)
    assert found == [] and "depend on random draws" in notes[0]


def test_the_shape_check_holds_even_where_the_rows_are_not_compared(tmp_path: Path) -> None:
    found, _ = problems(tmp_path, broadcast_against_four, independent=False)
    assert len(found) == 1 and "holds 4" in found[0]


def test_independent_is_read_from_the_batch_table_only(tmp_path: Path) -> None:
    assert case_of(tmp_path).variants.batch.independent is True  # type: ignore[union-attr]
    off = case_of(tmp_path / "o", ", independent = false").variants.batch
    assert off is not None and off.independent is False


GPT_PY = """
import torch

POS = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))

def run(x):
    return torch.nn.functional.gelu(x + POS.to(x.dtype))
"""


@pytest.mark.slow
def test_a_hard_coded_batch_fails_the_batch_variant_it_passed(tmp_path: Path) -> None:
    path = make_case(tmp_path, "gpt", """
        format = 1
        call = "case.py:run"
        [variants]
        batch = { axis = 0, sizes = [1] }
    """, GPT_PY, {"x": TOKENS})
    case = load_case(path)
    ctx = RunContext("fork", "cpu")
    assert run_spec(RunSpec(case, "cpu", "bfloat16", cast=True), ctx).outcome.status == "passed"
    verdict = run_spec(RunSpec(case, "cpu", "bfloat16", cast=True,
                               variant=Variant("batch", 1)), ctx)
    assert verdict.outcome.status == "failed", verdict.outcome
    assert verdict.outcome.summary.startswith(
        "batch[1]: the outputs do not follow the batch: out: axis 0 should hold 1 entry")
    assert "independent = false" in verdict.outcome.details


def test_a_call_that_writes_into_its_input_is_given_the_saved_batch_again(
        tmp_path: Path) -> None:
    assert problems(tmp_path, lambda x: x.mul_(2), size=3) == ([], [])


class MixingNet(torch.nn.Module):
    """A batch norm, then a view that mixes the samples of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.norm = torch.nn.BatchNorm1d(6).double()
        torch.nn.init.normal_(self.norm.running_mean)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.norm(x)
        return y.t().reshape(y.shape)


def test_a_batch_norm_in_eval_mode_keeps_the_rows_check(tmp_path: Path) -> None:
    net = MixingNet()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    found, notes = problems(tmp_path, net.eval(), size=3, x=x)
    assert notes == [] and len(found) == 1 and "rows 0, 1, 2 on axis 0 differ" in found[0]
    found, notes = problems(tmp_path, net.train(), size=3, x=x)
    assert found == [] and "a batch norm computes the statistics of the batch" in notes[0]


def test_random_draws_that_do_not_reach_the_outputs_keep_the_rows_check(
        tmp_path: Path) -> None:
    def built_then_loaded(x: torch.Tensor) -> torch.Tensor:
        torch.randn(8)  # a model's initialisation, overwritten by its saved state
        return mixes_samples(x)

    found, notes = problems(tmp_path, built_then_loaded, size=3)
    assert notes == [] and len(found) == 1

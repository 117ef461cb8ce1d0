"""The bundled model-failure cases replay as the failures they document, on the CPU."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import REPLAY_MODULE
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext
from tests.helpers import replay_cpu

CASES = Path(__file__).resolve().parents[1] / "cases"


def case_module(case_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bundled_{case_dir.name}",
                                                  case_dir / "case.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_embedding_oob_model_is_a_module_case_whose_cuda_assert_replays_as_index_error() -> None:
    case_dir = CASES / "embedding_oob_model"
    doc = tomllib.loads((case_dir / "case.toml").read_text())
    assert doc["call"] == REPLAY_MODULE
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["factory"] == "case.py:make_model"
    saved = payload.load(case_dir / "inputs.safetensors")
    vocab = recipe["kwargs"]["vocab"]
    assert sorted(saved) == ["state.emb.weight", "state.head.bias", "state.head.weight",
                             "tokens"]
    assert int(saved["tokens"].max()) == vocab  # a token id equal to the vocabulary size
    assert doc["origin"]["failure_class"] == "index-out-of-range"
    assert "srcIndex < srcSelectDimSize" in doc["origin"]["stderr"]

    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    # Captured as a RuntimeError on CUDA: known by its failure class, not by its type.
    assert is_known_failure(load_case(case_dir), verdict)


@pytest.mark.slow
def test_attention_masked_row_is_nan_exactly_at_the_fully_masked_rows() -> None:
    case_dir = CASES / "attention_masked_row"
    inputs = payload.load(case_dir / "inputs.safetensors")
    code = case_module(case_dir)
    fully_masked = inputs["mask"].all(dim=-1)
    assert fully_masked.sum() == 2  # the left-padded sequence's first two queries
    out = code.attention(**inputs)
    assert torch.equal(out.isnan().any(dim=-1), fully_masked)
    # Why the case has a reference: the buggy call in float64 is NaN at the same rows, so
    # judging it against itself would only show NaN against NaN (passing with equal_nan).
    as_float64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    assert torch.equal(code.attention(**as_float64).isnan().any(dim=-1), fully_masked)
    fixed = code.reference(**as_float64)
    assert fixed.isfinite().all() and not fixed[fully_masked].any()

    verdict = replay_cpu(case_dir)
    assert verdict.outcome.kind == "mismatch", verdict.outcome.summary
    assert "actual is NaN at 16 mismatched positions; expected (float64) is a number" in (
        verdict.outcome.details)
    assert is_known_failure(load_case(case_dir), verdict)


@pytest.mark.gpu
def test_embedding_oob_model_on_cuda_is_the_captured_device_side_assert() -> None:
    case_dir = CASES / "embedding_oob_model"
    case = load_case(case_dir)
    verdict = run_spec(RunSpec(case, "cuda", "float32", cast=False),
                       RunContext("spawn", "cuda", localize=False))
    assert verdict.outcome.error_type is not None, verdict.outcome.summary
    assert "device-side assert" in (verdict.outcome.error_message or ""), verdict.outcome.summary
    assert is_known_failure(case, verdict)


@pytest.mark.slow
def test_the_readmes_first_command_passes_on_the_bundled_cases(tmp_path: Path) -> None:
    """``pytest --gpu-cases cases`` as README.md and CI run it, in a fresh process: every
    bundled case passes, is a strict xfail of its captured failure, or skips its CUDA items
    (a change to verdicts that moves a golden file or a tolerance shows here)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--gpu-cases", str(CASES), "-q", "-rfE",
         "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", str(CASES.parent)],
        cwd=CASES.parent, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " failed" not in done.stdout.splitlines()[-1]

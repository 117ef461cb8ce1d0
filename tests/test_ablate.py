"""gpucase ablate: one change at a time, each in a fresh child, read against the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytest_gpucase.tools.ablate import (
    CPU_HINT,
    FAILS_DIFFERENTLY,
    NOT_APPLICABLE,
    PASSES,
    STILL_FAILS,
    Row,
    RowVerdict,
    ablate,
    changes,
    read,
)
from pytest_gpucase.case.load import load_case
from pytest_gpucase.cli import main
from pytest_gpucase.plan.environment import Device, Environment
from pytest_gpucase.plan.runs import RunSpec, expand, label_dtype, single_run
from pytest_gpucase.plan.runs import NotRunnable, choose_device
from tests.helpers import ce_case, make_case, recorded_ce_case, write_case

pytestmark = pytest.mark.slow  # every test here starts processes

ENV = Environment(backend="cpu", device_types=("cpu",), torch=torch.__version__)
NOT_ON_CPU = {
    "cpu": "the run is already on the CPU",
    "autocast_off": "the case records no autocast ([context] autocast)",
    "tf32_off": "TF32 is a CUDA matmul and convolution mode; this run is on the CPU",
    "cudnn_off": "cuDNN (MIOpen on ROCm) serves CUDA devices only; this run is on the CPU",
    "extensions": "the case declares no optional extension ([matrix.packages]) and no "
                  "[ablate] env",
}


def rows_of(result_rows: tuple[Row, ...]) -> list[tuple[str, str, str | None]]:
    return [(row.change, row.verdict, row.failure) for row in result_rows]


COUNTER_PY = """\
    import torch


    def running_mean(x):
        # A streaming metric: the total is accumulated in at least float32, but the count
        # lives in the input's dtype.
        total = torch.zeros(x.shape[1:], dtype=torch.promote_types(x.dtype, torch.float32))
        count = torch.zeros((), dtype=x.dtype)
        for row in x:
            total += row
            count += 1
        return (total / count).to(x.dtype)


    def reference(x):
        return x.mean(dim=0)
    """


def test_bfloat16_counter_passes_in_float32_and_float64(tmp_path: Path) -> None:
    """A running mean whose count is kept in bfloat16 stops counting at 256.

    bfloat16 holds 8 significant bits, so 256 + 1 rounds back to 256: after
    1024 rows the count reads 256 and the mean comes out 4x too large. float32
    counts exactly to 2**24, so the same code passes in float32 and float64, and
    torch's own mean (the reference operator) accumulates in float32 and passes
    in bfloat16 too. The case lists float32 first: the first dtype that fails,
    bfloat16, is the baseline.
    """
    x = 1 + 0.1 * torch.randn(1024, 8, generator=torch.Generator().manual_seed(0))
    path = make_case(tmp_path, "count_bf16", """\
        format = 1
        timeout = 30
        call = "case.py:running_mean"
        reference = "case.py:reference"

        [matrix]
        dtypes = ["float32", "bfloat16"]
        """, COUNTER_PY, {"x": x})
    seen: list[str] = []
    result = ablate(load_case(path), device="cpu", dtype=None, env=ENV,
                    progress=lambda row: seen.append(row.change))

    assert result.failing and result.dtype == "bfloat16"
    assert result.baseline.failure == "mismatch"
    assert rows_of(result.rows) == [
        ("cpu", NOT_APPLICABLE, None),
        ("float32", PASSES, None),
        ("float64", PASSES, None),
        ("autocast_off", NOT_APPLICABLE, None),
        ("tf32_off", NOT_APPLICABLE, None),
        ("cudnn_off", NOT_APPLICABLE, None),
        ("deterministic", STILL_FAILS, "mismatch"),
        ("compile_off", STILL_FAILS, "mismatch"),
        ("extensions", NOT_APPLICABLE, None),
        ("reference", PASSES, None),
    ]
    assert {row.change: row.note for row in result.rows
            if row.verdict == NOT_APPLICABLE} == NOT_ON_CPU
    assert seen == [row.change for row in result.rows]
    assert result.reading.startswith(
        "passes in float32 and float64 but fails in bfloat16: precision (overflow/rounding), "
        "not a logic bug; passes with the reference operator")

    text = result.render()
    assert text.splitlines()[0].endswith("count_bf16 on cpu in bfloat16: fails (mismatch)")
    assert "  float32                   passes" in text
    assert "  deterministic algorithms  still fails          mismatch" in text
    assert text.splitlines()[-1] == f"reading: {result.reading}"
    data = json.loads(json.dumps(result.to_dict()))
    assert data["failing"] and data["dtype"] == "bfloat16"
    assert [row["verdict"] for row in data["rows"]][:3] == [NOT_APPLICABLE, PASSES, PASSES]


SOFTMAX_PY = """\
    import torch


    def softmax(x):
        # Written without subtracting the row maximum.
        e = x.exp()
        return e / e.sum(dim=-1, keepdim=True)


    def reference(x):
        return torch.softmax(x, dim=-1)
    """


def test_float16_overflow_passes_in_float32_float64_and_the_reference(tmp_path: Path) -> None:
    """Naive softmax of logits near 12: exp(12) = 162755 overflows float16 (max 65504).

    inf / inf gives NaN in float16; float32 and float64 have the range, and
    torch.softmax subtracts the maximum, so it passes even in float16.
    """
    x = torch.tensor([[12.0, 11.0, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    path = make_case(tmp_path, "softmax_fp16", """\
        format = 1
        timeout = 30
        call = "case.py:softmax"
        reference = "case.py:reference"

        [matrix]
        dtypes = ["float16"]
        """, SOFTMAX_PY, {"x": x})
    result = ablate(load_case(path), device="cpu", dtype="float16", env=ENV)

    verdicts = {row.change: row.verdict for row in result.rows}
    assert result.baseline.failure == "mismatch"
    assert [verdicts[k] for k in ("float32", "float64", "reference", "deterministic")] == [
        PASSES, PASSES, PASSES, STILL_FAILS]
    assert "passes in float32 and float64 but fails in float16" in result.reading


EXTENSION_PY = """\
    import os

    import torch


    def attention_scores(q, k):
        # The optional fused kernel is used unless the project's switch turns it off.
        if os.environ.get("GPUCASE_FUSED_KERNEL", "1") != "0":
            raise RuntimeError("fused kernel: unsupported head dim 80")
        return q @ k.t()
    """


def test_extension_switched_off_through_the_case_env(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    path = make_case(tmp_path, "fused", """\
        format = 1
        timeout = 30
        call = "case.py:attention_scores"

        [matrix.packages]
        pytest = ""

        [ablate]
        env = { GPUCASE_FUSED_KERNEL = "0" }
        """, EXTENSION_PY, {"q": torch.randn(4, 80, generator=gen),
                            "k": torch.randn(4, 80, generator=gen)})
    env = Environment(backend="cpu", device_types=("cpu",), torch=torch.__version__,
                      packages={"pytest": pytest.__version__})
    result = ablate(load_case(path), device="cpu", dtype=None, env=env)

    assert result.baseline.failure == "RuntimeError"
    assert rows_of(result.rows) == [
        ("cpu", NOT_APPLICABLE, None),
        ("float32", NOT_APPLICABLE, None),
        ("float64", STILL_FAILS, "RuntimeError"),
        ("autocast_off", NOT_APPLICABLE, None),
        ("tf32_off", NOT_APPLICABLE, None),
        ("cudnn_off", NOT_APPLICABLE, None),
        ("deterministic", STILL_FAILS, "RuntimeError"),
        ("compile_off", STILL_FAILS, "RuntimeError"),
        ("env:GPUCASE_FUSED_KERNEL", PASSES, None),
        ("reference", NOT_APPLICABLE, None),
    ]
    labels = {row.change: row.label for row in result.rows}
    assert labels["env:GPUCASE_FUSED_KERNEL"] == "GPUCASE_FUSED_KERNEL=0"
    assert result.rows[1].note == "the run is already in float32"
    assert result.reading == ("passes only with GPUCASE_FUSED_KERNEL=0: suspect the optional "
                              "extension (pytest)")


def test_passing_case_has_nothing_to_ablate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_case(tmp_path, "fine", 'format = 1\ntimeout = 30\ncall = "case.py:softmax"\n'
                     'reference = "case.py:reference"\n', SOFTMAX_PY,
                     {"x": torch.tensor([[1.0, 2.0]])})
    result = ablate(load_case(path), device="cpu", dtype=None, env=ENV)
    assert not result.failing and result.rows == ()
    assert result.reading == "passes unchanged on the CPU in float32: nothing to ablate"

    assert main(["ablate", str(path), "--device", "cpu"]) == 1
    assert "fine on cpu in float32: passes\nreading: passes unchanged on the CPU in " \
           "float32: nothing to ablate" in capsys.readouterr().out


def test_unknown_dtype_or_missing_device_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_case(tmp_path, "fine", 'format = 1\ntimeout = 30\ncall = "case.py:softmax"\n',
                     SOFTMAX_PY, {"x": torch.tensor([[1.0, 2.0]])})
    assert main(["ablate", str(path), "--device", "cpu", "--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    with pytest.raises(NotRunnable, match="--device cuda: no CUDA device here"):
        choose_device(load_case(path), ENV, "cuda")


def test_a_broken_case_is_an_error_not_a_reading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in the call: every change "still failed" and the reading sent the user to
    shrink the inputs, with exit status 0. minimize and validate name the key."""
    path = make_case(tmp_path, "typo", 'format = 1\ntimeout = 30\ncall = "case.py:softmaxx"\n',
                     SOFTMAX_PY, {"x": torch.tensor([[1.0, 2.0]])})
    assert main(["ablate", str(path), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "case.toml: call: 'case.py' has no 'softmaxx'" in captured.err
    assert "reading" not in captured.out + captured.err

def test_cuda_changes_are_built_with_their_switches(tmp_path: Path) -> None:
    """On a CUDA run the CUDA-only changes apply; before Ampere, TF32 does not exist."""
    path = make_case(tmp_path, "mm", 'format = 1\ncall = "case.py:softmax"\nlaunch_blocking '
                     '= true\n', SOFTMAX_PY, {"x": torch.tensor([[1.0, 2.0]])})
    case = load_case(path)
    base = RunSpec(case, "cuda", "float32", False, env={"CUDA_LAUNCH_BLOCKING": "1"},
                   launch_blocking=True)
    hopper = Environment(backend="cuda", device_types=("cuda", "cpu"),
                         devices=(Device(0, "NVIDIA H100", "9.0"),))
    built = {change.key: change for change in changes(case, base, hopper)}

    on_cpu = built["cpu"].spec
    assert on_cpu is not None and on_cpu.device == "cpu" and dict(on_cpu.env) == {}
    tf32 = built["tf32_off"].spec
    assert tf32 is not None and tf32.settings == ("tf32_off",)
    assert dict(tf32.env) == {"CUDA_LAUNCH_BLOCKING": "1", "NVIDIA_TF32_OVERRIDE": "0"}
    cudnn = built["cudnn_off"].spec
    assert cudnn is not None and cudnn.settings == ("cudnn_off",)
    assert built["float32"].spec is None and built["float64"].spec is not None

    volta = Environment(backend="cuda", device_types=("cuda", "cpu"),
                        devices=(Device(0, "Tesla V100", "7.0"),))
    old = {change.key: change for change in changes(case, base, volta)}
    assert old["tf32_off"].spec is None
    assert old["tf32_off"].reason == ("TF32 needs compute capability 8.0 (Ampere) or newer; "
                                      "this GPU is 7.0")


def _rows(verdicts: dict[str, RowVerdict]) -> list[Row]:
    return [Row(key, key, verdict, failure="mismatch" if "fails" in verdict else None)
            for key, verdict in verdicts.items()]


@pytest.mark.parametrize(("verdicts", "reading"), [
    ({"cpu": STILL_FAILS, "cudnn_off": PASSES, "tf32_off": STILL_FAILS},
     "passes only with cuDNN off: suspect the cuDNN kernel for this shape"),
    ({"cpu": PASSES, "cudnn_off": STILL_FAILS},
     f"passes on the CPU: {CPU_HINT}"),
    ({"float32": STILL_FAILS, "float64": PASSES},
     "passes only in float64 but fails in bfloat16 and float32: rounding (accumulation order, "
     "cancellation) or a tolerance too tight; look at the reduction, not the kernel choice"),
    ({"cpu": STILL_FAILS, "deterministic": FAILS_DIFFERENTLY},
     "fails under every change tried: not precision, kernel choice or extension; the trigger "
     "is in the inputs or the operator's logic (shrink it with gpucase minimize); with "
     "deterministic it fails differently (mismatch)"),
])
def test_reading(verdicts: dict[str, RowVerdict], reading: str) -> None:
    assert read(_rows(verdicts), "bfloat16") == reading


def test_ablates_recommendation_to_minimize_runs_on_a_recorded_case(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    path = recorded_ce_case(tmp_path)
    capsys.readouterr()
    assert main(["ablate", str(path)]) == 0
    assert "(shrink it with gpucase minimize)" in capsys.readouterr().out
    # The advice, followed: the payload's RNG state is no third batch candidate.
    assert main(["minimize", str(path), "--max-tries", "20"]) == 0
    assert "entries on axis 0: 8 -> 1 (kept entry 5)" in capsys.readouterr().out


AUTOCAST_TOML = """
    format = 1
    call = "case.py:run"
    timeout = 60
    [context]
    autocast = { device_type = "cuda", dtype = "bfloat16", enabled = true }
"""
# Fails only where its matmul computes in bfloat16: a precision bug, not the data.
AUTOCAST_PY = """
    import torch

    def run(x):
        y = x @ x.T
        if y.dtype == torch.bfloat16:
            raise RuntimeError(f"lost precision: the product was computed in {y.dtype}")
        return y.float()
"""


def test_an_autocast_failure_is_read_as_precision_not_the_inputs(tmp_path: Path) -> None:
    """Recorded under bf16 autocast, the run computes in bf16 though its inputs are float32:
    the ablation says so, has an autocast-off row and the other low-precision dtype's, and
    never blames the inputs for a failure one precision change removes."""
    path = write_case(tmp_path, "amp", AUTOCAST_TOML, AUTOCAST_PY,
                      {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))})
    result = ablate(load_case(path), device="cpu", dtype=None, env=ENV)
    assert result.failing
    assert result.dtype == "bfloat16 autocast"   # as its item is named: [cpu-bfloat16]
    rows = {row.change: row for row in result.rows}
    assert rows["autocast_off"].verdict == PASSES
    assert rows["autocast_float16"].verdict == PASSES
    assert rows["float32"].verdict == NOT_APPLICABLE
    assert "see autocast off" in rows["float32"].note
    assert "passes with autocast off but fails under bfloat16 autocast" in result.reading
    assert "the trigger is in the inputs" not in result.reading
    assert result.render().splitlines()[0].endswith(
        "amp on cpu in bfloat16 autocast: fails (RuntimeError)")


def test_an_autocast_case_is_ablated_in_the_run_its_item_makes(tmp_path: Path) -> None:
    """The item of a case recorded under bf16 autocast is [cpu-bfloat16]: ablating it in
    that dtype (as --gpu-ablate does, with the item's dtype) is the item's own run, the
    saved float32 inputs under autocast, not those inputs cast to bfloat16, and is named
    as the item is."""
    path = write_case(tmp_path, "amp", AUTOCAST_TOML, AUTOCAST_PY,
                      {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))})
    case = load_case(path)
    (item,) = [spec for spec in expand(case, ENV, saved_dtype=label_dtype(case))
               if spec.device == "cpu"]
    assert item.item_name() == "amp[cpu-bfloat16]"
    run = single_run(case, ENV, "cpu", item.dtype)
    assert (run.id, run.cast) == (item.id, item.cast) == ("cpu-bfloat16", False)
    assert single_run(case, ENV, "cpu") == run
    found = ablate(case, device="cpu", dtype=item.dtype, env=ENV)
    assert found.dtype == "bfloat16 autocast"
    off = {row.change: row for row in found.rows}["autocast_off"]
    assert off.verdict == PASSES


def test_a_case_without_autocast_says_why_it_has_no_autocast_row(tmp_path: Path) -> None:
    path = ce_case(tmp_path, "ce_plain", [0, 1, 4], "")
    result = ablate(load_case(path), device="cpu", dtype=None, env=ENV)
    rows = {row.change: row for row in result.rows}
    assert rows["autocast_off"].verdict == NOT_APPLICABLE
    assert "records no autocast" in rows["autocast_off"].note

"""gpucase minimize: ddmin over saved entries, each try in a fresh child, the same failure kept."""

from __future__ import annotations

import datetime as dt
import io
import math
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import tomli_w
import torch
import torch.nn.functional as F

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.cli import main
from pytest_gpucase.plan.environment import Environment
from pytest_gpucase.run.isolation import run_in_child
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.plan.runs import NotRunnable
from pytest_gpucase.tools.minimize import (
    FailureClass,
    OriginalPasses,
    ddmin,
    failure_class,
    laid_out_like,
    minimize,
    Selection,
    one_thread,
    plan_axes,
    select,
    strides_like,
    with_minimized_from,
)
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext
from tests.helpers import recorded_ce_case

pytestmark = pytest.mark.slow  # every test here starts processes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV = Environment(backend="cpu", device_types=("cpu",), torch=torch.__version__)

CE_PY = """\
import torch.nn.functional as F

from pytest_gpucase.tools.checks import class_indices


def run(logits, target, num_classes):
    # The project's loss: class indices are checked before the kernel sees them.
    class_indices(target, num_classes)
    return F.cross_entropy(logits, target, reduction="none")
"""


def make_case(root: Path, name: str, toml: str, case_py: str,
              tensors: dict[str, torch.Tensor]) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(toml))
    (path / "case.py").write_text(case_py)
    payload.save(path / "inputs.safetensors", tensors)
    return path


def ce_case(root: Path, *, bad: int = 37, entries: int = 64) -> Path:
    """A 64-entry batch whose entry 37 holds class 4 on a 4-class head; expected to match.

    The logits reach the loss transposed, with a storage offset of 3 elements:
    the minimized case must keep both.
    """
    gen = torch.Generator().manual_seed(1834)
    storage = torch.randn(3 + 4 * entries, generator=gen)
    logits = storage[3:].view(4, entries).t()
    target = torch.randint(0, 4, (entries,), generator=gen)
    target[bad] = 4
    ids = ", ".join(f'"img_{i:05d}"' for i in range(entries))
    return make_case(root, "ce_batch", f"""\
        format = 1
        summary = "a 4-class head; one label in the batch reads 4"
        call = "case.py:run"
        timeout = 30

        [inputs]
        num_classes = 4

        [origin]
        error = "RuntimeError: CUDA error: device-side assert triggered"
        iteration = 1834
        sample_ids = [{ids}]
        """, CE_PY, {"logits": logits, "target": target})


def test_one_bad_entry_among_64_is_found_and_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the project: the original is recorded relative to the new case
    path = ce_case(tmp_path)
    result = minimize(load_case(path), env=ENV, out=sys.stdout)  # progress where asked only

    assert result.failure == FailureClass("raises", "ValueError")
    assert result.selection.entries == (37,)
    assert result.stopped is None
    assert result.tries <= 12  # about 2·log2(64): one child per try
    assert result.output == tmp_path / "ce_batch_min"
    assert dict(result.shapes) == {"logits": ((64, 4), (1, 4)), "target": ((64,), (1,))}

    out = capsys.readouterr().out
    # The failure kept is shown with its message (the same failure is class and message).
    assert "gpucase minimize: ce_batch fails on cpu in float32 (ValueError: target holds 1 " \
           "value out of range [0, 4) (ignore_index=-100): 4 at position 37); 64 entries on " \
           "axis 0; budget 200 tries, 600 s" in out
    for size in ("32 entries", "16 entries", "8 entries", "4 entries", "2 entries", "1 entry"):
        assert f": {size}, still ValueError [" in out
    summary = result.render()
    assert "entries on axis 0: 64 -> 1 (kept entry 37)" in summary
    assert "\n  sample id kept: img_00037 ([origin] sample_ids)\n" in summary
    assert "logits: [64, 4] -> [1, 4]" in summary
    assert "  wrote ce_batch_min" in summary

    written = load_case(result.output)
    assert written.summary == "a 4-class head; one label in the batch reads 4"
    assert written.origin["iteration"] == 1834
    record = written.origin["minimized_from"]
    assert record["case"] == "../ce_batch"
    assert record["entries"] == [37] and record["sample_ids"] == ["img_00037"]
    assert record["failure"] == "ValueError" and record["tries"] == result.tries
    assert record["shapes"]["logits"] == {"before": [64, 4], "after": [1, 4]}
    assert record["inputs"] == payload.content_hash(path / "inputs.safetensors")

    # Dtype, stride order and storage offset are kept; the values are the saved entry 37.
    infos = {info.name: info for info in payload.describe(written.inputs_file)}
    assert infos["logits"].dtype == "F32" and infos["target"].dtype == "I64"
    assert infos["logits"].stride == torch.empty(4, 1).t().stride()  # still transposed
    assert infos["logits"].storage_offset == 3
    saved, kept = payload.load(path / "inputs.safetensors"), payload.load(written.inputs_file)
    assert torch.equal(kept["logits"], saved["logits"][37:38])
    assert kept["target"].tolist() == [4]

    replay = run_spec(RunSpec(written, "cpu", "float32", False),
                      RunContext("fork", "cpu", localize=False))
    assert failure_class(replay) == result.failure
    assert "4 at position 0" in (replay.outcome.error_message or "")


def test_tries_see_the_project_files_the_case_names_relative_to_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded case calls its script through a path relative to its own folder
    (``../../train.py``): every try must name the same file, not one a level deeper."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(CE_PY.replace("def run(", "def loss_fn("))
    path = ce_case(tmp_path / "cases")
    (path / "case.py").write_text(textwrap.dedent("""\
        from pathlib import Path

        from pytest_gpucase.capture import load_script


        def run(**inputs):
            return load_script(Path(__file__).parent / "../../train.py").loss_fn(**inputs)
        """))
    result = minimize(load_case(path), env=ENV, out=io.StringIO())

    assert result.failure == FailureClass("raises", "ValueError")
    assert result.selection.entries == (37,)
    assert not [p for p in (tmp_path / "cases").iterdir() if p.name.startswith(".gpucase-min")]


def _cross_entropy_of_wide_rows() -> bool:
    F.cross_entropy(torch.zeros(8, 4096), torch.zeros(8, dtype=torch.int64))
    return True


def test_large_inputs_leave_later_children_able_to_run(tmp_path: Path) -> None:
    """Cutting transposed 64 x 4096 logits here must not stall the children forked after.

    Copies of that size run on this process's OpenMP pool, and a pool once used
    does not survive a fork: the child's first parallel region (log_softmax)
    would wait forever. minimize does its tensor work on one thread.
    """
    with one_thread():  # this test's own tensor work must not start the pool either
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(4096, 64, generator=gen).t()
        target = torch.randint(0, 4096, (64,), generator=gen)
        target[37] = 4096
    path = make_case(tmp_path, "wide", """\
        format = 1
        call = "case.py:run"
        timeout = 20

        [inputs]
        num_classes = 4096
        """, CE_PY, {"logits": logits, "target": target})
    result = minimize(load_case(path), env=ENV, out=io.StringIO())
    assert result.selection.entries == (37,)
    assert result.failed_differently == {}

    after = run_in_child(_cross_entropy_of_wide_rows, timeout=20)
    assert after.returned, after.problem


LSE_PY = """\
import torch


def logsumexp(x):
    # Written without subtracting the maximum: exp overflows float32 above 88.7.
    return x.exp().sum(dim=1).log()
"""


def test_overflowing_entry_shrinks_batch_and_length(tmp_path: Path) -> None:
    """One logit of 100 (entry 5, position 20) makes a naive logsumexp inf in float32."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    x[5, 20] = 100.0
    path = make_case(tmp_path, "lse", """\
        format = 1
        call = "case.py:logsumexp"
        timeout = 30

        [variants]
        length = { axis = 1, sizes = [1] }
        """, LSE_PY, {"x": x})
    result = minimize(load_case(path), env=ENV, out=io.StringIO())

    assert result.failure == FailureClass("mismatch")
    assert result.selection.entries == (5,)
    assert result.selection.window == (20, 21)
    assert "length on axis 1: 32 -> 1 (kept positions [20, 21))" in result.render()
    assert result.output is not None
    kept = payload.load(result.output / "inputs.safetensors")
    assert kept["x"].tolist() == [[100.0]]
    assert load_case(result.output).origin["minimized_from"]["length"] == {
        "axis": 1, "start": 20, "stop": 21}


CRASH_PY = """\
import os
import signal


def run(target):
    # Class 4 reaches an unchecked native kernel that reads out of bounds.
    if (target == 4).any():
        os.kill(os.getpid(), signal.SIGSEGV)
    if (target < 0).any():
        raise ValueError("negative class index")
    return target * 1
"""


def test_crash_keeps_its_signal_and_other_failures_are_not_kept(tmp_path: Path) -> None:
    target = torch.zeros(16, dtype=torch.int64)
    target[3], target[11] = -1, 4
    path = make_case(tmp_path, "crash", 'format = 1\ncall = "case.py:run"\ntimeout = 30\n',
                     CRASH_PY, {"target": target})
    result = minimize(load_case(path), env=ENV, out=io.StringIO())

    assert result.failure == FailureClass("crash", "SIGSEGV")
    assert str(result.failure) == "crash: SIGSEGV"
    assert result.selection.entries == (11,)
    # The first half holds entry 3 only: it fails, but with a ValueError, so it is not kept.
    assert dict(result.failed_differently) == {"ValueError: negative class index": 1}
    assert ("1 try failed differently (ValueError: negative class index): not kept"
            in result.render())


def test_max_tries_stops_and_writes_the_best_so_far(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    result = minimize(load_case(path), env=ENV, max_tries=3, out=io.StringIO())

    # Tries: [0, 32) passes, [32, 64) fails, [32, 48) fails; then the budget is spent.
    assert result.tries == 3 and result.stopped == "max tries"
    assert result.selection.entries == tuple(range(32, 48))
    assert result.output is not None
    record = load_case(result.output).origin["minimized_from"]
    assert record["stopped"] == "max tries" and record["entries"] == list(range(32, 48))
    # Outside the working directory too: relative to the new case, never absolute.
    assert record["case"] == "../ce_batch"
    assert "(stopped at --max-tries)" in result.render()
    assert "entries on axis 0: 64 -> 16 (kept entries 32, 33, 34," in result.render()


def test_time_budget_is_checked_before_each_try(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    ticks = iter(range(1000))
    result = minimize(load_case(path), env=ENV, time_budget=4.5, out=io.StringIO(),
                      clock=lambda: float(next(ticks)))

    # The clock reads 0 at the start, then once before each try and once per improvement:
    # tries at 1, 2 (improved at 3) and 4 (improved at 5), and none at 6.
    assert result.stopped == "time budget"
    assert result.tries == 3
    assert result.selection.entries == tuple(range(32, 48))
    assert result.output is not None


def test_time_budget_spent_before_any_try_writes_nothing(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    ticks = iter(range(0, 1000, 10))
    result = minimize(load_case(path), env=ENV, time_budget=5.0, out=io.StringIO(),
                      clock=lambda: float(next(ticks)))
    assert result.tries == 0 and result.stopped == "time budget" and result.output is None
    assert "nothing written" in result.render()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


class InterruptOnce(io.StringIO):
    """A terminal where the user presses Ctrl-C when the batch is down to 16 entries."""

    def __init__(self) -> None:
        super().__init__()
        self.pressed = False

    def write(self, text: str) -> int:
        if "16 entries" in text and not self.pressed:
            self.pressed = True
            raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_writes_the_best_so_far(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    result = minimize(load_case(path), env=ENV, out=InterruptOnce())
    assert result.stopped == "interrupted"
    assert result.selection.entries == tuple(range(32, 48))
    assert result.output is not None
    assert load_case(result.output).origin["minimized_from"]["stopped"] == "interrupted"
    assert not list(tmp_path.glob(".*.tmp"))


def test_passing_case_is_refused_and_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = torch.zeros(8, dtype=torch.int64)
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    path = make_case(tmp_path, "fine", 'format = 1\ncall = "case.py:run"\ntimeout = 30\n\n'
                     '[inputs]\nnum_classes = 4\n', CE_PY, {"logits": logits, "target": target})
    before = sorted(p.name for p in tmp_path.iterdir())

    with pytest.raises(OriginalPasses, match="passes unchanged"):
        minimize(load_case(path), env=ENV, out=io.StringIO())
    code = main(["minimize", str(path), "--device", "cpu", "--max-tries", "10",
                 "--time-budget", "60"])

    assert code == 1
    assert "fine passes unchanged (cpu in float32): there is no failure to keep; nothing " \
           "written" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_existing_output_is_never_overwritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = ce_case(tmp_path)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code = main(["minimize", str(path), "-o", str(taken), "--device", "cpu", "--max-tries", "10",
                 "--time-budget", "60"])
    assert code == 2
    assert "exists; minimize never overwrites" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


def test_output_inside_the_case_directory_is_refused(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    with pytest.raises(NotRunnable, match="lies inside the case directory"):
        minimize(load_case(path), env=ENV, output=path / "small", out=io.StringIO())
    assert not (path / "small").exists()


def test_default_name_skips_taken_ones(tmp_path: Path) -> None:
    path = ce_case(tmp_path)
    (tmp_path / "ce_batch_min").mkdir()
    result = minimize(load_case(path), env=ENV, max_tries=2, out=io.StringIO())
    assert result.output == tmp_path / "ce_batch_min2"


# --- layout of the subsets -------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def _transposed_with_offset() -> torch.Tensor:
    return torch.arange(3 + 5 * 6, dtype=torch.float32)[3:].view(5, 6).t()


def _padded_rows() -> torch.Tensor:
    return torch.arange(6 * 10, dtype=torch.float32).view(6, 10)[:, :8]


def _expanded() -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32).expand(6, 4)


def _channels_last() -> torch.Tensor:
    return torch.randn(6, 3, 2, 2).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("make", [_transposed_with_offset, _padded_rows, _expanded,
                                  _channels_last])
def test_subsets_keep_stride_order_padding_offset_and_values(
        make: Callable[[], torch.Tensor]) -> None:
    like = make()
    index = torch.tensor([1, 4])
    values = like.index_select(0, index)
    kept = laid_out_like(values, like)

    assert torch.equal(kept, values) and kept.dtype == like.dtype
    assert kept.storage_offset() == like.storage_offset()
    order = sorted(range(like.dim()), key=lambda d: like.stride(d))
    assert sorted(range(kept.dim()), key=lambda d: kept.stride(d)) == order
    if like.stride(0) == 0:
        assert kept.stride(0) == 0  # still expanded
    if make is _padded_rows:
        assert kept.stride() == (10, 1)  # the row padding is kept
    if make is _transposed_with_offset:
        assert kept.stride() == (1, 2)
    # The whole batch keeps the very same strides.
    assert laid_out_like(like.index_select(0, torch.arange(like.shape[0])), like).stride() == \
        like.stride()


def test_subsets_copy_bits_exactly() -> None:
    nan = torch.tensor([0x7FC1, 0x7F81, 0x1234], dtype=torch.int16).view(torch.bfloat16)
    like = nan.repeat(4, 1).t()  # (3, 4), transposed
    kept = laid_out_like(like.index_select(0, torch.tensor([0, 1])), like)
    assert torch.equal(_bits(kept), _bits(like[:2]))
    flags = torch.tensor([True, False, True, True]).view(2, 2).t()
    assert torch.equal(laid_out_like(flags[1:], flags), flags[1:])


def test_strides_like_lays_out_overlapping_dims_densely() -> None:
    # A sliding window (unfold) overlaps: its subset is laid out densely instead.
    assert strides_like((2, 3), (4, 3), (1, 1)) == (3, 1)


# --- delta debugging -------------------------------------------------------------------------


def test_ddmin_finds_one_entry_in_about_two_log2_n_tries() -> None:
    tried: list[tuple[int, ...]] = []

    def fails(items: tuple[int, ...]) -> bool:
        tried.append(items)
        return 37 in items

    assert ddmin(tuple(range(64)), fails) == (37,)
    assert len(tried) <= 12


def test_ddmin_keeps_entries_that_fail_only_together() -> None:
    def fails(items: tuple[int, ...]) -> bool:
        return {3, 40} <= set(items)

    assert ddmin(tuple(range(64)), fails) == (3, 40)


# --- writing case.toml -----------------------------------------------------------------------

ROUND_TRIP = {
    "format": 1,
    "summary": 'quotes " and \\ backslash, tab\t, newline\n, DEL \x7f, bell \x07, é ✓',
    "timeout": 1.5,
    "launch_blocking": False,
    "inputs": {"num_classes": 4, "ignore_index": -100, "scale": 1e-05, "big": 1e300,
               "tiny": -0.0, "infinite": math.inf},
    "expect": {"outcome": "matches", "tolerance": {"bfloat16": {"rtol": 0.02, "atol": 0.001}}},
    "matrix": {"dtypes": ["float32", "bfloat16"], "packages": {"flash-attn": ">=2.5"}},
    "variants": {"batch": {"axis": 0, "sizes": [1, 2]}},
    "ablate": {"env": {"USE_FLASH_ATTN": "0"}},
    "origin": {
        "saved": dt.datetime(2024, 5, 1, 12, 0, 3, 250000, tzinfo=dt.timezone.utc),
        "local": dt.datetime(2024, 5, 1, 12, 0),
        "day": dt.date(2024, 5, 1),
        "at": dt.time(7, 30, 1),
        "sample ids": [["a", "b"], [1, 2]],
        "steps": [{"name": "forward", "ok": True}, {"name": "step", "ok": False}],
        "": "empty key",
        "nested": {"deeper": {"deepest": {"x": 1}}, "empty": {}},
        "empty": {},
    },
}


def test_every_kind_of_case_value_round_trips_through_the_writer() -> None:
    text = tomli_w.dumps(ROUND_TRIP)
    assert tomllib.loads(text) == ROUND_TRIP
    assert math.isnan(tomllib.loads(tomli_w.dumps({"nan": math.nan}))["nan"])


RECORD = {"case": "../big", "entries": [37], "tries": 9, "seconds": 0.79,
          "shapes": {"x": {"before": [64, 4], "after": [1, 4]}}}


@pytest.mark.parametrize("original", [
    # [origin] as a table, followed by other tables: the text is kept and the table appended.
    'format = 1 # first\ncall = "case.py:run"\n\n[origin]\nerror = "boom"\n\n[expect]\n'
    'outcome = "matches"\n',
    # No [origin] at all.
    'format = 1\ncall = "case.py:run"\n',
])
def test_minimized_from_is_appended_to_the_text_kept_verbatim(original: str) -> None:
    text = with_minimized_from(original, RECORD)
    assert text.startswith(original)
    doc = tomllib.loads(text)
    assert doc["origin"]["minimized_from"] == RECORD
    assert {k: v for k, v in doc.items() if k != "origin"} == {
        k: v for k, v in tomllib.loads(original).items() if k != "origin"}


@pytest.mark.parametrize("original", [
    'format = 1\ncall = "case.py:run"\norigin = { error = "boom" }\n',            # inline
    'format = 1\ncall = "case.py:run"\norigin.error = "boom"\n',                  # dotted keys
    'format = 1\ncall = "case.py:run"\n[origin]\nerror = "boom"\n'
    '[origin.minimized_from]\ncase = "../first"\ntries = 3\n',                    # minimized twice
])
def test_minimized_from_falls_back_to_writing_the_whole_document(original: str) -> None:
    doc = tomllib.loads(with_minimized_from(original, RECORD))
    assert doc["format"] == 1 and doc["call"] == "case.py:run"
    assert doc["origin"]["error"] == "boom"
    table = doc["origin"]["minimized_from"]
    assert {k: v for k, v in table.items() if k != "previous"} == RECORD
    if "first" in original:
        assert table["previous"] == {"case": "../first", "tries": 3}


def test_command_writes_the_case_and_returns_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = ce_case(tmp_path, entries=8, bad=5)
    (path / "expected.safetensors").write_bytes(b"golden outputs of the full batch")
    (path / "helpers").mkdir()
    (path / "helpers" / "labels.txt").write_text("cat\ndog\n")
    code = main(["minimize", str(path), "-o", str(tmp_path / "small"), "--max-tries", "50",
                 "--time-budget", "60"])
    assert code == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "entries on axis 0: 8 -> 1 (kept entry 5)" in out
    assert "  sample id kept: img_00005 ([origin] sample_ids)\n" in out   # printed by the CLI
    assert "note: expected.safetensors is not copied: its golden outputs belong to the full " \
           "batch" in out
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == [
        "case.py", "case.toml", "helpers", "inputs.safetensors"]
    assert (tmp_path / "small" / "helpers" / "labels.txt").read_text() == "cat\ndog\n"
    assert load_case(tmp_path / "small").origin["minimized_from"]["case"] == "../ce_batch"


# ------------------------------------------------ which inputs shrink: the variants' one rule


def test_minimize_cuts_logits_and_target_but_never_the_class_weight(tmp_path: Path) -> None:
    # B == C == 4: the class weight (4,) has the batch's size, yet it is no sample.
    tensors = {"logits": torch.randn(4, 4), "weight": torch.ones(4),
               "target": torch.tensor([0, 1, 2, 3])}
    path = make_case(tmp_path, "weighted", """\
        format = 1
        call = "case.py:run"
        """, "def run(logits, weight, target):\n    return logits\n", tensors)
    axes = plan_axes(load_case(path), tensors)
    assert axes.batch_size == 4
    assert axes.batch_members == {"logits", "target"}
    kept = select(tensors, axes, Selection(entries=(2,)))
    assert {name: tuple(t.shape) for name, t in kept.items()} == {
        "logits": (1, 4), "weight": (4,), "target": (1,)}


def test_minimize_follows_the_inputs_a_case_names(tmp_path: Path) -> None:
    tensors = {"x": torch.randn(2, 16), "w1": torch.randn(64, 16)}
    code = "def run(x, w1):\n    return x @ w1.t()\n"
    inferred = make_case(tmp_path, "doubt", 'format = 1\ncall = "case.py:run"\n', code, tensors)
    # The fix named is minimize's own option: a [variants.batch] table would add pytest items.
    with pytest.raises(NotRunnable, match=r"minimize .*doubt --inputs x$"):
        plan_axes(load_case(inferred), tensors)
    assert plan_axes(load_case(inferred), tensors, ("x",)).batch_members == {"x"}
    named = make_case(tmp_path, "named", """\
        format = 1
        call = "case.py:run"

        [variants.batch]
        sizes = [1]
        inputs = ["x"]
        """, code, tensors)
    assert plan_axes(load_case(named), tensors).batch_members == {"x"}


def test_a_recorded_case_is_shrunk_and_its_rng_state_kept_whole(tmp_path: Path) -> None:
    path = recorded_ce_case(tmp_path)
    case = load_case(path)
    rng = case.context.rng["cpu"]  # a uint8 (5056,): once taken for a third batch candidate
    result = minimize(case, env=ENV, out=io.StringIO())
    assert result.axes.batch_members == {"logits", "target"}
    assert result.selection.entries == (5,)
    assert result.output is not None
    assert ("\n  sample ids: none recorded ([origin] sample_ids): the entries are positions in "
            "the saved batch\n") in result.render()   # no rec.step(sample_ids=...) there
    saved, kept = payload.load(case.inputs_file), payload.load(result.output / "inputs.safetensors")
    assert torch.equal(kept[rng], saved[rng])
    assert {name: tuple(t.shape) for name, t in kept.items() if name != rng} == {
        "logits": (1, 4), "target": (1,)}


def test_the_inputs_named_by_the_hint_shrink_without_a_variant_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.ones(2, 16)
    x[1, 0] = -1.0
    code_py = ("def run(x, w1):\n    if (x[:, 0] < 0).any():\n"
               "        raise ValueError('negative sample')\n    return x @ w1.t()\n")
    path = make_case(tmp_path, "doubt", 'format = 1\ncall = "case.py:run"\n', code_py,
                     {"x": x, "w1": torch.randn(64, 16)})
    assert main(["minimize", str(path), "--max-tries", "10"]) == 2
    hint = capsys.readouterr().err.strip().rpartition("e.g. ")[2]
    assert hint == f"gpucase minimize {path} --inputs x"

    # The hint as written: no [variants.batch] table, so no new pytest item either.
    assert main([*hint.split()[1:], "--max-tries", "10"]) == 0
    assert "x: [2, 16] -> [1, 16]" in capsys.readouterr().out
    small = load_case(tmp_path / "doubt_min")
    assert small.variants.batch is None
    assert tuple(payload.load(small.inputs_file)["w1"].shape) == (64, 16)


PACK_PY = """\
import torch


def run(x, lengths):
    # Pack the valid steps of each sequence of x (B, T, D) by its lengths (B,).
    packed = torch.cat([x[i, : int(n)] for i, n in enumerate(lengths)])
    total = int(lengths.sum())
    if packed.shape[0] != total:  # a length past T: slicing cut it short
        raise RuntimeError(f"The size of tensor a ({packed.shape[0]}) must match the size of "
                           f"tensor b ({total}) at non-singleton dimension 0")
    return packed.view(total, -1)  # no step at all: RuntimeError, but another one
"""


def test_a_smaller_batch_raising_another_runtime_error_is_not_the_same_failure(
        tmp_path: Path) -> None:
    """x (B, T, D) with lengths (B,): the entries of length 0 alone raise another
    RuntimeError (a view of 0 elements); counted by type alone, the search kept them and
    reported a case that no longer shows the length past T as a success."""
    lengths = torch.tensor([0, 0, 0, 0, 2, 3, 7, 1])
    path = make_case(tmp_path, "pack", 'format = 1\ncall = "case.py:run"\ntimeout = 30\n',
                     PACK_PY, {"x": torch.randn(8, 5, 3), "lengths": lengths})
    result = minimize(load_case(path), env=ENV, out=io.StringIO())

    assert result.selection.entries == (6,)  # the entry whose length (7) is past T (5)
    assert result.message == ("RuntimeError: The size of tensor a (11) must match the size of "
                              "tensor b (13) at non-singleton dimension 0")
    others = [found for found in result.failed_differently if "cannot reshape" in found]
    assert others, result.failed_differently
    summary = result.render()
    assert result.message in summary.splitlines()[0]
    assert f"differently ({others[0]}): not kept" in summary
    assert result.output is not None
    record = load_case(result.output).origin["minimized_from"]
    # The kept case's own failure: one entry, smaller sizes than the original's.
    kept = ("RuntimeError: The size of tensor a (5) must match the size of tensor b (7) at "
            "non-singleton dimension 0")
    assert record["error"] == kept and f"\n  it fails with: {kept}\n" in summary


def test_a_dict_batch_is_cut_whole_inputs_and_targets_alike(tmp_path: Path) -> None:
    """Issue 30: a watched loss took {"x": inputs, "y": targets}; cutting x alone fails
    otherwise ("Expected input batch_size (4) to match target batch_size (8)"): both are
    cut on the batch axis, down to the one bad entry."""
    from pytest_gpucase.tools.record import Recorder
    from tests import model_targets

    rec = Recorder(tmp_path / "cases", narrow=False)
    loss = rec.watch(model_targets.batch_loss)
    y = torch.tensor([0, 1, 2, 0, 1, 7, 2, 0])
    with pytest.raises(IndexError), rec.step(0):
        loss({"x": torch.randn(8, 5), "y": y})
    result = minimize(load_case(tmp_path / "cases" / "batch_loss"), env=ENV, out=io.StringIO())
    assert result.selection.entries == (5,)
    assert dict(result.shapes) == {"dict.batch.x": ((8, 5), (1, 5)),
                                   "dict.batch.y": ((8,), (1,))}
    kept = payload.load(load_case(result.output).inputs_file)
    assert kept["dict.batch.y"].tolist() == [7]


# ------------------------------------------------ the kept case names its own samples and failure


def test_the_minimized_case_holds_the_kept_entries_sample_ids(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = ce_case(tmp_path, entries=8, bad=5)
    assert main(["minimize", str(path), "--max-tries", "50"]) == 0
    out = capsys.readouterr().out
    assert "  sample id kept: img_00005 ([origin] sample_ids)\n" in out
    assert "alone pass" in out and ", so the failure is in the kept entry's data\n" in out
    written = load_case(tmp_path / "ce_batch_min")
    # show, triage, offending and data-check read [origin] sample_ids as the new batch's.
    assert written.origin["sample_ids"] == ["img_00005"]
    record = written.origin["minimized_from"]
    assert record["original_sample_ids"] == [f"img_{i:05d}" for i in range(8)]
    assert record["tried_alone"]["failing"] == []     # other entries alone pass
    assert "note" not in record
    assert main(["show", str(tmp_path / "ce_batch_min")]) == 0
    assert "sample_ids: 1 (img_00005)" in capsys.readouterr().out
    # A request withholds the parent's ids the record keeps too, not the kept one's alone.
    from pytest_gpucase.tools.show import request

    shared = request(tmp_path / "ce_batch_min")
    assert "img_0000" not in shared and "<sample id>" in shared
    # The text is kept verbatim around the replaced ids' line.
    text = (tmp_path / "ce_batch_min" / "case.toml").read_text()
    assert text.startswith('format = 1\nsummary = "a 4-class head; one label in the batch')


SHAPE_BUG_PY = """\
import torch


def run(x, w):
    # A code bug: the weight is transposed; every entry fails alone.
    return x @ w
"""


def test_a_failure_every_entry_gives_names_no_culprit_sample(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ids = ", ".join(f'"s{i:04d}"' for i in range(8))
    path = make_case(tmp_path, "shape_bug", f"""\
        format = 1
        call = "case.py:run"

        [variants.batch]
        sizes = [1]
        inputs = ["x"]

        [origin]
        sample_ids = [{ids}]
        """, SHAPE_BUG_PY, {"x": torch.randn(8, 4), "w": torch.randn(3, 4)})
    assert main(["minimize", str(path), "--max-tries", "50"]) == 0
    out = capsys.readouterr().out
    assert "entries on axis 0: 8 -> 1 (kept entry 0)" in out
    assert ("  every entry tried fails alone the same way (entries 0, 4, 2): the failure does "
            "not single out a sample; look at the code, not the data (or at what every sample "
            "shares: a label mapping, a vocabulary)\n") in out
    assert "sample id kept" not in out
    # The kept case's own message, not the original's (8x4).
    assert "  it fails with: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x4 " \
           "and 3x4)\n" in out
    record = load_case(tmp_path / "shape_bug_min").origin["minimized_from"]
    assert record["tried_alone"] == {"entries": [4, 2], "failing": [4, 2]}
    assert "look at the code, not the data" in record["note"]
    assert "(1x4 and 3x4)" in record["error"]

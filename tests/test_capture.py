"""The Recorder: first failure saved as a loadable case, later ones counted, atomic writes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.tools.record import recorder
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import REPLAY_ENV
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.case.load import load_case
from pytest_gpucase.tools.validate import validate
from tests.helpers import read_toml as toml

DEVICE_ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                 "asynchronously reported at some other API call")


def ce_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
            weight: torch.Tensor | None = None) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction=reduction, weight=weight)


def failing_op(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    raise ValueError(f"factor {factor} rejected")


def raise_given(x: torch.Tensor, error: Exception) -> None:
    raise error


def device_assert(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(DEVICE_ASSERT)


def takes_anything(a: Any, b: Any = None, *rest: Any, **extra: Any) -> None:
    raise KeyError("planted")


_module_recorder = Recorder("unused")  # root set by the one test that uses it


@_module_recorder.watch(name="decorated")
def decorated(x: torch.Tensor) -> torch.Tensor:
    raise ArithmeticError("from a decorated function")


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def fail(fn: Any, *args: Any, **kwargs: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.slow
def test_first_failure_becomes_a_complete_case(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path / "cases")
    loss = rec.watch(ce_loss, name="ce_class4")
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5) / 7
    logits = base[:, 1:5].t()  # a transposed view with a storage offset: layout must survive
    target = torch.tensor([0, 4, 1, 2])
    for it in range(2):
        with rec.step(it, "forward", ids=[f"img_{it}_{i}" for i in range(4)]):
            pass
        if it == 1:
            with pytest.raises(IndexError), rec.step(it, "loss"):
                loss(logits, target, reduction="sum")

    case_dir = tmp_path / "cases" / "ce_class4"
    assert rec.case_dir == case_dir
    doc = toml(case_dir)
    assert doc["call"] == "tests.test_capture:ce_loss"
    assert doc["xfail"] == ("captured failure: IndexError: Target 4 is out of bounds.; remove "
                            "this line once fixed")
    assert doc["expect"] == {"outcome": "matches"}
    assert doc["inputs"] == {"reduction": "sum"}
    origin = doc["origin"]
    assert origin["error"] == "IndexError: Target 4 is out of bounds."
    assert (origin["iteration"], origin["stage"], origin["last_step"]) == (1, "loss", "forward")
    assert origin["sample_ids"] == ["img_1_0", "img_1_1", "img_1_2", "img_1_3"]
    assert origin["backend"] == "cpu" and origin["torch"] == torch.__version__
    assert origin["later_errors"] == 0
    assert origin["inputs"] == {"logits": "float32 (4, 4) stride (1, 5) offset 1 cpu",
                                "target": "int64 (4,) stride (1,) cpu"}
    assert "incomplete" not in origin and "skipped_inputs" not in origin

    case = load_case(case_dir)  # the format contract holds
    assert case.xfail is not None and case.expect.outcome == "matches"
    saved = payload.load(case.inputs_file)
    assert saved["logits"].stride() == (1, 5) and saved["logits"].storage_offset() == 1
    assert torch.equal(saved["logits"], logits) and torch.equal(saved["target"], target)
    assert validate([tmp_path / "cases"]) == []

    err = capsys.readouterr().err
    assert ("gpucase: saved " in err and "ce_class4 (first failure at iteration 1, in loss, "
            "after forward)" in err)
    assert "clue: index out of range (CPU)" in err and "first check:" in err


@pytest.mark.slow
def test_original_exception_propagates_unchanged(tmp_path: Path) -> None:
    rec = Recorder(tmp_path)
    error = LookupError("the planted one")
    watched = rec.watch(raise_given)
    with pytest.raises(LookupError) as info:
        watched(torch.ones(2), error)
    assert info.value is error
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert info.traceback[-1].name == "raise_given"  # the frame that raised is still there
    assert rec.case_dir is not None


@pytest.mark.slow
def test_later_errors_are_counted_in_place_not_saved(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path)
    op = rec.watch(failing_op, name="op")
    other = rec.watch(ce_loss, name="other")
    with pytest.raises(ValueError), rec.step(0, "forward"):
        op(torch.ones(3))  # one error, seen by the call and by the step: counted once
    assert toml(tmp_path / "op")["origin"]["later_errors"] == 0
    fail(op, torch.ones(3))
    fail(other, torch.ones(2, 3), torch.tensor([5, 0]))
    with pytest.raises(RuntimeError), rec.step(1, "backward"):
        raise RuntimeError("outside any watched call")
    assert rec.later_errors == 3
    assert toml(tmp_path / "op")["origin"]["later_errors"] == 3
    assert visible(tmp_path) == ["op"]
    assert sorted(p.name for p in (tmp_path / "op").iterdir()) == ["case.toml",
                                                                  "inputs.safetensors"]
    assert capsys.readouterr().err.count("another error after the first failure") == 1


@pytest.mark.slow
def test_existing_cases_are_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "op").mkdir()
    (tmp_path / "op" / "case.toml").write_text("format = 1\ncall = \"m:f\"\n")
    (tmp_path / "op-3").mkdir()  # claimed by a writer that has not renamed yet
    for _ in range(3):
        fail(Recorder(tmp_path).watch(failing_op, name="op"), torch.ones(1))
    assert visible(tmp_path) == ["op", "op-2", "op-3", "op-4", "op-5"]
    assert (tmp_path / "op" / "case.toml").read_text() == "format = 1\ncall = \"m:f\"\n"
    assert not any((tmp_path / "op-3").iterdir())


@pytest.mark.slow
def test_concurrent_writers_get_distinct_names(tmp_path: Path) -> None:
    barrier = threading.Barrier(6)

    def writer() -> None:
        watched = Recorder(tmp_path).watch(failing_op, name="race")
        barrier.wait()
        with pytest.raises(ValueError):
            watched(torch.ones(1))

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    names = visible(tmp_path)
    assert names == sorted(["race", *(f"race-{n}" for n in range(2, 7))])
    assert all((tmp_path / name / "case.toml").is_file() for name in names)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _slow_writes(write_fd: int) -> None:
    """Make payload writes go 1 MiB at a time, telling the parent once data is on disk."""
    real = payload._write_atomic

    def slow(path: Path, chunks: Any) -> None:
        def pieces() -> Iterator[memoryview]:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), 1 << 20):
                    yield view[start:start + (1 << 20)]
                    if start:
                        os.write(write_fd, b"w")
                        time.sleep(0.05)
        real(path, pieces())

    payload._write_atomic = slow


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_no_visible_case(tmp_path: Path) -> None:
    """SIGKILL a real writer in the middle of a 64 MiB payload: only a hidden directory remains.

    The payload write is slowed down (1 MiB pieces), not replaced, so that the kill
    lands while the real writer is writing the real file.
    """
    root = tmp_path / "cases"
    big = torch.zeros(16 << 20)  # made before the fork: the child only writes it
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
        pid = os.fork()
    if pid == 0:  # the writer
        code = 1
        try:
            os.close(read_fd)
            _slow_writes(write_fd)
            watched = Recorder(root).watch(failing_op, name="big")
            with pytest.raises(ValueError):
                watched(big)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], 60)
        assert ready and os.read(read_fd, 1) == b"w", "the writer never started writing"
        os.kill(pid, signal.SIGKILL)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    assert visible(root) == []
    # The staged case, and the capture's store, where the large tensor was being written.
    (hidden,) = [p for p in root.iterdir() if p.name != ".gpucase-store"]
    assert hidden.name.startswith(".big.")
    left = [p.name for p in hidden.iterdir()]
    assert "case.toml" not in left
    store = [p.name for p in (root / ".gpucase-store").iterdir()]
    assert store and all(n.startswith(".") for n in store)  # a temporary, no finished file
    # Nothing half-written is seen as a case: the folder holds none.
    assert validate([root]) == [f"{root}: no case directory (with a case.toml) under {root}"]
    # The next writer is not confused by the leftover.
    fail(Recorder(root).watch(failing_op, name="big"), torch.ones(2))
    assert visible(root) == ["big"]


@pytest.mark.slow
def test_sticky_device_error_writes_metadata_only(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A device-side assert with inputs on a device that cannot be read back.

    Tensors on the ``meta`` device stand in for a device that no longer answers (a
    meta tensor cannot be copied to the host either); the error text is what CUDA
    raises after a device-side assert, which triage marks as sticky.
    """
    rec = Recorder(tmp_path, snapshot="after")
    loss = rec.watch(device_assert, name="ce_cuda")
    logits = torch.empty(3, 4, device="meta")
    target = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(RuntimeError), rec.step(1834, "loss", ids=["a001", "a002", "a003"]):
        loss(logits, target)
    case_dir = tmp_path / "ce_cuda"
    assert not (case_dir / "inputs.safetensors").exists()
    doc = toml(case_dir)
    origin = doc["origin"]
    assert origin["snapshot"] == "not saved: device unusable after device-side assert"
    assert origin["inputs"] == {"logits": "float32 (3, 4) stride (4, 1) meta",
                                "target": "int64 (3,) stride (1,) meta"}
    assert origin["backend"] == "meta" and origin["sample_ids"] == ["a001", "a002", "a003"]
    assert "xfail" not in doc  # an incomplete case must fail loudly, not xfail
    assert doc["call"] == "tests.test_capture:device_assert"
    assert "rebuild the batch from the 3 [origin] sample_ids" in doc["summary"]
    assert "logits, target not saved" in doc["summary"]
    load_case(case_dir)
    err = capsys.readouterr().err
    assert "restart: the process must be restarted before any reproduction" in err
    assert "first check: Check the indices, targets and operator conditions" in err


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"snapshot": "after"}, {"snapshot_limit": 0}, {}],
                         ids=["after", "over-limit", "before-fails"])
def test_device_copy_that_fails_writes_metadata_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kwargs: dict[str, Any]) -> None:
    """A non-sticky error, but the copy to the host raises (``meta`` stands in for the device)."""
    rec = Recorder(tmp_path, **kwargs)
    op = rec.watch(failing_op)
    error = fail(op, torch.empty(8, device="meta"), factor=3.0)
    assert str(error) == "factor 3.0 rejected"  # the user's error, never ours
    origin = toml(tmp_path / "failing_op")["origin"]
    # payload refuses a tensor with no values (a meta one) before torch's copy would raise.
    assert origin["snapshot"].startswith("not saved: device unusable after ValueError (copying "
                                         "x to the host raised TypeError")
    assert "meta tensor: it has a shape but no values" in origin["snapshot"]
    assert toml(tmp_path / "failing_op")["inputs"] == {"factor": 3.0}
    assert "no sample ids were recorded" in toml(tmp_path / "failing_op")["summary"]
    over = "over the snapshot limit of 0.0 MiB" in capsys.readouterr().err
    assert over == (kwargs == {"snapshot_limit": 0})


@pytest.mark.slow
def test_mixed_host_and_unreadable_device_inputs_keep_the_host_ones(tmp_path: Path) -> None:
    rec = Recorder(tmp_path)
    fail(rec.watch(device_assert), torch.empty(2, 4, device="meta"), torch.tensor([1, 4]))
    case_dir = tmp_path / "device_assert"
    saved = payload.load(case_dir / "inputs.safetensors")
    assert [name for name in saved if not name.startswith("context.")] == ["target"]
    assert toml(case_dir)["origin"]["snapshot"] == (
        "not saved: device unusable after device-side assert; saved from the host: target")


@pytest.mark.slow
@pytest.mark.parametrize("fails_at", [0, 5])
def test_plain_steps_record_the_last_completed_step(tmp_path: Path, fails_at: int) -> None:
    """README's loop, ``with rec.step(step, sample_ids=...)``: [origin] says which step was
    the last to complete, as named stages do (none when the first step fails)."""
    rec = Recorder(tmp_path / "cases")
    op = rec.watch(failing_op, name="plain")
    for step in range(fails_at + 1):
        with rec.step(step, sample_ids=[step]):
            if step == fails_at:
                fail(op, torch.ones(2))
    origin = toml(tmp_path / "cases" / "plain")["origin"]
    assert origin["iteration"] == fails_at
    assert origin.get("last_step") == (None if fails_at == 0 else f"iteration {fails_at - 1}")
    assert "stage" not in origin


@pytest.mark.slow
def test_a_failure_between_steps_is_after_the_last_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Outside any step once step 0 completed: "after iteration 0", not "at iteration 0, after
    # iteration 0".
    rec = Recorder(tmp_path / "cases")
    op = rec.watch(failing_op, name="between")
    with rec.step(0, sample_ids=[0]):
        pass
    fail(op, torch.ones(2))
    err = capsys.readouterr().err
    assert "(first failure after iteration 0)" in err, err


@pytest.mark.slow
def test_named_stages_inside_a_plain_step_are_the_last_step(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases")
    op = rec.watch(failing_op, name="nested")
    for step in range(3):
        with rec.step(step):
            with rec.step(step, "forward"):
                pass
            with rec.step(step, "optimizer.step"):
                if step == 2:
                    fail(op, torch.ones(2))
    origin = toml(tmp_path / "cases" / "nested")["origin"]
    assert (origin["iteration"], origin["stage"], origin["last_step"]) == (
        2, "optimizer.step", "forward")


@pytest.mark.slow
def test_ids_from_the_watch_callable_win_over_the_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path)
    op = rec.watch(failing_op, ids=lambda x, **kw: [f"row{int(v)}" for v in x])
    with pytest.raises(ValueError), rec.step(0, "forward", ids=["s1"]):
        op(torch.tensor([3.0, 9.0]))
    assert toml(tmp_path / "failing_op")["origin"]["sample_ids"] == ["row3", "row9"]

    rec = Recorder(tmp_path / "b")
    broken = rec.watch(failing_op, ids=lambda *a, **k: [1 / 0])
    with rec.step(0, "forward", ids=["s1"]):
        pass
    with pytest.raises(ValueError), rec.step(0, "loss"):
        broken(torch.ones(1))  # same iteration: the step's ids still hold
    assert toml(tmp_path / "b" / "failing_op")["origin"]["sample_ids"] == ["s1"]
    assert "the ids callable of failing_op raised ZeroDivisionError" in capsys.readouterr().err

    rec = Recorder(tmp_path / "c")
    with rec.step(0, "forward", ids=["s1"]):
        pass
    with pytest.raises(ValueError), rec.step(1, "forward"):
        rec.watch(failing_op)(torch.ones(1))  # a new iteration is a new batch
    assert "sample_ids" not in toml(tmp_path / "c" / "failing_op")["origin"]


@pytest.mark.slow
def test_inputs_toml_cannot_hold_are_listed_with_their_type(tmp_path: Path) -> None:
    rec = Recorder(tmp_path)
    sparse = torch.eye(2).to_sparse()
    with warnings.catch_warnings():  # quantized tensors are deprecated, and still met
        warnings.simplefilter("ignore")
        packed = torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.quint4x2)
    fail(rec.watch(takes_anything), object(), None, 2**70, torch.float16,
         kw_list=(1, 2.5, "x"), kw_map={"a": [True], "b c": {"d": -1}}, kw_bad={1: 2},
         kw_sparse=sparse, kw_packed=packed, kw_none=None)
    doc = toml(tmp_path / "takes_anything")
    assert doc["inputs"] == {"kw_list": [1, 2.5, "x"], "kw_map": {"a": [True], "b c": {"d": -1}}}
    assert doc["origin"]["skipped_inputs"] == {
        "a": "object", "rest0": "int", "rest1": "torch.dtype", "kw_bad": "dict",
        "kw_packed": "Tensor (a quantized tensor of quint4x2, per_tensor_affine): "
                     "not storable",
        "kw_none": "NoneType",
    }
    # A sparse tensor is saved exactly, as its indices and values (issue 30).
    saved = payload.load(tmp_path / "takes_anything" / "inputs.safetensors")["kw_sparse"]
    assert saved.layout == torch.sparse_coo and torch.equal(saved.to_dense(), torch.eye(2))
    assert "b" not in doc["inputs"]  # None where the default is None: the replay gets it too
    incomplete = doc["origin"]["incomplete"]
    assert any("*rest got 2 extra positional arguments" in line for line in incomplete)
    assert any("a, kw_bad, kw_none, kw_packed, rest0, rest1 could not be saved" in line
               for line in incomplete)
    assert "xfail" not in doc and doc["summary"].startswith("INCOMPLETE: ")


@pytest.mark.slow
def test_unimportable_function_gets_a_stub_and_precise_advice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def local_loss(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("inside")

    rec = Recorder(tmp_path)
    watched = rec.watch(local_loss)
    warned = capsys.readouterr().err
    assert warned.startswith("gpucase: warning: test_unimportable_function_gets_a_stub_and_precise"
                             "_advice.<locals>.local_loss is defined inside a function")
    assert 'rec.watch(..., call="package.module:local_loss")' in warned
    fail(watched, torch.ones(2))
    doc = toml(tmp_path / "local_loss")
    assert doc["call"] == "case.py:run" and "xfail" not in doc
    assert "call=\"package.module:local_loss\"" in doc["summary"]
    assert (tmp_path / "local_loss" / "inputs.safetensors").exists()  # nothing is lost
    case = load_case(tmp_path / "local_loss")
    namespace: dict[str, Any] = {}
    exec((case.path / "case.py").read_text(), namespace)
    with pytest.raises(NotImplementedError, match="defined inside a function"):
        namespace["run"](x=torch.ones(2))
    assert "the case is incomplete, so it has no xfail line" in capsys.readouterr().err


@pytest.mark.slow
def test_script_function_and_call_override(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def script_loss(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("in the script")

    script_loss.__module__ = "__main__"  # as for a function defined in `python train.py`
    script_loss.__qualname__ = "script_loss"
    Recorder(tmp_path).watch(script_loss)
    assert "script_loss is defined in __main__" in capsys.readouterr().err

    rec = Recorder(tmp_path)
    watched = rec.watch(script_loss, call="my_project.losses:script_loss")
    assert capsys.readouterr().err == ""
    fail(watched, torch.ones(1))
    doc = toml(tmp_path / "script_loss")
    assert doc["call"] == "my_project.losses:script_loss" and "xfail" in doc
    with pytest.raises(ValueError, match=r"expected 'package\.module:function'"):
        rec.watch(script_loss, call="train.py:script_loss")


@pytest.mark.slow
def test_decorator_form_names_the_module_function(tmp_path: Path) -> None:
    _module_recorder.root = tmp_path
    fail(decorated, torch.ones(1))
    assert toml(tmp_path / "decorated")["call"] == "tests.test_capture:decorated"
    assert decorated.__wrapped__.__name__ == "decorated"  # type: ignore[attr-defined]


@pytest.mark.slow
def test_failure_outside_any_watched_call(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path)
    with rec.step(5, "loss", ids=["x1"]):
        pass
    with pytest.raises(FloatingPointError), rec.step(5, "backward"):
        raise FloatingPointError("nan in the gradients")
    doc = toml(tmp_path / "step_backward")
    assert doc["call"] == "case.py:run" and "xfail" not in doc
    assert doc["origin"]["error"] == "FloatingPointError: nan in the gradients"
    assert doc["origin"]["sample_ids"] == ["x1"]
    assert "outside any watched call" in doc["summary"]
    assert "(first failure at iteration 5, in backward, after loss)" in capsys.readouterr().err


@pytest.mark.slow
def test_kernel_assertion_is_read_from_a_stderr_file(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "train.err"
    line = ("Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread: "
            "[2,0,0] Assertion `t >= 0 && t < n_classes` failed.")
    log.write_text(f"epoch 1\n{line}\n")
    rec = Recorder(tmp_path / "cases", stderr_file=log)
    fail(rec.watch(device_assert), torch.ones(2, 4), torch.tensor([0, 4]))
    assert toml(tmp_path / "cases" / "device_assert")["origin"]["stderr"] == line
    assert f"note: kernel assertion: {line}" in capsys.readouterr().err


def test_an_internal_failure_is_one_line_and_the_error_still_propagates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "cases"
    blocker.write_text("a file where the cases directory should be")
    error = fail(Recorder(blocker).watch(failing_op), torch.ones(1))
    assert isinstance(error, ValueError) and error.__context__ is None
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "could not record" in ln]
    assert len(lines) == 1 and lines[0].startswith("gpucase: could not record the failure (")


@pytest.mark.slow
def test_unreadable_inputs_still_leave_the_origin(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise MemoryError("no room for a copy")

    monkeypatch.setattr(recorder, "collect", broken)
    rec = Recorder(tmp_path)
    with pytest.raises(ValueError), rec.step(2, "loss", ids=["z9"]):
        rec.watch(failing_op)(torch.ones(1))
    doc = toml(tmp_path / "failing_op")
    assert doc["origin"]["incomplete"] == [
        "the inputs could not be read (MemoryError: no room for a copy)"]
    assert doc["origin"]["iteration"] == 2 and doc["origin"]["sample_ids"] == ["z9"]
    assert "xfail" not in doc


def test_replay_children_record_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPLAY_ENV, "1")
    rec = Recorder(tmp_path)
    assert rec.watch(failing_op) is failing_op
    with pytest.raises(ValueError), rec.step(0, "loss"):
        raise ValueError("in a replay")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_literals_round_trip_through_toml(tmp_path: Path) -> None:
    tricky = {
        "text": 'quote " backslash \\ newline \n tab \t del \x7f bell \x07 é 😀',
        "floats": [0.1, -0.0, 1e-300, 1e300, float("inf"), float("-inf")],
        "ints": [0, -1, 2**63 - 1, -(2**63)],
        "nested": {"a b": [[1, 2], []], "": "empty key", "ok": {}},
        "flag": False,
    }
    fail(Recorder(tmp_path).watch(takes_anything), 1, **tricky)
    assert toml(tmp_path / "takes_anything")["inputs"] == {"a": 1, **tricky}
    nan = Recorder(tmp_path / "nan")
    fail(nan.watch(takes_anything), float("nan"))
    value = toml(tmp_path / "nan" / "takes_anything")["inputs"]["a"]
    assert value != value


GPU_SCRIPT = """
import sys, tomllib
import torch, torch.nn.functional as F
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.case import payload

rec = Recorder(sys.argv[1])
loss = rec.watch(F.cross_entropy, name="ce_cuda")
logits = torch.randn(4, 4, device="cuda")
target = torch.tensor([0, 1, 4, 2], device="cuda")
try:
    with rec.step(7, "loss", ids=["a", "b", "c", "d"]):
        loss(logits, target)
except RuntimeError as exc:
    assert "device-side assert" in str(exc), exc
doc = tomllib.loads(open(sys.argv[1] + "/ce_cuda/case.toml").read())
saved = payload.load(sys.argv[1] + "/ce_cuda/inputs.safetensors")
assert saved["target"].tolist() == [0, 1, 4, 2], saved
assert doc["origin"]["backend"] in ("cuda", "rocm"), doc
assert doc["origin"]["snapshot"] == "tensors copied before the call", doc
assert doc["call"] == "torch.nn.functional:cross_entropy", doc
print("device:", doc["origin"]["device"])
"""


@pytest.mark.gpu
def test_device_side_assert_on_a_real_gpu_keeps_the_inputs(tmp_path: Path) -> None:
    """On a GPU: the inputs copied before the call survive the sticky error that follows.

    Run in a separate interpreter, so that this pytest process never initializes CUDA.
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_SCRIPT), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restart: the process must be restarted" in done.stderr
    assert "device: " in done.stdout and "device: cuda:0" not in done.stdout


# --- snapshots: inputs as passed, and what a call changed in place --------------------------------

INPLACE_MODULE = '''
import torch


def normalize_(x):
    x.mul_(10.0)  # in place, on the caller's tensor
    if x.abs().max() > {bound}:
        raise ValueError(f"too large: max {{x.abs().max().item():.1f}}")
    return x
'''


def scale_then_fail(x: torch.Tensor) -> torch.Tensor:
    x.mul_(10.0)
    raise ValueError(f"too large: max {x.max().item():.1f}")


def test_a_host_input_changed_in_place_is_saved_as_passed_and_the_fix_shows(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The outside tester's scenario: the failing call multiplies its input in place, then
    raises. The case holds the input as passed, so its replay raises the captured error
    (not one of ten times the values), and after the fix it shows as XPASS(strict)."""
    pytester.makeini("[pytest]\npythonpath = .\n")
    package = pytester.mkpydir("inplace_pkg")
    (package / "ops.py").write_text(INPLACE_MODULE.format(bound=50))
    pytester.syspathinsert()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    import importlib

    ops = importlib.import_module("inplace_pkg.ops")
    rec = Recorder(pytester.path / "cases")
    normalize = rec.watch(ops.normalize_)  # found importable while the module is imported
    monkeypatch.delitem(sys.modules, "inplace_pkg.ops")
    monkeypatch.delitem(sys.modules, "inplace_pkg")
    x = torch.full((3,), 6.0)
    with pytest.raises(ValueError, match=r"too large: max 60\.0"):
        normalize(x)
    assert x.tolist() == [60.0, 60.0, 60.0]  # the caller's tensor did change
    case_dir = pytester.path / "cases" / "normalize"
    assert payload.load(case_dir / "inputs.safetensors")["x"].tolist() == [6.0, 6.0, 6.0]
    doc = toml(case_dir)
    assert doc["origin"]["snapshot"] == "tensors copied before the call"
    assert "changed in place" not in capsys.readouterr().err

    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "--gpu-devices", "cpu",
                                           "--runxfail", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*ValueError: too large: max 60.0*"])
    assert "max 600.0" not in result.stdout.str()
    result.assert_outcomes(failed=1)

    (package / "ops.py").write_text(INPLACE_MODULE.format(bound=100))  # the fix
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "--gpu-devices", "cpu", "-rxX",
                                           "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*XPASS(strict)*captured failure: ValueError: too large: max "
                                 "60.0; remove this line once fixed*"])
    result.assert_outcomes(failed=1)


@pytest.mark.slow
@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"snapshot_limit": 4}, "over the snapshot limit of 0.0 MiB; Recorder(snapshot_limit=...) "
                            "of 0.0 MiB or more copies them before each call, as passed"),
    ({"snapshot": "after"}, 'snapshot="after"; Recorder(snapshot="before") copies them before '
                            "each call, as passed"),
], ids=["over-limit", "after"])
def test_an_input_not_copied_before_and_changed_in_place_is_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kwargs: dict[str, Any],
        fix: str) -> None:
    """Not copied before the call (over the limit, or snapshot="after"): the version counter
    read before it tells that the call changed the input, and the case and a note say so."""
    rec = Recorder(tmp_path, **kwargs)
    fail(rec.watch(scale_then_fail), torch.full((3,), 6.0))
    case_dir = tmp_path / "scale_then_fail"
    assert payload.load(case_dir / "inputs.safetensors")["x"].tolist() == [60.0, 60.0, 60.0]
    assert toml(case_dir)["origin"]["snapshot"] == (
        "host tensors, as they were after the failure; changed in place by the failing call, "
        f"so saved as changed: x (not copied before the call: {fix})")
    err = capsys.readouterr().err
    assert ("gpucase: note: the failing call of scale_then_fail changed x in place, so the case "
            f"holds them as changed, not as passed (not copied before the call: {fix})"
            ) in err.splitlines()
    assert ("over the snapshot limit" in err.split("gpucase: saved")[0]) == (
        "snapshot_limit" in kwargs)  # the limit's own note, once, before the call


@pytest.mark.slow
def test_an_unchanged_input_not_copied_before_gets_no_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fail(Recorder(tmp_path, snapshot="after").watch(failing_op), torch.ones(2))
    assert toml(tmp_path / "failing_op")["origin"]["snapshot"] == (
        "host tensors, as they were after the failure")
    assert "changed in place" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_large_case_says_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cases are committed: a saved line names the size from 1 MiB on, and not below."""
    fail(Recorder(tmp_path / "big").watch(failing_op), torch.zeros(2**18))  # 1 MiB of float32
    fail(Recorder(tmp_path / "small").watch(failing_op), torch.zeros(4))
    saved = [line for line in capsys.readouterr().err.splitlines() if "gpucase: saved" in line]
    assert saved == [f"gpucase: saved {tmp_path / 'big' / 'failing_op'} (1.0 MiB; first failure)",
                     f"gpucase: saved {tmp_path / 'small' / 'failing_op'} (first failure)"]


@pytest.mark.parametrize("narrow", ["no", 1, None])
def test_narrow_must_be_a_bool(tmp_path: Path, narrow: Any) -> None:
    with pytest.raises(TypeError, match=r"narrow must be True or False, not .*Recorder\(narrow"):
        Recorder(tmp_path, narrow=narrow)


def aliased_step(buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    buf.mul_(0).add_(7)            # the whole buffer, in place
    if (view > 5).any():           # ... which its view sees
        raise ValueError("view saw the update")
    return buf.sum()


@pytest.mark.slow
def test_arguments_sharing_memory_are_named(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A buffer and a view of it: a case holds each apart, so the capture says so (the replay
    of such a failure passed, an XPASS that read as 'fixed')."""
    rec = Recorder(tmp_path)
    buf = torch.zeros(8)
    fail(rec.watch(aliased_step), buf, buf[2:4])
    err = capsys.readouterr().err
    assert ("gpucase: note: arguments of aliased_step share memory (buf, view); the case holds "
            "each on its own") in err, err
    assert toml(tmp_path / "aliased_step")["origin"]["snapshot"] == (
        "tensors copied before the call; shared memory in the call, held apart in the case: "
        "buf, view")
    fail(Recorder(tmp_path / "apart").watch(aliased_step), torch.zeros(8), torch.full((2,), 9.0))
    assert "share memory" not in capsys.readouterr().err


def test_a_large_host_copy_before_each_call_is_named_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is paid at every step of a loop that never fails: said once, with the way out."""
    from pytest_gpucase.tools.record import inputs

    monkeypatch.setattr(inputs, "_HOST_COPY_NOTE", 64)
    step = Recorder(tmp_path).watch(torch.add, name="add")
    for _ in range(3):
        step(torch.ones(32), torch.ones(32))   # 128 bytes each
    err = capsys.readouterr().err
    assert err.count("MiB of host inputs of add are copied before each call") == 1, err
    assert 'snapshot="after"' in err
    Recorder(tmp_path, snapshot="after").watch(torch.add, name="add2")(torch.ones(32), 1)
    assert capsys.readouterr().err == ""


def token_loss(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reads both, writes neither (the Hugging Face ``labels=input_ids`` convention)."""
    if int(labels.max()) >= 8:
        raise IndexError(f"label {int(labels.max())} out of 8 classes")
    return input_ids.float().sum()


@pytest.mark.slow
def test_the_same_tensor_passed_twice_and_never_written_is_no_shared_memory_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: labels=input_ids shares memory, but the call writes into neither: the case
    holding them apart replays the same, so no note."""
    ids = torch.tensor([[1, 9, 3]])
    fail(Recorder(tmp_path).watch(token_loss), ids, labels=ids)
    assert "share memory" not in capsys.readouterr().err
    assert "shared memory" not in toml(tmp_path / "token_loss")["origin"]["snapshot"]


@pytest.mark.slow
def test_under_inference_mode_a_tensor_passed_twice_and_never_written_is_no_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: under torch.inference_mode (Trainer.validate, test, predict; evaluation
    loops) tensors have no version counter; labels=input_ids, unchanged by the call as its
    copy before the call shows, is no shared-memory note. A write under inference mode
    still is."""
    with torch.inference_mode():
        ids = torch.tensor([[1, 9, 3]])
        fail(Recorder(tmp_path).watch(token_loss), ids, labels=ids)
        assert "share memory" not in capsys.readouterr().err
        assert "shared memory" not in toml(tmp_path / "token_loss")["origin"]["snapshot"]
        buf = torch.zeros(8)
        fail(Recorder(tmp_path / "written").watch(aliased_step), buf, buf[2:4])
    assert "arguments of aliased_step share memory (buf, view)" in capsys.readouterr().err


class LazyNet(torch.nn.Module):
    """A LazyLinear, shaped by its first call: a fresh one has no shapes to compare."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.LazyLinear(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if bool((x < 0).any()):
            raise ValueError("negative input")
        return y


@pytest.mark.slow
def test_a_model_with_a_lazy_layer_is_watched_and_its_failure_saved(tmp_path: Path) -> None:
    """rec.watch checked the rebuild by comparing shapes, and an uninitialized parameter of
    the fresh model has none: the watch itself raised in the user's script."""
    model = LazyNet()
    model(torch.ones(1, 3))
    rec = Recorder(tmp_path, narrow=False)
    fail(rec.watch(model), -torch.ones(1, 3))
    assert (tmp_path / "LazyNet" / "case.toml").is_file()


@pytest.mark.slow
def test_the_sample_ids_of_a_huge_batch_keep_the_case_loadable(tmp_path: Path) -> None:
    """200,000 long sample ids (one per token of a large batch) made a 15 MiB case.toml, over
    the bound every reader applies: a capture that said "saved" and could not be loaded.
    The first ids are kept, with how many there were."""
    ids = [f"s3://bucket/shards/shard-{i // 1000:04d}/sample_{i:08d}.json" for i in range(200_000)]
    rec = Recorder(tmp_path, narrow=False)
    with pytest.raises(ValueError), rec.step(0, sample_ids=ids):
        rec.watch(failing_op)(torch.ones(2))
    case = load_case(tmp_path / "failing_op")
    kept = case.origin["sample_ids"]
    assert 1000 < len(kept) < len(ids) and kept == ids[:len(kept)]
    assert case.origin["sample_ids_total"] == 200_000


def takes_lengths(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    raise ValueError(f"{len(lengths)} lengths for {x.numel()} rows")


@pytest.mark.slow
def test_a_literal_too_large_for_case_toml_leaves_a_loadable_origin_case(
        tmp_path: Path) -> None:
    """A list of 300,000 lengths passed to the failing call made a 4 MiB case.toml, which no
    reader takes: the capture said "saved" and was lost. The case keeps its origin and says
    why it holds no more."""
    rec = Recorder(tmp_path, narrow=False)
    with pytest.raises(ValueError), rec.step(3, sample_ids=["a"]):
        rec.watch(takes_lengths)(torch.ones(2), list(range(300_000)))
    case = load_case(tmp_path / "takes_lengths")
    assert case.origin["iteration"] == 3 and case.origin["sample_ids"] == ["a"]
    assert any("over the 1048576 every reader takes" in reason
               for reason in case.origin["incomplete"]), case.origin


@pytest.mark.slow
def test_a_secret_in_the_watch_name_never_names_the_case_folder(tmp_path: Path) -> None:
    """Issue 30: rec.watch(fn, name=f"run_{token}"): the folder, committed with the cases, is
    named without the token."""
    token = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    rec = Recorder(tmp_path, narrow=False)
    fail(rec.watch(failing_op, name=f"run_{token}"), torch.ones(2))
    names = [p.name for p in tmp_path.iterdir()]
    assert names and not any(token[4:] in name for name in names), names

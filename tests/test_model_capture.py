"""Models under a Recorder: hooks, state, narrowing, numeric context, failure classes."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pytest_gpucase.tools.record import narrow, write
from pytest_gpucase.case import payload
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.verdict.triage import failure_class, same_failure
from tests import model_targets
from tests.helpers import read_toml, replay_cpu

pytestmark = pytest.mark.slow  # every test here starts processes


def test_watched_module_stays_a_module_and_its_failure_replays_narrowed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.TinyLM()
    rec = Recorder(tmp_path / "cases")
    assert rec.watch(model) is model
    assert len(list(model.parameters())) == 3  # not a plain function
    with rec.step(0, sample_ids=torch.tensor([1, 2])):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(IndexError, match="index out of range in self"), rec.step(1):
        model(torch.tensor([[1, 9, 3]]))

    whole = tmp_path / "cases" / "TinyLM"
    assert rec.case_dir == whole
    doc = read_toml(whole)
    assert doc["call"] == "pytest_gpucase.capture:replay_module"
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["factory"] == "tests.model_targets:TinyLM"
    assert recipe["kwargs"] == {"vocab": 8, "dim": 4} and recipe["training"] is True
    assert doc["origin"]["failure_class"] == "index-out-of-range"
    saved = payload.load(whole / "inputs.safetensors")
    assert torch.equal(saved["state.emb.weight"], model.emb.weight.detach())
    assert torch.equal(saved["tokens"], torch.tensor([[1, 9, 3]]))
    assert saved["context.rng_cpu"].dtype == torch.uint8

    names = sorted(p.name for p in rec.narrowed)
    assert names == ["TinyLM.aten.embedding.default", "TinyLM.emb"]
    emb = read_toml(tmp_path / "cases" / "TinyLM.emb")["inputs"]["gpucase_module"]
    assert emb["factory"] == "torch.nn.modules.sparse:Embedding"
    assert (emb["kwargs"]["num_embeddings"], emb["kwargs"]["embedding_dim"]) == (8, 4)
    for case_dir in (whole, *rec.narrowed):
        verdict = replay_cpu(case_dir)
        assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
        assert is_known_failure(load_case(case_dir), verdict)


class CheckedLM(model_targets.TinyLM):
    """TinyLM whose forward checks the token ids itself: the failure is Python's, no op's."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if int(tokens.max()) >= self.vocab:
            raise ValueError(f"token id {int(tokens.max())} >= vocab {self.vocab}")
        return super().forward(tokens)


def test_a_failure_no_op_raised_is_told_so(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """No op case is tried when no ATen op raised: the note says so, and claims no replay."""
    rec = Recorder(tmp_path / "cases")
    model = rec.watch(CheckedLM(), name="checked")
    with pytest.raises(ValueError, match="token id 9 >= vocab 8"), rec.step(0):
        model(torch.tensor([[1, 9, 3]]))
    assert rec.case_dir == tmp_path / "cases" / "checked"
    assert rec.narrowed == []
    err = capsys.readouterr().err
    assert "gpucase: note: no single ATen op raised: no op case written" in err.splitlines()
    assert "did not reproduce" not in err
    verdict = replay_cpu(tmp_path / "cases" / "checked")
    assert verdict.outcome.error_type == "ValueError", verdict.outcome.summary


def test_rerun_of_the_same_failure_counts_instead_of_copying(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = []
    for _ in range(2):
        torch.manual_seed(0)
        model = model_targets.TinyLM()
        rec = Recorder(tmp_path / "cases")
        rec.watch(model)
        with pytest.raises(IndexError):
            model(torch.tensor([[8]]))
        said.append(capsys.readouterr().err)
    names = ["TinyLM", "TinyLM.aten.embedding.default", "TinyLM.emb"]
    assert sorted(p.name for p in (tmp_path / "cases").iterdir()) == names
    assert read_toml(tmp_path / "cases" / "TinyLM")["origin"]["seen"] == 2
    assert said[0].count("gpucase: saved ") == 3
    # The rerun says what it did, and only that: no "saved" line for a copy it did not write.
    assert "gpucase: saved" not in said[1]
    for name in names:
        assert f"the same failure as {tmp_path / 'cases' / name} (seen 2 times)" in said[1]


def test_a_backward_failure_from_a_nan_the_loss_sent_is_not_frozen(tmp_path: Path) -> None:
    """Issue 21 item 6: the NaN gradient came from a loss computed outside the watched calls,
    so a replay from it would fail forever: the case says so, and is incomplete."""
    torch.manual_seed(0)
    model = model_targets.BackwardBoom()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    out = model(torch.ones(2, 3))
    with pytest.raises(FloatingPointError), rec.step(0, "backward"):
        (out * float("nan")).sum().backward()
    case_dir = tmp_path / "cases" / "BackwardBoom"
    doc = read_toml(case_dir)
    assert doc["inputs"]["gpucase_module"]["backward"] is True
    assert "xfail" not in doc
    assert doc["summary"].startswith("INCOMPLETE: the gradient that reached BackwardBoom's "
                                     "output holds NaN or inf")
    assert doc["origin"]["grad_output"] == "saved as captured, not finite"
    assert "the backward pass of BackwardBoom raised FloatingPointError" in doc["summary"]


def test_a_backward_failure_replays_from_the_watched_loss(tmp_path: Path) -> None:
    """The watched loss function took the model's output: the case calls it again and runs
    backward from its loss, so the gradient is recomputed, not saved."""
    torch.manual_seed(0)
    model = model_targets.BackwardBoom()
    rec = Recorder(tmp_path / "cases2")
    rec.watch(model)
    loss_fn = rec.watch(model_targets.scaled_sum)
    with pytest.raises(FloatingPointError), rec.step(0):
        loss = loss_fn(model(torch.ones(2, 3)), scale=torch.tensor(float("nan")))
        loss.backward()
    case_dir = tmp_path / "cases2" / "BackwardBoom"
    doc = read_toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["loss"] == {"call": "tests.model_targets:scaled_sum", "output": "x",
                              "index": 0}
    assert "grad_outputs" not in recipe and doc["xfail"].startswith("captured failure")
    assert doc["origin"]["grad_output"].startswith("recomputed")
    saved = payload.load(case_dir / "inputs.safetensors")
    assert torch.isnan(saved["loss.scale"]) and not any(k.startswith("grad_output") for k in saved)
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "FloatingPointError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


def test_a_backward_failure_with_a_finite_gradient_replays_from_it(tmp_path: Path) -> None:
    """A gradient that is not the symptom (finite, from a loss outside the watched calls) is
    an input of the backward pass like any other: saved, and the case says so."""
    torch.manual_seed(0)
    model = model_targets.BackwardBoom(limit=1.0)
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with pytest.raises(FloatingPointError), rec.step(0):
        (model(torch.ones(2, 3)) * 100).sum().backward()
    case_dir = tmp_path / "cases" / "BackwardBoom"
    doc = read_toml(case_dir)
    assert doc["inputs"]["gpucase_module"]["grad_outputs"] == {"0": "grad_output.0"}
    assert doc["origin"]["grad_output"].startswith("saved as captured: the loss was computed")
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "FloatingPointError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


def test_autocast_context_is_recorded_and_replayed(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases")
    matmul = rec.watch(model_targets.mixed_matmul)
    x, w = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 4)
    with pytest.raises(IndexError), torch.autocast("cpu", dtype=torch.bfloat16):
        matmul(x, w, torch.tensor([5]))
    case_dir = tmp_path / "cases" / "mixed_matmul"
    context = read_toml(case_dir)["context"]
    assert context["autocast"] == {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}
    case = load_case(case_dir)
    assert case.context.compute_dtype == "bfloat16"  # the item id names bfloat16
    verdict = replay_cpu(case_dir)
    # Without autocast the replay would raise "expected m1 and m2 to have the same dtype".
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary


ASSERT_LINE = ("/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: "
               "block: [0,0,0], thread: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.")


@pytest.mark.parametrize(("error", "message", "stderr", "expected"), [
    ("RuntimeError", "CUDA error: device-side assert triggered", ASSERT_LINE,
     "index-out-of-range"),
    ("RuntimeError", "CUDA error: device-side assert triggered", "", "device-side-assert"),
    ("IndexError", "index out of range in self", "", "index-out-of-range"),
    ("IndexError", "Target 4 is out of bounds.", "", "index-out-of-range"),
    ("RuntimeError", "expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != "
     "float", "", "dtype-mismatch"),
    ("torch.OutOfMemoryError", "", "", "oom"),
    ("ValueError", "something else", "", None),
])
def test_failure_class(error: str, message: str, stderr: str, expected: str | None) -> None:
    assert failure_class(error, message, stderr) == expected


def test_device_side_assert_is_known_as_the_cpu_index_error() -> None:
    assert same_failure("device-side-assert", "index-out-of-range")
    assert same_failure("index-out-of-range", "device-side-assert")
    assert not same_failure("index-out-of-range", "dtype-mismatch")
    case = SimpleNamespace(origin={"error": "RuntimeError: CUDA error: device-side assert "
                                            "triggered", "stderr": ASSERT_LINE})
    cpu = SimpleNamespace(outcome=SimpleNamespace(
        broken_case=False, error_type="IndexError", error_message="index out of range in self",
        kind="raises", status="failed"), child=SimpleNamespace(stderr=""),
        spec=SimpleNamespace(device="cpu"))
    assert is_known_failure(case, cpu)  # type: ignore[arg-type]
    other = SimpleNamespace(outcome=SimpleNamespace(
        broken_case=False, error_type="RuntimeError",
        error_message="expected m1 and m2 to have the same dtype", kind="raises",
        status="failed"), child=SimpleNamespace(stderr=""), spec=SimpleNamespace(device="cpu"))
    assert not is_known_failure(case, other)  # type: ignore[arg-type]
    # The recorded exception is gone and the outputs differ: another failure, not this one.
    mismatch = SimpleNamespace(outcome=SimpleNamespace(
        broken_case=False, error_type=None, error_message=None, kind="mismatch"),
        child=SimpleNamespace(stderr=""))
    assert not is_known_failure(case, mismatch)  # type: ignore[arg-type]


def test_scoped_xfail(tmp_path: Path) -> None:
    (tmp_path / "case.py").write_text("def run(x):\n    return x\n")
    (tmp_path / "case.toml").write_text(
        'format = 1\ncall = "case.py:run"\n'
        'xfail = { reason = "fp16 overflow", devices = ["cuda"], dtypes = ["float16"] }\n')
    case = load_case(tmp_path)
    assert case.xfail_for("cuda", "float16", None) == "fp16 overflow"
    assert case.xfail_for("cuda", "float32", None) is None
    assert case.xfail_for("cpu", "float16", "batch") is None


class InPlaceLM(model_targets.TinyLM):
    """TinyLM whose forward doubles the caller's token ids in place before embedding them."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens.mul_(2)
        return super().forward(tokens)


@pytest.mark.parametrize("limit", [None, 0], ids=["copied-before", "over-limit"])
def test_a_module_whose_forward_changes_its_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: int | None) -> None:
    """The module watch takes the same snapshot as a watched function: its inputs as
    passed, or, over the limit, as changed and said so."""
    kwargs = {} if limit is None else {"snapshot_limit": limit}
    rec = Recorder(tmp_path / "cases", narrow=False, **kwargs)
    model = rec.watch(InPlaceLM(), name="inplace")
    tokens = torch.tensor([[1, 5, 3]])
    with pytest.raises(IndexError, match="index out of range in self"), rec.step(0):
        model(tokens)
    assert tokens.tolist() == [[2, 10, 6]]
    case_dir = tmp_path / "cases" / "inplace"
    saved = payload.load(case_dir / "inputs.safetensors")["tokens"].tolist()
    snapshot = read_toml(case_dir)["origin"]["snapshot"]
    err = capsys.readouterr().err
    if limit is None:
        assert saved == [[1, 5, 3]]
        assert snapshot == "tensors copied before the call"
        assert "changed tokens in place" not in err
    else:
        assert saved == [[2, 10, 6]]
        assert snapshot.startswith("host tensors, as they were after the failure; changed in "
                                   "place by the failing call, so saved as changed: tokens (not "
                                   "copied before the call: over the snapshot limit of 0.0 MiB")
        assert "gpucase: note: the failing call of inplace changed tokens in place" in err
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    assert rec.narrowed == []


class ShiftEmbedding(torch.nn.Embedding):
    """An embedding that shifts the caller's ids by one in place before looking them up."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input.add_(1)
        return super().forward(input)


class ShiftLM(torch.nn.Module):
    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.emb = ShiftEmbedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))  # type: ignore[no-any-return]


def test_a_submodule_that_changed_its_input_is_not_narrowed_from_changed_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The innermost module changed its input in place before it raised: a case of it would
    hold the changed ids. None is written; the op is searched for in a replay of the model's
    case (inputs copied before), so the op case holds what the op was passed."""
    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases")
    model = rec.watch(ShiftLM())
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[1, 7, 3]]))
    whole = tmp_path / "cases" / "ShiftLM"
    assert payload.load(whole / "inputs.safetensors")["tokens"].tolist() == [[1, 7, 3]]
    err = capsys.readouterr().err
    assert (f"gpucase: note: emb not narrowed: its forward changed input in place before it "
            f"raised, so its inputs as passed are gone ({whole} holds the module's inputs as "
            "passed)") in err.splitlines()
    assert [p.name for p in rec.narrowed] == ["ShiftLM.aten.embedding.default"]
    op_case = rec.narrowed[0]
    ids = [t for t in payload.load(op_case / "inputs.safetensors").values()
           if t.dtype == torch.int64]
    assert [t.tolist() for t in ids] == [[[2, 8, 4]]]  # what the op was passed
    assert "narrowed cases" not in err and "narrowed case of" not in err  # small: no size note


def test_large_narrowed_cases_are_sized_and_noted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The saved lines give sizes, and one note says what the narrowed cases add beside the
    module's case (thresholds lowered to the test's tiny model)."""
    monkeypatch.setattr(write, "_SHOWN_SIZE", 0)
    monkeypatch.setattr(narrow, "_NARROWED_NOTE_SIZE", 0)
    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases")
    model = rec.watch(model_targets.TinyLM())
    with pytest.raises(IndexError):
        model(torch.tensor([[8]]))
    err = capsys.readouterr().err.splitlines()
    cases = tmp_path / "cases"
    saved = [line for line in err if line.startswith("gpucase: saved")]
    assert [re.sub(r"\d+\.\d MiB", "N MiB", line) for line in saved] == [
        f"gpucase: saved {cases / 'TinyLM'} (N MiB; first failure)",
        f"gpucase: saved {cases / 'TinyLM.emb'} (N MiB; narrowed to module emb)",
        f"gpucase: saved {cases / 'TinyLM.aten.embedding.default'} (N MiB; narrowed to op "
        "aten.embedding.default)"]
    notes = [line for line in err if "narrowed cases of this failure" in line]
    assert len(notes) == 1
    assert notes[0].startswith(
        f"gpucase: note: the 2 narrowed cases of this failure ({cases / 'TinyLM.emb'}, "
        f"{cases / 'TinyLM.aten.embedding.default'}) add ")
    assert notes[0].endswith(
        "(what they share with it is stored once): keep the narrowest case that reproduces "
        "and delete the others, or pass Recorder(narrow=False) to write the module's case "
        "alone")


def test_narrow_false_writes_the_module_case_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases", narrow=False)
    model = rec.watch(model_targets.TinyLM())
    with pytest.raises(IndexError):
        model(torch.tensor([[8]]))
    assert sorted(p.name for p in (tmp_path / "cases").iterdir()) == ["TinyLM"]
    assert rec.narrowed == [] and rec.case_dir == tmp_path / "cases" / "TinyLM"
    err = capsys.readouterr().err
    assert "narrowed" not in err and "no op case" not in err
    verdict = replay_cpu(tmp_path / "cases" / "TinyLM")
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary


def test_a_long_backward_message_replays_as_the_captured_failure(tmp_path: Path) -> None:
    """Issue 30: autograd's "modified by an inplace operation" message is longer than a
    summary line; the case keeps it whole in [origin] error and its replay is the known
    failure, and a case whose error was cut (an older capture's 256 characters and an
    ellipsis) still matches the replay's full message."""
    torch.manual_seed(0)
    model = model_targets.InplaceSigmoid()
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model, name="inplace")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), rec.step(0):
        model(torch.ones(2, 4)).backward()
    case_dir = tmp_path / "cases" / "inplace"
    doc = read_toml(case_dir)
    assert doc["origin"]["error"].endswith("check_nan=False).")
    assert "\u2026" in doc["xfail"]  # the summary's line is cut; [origin] error is not
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == "RuntimeError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)
    text = (case_dir / "case.toml").read_text()
    whole = doc["origin"]["error"]
    (case_dir / "case.toml").write_text(text.replace(whole, whole[:255] + "\u2026"))
    assert is_known_failure(load_case(case_dir), verdict)


def test_the_op_case_of_a_bf16_run_replays_its_recorded_dtypes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: bmm raised on float32 scores and bfloat16 values (autocast off around it);
    the op case replays those dtypes as recorded, without autocast casting them alike."""
    torch.manual_seed(0)
    model = model_targets.Float32Attention()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model, name="attn")
    with pytest.raises(RuntimeError), rec.step(0), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(1, 3, 4))
    op = tmp_path / "cases" / "attn.aten.bmm.default"
    assert op.is_dir(), capsys.readouterr().err
    assert "autocast" not in read_toml(op).get("context", {})
    saved = payload.load(op / "inputs.safetensors")
    assert {t.dtype for t in saved.values()} >= {torch.float32, torch.bfloat16}
    replays_as_known(op, "RuntimeError")


def replays_as_known(case_dir: Path, error: str) -> None:
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.error_type == error, verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)


def test_a_nan_output_is_narrowed_to_the_submodule_that_made_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN no op raised (softmax of an all -inf row, a padding mask's bug): the first
    submodule whose output held it while its inputs were finite gets its own case."""
    torch.manual_seed(0)
    model = model_targets.PadLM()
    rec = Recorder(tmp_path / "cases", nonfinite=True)
    rec.watch(model)
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    with rec.step(0):
        model(tokens, torch.tensor([[False] * 4, [False, False, True, True]]))
    pad = torch.tensor([[False] * 4, [True] * 4])   # a batch row that is all padding
    with pytest.raises(FloatingPointError, match="non-finite output of PadLM"), rec.step(1):
        model(tokens, pad)
    err = capsys.readouterr().err
    assert ("gpucase: note: blocks.0.attn (PadAttention) is the first submodule whose "
            "output held NaN or inf of finite inputs") in err
    # No ATen op raises a NaN: the op search that finds none adds nothing to the story.
    assert "ATen op" not in err and "no op case" not in err, err
    assert [p.name for p in rec.narrowed] == ["PadLM.blocks.0.attn"]
    narrowed = tmp_path / "cases" / "PadLM.blocks.0.attn"
    recipe = read_toml(narrowed)["inputs"]["gpucase_module"]
    assert recipe["factory"] == "tests.model_targets:PadAttention"
    assert recipe["finite"] is True
    saved = payload.load(narrowed / "inputs.safetensors")
    assert torch.equal(saved["pad"], pad) and bool(saved["x"].isfinite().all())
    verdict = replay_cpu(narrowed)
    assert verdict.outcome.error_type == "FloatingPointError", verdict.outcome.summary
    assert is_known_failure(load_case(narrowed), verdict)


@pytest.mark.parametrize(("model", "given", "why"), [
    (model_targets.PadBlock, (torch.tensor([[[float("nan")] * 8]]), torch.tensor([[False]])),
     "the module's inputs already hold NaN or inf (input"),
    (model_targets.NaNLM, (torch.tensor([[1, 7]]),),
     "no submodule's output held NaN or inf of finite inputs: the value arose in NaNLM's "
     "own forward, between its submodules"),
])
def test_a_nan_no_submodule_made_is_said_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: type[torch.nn.Module],
        given: tuple[torch.Tensor, ...], why: str) -> None:
    """No submodule made the NaN (the model was passed it, or made it in its own code
    between its submodules): the note says which, and no submodule case is written."""
    torch.manual_seed(0)
    net = model()
    rec = Recorder(tmp_path / "cases", nonfinite=True)
    rec.watch(net)
    with pytest.raises(FloatingPointError), rec.step(0):
        net(*given)
    err = capsys.readouterr().err
    assert f"gpucase: note: no submodule case written for the non-finite value: {why}" in err
    assert "ATen op" not in err, err   # no op raises a NaN: that note would tell nothing
    assert rec.narrowed == []


def test_a_submodule_that_cannot_be_rebuilt_is_told_its_own_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A factory for the model does not build its submodule: the note names what does
    (the submodule's own arguments kept as attributes), or that nothing needs doing."""
    torch.manual_seed(0)
    model = model_targets.RopeLM()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model, factory="tests.model_targets:RopeLM", kwargs={"vocab": 8, "dim": 6})
    with pytest.raises(RuntimeError, match="must match"), rec.step(0):
        model(torch.tensor([[1, 2]]))
    note = next(line for line in capsys.readouterr().err.splitlines()
                if line.startswith("gpucase: note: rope not narrowed:"))
    assert "rec.watch(model, factory=" not in note
    assert ("a factory for the model does not build Rotary, which a replay builds again from "
            "its own class: keep Rotary.__init__'s arguments as same-named attributes") in note
    assert f"or nothing to do: {tmp_path / 'cases' / 'RopeLM'}, the model's case, holds" in note
    verdict = replay_cpu(tmp_path / "cases" / "RopeLM")
    assert verdict.outcome.error_type == "RuntimeError", verdict.outcome.summary

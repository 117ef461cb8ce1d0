"""The offending value of an index, target or class-range error, read from the case's saved
inputs: value, position, sample id and valid range, in ``gpucase show``, ``gpucase request``
and the triage of a case item; said plainly where the case cannot tell."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.case.load import load_case
from pytest_gpucase.tools.offending import find, item_notes
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.tools.show import request, show
from tests import datafix_targets
from tests.datafix_targets import IDS, record, tokens

pytestmark = pytest.mark.slow  # the Recorder checks each case's rebuild in a process

def test_a_token_id_equal_to_the_vocabulary_is_named_in_every_case(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens())
    named = "idx holds 19 at [1, 1] (sample ex0042); wte has 19 rows (valid 0..18)"
    found = find(load_case(model_case))
    assert found is not None and found.offending is not None
    assert found.offending.describe().startswith(named)
    assert found.offending.saved
    narrowed = sorted(p.name for p in model_case.parent.iterdir() if p != model_case)
    assert narrowed == ["TinyGPT.aten.embedding.default", "TinyGPT.wte"]
    advice = (f"the failure is in the saved batch of {model_case} (sample ex0042 holds token "
              "19, wte has 19 rows): after a data fix it and its narrowed cases cannot pass; "
              f"turn it into a data check with `gpucase data-check {model_case}` (a case "
              "without those samples, expected to pass, and the data contract they broke) and "
              f"delete its narrowed cases (`gpucase narrowed {model_case} --delete`), or "
              "delete them all")
    for name in narrowed:  # the narrowed cases name the model's input and sample too
        text = show(model_case.parent / name)
        assert f"offending value: {named}" in text, text
        assert advice in text   # the same words: a session's summary says them once
    text = show(model_case)
    assert f"offending value: {named}; read with the narrowed case " \
           "TinyGPT.aten.embedding.default" in text
    assert advice in text


def test_a_target_equal_to_the_class_count_is_found_through_its_flattened_view(
        tmp_path: Path) -> None:
    """nanoGPT's loss: cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1);
    the op case holds the flat targets, the model's case the (B, T) batch."""
    torch.manual_seed(0)
    targets = torch.tensor([[1, 2, 3], [4, 19, -1], [1, 1, 1]])
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens(5), targets)
    named = ("targets holds 19 at [1, 1] (sample ex0042); the loss's input has 19 classes "
             "(valid 0..18, or -1 (ignore_index))")
    assert named in show(model_case)
    op_case = model_case.parent / "TinyGPT.aten.nll_loss_forward.default"
    assert f"offending value: {named} (this case's arg1)" in show(op_case)


def test_a_custom_modules_case_reads_the_value_through_its_op_case(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.LookupLM(), tokens())
    module_case = model_case.with_name("LookupLM.lookup")
    assert ("offending value: idx holds 19 at [1, 1] (sample ex0042); lookup has 19 rows "
            "(valid 0..18); read with the narrowed case LookupLM.aten.embedding.default") \
        in show(model_case)
    assert ("offending value: idx holds 19 at [1, 1] (sample ex0042); lookup has 19 rows "
            "(valid 0..18); read with the narrowed case LookupLM.aten.embedding.default") \
        in show(module_case)


@pytest.mark.parametrize(("how", "batch", "op", "said"), [
    ("select", [1, 7, 2], "index_select.default", "idx holds 7 at [1] (sample ex0042); "
     "dimension 0 of the indexed tensor has size 5 (valid 0..4)"),
    ("index", [1, 7, 2], "index.Tensor", "idx holds 7 at [1] (sample ex0042); dimension 0 of "
     "the indexed tensor has size 5 (valid -5..4)"),
    ("gather", [[1, 0], [7, 1], [2, 2]], "gather.default", "idx holds 7 at [1, 0] (sample "
     "ex0042); dimension 0 of the indexed tensor has size 5 (valid 0..4)"),
])
def test_index_ops_name_the_index_and_the_dimension(tmp_path: Path, how: str,
                                                    batch: list[int], op: str,
                                                    said: str) -> None:
    model_case = record(tmp_path / "cases", datafix_targets.Table(how), torch.tensor(batch))
    assert f"offending value: {said}; read with the narrowed case Table.aten.{op}" \
        in show(model_case)
    assert f"offending value: {said} (this case's arg1)" in \
        show(model_case.with_name(f"Table.aten.{op}"))


def test_a_label_the_loss_got_shifted_is_found_in_the_batch(tmp_path: Path) -> None:
    """labels[..., 1:] is no view of the saved labels: the one saved input holding the same
    out-of-range value is named, and said to be a slice of what the op got."""
    torch.manual_seed(0)
    labels = torch.tensor([[1, 2, 3], [4, 5, 19], [1, 1, 1]])
    model_case = record(tmp_path / "cases", datafix_targets.ShiftedLabelsLM(), tokens(5), labels)
    found = find(load_case(model_case))
    assert found is not None and found.offending is not None and found.offending.saved
    assert found.offending.describe().startswith(
        "targets holds 19 at [1, 2] (sample ex0042); the loss's input has 19 classes (valid "
        "0..18, or -100 (ignore_index)) (not the very tensor the failing op got, a slice or a "
        "shift of it holding the same out-of-range values)")


@pytest.mark.parametrize(("target", "shown"), [
    (-5, "target holds -5 at [1] (sample ex0042); the loss's input has 4 classes (valid 0..3, "
         "or -100 (ignore_index))"),
    (4, "target holds 4 at [1] (sample ex0042); the loss's input has 4 classes (valid 0..3, "
        "or -100 (ignore_index))"),
])
def test_a_loss_modules_target_is_checked_against_its_classes(tmp_path: Path, target: int,
                                                              shown: str) -> None:
    loss = torch.nn.CrossEntropyLoss()
    case = record(tmp_path / "cases", loss, torch.zeros(3, 4), torch.tensor([0, target, 1]))
    assert f"offending value: {shown}" in show(case)


def test_many_offending_positions_are_counted_and_a_few_shown(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(5, 2)
    batch = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3], [9, 9, 9, 9]])
    found = find(load_case(record(tmp_path / "cases", emb, batch)))
    assert found is not None and found.offending is not None
    assert found.offending.describe() == (
        "input holds 5 at [0, 0] (sample ex0041), 6 at [0, 1] (sample ex0041), 7 at [0, 2] "
        "(sample ex0041); 8 entries out of range in all; Embedding has 5 rows (valid 0..4)")
    assert found.offending.samples == ("ex0041", "ex0043")


def test_an_index_made_inside_the_model_is_not_blamed_on_the_batch(tmp_path: Path) -> None:
    """ShiftedGPT adds one to every id: the batch holds 18 < 19 and the embedding gets 19."""
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.ShiftedGPT(), tokens(18))
    lines = item_notes(load_case(model_case))
    assert lines == [
        "offending value: arg1 holds 19 at [1, 1] (sample ex0042); wte has 19 rows "
        "(valid 0..18); no saved input of ShiftedGPT holds these values (the narrowed case "
        "ShiftedGPT.aten.embedding.default does): they were computed inside the model, a bug "
        "of the code, not the data"]
    op_lines = item_notes(load_case(model_case.with_name("ShiftedGPT.aten.embedding.default")))
    assert len(op_lines) == 1 and "the model computed them, so no fix upstream of this call " \
        "can make this case pass" in op_lines[0]


def test_a_case_that_cannot_tell_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens(), narrow=False)
    assert item_notes(load_case(model_case)) == [
        "offending value: cannot be named from this case: the failing index is used inside "
        "TinyGPT, and neither a narrowed case of the failing op or layer beside it nor the "
        "error message says which saved value it is; its integer inputs hold idx 1..19 (19 at "
        "[1, 1], sample ex0042)"]


def onehot(labels: torch.Tensor) -> torch.Tensor:
    return F.one_hot(labels, 5)


def pick(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, index)


@pytest.mark.parametrize(("function", "args", "said"), [
    (pick, (torch.zeros(3, 4), torch.tensor([[0], [4], [1]])),
     "offending value: index holds 4 at [1, 0] (sample ex0042); dimension 1 it indexes has "
     "size 4 (valid 0..3)"),
    # The message names no value: the op that raised, found by a replay, says it (one_hot
    # raises in its own composite body, seen by a torch function mode).
    (onehot, (torch.tensor([1, 5, 2]),),
     "offending value: labels holds 5 at [1] (sample ex0042); one_hot's num_classes is 5 "
     "(valid 0..4)"),
])
def test_a_functions_case_reads_the_value_its_message_names(
        tmp_path: Path, function: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...],
        said: str) -> None:
    rec = Recorder(tmp_path / "cases")
    watched = rec.watch(function)
    with pytest.raises(RuntimeError), rec.step(0, sample_ids=IDS):
        watched(*args)
    assert rec.case_dir is not None
    assert item_notes(load_case(rec.case_dir), replay=True)[0].startswith(said)


def test_a_watched_loss_function_names_the_range_its_op_saw(tmp_path: Path) -> None:
    """A plain loop's watched loss: the message names the label only (Target 50 is out of
    bounds); the op that raised (nll_loss on the (B*T, 50) logits) gives the class count."""
    from pytest_gpucase.tools.datacheck import data_check

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 50, generator=generator)
    targets = torch.randint(0, 50, (4, 3), generator=generator)
    targets[2, 2] = 50
    ids = [f"s{i:04d}" for i in range(8, 12)]
    rec = Recorder(tmp_path / "cases")
    loss = rec.watch(datafix_targets.masked_ce)
    with pytest.raises(IndexError, match="Target 50 is out of bounds"), \
            rec.step(3, sample_ids=ids):
        loss(logits, targets, torch.ones(4, 3))
    assert rec.case_dir is not None
    from pytest_gpucase.tools.offending import triaged
    from tests.helpers import replay_cpu

    verdict, _ = triaged(replay_cpu(rec.case_dir))   # the case's run: replayed for the op
    assert verdict.triage is not None
    assert ("offending value: targets holds 50 at [2, 2] (sample s0010); the loss's input has "
            "50 classes (valid 0..49, or -100 (ignore_index))") in verdict.triage.notes
    # gpucase show reads the case without running it: the message's value alone.
    assert ("offending value: targets holds 50 at [2, 2] (sample s0010); the error names this "
            "value; the valid range is not saved in the case") in show(rec.case_dir)
    result = data_check(rec.case_dir, run=False)
    assert result.dropped_ids == ("s0010",) and result.contract is not None
    assert "[fields.targets]\ndtype = \"int64\"\nmin = 0\nmax = 49\n" in \
        result.contract.read_text()


def test_no_finding_for_other_failures_and_none_without_inputs(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    case = record(tmp_path / "a", lin, torch.zeros(2, 5))
    assert find(load_case(case)) is None
    assert "offending" not in show(case)
    emb_case = record(tmp_path / "b", torch.nn.Embedding(3, 2), torch.tensor([[3]]))
    (emb_case / "inputs.safetensors").unlink()
    assert item_notes(load_case(emb_case)) == [
        "offending value: the case saved no inputs (no inputs.safetensors), so the value "
        "cannot be read; the error message is all there is"]


def test_request_names_the_value_and_withholds_the_sample(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens())
    text = request(model_case)
    assert ("- note: offending value: idx holds 19 at [1, 1] (sample <sample id>); wte has "
            "19 rows (valid 0..18)") in text
    assert "ex0042" not in text
    # Issue 33: the scrubber took "pass:" in the tool's own advice for a label.
    assert ("- avoid: Do not clamp the indices or enlarge the layer to make it pass: find "
            "where the out-of-range value was made") in text


def test_the_case_item_triage_and_summary_name_the_value(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_case = record(tmp_path / "cases", datafix_targets.TinyGPT(), tokens())
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider",
         "--gpu-cases", str(model_case), "--runxfail", "-q", "--rootdir", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert "gpucase triage" in out, out
    assert "offending value: idx holds 19 at [1, 1] (sample ex0042); wte has 19 rows " \
           "(valid 0..18)" in out
    assert f"gpucase: the failure is in the saved batch of {model_case} (sample ex0042 holds " \
           "token 19" in out


def test_a_hand_written_cases_item_reads_the_value_its_run_names(tmp_path: Path) -> None:
    """No [origin] at all: the message of the run that failed names the value."""
    from pytest_gpucase.tools.offending import triaged
    from tests.helpers import replay_cpu, write_case

    case = write_case(tmp_path, "pick", """
        format = 1
        call = "case.py:pick"
        """, """
        import torch

        def pick(x, index):
            return torch.gather(x, 1, index)
        """, {"x": torch.zeros(3, 4), "index": torch.tensor([[0], [4], [1]])})
    verdict, advice = triaged(replay_cpu(case))
    assert verdict.triage is not None
    assert ("offending value: index holds 4 at [1, 0]; dimension 1 it indexes has size 4 "
            "(valid 0..3)") in verdict.triage.notes
    assert advice == [
        f"the failure is in the saved batch of {case} (entry 1 of index holds index 4, "
        "dimension 1 it indexes has size 4): after a data fix this case cannot pass; turn it "
        f"into a data check with `gpucase data-check {case}` (a case without those samples, "
        "expected to pass, and the data contract they broke), or delete it"]

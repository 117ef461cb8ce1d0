"""Edge variants: which ones a case asks for, and how each is built from the saved inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.case.model import AxisSizes, Boundaries, Expectation, VariantTables
from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.variants import (
    NotClassIndices,
    Variant,
    VariantNotApplicable,
    VariantTooLarge,
    apply,
    expand,
    members,
    describe_boundary,
    describe_resize,
    describe_saved,
    members_of,
    named_parameter,
    resized_elements,
)
from tests.helpers import recorded_ce_case

REJECT = Expectation(outcome="raises", exception="ValueError", match="out of range")


def boundaries(classes: int = 4, ignore_index: int | None = -100,
               reject: Expectation | None = REJECT) -> VariantTables:
    return VariantTables(boundaries=Boundaries("target", classes, ignore_index), reject=reject)


def labels(variants: list[Variant]) -> list[str]:
    return [v.label for v in variants]


def snapshot(inputs: dict[str, Any]) -> dict[str, Any]:
    """Deep copies of the tensors, to show afterwards that the saved ones were not written to."""
    return {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}


def assert_untouched(inputs: dict[str, Any], before: dict[str, Any]) -> None:
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(inputs[name], value), name
        else:
            assert inputs[name] == value, name


# ----------------------------------------------------------------------------- expand


def test_expand_lists_batch_then_length_then_boundaries() -> None:
    tables = VariantTables(batch=AxisSizes(0, (1, 2)), length=AxisSizes(1, (1, 4096)),
                           boundaries=Boundaries("target", 4, -100), reject=REJECT)
    found = expand(tables)
    assert labels(found) == ["batch=1", "batch=2", "length=1", "length=4096", "boundary=0",
                             "boundary=3", "boundary=-100", "boundary=-1", "boundary=4"]
    assert [v.kind for v in found] == ["batch"] * 2 + ["length"] * 2 + ["boundary"] * 5
    assert [v.axis for v in found[:4]] == [0, 0, 1, 1]
    # Batch and length variants read the saved size off the class-index input.
    assert {v.input for v in found} == {"target"}
    assert {v.ignore_index for v in found[4:]} == {-100}


def test_only_out_of_range_values_carry_the_reject_expectation() -> None:
    found = {v.value: v.reject for v in expand(boundaries())}
    assert found == {0: None, 3: None, -100: None, -1: REJECT, 4: REJECT}


@pytest.mark.parametrize(("tables", "expected"), [
    pytest.param(boundaries(classes=1), ["boundary=0", "boundary=-100", "boundary=-1",
                                         "boundary=1"], id="one-class: 0 == classes-1"),
    pytest.param(boundaries(ignore_index=None), ["boundary=0", "boundary=3", "boundary=-1",
                                                 "boundary=4"], id="no-ignore-index"),
    pytest.param(boundaries(ignore_index=0), ["boundary=0", "boundary=3", "boundary=-1",
                                              "boundary=4"], id="ignore-index-in-range"),
    pytest.param(boundaries(classes=1, ignore_index=None), ["boundary=0", "boundary=-1",
                                                            "boundary=1"], id="one-class-alone"),
])
def test_each_boundary_value_appears_once(tables: VariantTables, expected: list[str]) -> None:
    assert labels(expand(tables)) == expected


def test_an_ignore_index_of_minus_one_is_accepted_not_rejected() -> None:
    found = {v.value: v.reject for v in expand(boundaries(ignore_index=-1))}
    assert found == {0: None, 3: None, -1: None, 4: REJECT}


def test_out_of_range_values_need_a_reject_expectation() -> None:
    # case.py insists on [variants.reject]; without one there is nothing to check them against.
    assert labels(expand(boundaries(reject=None))) == ["boundary=0", "boundary=3",
                                                       "boundary=-100"]


def test_no_tables_no_variants() -> None:
    assert expand(VariantTables()) == []


def test_batch_variants_without_boundaries_have_no_anchor() -> None:
    found = expand(VariantTables(length=AxisSizes(2, (8,))))
    assert found == [Variant("length", 8, axis=2)]


# ----------------------------------------------------------------------------- members


def test_members_are_the_inputs_sharing_the_leading_sizes() -> None:
    inputs = {"logits": torch.zeros(5, 3), "target": torch.zeros(5, dtype=torch.long),
              "weight": torch.ones(3), "num_classes": 3}
    assert members(inputs, 0) == (5, ("logits", "target"))
    assert members(inputs, 1) == (3, ("logits",))
    assert members(inputs, 2) is None


def test_a_class_weight_stays_whole_when_the_batch_is_as_large_as_the_class_count() -> None:
    # B == C == 4: sizes alone cannot tell the class weight (C,) from the target (B,).
    inputs = {"logits": torch.zeros(4, 4), "target": torch.zeros(4, dtype=torch.long),
              "weight": torch.ones(4)}
    assert members(inputs, 0) == (4, ("logits", "target"))
    assert members(inputs, 0, anchor="target") == (4, ("logits", "target"))


def test_integer_and_bool_inputs_are_never_taken_for_parameters() -> None:
    inputs = {"x": torch.zeros(4, 4), "index": torch.zeros(4, dtype=torch.int32),
              "mask": torch.ones(4, dtype=torch.bool), "scale": torch.ones(4)}
    assert members(inputs, 0) == (4, ("x", "index", "mask"))


def test_inputs_of_the_data_shape_follow_the_batch() -> None:
    inputs = {"logits": torch.zeros(4, 4), "probabilities": torch.full((4, 4), 0.25),
              "per_element_weight": torch.ones(4, 4)}
    assert members(inputs, 0) == (4, ("logits", "probabilities", "per_element_weight"))


def test_the_boundaries_input_anchors_the_batch_when_a_table_is_larger() -> None:
    # F.embedding: the vocabulary table is the largest tensor, the indices are the batch.
    inputs = {"weight": torch.zeros(100, 8), "indices": torch.zeros(3, 5, dtype=torch.long)}
    assert members(inputs, 0, anchor="indices") == (3, ("indices",))
    # Without the anchor too: a tensor named as a parameter is never cut by inference.
    assert members(inputs, 0) == (3, ("indices",))


def test_an_anchor_without_the_axis_falls_back_to_the_largest_input() -> None:
    inputs = {"x": torch.zeros(2, 6, 3), "target": torch.zeros(2, dtype=torch.long)}
    assert members(inputs, 1, anchor="target") == (6, ("x",))
    assert members(inputs, 1, anchor="missing") == (6, ("x",))


def test_members_from_shapes_alone_agree_with_members() -> None:
    """The dry run reads shapes from a payload's header; it must pick the same members."""
    inputs = {"logits": torch.zeros(4, 4), "target": torch.zeros(4, dtype=torch.long),
              "weight": torch.ones(4), "n": 4}
    shapes = {"logits": ((4, 4), True), "target": ((4,), False), "weight": ((4,), True)}
    for axis, anchor in ((0, None), (0, "target"), (1, None), (2, None)):
        assert members_of(shapes, axis, anchor) == members(inputs, axis, anchor)


def test_a_variant_too_large_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = {"x": torch.zeros(300, 1000), "mask": torch.ones(300, 1000, dtype=torch.bool)}
    big = Variant("batch", 2**20, axis=1)  # 2 * 300 * 2**20 elements: over 2**28
    assert resized_elements(big, {"x": ((300, 1000), True), "mask": ((300, 1000), False)}) == (
        2 * 300 * 2**20)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("allocated")

    monkeypatch.setattr(torch, "arange", refuse)
    with pytest.raises(VariantTooLarge) as excinfo:
        apply(Variant("length", 2**20, axis=1), inputs)
    assert str(excinfo.value) == (
        "length=1048576: the resized inputs would hold 629145600 elements, over the limit of "
        "268435456; try a smaller size")


# ----------------------------------------------------------------------------- batch


def test_batch_takes_the_first_entries_of_every_batched_input() -> None:
    logits = torch.arange(15.0).reshape(5, 3)
    target = torch.tensor([0, 2, 1, 1, 0])
    weight = torch.tensor([1.0, 2.0, 3.0])
    inputs: dict[str, Any] = {"logits": logits, "target": target, "weight": weight,
                              "num_classes": 3}
    before = snapshot(inputs)
    got = apply(Variant("batch", 2), inputs)
    assert torch.equal(got["logits"], logits[:2])
    assert torch.equal(got["target"], torch.tensor([0, 2]))
    assert got["weight"] is weight
    assert got["num_classes"] == 3
    assert_untouched(inputs, before)


def test_batch_as_large_as_the_class_count_gives_a_valid_cross_entropy_call() -> None:
    torch.manual_seed(0)
    inputs: dict[str, Any] = {"input": torch.randn(4, 4), "target": torch.tensor([3, 0, 1, 2]),
                              "weight": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    for anchor in (None, "target"):
        got = apply(Variant("batch", 2, input=anchor), inputs)
        assert got["weight"] is inputs["weight"]
        assert torch.equal(got["target"], torch.tensor([3, 0]))
        expected = F.cross_entropy(inputs["input"][:2], inputs["target"][:2], inputs["weight"])
        assert torch.equal(F.cross_entropy(**got), expected)


def test_batch_of_the_saved_size_gives_the_saved_values() -> None:
    inputs = {"x": torch.arange(6.0).reshape(3, 2)}
    assert torch.equal(apply(Variant("batch", 3), inputs)["x"], inputs["x"])


def test_a_batch_larger_than_the_saved_one_is_not_applicable() -> None:
    inputs = {"x": torch.zeros(3, 2), "target": torch.zeros(3, dtype=torch.long)}
    with pytest.raises(VariantNotApplicable,
                       match=r"^batch=8: the saved batch holds 3 entries on axis 0$"):
        apply(Variant("batch", 8), inputs)


def test_no_tensor_with_the_axis_is_not_applicable() -> None:
    with pytest.raises(VariantNotApplicable, match=r"^length=4: no tensor input has an axis 1$"):
        apply(Variant("length", 4, axis=1), {"x": torch.zeros(3), "n": 2})


def test_an_empty_axis_cannot_be_repeated() -> None:
    with pytest.raises(VariantNotApplicable,
                       match=r"^length=4: the saved inputs are empty on axis 1$"):
        apply(Variant("length", 4, axis=1), {"x": torch.zeros(2, 0, 3)})


def test_batch_of_a_non_contiguous_input_keeps_its_strides() -> None:
    x = torch.arange(24.0).reshape(4, 3, 2).transpose(0, 1)     # (3, 4, 2), batch axis 0
    mask = torch.tensor([[True, False, True, True]] * 3)
    got = apply(Variant("batch", 2), {"x": x, "mask": mask})
    assert not x.is_contiguous()
    assert torch.equal(got["x"], x.contiguous()[:2])
    assert got["x"].stride() == x.stride()
    assert torch.equal(got["mask"], mask[:2])


# ----------------------------------------------------------------------------- length


def sequence_inputs() -> dict[str, Any]:
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return {"x": x, "mask": mask, "proj": torch.eye(3), "bias": torch.zeros(5, 5),
            "causal": True}


def test_length_truncates_the_inputs_on_that_axis() -> None:
    inputs = sequence_inputs()
    before = snapshot(inputs)
    got = apply(Variant("length", 3, axis=1), inputs)
    assert torch.equal(got["x"], inputs["x"][:, :3])
    assert torch.equal(got["mask"], inputs["mask"][:, :3])
    # (3, 3) and (5, 5) do not share x's leading sizes (2, 5): they stay whole.
    assert got["proj"] is inputs["proj"]
    assert got["bias"] is inputs["bias"]
    assert got["causal"] is True
    assert_untouched(inputs, before)


def test_length_repeats_the_saved_entries_cyclically() -> None:
    inputs = sequence_inputs()
    before = snapshot(inputs)
    got = apply(Variant("length", 12, axis=1), inputs)
    order = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert got["x"].shape == (2, 12, 3)
    assert torch.equal(got["x"], inputs["x"][:, order])
    assert got["mask"].tolist() == [[True, True, True, False, False] * 2 + [True, True],
                                    [True] * 12]
    assert got["x"][1, 7].tolist() == [21.0, 22.0, 23.0]     # entry 7 repeats entry 2
    assert_untouched(inputs, before)


def test_length_of_a_non_contiguous_input_is_correct() -> None:
    base = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(3, 5, 2)
    x = base.permute(2, 1, 0)                                   # (2, 5, 3), not contiguous
    mask = torch.ones(5, 2, dtype=torch.bool).t()               # (2, 5), not contiguous
    for size, order in ((2, [0, 1]), (7, [0, 1, 2, 3, 4, 0, 1])):
        got = apply(Variant("length", size, axis=1), {"x": x, "mask": mask})
        assert torch.equal(got["x"], x.contiguous()[:, order])
        assert torch.equal(got["mask"], mask.contiguous()[:, order])
    assert apply(Variant("length", 2, axis=1), {"x": x})["x"].stride() == x.stride()


# ----------------------------------------------------------------------------- boundaries


@pytest.mark.parametrize("value", [0, 3, -100, -1, 4])
def test_the_first_entry_not_ignored_is_set_to_the_value(value: int) -> None:
    target = torch.tensor([[-100, 2], [1, -100]])
    inputs: dict[str, Any] = {"logits": torch.zeros(2, 2, 4), "target": target,
                              "ignore_index": -100}
    before = snapshot(inputs)
    got = apply(Variant("boundary", value, input="target", ignore_index=-100), inputs)
    assert got["target"].tolist() == [[-100, value], [1, -100]]
    assert got["target"].dtype == torch.int64
    assert got["logits"] is inputs["logits"]
    assert got["ignore_index"] == -100
    assert_untouched(inputs, before)


def test_without_ignore_index_the_first_entry_is_set() -> None:
    got = apply(Variant("boundary", 4, input="target"), {"target": torch.tensor([-100, 1])})
    assert got["target"].tolist() == [4, 1]


def test_the_boundary_target_shares_no_memory_with_the_saved_one() -> None:
    target = torch.tensor([1, 2, 3])
    got = apply(Variant("boundary", 0, input="target"), {"target": target})["target"]
    got[1:] = 9
    assert target.tolist() == [1, 2, 3]
    assert got.untyped_storage().data_ptr() != target.untyped_storage().data_ptr()


def test_a_non_contiguous_target_keeps_its_layout() -> None:
    target = torch.tensor([[-100, 1], [2, 3]]).t()              # logically [[-100, 2], [1, 3]]
    got = apply(Variant("boundary", 7, input="target", ignore_index=-100),
                {"target": target})["target"]
    assert got.tolist() == [[-100, 7], [1, 3]]
    assert (got.stride(), got.storage_offset()) == (target.stride(), target.storage_offset())
    assert target.tolist() == [[-100, 2], [1, 3]]


def test_a_sliced_target_keeps_its_offset_and_step() -> None:
    target = torch.arange(10)[3::2]                             # [3, 5, 7, 9], offset 3, step 2
    got = apply(Variant("boundary", -1, input="target"), {"target": target})["target"]
    assert got.tolist() == [-1, 5, 7, 9]
    assert (got.stride(), got.storage_offset()) == ((2,), 3)
    assert target.tolist() == [3, 5, 7, 9]


def test_an_expanded_target_changes_one_entry_only() -> None:
    target = torch.tensor([2]).expand(4)                        # every entry is one element
    got = apply(Variant("boundary", 0, input="target"), {"target": target})["target"]
    assert got.tolist() == [0, 2, 2, 2]
    assert target.tolist() == [2, 2, 2, 2]


def test_a_scalar_target() -> None:
    got = apply(Variant("boundary", 3, input="target"), {"target": torch.tensor(1)})
    assert got["target"].item() == 3


def test_a_target_of_ignored_entries_only_is_not_applicable() -> None:
    with pytest.raises(VariantNotApplicable,
                       match=r"^boundary=0: every entry of 'target' is ignore_index \(-100\)$"):
        apply(Variant("boundary", 0, input="target", ignore_index=-100),
              {"target": torch.full((2, 3), -100)})


@pytest.mark.parametrize("inputs", [{"labels": torch.zeros(3, dtype=torch.long)},
                                    {"target": 3}], ids=["missing", "not-a-tensor"])
def test_a_missing_target_is_not_applicable(inputs: dict[str, Any]) -> None:
    with pytest.raises(VariantNotApplicable,
                       match=r"^boundary=4: no tensor input named 'target'$"):
        apply(Variant("boundary", 4, input="target"), inputs)


def test_an_empty_target_is_not_applicable() -> None:
    with pytest.raises(VariantNotApplicable, match=r"^boundary=0: 'target' is empty$"):
        apply(Variant("boundary", 0, input="target"), {"target": torch.zeros(0, dtype=torch.long)})


def test_a_value_the_dtype_cannot_hold_is_not_applicable() -> None:
    # uint8 would store -1 as 255: a different test, passed off as the boundary.
    target = torch.tensor([1, 2], dtype=torch.uint8)
    with pytest.raises(VariantNotApplicable,
                       match=r"^boundary=-1: 'target' is torch.uint8, which cannot hold -1$"):
        apply(Variant("boundary", -1, input="target"), {"target": target})
    assert apply(Variant("boundary", 4, input="target"), {"target": target})["target"].tolist() \
        == [4, 2]


def test_a_bool_target_is_a_broken_case() -> None:
    # Was a skip; a boundaries table on no class indices is the case's mistake (the run
    # reports it as a broken case, gpucase validate as a problem).
    with pytest.raises(NotClassIndices, match=r"^input 'target' holds bool, not class indices"):
        apply(Variant("boundary", 1, input="target"), {"target": torch.ones(2, dtype=torch.bool)})


def test_a_floating_boundaries_input_is_a_broken_case_naming_the_integer_inputs() -> None:
    """A typo (input = "logits") wrote -1 and 4 into a logit and ran."""
    inputs = {"logits": torch.zeros(5, 4), "target": torch.tensor([1, 2, 0, 3, 1])}
    with pytest.raises(NotClassIndices) as excinfo:
        apply(Variant("boundary", 4, input="logits"), inputs)
    assert str(excinfo.value) == (
        "input 'logits' holds float32, not class indices: a boundary variant writes class "
        "indices (0, classes - 1, -1, classes) into it; name the integer class-index input, "
        "e.g. input = \"target\"")
    assert torch.equal(inputs["logits"], torch.zeros(5, 4))


def test_a_batch_larger_than_saved_is_not_applicable_in_show_as_in_the_run() -> None:
    """One rule: gpucase show printed 'resized (5, 4) -> (8, 4)' where the run skipped."""
    shapes = {"logits": ((5, 4), True), "target": ((5,), False)}
    inputs = {"logits": torch.zeros(5, 4), "target": torch.zeros(5, dtype=torch.long)}
    with pytest.raises(VariantNotApplicable) as run:
        apply(Variant("batch", 8), inputs)
    assert str(run.value) == "batch=8: the saved batch holds 5 entries on axis 0"
    assert describe_resize(Variant("batch", 8), shapes) == (
        "batch[8]: not applicable: the saved batch holds 5 entries on axis 0")
    assert describe_resize(Variant("length", 8), shapes) == (
        "length[8]: resized logits (5, 4) -> (8, 4), target (5,) -> (8,)")


@pytest.mark.parametrize(("reject", "said"), [
    (REJECT, "makes -1 an out-of-range class index the case must reject ([variants.reject]: "
             "ValueError matching 'out of range')"),
    (None, "makes -1 a value the case accepts: the call must give the reference's outputs"),
], ids=["rejected", "accepted"])
def test_a_boundary_says_which_entry_it_set_and_what_the_case_wants(
        reject: Expectation | None, said: str) -> None:
    variant = Variant("boundary", -1, input="target", ignore_index=-100, reject=reject)
    target = torch.tensor([[-100, 2], [0, 1]])
    assert describe_boundary(variant, target) == (
        f"boundary[-1]: set target[0, 1] = -1 (saved 2); [variants] boundaries in case.toml {said}")
    # The entry described is the entry the run sets.
    assert apply(variant, {"target": target})["target"][0, 1].item() == -1
    assert describe_boundary(variant, None).startswith(
        "boundary[-1]: set the first entry of target not equal to ignore_index (-100) = -1; ")


def test_describe_saved_reads_a_boundary_from_the_payload(tmp_path: Path) -> None:
    from pytest_gpucase.case import payload

    (tmp_path / "case.toml").write_text(
        'format = 1\ncall = "case.py:run"\n[variants]\n'
        'boundaries = { input = "target", classes = 4 }\n'
        '[variants.reject]\nexception = "ValueError"\n')
    (tmp_path / "case.py").write_text("def run(target):\n    return target\n")
    payload.save(tmp_path / "inputs.safetensors", {"target": torch.tensor([3, 1])})
    case = load_case(tmp_path)
    [zero, three, minus_one, _] = expand(case.variants)
    assert describe_saved(three, case) == (
        "boundary[3]: set target[0] = 3 (saved 3); [variants] boundaries in case.toml makes 3 a "
        "value the case accepts: the call must give the reference's outputs")
    assert describe_saved(zero, case).startswith("boundary[0]: set target[0] = 0 (saved 3); ")
    assert describe_saved(minus_one, case) == (
        "boundary[-1]: set target[0] = -1 (saved 3); [variants] boundaries in case.toml makes -1 "
        "an out-of-range class index the case must reject ([variants.reject]: ValueError)")


# ------------------------------------------------------------- the one axis rule, named inputs


LOGITS_WEIGHT_TARGET = {"logits": ((4, 4), True), "weight": ((4,), True),
                        "target": ((4,), False)}


def test_the_variant_cuts_logits_and_target_but_never_the_class_weight() -> None:
    variant = Variant("batch", 1)
    assert members_of(LOGITS_WEIGHT_TARGET, 0) == (4, ("logits", "target"))
    inputs = {"logits": torch.zeros(4, 4), "weight": torch.ones(4),
              "target": torch.zeros(4, dtype=torch.long)}
    resized = apply(variant, inputs)
    assert {name: tuple(t.shape) for name, t in resized.items()} == {
        "logits": (1, 4), "weight": (4,), "target": (1,)}
    assert describe_resize(variant, LOGITS_WEIGHT_TARGET) == (
        "batch[1]: resized logits (4, 4) -> (1, 4), target (4,) -> (1,)")


def test_model_weights_larger_than_the_batch_never_anchor_it() -> None:
    # A minimized real model: the weights outsize the two samples.
    shapes = {"x": ((2, 16), True), "target": ((2,), False),
              "fc1.weight": ((64, 16), True), "fc1.bias": ((64,), True)}
    assert members_of(shapes, 0) == (2, ("x", "target"))


def test_an_unnamed_weight_beside_lone_samples_is_a_doubt_that_asks_for_inputs() -> None:
    shapes = {"x": ((2, 16), True), "w1": ((64, 16), True)}
    # The example names inputs of one size (x and w1 together would be refused): it works as
    # written, and names the table to add it to.
    with pytest.raises(VariantNotApplicable,
                       match=r'to \[variants.batch\] in case.toml, e.g. inputs = \["x"\]$'):
        members_of(shapes, 0)
    assert members_of(shapes, 0, names=("x",)) == (2, ("x",))


def test_a_parameter_name_with_the_batch_size_is_a_doubt() -> None:
    shapes = {"logits": ((4, 10), True), "sample_weight": ((4,), True)}
    with pytest.raises(VariantNotApplicable, match=r"sample_weight .* named as a parameter"):
        members_of(shapes, 0)
    assert members_of(shapes, 0, names=("logits", "sample_weight")) == (
        4, ("logits", "sample_weight"))


@pytest.mark.parametrize(("names", "problem"), [
    (("nope",), "not a tensor input"),
    (("weight",), "differ|no axis"),
    (("logits", "weight"), "differ in size"),
])
def test_named_inputs_are_checked(names: tuple[str, ...], problem: str) -> None:
    shapes = {"logits": ((4, 5), True), "weight": ((5,), True)}
    with pytest.raises(VariantNotApplicable, match=problem):
        members_of(shapes, 1 if names == ("weight",) else 0, names=names)


def test_parameter_names() -> None:
    assert all(named_parameter(name) for name in (
        "weight", "bias", "fc.weight", "class_weight", "bn.running_mean", "ln.gamma"))
    assert not any(named_parameter(name) for name in (
        "weights", "x", "target", "biased", "mask", "weight_decay"))


def test_a_named_inputs_list_reaches_the_variant() -> None:
    tables = VariantTables(batch=AxisSizes(0, (1,), inputs=("x", "target")))
    assert expand(tables) == [Variant("batch", 1, inputs=("x", "target"))]


def test_a_module_cases_state_dict_never_anchors_or_follows_the_batch() -> None:
    # replay_module's inputs: the samples, and the module's weights and buffers as state.<name>;
    # an unnamed buffer larger than the batch was once taken for the samples.
    inputs = {"gpucase_module": {"factory": "pkg.mod:make"}, "tokens": torch.zeros(4, 5,
              dtype=torch.long), "state.pos": torch.randn(16, 8), "state.emb.weight":
              torch.randn(4, 8)}
    resized = apply(Variant("batch", 1), inputs)
    assert tuple(resized["tokens"].shape) == (1, 5)
    assert resized["state.pos"] is inputs["state.pos"]
    assert resized["state.emb.weight"] is inputs["state.emb.weight"]
    # Without gpucase_module, state.pos is a call input like any other: the rule is in doubt.
    with pytest.raises(VariantNotApplicable, match="cannot tell which input holds the samples"):
        apply(Variant("batch", 1), {k: v for k, v in inputs.items() if k != "gpucase_module"})


@pytest.mark.slow
def test_a_recorded_cases_rng_state_is_no_batch_input(tmp_path: Path) -> None:
    from pytest_gpucase.tools.validate import validate

    path = recorded_ce_case(tmp_path)
    with (path / "case.toml").open("a", encoding="utf-8") as toml:
        toml.write("\n[variants.batch]\nsizes = [1]\n")
    case = load_case(path)
    assert case.context.rng  # a uint8 (5056,) tensor in the payload, never passed to the call
    assert validate([path]) == []
    assert describe_saved(expand(case.variants)[0], case) == (
        "batch[1]: resized logits (8, 4) -> (1, 4), target (8,) -> (1,)")


def test_a_shorter_sequence_is_laid_out_as_a_loader_makes_it() -> None:
    """A length variant cut from a contiguous (8, 16) batch along axis 1 was a view with the
    saved strides, and a correct model's ``targets.view(-1)`` raised on it; a data loader's
    shorter batch is contiguous. A saved tensor that was not contiguous keeps its layout."""
    idx = torch.arange(8 * 16).view(8, 16)
    short = apply(Variant("length", 4, axis=1), {"idx": idx})["idx"]
    assert short.is_contiguous() and torch.equal(short, idx[:, :4])
    short.view(-1)  # raised before
    transposed = torch.arange(16 * 8).view(16, 8).t()
    kept = apply(Variant("length", 4, axis=1), {"x": transposed})["x"]
    assert torch.equal(kept, transposed[:, :4]) and kept.stride() == transposed.stride()

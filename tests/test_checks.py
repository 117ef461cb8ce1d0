"""Data-contract checks: each failure names what is wrong, where, and how many."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase.tools.checks import class_indices, finite, index_within, same_device

NAN = float("nan")
INF = float("inf")


def _message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    return str(excinfo.value)


class TestClassIndices:
    def test_valid_targets_pass(self) -> None:
        class_indices(torch.tensor([0, 3, -100, 2]), num_classes=4)

    def test_uint8_targets_pass_as_nll_loss_takes_them(self) -> None:
        class_indices(torch.tensor([0, 3], dtype=torch.uint8), num_classes=4, ignore_index=255)

    def test_one_value_out_of_range(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.tensor([0, 1, 4, -100]), num_classes=4)
        assert _message(excinfo) == (
            "target holds 1 value out of range [0, 4) (ignore_index=-100): 4 at position 2"
        )

    def test_negative_values_other_than_ignore_index_are_out_of_range(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.tensor([-1, 2, -100, 5]), num_classes=4)
        assert _message(excinfo) == (
            "target holds 2 values out of range [0, 4) (ignore_index=-100): "
            "-1 at position 0, 5 at position 3"
        )

    def test_names_the_first_ten_and_counts_all(self) -> None:
        target = torch.cat((torch.zeros(3, dtype=torch.long), torch.arange(10, 35)))
        with pytest.raises(ValueError) as excinfo:
            class_indices(target, num_classes=10)
        shown = ", ".join(f"{10 + i} at position {3 + i}" for i in range(10))
        assert _message(excinfo) == (
            "target holds 25 values out of range [0, 10) (ignore_index=-100): "
            f"{shown} (first 10 shown)"
        )

    def test_ignore_index_is_honoured_when_inside_the_class_range(self) -> None:
        class_indices(torch.tensor([0, 0, 1]), num_classes=2, ignore_index=0)

    def test_all_ignored_batch_is_an_error(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.full((8,), -100), num_classes=4)
        assert _message(excinfo) == (
            "target holds only ignore_index (-100) in all 8 entries: the loss would be NaN "
            "(reduction='mean') or 0 (reduction='sum')"
        )

    def test_the_all_ignored_message_says_what_the_loss_really_does(self) -> None:
        logits, target = torch.zeros(2, 4), torch.full((2,), -100)
        assert F.cross_entropy(logits, target).isnan()
        assert F.cross_entropy(logits, target, reduction="sum") == 0

    def test_empty_target_is_an_error(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.zeros(0, dtype=torch.long), num_classes=4)
        assert _message(excinfo) == (
            "target is empty: the loss would be NaN (reduction='mean') or 0 (reduction='sum')"
        )

    @pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bool])
    def test_wrong_dtype_names_what_was_found(self, dtype: torch.dtype) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.zeros(3, dtype=dtype), num_classes=4)
        assert _message(excinfo) == (
            f"target must hold class indices as int64 (long); found {dtype}"
        )

    @pytest.mark.parametrize(("shape", "shown"), [((2, 3), "(2, 3)"), ((), "()")])
    def test_wrong_shape_names_what_was_found(self, shape: tuple[int, ...], shown: str) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.zeros(shape, dtype=torch.long), num_classes=4)
        assert _message(excinfo) == (
            f"target must be 1-D (one class index per sample); found shape {shown}"
        )

    @pytest.mark.parametrize("num_classes", [0, -3, True, 2.0])
    def test_num_classes_must_be_a_positive_integer(self, num_classes: object) -> None:
        with pytest.raises(ValueError) as excinfo:
            class_indices(torch.zeros(2, dtype=torch.long), num_classes=num_classes)  # type: ignore[arg-type]
        assert _message(excinfo) == f"num_classes must be a positive integer; got {num_classes!r}"

    def test_target_must_be_a_tensor(self) -> None:
        with pytest.raises(TypeError) as excinfo:
            class_indices([0, 1], num_classes=4)  # type: ignore[arg-type]
        assert _message(excinfo) == "target must be a torch.Tensor; got list"

    def test_the_check_agrees_with_cross_entropy_on_cpu(self) -> None:
        target = torch.tensor([0, 1, 4])
        with pytest.raises(IndexError, match=r"Target 4 is out of bounds\."):
            F.cross_entropy(torch.zeros(3, 4), target)
        with pytest.raises(ValueError, match="4 at position 2"):
            class_indices(target, num_classes=4)


class TestIndexWithin:
    def test_valid_indices_pass(self) -> None:
        index_within(torch.tensor([[0, 999], [5, 6]]), 1000)

    def test_names_values_and_positions(self) -> None:
        token_ids = torch.tensor([[0, 1, 2, 1000], [-1, 5, 5, 5]])
        with pytest.raises(ValueError) as excinfo:
            index_within(token_ids, 1000, name="token_ids")
        assert _message(excinfo) == (
            "token_ids holds 2 values out of range [0, 1000): 1000 at (0, 3), -1 at (1, 0)"
        )

    def test_one_dimensional_positions(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            index_within(torch.tensor([3, 7], dtype=torch.int32), 5)
        assert _message(excinfo) == "index holds 1 value out of range [0, 5): 7 at position 1"

    def test_zero_dimensional_index(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            index_within(torch.tensor(12), 10)
        assert _message(excinfo) == "index is 12, out of range [0, 10)"

    def test_the_check_agrees_with_embedding_on_cpu(self) -> None:
        ids = torch.tensor([[1, 3]])
        with pytest.raises(IndexError, match="index out of range in self"):
            torch.nn.Embedding(3, 2)(ids)
        with pytest.raises(ValueError, match=r"3 at \(0, 1\)"):
            index_within(ids, 3, name="ids")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
    def test_index_must_be_integer(self, dtype: torch.dtype) -> None:
        with pytest.raises(ValueError) as excinfo:
            index_within(torch.zeros(2, dtype=dtype), 3, name="ids")
        assert _message(excinfo) == f"ids must be an integer tensor; found {dtype}"


class TestSameDevice:
    def test_one_device_passes(self) -> None:
        same_device(x=torch.zeros(1), batch={"y": [torch.zeros(2)]}, model=torch.nn.Linear(1, 1))

    def test_nothing_to_compare_passes(self) -> None:
        same_device()
        same_device(labels=["cat", "dog"], step=3)

    def test_names_each_tensor_with_its_device(self) -> None:
        model = torch.nn.Linear(2, 2, bias=False).to("meta")
        with pytest.raises(ValueError) as excinfo:
            same_device(model=model, target=torch.zeros(2))
        assert (
            _message(excinfo) == "tensors on different devices: model.weight on meta, target on cpu"
        )

    def test_walks_lists_dicts_and_module_buffers(self) -> None:
        model = torch.nn.BatchNorm1d(2)
        batch = {"image": torch.zeros(1, device="meta"), "ids": [torch.zeros(1), "img_00412"]}
        with pytest.raises(ValueError) as excinfo:
            same_device(model=model, batch=batch)
        assert _message(excinfo) == (
            "tensors on different devices: model.weight on cpu, model.bias on cpu, "
            "model.running_mean on cpu, model.running_var on cpu, model.num_batches_tracked on "
            "cpu, and 1 more on cpu, batch['image'] on meta"
        )

    def test_a_large_model_does_not_bury_the_odd_one_out(self) -> None:
        model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(50))).to("meta")
        with pytest.raises(ValueError) as excinfo:
            same_device(model=model, target=torch.zeros(2))
        message = _message(excinfo)
        assert message.endswith(", and 95 more on meta, target on cpu")
        assert len(message) < 300


class TestFinite:
    def test_finite_tensors_pass(self) -> None:
        finite(x=torch.ones(3), ids=torch.arange(3), mask=torch.ones(2, dtype=torch.bool))

    def test_counts_nan_and_inf_and_names_the_first_positions(self) -> None:
        logits = torch.tensor([[0.0, NAN], [INF, -INF]])
        with pytest.raises(ValueError) as excinfo:
            finite(logits=logits)
        assert _message(excinfo) == (
            "logits holds 1 NaN and 2 inf (of 4 values): nan at (0, 1), inf at (1, 0), "
            "-inf at (1, 1)"
        )

    def test_scalar_loss(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            finite(loss=torch.tensor(NAN))
        assert _message(excinfo) == "loss is nan"

    def test_every_offending_tensor_is_reported(self) -> None:
        with pytest.raises(ValueError) as excinfo:
            finite(x=torch.tensor([1.0, INF]), ok=torch.ones(2), loss=torch.tensor(-INF))
        assert _message(excinfo) == ("x holds 1 inf (of 2 values): inf at position 1; loss is -inf")

    def test_low_precision_and_many_offenders(self) -> None:
        x = torch.full((3, 5), NAN, dtype=torch.bfloat16)
        with pytest.raises(ValueError) as excinfo:
            finite(x=x)
        message = _message(excinfo)
        assert message.startswith("x holds 15 NaN (of 15 values): nan at (0, 0), nan at (0, 1), ")
        assert message.endswith("nan at (1, 4) (first 10 shown)")

    def test_module_parameters_are_checked_by_name(self) -> None:
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            model.bias.fill_(NAN)
        with pytest.raises(ValueError) as excinfo:
            finite(model=model)
        assert _message(excinfo) == "model.bias holds 1 NaN (of 1 values): nan at position 0"

    def test_meta_tensors_are_skipped(self) -> None:
        finite(x=torch.zeros(2, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.version.cuda is None, reason="torch is built without CUDA")
def test_class_indices_on_cuda_raises_before_any_kernel_assert() -> None:
    # A child process: the test process must never initialize CUDA (it breaks later forks).
    script = textwrap.dedent(
        """
        import torch
        from pytest_gpucase.tools.checks import class_indices, same_device
        if not torch.cuda.is_available():
            print("no CUDA device")
            raise SystemExit(0)
        target = torch.tensor([0, 1, 4, -100], device="cuda")
        try:
            class_indices(target, num_classes=4)
        except ValueError as error:
            print(error)
        # The check ran no asserting kernel, so the context is still usable.
        print(torch.ones(2, device="cuda").sum().item())
        try:
            same_device(model=torch.nn.Linear(2, 2).cuda(), target=torch.zeros(2))
        except ValueError as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no CUDA device":
        pytest.skip("no CUDA device present")
    assert done.stdout.splitlines() == [
        "target holds 1 value out of range [0, 4) (ignore_index=-100): 4 at position 2",
        "2.0",
        (
            "tensors on different devices: model.weight on cuda:0, model.bias on cuda:0, "
            "target on cpu"
        ),
    ]

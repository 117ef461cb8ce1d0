"""A failure anywhere in a recorded step is a complete case, and the first NaN/inf is a
first failure when asked (issue 22 item 3): the call that raised is found in the traceback,
the guard's NaN is traced to the watched call that produced it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_gpucase import checks
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import REPLAY_FUNCTION, REPLAY_MODULE
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.tools.validate import validate
from tests import model_targets
from tests.helpers import replays, read_toml as toml

pytestmark = pytest.mark.slow  # every test here starts processes


def setup(tmp_path: Path, **options: Any) -> tuple[Recorder, torch.nn.Module]:
    torch.manual_seed(0)
    model = model_targets.TinyLM()
    rec = Recorder(tmp_path / "cases", **options)
    rec.watch(model)
    return rec, model


TOKENS = torch.tensor([[1, 2, 3]])


def test_a_loss_that_raises_in_the_step_is_saved_with_its_inputs(tmp_path: Path) -> None:
    rec, model = setup(tmp_path)
    target = torch.tensor([1, 2, 30])
    with pytest.raises(IndexError, match="Target 30 is out of bounds"), rec.step(4):
        logits = model(TOKENS)[0]
        loss = F.cross_entropy(logits, target)
        loss.backward()
    case_dir = tmp_path / "cases" / "cross_entropy"
    doc = toml(case_dir)
    assert doc["call"] == "torch.nn.functional:cross_entropy"
    assert doc["origin"]["iteration"] == 4 and "incomplete" not in doc["origin"]
    assert doc["origin"]["raised_in"].startswith("test_record_steps.py:")
    saved = payload.load(case_dir / "inputs.safetensors")
    assert torch.equal(saved["target"], target) and torch.equal(saved["input"], logits.detach())
    replays(case_dir, "IndexError")


def test_an_unwatched_loss_module_is_saved_as_a_module_case(tmp_path: Path) -> None:
    rec, model = setup(tmp_path)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    with pytest.raises(IndexError), rec.step(0):
        criterion(model(TOKENS)[0], torch.tensor([1, 2, 30]))
    case_dir = tmp_path / "cases" / "CrossEntropyLoss"
    recipe = toml(case_dir)["inputs"]["gpucase_module"]
    assert recipe["factory"] == "torch.nn.modules.loss:CrossEntropyLoss"
    assert recipe["kwargs"]["label_smoothing"] == 0.1
    replays(case_dir, "IndexError")


def test_code_written_in_the_step_is_named_with_its_line(tmp_path: Path) -> None:
    rec, model = setup(tmp_path)
    with pytest.raises(RuntimeError), rec.step(0):
        logits = model(TOKENS)
        (logits - torch.ones(2, 2)).sum()
    (case_dir,) = (tmp_path / "cases").iterdir()
    reasons = toml(case_dir)["origin"]["incomplete"]
    assert "it was raised by code written in the step itself (test_record_steps.py:" in reasons[0]
    assert "(logits - torch.ones(2, 2)).sum()" in reasons[0]
    assert validate([case_dir])[0].endswith(reasons[0])  # gpucase validate says the same


def _guarded(tmp_path: Path, guard: str) -> Path:
    torch.manual_seed(0)
    model = model_targets.NaNLM()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    for it, tokens in enumerate((TOKENS, torch.tensor([[1, 7, 3]]))):
        with rec.step(it):
            if guard == "anomaly":
                with torch.autograd.set_detect_anomaly(True):
                    out = model(tokens)
                    (out * 0).sum().backward()
                continue
            loss = F.cross_entropy(model(tokens)[0], torch.tensor([1, 2, 3]))
            if guard == "raise" and not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()}")
            if guard == "checks":
                checks.finite(loss=loss)
    raise AssertionError("the guard did not fire")  # pragma: no cover


@pytest.mark.parametrize("guard,error", [("raise", FloatingPointError), ("checks", ValueError),
                                         ("anomaly", RuntimeError)])
def test_a_guard_on_a_nan_saves_the_call_that_made_it(tmp_path: Path, guard: str,
                                                      error: type[Exception]) -> None:
    """The usual guards (a raise, checks.finite, anomaly mode) no longer give an incomplete
    stub: the case replays the watched call whose output (or backward) holds the NaN, and
    asks the replay for finite values, so that a fix turns it XPASS."""
    with pytest.raises(error):
        _guarded(tmp_path, guard)
    case_dir = tmp_path / "cases" / "NaNLM"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["finite"] is True and "incomplete" not in doc["origin"]
    assert doc["origin"]["failure_class"] == "nonfinite"
    replays(case_dir, "FloatingPointError")


def test_a_hook_registered_after_watch_is_not_lost(tmp_path: Path) -> None:
    rec, model = setup(tmp_path)

    def guard(module: Any, args: Any, out: torch.Tensor) -> None:
        checks.finite(out=out)

    model.register_forward_hook(guard)  # after rec.watch: its error passes the Recorder's hook
    with pytest.raises(ValueError), rec.step(0):
        model.head.bias.data[0] = float("nan")
        model(TOKENS)
    case_dir = tmp_path / "cases" / "TinyLM"
    assert toml(case_dir)["inputs"]["gpucase_module"]["finite"] is True
    replays(case_dir, "FloatingPointError")


# -- nonfinite= ----------------------------------------------------------------------------


def test_nonfinite_makes_the_first_nan_output_a_first_failure(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.NaNLM()
    rec = Recorder(tmp_path / "cases", nonfinite=True)
    rec.watch(model)
    model(TOKENS)
    with pytest.raises(FloatingPointError, match=r"^non-finite output of NaNLM: out holds \d+ "
                       r"(NaN|inf).* \(at iteration 6\)$"), rec.step(6):
        model(torch.tensor([[1, 7, 3]]))
    case_dir = tmp_path / "cases" / "NaNLM"
    doc = toml(case_dir)
    assert doc["origin"]["iteration"] == 6 and doc["inputs"]["gpucase_module"]["finite"]
    replays(case_dir, "FloatingPointError")


def test_nonfinite_loss_of_a_watched_function(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases", nonfinite=("loss",))
    loss_fn = rec.watch(model_targets.scaled_sum)
    loss_fn(torch.ones(2), torch.tensor(1.0))
    with pytest.raises(FloatingPointError, match=r"^non-finite loss of scaled_sum"):
        loss_fn(torch.ones(2), torch.tensor(float("nan")))
    case_dir = tmp_path / "cases" / "scaled_sum"
    doc = toml(case_dir)
    assert doc["call"] == REPLAY_FUNCTION
    assert doc["inputs"]["gpucase_function"] == {"target": "tests.model_targets:scaled_sum",
                                                 "finite": True}
    replays(case_dir, "FloatingPointError")


def test_nonfinite_parameter_gradient_is_caught_before_the_optimizer_step(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.SqrtLM()
    rec = Recorder(tmp_path / "cases", nonfinite=("grad",))
    rec.watch(model)
    loss_fn = rec.watch(model_targets.scaled_sum)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.scale.detach().clone()
    with pytest.raises(FloatingPointError, match=r"^non-finite gradient of SqrtLM: "), \
            rec.step(0):
        model.scale.data.zero_()
        loss_fn(model(torch.ones(2, 3)), torch.tensor(1.0)).backward()
        optimizer.step()
    assert torch.equal(model.scale.detach(), torch.zeros_like(before))  # never stepped
    case_dir = tmp_path / "cases" / "SqrtLM"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["backward"] is True and recipe["finite"] is True
    assert recipe["loss"]["call"] == "tests.model_targets:scaled_sum"
    replays(case_dir, "FloatingPointError")


def test_nonfinite_takes_true_or_kinds() -> None:
    with pytest.raises(ValueError, match="nonfinite: unknown 'weights'; give True, or some of "
                                         "'output', 'loss', 'grad'"):
        Recorder("cases", nonfinite=["weights"])
    assert Recorder("cases", nonfinite=True).nonfinite_kinds == {"output", "loss", "grad"}
    assert Recorder("cases").nonfinite_kinds == frozenset()


def test_a_nan_without_nonfinite_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.NaNLM()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with rec.step(0):
        assert torch.isinf(model(torch.tensor([[7]]))).all()
    assert rec.case_dir is None


def test_a_module_case_names_its_generated_call(tmp_path: Path) -> None:
    _, model = setup(tmp_path)
    with pytest.raises(IndexError):
        model(torch.tensor([[9]]))
    assert toml(tmp_path / "cases" / "TinyLM")["call"] == REPLAY_MODULE


def test_a_gradient_clip_guard_is_traced_to_the_forward_that_made_the_nan(
        tmp_path: Path) -> None:
    """clip_grad_norm_(error_if_nonfinite=True) raises after backward, on gradients made
    non-finite by an output the watched forward already held: the forward is the case (it
    fails again while the NaN is made), not a backward case from the symptom's gradient."""
    torch.manual_seed(0)
    model = model_targets.NaNLM()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with pytest.raises(RuntimeError, match="non-finite"), rec.step(3):
        loss = model(torch.tensor([[1, 7, 2]])).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    case_dir = tmp_path / "cases" / "NaNLM"
    doc = toml(case_dir)
    assert "incomplete" not in doc["origin"], doc["origin"]
    assert doc["inputs"]["gpucase_module"]["backward"] is False
    assert doc["inputs"]["gpucase_module"]["finite"] is True
    replays(case_dir, "FloatingPointError")


def test_a_failure_no_watched_call_saw_names_the_function_to_watch() -> None:
    """Recorded from outside any step (a Trainer's compute_loss_func): the reason names the
    user's last function in the traceback and how to watch it."""
    from pytest_gpucase.tools.record.step import failing_call

    def my_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    try:
        my_loss(torch.zeros(2, 3), torch.tensor([0, 5]))
    except IndexError as exc:
        why = failing_call(exc, {}, anchored=False)
    assert isinstance(why, str)
    assert "my_loss in test_record_steps.py" in why and "rec.watch(my_loss)" in why

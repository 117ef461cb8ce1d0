"""``run.context.replay_context``: the case's ``[context]`` around the call, and the grad
mode as it was after it, whichever way the block ends."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_gpucase.case.model import Autocast, ReplayContext
from pytest_gpucase.run.context import replay_context

CONTEXTS = [
    ReplayContext(),                          # no [context]: the plain path
    ReplayContext(grad=False),
    ReplayContext(inference=True),
    ReplayContext(autocast=Autocast(device_type="cpu", dtype="bfloat16")),
]


@pytest.mark.parametrize("context", CONTEXTS, ids=["plain", "no-grad", "inference", "autocast"])
@pytest.mark.parametrize("raising", [False, True], ids=["returns", "raises"])
def test_the_grad_mode_is_the_contexts_inside_and_restored_after(context: ReplayContext,
                                                                 raising: bool) -> None:
    seen = []
    with torch.set_grad_enabled(True):
        expected = pytest.raises(ValueError) if raising else contextlib.nullcontext()
        with expected, replay_context(context, "cpu", {}):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                         torch.is_autocast_enabled("cpu")))
            torch.set_grad_enabled(False)  # the user's code leaves it off for good
            if raising:
                raise ValueError("the call failed")
        assert torch.is_grad_enabled()
    grad = context.grad if context.grad is not None else not context.inference
    assert seen == [(grad and not context.inference, bool(context.inference),
                     context.autocast is not None)]


def test_the_saved_rng_state_is_set_before_the_call() -> None:
    torch.manual_seed(3)
    state = torch.get_rng_state()
    expected = torch.rand(3)
    torch.manual_seed(4)
    with replay_context(ReplayContext(), "cpu", {"cpu": state}):
        assert torch.equal(torch.rand(3), expected)

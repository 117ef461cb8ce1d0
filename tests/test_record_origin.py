"""The name a case gives the call that raised (issue 33 item 3): the user's module and
method, never a framework's wrapper of it (Accelerate's output cast and autocast, a
compiled function, a decorator), told by where the wrapper's code lies."""

from __future__ import annotations

import functools
from types import MethodType
from typing import Any

import pytest
import torch

from pytest_gpucase.tools.record.origin import framework_code, user_label
from tests import model_targets


def test_accelerate_s_wrapped_forward_is_named_by_the_model_s_class() -> None:
    """Accelerate under mixed precision replaces model.forward with its autocast wrapper,
    then with convert_outputs_to_fp32's: the label is still TinyLM.forward."""
    operations = pytest.importorskip("accelerate.utils.operations")
    model = model_targets.TinyLM()
    forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__)
    model.forward = MethodType(forward, model)  # type: ignore[method-assign]
    model.forward = MethodType(  # type: ignore[method-assign]
        operations.convert_outputs_to_fp32(model.forward.__func__), model)
    assert "convert_outputs_to_fp32" in model.forward.__qualname__
    assert user_label(model.forward) == "TinyLM.forward"


def test_a_compiled_function_and_a_decorated_one_keep_the_user_s_name() -> None:
    def my_loss(x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    def decorator(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)
        return wrapper

    compiled = torch.compile(my_loss, backend="eager")
    assert str(user_label(compiled)).endswith("my_loss")
    assert str(user_label(decorator(my_loss))).endswith("my_loss")
    assert user_label(model_targets.TinyLM().forward) == "TinyLM.forward"


def test_framework_code_is_told_by_its_location() -> None:
    assert framework_code(torch.nn.Module.__call__.__code__.co_filename)
    assert framework_code(functools.wraps.__code__.co_filename)
    assert not framework_code(model_targets.TinyLM.forward.__code__.co_filename)
    assert not framework_code("<string>")

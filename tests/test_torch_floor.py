"""The torch APIs newer than the declared floor, each used behind a guard: tested here by
taking the API away from this torch (what an older release lacks), as the guard meets it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pytest_gpucase.tools.record.hooks import compiling
from pytest_gpucase.tools.record.inputs import autocast_dtype, numeric_context
from pytest_gpucase.tools.record.watch import autocast_state


def test_autocast_is_read_where_the_device_typed_queries_are_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On torch < 2.4 torch.is_autocast_enabled(device_type) raised a TypeError, swallowed,
    and [context] autocast was silently left out of the case."""
    with torch.autocast("cpu", dtype=torch.bfloat16), monkeypatch.context() as patch:
        # taken away inside the region: torch.autocast itself calls it on this torch
        patch.delattr(torch, "get_autocast_dtype")   # torch 2.3 has no such function
        assert autocast_dtype("cpu") == "bfloat16"
        assert autocast_state() == ("cpu", "bfloat16")
        context, _ = numeric_context(["cpu"], {})
        assert autocast_dtype("hpu") is None   # a device type without a legacy query
    assert context["autocast"] == {"device_type": "cpu", "dtype": "bfloat16", "enabled": True}
    with monkeypatch.context() as patch:
        patch.delattr(torch, "get_autocast_dtype")
        assert autocast_dtype("cpu") is None   # outside the region


def test_autocast_with_the_typed_queries() -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_dtype("cpu") == "float16"
    assert autocast_dtype("not-a-device") is None


def test_compiling_without_torch_compiler_is_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """On torch < 2.3 the Recorder's hook raised AttributeError from
    torch.compiler.is_compiling() instead of letting the user's error through."""
    # (this torch's torch._dynamo.is_compiling, which 2.1 has on its own, calls the first)
    monkeypatch.delattr(torch.compiler, "is_compiling")
    monkeypatch.delattr(torch._dynamo, "is_compiling")
    assert compiling() is False                 # neither: nothing can be tracing
    monkeypatch.undo()
    assert compiling() is False


@pytest.mark.slow
def test_the_verdict_imports_and_compares_without_the_wide_unsigned_dtypes() -> None:
    """On torch < 2.3 every case item ended in INTERNALERROR: verdict/compare.py read
    torch.uint16 and torch.uint32 at import."""
    script = (
        "import torch\n"
        "for name in ('uint16', 'uint32', 'uint64'):\n"
        "    delattr(torch, name)\n"
        "from pytest_gpucase.verdict.compare import compare\n"
        "a = torch.arange(6, dtype=torch.int32)\n"
        "print(compare(a, a.clone()).ok, compare(a, a + 1).ok)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]

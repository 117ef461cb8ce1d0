"""Shared test setup: pytester for end-to-end runs, and the `gpu` marker's skip."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]


@functools.cache
def cuda_available() -> bool:
    """Ask a separate interpreter, so that this pytest process never initializes CUDA."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    return done.stdout.strip() == "True"


@pytest.fixture(autouse=True)
def _pytester_in_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest sessions started by a test run their items in order, whatever plugins are installed:
    their output is what the test reads (pytest-randomly would shuffle it)."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts
        monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:randomly")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
        for item in gpu_items:
            item.add_marker(skip)

"""Shared test setup: pytester for end-to-end runs, and the `gpu` marker's skip."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

# One torch thread per test process (and the children it starts), unless the shell says
# otherwise: the suite's tensors are small, and on a loaded machine OpenMP's pool waits at
# every op's barrier. Measured on 2 shared cores at load 8-9: `pytest -m "not slow"` took
# 117 s wall and 35 s CPU with torch's default, 78 s and 22 s with one thread. Set before
# any test module imports torch; a test of several threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.cache
def cuda_available() -> bool:
    """Ask a separate interpreter, so that this pytest process never initializes CUDA."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    return done.stdout.strip() == "True"


# What a CI runner or a developer's shell may set that changes what a pytest session or the
# plugin prints or writes: the suite reads the output of the sessions it starts, so those runs
# see the same environment on every machine. A test of that behaviour sets the variable itself.
RUNNER_ENVIRONMENT = ("CI", "BUILD_NUMBER",  # pytest prints failures untrimmed on CI
                      "GITHUB_STEP_SUMMARY",  # the plugin appends its summary there
                      "FORCE_COLOR", "PY_COLORS", "NO_COLOR")


@pytest.fixture(autouse=True)
def _pytester_in_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """pytest sessions started by a test run their items in order, whatever plugins are installed:
    their output is what the test reads (pytest-randomly would shuffle it), in an environment
    without the runner's own settings (``RUNNER_ENVIRONMENT``) and 80 columns wide, forked from
    a warm interpreter unless the test is marked ``fresh_interpreter`` (``tests/warm.py``). The
    reference cache's key lives in a folder of the test run, never the user's own."""
    for name in RUNNER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("GPUCASE_REFERENCE_KEY_FILE", raising=False)
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, str(tmp_path_factory.getbasetemp() / name.lower()))
    if "pytester" in request.fixturenames:
        pytester = request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts
        monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:randomly")
        if request.node.get_closest_marker("fresh_interpreter") is None:
            from tests import warm

            warm.install(pytester, monkeypatch)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests import warm

    warm.stop()


# The inner loop, `pytest -m "not slow"`, leaves out what starts other processes: pytest
# sessions, runs in children, interpreters. The rule, held by a guard rather than a list: a test
# that uses pytester is slow; any other that starts a process says so with the `slow` marker
# (on the test, or `pytestmark` on its module), and an unmarked test that forks, spawns or runs
# a subprocess fails at that call, naming the marker (`_no_process_in_the_fast_loop`).
def _slow(item: pytest.Item) -> bool:
    return ("pytester" in getattr(item, "fixturenames", ())
            or item.get_closest_marker("slow") is not None)


class StartsAProcess(Exception):
    """A test outside the slow loop started a process."""


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_loop(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if _slow(request.node):
        yield
        return
    import os

    message = (f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow (the "
               "fast loop, -m 'not slow', starts none)")
    tried: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        tried.append(message)
        raise StartsAProcess(message)

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    yield
    if tried:   # also where the code under test caught the refusal (a Recorder's capture)
        pytest.fail(message, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A test that runs a child's code in this process (``run.child.run``) must put back what
    a child sets: with GPUCASE_REPLAY left set, every Recorder of the later tests in this
    worker takes itself for a replay's and records nothing. Checked once every fixture (a
    monkeypatch that set it) is torn down."""
    import os

    result = yield
    if os.environ.pop("GPUCASE_REPLAY", None) is not None:
        pytest.fail(f"{item.nodeid} left GPUCASE_REPLAY set in the test process: restore "
                    "os.environ after running a child's code here", pytrace=False)
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
        for item in gpu_items:
            item.add_marker(skip)

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
    without the runner's own settings (``RUNNER_ENVIRONMENT``) and 80 columns wide. The
    reference cache's key lives in a folder of the test run, never the user's own."""
    for name in RUNNER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("GPUCASE_REFERENCE_KEY_FILE", raising=False)
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, str(tmp_path_factory.getbasetemp() / name.lower()))
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts
        monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:randomly")


# The inner loop, `pytest -m "not slow"`, leaves out what starts other processes: pytest
# sessions (the pytester fixture), runs in children, interpreters. pytest's own suite marks
# its pytester tests the same way. Whole modules where nearly every test forks a run:
SLOW_MODULES = frozenset({
    "test_ablate", "test_containment", "test_example_model", "test_example_training",
    "test_gpu", "test_gpu_ablate", "test_isolation", "test_isolation_modes", "test_minimize",
    "test_model_capture", "test_runner",
    # The Recorder in training stacks: real Trainer runs, replays in children.
    "test_example_integrations", "test_integration_lightning", "test_integration_transformers",
    "test_record_rebuild", "test_record_steps",
})
# ... and single tests elsewhere that start a process or kill one at random moments.
SLOW_TESTS = frozenset({
    "test_plain_write_killed_midway_is_detected",
    "test_atomic_save_killed_midway_keeps_previous_checkpoint",
    "test_resave_killed_at_random_moments_always_leaves_a_valid_checkpoint",
    "test_output_cut_short_by_head_ends_quietly",
    "test_embedding_oob_model_is_a_module_case_whose_cuda_assert_replays_as_index_error",
    "test_public_names_load_lazily_and_without_torch",
    "test_a_regenerated_golden_passes_the_next_run",
    "test_regen_refuses_an_output_it_cannot_store",
    "test_reading_a_golden_imports_nothing",
    "test_step_summary_of_a_run_outside_the_rootdir",
    "test_report_modules_import_neither_torch_nor_pytest",
    "test_request_scrubs_a_megabyte_of_hostile_text_in_linear_time",
    "test_triage_of_a_pathological_text_is_linear",
    "test_validate_minimize_and_ablate_find_the_src_layout_from_elsewhere",
    "test_pytest_children_import_as_the_parent_does",
    "test_loading_does_not_import_torch",
    "test_a_failure_inside_a_compiled_model_is_a_case_of_the_eager_module",
    "test_a_killed_interpreter_leaves_no_case_that_looks_valid",
})


def _slow(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    name = getattr(item, "originalname", item.name)
    return ("pytester" in getattr(item, "fixturenames", ())
            or (module is not None and module.__name__.rpartition(".")[2] in SLOW_MODULES)
            or name in SLOW_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
        for item in gpu_items:
            item.add_marker(skip)

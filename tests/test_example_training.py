"""End to end: the example's training fails, its case is replayed, the bug is fixed, and the
same case is replayed again, each step run as a user runs it.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from pytest_gpucase.tools.validate import validate
from tests.helpers import PYTEST, apply_fix, run, without_xfail

pytestmark = pytest.mark.slow  # every test here starts processes

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "training_capture"
BUG = "    return labels  # the bug: used as annotated; the fix is `return labels - 1`\n"
FIX = "    return labels - 1\n"
XFAIL = "captured failure: IndexError: Target 4 is out of bounds.; remove this line once fixed"


def replay(project: Path) -> pytest.RunResult:
    # CPU items only, so that the outcomes are the same on a GPU runner.
    return run(project, sys.executable, "-c", PYTEST, "--gpu-cases", "cases", "-rxX",
               "--gpu-devices", "cpu", "-p", "no:cacheprovider")


def test_training_failure_is_captured_replayed_and_fixed(pytester: pytest.Pytester) -> None:
    """The example's whole story, in the order a user lives it.

    Removing the xfail line is shown on a copy of the case, so that one replay run
    shows both states (each run costs an interpreter start with torch).
    """
    project = pytester.path
    shutil.copytree(EXAMPLE, project, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("cases", "__pycache__"))

    training = run(project, sys.executable, "train.py")
    assert training.ret == 1, training.outlines + training.errlines
    training.stderr.fnmatch_lines([
        "gpucase: saved cases/ce_class4 (first failure at iteration 3, in loss, after forward)",
        "clue: index out of range (CPU)",
        "note: a class target is 4: targets must lie in [[]0, num_classes) or equal ignore_index",
        "Traceback (most recent call last):",
        "IndexError: Target 4 is out of bounds.",
    ])
    case_dir = project / "cases" / "ce_class4"
    doc = tomllib.loads((case_dir / "case.toml").read_text())
    assert doc["call"] == "toy_train.model:loss_fn" and doc["xfail"] == XFAIL
    assert doc["origin"]["sample_ids"] == [f"s{i:03d}" for i in range(48, 64)]
    pytester.syspathinsert(project)  # as for the training script: toy_train is importable
    assert validate([project / "cases"]) == []

    # Before the fix: the case is a strict xfail; without its xfail line it fails with the
    # triage; a hidden directory (a case being written) is not collected.
    shutil.copytree(case_dir, project / "cases" / "ce_class4_open")
    without_xfail(project / "cases" / "ce_class4_open")
    shutil.copytree(case_dir, project / "cases" / ".ce_class4.0123456789ab.tmp")
    before = replay(project)
    before.assert_outcomes(xfailed=1, failed=1)
    before.stdout.fnmatch_lines([
        "*_ ce_class4_open[[]cpu-float32[]] _*",
        "the call raised IndexError: Target 4 is out of bounds.",
        "*Captured gpucase triage call*",
        "clue: index out of range (CPU)",
        "first check: Check the indices and targets*",
        f"XFAIL cases/ce_class4/case.toml::ce_class4[[]cpu-float32[]] - {XFAIL}",
    ])

    apply_fix(project / "toy_train" / "data.py", BUG, FIX)

    # After the fix: the same case passes, seen as XPASS(strict) until its xfail line goes.
    after = replay(project)
    after.assert_outcomes(failed=1, passed=1)
    after.stdout.fnmatch_lines([
        "cases/ce_class4/case.toml F *",
        "cases/ce_class4_open/case.toml . *",
        "*_ ce_class4[[]cpu-float32[]] _*",
        f"[[]XPASS(strict)[]] {XFAIL}",
    ])

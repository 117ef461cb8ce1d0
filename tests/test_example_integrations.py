"""End to end, as a user runs them: the Lightning and Hugging Face examples fail, their
cases replay as the captured failure, the fix in the script turns them XPASS(strict)."""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from tests.helpers import PYTEST, apply_fix, run

pytestmark = pytest.mark.slow  # every test here starts processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
XFAIL = "captured failure: IndexError: Target -1 is out of bounds.; remove this line once fixed"


def replay(project: Path) -> pytest.RunResult:
    return run(project, sys.executable, "-c", PYTEST, "--gpu-cases", "cases", "-rxX",
               "--gpu-devices", "cpu", "-p", "no:cacheprovider")


@pytest.mark.parametrize("example,bug,fix,case", [
    ("lightning_capture",
     "tags.reshape(-1))\n",
     "tags.reshape(-1),\n                               ignore_index=PAD)\n",
     "Tagger.training_step"),
    ("hf_capture",
     "labels.reshape(-1))\n",
     "labels.reshape(-1), ignore_index=PAD)\n",
     "Tagger"),
])
def test_example_is_captured_replayed_and_fixed(pytester: pytest.Pytester, example: str,
                                                bug: str, fix: str, case: str) -> None:
    pytest.importorskip("lightning" if example.startswith("lightning") else "transformers")
    project = pytester.path
    shutil.copytree(EXAMPLES / example, project, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("cases", "out", "__pycache__"))
    training = run(project, sys.executable, "train.py")
    assert training.ret == 1, training.outlines + training.errlines
    training.stderr.fnmatch_lines([f"gpucase: saved cases/{case} (first failure at *",
                                   "IndexError: Target -1 is out of bounds."])
    doc = tomllib.loads((project / "cases" / case / "case.toml").read_text())
    assert doc["xfail"] == XFAIL
    assert doc["context"]["autocast"]["dtype"] == "bfloat16"
    before = replay(project)
    before.assert_outcomes(xfailed=2)
    apply_fix(project / "train.py", bug, fix)
    after = replay(project)  # the class is loaded from the script as it is now
    after.assert_outcomes(failed=1, xfailed=1)
    after.stdout.fnmatch_lines([f"[[]XPASS(strict)[]] {XFAIL}"])

"""A recorded case declares the frameworks its rebuild imports (issue 33 item 8): a runner
without one skips the case with the reason instead of failing it with a
ModuleNotFoundError, and a case that cannot import an undeclared package says so instead
of advising to expect ModuleNotFoundError.

The framework here is a real installed distribution (a package with its dist-info in a
``site-packages`` folder), put on the path of the recording script only."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from tests.helpers import python_in, read_toml

pytestmark = pytest.mark.slow  # a training script, then pytest runs of its case

ROOT = Path(__file__).parent.parent

_MODEL = '''
import torch
import gpucase_fakefw

class Net(gpucase_fakefw.Base):
    def __init__(self, vocab=8, dim=4):
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.emb = torch.nn.Embedding(vocab, dim)

    def forward(self, tokens):
        return self.emb(tokens)
'''

_TRAIN = '''
import torch
from mymodel import Net
from pytest_gpucase import Recorder

rec = Recorder("cases", narrow=False)
model = Net()
rec.watch(model)
with rec.step(0):
    model(torch.tensor([[1, 8]]))
'''


def _recorded(project: Path) -> Path:
    """The case of a model whose base class is an installed framework's, recorded where the
    framework is installed."""
    site = project / "lib" / "site-packages"
    (site / "gpucase_fakefw").mkdir(parents=True)
    (site / "gpucase_fakefw" / "__init__.py").write_text(
        "import torch\n\nclass Base(torch.nn.Module):\n    pass\n")
    info = site / "gpucase_fakefw-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpucase-fakefw\n"
                                   "Version: 1.0\n")
    (info / "top_level.txt").write_text("gpucase_fakefw\n")
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "mymodel.py").write_text(textwrap.dedent(_MODEL))
    (project / "train.py").write_text(textwrap.dedent(_TRAIN))
    done = python_in(project, "train.py", paths=(site,))
    assert "IndexError" in done.stderr, done.stderr
    return project / "cases" / "Net"


def test_a_runner_without_the_framework_skips_the_case_saying_why(
        pytester: pytest.Pytester) -> None:
    case = _recorded(pytester.path)
    # The framework, not the project's own module (mymodel) nor torch.
    assert read_toml(case)["matrix"]["packages"] == {"gpucase-fakefw": ""}
    result = pytester.runpytest_subprocess("--gpu-cases", "-rs", "-p", "no:randomly",
                                           "cases")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*requires gpucase-fakefw; not installed*"])
    assert "ModuleNotFoundError" not in result.stdout.str()


def test_an_undeclared_missing_package_is_named_not_made_the_expectation(
        pytester: pytest.Pytester) -> None:
    case = _recorded(pytester.path)
    toml = case / "case.toml"
    toml.write_text(toml.read_text().replace('[matrix.packages]\ngpucase-fakefw = ""\n', ""))
    assert "gpucase-fakefw" not in toml.read_text()
    result = pytester.runpytest_subprocess("--gpu-cases", "-p", "no:randomly", "cases")
    result.assert_outcomes(failed=1, skipped=1)
    out = result.stdout.str()
    assert "imports gpucase_fakefw, which is not installed on this runner" in out, out
    assert "[matrix.packages] gpucase_fakefw" in out
    assert 'exception = "ModuleNotFoundError"' not in out


def test_a_project_module_the_run_cannot_import_is_said_to_be_the_project_s(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the project's pytest configuration its folder is not on the path: the case
    cannot import mymodel, which is the project's code, not a package to install."""
    _recorded(pytester.path)
    (pytester.path / "pytest.ini").unlink()
    elsewhere = pytester.mkdir("elsewhere")
    (elsewhere / "pytest.ini").write_text("[pytest]\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), str(pytester.path / "lib" / "site-packages")]))
    monkeypatch.chdir(elsewhere)
    result = pytester.runpytest_subprocess("--gpu-cases", "-p", "no:randomly",
                                           str(pytester.path / "cases"))
    out = result.stdout.str()
    assert "imports mymodel, the project's code in" in out, out
    assert "pythonpath" in out and "not installed" not in out

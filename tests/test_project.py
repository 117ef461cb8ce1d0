"""One way to import the user's code: rootdir and ini ``pythonpath``, for every gpucase tool."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.cli import main
from pytest_gpucase.case.project import import_paths, importable

MOD_PY = """\
def fn(logits, target):
    # The project's loss: class indices are checked before the kernel sees them.
    bad = (target < 0) | (target >= logits.shape[-1])
    if bad.any():
        raise ValueError(f"class index {int(target[bad][0])} out of range")
    return logits.logsumexp(-1) - logits.gather(-1, target[:, None])[:, 0]
"""
CASE_PY = """\
from mypkg.mod import fn


def run(logits, target):
    return fn(logits, target)
"""


def write_case(directory: Path, call: str, target: torch.Tensor, code: str | None = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "case.toml").write_text(textwrap.dedent(f"""\
        format = 1
        summary = "a 4-class head; one label in the batch reads 4"
        call = "{call}"
        timeout = 60
        """))
    if code is not None:
        (directory / "case.py").write_text(code)
    gen = torch.Generator().manual_seed(0)
    payload.save(directory / "inputs.safetensors",
                 {"logits": torch.randn(len(target), 4, generator=gen), "target": target})
    return directory


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A src/ layout project with its cases; the working directory is somewhere else."""
    root = tmp_path / "proj"
    (root / "src" / "mypkg").mkdir(parents=True)
    (root / "src" / "mypkg" / "__init__.py").write_text("")
    (root / "src" / "mypkg" / "mod.py").write_text(MOD_PY)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["src"]\n')
    bad = torch.tensor([0, 1, 2, 3, 2, 4, 1, 0])
    write_case(root / "cases" / "module_call", "mypkg.mod:fn", bad)
    write_case(root / "cases" / "file_call", "case.py:run", bad, CASE_PY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("pyproject.toml", '[tool.pytest.ini_options]\npythonpath = ["src", "lib"]\n',
     ["src", "lib", "."]),
    ("pyproject.toml", '[tool.pytest]\npythonpath = ["src"]\n', ["src", "."]),
    ("pytest.ini", "[pytest]\npythonpath = src lib\n", ["src", "lib", "."]),
    ("pytest.ini", "# no [pytest] section: still the configuration file\n", ["."]),
    ("pytest.toml", '[pytest]\npythonpath = ["src"]\n', ["src", "."]),
    ("tox.ini", "[pytest]\npythonpath = src\n", ["src", "."]),
    ("setup.cfg", "[tool:pytest]\npythonpath = src\n", ["src", "."]),
])
def test_the_rootdir_and_pythonpath_pytest_would_find(
        tmp_path: Path, name: str, text: str, expected: list[str]) -> None:
    (tmp_path / name).write_text(text)
    case_dir = tmp_path / "cases" / "one"
    case_dir.mkdir(parents=True)
    assert import_paths(case_dir) == tuple(os.path.normpath(tmp_path / e) for e in expected)


def test_configuration_files_are_read_in_pytests_order(tmp_path: Path) -> None:
    # tox.ini without [pytest] and a pyproject.toml without a pytest table are no
    # configuration; the setup.cfg nearer the case is, and wins over the one above.
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = top\n")
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "tox.ini").write_text("[tox]\nenvlist = py311\n")
    (inner / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (inner / "setup.cfg").write_text("[tool:pytest]\npythonpath = src\n")
    assert import_paths(inner / "cases" / "one") == (str(inner / "src"), str(inner))
    (inner / "setup.cfg").unlink()
    # pyproject.toml without a pytest table loses to a configuration file above it...
    assert import_paths(inner / "cases") == (str(tmp_path / "top"), str(tmp_path))
    (tmp_path / "pytest.ini").unlink()
    # ...and is the rootdir when there is none, as pytest falls back to.
    assert import_paths(inner / "cases") == (str(inner),)


def test_no_project_no_path(tmp_path: Path) -> None:
    assert import_paths(tmp_path / "cases" / "one") == ()


def test_importable_restores_sys_path(project: Path) -> None:
    before = list(sys.path)
    with importable(project / "cases" / "module_call"):
        assert sys.path[:2] == [str(project / "src"), str(project)]
    assert sys.path == before


@pytest.mark.slow
def test_validate_minimize_and_ablate_find_the_src_layout_from_elsewhere(
        project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = project / "cases"
    assert main(["validate", str(cases)]) == 0, capsys.readouterr().out
    assert "mypkg" not in sys.modules  # looked up, never imported
    assert str(project / "src") not in sys.path

    for name in ("module_call", "file_call"):
        code = main(["minimize", str(cases / name), "--device", "cpu", "--max-tries", "20",
                     "--time-budget", "120"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "(ValueError: class index 4 out of range)" in out
        assert "entries on axis 0: 8 -> 1 (kept entry 5)" in out
        written = (cases / f"{name}_min" / "case.toml").read_text()
        # No absolute path: the call is as it was, the original relative to the new case.
        assert str(project.parent) not in written and os.path.expanduser("~") not in written
        assert f'case = "../{name}"' in written
    assert 'call = "case.py:run"' in (cases / "file_call_min" / "case.toml").read_text()

    assert main(["ablate", str(cases / "module_call"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "module_call on cpu in float32: fails (ValueError)" in out, out
    assert "broken case" not in out and "importing" not in out


@pytest.mark.slow
def test_pytest_children_import_as_the_parent_does(project: Path, pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest the ini's pythonpath is applied in the parent; a spawned child gets the
    same sys.path (a forked one inherits it)."""
    write_case(project / "cases" / "valid", "mypkg.mod:fn", torch.tensor([0, 1, 2, 3]))
    monkeypatch.chdir(project)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases/valid", "--gpu-devices", "cpu",
                                           "--gpu-start-method", "spawn", "-p",
                                           "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_configuration_file_edited_between_runs_is_read_again(tmp_path: Path) -> None:
    """Each run asks; a file is parsed again only when it changed, and a new file nearer the
    case is found at once."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["src"]\n')
    case = tmp_path / "cases" / "one"
    case.mkdir(parents=True)
    assert import_paths(case) == (str(tmp_path / "src"), str(tmp_path))
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\npythonpath = ["lib", "src"]\n')
    assert import_paths(case) == (str(tmp_path / "lib"), str(tmp_path / "src"),
                                          str(tmp_path))
    (tmp_path / "cases" / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    assert import_paths(case) == (str(tmp_path / "cases"),)


def test_a_configuration_rewritten_with_its_old_modification_time_is_read_again(
        tmp_path: Path) -> None:
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\npythonpath = ccc\n")
    before = ini.stat()
    assert import_paths(tmp_path) == (str(tmp_path / "ccc"), str(tmp_path))
    ini.write_text("[pytest]\npythonpath = ddd\n")  # the same size
    os.utime(ini, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert import_paths(tmp_path) == (str(tmp_path / "ddd"), str(tmp_path))

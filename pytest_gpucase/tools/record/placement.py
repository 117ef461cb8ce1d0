"""Whether a replay of the cases under a Recorder's folder will import the user's code as the
recording process did.

A replay imports a case's model class, factory and function from the case's project: the
``pythonpath`` entries of the nearest pytest configuration above the case, then its rootdir
(``case.project``). The recording process may have found the same module elsewhere: in the
folder of the script that was run (``python proj/train.py`` puts ``proj/`` first on
``sys.path``) or in the working directory (``python -m``, ``python -c``). A module found
only there is not importable by the replay, and every case written would fail with a
``ModuleNotFoundError`` of the user's own module. Said when the module is watched, before any
training, with the fix. A module installed or put on ``PYTHONPATH`` is found by the replay
too and is not reported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pytest_gpucase.base.errors import display
from pytest_gpucase.case import project

__all__ = ["unreachable"]


def _entry_of(module_name: str) -> Path | None:
    """The ``sys.path`` entry the top-level package of ``module_name`` was imported from."""
    top = sys.modules.get(module_name.partition(".")[0])
    file = getattr(top, "__file__", None)
    if not isinstance(file, str):
        return None  # a namespace package, a built-in, a module of no file
    where = Path(file).resolve().parent
    # A package's __file__ is its __init__.py: the entry is the folder above the package's.
    return where.parent if hasattr(top, "__path__") else where


def _transient() -> set[Path]:
    """``sys.path`` entries a replay does not have: the run script's folder, the working
    directory (``''``, which ``python -m`` and ``-c`` put first)."""
    found = {Path(os.getcwd()).resolve()}
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(script, str):
        found.add(Path(script).resolve().parent)
    return found


def unreachable(module_name: str, root: Path) -> str | None:
    """Why a replay of a case under ``root`` cannot import ``module_name``, or None when it
    can (or when it cannot be told: the module is not loaded, or has no file)."""
    if module_name in ("__main__", "") or module_name.partition(".")[0] not in sys.modules:
        return None  # a class of the script: the case loads the script itself
    entry = _entry_of(module_name)
    if entry is None or entry not in _transient():
        return None
    probe = Path(os.path.abspath(root)) / "case"
    if entry in {Path(p).resolve() for p in project.import_paths(probe)}:
        return None
    top = module_name.partition(".")[0]
    paths = project.import_paths(probe)
    how = ("no pytest configuration above it names a project" if not paths else
           f"its project's import paths ({', '.join(display(Path(p)) for p in paths)}) do "
           "not hold it")
    return (f"{top} was imported from {display(entry)} (the script's folder or the working "
            f"directory), but a replay of a case in {display(Path(root))} will not find it: "
            f"{how}. Record into a folder inside the project that holds {top} (one with a "
            "pytest configuration, e.g. [tool.pytest.ini_options] in pyproject.toml), or list "
            "its folder in that configuration's pythonpath")

"""Where a case's ``call``, ``reference`` and module ``factory`` are imported from.

One rule for every tool, so that a case imports the user's code the same way
under ``pytest --gpu-cases``, ``gpucase minimize``, ``gpucase ablate`` and
``gpucase validate``: the project of a case is the one pytest would find for
it, the nearest directory above it with a pytest configuration file, checked
in pytest's order (``pytest.toml``, ``.pytest.toml``, ``pytest.ini``,
``.pytest.ini``, ``pyproject.toml`` with ``[tool.pytest]`` or
``[tool.pytest.ini_options]``, ``tox.ini`` with ``[pytest]``, ``setup.cfg`` with
``[tool:pytest]``), else the nearest ``pyproject.toml`` as pytest falls back
to. A case folder's own files are never read (``case.load`` refuses them), and those
above are read within ``MAX_CONFIG_BYTES``. Its ``pythonpath`` entries (relative to
the file) come first, then the rootdir itself, which pytest's rootdir ``conftest.py``
and ``prepend`` import mode make importable.

Nothing here is written into a case: the paths are found again, from wherever
the case lies, each time it runs. pytest's own finder is private (its
signature changed between pytest 8 and 9), so the search is rebuilt here on
``tomllib`` and ``iniconfig``, the parser pytest itself reads ini files with.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pytest_gpucase.base.files import read_regular, stat_signature
from pytest_gpucase.case.model import MAX_CONFIG_BYTES, is_case_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["import_paths", "importable", "missing", "prepend"]

_MISSING = object()


def _text(path: Path) -> str:
    """A configuration file's text, read within its bound (``MAX_CONFIG_BYTES``)."""
    return read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")


def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(_text(path))


def _pytest_table(path: Path) -> Any:
    return _toml(path).get("pytest", {})


def _pyproject(path: Path) -> Any:
    tool = _toml(path).get("tool", {}).get("pytest", _MISSING)
    if tool is _MISSING:
        return None
    native = {k: v for k, v in tool.items() if k != "ini_options"}
    return native or tool.get("ini_options")


def _ini(section: str, always: bool = False) -> Callable[[Path], Any]:
    def load(path: Path) -> Any:
        # Imported here: ``gpucase show`` reads cases where pytest (and iniconfig, which comes
        # with it) is not installed, and finds no ini file to parse in most projects.
        import iniconfig

        try:
            config = iniconfig.IniConfig(str(path), _text(path))
        except iniconfig.ParseError as exc:
            raise ValueError(str(exc)) from exc
        if section in config:
            return dict(config[section].items())
        return {} if always else None
    return load


# pytest's configuration files in its order of precedence, each with how to read its
# pytest table (None: the file holds no pytest configuration).
_LOADERS: dict[str, Callable[[Path], Any]] = {
    "pytest.toml": _pytest_table,
    ".pytest.toml": _pytest_table,
    "pytest.ini": _ini("pytest", always=True),
    ".pytest.ini": _ini("pytest", always=True),
    "pyproject.toml": _pyproject,
    "tox.ini": _ini("pytest"),
    "setup.cfg": _ini("tool:pytest"),
}


# Each configuration file's pytest table as last read, under what ``os.stat`` said of the
# file then (``stat_signature``): a file is parsed again only when that changed (every run
# of every case asks).
_READ: dict[str, tuple[tuple[int, int, int, int, int], Any]] = {}


def _config(start: Path) -> tuple[Path, dict[str, Any]] | None:
    """The rootdir pytest would find for ``start`` and its configuration, or None."""
    fallback: Path | None = None
    for base in (start, *start.parents):
        if is_case_dir(base):
            continue  # a case folder configures nothing (case.load refuses such files)
        for name, load in _LOADERS.items():
            file = os.path.join(base, name)
            try:
                found = os.stat(file)
            except (OSError, ValueError):
                continue
            if not stat.S_ISREG(found.st_mode):
                continue
            if name == "pyproject.toml" and fallback is None:
                fallback = base
            signature = stat_signature(found)
            read = _READ.get(file)
            if read is not None and read[0] == signature:
                table = read[1]
            else:
                try:
                    table = load(Path(file))
                except (OSError, ValueError, RecursionError):   # an ini's ParseError too
                    continue  # pytest itself will name the broken file when it runs
                _READ[file] = (signature, table)
            if isinstance(table, dict):
                return base, table
    return (fallback, {}) if fallback is not None else None


def import_paths(case_path: Path) -> tuple[str, ...]:
    """The ``sys.path`` entries a case at ``case_path`` imports the user's code from, in
    order: the ``pythonpath`` entries of its project's configuration, then the rootdir.
    Empty when no project is found above it."""
    found = _config(Path(os.path.abspath(case_path)))
    if found is None:
        return ()
    root, table = found
    value = table.get("pythonpath", [])
    entries = shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    paths = [os.path.normpath(root / entry) for entry in entries]
    return tuple(dict.fromkeys([*paths, str(root)]))


def prepend(entries: Sequence[str]) -> None:
    """Put ``entries`` first on ``sys.path``, in order, leaving those already there in place
    (under pytest, its ``pythonpath`` is applied already and keeps its position)."""
    sys.path[:0] = missing(entries)


def missing(entries: Sequence[str]) -> list[str]:
    """Those of ``entries`` that ``sys.path`` does not hold yet, in order (``prepend``)."""
    present = {os.path.abspath(p or os.curdir) for p in sys.path}
    return [entry for entry in entries if os.path.abspath(entry) not in present]


@contextlib.contextmanager
def importable(case_path: Path) -> Iterator[None]:
    """``sys.path`` as a run of the case at ``case_path`` sees it, restored afterwards: for
    looking a module up in the parent (``gpucase validate``) without changing the process."""
    saved = list(sys.path)
    prepend(import_paths(case_path))
    try:
        yield
    finally:
        sys.path[:] = saved

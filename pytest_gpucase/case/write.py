"""A case directory written whole: into a hidden temporary directory beside the target,
then renamed into place; an existing case is never overwritten."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_gpucase.base.files import fsync_directory, remove_stale_temporaries, temporary_path

__all__ = ["FileContent", "copy_into", "write_case_dir"]

FileContent = str | bytes | Callable[[Path], None]   # text, bytes, or a writer of that path


def write_case_dir(target: Path, document: Mapping[str, Any] | str,
                   files: Mapping[str, FileContent] | None = None,
                   copy_from: Sequence[Path] = (), *,
                   check: Callable[[Path], object] | None = None,
                   claim: Callable[[], Path] | None = None) -> Path:
    """Write a case directory at ``target`` atomically; never overwrite one.

    ``document`` is the ``case.toml`` document (written by tomli-w) or its text;
    ``files`` the other files by name (the payload as a writer: ``lambda p:
    payload.save(p, tensors)``); ``copy_from`` files or directories copied in
    (``case.py``, helpers). Everything goes to a hidden temporary directory
    beside ``target``, ``case.toml`` last, each file fsynced; ``check`` is then
    called on that directory (``load_case``: the new case must load as any
    other), and the directory is renamed onto ``target``. Raises
    ``FileExistsError`` when ``target`` exists. ``claim``, when given, creates
    the empty directory to rename onto instead (a free name, ``mkdir`` as the
    lock) and returns it; ``target`` then only names the temporary.
    """
    import tomli_w

    from pytest_gpucase.case.model import CASE_FILE

    if claim is None and target.exists():
        raise FileExistsError(f"{target} exists; a case is never overwritten")
    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (not mkdtemp) so that the umask applies as to any new directory.
    work = temporary_path(target)
    remove_stale_temporaries(target)
    os.mkdir(work)
    try:
        copy_into(copy_from, work)
        for name, content in (files or {}).items():
            if callable(content):
                content(work / name)
            else:
                data = content.encode("utf-8") if isinstance(content, str) else content
                _write_synced(work / name, data)
        text = document if isinstance(document, str) else tomli_w.dumps(document)
        _write_synced(work / CASE_FILE, text.encode("utf-8"))
        fsync_directory(work)
        if check is not None:
            check(work)
        if claim is not None:
            target = _rename_onto_claim(work, claim)
        else:
            if target.exists():
                raise FileExistsError(f"{target} appeared meanwhile; not overwritten")
            # A rename onto an existing non-empty directory fails: nothing is ever replaced.
            os.rename(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    fsync_directory(target.parent)
    return target


def copy_into(sources: Iterable[Path], target: Path) -> None:
    """Copy files and directories (without ``__pycache__``) into the directory ``target``."""
    for source in sources:
        if source.is_dir():
            shutil.copytree(source, target / source.name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target / source.name)


def _rename_onto_claim(work: Path, claim: Callable[[], Path]) -> Path:
    claimed = claim()
    try:
        try:
            os.rename(work, claimed)  # replaces our own empty claim (POSIX)
        except OSError:
            claimed.rmdir()  # platforms that refuse to rename onto a directory
            os.rename(work, claimed)
    except BaseException:
        if claimed.is_dir() and not any(claimed.iterdir()):
            claimed.rmdir()
        raise
    return claimed


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())

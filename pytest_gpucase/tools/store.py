"""The capture store's files that no case names any more (``gpucase store``, and a note of
``gpucase validate``).

A capture keeps each tensor of 1 MiB or more once, in ``.gpucase-store/<sha256>.safetensors``
beside its case directories (``case.payload``). A case deleted, minimized or captured again
leaves the files only it named; a writer killed midway leaves a partial temporary. Neither
is found by anything, and both get committed with ``cases/``. ``orphans`` lists them, for
one store, from the payload headers of the case directories beside it (no tensor read);
``prune`` removes them. A payload that cannot be read, or a capture still being written
beside the store (its staging folder, whose writer lives: it stores its tensors before its
case names them), makes the store's files unknown: nothing of that store is called an
orphan then.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_gpucase.base.errors import CaseFormatError, display
from pytest_gpucase.base.files import abandoned, being_written
from pytest_gpucase.case import payload
from pytest_gpucase.case.model import INPUTS_FILE

__all__ = ["Orphans", "orphans", "prune", "stores_under"]

_STORED = re.compile(r"[0-9a-f]{64}\.safetensors")


@dataclass(frozen=True)
class Orphans:
    """One store's files no case beside it names, and why none could be told (if so)."""

    store: Path
    files: tuple[Path, ...] = ()
    unknown: str = ""                 # a payload could not be read: nothing is an orphan
    sizes: dict[Path, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def stores_under(paths: Sequence[Path]) -> list[Path]:
    """The store folders at, beside (a case directory given) or under ``paths``."""
    found: list[Path] = []
    for path in map(Path, paths):
        candidates = [path / payload.STORE_DIR, path.parent / payload.STORE_DIR]
        if path.name == payload.STORE_DIR:
            candidates.insert(0, path)
        if path.is_dir():
            for current, dirs, _ in os.walk(path):
                if payload.STORE_DIR in dirs:
                    candidates.append(Path(current) / payload.STORE_DIR)
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for store in candidates:
            if store.is_dir() and not store.is_symlink() and store.resolve() not in {
                    s.resolve() for s in found}:
                found.append(store)
    return found


def _named(store: Path) -> set[str] | str:
    """The store files the case directories beside ``store`` name, or why they cannot be
    told (a payload that cannot be read)."""
    names: set[str] = set()
    # A capture being written stores its tensors before its staged case names them: until
    # it is done, any store file may be its, so none is an orphan.
    with os.scandir(store.parent) as entries:
        writing = [Path(entry.path) for entry in entries if being_written(entry)]
    if writing:
        return (f"a capture is being written beside it ({display(writing[0])}); run again "
                "once it is done")
    for case_dir in sorted(p for p in store.parent.iterdir() if p.is_dir()):
        file = case_dir / INPUTS_FILE
        if case_dir.name.startswith(".") or not os.path.lexists(file):
            continue
        try:
            metadata = payload.read_header(file)[1]
            table = json.loads(metadata.get(payload.STORE_KEY, "{}"))
        except (CaseFormatError, OSError, ValueError) as exc:
            return f"{display(file)} cannot be read ({exc})"
        if isinstance(table, dict):
            names.update(f"{digest}.safetensors" for digest in table.values()
                         if isinstance(digest, str))
    return names


def orphans(store: Path) -> Orphans:
    """The files of ``store`` that no case beside it names: store files of no case, and
    temporaries whose writer is gone (a killed writer's partial file)."""
    named = _named(store)
    if isinstance(named, str):
        return Orphans(store, unknown=named)
    files: list[Path] = []
    sizes: dict[Path, int] = {}
    for entry in sorted(os.scandir(store), key=lambda e: e.name):
        if entry.name in named:
            continue
        if not (_STORED.fullmatch(entry.name) or abandoned(entry)):
            continue  # not the store's, or a temporary still being written: left alone
        path = Path(entry.path)
        files.append(path)
        try:
            sizes[path] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            sizes[path] = 0
    return Orphans(store, tuple(files), sizes=sizes)


def prune(found: Iterable[Orphans]) -> list[Path]:
    """Remove the orphans found (those of stores whose cases could all be read); returns
    what was removed. A file named again meanwhile is kept: each store is read again."""
    removed: list[Path] = []
    for before in found:
        if before.unknown:
            continue
        again = orphans(before.store)
        for path in set(before.files) & set(again.files):
            try:
                if path.is_dir() and not path.is_symlink():
                    continue
                path.unlink()
            except OSError:
                continue
            removed.append(path)
    return sorted(removed)

"""``gpucase store`` against captures still being written (issue 30 item 2): a store file a
live capture has written and its staged case does not name yet is never an orphan, so a
prune run beside a training job never takes a tensor from the case it is writing."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_gpucase.base.files import HOST, temporary_path
from pytest_gpucase.case import payload
from pytest_gpucase.tools.store import orphans, prune


def _store(root: Path) -> tuple[Path, Path]:
    store = root / payload.STORE_DIR
    store.mkdir(parents=True)
    blob = store / ("ab" * 32 + ".safetensors")
    blob.write_bytes(b"a tensor a capture stored before its case named it")
    return store, blob


def test_a_store_file_of_a_capture_being_written_is_not_an_orphan(tmp_path: Path) -> None:
    """This process is the writer: its staging folder beside the store (not yet holding
    the payload that names the file) makes the store's files unknown, not orphans."""
    store, blob = _store(tmp_path / "cases")
    os.mkdir(temporary_path(tmp_path / "cases" / "TinyLM"))
    found = orphans(store)
    assert found.files == () and "being written" in found.unknown, found
    assert prune([found]) == [] and blob.exists()


def test_a_dead_writers_staging_folder_leaves_its_store_files_orphans(tmp_path: Path) -> None:
    store, blob = _store(tmp_path / "cases")
    os.mkdir(tmp_path / "cases" / f".TinyLM.{HOST}.99999999.0123abcd.tmp")  # no such pid
    found = orphans(store)
    assert found.files == (blob,) and not found.unknown
    assert prune([found]) == [blob] and not blob.exists()

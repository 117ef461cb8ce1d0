"""What a checkpoint without a manifest can be shown to be (``tools.checkpoint``'s
weaker verdict, ``LOADABLE``): a whole archive, loadable without unpickling code, every
tensor's bytes in the file. Also the loader's errors in one sentence, for every verdict."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import torch

from pytest_gpucase.base.tensors import named_tensors

__all__ = ["UNPROVEN", "archive_problem", "is_zip", "load_error", "refused_global", "size_problems",
           "unpickling_needed"]

# A plain checkpoint's verdict when every check it can have passed.
UNPROVEN = "no manifest: loadable and finite, but the write's completeness is not proven"


def is_zip(path: Path) -> bool:
    """Whether ``path`` is a zip (torch.save's format since 1.6), by torch's own test."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def archive_problem(path: Path, size: int) -> str | None:
    """What is wrong with a plain ``torch.save`` zip's structure, checked as a manifest's
    hash would be: the central directory (written last: a truncated write has none) and
    every record's CRC (a damaged byte). None for a whole zip, or another format."""
    if not is_zip(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except zipfile.BadZipFile:
        return (f"not a whole zip archive: its directory, which torch.save writes last, is "
                f"missing ({size} bytes): truncated write?")
    if damaged is not None:
        return f"record {damaged} is damaged (its CRC does not match): corrupted on disk?"
    return None


def size_problems(path: Path, loaded: object) -> list[str]:
    """A ``torch.save`` zip's tensor records against the tensors loaded from them. torch
    memory-maps the records without checking their sizes: a tensor whose record lost bytes
    reads past its end, into the next record. The storages (shared ones once) must fit in
    the records' bytes."""
    if not is_zip(path):
        return []
    with zipfile.ZipFile(path) as archive:
        stored = sum(info.file_size for info in archive.infolist()
                     if re.search(r"(^|/)data/\d+$", info.filename))
    storages: dict[int, int] = {}
    for _, tensor in named_tensors(loaded):
        if tensor.layout == torch.strided and not tensor.is_meta:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    held = sum(storages.values())
    if held <= stored:
        return []
    return [f"its tensors hold {held} bytes but the archive's tensor records {stored}: a "
            "record was cut short or rewritten (torch reads past its end)"]


def refused_global(exc: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` refused what the pickle names (a class, a
    function): the file may be whole, but only full unpickling would load it."""
    return "WeightsUnpickler error:" in str(exc)


def unpickling_needed(exc: BaseException) -> str:
    """The verdict's words for a file ``refused_global`` refused: why it was not loaded."""
    reason = load_error(exc).removeprefix("refused by torch.load(weights_only=True): ")
    return (f"needs full unpickling, so not loaded: torch.load(weights_only=True) refuses it "
            f"({reason}); a full load may run any code its pickle names: save tensors, "
            "state dicts and plain values instead")


# torch.load's words for a zip record that holds fewer bytes than its tensor (mmap).
_SHORT_RECORD = "Trying to resize storage that is not resizable"


def load_error(exc: BaseException) -> str:
    """Reduce a loader's error to its one informative sentence."""
    text = str(exc)
    if _SHORT_RECORD in text:
        return ("a tensor's record in the archive holds fewer bytes than the tensor: the "
                f"file was cut short or rewritten (torch.load: {_SHORT_RECORD})")
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split("\n\n", 1)[0]
        return f"refused by torch.load(weights_only=True): {_first_sentence(reason)}"
    return f"{type(exc).__name__}: {_first_sentence(text)}"


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.split(". ", 1)[0].rstrip(".")

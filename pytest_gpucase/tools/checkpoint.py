"""Atomic checkpoint save with a manifest, and validation before a restart.

A restart must only ever start from a checkpoint that is proven complete and
sound. ``save`` writes the checkpoint and a sidecar manifest
``<path>.manifest.json`` (size, sha256, every tensor's shape, dtype and
non-finite count). ``validate`` checks a file against its manifest, loads it
without running pickle code, checks that every floating tensor is finite and,
given a model, that keys and shapes still match.

A checkpoint without a manifest (a plain ``torch.save``, a safetensors file
written by another tool) gets a weaker verdict, ``LOADABLE``: it loads with
``torch.load(weights_only=True)`` (or as safetensors), every floating tensor is
finite, its archive is whole (a zip's central directory and every record's
CRC; a safetensors header's offsets inside the file) and every tensor's bytes
are in the file; but nothing proves its write completed. It is a usable restart point,
with that caveat; ``require_manifest`` refuses it. A plain file that needs full
unpickling (a pickled class, a function) is not loaded: it is ``UNCHECKED``,
never a restart point, since loading it may run any code its pickle names.

Re-saving to the same path keeps a valid checkpoint at every instant, whenever
the writer is killed. The file and its manifest are two files, and no rename
replaces both at once; so, for a while, the manifest vouches for both the old
and the new file:

1. the new object goes to a temporary file beside ``path``, is fsynced and hashed;
2. the manifest is atomically replaced by one that describes the new file and,
   under ``previous``, the record of the file still at ``path``;
3. the temporary file is renamed over ``path`` (the directory is fsynced);
4. the manifest is atomically replaced by one that describes the new file alone.

Every manifest a reader can meet vouches for every file it can meet beside it:
the old manifest with the old file (before 2), the two-record manifest with
either file (2 to 4), the new manifest with the new file (after 4). A kill
between 3 and 4 leaves a two-record manifest, which is as sound (the next
save drops the record that no longer fits the file). ``path`` itself stays the
plain checkpoint, loadable with ``torch.load(path)`` and nothing else.

A killed writer leaves its temporary file behind. Temporaries are named
``.<name>.<host>.<pid>.<token>.tmp`` (hidden: scans skip them), and every
write removes those beside its target whose writer is gone: written on this
host by a pid that no longer runs, or untouched for a day (a writer on
another host, whose pid means nothing here).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TypeAlias, TypeVar, cast

import torch

from pytest_gpucase.base import files
from pytest_gpucase.base.tensors import dotted, named_tensors
from pytest_gpucase.case.project import import_paths, prepend
from pytest_gpucase.tools.checkpoint_contents import (
    STATE_DICT_KEYS,
    find_state_dict,
    further_problems,
    tied_aliases,
)
from pytest_gpucase.tools.checkpoint_contents import holds as contents_of
from pytest_gpucase.tools.checkpoint_plain import (
    UNPROVEN,
    archive_problem,
    is_zip,
    load_error,
    refused_global,
    size_problems,
    unpickling_needed,
)

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "FORMAT_VERSION",
    "STATE_DICT_KEYS",
    "UNPROVEN",
    "Manifest",
    "ManifestError",
    "ModelSpecError",
    "Survey",
    "TensorRecord",
    "Validation",
    "manifest_path",
    "newest_valid",
    "save",
    "scan",
    "survey",
    "validate",
]

FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"
# File names a directory scan treats as checkpoints; explicit file paths are always taken.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".pth.tar")
NO_MANIFEST = (
    "no manifest: cannot prove the write completed; re-save with pytest_gpucase.checkpoint.save"
)
# A manifest is about 130 bytes a tensor: this covers half a million tensors (one
# shard of a large model with its Adam state, listed twice while a re-save
# swaps files), and keeps a runaway file from being read whole.
MAX_MANIFEST_BYTES = 64 << 20
# Temporaries, their names and their cleanup: files.
_HOST = files.HOST

_CHUNK_BYTES = 1 << 20
# Bounds the temporary boolean mask of the finiteness check, so a 10 GB tensor
# does not need another 2.5 GB to be checked.
_CHUNK_ELEMENTS = 1 << 24
_DDP_PREFIX = "module."

PathLike: TypeAlias = "str | os.PathLike[str]"
ModelLike: TypeAlias = "torch.nn.Module | Mapping[str, object]"
_T = TypeVar("_T")


class ManifestError(ValueError):
    """A manifest file that is not a valid gpucase manifest."""


class ModelSpecError(ValueError):
    """A model reference (a checkpoint file or ``pkg.module:attr``) that gives no model."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a checkpoint as it was at save time."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int

    @property
    def finite(self) -> bool:
        """Whether the tensor held no NaN and no infinity."""
        return self.nan == 0 and self.inf == 0


@dataclass(frozen=True)
class Manifest:
    """What ``save`` wrote: enough to prove later that the file is complete and unchanged."""

    format: int
    sha256: str
    size: int
    created: datetime
    tensors: tuple[TensorRecord, ...]
    # While a re-save swaps files: the records of the file it replaces, which this
    # manifest also vouches for (see the module docstring). Empty otherwise.
    previous: tuple[Manifest, ...] = ()

    @property
    def finite(self) -> bool:
        """Whether every floating tensor was finite at save time."""
        return all(record.finite for record in self.tensors)

    def to_json(self) -> dict[str, object]:
        """Return the manifest as the JSON object stored next to the checkpoint."""
        previous = {"previous": [r.to_json() for r in self.previous]} if self.previous else {}
        return {
            "format": self.format,
            "sha256": self.sha256,
            "size": self.size,
            "created": self.created.isoformat(timespec="microseconds"),
            "finite": self.finite,
            **previous,
            "tensors": [
                {
                    "name": r.name,
                    "shape": list(r.shape),
                    "dtype": r.dtype,
                    "nan": r.nan,
                    "inf": r.inf,
                }
                for r in self.tensors
            ],
        }

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """Build a manifest from its JSON object, raising ManifestError naming the bad field."""
        manifest = cls._one_from_json(data)
        if not isinstance(data, dict) or "previous" not in data:
            return manifest
        previous = []
        for i, entry in enumerate(_field(data, "previous", list)):
            try:
                previous.append(cls._one_from_json(entry))
            except ManifestError as exc:
                raise ManifestError(f"previous[{i}]: {exc}") from None
        return replace(manifest, previous=tuple(previous))

    @classmethod
    def _one_from_json(cls, data: object) -> Manifest:
        """One record, without its ``previous`` list (records never nest deeper)."""
        if not isinstance(data, dict):
            raise ManifestError("not a JSON object")
        version = _field(data, "format", int)
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"format {version} is newer than this gpucase understands ({FORMAT_VERSION})"
            )
        records = []
        for i, entry in enumerate(_field(data, "tensors", list)):
            if not isinstance(entry, dict):
                raise ManifestError(f"tensors[{i}]: not a JSON object")
            shape = _field(entry, "shape", list)
            if not all(isinstance(n, int) for n in shape):
                raise ManifestError(f"tensors[{i}].shape: not a list of integers")
            records.append(
                TensorRecord(
                    name=_field(entry, "name", str),
                    shape=tuple(shape),
                    dtype=_field(entry, "dtype", str),
                    nan=_field(entry, "nan", int),
                    inf=_field(entry, "inf", int),
                )
            )
        try:
            created = datetime.fromisoformat(_field(data, "created", str))
        except ValueError:
            raise ManifestError("created: not an ISO 8601 time") from None
        return cls(
            format=version,
            sha256=_field(data, "sha256", str),
            size=_field(data, "size", int),
            created=created,
            tensors=tuple(records),
        )


@dataclass(frozen=True)
class Validation:
    """The verdict on one checkpoint file: truthy when it is a restart point (``proven``
    when a manifest vouches for it; else ``caveat`` says what is not proven)."""

    path: Path
    problems: tuple[str, ...]
    mtime: float | None = None
    # The manifest record that vouches for the file (during a re-save, possibly one
    # of its ``previous`` records); the newest record when none does.
    manifest: Manifest | None = None
    # Where the model's state dict was found ("at top level", "under 'model'", ...);
    # None when no model was compared.
    layout: str | None = None
    # No manifest: what the verdict does not prove (UNPROVEN) when every other check passed.
    caveat: str | None = None
    # No manifest, and torch.load(weights_only=True) refused it: not loaded, not checked.
    unchecked: bool = False
    # What a restart from it gets back ("weights + optimizer + iter_num 400"); None when
    # it was not loaded.
    holds: str | None = None

    @property
    def resumable(self) -> bool:
        """Whether it holds an optimizer's state beside the weights (a restart from a
        weights-only file starts the optimizer and the step count afresh)."""
        return self.holds is not None and "optimizer" in self.holds

    def __bool__(self) -> bool:
        return not self.problems

    @property
    def proven(self) -> bool:
        """A restart point whose write a manifest proves complete."""
        return not self.problems and self.caveat is None

    @property
    def verdict(self) -> str:
        """As the CLI prints it: ``VALID`` (its manifest vouches), ``LOADABLE`` (no
        manifest; loads, finite, whole), ``UNCHECKED`` (no manifest, and loading it needs
        full unpickling) or ``INVALID``."""
        if not self.problems:
            return "VALID" if self.caveat is None else "LOADABLE"
        return "UNCHECKED" if self.unchecked else "INVALID"


def manifest_path(path: PathLike) -> Path:
    """Return where the manifest of the checkpoint at ``path`` lives."""
    path = Path(path)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def save(obj: object, path: PathLike) -> Manifest:
    """Write ``obj`` to ``path`` with its manifest, and return the manifest.

    A valid checkpoint is at ``path`` at every instant: the previous one until
    the new one is complete, then the new one (the module docstring says how).
    ``.safetensors`` paths take a flat mapping of names to tensors; anything
    else is written with ``torch.save`` and should hold only what
    ``torch.load(weights_only=True)`` accepts (tensors, containers, numbers,
    strings), since that is how :func:`validate` loads it.
    """
    path = Path(path)
    if path.name.endswith(".safetensors"):
        tensors = _flat_tensors(obj, path)
        from pytest_gpucase.case.payload import save as save_payload

        def write(tmp: Path) -> None:
            # Our own writer: safetensors.torch.save_file needs numpy, which torch does not bring.
            save_payload(tmp, dict(tensors))

    else:

        def write(tmp: Path) -> None:
            torch.save(obj, str(tmp))

    # Counted before writing: the counts describe the object that went to disk.
    records = tuple(_record(name, t) for name, t in _walk_tensors(obj))
    tmp, sha256, size = _write_temporary(path, write)
    try:
        manifest = Manifest(
            format=FORMAT_VERSION,
            sha256=sha256,
            size=size,
            created=datetime.now(timezone.utc),
            tensors=records,
        )
        replaced = _records_of_file_in_place(path, sha256)
        # Vouches for the file in place and for the new one, whichever a kill leaves there.
        _write_manifest(path, replace(manifest, previous=replaced))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    files.fsync_directory(path.parent)
    if replaced:
        _write_manifest(path, manifest)
    return manifest


def validate(path: PathLike, model: ModelLike | None = None) -> Validation:
    """Check one checkpoint file and list every reason not to restart from it.

    Never raises for what it finds: a file, a manifest or a model that fails in
    an unforeseen way is this file's verdict, so that a scan goes on to the next.
    """
    path = Path(path)
    try:
        return _validate(path, model)
    # Hostile or damaged input can fail anywhere (a pickle nested past the recursion
    # limit, an I/O error mid-read): a verdict, not a crash.
    except Exception as exc:
        return Validation(path, (f"cannot validate: {load_error(exc)}",))


def _validate(path: Path, model: ModelLike | None) -> Validation:
    try:
        before = path.stat()
    except FileNotFoundError:
        return Validation(path, ("file not found",))
    except OSError as exc:
        return Validation(path, (f"cannot read: {exc.strerror or exc}",))
    if not stat.S_ISREG(before.st_mode):
        return Validation(path, ("not a regular file",), before.st_mtime)

    problems: list[str] = []
    manifest: Manifest | None = None
    unproven = False
    try:
        manifest = read_manifest(manifest_path(path))
    except (OSError, ManifestError) as exc:
        problems.append(f"manifest unreadable: {exc}")
    else:
        unproven = manifest is None
    if manifest is not None:
        manifest, problem = _vouching_record(path, before.st_size, manifest)
        if problem is not None:
            problems.append(problem)

    layout: str | None = None
    holds: str | None = None
    unchecked = False
    broken = archive_problem(path, before.st_size) if unproven else None
    if broken is not None:   # torch's own message for it says less
        problems.append(broken)
    else:
        try:
            loaded = _load(path)
        # Any failure to load (corrupt zip, refused global, bad header) is a verdict.
        except Exception as exc:
            unchecked = unproven and refused_global(exc)
            problems.append(unpickling_needed(exc) if unchecked
                            else f"cannot load: {load_error(exc)}")
        else:
            holds = contents_of(loaded)
            problems.extend(_nonfinite_problems(loaded))
            if unproven:
                problems.extend(size_problems(path, loaded))
            if model is not None:
                layout, model_problems = _compare_with_model(loaded, model)
                problems.extend(model_problems)

    # The checks above read the file several times; all must have seen the same file.
    try:
        after = path.stat()
    except FileNotFoundError:
        problems.append("file was removed while being validated")
    else:
        if (after.st_ino, after.st_size, after.st_mtime_ns) != (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        ):
            problems.append("file was replaced while being validated; validate again")
    if unproven and not problems:   # as sound as a file without a manifest can be shown
        return Validation(path, (), before.st_mtime, None, layout, caveat=UNPROVEN,
                          holds=holds)
    if unproven and not unchecked:
        # Last: when such a file also fails to load, that is the more telling first problem.
        problems.append(NO_MANIFEST)
    return Validation(path, tuple(problems), before.st_mtime, manifest, layout,
                      unchecked=unchecked, holds=holds)


def read_manifest(path: PathLike) -> Manifest | None:
    """Read the manifest file at ``path``; None when there is none.

    Raises OSError when it cannot be read and ManifestError when it is not a
    manifest: a FIFO, a device (a link to /dev/zero), a directory, a file over
    ``MAX_MANIFEST_BYTES``, or JSON that is invalid or nested past the parser's limit.
    """
    # O_NONBLOCK: opening a FIFO to read waits for a writer that may never come.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    try:
        # Checked on the open file, so the file read is the file checked.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ManifestError(
                "not a regular file (a FIFO, device or directory); save() writes a JSON file"
            )
        if info.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{info.st_size} bytes, more than a manifest holds ({MAX_MANIFEST_BYTES})"
            )
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"grew past {MAX_MANIFEST_BYTES} bytes while being read")
    try:
        # save() writes UTF-8; json.loads would guess other encodings from bytes.
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ManifestError("JSON nested too deeply to be a manifest") from None
    # JSONDecodeError and UnicodeDecodeError are both ValueErrors.
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    return Manifest.from_json(data)


def _vouching_record(path: Path, size: int, manifest: Manifest) -> tuple[Manifest, str | None]:
    """The record of ``manifest`` that matches the file, or the newest and why none does."""
    candidates = [r for r in (manifest, *manifest.previous) if r.size == size]
    if not candidates:
        why = "truncated write?" if size < manifest.size else "changed after save?"
        return manifest, f"size {size} bytes but manifest says {manifest.size} ({why})"
    # A size mismatch already implies a different hash: the file is only read when a
    # record of its size exists.
    digest = _sha256_file(path)
    for record in candidates:
        if record.sha256 == digest:
            return record, None
    return manifest, "sha256 differs from manifest"


def _records_of_file_in_place(path: Path, new_sha256: str) -> tuple[Manifest, ...]:
    """The records of the present manifest that may describe the file now at ``path``.

    Those of its size, unhashed: hashing a large checkpoint on every save would
    cost more than it proves, and a record only ever vouches for its own hash.
    """
    try:
        size = path.stat().st_size
        current = read_manifest(manifest_path(path))
    except (OSError, ManifestError):
        return ()  # Nothing valid in place: nothing to keep vouching for.
    if current is None:
        return ()
    kept = {
        record.sha256: replace(record, previous=())
        for record in (current, *current.previous)
        if record.size == size and record.sha256 != new_sha256
    }
    return tuple(kept.values())


def _write_manifest(path: Path, manifest: Manifest) -> None:
    text = _manifest_text(manifest)

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    _atomic_write(manifest_path(path), write)


def scan(paths: PathLike | Iterable[PathLike], model: ModelLike | None = None) -> list[Validation]:
    """Validate every checkpoint in ``paths`` (files, or directories' top level), newest first.

    A directory that cannot be listed gets an INVALID verdict of its own, after the files.
    """
    files, unlisted = _candidates(paths)
    return [*(validate(path, model) for path in _newest_first(files)), *unlisted]


def newest_valid(
    paths: PathLike | Iterable[PathLike], model: ModelLike | None = None,
    *, require_manifest: bool = False,
) -> Path | None:
    """Return the newest checkpoint in ``paths`` that is a restart point, or None when none
    is. Without a manifest a checkpoint that loads, is finite and whole is one (``LOADABLE``);
    ``require_manifest``: only one whose manifest vouches for it (``VALID``)."""
    # Stops at the first valid one, so older checkpoints are not hashed for nothing.
    for path in _newest_first(_candidates(paths)[0]):
        result = validate(path, model)
        if result.proven if require_manifest else result:
            return path
    return None


@dataclass(frozen=True)
class Survey:
    """What ``gpucase checkpoint`` found: every verdict, newest first, and where to restart."""

    paths: tuple[str, ...]
    results: tuple[Validation, ...]
    require_manifest: bool = False   # a LOADABLE checkpoint is no restart point

    @property
    def restart(self) -> Validation | None:
        """The newest restart point (``VALID``, or ``LOADABLE`` unless a manifest is
        required), or None when there is none."""
        return next((result for result in self.results
                     if (result.proven if self.require_manifest else result)), None)

    def render(self, all_problems: bool = False) -> str:
        """The table of verdicts, what each file holds, and the line that says which
        checkpoint to restart from. A file's problems after its first are listed below
        it, ``checkpoint_contents.SHOWN_PROBLEMS`` of them unless ``all_problems``."""
        if not self.results:
            return f"no checkpoint found in {', '.join(self.paths)}"
        rows = [("TIME", "FILE", "VERDICT", "HOLDS", "PROBLEM")]
        more: list[tuple[str, ...]] = [()]
        for result in self.results:
            problems = result.problems or ((result.caveat,) if result.caveat else ("",))
            when = "-" if result.mtime is None else _local_time(result.mtime)
            rows.append((when, str(result.path), result.verdict, result.holds or "-",
                         problems[0]))
            more.append(further_problems(problems[1:], all_problems))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = []
        for row, further in zip(rows, more, strict=True):
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
            indent = " " * (sum(widths) + 2 * len(widths))
            lines.extend(f"{indent}{problem}" for problem in further)

        chosen = self.restart
        if chosen is None:
            some = ("no checkpoint with a manifest (--require-manifest)"
                    if self.require_manifest and any(self.results) else "no valid checkpoint")
            lines.append(f"{some}: nothing to restart from")
            return "\n".join(lines)
        newer = self.results.index(chosen)
        notes = []
        if chosen.caveat is not None:
            notes.append(chosen.caveat)
            proven = next((r for r in self.results[newer:] if r.proven), None)
            if proven is not None:
                notes.append(f"{proven.path}, older, is proven by its manifest")
        if chosen.layout is not None:
            notes.append(f"model state dict {chosen.layout}")
        if chosen.holds is not None and not chosen.resumable:
            notes.append(_weights_only(chosen, self.results[newer + 1:], self.require_manifest))
        if newer:
            notes.append(_skipped(self.results[:newer]))
        suffix = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"restart from: {chosen.path}{suffix}")
        return "\n".join(lines)


def _weights_only(chosen: Validation, older: Sequence[Validation],
                  require_manifest: bool) -> str:
    """The restart line's note for a restart point without an optimizer's state: what a
    restart from it loses, and the newest older one that has it."""
    lost = f"it holds {chosen.holds}: a restart from it starts the optimizer afresh"
    full = next((r for r in older if r.resumable
                 and (r.proven if require_manifest else bool(r))), None)
    if full is None:
        return lost
    return f"{lost}; {full.path}, older, holds {full.holds}: restart from it to resume"


def _skipped(newer: Sequence[Validation]) -> str:
    """``2 newer checkpoints invalid``, or by verdict when they differ."""
    counts = {verdict: sum(r.verdict == verdict for r in newer)
              for verdict in ("INVALID", "UNCHECKED", "LOADABLE")}
    parts = [f"{n} {verdict.lower()}" for verdict, n in counts.items() if n]
    plural = "s" if len(newer) > 1 else ""
    if len(parts) == 1:
        return f"{len(newer)} newer checkpoint{plural} {parts[0].split(' ', 1)[1]}"
    return f"{len(newer)} newer checkpoint{plural} not taken: {', '.join(parts)}"


def survey(paths: Sequence[str], model: str | None = None,
           require_manifest: bool = False) -> Survey:
    """Validate the checkpoints in ``paths``, newest first, against ``model`` if given
    (``require_manifest``: a checkpoint without one is no restart point).

    ``model`` is a checkpoint file whose state dict is the reference, or
    ``pkg.module:attr`` naming a module, a state dict, or a callable returning
    one. Raises ModelSpecError, naming ``model``, when it gives no model.
    """
    reference: ModelLike | None = None
    if model is not None:
        try:
            reference = _resolve_model(model)
        # User code and user files can fail in any way; it is the reference that is unusable.
        except Exception as exc:
            raise ModelSpecError(f"{model}: {load_error(exc)}") from exc
    return Survey(tuple(paths), tuple(scan(paths, reference)), require_manifest)


def _field(data: Mapping[str, object], key: str, kind: type[_T]) -> _T:
    value = data.get(key)
    # bool is an int subclass; a boolean size or count is a corrupt manifest.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _manifest_text(manifest: Manifest) -> str:
    """Render the manifest as JSON with one line per tensor, so large models stay readable."""
    data = manifest.to_json()
    tensors = cast("list[object]", data.pop("tensors"))
    head = json.dumps(data, indent=2).removesuffix("\n}")
    rows = ",\n".join(f"    {json.dumps(record)}" for record in tensors)
    body = f"[\n{rows}\n  ]" if rows else "[]"
    return f'{head},\n  "tensors": {body}\n}}\n'


def _atomic_write(path: Path, write: Callable[[Path], None]) -> tuple[str, int]:
    """Write through ``write`` to a temporary sibling, make it durable, rename it over ``path``."""
    tmp, sha256, size = _write_temporary(path, write)
    files.replace(tmp, path)
    return sha256, size


def _write_temporary(path: Path, write: Callable[[Path], None]) -> tuple[Path, str, int]:
    """Write through ``write`` to a new durable temporary beside ``path``; return it and its hash.

    The caller renames it into place (or removes it). ``files.new_temporary``
    first removes the temporaries that killed writers left beside ``path``.
    """
    tmp = files.new_temporary(path)
    try:
        write(tmp)
        # The writer has closed (so flushed) its own handle; fsync acts on the file, so
        # syncing through a new handle makes those bytes durable before the rename.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
            # Hash what is on disk, not what we meant to write.
            sha256, size = _sha256_stream(f)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, sha256, size


def _sha256_stream(f: IO[bytes]) -> tuple[str, int]:
    f.seek(0)
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256_stream(f)[0]


def _flat_tensors(obj: object, path: Path) -> Mapping[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"{path}: a .safetensors file holds a flat mapping of names to tensors, "
            f"got {type(obj).__name__}; save other objects to a .pt path"
        )
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{path}: a .safetensors file holds a flat mapping of names to tensors, "
                f"got {type(value).__name__} at {key!r}; save other objects to a .pt path"
            )
    return obj


def _walk_tensors(obj: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested mappings and sequences with its dotted name (fsutil's walk)."""
    for name, tensor in named_tensors(obj, name=dotted):
        yield name or "<root>", tensor


def _record(name: str, tensor: torch.Tensor) -> TensorRecord:
    nan, inf = _count_nonfinite(tensor)
    return TensorRecord(
        name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), nan, inf
    )


def _count_nonfinite(tensor: torch.Tensor) -> tuple[int, int]:
    """Count NaN and infinite elements of a floating or complex tensor."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0, 0
    if tensor.layout != torch.strided or tensor.is_meta:
        return 0, 0  # Sparse and meta tensors have no dense values to scan here.
    flat = tensor.detach().reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        if bool(torch.isfinite(chunk).all()):
            continue
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def _load(path: Path) -> object:
    """Load a checkpoint on the CPU without executing pickle code."""
    if path.name.endswith(".safetensors"):
        from pytest_gpucase.case.payload import STORE_KEY, read_header
        from pytest_gpucase.case.payload import load as load_payload

        # A checkpoint holds its tensors itself (save writes no store): metadata naming
        # store files would lead outside its folder (../.gpucase-store), so it is refused.
        if STORE_KEY in read_header(path)[1]:
            raise ValueError(f"its metadata '{STORE_KEY}' names store files outside its "
                             "folder; a checkpoint holds its tensors itself: save it again")
        return load_payload(path)
    # map_location="cpu" keeps validation from initializing CUDA in this process;
    # mmap keeps a 50 GB checkpoint from needing 50 GB of RAM to be checked (legacy,
    # non-zip files cannot be memory-mapped).
    return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip(path))


def _nonfinite_problems(loaded: object) -> list[str]:
    problems = []
    for name, tensor in _walk_tensors(loaded):
        nan, inf = _count_nonfinite(tensor)
        if nan or inf:
            problems.append(f"{name}: {nan} NaN, {inf} inf")
    return problems


def _compare_with_model(loaded: object, model: ModelLike) -> tuple[str | None, list[str]]:
    expected = model.state_dict() if isinstance(model, torch.nn.Module) else model
    found = find_state_dict(loaded)
    if found is None:
        keys = ", ".join(map(str, loaded)) if isinstance(loaded, Mapping) else type(loaded).__name__
        wanted = ", ".join(repr(k) for k in STATE_DICT_KEYS)
        problem = (
            "no model state dict found: expected tensors at top level or a mapping under "
            f"{wanted}; found {keys}"
        )
        return None, [problem]
    layout, prefix, state = found
    problems = []
    if set(state) != set(expected):
        stripped = {str(k).removeprefix(_DDP_PREFIX): v for k, v in state.items()}
        if set(stripped) == set(expected):
            problems.append(
                "keys carry the 'module.' prefix of DistributedDataParallel: "
                "save model.module.state_dict(), or strip the prefix before loading"
            )
            state, prefix = stripped, f"{prefix}{_DDP_PREFIX}"
        else:
            aliases = tied_aliases(expected)
            # A tied alias (same storage in the model) is restored from its peer by
            # safetensors.torch.load_model, which drops it when saving: not missing.
            missing = [k for k in expected if k not in state
                       and not any(peer in state for peer in aliases.get(k, ()))]
            # And a tied alias the checkpoint keeps that the reference saved once.
            kept = tied_aliases(state)
            unexpected = [str(k) for k in state if k not in expected
                          and not any(peer in expected for peer in kept.get(str(k), ()))]
            if missing:
                problems.append(f"missing keys: {_some(missing)}")
            if unexpected:
                problems.append(f"unexpected keys: {_some(unexpected)}")
    for key, want in expected.items():
        have = state.get(key)
        if isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor):
            if have.shape != want.shape:
                problems.append(
                    f"{prefix}{key}: shape {tuple(have.shape)} but model has {tuple(want.shape)}"
                )
        elif key in state and isinstance(want, torch.Tensor):
            problems.append(f"{prefix}{key}: {type(have).__name__} but model has a tensor")
    return layout, problems


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def _candidates(paths: PathLike | Iterable[PathLike]) -> tuple[list[Path], list[Validation]]:
    """The checkpoint files in ``paths``, and a verdict for each directory that cannot be listed."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    unlisted: list[Validation] = []
    for entry in map(Path, paths):
        try:
            if not entry.is_dir():
                # Named explicitly: validate it whatever its name, so a typo reads "file not found".
                found.append(entry)
                continue
            children = list(entry.iterdir())
        except OSError as exc:
            unlisted.append(Validation(entry, (f"cannot list: {exc.strerror or exc}",)))
            continue
        for child in children:
            if child.name.startswith(".") or not child.name.endswith(CHECKPOINT_SUFFIXES):
                continue
            try:
                regular = child.is_file()
            except OSError:
                regular = True  # Unreadable: validate says why.
            if regular:
                found.append(child)
    return list(dict.fromkeys(found)), unlisted


def _newest_first(paths: list[Path]) -> list[Path]:
    def key(path: Path) -> tuple[int, str]:
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = -1  # Missing files sort last.
        # Same mtime (coarse filesystem clocks): later names like step-200 first.
        return mtime, path.name

    return sorted(paths, key=key, reverse=True)


def _local_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _resolve_model(spec: str) -> ModelLike:
    """Turn the CLI's ``--model`` into a module or state dict to compare against."""
    if Path(spec).is_file():
        found = find_state_dict(_load(Path(spec)))
        if found is None:
            raise ValueError("no model state dict found in that file")
        return found[2]
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError("expected a checkpoint file or pkg.module:attr")
    # As pytest would import it: from the working directory and its project's paths.
    prepend([*import_paths(Path.cwd()), os.getcwd()])
    target: object = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if callable(target) and not isinstance(target, torch.nn.Module):
        target = target()
    if isinstance(target, (torch.nn.Module, Mapping)):
        return target
    raise ValueError(f"{attr} is a {type(target).__name__}, not a module or state dict")

"""Files written atomically, and the temporaries of dead writers removed: once, here.

A reader (a collecting pytest, a restart, a CI uploader) must never see half a
file, and a killed writer must not leave its half where it is read:

* ``write_atomic`` writes to a temporary file beside the target (same directory:
  ``os.replace`` is atomic only within one file system), fsyncs it, renames it
  over the target and fsyncs the directory, so the rename itself survives a
  power loss. The temporary is created with mode 0o666 through ``O_CREAT`` so
  that the umask applies as to any new file (``mkstemp`` makes it private).
* Temporaries are named ``.<name>.<host>.<pid>.<token>.tmp`` (hidden: scans and
  collection skip them); every write first removes those beside its target
  whose writer is gone: written on this host by a pid that no longer runs, or
  untouched for a day (a writer on another host, whose pid means nothing here).

A whole case directory is written the same way by ``case.write``; the walk over nested
tensors is ``base.tensors.named_tensors``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterable
from typing import BinaryIO
from pathlib import Path

from pytest_gpucase.base.errors import file_kind

__all__ = [
    "HOST", "FileTooLarge", "NotRegularFile", "abandoned", "being_written", "file_sha256",
    "fsync_directory",
    "new_temporary", "open_regular", "read_head", "read_regular", "remove_stale_temporaries",
    "replace", "running", "stat_signature", "sweep_temporaries",
    "temporary_path", "write_atomic",
    "write_text_atomic",
]

# A writer's temporary file that has not changed for this long is abandoned,
# whoever wrote it: no write spends a day without writing or renaming.
STALE_AFTER_SECONDS = 24 * 3600
# Which host wrote a temporary file: its pid can only be checked here. Hashed,
# so that long host names do not make file names too long.
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary_path(path: Path) -> Path:
    """A fresh temporary name beside ``path``: ``.<name>.<host>.<pid>.<token>.tmp``."""
    return path.with_name(f".{path.name}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def temporary_pattern(path: Path) -> re.Pattern[str]:
    """Names of the temporaries written for ``path``: host, pid and token.

    A temporary may itself be written through a temporary (a checkpoint's
    ``.safetensors`` goes through ``payload.save``): those are matched too,
    in this module's naming and in the older ``.<temporary>.<12 hex>.tmp``.
    """
    return re.compile(
        rf"\.?\.{re.escape(path.name)}\.(?P<host>[0-9a-f]{{8}})\.(?P<pid>[0-9]+)"
        rf"\.[0-9a-f]{{8}}\.tmp(?:\.(?:[0-9a-f]{{8}}\.[0-9]+\.)?[0-9a-f]+\.tmp)?"
    )


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries beside ``path`` whose writer is gone (see the module docstring)."""
    pattern = temporary_pattern(path)
    now = time.time()
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return  # The write itself will say what is wrong with the directory.
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            idle = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue  # Gone already: its writer finished, or another cleaner was first.
        mine = match["host"] == HOST
        if idle > STALE_AFTER_SECONDS or (mine and not running(int(match["pid"]))):
            # Another cleaner may be first: leave it. A staged directory goes whole.
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)


# Any temporary this module names (``temporary_path``), whatever it was written for: a
# hidden file, or a hidden directory (a case staged whole, ``case.write``).
_ANY_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)"
                            r"\.[0-9a-f]{8}\.tmp")


def abandoned(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a temporary (``temporary_path``) whose writer is gone: on this
    host and no longer running, or idle for ``STALE_AFTER_SECONDS``."""
    match = _ANY_TEMPORARY.fullmatch(entry.name)
    if match is None:
        return False
    try:
        idle = time.time() - entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return False
    return idle > STALE_AFTER_SECONDS or (match["host"] == HOST
                                          and not running(int(match["pid"])))


def being_written(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a temporary (``temporary_path``) whose writer may still be at it:
    one that ``abandoned`` does not call gone."""
    return _ANY_TEMPORARY.fullmatch(entry.name) is not None and not abandoned(entry)


def sweep_temporaries(folder: Path) -> list[str]:
    """Remove every temporary in ``folder`` (files and staged directories) whose writer is
    gone: on this host and no longer running, or idle for ``STALE_AFTER_SECONDS``. A writer
    killed midway (a capture's staging folder, a store file's partial bytes) leaves them
    hidden forever otherwise. Returns the names removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not abandoned(entry):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            continue  # gone already, or another cleaner's: leave it
        removed.append(entry.name)
    return removed


def running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (True when that cannot be told)."""
    if os.name == "nt":
        return True  # os.kill(pid, 0) would terminate the process on Windows.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it runs, as another user.
    return True


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a no-op where directories cannot be opened."""
    if os.name == "nt":
        return  # Windows cannot open a directory to fsync it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse; the data itself was synced
    finally:
        os.close(fd)


def new_temporary(path: Path) -> Path:
    """Create an empty temporary beside ``path`` (stale ones removed first) and return it."""
    remove_stale_temporaries(path)
    tmp = temporary_path(path)
    # 0o666 through O_CREAT lets the umask decide permissions, as for a plain open().
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_BINARY", 0),
                     0o666))
    return tmp


def replace(tmp: Path, path: Path) -> None:
    """Rename a durable temporary over ``path`` and make the rename durable; on failure,
    remove the temporary."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview], *,
                 mode: int | None = None) -> None:
    """Write ``chunks`` to ``path`` atomically and durably (``mode``: the file's permissions)."""
    path = Path(path)
    tmp = new_temporary(path)
    try:
        with open(tmp, "wb") as handle:
            handle.writelines(chunks)
            handle.flush()
            if mode is not None:
                os.chmod(tmp, mode)
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    replace(tmp, path)


def write_text_atomic(path: Path, text: str, *, mode: int | None = None,
                      errors: str = "strict") -> None:
    """``write_atomic`` for text, encoded as UTF-8."""
    write_atomic(path, [text.encode("utf-8", errors)], mode=mode)


class NotRegularFile(OSError):
    """A path that is no regular file (``kind`` says what it is: a FIFO, a device...)."""

    def __init__(self, path: Path | str, kind: str) -> None:
        super().__init__(f"{path}: is {kind}, not a regular file")
        self.kind = kind


class FileTooLarge(OSError):
    """A file over the size its reader allows (``size``: what it holds, or has been read)."""

    def __init__(self, path: Path | str, size: int, limit: int) -> None:
        super().__init__(f"{path}: is {size} bytes, over the limit of {limit}")
        self.size = size


def _open_checked(path: Path | str, follow_symlinks: bool) -> tuple[int, os.stat_result]:
    """A descriptor of ``path`` opened without blocking (a FIFO put in its place cannot hang
    the reader), and the open file's ``fstat``, refused unless it is a regular file."""
    flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise NotRegularFile(path, file_kind(found.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, found


def open_regular(path: Path | str) -> BinaryIO:
    """``path`` opened for reading as ``read_regular`` opens it (no blocking, a regular file
    checked on the open file): for a reader that bounds what it reads itself (a payload's
    header from its length field, a hash in chunks)."""
    fd, _ = _open_checked(path, True)
    return open(fd, "rb")


def read_regular(path: Path | str, limit: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes: the one reader of files anyone
    may have written (a case's files, a report from another job, a cache entry).

    The file is opened without blocking (a FIFO put in its place cannot hang the reader),
    and its kind and size are checked on the open file before it is read; a file that
    grows while it is read is cut off at ``limit`` and refused. The first read asks for
    the size ``fstat`` gave and one byte more (a bigger buffer is allocated whole, per
    file, at scale). Raises ``NotRegularFile``, ``FileTooLarge``, and ``OSError`` as
    ``os.open`` does (``ELOOP``: a link, where ``follow_symlinks`` is false).
    """
    fd, found = _open_checked(path, follow_symlinks)
    try:
        if found.st_size > limit:
            raise FileTooLarge(path, found.st_size, limit)
        chunks, size, step = [], 0, found.st_size + 1
        while size <= limit:
            asked = min(step, 1 << 20, limit + 1 - size)
            chunk = os.read(fd, asked)
            chunks.append(chunk)
            size += len(chunk)
            if len(chunk) < asked:
                break  # a regular file reads short only at its end
            step = 1 << 20
    finally:
        os.close(fd)
    if size > limit:
        raise FileTooLarge(path, size, limit)
    return b"".join(chunks)


def read_head(path: Path | str, limit: int) -> tuple[bytes, os.stat_result]:
    """The first ``limit`` bytes (at most) of a regular file and its ``fstat``, taken on the
    open file: for a file whose head says how much of it to trust (a store file's header).
    Opened as ``read_regular`` opens (no blocking, no link followed); raises
    ``NotRegularFile`` and ``OSError`` as it does."""
    fd, found = _open_checked(path, False)
    try:
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, min(limit - size, max(found.st_size - size + 1, 1), 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), found


def stat_signature(found: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one version of a file from another without reading it: its device, inode,
    size, modification and change times (a rewrite that sets the modification time back
    still changes the last; no user call sets it)."""
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a regular file's bytes, read in chunks (opened as
    ``open_regular`` opens: a FIFO in its place is refused, not waited on)."""
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while chunk := handle.read(2**22):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"

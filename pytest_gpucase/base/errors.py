"""Errors a user can act on: each names the file, the key and the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

__all__ = [
    "CaseFormatError", "display", "display_posix", "file_kind", "link_inside", "printable",
    "regular_file",
]


class CaseFormatError(Exception):
    """A case directory that cannot be loaded as written.

    The message reads ``<file>: [table] key: what is wrong; the fix`` so that a
    user can go straight to the line to change.
    """

    def __init__(self, path: Path | str, message: str, key: str | None = None) -> None:
        self.path = Path(path)
        self.key = key
        self.problem = message
        where = f"{key}: " if key else ""
        super().__init__(f"{display(self.path)}: {where}{message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds from ``args`` (the whole message), which does not fit __init__;
        # this error may cross from an isolated child to the pytest process.
        return (type(self), (self.path, self.problem, self.key))


def display(path: Path) -> str:
    """Show a path relative to the working directory when it lies below it.

    Symlinks are resolved only as a last resort: the user sees the path they
    gave, not where a linked case directory really lives. Bytes of a name that
    are not UTF-8 are shown as ``\\xNN``, so that the text can be printed and
    written to JSON.
    """
    return printable(_relative(Path(path)))


def _relative(path: Path) -> str:
    try:
        cwd = Path.cwd()
    except OSError:  # the working directory was removed
        return str(path)
    shown = Path(os.path.abspath(path))
    if shown.is_relative_to(cwd):
        return str(shown.relative_to(cwd))
    try:
        shown, cwd = path.resolve(), cwd.resolve()
    except (OSError, RuntimeError):  # a loop of links: shown as given
        return str(path)
    return str(shown.relative_to(cwd)) if shown.is_relative_to(cwd) else str(path)


def printable(text: str) -> str:
    """``text`` (a file name from the OS) with undecodable bytes written as ``\\xNN``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (``a FIFO (named pipe)``), for a refusal."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: Path, fix: str) -> os.stat_result:
    """The ``stat`` of ``path`` (symlinks followed) when it is a regular file.

    Anything else is refused before it is opened: a FIFO or a device would
    block the reader or never end. Raises ``OSError`` (``FileNotFoundError``
    included) as ``os.stat`` does, and ``CaseFormatError`` naming the kind and ``fix``.
    """
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise CaseFormatError(path, f"is {file_kind(info.st_mode)}, not a regular file; {fix}")
    return info


def link_inside(file: Path, directory: Path) -> str | None:
    """The target of ``file`` when it is a symlink that stays inside ``directory`` (None when
    it is no symlink); ``CaseFormatError`` when the link leads outside.

    A case directory is whole by itself: a link out of it does not come along with a
    copy of the case, and would have the case read whatever file its author chose.
    """
    try:
        target = os.readlink(file) if os.path.islink(file) else None
    except OSError:
        return None
    if target is None:
        return None
    try:
        resolved = file.resolve()
        inside = resolved.is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
        raise CaseFormatError(file, f"is a symlink to {printable(target)} that leads back to "
                              "itself (a loop); replace it with the file itself") from None
    if not inside:
        # The first hop may lie inside (a chain, a linked folder): then name where it ends.
        hop = Path(os.path.normpath(os.path.join(os.path.abspath(file.parent), target)))
        ends = (f" (which leads to {printable(str(resolved))})"
                if hop.is_relative_to(os.path.abspath(directory)) else "")
        raise CaseFormatError(file, f"is a symlink to {printable(target)}{ends}, outside the "
                              "case directory; replace it with the file itself")
    return target


def display_posix(path: Path) -> str:
    """``display(path)`` with ``/``; a normalized path below the working directory (every
    collected case) is cut with string operations: pathlib costs a quarter millisecond a
    case at collection."""
    text = os.fspath(path)
    try:
        cwd = os.getcwd().rstrip(os.sep) + os.sep
    except OSError:
        cwd = ""
    if (os.sep == "/" and cwd and text.startswith(cwd) and os.path.isabs(text)
            and os.path.normpath(text) == text):
        return printable(text[len(cwd):])
    return Path(display(path)).as_posix()

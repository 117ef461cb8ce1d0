"""Errors a user can act on: each names the file, the key and the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
    gave, not where a linked case directory really lives.
    """
    try:
        cwd = Path.cwd()
    except OSError:  # the working directory was removed
        return str(path)
    for shown, base in ((Path(os.path.abspath(path)), cwd), (path.resolve(), cwd.resolve())):
        if shown.is_relative_to(base):
            return str(shown.relative_to(base))
    return str(path)

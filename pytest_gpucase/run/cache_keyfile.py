"""The reference cache's secret: the key file its entries are authenticated with.

A key is 32 random bytes in a regular file of the user's own that no one else may read,
kept outside any project and repository (under ``$XDG_CONFIG_HOME``/``~/.config``, or the
file ``GPUCASE_REFERENCE_KEY_FILE`` names: a CI job supplies it from a secret). Split from
``run.reference_cache``, which reads and writes the entries.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from pytest_gpucase.base.errors import display

__all__ = ["KEY_FILE_ENV", "KEY_NAME", "Unusable", "make_key", "read_key", "user_key"]

# Set by the user: the key file to use instead of the one under ~/.config.
KEY_FILE_ENV = "GPUCASE_REFERENCE_KEY_FILE"
KEY_NAME = "reference-cache.key"

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Unusable(Exception):
    """No cache here: the message says why (a symlink, no private place for a key)."""


def read_key(path: Path) -> bytes:
    """The secret in a key file: a regular file (not a link) of this user's that no one
    else may read, holding at least 32 bytes as hex. ``Unusable`` says what is wrong;
    ``FileNotFoundError`` when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        raise Unusable(f"the key file {display(path)} {what}") from None
    with open(fd, "rb") as handle:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise Unusable(f"the key file {display(path)} is not a regular file")
        if hasattr(os, "getuid") and found.st_uid != os.getuid():
            raise Unusable(f"the key file {display(path)} belongs to another user")
        if os.name == "posix" and found.st_mode & 0o077:
            raise Unusable(f"the key file {display(path)} may be read or written by others "
                           f"(mode {found.st_mode & 0o777:o}); chmod 600 it, or remove it to "
                           "have a new one made")
        text = handle.read(4097).strip()
    try:
        secret = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) < 32:
        raise Unusable(f"the key file {display(path)} does not hold a key (64 hex digits or "
                       "more); remove it to have a new one made")
    return secret


def make_key(path: Path) -> Path:
    """The key file at ``path``, made (0600, 32 random bytes) when there is none; ``Unusable``
    when it cannot be made or is not private. Two sessions making it at once agree: it is
    written aside and linked into place, never seen half written."""
    with contextlib.suppress(FileNotFoundError):
        read_key(path)
        return path
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another session was first: its key is the key
        except OSError:  # no hard links here (some network or FUSE file systems)
            if not os.path.lexists(path):
                os.replace(aside, path)
    except OSError as exc:
        raise Unusable(f"cannot write the key file {display(path)} "
                       f"({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside)
    read_key(path)
    return path


def _key_folders() -> list[Path]:
    """Where a user's key may live: the config folder, else the user cache folder."""
    found = []
    home = os.path.expanduser("~")
    for variable, default in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache")):
        value = os.environ.get(variable, "")
        if os.path.isabs(value):
            found.append(Path(value) / "pytest-gpucase")
        elif os.path.isabs(home) and home != "/":
            found.append(Path(home) / default / "pytest-gpucase")
    return found


def _shared_place(folder: Path, projects: Sequence[Path]) -> str | None:
    """Why ``folder`` is no place for a secret (inside a project or a repository), or None."""
    resolved = Path(os.path.realpath(folder))
    for project in projects:
        if resolved.is_relative_to(os.path.realpath(project)):
            return f"{display(folder)} is inside the project {display(project)}"
    for above in (resolved, *resolved.parents):
        for marker in (".git", ".hg"):
            if os.path.lexists(above / marker):
                return f"{display(folder)} is inside the repository {display(above)}"
    return None


def _private_folder(folder: Path) -> None:
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        found = os.stat(folder)
    except OSError as exc:
        raise Unusable(f"cannot make {display(folder)} ({exc.strerror or exc})") from None
    if hasattr(os, "getuid") and found.st_uid != os.getuid():
        raise Unusable(f"{display(folder)} belongs to another user")
    if os.name == "posix" and found.st_mode & 0o022:
        raise Unusable(f"{display(folder)} may be written by others "
                       f"(mode {found.st_mode & 0o777:o}); chmod 700 it")


def user_key(projects: Sequence[Path] = ()) -> Path:
    """This user's key file for the reference cache, made on first use.

    ``GPUCASE_REFERENCE_KEY_FILE`` when set (it must exist, or be makeable, and be
    private), else ``pytest-gpucase/reference-cache.key`` under ``$XDG_CONFIG_HOME``
    (``~/.config``), else under ``$XDG_CACHE_HOME`` (``~/.cache``): the first of those
    outside ``projects`` and outside any repository where a key exists or can be made.
    ``Unusable`` says why there is none (a read-only home, say).
    """
    chosen = os.environ.get(KEY_FILE_ENV)
    if chosen:
        path = Path(os.path.abspath(chosen))
        problem = _shared_place(path.parent, projects)
        if problem is not None:
            raise Unusable(f"{KEY_FILE_ENV}: {problem}; keep the key outside any project "
                           "and repository")
        return make_key(path)
    problems = []
    for folder in _key_folders():
        problem = _shared_place(folder, projects)
        if problem is None:
            try:
                _private_folder(folder)
                return make_key(folder / KEY_NAME)
            except Unusable as exc:
                problem = str(exc)
        problems.append(problem)
    if not problems:
        problems.append("no home folder, and neither XDG_CONFIG_HOME nor XDG_CACHE_HOME is set")
    raise Unusable("no private place for the reference cache's key: " + "; ".join(problems)
                   + f" (set {KEY_FILE_ENV} to a file outside the project and any repository)")

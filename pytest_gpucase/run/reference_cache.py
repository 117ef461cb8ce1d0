"""The float64 CPU reference of a case, computed once and reused by every item that shares it.

Every item of one case and variant (each device, and each dtype the inputs are
not cast to) computes the same reference: the same function on the same
float64 inputs on the CPU. The first item's child writes it to the cache
directory (``GPUCASE_REFERENCE_CACHE`` in the child's environment; the plugin
sets it to a folder of pytest's cache), later ones read it back.

The file's name is a hash of everything the reference depends on: the case's
``case.toml``, its inputs file (its content hash when ``inputs_sha256`` names
one, else its size, inode and change times: hashing a large payload per item
would cost more than most references), the source file that defines the
reference function (for a case's own ``case.py``: all of it), the variant, the
dtype the inputs were cast to (a float32 item's reference starts from
float32-rounded inputs), the switches, the torch version, and every module
loaded in the child when the key is computed (after the call ran) that may
hold user code: each module with a file that is neither in Python's standard
library nor inside torch's own package is keyed by its path, size and
modification and change times (a ``stat`` each, no reading: about a
millisecond for the 150 or so keyed of the 1200 modules a child of pytest has
loaded), so that editing a helper the reference calls (``refimpl.ref``) makes a
new name rather than a wrong pass. Any change makes a new name; an unreadable
entry is computed again.

NOT keyed: data files the reference reads (a table it loads with ``open``),
and modules it imports lazily, inside the reference call itself (they are not
loaded yet when the key is computed). A reference that depends on those needs
``pytest --cache-clear`` after they change, or no cache at all (``-p
no:cacheprovider``).

A failing item never trusts the cache: its reference is computed again before
it is reported (see ``execute``). A reference faster than ``MIN_SECONDS`` is not worth a file and
is computed each time.

Old names are never read again, so the folder is pruned when a session that
used it ends (``prune``): an entry unused for ``KEEP_DAYS`` goes, then the
least recently used ones until the folder holds at most ``MAX_BYTES``. A read
marks an entry used (its modification time).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gpucase.plan.runs import RunSpec

__all__ = [
    "CACHE_ENV", "MIN_SECONDS", "companion", "entry", "forget_primed", "key", "load", "prime",
    "prune", "store",
]

CACHE_ENV = "GPUCASE_REFERENCE_CACHE"
# A reference computed faster than this is not cached: reading the file back would cost
# more (a trivial case's float64 reference takes a fraction of a millisecond).
MIN_SECONDS = 0.005
_VERSION = b"gpucase-reference-1"
KEEP_DAYS = 14
MAX_BYTES = 2 << 30


def _file_signature(path: Path) -> bytes:
    try:
        found = path.stat()
    except OSError:
        return b"absent"
    return f"{found.st_size}:{found.st_ino}:{found.st_mtime_ns}:{found.st_ctime_ns}".encode()


def _source_of(func: Callable[..., Any]) -> bytes:
    """The bytes of the file that defines ``func``, or its name when it has none (a builtin)."""
    with contextlib.suppress(TypeError, OSError):
        source = inspect.getsourcefile(inspect.unwrap(func))
        if source is not None:
            return Path(source).read_bytes()
    return repr(getattr(func, "__qualname__", func)).encode()


@functools.cache
def _outside_user_code() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Folders whose modules are not keyed: torch's own package (keyed by its version),
    and the standard library (Python's) except the site-packages that a virtual
    environment or a system Python keeps inside its folders (third-party code there
    is keyed); each as written and as resolved, since a module's ``__file__`` may be
    either."""
    import torch

    def folders(*paths: str) -> tuple[str, ...]:
        return tuple(sorted({os.path.join(form(path), "") for path in paths
                             for form in (os.path.abspath, os.path.realpath)}))

    paths = sysconfig.get_paths()
    return (folders(os.path.dirname(torch.__file__)),
            folders(paths["stdlib"], paths["platstdlib"]),
            folders(paths["purelib"], paths["platlib"]))


def _loaded_modules() -> bytes:
    """Path, size, modification and change times of every loaded module that may be
    user code (see the module's docstring), sorted; a ``stat`` each, never a read.

    Modules loaded when the session primed (in the pytest process, before it forks) have
    their rows made then; a child looks only at the names added since. Reading every
    module object in a forked child is what costs: each read writes the object's
    reference count, and each write copies a page of the parent's memory (6-8 ms a
    child for 1,200 modules, against 1 ms in the parent).
    """
    if _PRIMED is None:
        rows = _rows(sys.modules.items(), {})
    else:
        names, primed_rows, last_name, last_module = _PRIMED
        added = []
        # sys.modules keeps insertion order: what was imported since priming is at its
        # end, after the last module then loaded (unless that one left: then all is read).
        for name in reversed(sys.modules):
            if name == last_name and sys.modules.get(name) is last_module:
                break
            if name not in names:
                added.append(name)
        rows = _rows(((name, sys.modules[name]) for name in added), primed_rows)
    return "\n".join(sorted(rows.values())).encode(errors="surrogateescape")


def _rows(modules: Iterable[tuple[str, Any]], primed: dict[str, str]) -> dict[str, str]:
    """File -> row for ``modules`` that may hold user code, added to ``primed``."""
    torch_package, stdlib, site_packages = _outside_user_code()
    found_rows = dict(primed)
    for name, module in modules:
        if name == "torch" or name.startswith("torch."):
            continue  # most of what is loaded: passed over by name, with no lookup
        file = getattr(module, "__file__", None)
        if (not isinstance(file, str) or file in found_rows or file.startswith(torch_package)
                or (file.startswith(stdlib) and not file.startswith(site_packages))):
            continue  # a builtin, a namespace package, seen, or not user code
        try:
            found = os.stat(file)
        except (OSError, ValueError):
            continue  # a module from a zip, or gone: nothing to compare with
        found_rows[file] = f"{file}\0{found.st_size}:{found.st_mtime_ns}:{found.st_ctime_ns}"
    return found_rows


# The names loaded when the session primed, and the rows of their files (made afresh each
# session: a process running several, pytest.main in a loop, sees edits between them).
_PRIMED: tuple[frozenset[str], dict[str, str], str | None, Any] | None = None


def forget_primed() -> None:
    """Drop the rows of the previous session (before a zygote forks: its children would keep
    them, and a module edited since would be keyed as it was)."""
    global _PRIMED
    _PRIMED = None


def prime() -> None:
    """Make the rows of every module loaded so far, in the pytest process before it forks."""
    global _PRIMED
    _PRIMED = None
    loaded = list(sys.modules.items())
    last_name, last_module = loaded[-1] if loaded else (None, None)
    _PRIMED = frozenset(name for name, _ in loaded), _rows(loaded, {}), last_name, last_module


def key(spec: RunSpec, reference: Callable[..., Any]) -> str:
    """The hash naming ``spec``'s reference in the cache."""
    import torch

    case = spec.case
    digest = hashlib.sha256(_VERSION)
    parts: list[bytes] = [
        case.case_file.read_bytes(),
        (case.inputs_sha256 or "").encode() or _file_signature(case.inputs_file),
        _source_of(reference),
        (case.reference or case.call).encode(),
        (spec.variant.id if spec.variant is not None else "").encode(),
        (spec.dtype if spec.cast else "saved").encode(),
        ",".join(spec.settings).encode(),
        torch.__version__.encode(),
        _loaded_modules(),
    ]
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def entry(spec: RunSpec, reference: Callable[..., Any]) -> Path | None:
    """Where ``spec``'s reference is cached, or None when this child has no cache."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return None
    try:
        return Path(folder) / f"{key(spec, reference)}.safetensors"
    except OSError:  # the case file vanished: no caching, the run will say what is wrong
        return None


def companion(path: Path | None, kind: str) -> Path | None:
    """Where something computed beside the reference is kept (``kind``: the rounding budget,
    the CPU's own run in the run's dtype, a gradcheck's pass): under the reference's own
    key, so that whatever makes a new reference makes a new one too; pruned with it."""
    return None if path is None else path.with_name(f"{path.stem}.{kind}{path.suffix}")


def load(path: Path | None) -> dict[str, Any] | None:
    """The cached reference results at ``path``, or None when absent or unreadable."""
    if path is None or not path.exists():
        return None
    from pytest_gpucase.case import golden

    try:
        found = golden.load(path)
    except Exception:  # a torn or foreign file: computed again, and rewritten
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: prune keeps it
    return found


def prune(folder: Path, keep_days: float = KEEP_DAYS, max_bytes: int = MAX_BYTES,
          now: float | None = None) -> int:
    """Remove entries of ``folder`` unused for ``keep_days``, then the least recently
    used until at most ``max_bytes`` remain; return how many were removed.

    Other sessions may be pruning or writing the same folder: an entry that is gone
    already, or that cannot be removed (another user's, a read-only mount), is
    skipped, and a writer's temporary (a hidden file) younger than ``keep_days`` is
    left to it, whatever the size. Nothing here raises: pruning is housekeeping.
    """
    import time

    now = time.time() if now is None else now
    entries: list[tuple[float, int, str]] = []
    try:
        with os.scandir(folder) as found:
            for item in found:
                with contextlib.suppress(OSError):
                    if item.is_file(follow_symlinks=False):
                        info = item.stat(follow_symlinks=False)
                        entries.append((info.st_mtime, info.st_size, item.path))
    except OSError:
        return 0
    entries.sort()
    total = sum(size for _, size, _ in entries)
    removed = 0
    for used, size, path in entries:
        recent = used > now - keep_days * 86400
        if recent and total <= max_bytes:
            break
        if recent and os.path.basename(path).startswith("."):
            continue  # a write in progress: its writer renames or removes it
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue  # still there: still counted
        else:
            removed += 1
        total -= size
    return removed


def store(path: Path | None, results: dict[str, Any], seconds: float) -> None:
    """Cache ``results`` at ``path`` (atomically) when computing them took ``MIN_SECONDS``
    or more; results golden files cannot hold are not cached."""
    if path is None or seconds < MIN_SECONDS:
        return
    from pytest_gpucase.case import golden

    with contextlib.suppress(Exception):
        path.parent.mkdir(parents=True, exist_ok=True)
        golden.save(path, results)

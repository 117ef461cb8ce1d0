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
library nor inside torch's own package is keyed by its path and its
``base.files.stat_signature`` (a ``stat`` each, no reading: about a
millisecond for the 150 or so keyed of the 1200 modules a child of pytest has
loaded), so that editing a helper the reference calls (``refimpl.ref``) makes a
new name rather than a wrong pass. Any change makes a new name; an unreadable
entry is computed again. The parent computes the key before it forks a child
whose reference lies in the case's own file, on what that child is expected to
load (the modules primed and the case's module); the child takes it only when
it finds just that, else computes it itself (``prepare``, ``key``): one key.

NOT keyed: data files the reference reads (a table it loads with ``open``),
and modules it imports lazily, inside the reference call itself (they are not
loaded yet when the key is computed). A reference that depends on those needs
``pytest --cache-clear`` after they change, or no cache at all (``-p
no:cacheprovider``).

A failing item never trusts the cache: its reference is computed again before
it is reported (see ``execute``). A reference faster than ``MIN_SECONDS`` is not worth a file and
is computed each time. What is kept beside a reference under its name (``companion``: the
rounding budget, a gradcheck's pass, the CPU baseline) goes with it; a budget and a gradcheck
pass, a few numbers, are kept however fast they were made (their draws and evaluations cost
several runs of the reference), and are read beside a reference computed afresh too.

Old names are never read again, so the folder is pruned when a session that
used it ends (``prune``): an entry unused for ``KEEP_DAYS`` goes, then the
least recently used ones until the folder holds at most ``MAX_BYTES``. A read
marks an entry used (its modification time).

The folder is not trusted (a pull request can commit files, or a symlink, under
``.pytest_cache``; a CI cache can be restored from another branch):

* No pass rests on an entry nobody checked. Each entry carries an HMAC-SHA256 of
  its name and bytes, keyed by a secret of the user's (``user_key``: a 0600 file
  under ``$XDG_CONFIG_HOME`` or ``~/.config``, else the user cache folder, never
  inside the project or a repository; ``GPUCASE_REFERENCE_KEY_FILE`` names another).
  An entry whose tag does not match (changed since it was written, or written
  with another key) is computed again and rewritten, with a note. Where no key
  can be kept (a read-only home), references are cached for the session only, in
  a private temporary folder with a key of its own: never trusted unchecked.
* The folder is opened from a trusted base (the rootdir) one component at a
  time, never through a symlink (``open_folder``): a folder that is or passes
  through one is refused, and nothing in it is read or removed.
* What is computed beside a reference (the rounding budget, the CPU's same-dtype
  run, a gradcheck's pass: ``companion``) is an entry of its own, named by the
  reference's key and its kind, and authenticated the same way.
* ``prune`` removes only names this module writes (``OWN_NAME``: 64 hex digits,
  a companion's kind, the entry suffix, and their temporaries), never follows a link, and works
  on the opened folder, so that it cannot leave it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import functools
import hashlib
import hmac
import inspect
import os
import re
import stat
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.errors import display
from pytest_gpucase.run.cache_keyfile import (
    KEY_FILE_ENV,
    KEY_NAME,
    Unusable,
    make_key,
    read_key,
    user_key,
)
from pytest_gpucase.case.model import CASE_MODULE_PREFIX, MAX_CASE_BYTES, MAX_SOURCE_BYTES
from pytest_gpucase.base.files import (
    FileTooLarge,
    NotRegularFile,
    read_regular,
    stat_signature,
    write_atomic,
)

if TYPE_CHECKING:
    from pytest_gpucase.plan.runs import RunSpec

__all__ = [
    "CACHE_ENV", "KEY_ENV", "KEY_FILE_ENV", "MIN_SECONDS", "OWN_NAME", "Entry", "ReferenceCache",
    "Unusable", "check_folder", "companion", "content_key", "entry", "forget_prepared",
    "forget_primed", "key", "load", "make_key", "open_folder", "persisted", "prepare", "prime",
    "prune", "read_key", "session_cache", "store", "take_notes", "user_key",
]

CACHE_ENV = "GPUCASE_REFERENCE_CACHE"
# In a run's child: the path of the key file (never the key: a child's environment is
# printed by cases, and ends in CI logs).
KEY_ENV = "GPUCASE_REFERENCE_KEY"
# A reference computed faster than this is not cached: reading the file back would cost
# more (a trivial case's float64 reference takes a fraction of a millisecond).
MIN_SECONDS = 0.005
# Part of every key: a new format gives every entry a new name, so old entries are never
# read (and prune removes them as they age).
_VERSION = b"gpucase-reference-2"
SUFFIX = ".reference"
# What an entry file starts with, then the 32 bytes of its tag, then a safetensors payload.
MAGIC = b"gpucase-reference-2\n"
_TAG_BYTES = 32
KEEP_DAYS = 14
MAX_BYTES = 2 << 30
# The names prune may remove: entries and their companions (``<key>.<kind>.reference``),
# those of the earlier format (written as .safetensors into the same folder), and
# write_atomic's temporaries of them.
OWN_NAME = re.compile(r"(?P<temporary>\.)?[0-9a-f]{64}(?:\.[a-z][a-z0-9-]{0,31})?"
                      r"(?:\.reference|\.safetensors)"
                      r"(?(temporary)\.[0-9a-f]{8}\.[0-9]{1,10}\.[0-9a-f]{8}\.tmp)")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class ReferenceCache:
    """A session's cache: the folder of entries, the key that authenticates them, and the
    trusted folder it was opened from (links above ``base`` are the user's own layout)."""

    folder: Path
    key_file: Path
    base: Path | None = None
    temporary: Path | None = None    # the private folder of a session-only cache, removed after

    def env(self) -> dict[str, str]:
        """What a run's child needs to use the cache."""
        return {CACHE_ENV: str(self.folder), KEY_ENV: str(self.key_file)}


@dataclass(frozen=True)
class Entry:
    """Where one reference is cached, and the secret that authenticates it (in the child)."""

    path: Path
    name: str
    secret: bytes
    case: str


def _file_signature(path: Path) -> bytes:
    try:
        found = path.stat()
    except OSError:
        return b"absent"
    return _signature_text(found).encode()


def _signature_text(found: os.stat_result) -> str:
    return ":".join(map(str, stat_signature(found)))


def _source_of(func: Callable[..., Any]) -> bytes:
    """The bytes of the file that defines ``func``, or its name when it has none (a builtin)."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    read = _PREPARED.pop("sources", {}).get(getattr(code, "co_filename", None))
    if read is not None:  # the case's own file, read by the parent before it forked
        return read  # type: ignore[no-any-return]
    with contextlib.suppress(TypeError, OSError):
        source = inspect.getsourcefile(inspect.unwrap(func))
        if source is not None:
            return _bounded(source, MAX_SOURCE_BYTES)
    return repr(getattr(func, "__qualname__", func)).encode()


def _bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of a file a key reads, within its bound (the table "Bounds" in
    docs/case-format.md); a file past it, or no regular file, counts by its ``stat``
    signature instead: the key still changes with it, and nothing unbounded is read.
    Raises ``OSError`` for a file that cannot be opened."""
    try:
        return read_regular(path, limit)
    except (FileTooLarge, NotRegularFile):
        return b"signature:" + _file_signature(Path(path))


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
    """Path and ``stat_signature`` of every loaded module that may be
    user code (see the module's docstring), sorted; a ``stat`` each, never a read.

    Modules loaded when the session primed (in the pytest process, before it forks) have
    their rows made, sorted and joined then; a child looks only at the names added since
    and splices their rows in. Reading every module object, or every row, in a forked
    child is what costs: each read writes the object's reference count, and each write
    copies a page of the parent's memory (6-8 ms a child for 1,200 modules, against 1 ms
    in the parent).
    """
    primed = _PRIMED
    if primed is None:  # a list first: reading a lazy module's __file__ may import more
        return _joined(sorted(_rows(list(sys.modules.items()), {}).values()))
    return primed.with_rows(_added_rows(primed))


def _added_rows(primed: _Primed) -> list[str]:
    """The rows of the modules loaded since ``primed`` was made, that it does not hold,
    sorted."""
    added = []
    # sys.modules keeps insertion order: what was imported since priming is at its end,
    # after the last module then loaded (unless that one left: then all is read).
    for name in reversed(sys.modules):
        module = sys.modules[name]
        if name == primed.last_name and module is primed.last_module:
            break
        if name not in primed.names:
            added.append((name, module))
    # Rows made once the walk is done: reading a module's __file__ can import (a module
    # imported with importlib.util.LazyLoader loads then), which changes sys.modules.
    rows: dict[str, str] = {}
    for name, module in added:
        for file, row in _module_rows(name, module).items():
            if file not in primed.rows:
                rows.setdefault(file, row)
    return sorted(rows.values())


# The rows of modules loaded after priming, by name, while the same module is loaded under
# that name: a reused worker keeps the library modules its calls imported, and statted each
# of them on every later call (0.15 ms a call). Its row is the file as it was when first
# keyed, as the primed rows are the files as they were at priming; a module replaced, or
# imported again (a case's own module, dropped after each call), is keyed anew.
_ADDED: dict[str, tuple[weakref.ref[Any], dict[str, str]]] = {}


def _module_rows(name: str, module: Any) -> dict[str, str]:
    known = _ADDED.get(name)
    if known is not None and known[0]() is module:
        return known[1]
    found = _rows([(name, module)], {})
    if name.startswith(CASE_MODULE_PREFIX):
        return found  # imported afresh by each run: nothing to keep
    if len(_ADDED) >= _ADDED_KEPT:  # a worker that ran thousands of cases: their modules
        for gone in [key for key, (ref, _) in _ADDED.items() if ref() is None]:
            del _ADDED[gone]
    with contextlib.suppress(TypeError):  # an object that takes no weak reference
        _ADDED[name] = (weakref.ref(module), found)
    return found


_ADDED_KEPT = 4096


def _joined(rows: Iterable[str]) -> bytes:
    return "\n".join(rows).encode(errors="surrogateescape")


def _rows(modules: Iterable[tuple[str, Any]], seen: Mapping[str, str]) -> dict[str, str]:
    """File -> row for those of ``modules`` that may hold user code, whose file is not in
    ``seen`` already."""
    torch_package, stdlib, site_packages = _outside_user_code()
    found_rows: dict[str, str] = {}
    for name, module in modules:
        if name == "torch" or name.startswith("torch."):
            continue  # most of what is loaded: passed over by name, with no lookup
        file = getattr(module, "__file__", None)
        if (not isinstance(file, str) or file in found_rows or file in seen
                or file.startswith(torch_package)
                or (file.startswith(stdlib) and not file.startswith(site_packages))):
            continue  # a builtin, a namespace package, seen, or not user code
        try:
            found = os.stat(file)
        except (OSError, ValueError):
            continue  # a module from a zip, or gone: nothing to compare with
        found_rows[file] = f"{file}\0{_signature_text(found)}"
    return found_rows


@dataclass(frozen=True)
class _Primed:
    """The modules whose rows are made (``names``: the child skips them) and those rows,
    sorted and joined as ``_loaded_modules`` gives them, with where each row starts in the
    joined bytes: a child adds a row by slicing there, touching none of the others.

    ``base``: the names and rows of the session's priming; ``after``: the modules the parent
    imported since, whose rows are in too, each checked to be the one loaded under its name
    before every fork (a module replaced or removed since makes them anew)."""

    names: frozenset[str]
    rows: dict[str, str]
    last_name: str | None
    last_module: Any
    ordered: list[str]
    joined: bytes
    starts: list[int]
    base: tuple[frozenset[str], dict[str, str]]
    after: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def made(cls, base: tuple[frozenset[str], dict[str, str]],
             after: Sequence[tuple[str, Any]] = ()) -> _Primed:
        base_names, base_rows = base
        rows = {**base_rows, **_rows(after, base_rows)} if after else base_rows
        ordered = sorted(rows.values())
        encoded = [_joined([row]) for row in ordered]  # each row once, as _joined writes it
        starts, offset = [], 0
        for row in encoded:
            starts.append(offset)
            offset += len(row) + 1
        last = next(reversed(sys.modules), None)
        return cls(base_names | {name for name, _ in after}, rows, last,
                   None if last is None else sys.modules.get(last), ordered,
                   b"\n".join(encoded), starts, base, tuple(after))

    def current(self) -> bool:
        """Whether nothing was imported since (the last name of ``sys.modules`` is the one
        then, as its module) and every module imported since priming is still the one loaded
        under its name."""
        last = next(reversed(sys.modules), None)
        return (last is not None and last == self.last_name
                and sys.modules.get(last) is self.last_module
                and all(sys.modules.get(name) is module for name, module in self.after))

    def with_rows(self, added: Iterable[str]) -> bytes:
        """The joined rows with ``added`` (rows of files not primed) in their sorted places."""
        new = sorted(added)
        if not new:
            return self.joined
        pieces, done, count = [], 0, len(self.ordered)
        for row in new:
            at = bisect.bisect_left(self.ordered, row)
            if at > done:  # the primed rows before this one, as one slice
                pieces.append(self._block(done, at))
            pieces.append(_joined([row]))
            done = at
        if done < count:
            pieces.append(self._block(done, count))
        return b"\n".join(pieces)

    def _block(self, first: int, end: int) -> bytes:
        """Rows ``first`` to ``end`` (excluded) as joined, without a newline at the end."""
        stop = self.starts[end] - 1 if end < len(self.starts) else len(self.joined)
        return self.joined[self.starts[first]:stop]


# What the session primed (made afresh each session: a process running several, pytest.main
# in a loop, sees edits between them).
_PRIMED: _Primed | None = None


def forget_primed() -> None:
    """Drop the rows of the previous session (before a zygote forks: its children would keep
    them, and a module edited since would be keyed as it was)."""
    global _PRIMED
    _PRIMED = None
    _ADDED.clear()


def prime() -> None:
    """Make the rows of every module loaded so far, in the pytest process before it forks."""
    global _PRIMED
    _PRIMED = None
    _ADDED.clear()
    loaded = list(sys.modules.items())
    _PRIMED = _Primed.made((frozenset(name for name, _ in loaded), _rows(loaded, {})))


def _primed_again() -> None:
    """Add the rows of what the pytest process imported since it primed (collection, the
    first runs' own imports), before it forks the next child: a child that had to walk
    them would touch, and so copy, each module object's page. Made anew from what is
    loaded now whenever a module was imported, replaced or removed since the last time."""
    global _PRIMED
    primed = _PRIMED
    # Only the last name and the few modules imported since priming are looked at while
    # nothing changed: every object this process touches after a fork costs it a page copy
    # too, while that child lives.
    if primed is None or primed.current():
        return
    base_names = primed.base[0]
    after = [(name, module) for name, module in sys.modules.items() if name not in base_names]
    _PRIMED = _Primed.made(primed.base, after)


# The files of the run the parent is about to fork (``prepare``), read there.
_PREPARED: dict[str, Any] = {}


def prepare(spec: RunSpec, key_file: str | None = None, folder: str | None = None) -> None:
    """Read, in the parent just before it forks the child of ``spec``, the files its key
    reads: ``case.toml``, the inputs' signature, and the case's own source file when the
    reference is defined in one (``FILE.py:func``); and the secret in ``key_file`` (the
    child's ``KEY_ENV``), when it is a usable key file (``_parent_secret``); with the key
    predicted, its entry's path in ``folder`` (the child's ``CACHE_ENV``). Only that child
    uses them (a process whose parent is this one), once; any other child reads them
    itself, and the parent drops them when the run ends (``forget_prepared``)."""
    _PREPARED.clear()
    _primed_again()
    if key_file:
        secret = _parent_secret(key_file)
        if secret is not None:
            _PREPARED["secret"] = (key_file, secret, os.getpid())
    case = spec.case
    sources: dict[str, bytes] = {}
    where = (case.reference or case.call).partition(":")[0]
    if where.endswith(".py"):
        file = case.path / where
        with contextlib.suppress(OSError):
            sources[str(file)] = _bounded(file, MAX_SOURCE_BYTES)
    try:
        toml = _bounded(case.case_file, MAX_CASE_BYTES)
    except OSError:
        return  # the child will say what is wrong
    inputs = (case.inputs_sha256 or "").encode() or _file_signature(case.inputs_file)
    predicted = _predicted(spec, toml, inputs, sources)
    _PREPARED.update(case=case.case_file, toml=toml, sources=sources, parent=os.getpid(),
                     inputs=inputs, key=predicted)
    if predicted is not None and folder:
        name = f"{predicted[2]}{SUFFIX}"
        path = Path(folder) / name
        os.fspath(path)  # its text made here too (a Path keeps it), for the child to inherit
        _PREPARED["entry"] = (folder, name, path)


def _predicted(spec: RunSpec, toml: bytes, inputs: bytes,
               sources: Mapping[str, bytes]) -> tuple[str, list[str], str] | None:
    """The key the child of ``spec`` will compute, made here, where every page is the
    parent's own, on what the child is expected to find: its reference defined in the
    case's own file (read here into ``sources``), and nothing loaded beside the modules
    primed but that file's module (``_added_rows``). (That file, the rows, the key); the
    child uses the key only when it finds both as expected (``key``). None where it
    cannot be told here: a reference in an installed module, nothing primed, no torch."""
    torch = sys.modules.get("torch")
    primed = _PRIMED
    if not sources or primed is None or torch is None:
        return None
    file, source = next(iter(sources.items()))
    module = type(sys)("gpucase_predicted")  # what the child's import of ``file`` holds
    module.__file__ = file
    rows = sorted(_rows([("", module)], primed.rows).values())
    return file, rows, _digest(spec, toml, inputs, source, primed.with_rows(rows),
                               torch.__version__)


# The secrets this process read (``_parent_secret``): key file -> (its lstat, the secret).
_SECRETS: dict[str, tuple[tuple[int, ...], bytes]] = {}


def _parent_secret(key_file: str) -> bytes | None:
    """The secret of ``key_file`` as ``read_key`` reads it, read again only when the file's
    ``lstat`` changed (a new inode, size, mode, owner or time); None when it is not usable
    (the child then reads it and meets the same problem)."""
    try:
        found = os.lstat(key_file)
    except OSError:
        return None
    signature = (found.st_dev, found.st_ino, found.st_size, found.st_mode, found.st_uid,
                 found.st_mtime_ns, found.st_ctime_ns)
    known = _SECRETS.get(key_file)
    if known is not None and known[0] == signature:
        return known[1]
    try:
        secret = read_key(Path(key_file))
    except (OSError, Unusable):
        _SECRETS.pop(key_file, None)
        return None
    _SECRETS[key_file] = (signature, secret)
    return secret


def forget_prepared() -> None:
    """Drop what ``prepare`` read (in the parent, once its child has forked and run)."""
    _PREPARED.clear()


def key(spec: RunSpec, reference: Callable[..., Any]) -> str:
    """The hash naming ``spec``'s reference in the cache."""
    import torch

    case = spec.case
    prepared_for = _PREPARED.get("case")
    if ((prepared_for is case.case_file or prepared_for == case.case_file)
            and _PREPARED["parent"] == os.getppid()):
        toml, inputs = _PREPARED.pop("toml"), _PREPARED.pop("inputs")
        predicted = _PREPARED.pop("key")
        del _PREPARED["case"]  # once: the sources go in _source_of, just below
        if predicted is not None:  # the parent's key, when the child found what it expected
            file, rows, digest = predicted
            code = getattr(_unwrapped(reference), "__code__", None)
            primed = _PRIMED
            if (getattr(code, "co_filename", None) == file and primed is not None
                    and _added_rows(primed) == rows):
                _PREPARED.clear()
                return digest  # type: ignore[no-any-return]
    else:
        _PREPARED.clear()
        toml = _bounded(case.case_file, MAX_CASE_BYTES)
        inputs = (case.inputs_sha256 or "").encode() or _file_signature(case.inputs_file)
    return _digest(spec, toml, inputs, _source_of(reference), _loaded_modules(),
                   torch.__version__)


def _unwrapped(func: Callable[..., Any]) -> Any:
    """``inspect.unwrap(func)``, asked only of a function that wraps another."""
    return func if getattr(func, "__wrapped__", None) is None else inspect.unwrap(func)


def _digest(spec: RunSpec, toml: bytes, inputs: bytes, source: bytes, modules: bytes,
            version: str, *, kind: bytes = _VERSION) -> str:
    """The key of ``spec`` from what it depends on (``key``, and ``content_key`` with its own
    ``kind``), each part with its length."""
    case = spec.case
    digest = hashlib.sha256(kind)
    parts: list[bytes] = [
        toml,
        inputs,
        source,
        (case.reference or case.call).encode(),
        (spec.variant.id if spec.variant is not None else "").encode(),
        (spec.dtype if spec.cast else "saved").encode(),
        ",".join(spec.settings).encode(),
        repr(case.context.autocast).encode(),   # a run may change it (ablate's autocast rows)
        version.encode(),
        modules,
    ]
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def entry(spec: RunSpec, reference: Callable[..., Any]) -> Entry | None:
    """Where ``spec``'s reference is cached, or None when this child has no cache (no folder,
    or no key it can read: then nothing is read or written, never an unchecked entry)."""
    folder, key_file = os.environ.get(CACHE_ENV), os.environ.get(KEY_ENV)
    if not folder or not key_file:
        return None
    prepared = _PREPARED.pop("secret", None)
    made = _PREPARED.pop("entry", None)
    try:
        if prepared is not None and prepared[0] == key_file and prepared[2] == os.getppid():
            secret = prepared[1]  # read by the parent before it forked this child
        else:
            secret = read_key(Path(key_file))
        name = f"{key(spec, reference)}{SUFFIX}"
    except (OSError, Unusable):  # no key to check with (no cache), or the case file
        return None              # vanished (the run will say what is wrong)
    # The path of the key the parent predicted was made there.
    path = made[2] if made is not None and made[:2] == (folder, name) else Path(folder) / name
    return Entry(path, name, secret, spec.case.name)


_KIND = re.compile(r"[a-z][a-z0-9-]{0,31}")


def companion(cached: Entry | None, kind: str) -> Entry | None:
    """Where something computed beside the reference is kept (``kind``: the rounding budget,
    the CPU's own run in the run's dtype, a gradcheck's pass): under the reference's own
    key, so that whatever makes a new reference makes a new one too; pruned with it, and
    authenticated like it (its name, kind included, is bound into its tag, so an entry
    copied to another kind's name is refused)."""
    if cached is None:
        return None
    if not _KIND.fullmatch(kind):
        raise ValueError(f"not a companion kind: {kind!r}")
    stem = cached.name.removesuffix(SUFFIX)
    name = f"{stem}.{kind}{SUFFIX}"
    return dataclasses.replace(cached, path=cached.path.with_name(name), name=name)


# Part of every content key (``content_key``): a new format names every persisted entry anew.
_CONTENT_VERSION = b"gpucase-persisted-1"


def content_key(spec: RunSpec, reference: Callable[..., Any]) -> str:
    """``key``, of content only: the inputs' bytes (or ``inputs_sha256``), and every loaded
    module that may hold user code by its name and its file's SHA-256, where ``key`` has
    ``stat`` signatures, which a fresh checkout (a CI job) changes. Tens of milliseconds:
    made only where a rounding budget is asked for."""
    import torch

    from pytest_gpucase.base.files import file_sha256

    case = spec.case
    modules = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and _rows([(name, module)], {}):
            with contextlib.suppress(OSError):
                digest = hashlib.sha256(_bounded(file, MAX_SOURCE_BYTES)).hexdigest()
                modules.append(f"{name}\0{digest}")
    return _digest(spec, _bounded(case.case_file, MAX_CASE_BYTES),
                   (case.inputs_sha256 or file_sha256(case.inputs_file)).encode(),
                   _source_of(reference),
                   "\n".join(sorted(modules)).encode(errors="surrogateescape"),
                   torch.__version__, kind=_CONTENT_VERSION)


def persisted(cached: Entry | None, spec: RunSpec, reference: Callable[..., Any],
              kind: str) -> Entry | None:
    """``companion``, named by ``content_key``: found again by a CI job that restores the
    folder with the same key (``GPUCASE_REFERENCE_KEY_FILE``); None when unreadable."""
    if cached is None:
        return None
    try:
        stem = content_key(spec, reference)
    except OSError:
        return None
    return companion(dataclasses.replace(cached, name=f"{stem}{SUFFIX}"), kind)


# Notes of this run for the pytest process (an entry that failed authentication), taken
# with the run's outcome (``take_notes``).
_NOTES: list[str] = []


def take_notes() -> list[str]:
    """The notes of the run that just ended, cleared for the next (a reused child runs many)."""
    notes = list(dict.fromkeys(_NOTES))
    _NOTES.clear()
    return notes


def _refused(cached: Entry, why: str) -> None:
    _NOTES.append(f"the reference cache entry of case {cached.case} ({cached.name[:12]}...) "
                  f"{why}: not trusted; the reference was computed again and the entry "
                  "rewritten")


def _tag(secret: bytes, name: str, chunks: Iterable[bytes | memoryview]) -> bytes:
    """The HMAC-SHA256 of an entry's name and payload: the name is bound too, so that a
    genuine entry copied under another name (another case's reference) is refused."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (_VERSION, len(name).to_bytes(8, "little"), name.encode()):
        mac.update(part)
    for chunk in chunks:
        mac.update(chunk)
    return mac.digest()


def load(cached: Entry | None) -> dict[str, Any] | None:
    """The cached reference results, or None when absent or not authentic (then noted).

    The file is opened without following a link and without blocking, read whole (it
    must be a regular file under ``MAX_BYTES``), and its tag checked before a byte of it
    is parsed; what is parsed is the bytes that were checked.
    """
    if cached is None:
        return None
    try:
        data = read_regular(cached.path, MAX_BYTES, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except NotRegularFile as exc:
        _refused(cached, f"is {exc.kind}, not a regular file")
        return None
    except FileTooLarge as exc:
        _refused(cached, f"is {exc.size} bytes, over the cache's {MAX_BYTES}")
        return None
    except OSError as exc:
        _refused(cached, "is a symlink" if exc.errno == errno.ELOOP
                 else f"cannot be opened ({exc.strerror or exc})")
        return None
    start = len(MAGIC) + _TAG_BYTES
    body = memoryview(data)[start:]   # checked as it lies in what was read: no copy
    if len(data) < start or not data.startswith(MAGIC):
        _refused(cached, "is not an entry of this version (no tag)")
        return None
    if not hmac.compare_digest(data[len(MAGIC):start], _tag(cached.secret, cached.name, [body])):
        _refused(cached, "failed authentication (changed since it was written, or written "
                 "with another key)")
        return None
    from pytest_gpucase.case import golden

    try:
        results = golden.load(cached.path, data=bytes(body))
    except Exception as exc:  # an authentic entry this version cannot read: computed again
        _refused(cached, f"cannot be read ({type(exc).__name__})")
        return None
    with contextlib.suppress(OSError, NotImplementedError):
        os.utime(cached.path, follow_symlinks=False)  # used now: prune keeps it
    return results


def store(cached: Entry | None, results: dict[str, Any], seconds: float) -> None:
    """Cache ``results`` (atomically, with their tag) when computing them took
    ``MIN_SECONDS`` or more; results golden files cannot hold are not cached."""
    if cached is None or seconds < MIN_SECONDS:
        return
    from pytest_gpucase.case import golden

    with contextlib.suppress(Exception):
        chunks = golden.encode(cached.path, results)
        write_atomic(cached.path, [MAGIC, _tag(cached.secret, cached.name, chunks), *chunks])


# ------------------------------------------------------------------------- the folder


def check_folder(folder: Path, base: Path | None) -> None:
    """Refuse (``Unusable``) a ``folder`` that is, or passes below ``base`` through, a symlink;
    components that do not exist yet are fine. Nothing is created, read or followed."""
    for path in _components(folder, base):
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise Unusable(f"{display(path)} cannot be examined ({exc.strerror or exc})"
                           ) from None
        if stat.S_ISLNK(found.st_mode):
            raise Unusable(_link_problem(path))
        if not stat.S_ISDIR(found.st_mode):
            raise Unusable(f"{display(path)} is not a folder")


def _components(folder: Path, base: Path | None) -> list[Path]:
    folder = Path(os.path.abspath(folder))
    if base is None:
        return [folder]
    base = Path(os.path.abspath(base))
    if not folder.is_relative_to(base):
        raise Unusable(f"{display(folder)} is not inside {display(base)}")
    parts = folder.relative_to(base).parts
    return [base.joinpath(*parts[:n]) for n in range(1, len(parts) + 1)] or [folder]


def _link_problem(path: Path) -> str:
    try:
        target = f" -> {os.readlink(path)}"
    except OSError:
        target = ""
    return (f"{display(path)} is a symlink{target}: the reference cache is never read or "
            "pruned through a link (a link committed under .pytest_cache would have it "
            "delete files elsewhere)")


def open_folder(folder: Path, base: Path | None = None) -> int:
    """A descriptor of ``folder``, opened from ``base`` (or its parent) one component at a
    time without following a link; ``Unusable`` when one is a link or not a folder."""
    parts = _components(folder, base)
    start = parts[0].parent
    fd = os.open(start, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for path in parts:
            try:
                inner = os.open(path.name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                                dir_fd=fd)
            except OSError as exc:
                if os.path.islink(path):
                    raise Unusable(_link_problem(path)) from None
                raise Unusable(f"{display(path)} cannot be opened as a folder "
                               f"({exc.strerror or exc})") from None
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def prune(folder: Path, keep_days: float = KEEP_DAYS, max_bytes: int = MAX_BYTES,
          now: float | None = None, base: Path | None = None) -> int:
    """Remove entries of ``folder`` unused for ``keep_days``, then the least recently
    used until at most ``max_bytes`` remain; return how many were removed.

    Only names this module writes (``OWN_NAME``) are looked at, each without following
    a link, in the folder opened by ``open_folder`` (from ``base``): a folder that is or
    passes through a link is left alone. Other sessions may be pruning or writing the
    same folder: an entry that is gone already, or that cannot be removed (another
    user's, a read-only mount), is skipped, and a writer's temporary younger than
    ``keep_days`` is left to it, whatever the size. Nothing here raises: pruning is
    housekeeping.
    """
    import time

    now = time.time() if now is None else now
    try:
        fd = open_folder(folder, base)
    except (OSError, Unusable):
        return 0
    try:
        return _prune_open(fd, keep_days, max_bytes, now)
    finally:
        os.close(fd)


def _prune_open(fd: int, keep_days: float, max_bytes: int, now: float) -> int:
    entries: list[tuple[float, int, str, bool]] = []
    try:
        names = os.listdir(fd)
    except OSError:
        return 0
    for name in names:
        found = OWN_NAME.fullmatch(name)
        if found is None:
            continue  # not a name this module writes: never touched
        with contextlib.suppress(OSError):
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                entries.append((info.st_mtime, info.st_size, name, bool(found["temporary"])))
    entries.sort()
    total = sum(size for _, size, _, _ in entries)
    removed = 0
    for used, size, name, temporary in entries:
        recent = used > now - keep_days * 86400
        if recent and total <= max_bytes:
            break
        if recent and temporary:
            continue  # a write in progress: its writer renames or removes it
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError:
            continue  # still there: still counted
        else:
            removed += 1
        total -= size
    return removed


# ------------------------------------------------------------------------- the key


def session_cache() -> ReferenceCache:
    """A cache for this session only: a private temporary folder and a key of its own
    (removed with ``temporary`` when the session ends)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gpucase-references-"))
    folder = root / "entries"
    folder.mkdir(mode=0o700)
    return ReferenceCache(folder, make_key(root / KEY_NAME), base=root, temporary=root)

"""What the process that forks a run's child (the pytest process, or the zygote) finds for
the run just before the fork, so that the child need not find it again
(``prepare_in_parent``, given to ``run_in_child`` as its ``prepare``).

A forked child pays for every object it touches with copy-on-write page faults, so work
that is the same before and after the fork is cheaper done once in its parent: the paths
a case's code is imported from (and which of them ``sys.path`` lacks), the files its
reference-cache key reads, a small payload's tensors (data parsed, no code run), and the
case's own ``FILE.py`` compiled into a fresh, empty module (read and compiled, never
run: the child runs its body, ``module``). Only the child forked there uses them.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import re
import stat
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pytest_gpucase.case import payload, project
from pytest_gpucase.case.model import CASE_MODULE_PREFIX, Case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import reference_cache

__all__ = ["COMPILE_LIMIT", "apart", "imported", "loaded", "module", "module_name",
           "prepare_in_parent", "prepend_import_paths", "taken"]

# What the parent found for the run it is about to fork (``prepare_in_parent``): the
# child inherits it instead of finding it again, on pages that its own work would copy.
_PREPARED: dict[str, Any] = {}


@contextlib.contextmanager
def prepare_in_parent(spec: RunSpec, env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Find, around the fork of the child that runs ``spec`` and in the process that forks
    it (the pytest process, or the zygote: ``run_in_child``'s ``prepare``), what the child
    would find the same way: the paths the case's code is imported from, and the parts of
    its reference-cache key that are plain files and the secret of the key file ``env``
    names (``reference_cache.prepare``), a small payload's tensors, and the case's own
    module compiled (``module``). Only that child uses them (its parent is this process),
    once; any other child (a reused worker, a spawned one) finds them itself. Dropped here
    when the block ends."""
    case = spec.case
    # Nothing of an earlier run's may reach this one's child (a prepare that failed half
    # way, its entries left): dropped first, and however this one ends.
    _PREPARED.clear()
    reference_cache.forget_prepared()
    try:
        for path in (case.case_file, case.inputs_file, case.expected_file):
            os.fspath(path)  # made here once, as text too (``Case`` keeps them), for the child
        _PREPARED.update(case=case.path, parent=os.getpid(),
                         missing_paths=project.missing(project.import_paths(case.path)))
        for target in {case.call, case.reference or case.call}:
            _compile_module(case, target.partition(":")[0])
        if case.inputs_sha256 is None:  # else the child checks the hash of the bytes it reads
            # A small payload is loaded here: data parsed, no code run, as the header already
            # is; the child finds its tensors in memory, on pages it copies only if it writes.
            _PREPARED["tensors"] = payload.load_small(case.inputs_file)
        env = env or {}
        reference_cache.prepare(spec, env.get(reference_cache.KEY_ENV),
                                env.get(reference_cache.CACHE_ENV))
        yield
    finally:
        _PREPARED.clear()
        reference_cache.forget_prepared()


def taken(case: Case, name: str) -> Any:
    """What the parent prepared for this run under ``name`` (taken: once), or None."""
    found = _PREPARED.get("case")
    # By identity first: the child's case is the one the parent prepared (inherited).
    if (found is case.path or found == case.path) and _PREPARED["parent"] == os.getppid():
        return _PREPARED.pop(name, None)
    return None


# Compiled once, at import: a child compiling it costs more than the import.
_NOT_IDENTIFIER = re.compile(r"[^0-9A-Za-z_]")


def module_name(case: Case, where: str) -> str:
    """The name a case's own ``FILE.py`` is imported under (``child.resolve``)."""
    return f"{CASE_MODULE_PREFIX}{_NOT_IDENTIFIER.sub('_', case.name)}_{Path(where).stem}"


# Bytes of a case's ``FILE.py`` the parent compiles for its child (a few milliseconds at
# most): a bigger one (generated code) is compiled by the child, under the run's timeout.
COMPILE_LIMIT = 256 * 1024


def _compile_module(case: Case, where: str) -> None:
    """In the parent: a fresh module for the case's ``where`` (a ``FILE.py`` of the case,
    of at most ``COMPILE_LIMIT`` bytes), made as ``importlib`` makes it, and its code as the
    loader gives it (from a valid cached bytecode file, else compiled from the source).
    None of the case's code runs here; anything that fails (a syntax error, a missing
    file) is left for the child to meet and report as it always did."""
    if not where.endswith(".py"):
        return
    try:
        found = os.stat(case.path / where)
        if not stat.S_ISREG(found.st_mode) or found.st_size > COMPILE_LIMIT:
            return  # a FIFO would block the read: the child meets it, under its timeout
        if not _regular_or_absent(importlib.util.cache_from_source(str(case.path / where))):
            return  # the loader reads its bytecode cache too: the same
        name, module_spec = _spec(case, where)
        code = module_spec.loader.get_code(name)  # type: ignore[union-attr]
        if code is None:
            return
        made = importlib.util.module_from_spec(module_spec)
    except Exception:
        return
    _PREPARED[f"module:{where}"] = (name, made, code)


def _regular_or_absent(path: str) -> bool:
    """Whether ``path`` is a regular file or nothing: anything else (a FIFO) may block the
    process that reads it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True


def _spec(case: Case, where: str) -> tuple[str, importlib.machinery.ModuleSpec]:
    """The name a case's ``where`` is imported under and its spec, as ``importlib`` makes it
    for the file; ImportError when it makes none."""
    file = case.path / where
    name = module_name(case, where)
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {file}")
    return name, module_spec


def module(case: Case, where: str) -> types.ModuleType | None:
    """In the child: the case's ``where`` module, as a fresh import of it leaves it: under
    its name in ``sys.modules``, its body run here (what the parent prepared: its name, a
    new module and its compiled code; the one loaded under that name already, if any);
    None when the parent prepared nothing for it (then the child imports it itself). An
    exception of the module's body propagates, the module left in ``sys.modules`` as
    ``child.resolve`` leaves it."""
    found = taken(case, f"module:{where}")
    if found is None:
        return None
    name, made, code = found
    already = loaded(name, made.__file__)
    if already is not None:
        return already
    sys.modules[name] = made
    if len(_CODES) >= 8:   # a reused worker runs case after case: what a run needs, no more
        _CODES.clear()
    _CODES[name] = code   # for a copy of it apart (``apart``)
    exec(code, made.__dict__)  # the module's body, as the loader's exec_module runs it
    return made  # type: ignore[no-any-return]


# The code of each case module run here from the parent's compile, by module name.
_CODES: dict[str, types.CodeType] = {}
# What a module's copy takes of it before its body runs: where it was loaded from.
_ORIGIN = ("__file__", "__spec__", "__loader__", "__package__", "__cached__", "__builtins__")


def apart(case: Case, where: str) -> types.ModuleType:
    """A second copy of the case's own ``where`` module (imported here already), its body
    run afresh into a module object of its own: the reference computed from it shares no
    module-level state with the call (a table cached by length, a memo of results, filled
    by the call in its own precision). Not in ``sys.modules``: the call's module stays the
    one imported. Raises what the body raises run a second time (a custom op registered
    twice)."""
    name = module_name(case, where)
    shared = loaded(name, str(case.path / where))
    if shared is None:
        raise ImportError(f"{where} is not imported here")
    code = _CODES.get(name)
    if code is None:
        loader = getattr(getattr(shared, "__spec__", None), "loader", None)
        code = loader.get_code(name) if loader is not None else None
        if code is None:
            raise ImportError(f"no code for {where}")
    copy = types.ModuleType(name, shared.__doc__)
    copy.__dict__.update({key: shared.__dict__[key] for key in _ORIGIN if key in shared.__dict__})
    exec(code, copy.__dict__)
    return copy


def imported(case: Case, where: str) -> types.ModuleType:
    """The case's own ``where`` (a ``FILE.py`` of it) imported here, where the parent
    prepared nothing (``module``): once per process."""
    name = module_name(case, where)
    module = loaded(name, str(case.path / where))
    if module is None:
        name, module_spec = _spec(case, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def loaded(name: str, file: str | None) -> types.ModuleType | None:
    """The module ``sys.modules`` holds under ``name`` if it is ``file``'s: another case of
    the same name (cases/a/GPT, cases/b/GPT) in a process that imported it first (a reused
    worker, a tool running cases in-process) holds its own there."""
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != file:
        return None
    return module


def prepend_import_paths(case: Case) -> None:
    """``project.prepend(import_paths(case))``, with what ``sys.path`` lacks found by the
    parent when it prepared this child (the child's ``sys.path`` is the parent's at the
    fork)."""
    missing: list[str] | None = taken(case, "missing_paths")
    if missing is None:
        project.prepend(project.import_paths(case.path))
    else:
        sys.path[:0] = missing

"""What the parent finds for a run just before it forks the run's child, so that the
child need not find it again (``prepare_in_parent``).

A forked child pays for every object it touches with copy-on-write page faults, so work
that is the same before and after the fork is cheaper done once in the parent: the paths
a case's code is imported from, the files its reference-cache key reads, a small
payload's tensors (data parsed, no code run). Only the child forked there uses them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from pytest_gpucase.case import payload, project
from pytest_gpucase.case.model import Case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run import reference_cache

__all__ = ["import_paths", "prepare_in_parent", "taken"]

# What the parent found for the run it is about to fork (``prepare_in_parent``): the
# child inherits it instead of finding it again, on pages that its own work would copy.
_PREPARED: dict[str, Any] = {}


@contextlib.contextmanager
def prepare_in_parent(spec: RunSpec, forked: bool = True) -> Iterator[None]:
    """Find, in the parent around the fork of the child that runs ``spec``, what the child
    would find the same way: the paths the case's code is imported from, and the parts of
    its reference-cache key that are plain files (``reference_cache.prepare``), and a small
    payload's tensors. Only that child uses them (its parent is this process), once; any
    other child (a reused worker, a zygote's, a spawned one) finds them itself. Dropped
    here when the block ends. Nothing is done unless the child is ``forked`` from here
    (a zygote's or a spawned child could not use it)."""
    if not forked:
        yield
        return
    case = spec.case
    _PREPARED.update(case=case.path, parent=os.getpid(),
                     import_paths=project.import_paths(case.path))
    if case.inputs_sha256 is None:  # else the child checks the hash of the bytes it reads
        # A small payload is loaded here: data parsed, no code run, as the header already
        # is; the child finds its tensors in memory, on pages it copies only if it writes.
        _PREPARED["tensors"] = payload.load_small(case.inputs_file)
    reference_cache.prepare(spec)
    try:
        yield
    finally:
        _PREPARED.clear()
        reference_cache.forget_prepared()


def taken(case: Case, name: str) -> Any:
    """What the parent prepared for this run under ``name`` (taken: once), or None."""
    if _PREPARED.get("case") == case.path and _PREPARED["parent"] == os.getppid():
        return _PREPARED.pop(name, None)
    return None


def import_paths(case: Case) -> tuple[str, ...]:
    """``project.import_paths`` of the case, as the parent found them if it did."""
    paths: tuple[str, ...] | None = taken(case, "import_paths")
    return project.import_paths(case.path) if paths is None else paths

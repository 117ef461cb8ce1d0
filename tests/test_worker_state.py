"""The worker's check of the namespaces it watches (``run.isolation.state``): the dicts'
version tags prove an untouched dict unchanged; any change sends the check to the values."""

from __future__ import annotations

import gc
import sys

import pytest

from pytest_gpucase.run.isolation import state


def namespaces(*dicts: dict[str, object]) -> state._Namespaces:
    found = state._Namespaces()
    for index, namespace in enumerate(dicts):
        found.add(f"m{index}", namespace, strict=True)
    found.freeze()
    return found


@pytest.mark.skipif(sys.implementation.name != "cpython"
                    or not (3, 11) <= sys.version_info[:2] <= (3, 13),
                    reason="version tags are CPython 3.11-3.13's")
def test_untouched_dicts_are_proven_unchanged_by_their_version_tags() -> None:
    module: dict[str, object] = {"value": [1]}
    other = {"a": object()}
    found = namespaces(module, other)
    assert state._version_offset() is not None
    assert found.versions.unchanged()   # no value compared
    module["value"] = module["value"]   # the same object again: no change at all
    assert found.versions.unchanged()
    kept = other["a"]
    other["a"] = object()               # another object
    assert not found.versions.unchanged() and not found.unchanged()
    other["a"] = kept                   # put back: unchanged by identity, tags refreshed
    assert found.unchanged() and found.versions.unchanged()


class Weird:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no")

    __hash__ = object.__hash__


@pytest.mark.parametrize("change", ["add", "remove", "replace", "replace_equal", "raises",
                                    "class_attribute"])
def test_every_change_of_a_watched_dict_is_seen(change: str) -> None:
    class Watched:
        method = staticmethod(len)

    module: dict[str, object] = {"number": 1000, "name": "x"}
    cls_dict = gc.get_referents(Watched.__dict__)[0]
    found = namespaces(module, cls_dict)
    if change == "add":
        module["extra"] = 1
    elif change == "remove":
        del module["name"]
    elif change == "replace":
        module["name"] = "y"
    elif change == "replace_equal":  # equal, not the same: the values' list compares equal
        module["number"] = int("1000")
    elif change == "raises":
        module["name"] = Weird()
    else:
        setattr(Watched, "method", staticmethod(abs))  # noqa: B010
    assert not found.versions.unchanged()
    assert found.unchanged() is (change == "replace_equal")


def test_the_modules_a_call_imported_are_found_whatever_left_or_moved() -> None:
    """``_new_modules``: what was imported since the last look, in import order: read from the
    end of ``sys.modules`` while everything before it is as it was, from every name else (a
    module removed or replaced before the end moves nothing past it)."""
    import types

    taken = state.WorkerState.__new__(state.WorkerState)

    def look() -> None:
        taken.modules = dict(sys.modules)
        taken.module_objects = list(taken.modules.values())

    names = [f"gpucase_test_new_{index}" for index in range(4)]
    try:
        sys.modules[names[0]] = types.ModuleType(names[0])
        look()
        assert taken._new_modules() == []
        sys.modules[names[1]] = types.ModuleType(names[1])
        sys.modules[names[2]] = types.ModuleType(names[2])
        assert taken._new_modules() == names[1:3]
        look()
        del sys.modules[names[0]]  # one before the end left, and another came
        sys.modules[names[3]] = types.ModuleType(names[3])
        assert taken._new_modules() == [names[3]]
        look()
        sys.modules[names[1]] = types.ModuleType(names[1])  # replaced in place: not new
        assert taken._new_modules() == []
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_an_autocast_dtype_left_changed_retires_the_worker() -> None:
    """``torch.set_autocast_dtype("cpu", torch.float16)`` in one case made a later case's
    matmul run in float16 in the same worker, with no retirement."""
    import torch

    looked = state.WorkerState()
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        reasons = looked.settle()
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert any("torch.get_autocast_dtype('cpu') changed" in why for why in reasons), reasons
    assert looked.settle() == []

"""What the parent prepares before it forks a run's child (``run.prepared``): the case's
module compiled there but run only in the child, fresh for every child; the import paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import write_case
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.isolation import run_in_child
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.prepared import prepare_in_parent
from pytest_gpucase.run.runcontext import RunContext

TOML = 'format = 1\ncall = "case.py:run"\n'
# Each import of the module counts itself, in the process that runs its body.
COUNTING = """
import os
CALLS = []
with open(os.path.join(os.path.dirname(__file__), "imported"), "a") as handle:
    handle.write(f"{os.getpid()}\\n")

def run(x):
    CALLS.append(1)
    return x + len(CALLS)
"""


def _imported_and_called(spec: RunSpec) -> tuple[int, str, list[str]]:
    from pytest_gpucase.run.child import resolve
    from pytest_gpucase.run.prepared import prepend_import_paths

    before = list(sys.path)
    prepend_import_paths(spec.case)
    added = sys.path[:len(sys.path) - len(before)]
    func = resolve(spec.case, spec.case.call, "call")
    module = sys.modules[func.__module__]
    return int(func(1)), str(module.__file__), added


@pytest.mark.slow
def test_the_case_module_runs_only_in_the_child_and_fresh_in_each(tmp_path: Path) -> None:
    """The parent reads and compiles ``case.py`` before the fork; its body runs in each
    child, never in the pytest process, and a child's changes to the module's state are
    not seen by the next child (a run that mutates module state keeps its isolation)."""
    path = write_case(tmp_path, "counting", TOML, COUNTING, {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    found = []
    for _ in range(2):
        with prepare_in_parent(spec):
            child = run_in_child(_imported_and_called, spec, timeout=60)
        assert child.returned, child.problem
        found.append(child.value)
    # Each child ran the body once and called once: 1 + 1, not 1 + 2.
    assert [value[0] for value in found] == [2, 2]
    assert found[0][1] == str(path / "case.py")
    pids = (path / "imported").read_text().split()
    assert len(pids) == 2 and str(os.getpid()) not in pids
    assert not any(name.startswith("gpucase_case_counting") for name in sys.modules)


@pytest.mark.slow
def test_the_import_paths_the_parent_finds_are_the_childs_own(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = src\n")
    path = write_case(tmp_path, "counting", TOML, COUNTING, {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    own = run_in_child(_imported_and_called, spec, timeout=60)
    with prepare_in_parent(spec):
        prepared = run_in_child(_imported_and_called, spec, timeout=60)
    assert own.returned and prepared.returned, (own.problem, prepared.problem)
    assert prepared.value[2] == own.value[2] == [str(tmp_path / "src"), str(tmp_path)]


@pytest.mark.slow
@pytest.mark.parametrize(("body", "said"), [
    ("def run(x):\n    return x +\n", "SyntaxError"),
    ("import sys\nsys.exit(4)\n", "SystemExit: 4"),
])
def test_a_case_module_that_does_not_import_is_a_broken_case(tmp_path: Path, body: str,
                                                             said: str) -> None:
    """Compiling it in the parent raises nothing there: the child meets the error and
    reports it as before."""
    path = write_case(tmp_path, "broken", TOML, body, {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    verdict = run_spec(spec, RunContext("fork", "cpu"))
    assert verdict.outcome.kind == "broken case", verdict.outcome
    assert "call: importing 'case.py' failed" in verdict.outcome.summary
    assert said in verdict.outcome.details


def test_the_parent_reads_the_key_files_secret_again_when_the_file_changes(
        tmp_path: Path) -> None:
    from pytest_gpucase.run import reference_cache

    key_file = reference_cache.make_key(tmp_path / "key")
    first = reference_cache._parent_secret(str(key_file))
    assert first == reference_cache.read_key(key_file)
    key_file.unlink()
    assert reference_cache._parent_secret(str(key_file)) is None
    reference_cache.make_key(key_file)  # another key under the same name
    second = reference_cache._parent_secret(str(key_file))
    assert second == reference_cache.read_key(key_file) != first
    key_file.chmod(0o644)  # readable by others: refused, as the child's read refuses it
    assert reference_cache._parent_secret(str(key_file)) is None
    key_file.chmod(0o600)
    key_file.rename(tmp_path / "real")
    key_file.symlink_to(tmp_path / "real")
    assert reference_cache._parent_secret(str(key_file)) is None


def _secret_in_child(spec: RunSpec, key_file: str) -> str:
    from pytest_gpucase.run import reference_cache

    os.environ[reference_cache.KEY_ENV] = key_file
    os.environ[reference_cache.CACHE_ENV] = os.path.dirname(key_file)
    entry = reference_cache.entry(spec, len)
    return entry.secret.hex() if entry is not None else ""


@pytest.mark.slow
def test_the_child_takes_the_secret_the_parent_read(tmp_path: Path) -> None:
    from pytest_gpucase.run import reference_cache

    path = write_case(tmp_path, "counting", TOML, COUNTING, {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    key_file = reference_cache.make_key(tmp_path / "key")
    secret = reference_cache.read_key(key_file).hex()
    with prepare_in_parent(spec, env={reference_cache.KEY_ENV: str(key_file)}):
        key_file.unlink()  # read before the fork: the child never opens it
        prepared = run_in_child(_secret_in_child, spec, str(key_file), timeout=60)
    own = run_in_child(_secret_in_child, spec, str(key_file), timeout=60)
    assert prepared.value == secret
    assert own.value == ""  # without the parent's read: no key file, no cache


def test_a_big_case_module_is_left_for_the_child_to_compile(tmp_path: Path) -> None:
    """Generated code past ``COMPILE_LIMIT`` is compiled in the child, under the run's
    timeout, not in the pytest process, which has none."""
    from pytest_gpucase.run import prepared

    small = write_case(tmp_path, "small", TOML, COUNTING, {"x": torch.ones(2)})
    big = write_case(tmp_path, "big", TOML, COUNTING + "# padding\n" * (
        prepared.COMPILE_LIMIT // 10 + 1), {"x": torch.ones(2)})
    for path, expected in ((small, True), (big, False)):
        spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
        with prepare_in_parent(spec):
            assert ("module:case.py" in prepared._PREPARED) is expected


def _entry_in_child(spec: RunSpec, key_file: str, folder: str) -> list[str]:
    from pytest_gpucase.run import reference_cache
    from pytest_gpucase.run.child import resolve

    os.environ[reference_cache.KEY_ENV] = key_file
    os.environ[reference_cache.CACHE_ENV] = folder
    entry = reference_cache.entry(spec, resolve(spec.case, spec.case.call, "call"))
    assert entry is not None
    return [str(entry.path), entry.name]


@pytest.mark.slow
def test_the_child_takes_the_entry_path_the_parent_made_for_its_folder_only(
        tmp_path: Path) -> None:
    """The parent predicts the key of a reference defined in the case's own file and makes
    its entry's path in the cache folder the child is given; a child whose folder is another
    (or whose key is another) makes its own, in its own folder."""
    from pytest_gpucase.run import reference_cache

    path = write_case(tmp_path, "counting", TOML, COUNTING, {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    key_file = str(reference_cache.make_key(tmp_path / "key"))
    folder, other = str(tmp_path / "cache"), str(tmp_path / "elsewhere")
    env = {reference_cache.KEY_ENV: key_file, reference_cache.CACHE_ENV: folder}
    found = {}
    saved = reference_cache._PRIMED
    # Whatever a run imports in this process is imported first: priming after it, the
    # child finds nothing loaded that the parent did not predict.
    run_in_child(_entry_in_child, spec, key_file, folder, timeout=60)
    reference_cache.prime()  # as a session with a cache does before its first fork
    try:
        for given in (folder, other):
            with prepare_in_parent(spec, env=env):
                made = reference_cache._PREPARED.get("entry")
                assert made is not None and made[0] == folder
                result = run_in_child(_entry_in_child, spec, key_file, given, timeout=60)
            assert result.returned, result.problem
            found[given] = result.value
        # Without the parent's preparation: the same key, and the path made by the child.
        alone = run_in_child(_entry_in_child, spec, key_file, folder, timeout=60)
    finally:
        reference_cache._PRIMED = saved
    name = made[1]
    assert found[folder] == [os.path.join(folder, name), name]
    assert found[other] == [os.path.join(other, name), name]
    assert alone.value == found[folder]


@pytest.mark.parametrize("where", ["source", "bytecode cache"])
def test_a_case_file_that_is_no_longer_a_file_is_left_to_the_child(
        tmp_path: Path, where: str) -> None:
    """A case's module (or the bytecode cache the loader reads for it) replaced by a FIFO
    since collection would block the process that prepares (the pytest process, or the
    zygote, which every run waits on): it is not read there; the child meets it, under its
    run's timeout."""
    import importlib.util
    import threading

    from pytest_gpucase.run import prepared

    path = write_case(tmp_path, "fifo", TOML, "def run(x):\n    return x\n", {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    fifo = Path(importlib.util.cache_from_source(str(path / "case.py")))
    if where == "source":
        fifo = path / "case.py"
        fifo.unlink()
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    found: list[object] = []

    def enter() -> None:
        with prepare_in_parent(spec):
            found.append(prepared._PREPARED.get("module:case.py"))

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    thread.join(10)
    alive = thread.is_alive()
    if alive:  # unblock the read, so that the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not alive and found == [None]


def test_nothing_of_an_earlier_prepare_reaches_the_next(tmp_path: Path) -> None:
    """A prepare that ended half way left its entries (another case's tensors): the next
    one starts from nothing, so that its child cannot take them for its own."""
    from pytest_gpucase.run import prepared

    path = write_case(tmp_path, "adds", TOML, "def run(x):\n    return x\n", {"x": torch.ones(2)})
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    prepared._PREPARED.update(case=spec.case.path, parent=os.getpid(), stale=True)
    try:
        with prepare_in_parent(spec):
            assert "stale" not in prepared._PREPARED
    finally:
        prepared._PREPARED.clear()

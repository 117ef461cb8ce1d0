"""The float64 reference: computed once per case and variant, recomputed when anything it
depends on changes, and never trusted for a failure."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpucase.case import golden
from pytest_gpucase.case import payload
from pytest_gpucase.run import reference_cache
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext
from pytest_gpucase.verdict.rounding import DRAWS

CODE = '''
import os
import time

def run(x):
    return x + 1

def ref(x):
    with open(os.path.join(os.path.dirname(__file__), "calls"), "a") as handle:
        handle.write("1")
    time.sleep(0.02)  # slower than reference_cache.MIN_SECONDS: worth caching
    return x + {offset}
'''


def make(root: Path, offset: int = 1) -> Path:
    path = root / "counted"
    path.mkdir(parents=True, exist_ok=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    'reference = "case.py:ref"\n')
    (path / "case.py").write_text(CODE.format(offset=offset))
    payload.save(path / "inputs.safetensors", {"x": torch.ones(4)})
    return path


def cache_at(folder: Path, key: str = "key") -> reference_cache.ReferenceCache:
    """A cache folder and its key, as a session makes them (the key beside the folder)."""
    folder.mkdir(exist_ok=True)
    return reference_cache.ReferenceCache(folder, reference_cache.make_key(folder.parent / key))


def judged(path: Path, cache: Path, device: str = "cpu", key: str = "key") -> Outcome:
    spec = RunSpec(load_case(path), device, "float32", cast=False)
    return run_spec(spec, RunContext("fork", "cpu", reference_cache=cache_at(cache, key))).outcome


def run(path: Path, cache: Path, device: str = "cpu") -> str:
    return judged(path, cache, device).status


def calls(path: Path) -> int:
    file = path / "calls"
    return len(file.read_text()) if file.exists() else 0


@pytest.mark.slow
def test_the_reference_is_computed_once_and_reused(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert [run(path, cache) for _ in range(3)] == ["passed"] * 3
    assert calls(path) == 1
    assert len(list(cache.glob("*.reference"))) == 1


def test_a_cast_dtype_is_a_reference_of_its_own(tmp_path: Path) -> None:
    case = load_case(make(tmp_path))
    saved = RunSpec(case, "cpu", "float32", cast=False)
    cast = RunSpec(case, "cpu", "bfloat16", cast=True)
    assert reference_cache.key(saved, len) != reference_cache.key(cast, len)


@pytest.mark.slow
def test_changed_inputs_invalidate_it(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    payload.save(path / "inputs.safetensors", {"x": torch.full((4,), 2.0)})
    assert run(path, cache) == "passed"
    assert calls(path) == 2


@pytest.mark.slow
def test_a_changed_reference_function_invalidates_it(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    make(tmp_path, offset=2)  # the reference now disagrees with the call
    assert run(path, cache) == "failed"
    # Computed again (not read from the cache), and run DRAWS more times for the rounding
    # budget that the failing leaf asks for before it is reported.
    assert calls(path) == 2 + DRAWS


def stored(entry: Path) -> dict[str, object]:
    """An entry's results, read past its tag (as the cache does once the tag is checked)."""
    data = entry.read_bytes()
    return golden.load(entry, data=data[len(reference_cache.MAGIC) + 32:])


@pytest.mark.slow
def test_a_failure_never_rests_on_the_cache(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (entry,) = cache.glob("*.reference")
    golden.save(entry, {"out": torch.zeros(4, dtype=torch.float64)})  # a wrong cached value
    assert run(path, cache) == "passed"  # recomputed before any failure is reported
    assert calls(path) == 2
    assert torch.equal(stored(entry)["out"], torch.full((4,), 2.0, dtype=torch.float64))


def _forged_plain(entry: Path, wrong: Path) -> None:
    golden.save(entry, {"out": torch.full((4,), 2.0, dtype=torch.float64)})


def _forged_tag(entry: Path, wrong: Path) -> None:
    """The entry's own format and a tag, made without the key."""
    chunks = golden.encode(entry, {"out": torch.full((4,), 2.0, dtype=torch.float64)})
    entry.write_bytes(reference_cache.MAGIC + bytes(32) + b"".join(bytes(c) for c in chunks))


def _copied(entry: Path, wrong: Path) -> None:
    """A genuine entry, with a valid tag, of another case whose reference is the wrong value."""
    entry.write_bytes(wrong.read_bytes())


def _linked(entry: Path, wrong: Path) -> None:
    entry.unlink()
    entry.symlink_to(wrong)


def _fifo(entry: Path, wrong: Path) -> None:
    entry.unlink()
    os.mkfifo(entry)


def _folder(entry: Path, wrong: Path) -> None:
    entry.unlink()
    entry.mkdir()


def _huge(entry: Path, wrong: Path) -> None:
    with open(entry, "r+b") as handle:   # sparse: costs no disk
        handle.truncate(reference_cache.MAX_BYTES + 1)


@pytest.mark.slow
@pytest.mark.parametrize("forge", [_forged_plain, _forged_tag, _copied, _linked, _fifo, _folder,
                                   _huge],
                         ids=["plain-golden", "tag-without-key", "genuine-of-another-case",
                              "symlink", "fifo", "folder", "over-the-cache-size"])
def test_a_poisoned_entry_never_turns_a_failure_into_a_pass(
        tmp_path: Path, forge: Callable[[Path, Path], None]) -> None:
    """The call returns x + 1, the reference x + 2: the item fails. An entry rewritten to
    hold x + 1 (the wrong output) made it pass; every such entry is now refused, noted, and
    the reference computed again."""
    cache = tmp_path / "cache"
    wrong_case = make(tmp_path / "wrong", offset=1)   # a case whose reference IS x + 1
    assert run(wrong_case, cache) == "passed"
    (wrong,) = cache.glob("*.reference")
    path = make(tmp_path, offset=2)
    first = judged(path, cache)
    assert first.status == "failed" and not first.notes
    # The reference's own entry, not the budget computed beside it for the failing leaf.
    (entry,) = {p for p in cache.glob("*.reference") if p.name.count(".") == 1} - {wrong}
    forge(entry, wrong)
    outcome = judged(path, cache)
    assert outcome.status == "failed", outcome.summary
    # Computed again, not read (each failing run also ran the DRAWS of its budget).
    assert calls(path) == 2 * (1 + DRAWS)
    (note,) = outcome.notes
    assert note.startswith(f"the reference cache entry of case counted ({entry.name[:12]}...) ")
    assert note.endswith(": not trusted; the reference was computed again and the entry "
                         "rewritten")
    if entry.is_dir():
        return   # nothing can be written over a folder: the run goes on without the cache
    assert torch.equal(stored(entry)["out"], torch.full((4,), 3.0, dtype=torch.float64))


@pytest.mark.slow
def test_entries_written_with_another_key_are_computed_again(tmp_path: Path) -> None:
    """A CI cache restored on a runner whose home (and key) is new: never trusted."""
    path, cache = make(tmp_path), tmp_path / "cache"
    assert judged(path, cache, key="first").status == "passed"
    outcome = judged(path, cache, key="second")
    assert outcome.status == "passed" and calls(path) == 2
    assert "failed authentication (changed since it was written, or written with another " \
           "key)" in outcome.notes[0]
    assert judged(path, cache, key="second").notes == ()  # rewritten with this key: trusted
    assert calls(path) == 2


@pytest.mark.slow
def test_without_a_cache_folder_nothing_is_written(tmp_path: Path) -> None:
    path = make(tmp_path)
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    assert run_spec(spec, RunContext("fork", "cpu")).outcome.status == "passed"
    assert reference_cache.CACHE_ENV not in os.environ
    assert calls(path) == 1


@pytest.mark.slow
def test_a_fast_reference_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The threshold, not the machine's speed, decides: an unsleeping reference took over 5 ms
    # on a loaded 2-core runner. (The forked child inherits the patched module.)
    monkeypatch.setattr(reference_cache, "MIN_SECONDS", 10.0)
    path, cache = make(tmp_path), tmp_path / "cache"
    (path / "case.py").write_text((path / "case.py").read_text().replace("time.sleep(0.02)",
                                                                         "pass"))
    assert [run(path, cache) for _ in range(2)] == ["passed"] * 2
    assert calls(path) == 2
    assert not list(cache.glob("*.reference"))


def _aged(folder: Path, name: str, size: int, days_ago: float, now: float) -> Path:
    path = folder / name
    path.write_bytes(b"x" * size)
    os.utime(path, (now - days_ago * 86400,) * 2)
    return path


def _name(n: int, suffix: str = ".reference") -> str:
    return f"{n:064x}{suffix}"


def test_prune_drops_unused_entries_then_the_least_recently_used(tmp_path: Path) -> None:
    now = 2_000_000_000.0
    stale = _aged(tmp_path, _name(1), 10, 30, now)
    older = _aged(tmp_path, _name(2), 100, 2, now)
    newer = _aged(tmp_path, _name(3), 100, 1, now)
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=1000, now=now) == 1
    assert not stale.exists() and older.exists() and newer.exists()
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=150, now=now) == 1
    assert not older.exists() and newer.exists()  # over the size: the oldest goes first
    assert reference_cache.prune(tmp_path / "absent", now=now) == 0


def test_prune_spares_writes_in_progress_and_survives_what_it_cannot_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = 2_000_000_000.0
    writing = _aged(tmp_path, f".{_name(1)}.0123abcd.42.89abcdef.tmp", 500, 0.01, now)
    kept = _aged(tmp_path, _name(2), 10, 30, now)
    real_unlink = os.unlink

    def refused(path: str, *, dir_fd: int | None = None) -> None:
        if path.endswith(_name(2)):
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", refused)
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=100, now=now) == 0
    assert writing.exists() and kept.exists()


def test_prune_removes_only_names_it_writes_and_follows_no_link(tmp_path: Path) -> None:
    """Whatever else the folder holds (a committed file, a link named like an entry, a
    folder), prune removes entries and their temporaries, and nothing they point to."""
    now = 2_000_000_000.0
    folder, outside = tmp_path / "cache", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    precious = _aged(outside, "thesis.pdf", 10, 400, now)
    own = [_aged(folder, _name(1), 10, 30, now),
           _aged(folder, _name(2, ".safetensors"), 10, 30, now),   # the earlier format
           _aged(folder, f".{_name(3)}.0123abcd.42.89abcdef.tmp", 10, 30, now)]
    foreign = [_aged(folder, name, 10, 400, now) for name in (
        "id_rsa", "notes.safetensors", _name(4) + ".bak", _name(5).upper(), "x" + _name(6),
        f".{_name(7)}.0123abcd.42.89abcdef.tmp.old", _name(8)[:-1] + "\n")]
    (folder / _name(9)).symlink_to(precious)           # a link named like an entry
    (folder / _name(10)).mkdir()                       # a folder named like one
    assert reference_cache.prune(folder, keep_days=14, max_bytes=0, now=now) == len(own)
    assert not any(path.exists() for path in own)
    assert all(path.exists() for path in foreign)
    assert precious.exists() and (folder / _name(9)).is_symlink() and (folder / _name(10)).is_dir()


def test_prune_leaves_a_folder_that_is_or_passes_through_a_link(tmp_path: Path) -> None:
    now = 2_000_000_000.0
    target = tmp_path / "home"
    target.mkdir()
    victim = _aged(target, _name(1), 10, 400, now)
    project = tmp_path / "project"
    (project / ".pytest_cache").mkdir(parents=True)
    (project / ".pytest_cache" / "d").symlink_to(target)
    (tmp_path / "link").symlink_to(target)
    assert reference_cache.prune(tmp_path / "link", keep_days=0, max_bytes=0, now=now) == 0
    assert reference_cache.prune(project / ".pytest_cache" / "d" / "gpucase-references",
                                 keep_days=0, max_bytes=0, now=now, base=project) == 0
    (target / "gpucase-references").mkdir()
    moved = _aged(target / "gpucase-references", _name(2), 10, 400, now)
    assert reference_cache.prune(project / ".pytest_cache" / "d" / "gpucase-references",
                                 keep_days=0, max_bytes=0, now=now, base=project) == 0
    assert victim.exists() and moved.exists()


@pytest.mark.slow
def test_a_cache_hit_marks_the_entry_used(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (entry,) = cache.glob("*.reference")
    os.utime(entry, (1.0, 1.0))  # looks unused for decades
    assert run(path, cache) == "passed"
    assert calls(path) == 1  # read back, not recomputed
    assert reference_cache.prune(cache) == 0 and entry.exists()


def test_the_session_prunes_the_folder_it_used(pytester: pytest.Pytester) -> None:
    (pytester.path / "cases").mkdir()
    make(pytester.path / "cases")
    cache = pytester.path / ".pytest_cache" / "d" / "gpucase-references"
    cache.mkdir(parents=True)
    forgotten = cache / _name(1)
    forgotten.write_bytes(b"old")
    os.utime(forgotten, (1.0, 1.0))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert not forgotten.exists()
    assert len(list(cache.glob("*.reference"))) == 1  # this run's entry stays
    assert "gpucase: reference cache" not in result.stdout.str()


def test_an_edited_module_the_reference_calls_invalidates_it(pytester: pytest.Pytester) -> None:
    # The reference is case.py's, but its arithmetic lives in a module of the project:
    # editing that module must not leave the old value cached (a wrong pass).
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(refimpl="def ref(x):\n    return x * 2\n")
    case = pytester.path / "cases" / "stale"
    case.mkdir(parents=True)
    (case / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    'reference = "case.py:reference"\n')
    (case / "case.py").write_text(
        "import os\nimport time\n\nimport refimpl\n\n"
        "def run(x):\n    return x * 2\n\n"
        "def reference(x):\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'calls'), 'a') as handle:\n"
        "        handle.write('1')\n"
        "    time.sleep(0.02)  # worth caching\n"
        "    return refimpl.ref(x)\n")
    payload.save(case / "inputs.safetensors", {"x": torch.ones(4)})
    args = ("--gpu-cases", "--gpu-devices", "cpu", "cases", "-p", "no:randomly")
    for _ in range(2):
        pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)
    assert calls(case) == 1  # nothing changed: the second run read the cache
    # Another size too, so that Python's own bytecode cache cannot serve the old module.
    (pytester.path / "refimpl.py").write_text("def ref(x):\n    return x * 3  # edited\n")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1)  # as it does with the cache cleared
    assert calls(case) >= 2


@pytest.mark.slow
def test_a_zero_tensor_reference_is_cached_by_its_values(tmp_path: Path) -> None:
    # A zero tensor has no memory to read: caching it once crashed the child (SIGSEGV).
    path, cache = make(tmp_path), tmp_path / "cache"
    (path / "case.py").write_text(
        CODE.format(offset=0).replace("def run(x):\n    return x + 1",
                                      "def run(x):\n    return x * 0")
        .replace("return x + 0", "import torch\n    return torch._efficientzerotensor(4)"))
    assert [run(path, cache) for _ in range(2)] == ["passed"] * 2
    assert calls(path) == 1  # cached, then read back
    (entry,) = cache.glob("*.reference")
    assert torch.equal(stored(entry)["out"], torch.zeros(4))


def test_module_rows_are_made_once_per_session_and_afresh_for_the_next(tmp_path: Path) -> None:
    helper = tmp_path / "gpucase_primed_helper.py"
    helper.write_text("VALUE = 1\n")
    import importlib
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("gpucase_primed_helper")
        reference_cache.prime()
        before = reference_cache._loaded_modules()
        assert str(helper).encode() in before
        helper.write_text("VALUE = 22\n")  # another size: another row, once primed again
        assert reference_cache._loaded_modules() == before  # within a session: as made
        reference_cache.prime()
        assert reference_cache._loaded_modules() != before
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gpucase_primed_helper", None)


def test_modules_imported_after_priming_are_keyed_even_when_the_last_primed_one_left(
        tmp_path: Path) -> None:
    import importlib
    import sys

    for name in ("gpucase_first_helper", "gpucase_second_helper"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("gpucase_first_helper")
        reference_cache.prime()  # the helper is the last module loaded at this point
        importlib.import_module("gpucase_second_helper")
        rows = reference_cache._loaded_modules()
        assert str(tmp_path / "gpucase_second_helper.py").encode() in rows
        # The last primed module leaves: every name is read, nothing is missed.
        sys.modules.pop("gpucase_first_helper")
        (tmp_path / "gpucase_third_helper.py").write_text("VALUE = 3\n")
        importlib.import_module("gpucase_third_helper")
        rows = reference_cache._loaded_modules()
        assert str(tmp_path / "gpucase_second_helper.py").encode() in rows
        assert str(tmp_path / "gpucase_third_helper.py").encode() in rows
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("gpucase_first_helper", "gpucase_second_helper", "gpucase_third_helper"):
            sys.modules.pop(name, None)
        reference_cache.prime()


def _tree(folder: Path) -> dict[str, tuple[int, float]]:
    return {str(path.relative_to(folder)): (path.lstat().st_size, path.lstat().st_mtime)
            for path in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("linked", [".pytest_cache", ".pytest_cache/d",
                                    ".pytest_cache/d/gpucase-references"])
def test_a_cache_folder_that_passes_through_a_symlink_is_refused(
        pytester: pytest.Pytester, linked: str) -> None:
    """A pull request commits the link; the prune at the session's end deleted every old
    file in the folder it points to. Now: one note, nothing deleted or written there."""
    make(pytester.path / "cases")
    victim = pytester.path.parent / f"{pytester.path.name}-home"
    below = Path(".pytest_cache/d/gpucase-references").relative_to(linked)
    (victim / below).mkdir(parents=True)
    now = 2_000_000_000.0
    for name in ("thesis.pdf", "id_rsa", _name(1), _name(2, ".safetensors")):
        _aged(victim, name, 10, 400, now)
        _aged(victim / below, name, 10, 400, now)
    link = pytester.path / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    compared = victim / "d" if linked == ".pytest_cache" else victim  # pytest's own go in v/
    before = _tree(compared)
    # Under xdist: each worker finds the link, the controller says it once.
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-n", "2", "-p", "no:benchmark")
    result.assert_outcomes(passed=1)
    assert _tree(compared) == before
    result.stdout.fnmatch_lines([f"gpucase: reference cache: {linked} is a symlink -> {victim}: "
                                 "the reference cache is never read or pruned through a link*; "
                                 "references are cached for this session only, in a private "
                                 "temporary folder"])
    assert result.stdout.str().count("gpucase: reference cache") == 1


def test_without_a_private_place_for_the_key_references_are_cached_for_the_session_only(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only home (here: a file where the folders would go) degrades to a cache of the
    session, never to an unchecked one."""
    path = make(pytester.path / "cases")
    blocker = pytester.path.parent / f"{pytester.path.name}-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    for _ in range(2):
        result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["gpucase: reference cache: no private place for the "
                                     "reference cache's key: cannot make *; cannot make *"])
    assert calls(path) == 2  # nothing kept from one session to the next
    assert not list((pytester.path / ".pytest_cache").rglob("*.reference"))


def test_a_key_inside_the_project_or_readable_by_others_is_never_used(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    make(pytester.path / "cases")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(pytester.path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(pytester.path / "cache"))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpucase: reference cache: no private place for the reference "
                                 "cache's key: config/pytest-gpucase is inside the project *"])
    assert not (pytester.path / "config" / "pytest-gpucase").exists()
    key = pytester.path.parent / f"{pytester.path.name}-key"
    key.write_text("ab" * 32)
    key.chmod(0o644)
    monkeypatch.setenv(reference_cache.KEY_FILE_ENV, str(key))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"gpucase: reference cache: the key file {key} may be read or "
                                 "written by others (mode 644); chmod 600 it*"])


def test_a_users_key_is_made_private_once_and_shared(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = reference_cache.user_key((tmp_path / "project",))
    assert first == tmp_path / "config" / "pytest-gpucase" / "reference-cache.key"
    assert first.stat().st_mode & 0o777 == 0o600
    assert first.parent.stat().st_mode & 0o777 == 0o700
    assert reference_cache.user_key(()) == first
    assert len(reference_cache.read_key(first)) == 32
    repository = tmp_path / "dotfiles"
    (repository / ".git").mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(repository / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert reference_cache.user_key(()) == tmp_path / "cache" / "pytest-gpucase" / \
        "reference-cache.key"   # never inside a repository: the next place
    (tmp_path / "elsewhere").write_text("ab" * 32)
    (tmp_path / "link.key").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(reference_cache.Unusable, match="is a symlink"):
        reference_cache.read_key(tmp_path / "link.key")


def _key_in_child(spec: RunSpec) -> str:
    from pytest_gpucase.run.child import resolve

    return reference_cache.key(spec, resolve(spec.case, "case.py:ref", "reference"))


@pytest.mark.slow
def test_files_read_by_the_parent_before_the_fork_give_the_same_key(tmp_path: Path) -> None:
    from pytest_gpucase.run.prepared import prepare_in_parent
    from pytest_gpucase.run.isolation import run_in_child

    path = make(tmp_path)
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    plain = run_in_child(_key_in_child, spec, timeout=60)
    before = reference_cache.key(spec, len)
    with prepare_in_parent(spec):
        prepared = run_in_child(_key_in_child, spec, timeout=60)
        # Used by that child only: this process (not its parent) reads the files itself.
        (path / "case.toml").write_text((path / "case.toml").read_text() + "# edited\n")
        here = reference_cache.key(spec, len)
    assert plain.returned and prepared.returned, (plain.problem, prepared.problem)
    assert prepared.value == plain.value
    assert here != before
    assert here == reference_cache.key(spec, len)
    after = run_in_child(_key_in_child, spec, timeout=60)
    assert after.value != plain.value  # dropped when the block ended: the edit is seen


@pytest.mark.slow
def test_the_key_the_parent_predicts_is_the_childs_or_left_unused(tmp_path: Path) -> None:
    """The parent computes the key of a case whose reference is in its own file before the
    fork; the child takes it only when it loaded what the parent expected (that file's
    module alone): the key is the one the child would compute itself either way."""
    from pytest_gpucase.run.isolation import run_in_child
    from pytest_gpucase.run.prepared import prepare_in_parent

    plain_case = make(tmp_path / "plain")
    importing = make(tmp_path / "importing")  # its reference imports a helper beside it
    (importing / "gpucase_predicted_helper.py").write_text("VALUE = 1\n")
    (importing / "case.py").write_text(
        "import sys\nsys.path.insert(0, __import__('os').path.dirname(__file__))\n"
        "import gpucase_predicted_helper\n" + CODE.format(offset=1))
    reference_cache.prime()
    try:
        for path, expected in ((plain_case, True), (importing, False)):
            spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
            own = run_in_child(_key_in_child, spec, timeout=60)
            with prepare_in_parent(spec):
                predicted = reference_cache._PREPARED["key"]
                prepared = run_in_child(_key_in_child, spec, timeout=60)
            assert own.returned and prepared.returned, (own.problem, prepared.problem)
            assert prepared.value == own.value
            assert predicted is not None and (predicted[2] == own.value) is expected
    finally:
        reference_cache.forget_primed()
        sys.modules.pop("gpucase_predicted_helper", None)


ROUNDED = '''
import os
import time

def run(a, b):
    with open(os.path.join(os.path.dirname(__file__), "calls"), "a") as handle:
        handle.write("1")
    time.sleep(0.02)  # slower than reference_cache.MIN_SECONDS: worth caching
    return a @ b {change}
'''


def rounded_case(root: Path, change: str = "", seed: int = 0) -> Path:
    """A float32 matmul of values ~1e3: past the default tolerance, within its rounding budget."""
    path = root / "rounded"
    path.mkdir(exist_ok=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
    (path / "case.py").write_text(ROUNDED.format(change=change))
    gen = torch.Generator().manual_seed(seed)
    payload.save(path / "inputs.safetensors",
                 {"a": torch.randn(64, 512, generator=gen) * 1e3,
                  "b": torch.randn(512, 64, generator=gen) * 1e3})
    return path


@pytest.mark.slow
def test_the_rounding_budget_is_kept_beside_the_reference(tmp_path: Path) -> None:
    """A run past its default tolerance computes the reference and its DRAWS draws once; the
    next run reads both, and runs only the call."""
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS + 1
    (budget,) = cache.glob("*.budget3-float32.reference")
    assert set(stored(budget)["spreads"]) == {"out"}
    # Authenticated as the reference is: another genuine entry's bytes under its name (the
    # reference's own) are refused.
    (entry,) = [p for p in cache.glob("*.reference") if p.name.count(".") == 1]
    budget.write_bytes(entry.read_bytes())
    outcome = judged(path, cache)
    assert outcome.status == "passed"
    # Refused, so the call's leaf had no budget to pass on: a fresh reference and draws.
    assert calls(path) == 1 + 1 + DRAWS + 1 + (1 + 1 + DRAWS)
    assert any("failed authentication" in note for note in outcome.notes)


@pytest.mark.slow
def test_a_budget_is_kept_beside_a_reference_too_fast_to_keep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draws cost more than reading a few numbers back: kept even where the reference is
    computed afresh each run, and written once, also by a run that keeps failing."""
    monkeypatch.setattr(reference_cache, "MIN_SECONDS", 10.0)  # no reference is kept
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS + (1 + 1)  # the call and its reference, no draws
    (budget,) = cache.glob("*")
    assert budget.name.endswith(".budget3-float32.reference")
    written = budget.stat().st_mtime_ns
    # A wrong result is judged against a fresh reference and fresh draws, never the kept ones.
    (path / "case.py").write_text(ROUNDED.format(
        change="* (1.01 if a.dtype != __import__('torch').float64 else 1.0)"))
    assert run(path, cache) == "failed"
    assert run(path, cache) == "failed"
    assert len(list(cache.glob("*.budget3-float32.reference"))) == 2  # the new code's key
    assert budget.stat().st_mtime_ns == written


@pytest.mark.slow
def test_inputs_that_cannot_be_loaded_again_for_the_draws_fail_the_run(
        tmp_path: Path) -> None:
    """The draws load the case's inputs again when they need them: a payload broken by then
    is the run's failure, told as the broken case it is, not a budget missing from a
    comparison that then fails on the default tolerance."""
    path = rounded_case(tmp_path)
    (path / "case.py").write_text(
        "import os\n\n"
        "def run(a, b):\n"
        "    if a.dtype == __import__('torch').float64:  # the reference run\n"
        "        with open(os.path.join(os.path.dirname(__file__), 'inputs.safetensors'),\n"
        "                  'wb') as handle:\n"
        "            handle.write(b'garbage')\n"
        "    return a @ b\n")
    outcome = judged(path, tmp_path / "cache")
    assert outcome.status == "failed"
    assert outcome.kind == "broken case"
    assert "inputs.safetensors" in outcome.summary and "too short" in outcome.summary


@pytest.mark.slow
def test_whatever_invalidates_the_reference_invalidates_its_budget(tmp_path: Path) -> None:
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    rounded_case(tmp_path, seed=1)  # other inputs: a new reference, and a new budget
    assert run(path, cache) == "passed"
    assert calls(path) == 2 * (1 + 1 + DRAWS)
    rounded_case(tmp_path, change="+ 0.0", seed=1)  # edited code: both again
    assert run(path, cache) == "passed"
    assert calls(path) == 3 * (1 + 1 + DRAWS)
    names = sorted(p.name.split(".", 1)[1] for p in cache.glob("*.reference"))
    assert names == ["budget3-float32.reference"] * 3 + ["reference"] * 3
    assert all(reference_cache.OWN_NAME.fullmatch(p.name) for p in cache.iterdir())
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    entry = reference_cache.Entry(tmp_path / f"{'a' * 64}.reference", f"{'a' * 64}.reference",
                                  b"secret", "rounded")
    for kind in ("budget3-float32", "baseline1-float32", "gradcheck2"):
        where = reference_cache.companion(entry, kind)
        assert where is not None and where.secret == entry.secret
        assert where.path == tmp_path / f"{'a' * 64}.{kind}.reference"
        assert where.path.name == where.name
    with pytest.raises(ValueError):
        reference_cache.companion(entry, "../x")
    assert reference_cache.key(spec, len) != reference_cache.key(
        RunSpec(load_case(path), "cpu", "bfloat16", cast=True), len)


@pytest.mark.slow
def test_a_wrong_result_never_passes_on_a_stale_budget(tmp_path: Path) -> None:
    """A cached budget may let a run pass, as a cached reference may; a failure is judged
    against a fresh reference and a fresh budget."""
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (path / "case.py").write_text(ROUNDED.format(
        change="* (1.01 if a.dtype != __import__('torch').float64 else 1.0)"))
    assert run(path, cache) == "failed"


@pytest.mark.slow
def test_a_gradcheck_pass_is_kept_beside_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "square"
    path.mkdir()
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    '[expect]\ngradients = true\n')
    (path / "case.py").write_text(CODE.replace("def ref(x):", "def run(x):").replace(
        "def run(x):\n    return x + 1\n", "").format(offset="x * x"))
    payload.save(path / "inputs.safetensors", {"x": torch.randn(4)})
    cache = tmp_path / "cache"
    assert run(path, cache) == "passed"
    first = calls(path)  # the call, the reference, and gradcheck's evaluations
    assert run(path, cache) == "passed"
    assert calls(path) == first + 1  # the call alone: reference and gradcheck pass cached
    assert len(list(cache.glob("*.gradcheck2.reference"))) == 1


def test_rows_added_in_a_child_land_where_sorting_all_of_them_puts_them() -> None:
    """A child splices the rows of what it imported into the joined rows the parent primed:
    the key must not depend on which rows were primed and which were added."""
    rng = random.Random(0)
    for _ in range(500):
        pool = list(dict.fromkeys(f"/p/{rng.choice('abxyz')}{rng.randint(0, 30)}\udcff\0"
                                  f"{rng.randint(0, 9)}" for _ in range(12)))
        rng.shuffle(pool)
        split = rng.randint(0, len(pool))
        primed = {row: row for row in pool[:split]}
        added = pool[split:split + rng.randint(0, 4)]
        made = reference_cache._Primed.made((frozenset(), primed))
        assert made.with_rows(added) == "\n".join(sorted([*primed, *added])).encode(
            errors="surrogateescape")


def test_a_module_the_parent_replaces_after_priming_is_keyed_as_loaded(tmp_path: Path) -> None:
    """The rows made before each fork follow what is loaded: a module imported after the
    session primed, then replaced (in place or imported again) or removed, is keyed by the
    file now loaded, as a key made from every loaded module is."""
    def load(name: str, file: Path) -> object:
        file.write_text("VALUE = 1\n")
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def keyed() -> bytes:
        return reference_cache._loaded_modules()

    name = "gpucase_test_replaced_module"
    saved = reference_cache._PRIMED
    try:
        reference_cache.prime()
        sys.modules[name] = load(name, tmp_path / "first.py")
        reference_cache._primed_again()
        assert str(tmp_path / "first.py").encode() in keyed()
        sys.modules[name] = load(name, tmp_path / "second.py")  # in place: same position
        reference_cache._primed_again()
        assert str(tmp_path / "second.py").encode() in keyed()
        assert str(tmp_path / "first.py").encode() not in keyed()
        del sys.modules[name]
        sys.modules[name] = load(name, tmp_path / "third.py")  # imported again: at the end
        reference_cache._primed_again()
        assert str(tmp_path / "third.py").encode() in keyed()
        del sys.modules[name]
        reference_cache._primed_again()
        assert str(tmp_path).encode() not in keyed()
        # The same bytes as rows made of every module loaded now.
        rows = reference_cache._rows(sys.modules.items(), {})
        assert keyed() == "\n".join(sorted(rows.values())).encode(errors="surrogateescape")
    finally:
        sys.modules.pop(name, None)
        reference_cache._PRIMED = saved


def test_a_reused_child_stats_a_module_its_calls_imported_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker keeps the library modules its calls imported, after the session primed: each
    is keyed by its file as first seen, with one ``stat`` while that module stays loaded (not
    one a call); a module replaced, or imported again (a case's own, each call), is keyed
    anew, by its file as it is then."""
    def load(name: str, file: Path, text: str) -> object:
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    name, first, second = "gpucase_test_kept_module", tmp_path / "first.py", tmp_path / "b.py"
    statted: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        statted.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    saved = reference_cache._PRIMED
    try:
        reference_cache.prime()
        sys.modules[name] = load(name, first, "VALUE = 1\n")
        monkeypatch.setattr(reference_cache.os, "stat", counting_stat)
        rows = reference_cache._loaded_modules()
        assert str(first).encode() in rows
        for _ in range(3):
            assert reference_cache._loaded_modules() == rows
        assert statted.count(str(first)) == 1
        first.write_text("VALUE = 22\n")  # edited on disk: the loaded module is as it was
        assert reference_cache._loaded_modules() == rows
        sys.modules[name] = load(name, first, "VALUE = 333\n")  # imported again: anew
        again = reference_cache._loaded_modules()
        assert str(first).encode() in again and again != rows
        sys.modules[name] = load(name, second, "VALUE = 1\n")  # another file under the name
        replaced = reference_cache._loaded_modules()
        assert str(second).encode() in replaced and str(first).encode() not in replaced
        del sys.modules[name]
        assert str(tmp_path).encode() not in reference_cache._loaded_modules()
    finally:
        monkeypatch.undo()
        sys.modules.pop(name, None)
        reference_cache._PRIMED = saved


@pytest.mark.slow
def test_a_fresh_checkout_reuses_the_budget_by_content(tmp_path: Path) -> None:
    """A CI job checks the project out afresh (every file new: other inodes and times) and
    restores the cache folder: the reference, keyed by those, is computed again, but the
    rounding budget, named by content, is read back with the same key; with another key
    (a fresh home's), or tampered with, it is computed again and never trusted."""
    import shutil

    (tmp_path / "first").mkdir()
    path, cache = rounded_case(tmp_path / "first"), tmp_path / "cache"
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS
    checkout = tmp_path / "second" / "rounded"
    shutil.copytree(path, checkout)
    (checkout / "calls").unlink()
    assert run(checkout, cache) == "passed"
    assert calls(checkout) == 1 + 1  # the call and a fresh reference: no draws
    other = judged(checkout, cache, key="another")
    assert other.status == "passed"
    assert calls(checkout) == 1 + 1 + (1 + 1 + DRAWS)
    assert any("failed authentication" in note for note in other.notes)
    (budget,) = cache.glob("*.budget3-float32.reference")
    data = bytearray(budget.read_bytes())
    data[-1] ^= 1
    budget.write_bytes(bytes(data))
    tampered = judged(checkout, cache, key="another")
    assert tampered.status == "passed"
    assert any("failed authentication" in note for note in tampered.notes)


LAZY_CODE = '''
import importlib.util
import os
import sys


def _lazy(name):
    """``name`` imported lazily (``importlib.util.LazyLoader``): loaded at its first use."""
    file = os.path.join(os.path.dirname(__file__), name + ".py")
    spec = importlib.util.spec_from_file_location(name, file)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


helper = _lazy("gpucase_lazy_helper")  # never used by the call: still lazy at the key


def run(x):
    return x + 1
'''


@pytest.mark.slow
def test_a_module_loaded_lazily_is_keyed_without_failing_the_run(tmp_path: Path) -> None:
    """A module imported with ``importlib.util.LazyLoader`` loads at its first attribute read,
    the key's ``__file__`` included, and its own imports add to ``sys.modules`` then: the
    key must not be reading ``sys.modules`` as they do (a RuntimeError failing the run)."""
    path = tmp_path / "lazy"
    path.mkdir()
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
    (path / "case.py").write_text(LAZY_CODE)
    (path / "gpucase_lazy_helper.py").write_text("import colorsys\nimport wave\n")
    payload.save(path / "inputs.safetensors", {"x": torch.ones(4)})
    saved = reference_cache._PRIMED
    try:
        for primed in (True, False):  # a session primes before its first fork
            if primed:
                reference_cache.prime()
            else:
                reference_cache._PRIMED = None
            outcome = judged(path, tmp_path / "cache")
            assert outcome.status == "passed", outcome.details
    finally:
        reference_cache._PRIMED = saved

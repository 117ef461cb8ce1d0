"""The float64 reference: computed once per case and variant, recomputed when anything it
depends on changes, and never trusted for a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import golden
from pytest_gpucase.case import payload
from pytest_gpucase.run import reference_cache
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.parent import run_spec
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
    path.mkdir(exist_ok=True)
    (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    'reference = "case.py:ref"\n')
    (path / "case.py").write_text(CODE.format(offset=offset))
    payload.save(path / "inputs.safetensors", {"x": torch.ones(4)})
    return path


def run(path: Path, cache: Path, device: str = "cpu") -> str:
    spec = RunSpec(load_case(path), device, "float32", cast=False)
    verdict = run_spec(spec, start_method="fork", backend="cpu", reference_cache=cache)
    return verdict.outcome.status


def calls(path: Path) -> int:
    file = path / "calls"
    return len(file.read_text()) if file.exists() else 0


def test_the_reference_is_computed_once_and_reused(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert [run(path, cache) for _ in range(3)] == ["passed"] * 3
    assert calls(path) == 1
    assert len(list(cache.glob("*.safetensors"))) == 1


def test_a_cast_dtype_is_a_reference_of_its_own(tmp_path: Path) -> None:
    case = load_case(make(tmp_path))
    saved = RunSpec(case, "cpu", "float32", cast=False)
    cast = RunSpec(case, "cpu", "bfloat16", cast=True)
    assert reference_cache.key(saved, len) != reference_cache.key(cast, len)


def test_changed_inputs_invalidate_it(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    payload.save(path / "inputs.safetensors", {"x": torch.full((4,), 2.0)})
    assert run(path, cache) == "passed"
    assert calls(path) == 2


def test_a_changed_reference_function_invalidates_it(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    make(tmp_path, offset=2)  # the reference now disagrees with the call
    assert run(path, cache) == "failed"
    # Computed again (not read from the cache), and run DRAWS more times for the rounding
    # budget that the failing leaf asks for before it is reported.
    assert calls(path) == 2 + DRAWS


def test_a_failure_never_rests_on_the_cache(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (entry,) = cache.glob("*.safetensors")
    golden.save(entry, {"out": torch.zeros(4, dtype=torch.float64)})  # a wrong cached value
    assert run(path, cache) == "passed"  # recomputed before any failure is reported
    assert calls(path) == 2
    assert torch.equal(golden.load(entry)["out"], torch.full((4,), 2.0, dtype=torch.float64))


def test_without_a_cache_folder_nothing_is_written(tmp_path: Path) -> None:
    path = make(tmp_path)
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    assert run_spec(spec, start_method="fork", backend="cpu").outcome.status == "passed"
    assert reference_cache.CACHE_ENV not in os.environ
    assert calls(path) == 1


def test_a_fast_reference_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The threshold, not the machine's speed, decides: an unsleeping reference took over 5 ms
    # on a loaded 2-core runner. (The forked child inherits the patched module.)
    monkeypatch.setattr(reference_cache, "MIN_SECONDS", 10.0)
    path, cache = make(tmp_path), tmp_path / "cache"
    (path / "case.py").write_text((path / "case.py").read_text().replace("time.sleep(0.02)",
                                                                         "pass"))
    assert [run(path, cache) for _ in range(2)] == ["passed"] * 2
    assert calls(path) == 2
    assert not list(cache.glob("*.safetensors"))


def _aged(folder: Path, name: str, size: int, days_ago: float, now: float) -> Path:
    path = folder / name
    path.write_bytes(b"x" * size)
    os.utime(path, (now - days_ago * 86400,) * 2)
    return path


def test_prune_drops_unused_entries_then_the_least_recently_used(tmp_path: Path) -> None:
    now = 2_000_000_000.0
    stale = _aged(tmp_path, "stale.safetensors", 10, 30, now)
    older = _aged(tmp_path, "older.safetensors", 100, 2, now)
    newer = _aged(tmp_path, "newer.safetensors", 100, 1, now)
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=1000, now=now) == 1
    assert not stale.exists() and older.exists() and newer.exists()
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=150, now=now) == 1
    assert not older.exists() and newer.exists()  # over the size: the oldest goes first
    assert reference_cache.prune(tmp_path / "absent", now=now) == 0


def test_prune_spares_writes_in_progress_and_survives_what_it_cannot_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = 2_000_000_000.0
    writing = _aged(tmp_path, ".abc.safetensors.host.1.ff.tmp", 500, 0.01, now)
    kept = _aged(tmp_path, "kept.safetensors", 10, 30, now)
    real_unlink = os.unlink

    def refused(path: str) -> None:
        if path.endswith("kept.safetensors"):
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", refused)
    assert reference_cache.prune(tmp_path, keep_days=14, max_bytes=100, now=now) == 0
    assert writing.exists() and kept.exists()


def test_a_cache_hit_marks_the_entry_used(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (entry,) = cache.glob("*.safetensors")
    os.utime(entry, (1.0, 1.0))  # looks unused for decades
    assert run(path, cache) == "passed"
    assert calls(path) == 1  # read back, not recomputed
    assert reference_cache.prune(cache) == 0 and entry.exists()


def test_the_session_prunes_the_folder_it_used(pytester: pytest.Pytester) -> None:
    (pytester.path / "cases").mkdir()
    make(pytester.path / "cases")
    cache = pytester.path / ".pytest_cache" / "d" / "gpucase-references"
    cache.mkdir(parents=True)
    forgotten = cache / "0123.safetensors"
    forgotten.write_bytes(b"old")
    os.utime(forgotten, (1.0, 1.0))
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert not forgotten.exists()
    assert len(list(cache.glob("*.safetensors"))) == 1  # this run's entry stays


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


def test_a_zero_tensor_reference_is_cached_by_its_values(tmp_path: Path) -> None:
    # A zero tensor has no memory to read: caching it once crashed the child (SIGSEGV).
    path, cache = make(tmp_path), tmp_path / "cache"
    (path / "case.py").write_text(
        CODE.format(offset=0).replace("def run(x):\n    return x + 1",
                                      "def run(x):\n    return x * 0")
        .replace("return x + 0", "import torch\n    return torch._efficientzerotensor(4)"))
    assert [run(path, cache) for _ in range(2)] == ["passed"] * 2
    assert calls(path) == 1  # cached, then read back
    (entry,) = cache.glob("*.safetensors")
    assert torch.equal(golden.load(entry)["out"], torch.zeros(4))


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


def test_the_rounding_budget_is_kept_beside_the_reference(tmp_path: Path) -> None:
    """A run past its default tolerance computes the reference and its DRAWS draws once; the
    next run reads both, and runs only the call."""
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS
    assert run(path, cache) == "passed"
    assert calls(path) == 1 + 1 + DRAWS + 1
    (entry,) = [p for p in cache.glob("*.safetensors") if p.name.count(".") == 1]
    budget = reference_cache.companion(entry, "budget1-float32")
    assert budget is not None and budget.exists()
    assert set(golden.load(budget)["spreads"]) == {"out"}


def test_whatever_invalidates_the_reference_invalidates_its_budget(tmp_path: Path) -> None:
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    rounded_case(tmp_path, seed=1)  # other inputs: a new reference, and a new budget
    assert run(path, cache) == "passed"
    assert calls(path) == 2 * (1 + 1 + DRAWS)
    rounded_case(tmp_path, change="+ 0.0", seed=1)  # edited code: both again
    assert run(path, cache) == "passed"
    assert calls(path) == 3 * (1 + 1 + DRAWS)
    names = sorted(p.name.split(".", 1)[1] for p in cache.glob("*.safetensors"))
    assert names == ["budget1-float32.safetensors"] * 3 + ["safetensors"] * 3
    spec = RunSpec(load_case(path), "cpu", "float32", cast=False)
    for kind in ("budget1-float32", "baseline1-float32", "gradcheck1"):
        where = reference_cache.companion(tmp_path / "x.safetensors", kind)
        assert where == tmp_path / f"x.{kind}.safetensors"
    assert reference_cache.key(spec, len) != reference_cache.key(
        RunSpec(load_case(path), "cpu", "bfloat16", cast=True), len)


def test_a_wrong_result_never_passes_on_a_stale_budget(tmp_path: Path) -> None:
    """A cached budget may let a run pass, as a cached reference may; a failure is judged
    against a fresh reference and a fresh budget."""
    path, cache = rounded_case(tmp_path), tmp_path / "cache"
    assert run(path, cache) == "passed"
    (path / "case.py").write_text(ROUNDED.format(
        change="* (1.01 if a.dtype != __import__('torch').float64 else 1.0)"))
    assert run(path, cache) == "failed"


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
    assert len(list(cache.glob("*.gradcheck1.safetensors"))) == 1

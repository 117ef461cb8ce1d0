"""The float64 reference: computed once per case and variant, recomputed when anything it
depends on changes, and never trusted for a failure."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pytest_gpucase import golden, payload, reference_cache
from pytest_gpucase.case import load_case
from pytest_gpucase.matrix import RunSpec
from pytest_gpucase.runner import run_spec

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
    assert calls(path) == 2


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


def test_a_fast_reference_is_not_cached(tmp_path: Path) -> None:
    path, cache = make(tmp_path), tmp_path / "cache"
    (path / "case.py").write_text((path / "case.py").read_text().replace("time.sleep(0.02)",
                                                                         "pass"))
    assert [run(path, cache) for _ in range(2)] == ["passed"] * 2
    assert calls(path) == 2
    assert not list(cache.glob("*.safetensors"))

"""One GPU per xdist worker, as a pure decision on plain data."""

from __future__ import annotations

import pytest

from pytest_gpucase.plan.pinning import pin_env, visible_devices, worker_index


def test_worker_index() -> None:
    assert worker_index("gw0") == 0
    assert worker_index("gw12") == 12
    assert worker_index(None) is None
    assert worker_index("master") is None


def test_round_robin_over_all_devices() -> None:
    pins = [pin_env(f"gw{i}", "cuda", 4, {}) for i in range(6)]
    assert [p["CUDA_VISIBLE_DEVICES"] for p in pins] == ["0", "1", "2", "3", "0", "1"]


def test_more_workers_than_devices_do_not_pile_on_device_zero() -> None:
    pins = [pin_env(f"gw{i}", "cuda", 2, {})["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert pins.count("0") == 2 and pins.count("1") == 2


def test_outer_subset_is_respected_by_id() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "2,3"}
    pins = [pin_env(f"gw{i}", "cuda", 2, environ)["CUDA_VISIBLE_DEVICES"] for i in range(3)]
    assert pins == ["2", "3", "2"]


def test_outer_subset_by_uuid() -> None:
    uuids = "GPU-8c1e6c4b-aaaa,GPU-1f0d2b7e-bbbb"
    pin = pin_env("gw1", "cuda", 2, {"CUDA_VISIBLE_DEVICES": uuids})
    assert pin == {"CUDA_VISIBLE_DEVICES": "GPU-1f0d2b7e-bbbb"}


def test_rocm_uses_hip_variable_inside_the_rocr_subset() -> None:
    environ = {"ROCR_VISIBLE_DEVICES": "4,5"}
    assert pin_env("gw1", "rocm", 2, environ) == {"HIP_VISIBLE_DEVICES": "1"}
    assert pin_env("gw1", "rocm", 2, {"HIP_VISIBLE_DEVICES": "6,7"}) == {"HIP_VISIBLE_DEVICES": "7"}


@pytest.mark.parametrize("backend", ["cpu", "mps", "xpu"])
def test_nothing_to_pin_without_cuda_or_rocm(backend: str) -> None:
    assert pin_env("gw0", backend, 1, {}) == {}


def test_no_pin_outside_xdist_or_without_devices() -> None:
    assert pin_env(None, "cuda", 4, {}) == {}
    assert pin_env("gw0", "cuda", 0, {}) == {}


def test_entries_past_the_visible_count_are_not_used() -> None:
    # CUDA stops at the first invalid entry: only device_count of them are visible.
    assert visible_devices("cuda", 1, {"CUDA_VISIBLE_DEVICES": "1,bogus,2"}) == ["1"]

"""One GPU per pytest-xdist worker: which device a worker's children may see.

Hand-made pinning in public projects often gets three things wrong: it ignores
an outer ``CUDA_VISIBLE_DEVICES`` (and pins a device the job was not given),
it sets the variable after something already initialized the device, and it
piles every worker onto device 0 when there are more workers than devices.
Here the outer list is respected (ids or UUIDs, kept as written), workers are
assigned round-robin over it, and the variable only goes into the environment
of each run's child, before anything in the child touches the device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pytest_gpucase.base.backends import visible_variable

__all__ = ["pin_env", "visible_devices", "worker_index"]


def worker_index(worker_id: str | None) -> int | None:
    """``gw3`` -> 3; None outside xdist."""
    if worker_id is None:
        return None
    found = re.fullmatch(r"gw(\d+)", worker_id)
    return int(found[1]) if found else None


def visible_devices(backend: str, device_count: int, environ: Mapping[str, str]) -> list[str]:
    """The device ids a worker may be pinned to, in the terms of the outer environment."""
    variable = visible_variable(backend)
    if variable is None:
        return []
    outer = environ.get(variable)
    if outer is not None and outer.strip():
        ids = [part.strip() for part in outer.split(",") if part.strip()]
        # The runtime stops at the first invalid entry; only what it shows is usable.
        return ids[:device_count] if device_count else ids
    # ROCR_VISIBLE_DEVICES (or no variable at all): HIP numbers what it sees from 0.
    return [str(index) for index in range(device_count)]


def pin_env(worker_id: str | None, backend: str, device_count: int,
            environ: Mapping[str, str]) -> dict[str, str]:
    """The variable that gives this worker's children one device, round-robin; {} if none."""
    index = worker_index(worker_id)
    devices = visible_devices(backend, device_count, environ)
    variable = visible_variable(backend)
    if index is None or not devices or variable is None:
        return {}
    return {variable: devices[index % len(devices)]}

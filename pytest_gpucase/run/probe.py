"""The environment probed in a child, so that the pytest process never touches the device.

Apart from ``parent`` on purpose: collection probes the environment, and must not import
what a run needs (the child's side, the comparator).
"""

from __future__ import annotations

from collections.abc import Iterable

from pytest_gpucase.plan.environment import Environment, probe_here

__all__ = ["probe"]


def probe(packages: Iterable[str] = (), rootdir: str | None = None) -> Environment:
    """Take the snapshot in a child process, so that this process never touches the device."""
    from pytest_gpucase.run.isolation import default_start_method, run_in_child

    result = run_in_child(probe_here, tuple(packages), rootdir, timeout=120,
                          start_method=default_start_method())
    if not result.returned:
        detail = result.child_error or result.stderr[-2000:]
        raise RuntimeError(f"gpucase: probing the environment {result.problem}:\n{detail}")
    env: Environment = result.value
    return env

"""What ordinary tests use: the ``gpu_case``, ``gpu_device`` and ``gpu_dtype`` fixtures, the
``gpu_requires`` marker read as requirements, and the parametrization over devices and dtypes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpucase.plugin.items import skip_here
from pytest_gpucase.plugin.state import GpuCaseSession, session_key

if TYPE_CHECKING:
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.run.parent import Verdict

__all__ = [
    "BadMarker", "GpuCaseHandle", "bad_marker_key", "gpu_case", "gpu_device", "gpu_dtype",
    "parametrize", "requirements_from_marker",
]


class BadMarker(Exception):
    """A ``gpu_requires`` marker that cannot be read: the test it marks errors, alone."""


# The markers a test could not be given, by item: its setup raises the reason.
bad_marker_key = pytest.StashKey[str]()


def requirements_from_marker(where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``@pytest.mark.gpu_requires(...)`` as ``Requirements``; a mistake raises ``BadMarker``."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from pytest_gpucase.base.backends import BACKENDS
    from pytest_gpucase.case.model import VERSION_KEYS, Requirements

    if args:
        raise BadMarker(f"{where}: gpu_requires takes keyword arguments only, got {args[0]!r}; "
                        f"write it like gpu_requires(torch='>=2.1', backends=['cuda'])")
    unknown = sorted(set(kwargs) - {"backends", "packages", *VERSION_KEYS})
    if unknown:
        raise BadMarker(f"{where}: gpu_requires: unknown argument {unknown[0]!r}; "
                        f"expected backends, packages, {', '.join(VERSION_KEYS)}")
    specs = {key: kwargs[key] for key in VERSION_KEYS if kwargs.get(key) is not None}
    given = kwargs.get("packages") or {}
    if not (isinstance(given, Mapping)
            and all(isinstance(name, str) and name.strip() for name in given)):
        raise BadMarker(f"{where}: gpu_requires: packages={given!r} is not a dict of package "
                        "names to specifiers; write it like packages={'flash-attn': '>=2.5'}")
    packages = dict(given)
    for key, value in [*specs.items(), *packages.items()]:
        try:
            if value:
                SpecifierSet(value)
        except (InvalidSpecifier, TypeError):
            raise BadMarker(f"{where}: gpu_requires: {key}={value!r} is not a PEP 440 "
                            "specifier; write it like '>=2.1'") from None
    backends = kwargs.get("backends")
    if backends is not None:
        if not (isinstance(backends, str) or (isinstance(backends, (list, tuple)) and backends)):
            raise BadMarker(f"{where}: gpu_requires: backends={backends!r} is not a backend or "
                            "a non-empty list of them; write it like backends=['cuda', 'rocm']")
        backends = (backends,) if isinstance(backends, str) else tuple(backends)
        for backend in backends:
            if backend not in BACKENDS:
                raise BadMarker(f"{where}: gpu_requires: unknown backend {backend!r}; "
                                f"expected one of {', '.join(BACKENDS)}")
    return Requirements(backends=backends, versions=specs, packages=packages)


class GpuCaseHandle:
    """What the ``gpu_case`` fixture gives a hand-written test: the case, its inputs, its runs."""

    def __init__(self, case: Case, state: GpuCaseSession, item: pytest.Item | None = None) -> None:
        self.case = case
        self._state = state
        self._item = item   # the test: its pytest_gpucase_run_env hook reaches every run

    def inputs(self, device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
        """The case's keyword arguments in this process, on ``device``, floats cast to ``dtype``."""
        from pytest_gpucase.run.child import load_inputs, prepare

        return prepare(load_inputs(self.case), device, dtype)

    def run(self, device: str = "cpu", dtype: str | None = None,
            launch_blocking: bool = False) -> Verdict:
        """Run the case once in a fresh child and return the verdict (a failure does not raise).

        A run that cannot happen here skips the test, with the reason ``pytest --gpu-cases``
        gives its items: a ``[matrix]`` requirement this environment does not meet
        (``requires tinyext>=2.0; found 1.0``) or a device type it lacks (``no CUDA device
        here``). A skipped verdict would have passed ``assert not verdict.failed`` with
        nothing run.
        """
        from pytest_gpucase.plan.runs import run_skip, single_run
        from pytest_gpucase.run.parent import incomplete_pass, run_spec

        env = self._state.environment(tuple(self.case.matrix.packages))
        reason = run_skip(self.case.matrix, env, device.split(":")[0])
        if reason is not None:
            raise skip_here(reason)
        spec = single_run(self.case, env, device, dtype, launch_blocking=launch_blocking)
        return incomplete_pass(run_spec(spec, replace(self._state.run_context(self._item),
                                                      localize=False)))


@pytest.fixture
def gpu_device(request: pytest.FixtureRequest) -> str:
    """A device type this test runs on: each available type (others skipped with a reason).

    The test runs in the pytest process: a CUDA test initializes CUDA here, and
    later case runs then start fresh interpreters instead of forks.
    """
    return str(request.param)


@pytest.fixture
def gpu_dtype(request: pytest.FixtureRequest) -> Any:
    """A ``torch.dtype`` from ``--gpu-dtypes`` (default float32)."""
    import torch

    return getattr(torch, request.param)


@pytest.fixture
def gpu_case(request: pytest.FixtureRequest) -> GpuCaseHandle:
    """The case named by ``@pytest.mark.gpu_case("path/to/case")``, relative to the rootdir."""
    from pytest_gpucase.base.errors import CaseFormatError
    from pytest_gpucase.case.load import load_case

    marker = request.node.get_closest_marker("gpu_case")
    if marker is None or not marker.args:
        pytest.fail(f"{request.node.nodeid}: the gpu_case fixture needs the case folder: "
                    "mark the test @pytest.mark.gpu_case(\"cases/NAME\")", pytrace=False)
    path = Path(marker.args[0])
    if not path.is_absolute():
        path = request.config.rootpath / path
    try:
        case = load_case(path)
    except CaseFormatError as exc:
        pytest.fail(str(exc), pytrace=False)
    return GpuCaseHandle(case, request.config.stash[session_key], request.node)


def parametrize(metafunc: pytest.Metafunc) -> None:
    """Parametrize the ``gpu_device`` and ``gpu_dtype`` fixtures of a test."""
    wants_device = "gpu_device" in metafunc.fixturenames
    if wants_device:
        from pytest_gpucase.plan.runs import device_list, device_skip

        env = metafunc.config.stash[session_key].environment()
        asked = metafunc.config.stash[session_key].settings.gpu_devices
        params = []
        for device in device_list(env, asked=asked):
            reason = device_skip(device, env)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(device, marks=marks, id=device))
        metafunc.parametrize("gpu_device", params, indirect=True)
    if "gpu_dtype" in metafunc.fixturenames:
        dtypes = metafunc.config.stash[session_key].settings.gpu_dtypes or ("float32",)
        metafunc.parametrize("gpu_dtype", list(dtypes), indirect=True)

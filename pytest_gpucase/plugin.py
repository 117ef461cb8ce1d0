"""pytest hooks for gpucase: options, markers, collection of case directories, fixtures.

Kept thin and light: nothing here imports torch at module level, so a plain
``pytest`` run that uses no case pays nothing. The engine is imported lazily.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .case import Case
    from .environment import Environment
    from .execute import Outcome
    from .isolation import StartMethod
    from .matrix import RunSpec
    from .runner import Verdict


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpucase", "saved GPU failure cases")
    group.addoption("--gpu-cases", action="store_true",
                    help="collect case directories (with a case.toml) and replay each run "
                         "in a fresh child process")
    group.addoption("--gpu-launch-blocking", action="store_true",
                    help="run device items with the backend's launch-blocking variable "
                         "(CUDA_LAUNCH_BLOCKING=1, AMD_SERIALIZE_KERNEL=3); never for timing")
    group.addoption("--gpu-devices", metavar="TYPES", type=_device_list,
                    help="only these device types, e.g. cuda,cpu (narrows each case's list)")
    group.addoption("--gpu-dtypes", metavar="DTYPES", type=_dtype_list,
                    help="only these dtypes, e.g. float32,bfloat16 (narrows each case's list)")
    group.addoption("--gpu-no-localize", action="store_true",
                    help="do not rerun an asynchronous device error with launch blocking")
    group.addoption("--gpu-cases-regen", action="store_true",
                    help="write or rewrite each case's expected.safetensors from its reference "
                         "run, and list the files written")
    group.addoption("--gpu-cases-report", metavar="PATH", type=Path,
                    help="write the run's results (environment and every item) as JSON here")
    group.addoption("--gpu-ablate", action="store_true",
                    help="rerun each failing item under one change at a time (CPU, float32, "
                         "float64, TF32 off, cuDNN off, ...) and report which make it pass")
    group.addoption("--gpu-per-worker", action="store_true",
                    help="under pytest-xdist, give each worker's runs one device of the visible "
                         "ones, round-robin (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    group.addoption("--gpu-start-method", choices=("auto", "fork", "spawn"), default="auto",
                    help="how each run's child starts: auto (fork, or spawn when CUDA is "
                         "already initialized in the pytest process), fork, spawn")


def _csv(value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    import argparse

    names = tuple(part.strip() for part in value.split(",") if part.strip())
    for name in names:
        if name not in known:
            # A typo would otherwise narrow every case to nothing, without a word.
            raise argparse.ArgumentTypeError(f"unknown {name!r}; expected one of "
                                             f"{', '.join(known)}")
    return names


def _device_list(value: str) -> tuple[str, ...]:
    from .case import DEVICE_TYPES

    return _csv(value, DEVICE_TYPES)


def _dtype_list(value: str) -> tuple[str, ...]:
    from .case import FLOAT_DTYPES

    return _csv(value, FLOAT_DTYPES)


@dataclass
class GpuCaseSession:
    """The plugin's state for one pytest session."""

    config: pytest.Config
    _env: Environment | None = None
    notes: list[str] = field(default_factory=list)
    regenerated: dict[Path, str | None] = field(default_factory=dict)  # case dir -> file or None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)   # nodeid -> JSON record
    _written_at: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.config.getoption("gpu_cases"))

    def environment(self, packages: tuple[str, ...] = ()) -> Environment:
        """The session's environment snapshot, probed in a child on first use."""
        from .environment import package_version, probe

        if self._env is None:
            from ._torch import import_torch

            import_torch()  # imported once here so that every forked child shares it

            self._env = probe(rootdir=str(self.config.rootpath))
        missing = [name for name in packages if name not in self._env.packages]
        if missing:
            found = {name: package_version(name) for name in missing}
            self._env = replace(self._env, packages={**self._env.packages, **found})
        return self._env

    def regenerate(self, case: Case) -> None:
        """Write the case's golden once per session (the first of its items asks)."""
        from .runner import regenerate_golden

        if case.path in self.regenerated:
            return
        self.regenerated[case.path] = None
        child = regenerate_golden(case, start_method=self.start_method())
        if not child.returned:
            detail = child.child_error or child.stderr[-2000:]
            from .errors import display

            pytest.fail(f"{display(case.case_file)}: writing {case.expected_file.name} failed: "
                        f"{child.problem}\n{detail}", pytrace=False)
        self.regenerated[case.path] = child.value

    def record(self, report: pytest.TestReport) -> None:
        """Keep the JSON record of a finished item; rewrite the report file now and then."""
        import time

        record = result_record(report)
        if record is None:
            return
        self.results[report.nodeid] = record
        if time.monotonic() - self._written_at > REPORT_EVERY:
            self.write_report(complete=False)

    def build_report(self, *, complete: bool) -> dict[str, Any]:
        """The JSON report of what has finished so far."""
        from .report import new_report

        report = new_report(self.environment().to_dict())
        report["results"] = list(self.results.values())
        report["complete"] = complete
        return report

    def write_report(self, *, complete: bool) -> None:
        """Rewrite the JSON report atomically, so a crash or Ctrl-C leaves what finished."""
        import time

        path: Path | None = self.config.getoption("gpu_cases_report")
        if path is not None:
            from .report import write_report

            write_report(path, self.build_report(complete=complete))
            self._written_at = time.monotonic()

    def worker_env(self) -> dict[str, str]:
        """The device pin of this xdist worker's children (``--gpu-per-worker``), or {}."""
        import os

        from .pinning import pin_env

        if not self.config.getoption("gpu_per_worker"):
            return {}
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        env = self.environment()
        return pin_env(worker, env.backend, len(env.devices), os.environ)

    def start_method(self) -> StartMethod:
        from .isolation import default_start_method

        chosen: str = self.config.getoption("gpu_start_method")
        if chosen != "auto":
            return chosen  # type: ignore[return-value]
        method = default_start_method()
        note = ("CUDA was initialized in the pytest process, so each run starts a fresh "
                "interpreter (spawn) instead of a fork: every run pays for importing torch again")
        if method == "spawn" and note not in self.notes:
            self.notes.append(note)
        return method


REPORT_EVERY = 2.0  # seconds between incremental rewrites of the JSON report
session_key = pytest.StashKey[GpuCaseSession]()


def pytest_configure(config: pytest.Config) -> None:
    state = GpuCaseSession(config)
    config.stash[session_key] = state
    if state.enabled:
        from ._torch import import_torch

        import_torch()  # before any engine module imports it, and before anything can fork
    if state.enabled and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(state), "gpucase-recorder")
    if state.enabled and config.getoption("forked", False):
        # Registered after pytest-forked (an entry point), so called before its tryfirst hook.
        config.pluginmanager.register(_OwnIsolation(), "gpucase-own-isolation")
    config.addinivalue_line(
        "markers", "gpu_case(path): give the gpu_case fixture the case directory at path")
    for device in ("cpu", "cuda", "mps", "xpu"):
        config.addinivalue_line("markers", f"device_{device}: a gpucase run on {device}")
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        config.addinivalue_line("markers", f"dtype_{dtype}: a gpucase run in {dtype}")
    for kind in ("batch", "length", "boundary"):
        config.addinivalue_line("markers", f"variant_{kind}: a gpucase {kind} edge variant")
    for backend in ("cuda", "rocm", "cpu", "mps", "xpu"):
        config.addinivalue_line("markers", f"backend_{backend}: a gpucase run on the {backend} "
                                "backend")
    config.addinivalue_line(
        "markers", "gpu_requires(backends=None, torch=None, python=None, cuda=None, hip=None, "
        "capability=None, packages=None): skip unless this environment meets the requirements, "
        "written as in a case's [matrix]")


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash[session_key]
    if not state.enabled:
        return None
    return state.environment().header()


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if not parent.config.stash[session_key].enabled or path.name.startswith("."):
        return None  # hidden: a recorder's unfinished write, never a case
    from .case import is_case_dir

    if is_case_dir(path):
        return CaseDirectory.from_parent(parent, path=path)
    return None


class CaseDirectory(pytest.Directory):
    """A case directory: one item per run (device x dtype x variant)."""

    def collect(self) -> Iterator[pytest.Item]:
        from .case import load_case
        from .errors import CaseFormatError
        from .matrix import expand, saved_dtype

        state = self.config.stash[session_key]
        try:
            case = load_case(self.path)
            # The saved dtype names the items only when [matrix] dtypes does not.
            saved = None if case.matrix.dtypes else saved_dtype(case)
            specs = expand(
                case, state.environment(tuple(case.matrix.packages)),
                saved_dtype=saved,
                devices=self.config.getoption("gpu_devices"),
                dtypes=self.config.getoption("gpu_dtypes"),
                launch_blocking=self.config.getoption("gpu_launch_blocking"),
            )
        except CaseFormatError as exc:
            yield BrokenCaseItem.from_parent(self, name=self.path.name, problem=str(exc))
            return
        pin = state.worker_env()
        # torch.cuda is CUDA on NVIDIA builds and HIP on ROCm builds.
        cuda_backend = "rocm" if state.environment().backend == "rocm" else "cuda"
        for spec in specs:
            if pin and spec.device != "cpu":
                spec = replace(spec, env={**spec.env, **pin})
            item = CaseItem.from_parent(self, name=f"{case.name}[{spec.id}]", spec=spec)
            item.add_marker(f"backend_{cuda_backend if spec.device == 'cuda' else spec.device}")
            yield item


class BrokenCaseItem(pytest.Item):
    """A case that cannot be loaded: one failing item, so that the other cases still run."""

    def __init__(self, *, problem: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.problem = problem

    def runtest(self) -> None:
        raise CaseFileError(self.problem)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, CaseFileError):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path / "case.toml", 0, f"{self.name} (broken case)"


class CaseFileError(Exception):
    """A case file that cannot be loaded (shown without a traceback)."""


class CaseRunFailed(Exception):
    """A run of a case whose verdict is failed."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.outcome.summary)
        self.verdict = verdict


class KnownFailure(CaseRunFailed):
    """The failure a case's ``xfail`` describes (the one in ``[origin] error``, if named)."""


def is_known_failure(case: Case, verdict: Verdict) -> bool:
    """Whether a failed run is the case's known failure, not a broken case or another error."""
    import re

    outcome = verdict.outcome
    if outcome.broken_case:
        return False
    recorded = re.match(r"([A-Za-z_][\w.]*)(?::|$)", str(case.origin.get("error", "")))
    if recorded is None or outcome.error_type is None:
        return True  # nothing to tell them apart by: a mismatch, or no recorded type
    return recorded[1].rsplit(".", 1)[-1] == outcome.error_type


class CaseItem(pytest.Item):
    """One run of a case, executed in a fresh child process."""

    def __init__(self, *, spec: RunSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.add_marker(f"device_{spec.device}")
        if spec.dtype in ("float16", "bfloat16", "float32", "float64"):
            self.add_marker(f"dtype_{spec.dtype}")
        if spec.variant is not None:
            self.add_marker(f"variant_{spec.variant.kind}")
        self.user_properties.append(("gpucase", spec_fields(spec)))
        if spec.skip is not None:
            self.add_marker(pytest.mark.skip(reason=spec.skip))
        elif spec.case.xfail is not None:
            # Only the known failure counts as xfailed; any other failure is a failure.
            self.add_marker(pytest.mark.xfail(reason=spec.case.xfail, strict=True,
                                              raises=KnownFailure))

    def runtest(self) -> None:
        from .runner import run_spec

        state = self.config.stash[session_key]
        if (self.config.getoption("gpu_cases_regen") and self.spec.variant is None
                and self.spec.case.expect.outcome == "matches"):
            state.regenerate(self.spec.case)
        verdict = run_spec(self.spec, start_method=state.start_method(),
                           backend=state.environment().backend,
                           localize=not self.config.getoption("gpu_no_localize"))
        fields = verdict_fields(verdict)
        _add_sections(self, verdict)
        _reissue_warnings(verdict)
        if verdict.failed and self.config.getoption("gpu_ablate"):
            from .ablate import ablate

            found = ablate(self.spec.case, device=self.spec.device, dtype=self.spec.dtype,
                           env=state.environment(), start_method=state.start_method(),
                           variant=self.spec.variant)
            self.add_report_section("call", "gpucase ablation", found.render())
            fields["ablation"] = found.to_dict()
        self.user_properties.append(("gpucase_result", fields))
        if verdict.outcome.status == "skipped":
            pytest.skip(verdict.outcome.summary)
        if verdict.failed:
            if self.spec.case.xfail is not None and is_known_failure(self.spec.case, verdict):
                raise KnownFailure(verdict)
            raise CaseRunFailed(verdict)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, CaseRunFailed):
            return _failure_text(excinfo.value.verdict.outcome)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.spec.case.case_file, 0, self.name


def _failure_text(outcome: Outcome) -> str:
    text = outcome.summary
    if outcome.details:
        text += "\n\n" + outcome.details.rstrip()
    return text


def _add_sections(item: pytest.Item, verdict: Verdict) -> None:
    from .runner import describe_rerun, describe_warnings, stderr_section

    child = verdict.child
    if child.stdout:
        item.add_report_section("call", "stdout (child)", child.stdout)
    stderr = stderr_section(verdict)
    if stderr:
        item.add_report_section("call", "stderr (child)", stderr)
    if child.warnings:
        item.add_report_section("call", "warnings (child)", describe_warnings(child))
    if verdict.triage is not None:
        item.add_report_section("call", "gpucase triage", verdict.triage.render())
    if verdict.localized is not None:
        item.add_report_section("call", "gpucase launch-blocking rerun", describe_rerun(verdict))


def _reissue_warnings(verdict: Verdict) -> None:
    """The child's warnings, raised again in the item for pytest's warning summary.

    Under ``-W error`` they fail a passing item; a failed one keeps its own failure.
    """
    import contextlib

    from .runner import reissue_warnings

    if verdict.failed:
        with contextlib.suppress(Warning):
            reissue_warnings(verdict.child.warnings)
    else:
        reissue_warnings(verdict.child.warnings)


def spec_fields(spec: RunSpec) -> dict[str, Any]:
    """What the JSON report says of an item before it runs (set at collection)."""
    return {
        "case": spec.case.name,
        "case_path": _relative(spec.case.path),
        "device": spec.device,
        "dtype": spec.dtype,
        "variant": spec.variant.label if spec.variant is not None else None,
        "launch_blocking": spec.launch_blocking,
    }


def verdict_fields(verdict: Verdict) -> dict[str, Any]:
    """What the JSON report says of a run's verdict (plain data: it crosses xdist)."""
    outcome = verdict.outcome
    return {
        "error_type": outcome.error_type,
        "message": outcome.summary,
        "max_abs": outcome.max_abs,
        "max_rel": outcome.max_rel,
        "triage": verdict.triage.to_dict() if verdict.triage is not None else None,
        "localized": verdict.localized.outcome.summary if verdict.localized is not None else None,
    }


def _relative(path: Path) -> str:
    from .errors import display

    return Path(display(path)).as_posix()


def result_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The JSON record of an item once its outcome is known, from its pytest report."""
    props: dict[str, Any] = dict(report.user_properties)
    if "gpucase" not in props:
        return None
    if report.when == "setup" and report.passed:
        return None  # the call phase will say
    if report.when == "teardown" and not report.failed:
        return None
    xfail = hasattr(report, "wasxfail")
    if report.when != "call":
        outcome = "skipped" if report.skipped else "error"
    elif report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    elif report.passed:
        outcome = "xpassed" if xfail else "passed"
    else:
        strict_xpass = "XPASS(strict)" in str(report.longrepr)
        outcome = "xpassed" if strict_xpass else "failed"
    skip_reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        skip_reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    record: dict[str, Any] = {"nodeid": report.nodeid, **props["gpucase"]}
    record.update({"outcome": outcome, "error_type": None, "message": None, "max_abs": None,
                   "max_rel": None, "duration": round(report.duration, 6),
                   "skip_reason": skip_reason, "triage": None, "localized": None})
    record.update(props.get("gpucase_result", {}))
    if xfail and outcome == "xfailed":
        record["message"] = record["message"] or str(report.wasxfail)
    return record


class _Recorder:
    """Collects results on the process that writes the report (the controller under xdist)."""

    def __init__(self, state: GpuCaseSession) -> None:
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.state.record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import os

        # An interrupted run (Ctrl-C) still leaves a valid report of what finished.
        complete = session.exitstatus != pytest.ExitCode.INTERRUPTED
        self.state.write_report(complete=complete)
        if os.environ.get("GITHUB_STEP_SUMMARY") and self.state.results:
            from .report import append_step_summary

            append_step_summary(self.state.build_report(complete=complete))


class _OwnIsolation:
    """Under ``--forked``, case items keep their own fresh child instead of a second fork.

    Each case run already happens in a fresh child, so pytest-forked's extra
    fork adds nothing to them (and pytest-forked 1.7.5 cannot send pytest 9.2's
    reports back at all); the user's other tests are still forked by it.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item,
                                nextitem: pytest.Item | None) -> bool | None:
        if not isinstance(item, (CaseItem, BrokenCaseItem)):
            return None
        from _pytest.runner import runtestprotocol

        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runtestprotocol(item, nextitem=nextitem, log=True)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[session_key]
    for note in state.notes:
        terminalreporter.write_line(f"gpucase: {note}", yellow=True)
    written = [path for path in state.regenerated.values() if path]
    if written:
        terminalreporter.write_sep("-", "gpucase: golden files written")
        for path in written:
            terminalreporter.write_line(_relative(Path(path)))
    report_path = config.getoption("gpu_cases_report", None)
    if report_path is not None and state.enabled and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"gpucase: JSON report written to {report_path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu_requires")]
    if not marked:
        return
    from .matrix import evaluate

    state = config.stash[session_key]
    for item in marked:
        marker = item.get_closest_marker("gpu_requires")
        assert marker is not None
        requirements = requirements_from_marker(item.nodeid, dict(marker.kwargs))
        reason = evaluate(requirements, state.environment(tuple(requirements.packages)))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def requirements_from_marker(where: str, kwargs: dict[str, Any]) -> Any:
    """``@pytest.mark.gpu_requires(...)`` as ``Requirements``; a mistake is a usage error."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from .case import BACKENDS, VERSION_KEYS, Requirements

    unknown = sorted(set(kwargs) - {"backends", "packages", *VERSION_KEYS})
    if unknown:
        raise pytest.UsageError(f"{where}: gpu_requires: unknown argument {unknown[0]!r}; "
                                f"expected backends, packages, {', '.join(VERSION_KEYS)}")
    specs = {key: kwargs[key] for key in VERSION_KEYS if kwargs.get(key) is not None}
    packages = dict(kwargs.get("packages") or {})
    for key, value in [*specs.items(), *packages.items()]:
        try:
            if value:
                SpecifierSet(value)
        except (InvalidSpecifier, TypeError):
            raise pytest.UsageError(f"{where}: gpu_requires: {key}={value!r} is not a PEP 440 "
                                    "specifier; write it like '>=2.1'") from None
    backends = kwargs.get("backends")
    if backends is not None:
        backends = (backends,) if isinstance(backends, str) else tuple(backends)
        for backend in backends:
            if backend not in BACKENDS:
                raise pytest.UsageError(f"{where}: gpu_requires: unknown backend {backend!r}; "
                                        f"expected one of {', '.join(BACKENDS)}")
    return Requirements(backends=backends, versions=specs, packages=packages)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wants_device = "gpu_device" in metafunc.fixturenames
    if wants_device:
        from .matrix import DEFAULT_DEVICES, device_skip

        env = metafunc.config.stash[session_key].environment()
        asked = metafunc.config.getoption("gpu_devices")
        devices = [*DEFAULT_DEVICES, *(t for t in env.device_types if t not in DEFAULT_DEVICES)]
        params = []
        for device in devices:
            if asked is not None and device not in asked:
                continue
            reason = device_skip(device, env)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(device, marks=marks, id=device))
        metafunc.parametrize("gpu_device", params, indirect=True)
    if "gpu_dtype" in metafunc.fixturenames:
        dtypes = metafunc.config.getoption("gpu_dtypes") or ("float32",)
        metafunc.parametrize("gpu_dtype", list(dtypes), indirect=True)


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


class GpuCaseHandle:
    """What the ``gpu_case`` fixture gives a hand-written test: the case, its inputs, its runs."""

    def __init__(self, case: Case, state: GpuCaseSession) -> None:
        self.case = case
        self._state = state

    def inputs(self, device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
        """The case's keyword arguments in this process, on ``device``, floats cast to ``dtype``."""
        from .execute import load_inputs, prepare

        return prepare(load_inputs(self.case), device, dtype)

    def run(self, device: str = "cpu", dtype: str | None = None,
            launch_blocking: bool = False) -> Verdict:
        """Run the case once in a fresh child and return the verdict (it does not raise)."""
        from .environment import launch_blocking_env
        from .matrix import RunSpec, saved_dtype
        from .runner import run_spec

        backend = self._state.environment().backend
        env = launch_blocking_env(backend) if launch_blocking and device != "cpu" else {}
        spec = RunSpec(self.case, device, dtype or saved_dtype(self.case) or "float32",
                       cast=dtype is not None, env=env, launch_blocking=bool(env))
        return run_spec(spec, start_method=self._state.start_method(), backend=backend,
                        localize=False)


@pytest.fixture
def gpu_case(request: pytest.FixtureRequest) -> GpuCaseHandle:
    """The case named by ``@pytest.mark.gpu_case("path/to/case")``, relative to the rootdir."""
    from .case import load_case
    from .errors import CaseFormatError

    marker = request.node.get_closest_marker("gpu_case")
    if marker is None or not marker.args:
        raise pytest.UsageError(
            f"{request.node.nodeid}: the gpu_case fixture needs "
            "@pytest.mark.gpu_case(\"cases/NAME\")")
    path = Path(marker.args[0])
    if not path.is_absolute():
        path = request.config.rootpath / path
    try:
        case = load_case(path)
    except CaseFormatError as exc:
        pytest.fail(str(exc), pytrace=False)
    return GpuCaseHandle(case, request.config.stash[session_key])

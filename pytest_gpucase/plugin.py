"""pytest hooks for gpucase: options, markers, collection of case directories, fixtures.

Kept thin and light: nothing here imports torch at module level, so a plain
``pytest`` run that uses no case pays nothing. The engine is imported lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest

if TYPE_CHECKING:
    from .case import Case
    from .environment import Environment
    from .execute import Outcome
    from .isolation import StartMethod
    from .plan import RunSpec
    from .runner import Verdict


@dataclass(frozen=True)
class Setting:
    """One setting: a command-line option and the ini key of the same name."""

    name: str            # the ini key and the option's dest, e.g. "gpu_devices"
    help: str
    kind: Literal["bool", "csv", "path", "choice", "paths", "gib"] = "bool"
    choices: tuple[str, ...] = ()
    default: Any = None
    needs_cases: bool = False  # meaningless without --gpu-cases: a usage error on the command line

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS = (
    Setting("gpu_cases", "collect case directories (with a case.toml) and replay each run in a "
            "fresh child process", default=False),
    Setting("gpu_cases_paths", "case folders collected by --gpu-cases when no path is given on "
            "the command line (ini only; relative to the rootdir)", kind="paths", default=()),
    Setting("gpu_launch_blocking", "run device items with the backend's launch-blocking variable "
            "(CUDA_LAUNCH_BLOCKING=1, AMD_SERIALIZE_KERNEL=3); never for timing", default=False,
            needs_cases=True),
    Setting("gpu_devices", "only these device types, e.g. cuda,cpu (narrows each case's list)",
            kind="csv"),
    Setting("gpu_dtypes", "only these dtypes, e.g. float32,bfloat16 (narrows each case's list)",
            kind="csv"),
    Setting("gpu_no_localize", "do not rerun an asynchronous device error with launch blocking",
            default=False, needs_cases=True),
    Setting("gpu_cases_regen", "write or rewrite each case's expected.safetensors from its "
            "reference run, and list the files written", default=False, needs_cases=True),
    Setting("gpu_cases_report", "write the run's results (environment and every item) as JSON "
            "here", kind="path", needs_cases=True),
    Setting("gpu_ablate", "rerun each failing item under one change at a time (CPU, float32, "
            "float64, TF32 off, cuDNN off, ...) and report which make it pass", default=False,
            needs_cases=True),
    Setting("gpu_per_worker", "under pytest-xdist, give each worker's runs one device of the "
            "visible ones, round-robin (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
            default=False),
    Setting("gpu_memory_limit", "kill a run's whole process tree when its resident memory "
            "passes this many GiB, e.g. 8 (a case's own memory_limit wins)", kind="gib",
            needs_cases=True),
    Setting("gpu_start_method", "how each run's child starts: auto (fork, or forkserver when "
            "CUDA is already initialized in the pytest process), fork, forkserver (forked by a "
            "zygote started with the session, before CUDA could be initialized), spawn (a fresh "
            "interpreter per run)", kind="choice",
            choices=("auto", "fork", "forkserver", "spawn"), default="auto"),
    Setting("gpu_isolation", "how fresh each run's child is: item (a fresh child per run), "
            "case (one child runs a case's runs in turn), worker (one child per device runs "
            "them all, keeping its device context); a reused child ends on a crash, timeout or "
            "state it cannot restore, and every failure in one is judged again in a fresh "
            "child", kind="choice", choices=("item", "case", "worker"), default="item"),
)
_SETTINGS = {setting.name: setting for setting in SETTINGS}


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpucase", "saved GPU failure cases")
    for setting in SETTINGS:
        ini_type = {"bool": "bool", "paths": "paths"}.get(setting.kind, "string")
        parser.addini(setting.name, setting.help, type=ini_type,  # type: ignore[arg-type]
                      default=setting.default)
        if setting.kind == "paths":
            continue
        if setting.kind == "bool":
            group.addoption(setting.flag, action="store_true", default=None, help=setting.help)
        elif setting.kind == "choice":
            group.addoption(setting.flag, choices=setting.choices, default=None,
                            help=setting.help)
        else:
            group.addoption(setting.flag, metavar=setting.name.removeprefix("gpu_").upper(),
                            default=None, help=setting.help)


def setting(config: pytest.Config, name: str) -> Any:
    """A setting's value: the command line's, else the ini key's, else the default.

    Values from either place are checked the same way; a mistake is a usage error
    naming where it came from.
    """
    spec = _SETTINGS[name]
    value = config.getoption(name, None) if spec.kind != "paths" else None
    source = f"argument {spec.flag}"
    if value is None:
        value = config.getini(name)
        source = f"ini key {name}"
        if value in (None, "", []):
            value = spec.default
    if spec.kind == "bool":
        return bool(value)
    if spec.kind == "paths":
        return tuple(value or ())
    if value is None:
        return None
    if spec.kind == "path":
        return Path(str(value))
    if spec.kind == "gib":
        return _gib(str(value), source)
    if spec.kind == "choice":
        if value not in spec.choices:
            raise pytest.UsageError(f"{source}: {value!r} is not one of {', '.join(spec.choices)}")
        return value
    from .backends import DEVICE_TYPES
    from .case import FLOAT_DTYPES

    known = DEVICE_TYPES if name == "gpu_devices" else FLOAT_DTYPES
    return _csv(str(value), known, source)


def _gib(value: str, source: str) -> int:
    """``"8"`` or ``"0.5"`` GiB as bytes; anything else is a usage error."""
    import math

    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise pytest.UsageError(f"{source}: {value!r} is not a positive number of GiB")
    return int(gib * 2**30)


def _csv(value: str, known: tuple[str, ...], source: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    for name in names:
        if name not in known:
            # A typo would otherwise narrow every case to nothing, without a word.
            raise pytest.UsageError(f"{source}: unknown {name!r}; expected one of "
                                    f"{', '.join(known)}")
    return names


@dataclass
class GpuCaseSession:
    """The plugin's state for one pytest session."""

    config: pytest.Config
    settings: dict[str, Any] = field(default_factory=dict)  # every Setting, resolved once
    _env: Environment | None = None
    notes: list[str] = field(default_factory=list)
    regenerated: dict[Path, str | None] = field(default_factory=dict)  # case dir -> file or None
    cases_seen: int = 0  # case directories collected in this process
    filtered_out: list[str] = field(default_factory=list)  # emptied by the filters
    results: dict[str, dict[str, Any]] = field(default_factory=dict)   # nodeid -> JSON record
    created: str = field(default_factory=lambda: _now())   # when the run started, said once
    _written_at: float = 0.0
    _unwritten: bool = False    # a record arrived since the report file was last written
    _finished: bool = False     # the report of the whole session has been written
    renderers: tuple[str, ...] = ()   # report formats this session's plugins added
    _reference_cache: Path | None = None
    _pool: Any = None  # isolation.WorkerPool, for --gpu-isolation case or worker
    _temporary: list[Path] = field(default_factory=list)  # removed at pytest_unconfigure

    @property
    def enabled(self) -> bool:
        return bool(self.settings["gpu_cases"])

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
        """Keep the JSON record of a finished item; rewrite the report file now and then.

        Rewrites are throttled (a large suite would otherwise rewrite the file once per
        item); what a throttled rewrite leaves out is written at the end of the session,
        however it ends (``pytest_sessionfinish``, else ``pytest_unconfigure``).
        """
        import time

        record = result_record(report) or crash_record(report)
        if record is None:
            return
        self.results[report.nodeid] = record
        self._unwritten = True
        if time.monotonic() - self._written_at > REPORT_EVERY:
            self.write_report(complete=False)

    def build_report(self, *, complete: bool) -> dict[str, Any]:
        """The JSON report of what has finished so far."""
        from .report import check_report, new_report

        report = new_report(self.environment().to_dict(), created=self.created)
        report["results"] = list(self.results.values())
        report["complete"] = complete
        check_report(report)   # a record that breaks the schema is a bug here, not in the file
        return report

    def write_report(self, *, complete: bool) -> None:
        """Rewrite the JSON report atomically, so a crash or Ctrl-C leaves what finished."""
        import time

        path: Path | None = self.settings["gpu_cases_report"]
        if path is not None:
            from .report import write_report

            write_report(path, self.build_report(complete=complete))
            self._written_at = time.monotonic()
            self._unwritten = False

    def worker_env(self) -> dict[str, str]:
        """The device pin of this xdist worker's children (``--gpu-per-worker``), or {}."""
        import os

        from .pinning import pin_env

        if not self.settings["gpu_per_worker"]:
            return {}
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        env = self.environment()
        return pin_env(worker, env.backend, len(env.devices), os.environ)

    def reference_cache(self) -> Path:
        """Where children cache the float64 references (pytest's cache, else a temporary
        folder removed at the end of the session)."""
        if self._reference_cache is None:
            cache = getattr(self.config, "cache", None)
            if cache is not None:
                self._reference_cache = Path(cache.mkdir("gpucase-references"))
            else:
                import tempfile

                self._reference_cache = Path(tempfile.mkdtemp(prefix="gpucase-references-"))
                self._temporary.append(self._reference_cache)
        return self._reference_cache

    def pool(self) -> Any:
        """The session's reusable children (``--gpu-isolation``), or None for ``item``."""
        if self.settings["gpu_isolation"] == "item":
            return None
        if self._pool is None:
            from .isolation import WorkerPool

            self._pool = WorkerPool()
        return self._pool

    def start_method(self) -> StartMethod:
        from .isolation import default_start_method

        chosen: str = self.settings["gpu_start_method"]
        if chosen != "auto":
            return chosen  # type: ignore[return-value]
        method = default_start_method()
        # Only where there is no zygote (not Linux): with one, forkserver costs a fork.
        note = ("CUDA was initialized in the pytest process, so each run starts a fresh "
                "interpreter (spawn) instead of a fork: every run pays for importing torch again")
        if method == "spawn" and note not in self.notes:
            self.notes.append(note)
        return method


REPORT_EVERY = 2.0  # seconds between incremental rewrites of the JSON report


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")
session_key = pytest.StashKey[GpuCaseSession]()


def pytest_configure(config: pytest.Config) -> None:
    state = GpuCaseSession(config, {spec.name: setting(config, spec.name) for spec in SETTINGS})
    config.stash[session_key] = state
    formats = config.hook.pytest_gpucase_report_formats()   # hookspecs.py
    if any(formats):   # report.py is imported only when a plugin adds a format
        from .report import add_renderers

        state.renderers = add_renderers(formats)
    if not state.enabled:
        given = [spec.flag for spec in SETTINGS
                 if spec.needs_cases and config.getoption(spec.name, None)]
        if given:
            raise pytest.UsageError(
                f"{given[0]} needs --gpu-cases (or gpu_cases = true in the ini): without it no "
                "case is collected, so it would change nothing")
    else:
        _add_case_paths(config, state.settings["gpu_cases_paths"])
    if state.enabled:
        from ._torch import import_torch

        import_torch()  # before any engine module imports it, and before anything can fork
        _start_zygote(config, state)
    if state.enabled and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(state), "gpucase-recorder")
    if state.enabled and config.getoption("forked", False):
        # Registered after pytest-forked (an entry point), so called before its tryfirst hook.
        config.pluginmanager.register(_OwnIsolation(), "gpucase-own-isolation")
    config.addinivalue_line(
        "markers", "gpu_case(path): give the gpu_case fixture the case directory at path")
    for name, text in run_markers():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.addinivalue_line(
        "markers", "gpu_requires(backends=None, torch=None, python=None, cuda=None, hip=None, "
        "capability=None, packages=None): skip unless this environment meets the requirements, "
        "written as in a case's [matrix]")


def run_markers() -> list[tuple[str, str]]:
    """The markers each case item may carry, read off the tables that define them.

    Devices and backends from ``backends.py``, dtypes from ``case.FLOAT_DTYPES``,
    variant kinds from ``variants.VARIANT_KINDS``: a row added there is a marker
    here, so ``--strict-markers`` never rejects an item's own marker.
    """
    from .backends import BACKENDS, DEVICE_TYPES
    from .case import FLOAT_DTYPES
    from .variants import VARIANT_KINDS

    return [
        *((f"device_{device}", f"a gpucase run on {device}") for device in DEVICE_TYPES),
        *((f"dtype_{dtype}", f"a gpucase run in {dtype}") for dtype in FLOAT_DTYPES),
        *((f"variant_{kind}", f"a gpucase {kind} edge variant") for kind in VARIANT_KINDS),
        *((f"backend_{backend}", f"a gpucase run on the {backend} backend")
          for backend in BACKENDS),
    ]


def _start_zygote(config: pytest.Config, state: GpuCaseSession) -> None:
    """Start the forkserver's zygote now, before anything in this process can initialize
    CUDA, where runs may need it (auto or forkserver; not on an xdist controller)."""
    from .isolation import forkserver, forkserver_available

    if state.settings["gpu_start_method"] not in ("auto", "forkserver"):
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # the workers run the items, each with a zygote of its own
    if forkserver_available():
        forkserver()


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil
    import sys

    isolation = sys.modules.get("pytest_gpucase.isolation")
    if isolation is not None:
        isolation.shutdown()  # no child, zombie or zygote outlives the session
    state = config.stash.get(session_key, None)
    for path in state._temporary if state is not None else ():
        shutil.rmtree(path, ignore_errors=True)
    if state is not None and state.renderers:
        from .report import RENDERERS

        for name in state.renderers:
            RENDERERS.pop(name, None)   # the next session in this process asks its own plugins


def _add_case_paths(config: pytest.Config, paths: tuple[str, ...]) -> None:
    """With no path on the command line, ``--gpu-cases`` also collects ``gpu_cases_paths``."""
    if not paths or config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    given = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    for entry in paths:
        path = Path(entry).resolve()
        if not path.exists():
            raise pytest.UsageError(f"ini key gpu_cases_paths: {entry} does not exist; list "
                                    "case folders relative to the rootdir")
        if not any(path == arg or arg in path.parents for arg in given):
            config.args.append(str(path))


def pytest_collection_finish(session: pytest.Session) -> None:
    state = session.config.stash[session_key]
    if not state.enabled or hasattr(session.config, "workerinput"):
        return
    found = any(isinstance(item, (CaseItem, BrokenCaseItem)) for item in session.items)
    if found:
        return
    if state.filtered_out:
        state.notes.append(
            "no case run was left after --gpu-devices/--gpu-dtypes: "
            + "; ".join(state.filtered_out[:5]) + (" ..." if len(state.filtered_out) > 5 else ""))
    elif not state.cases_seen and not session.config.option.keyword \
            and not session.config.option.markexpr:
        state.notes.append(
            "--gpu-cases found no case folder (a folder holding a case.toml) under "
            + ", ".join(session.config.args) + ": pass the case folders (pytest --gpu-cases "
            "cases) or list them in the ini key gpu_cases_paths")


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
    """A case directory: its ``case.toml`` is the one file collected from it.

    Items live under the ``case.toml`` file node, so that an item's id
    (``cases/ce_class4/case.toml::ce_class4[cpu-float32]``) is a path pytest
    accepts on its command line, and ``--lf``/``--sw`` can narrow to it.
    """

    def collect(self) -> Iterator[pytest.Collector]:
        yield CaseFile.from_parent(self, path=self.path / "case.toml")


class CaseFile(pytest.File):
    """A case's ``case.toml``: one item per run (device x dtype x variant)."""

    def collect(self) -> Iterator[pytest.Item]:
        from .case import load_case
        from .errors import CaseFormatError
        from .backends import run_backend
        from .plan import expand, saved_dtype

        state = self.config.stash[session_key]
        case_dir = self.path.parent
        try:
            case = load_case(case_dir)
            # The saved dtype names the items only when [matrix] dtypes does not; under
            # autocast the call computes in the autocast dtype, which names them instead.
            saved = None if case.matrix.dtypes else (case.context.compute_dtype
                                                     or saved_dtype(case))
            specs = expand(
                case, state.environment(tuple(case.matrix.packages)),
                saved_dtype=saved,
                devices=state.settings["gpu_devices"],
                dtypes=state.settings["gpu_dtypes"],
                launch_blocking=state.settings["gpu_launch_blocking"],
            )
        except Exception as exc:  # whatever the files hold: one failed item, the session goes on
            from .case import CASE_FILE, case_name
            from .errors import display

            problem = str(exc) if isinstance(exc, CaseFormatError) else (
                f"{display(case_dir / CASE_FILE)}: the case cannot be loaded: "
                f"{type(exc).__name__}: {exc}")
            yield BrokenCaseItem.from_parent(self, name=case_name(case_dir), problem=problem,
                                             case_path=_relative(case_dir))
            return
        state.cases_seen += 1
        if not specs:
            state.filtered_out.append(f"{case.name} (its runs: {_case_runs(case)})")
        pin = state.worker_env()
        build = state.environment().backend
        case_path = _relative(case_dir) if specs else ""  # once per case, not per item
        for spec in specs:
            if pin and spec.device != "cpu":
                spec = replace(spec, env={**spec.env, **pin})
            item = CaseItem.from_parent(self, name=f"{case.name}[{spec.id}]", spec=spec,
                                        case_path=case_path,
                                        **_item_id(self, case.name, spec.id))
            # torch.cuda is CUDA on NVIDIA builds and HIP on ROCm builds: backends.py knows.
            item.add_marker(_mark(f"backend_{run_backend(spec.device, build)}"))
            yield item


@functools.cache
def _mark(name: str) -> pytest.MarkDecorator:
    """The marker ``name`` (all registered in pytest_configure), made once, not per item."""
    return getattr(pytest.mark, name)  # type: ignore[no-any-return]


def _item_id(parent: pytest.Collector, name: str, params: str) -> dict[str, Any]:
    """pytest >= 9.2 keeps structured ids and matches ``--lf`` on them: give the item its
    params as parametrized functions have them, or ``name[params]`` never equals itself."""
    parent_id = getattr(parent, "id", None)
    if parent_id is None or not hasattr(parent_id, "with_params"):
        return {}
    return {"nodeid": parent_id.child(name).with_params(params)}


def _case_runs(case: Case) -> str:
    devices = ", ".join(case.matrix.devices or ("any device",))
    dtypes = ", ".join(case.matrix.dtypes or ("its saved dtype",))
    return f"devices {devices}; dtypes {dtypes}"


class BrokenCaseItem(pytest.Item):
    """A case that cannot be loaded: one failing item, so that the other cases still run."""

    def __init__(self, *, problem: str, case_path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.problem = problem
        from .report import property_json

        # Recorded like any run, so that the JSON report, the matrix and the step summary
        # show the broken case too; "all": it fails on every device type it would run on.
        self.user_properties.append(("gpucase", property_json({
            "case": self.name, "case_path": case_path, "device": "all", "dtype": "all",
            "variant": None, "launch_blocking": False})))
        self.user_properties.append(("gpucase_result", property_json({
            "error_type": "CaseFormatError", "message": problem})))

    def runtest(self) -> None:
        raise CaseFileError(self.problem)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        from .report import terminal_safe

        if isinstance(excinfo.value, CaseFileError):
            return terminal_safe(str(excinfo.value))
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.name} (broken case)"


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
    """Whether a failed run is the case's known failure, not a broken case or another error.

    Compared by failure class (pytest_gpucase.triage.failure_class) when both sides have
    one, so that a device-side assert captured on CUDA is met by the IndexError the CPU
    raises for the same inputs; else by the exception type named in ``[origin] error``.
    """
    import re

    from .triage import failure_class, same_failure

    outcome = verdict.outcome
    if outcome.broken_case:
        return False
    error = str(case.origin.get("error", ""))
    recorded = re.match(r"([A-Za-z_][\w.]*)(?::|$)", error)
    if recorded is None:
        return True  # nothing to tell them apart by: no recorded type
    known = case.origin.get("failure_class")
    if not isinstance(known, str):
        known = failure_class(recorded[1], error.partition(":")[2],
                              str(case.origin.get("stderr", "")))
    if known not in (None, "nan") and outcome.kind in ("mismatch", "golden mismatch",
                                                        "no exception"):
        return False  # the captured error is gone (a fix): another failure, not the known one
    if outcome.error_type is None:
        return True  # nothing to tell them apart by: a mismatch
    found = failure_class(outcome.error_type, outcome.error_message or "", verdict.child.stderr)
    if known is not None and found is not None:
        return same_failure(known, found)
    return recorded[1].rsplit(".", 1)[-1] == outcome.error_type


def xfail_reason(spec: RunSpec) -> str | None:
    """The xfail reason that applies to this run (None outside a scoped xfail)."""
    variant = spec.variant.kind if spec.variant is not None else None
    return spec.case.xfail_for(spec.device, spec.dtype, variant)


class CaseItem(pytest.Item):
    """One run of a case, executed in a fresh child process."""

    def __init__(self, *, spec: RunSpec, case_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.add_marker(_mark(f"device_{spec.device}"))
        from .case import FLOAT_DTYPES

        if spec.dtype in FLOAT_DTYPES:
            self.add_marker(_mark(f"dtype_{spec.dtype}"))
        if spec.variant is not None:
            # -m "variant_boundary(value=-1)" selects exactly one value.
            self.add_marker(getattr(pytest.mark, f"variant_{spec.variant.kind}")(
                value=spec.variant.value))
        # -k cuda_float32 selects as in PyTorch's device-type test names (test_x_cuda_float32).
        self.extra_keyword_matches.add(f"{spec.device}_{spec.dtype}")
        from .report import property_json

        self.user_properties.append(("gpucase", property_json(spec_fields(spec, case_path))))
        if spec.skip is not None:
            self.add_marker(pytest.mark.skip(reason=spec.skip))
        elif (reason := xfail_reason(spec)) is not None:
            # Only the known failure counts as xfailed; any other failure is a failure.
            self.add_marker(pytest.mark.xfail(reason=reason, strict=True,
                                              raises=KnownFailure))

    def runtest(self) -> None:
        from .runner import run_spec

        state = self.config.stash[session_key]
        if (self.config.stash[session_key].settings["gpu_cases_regen"] and self.spec.variant is None
                and self.spec.case.expect.outcome == "matches"):
            state.regenerate(self.spec.case)
        spec = self.spec
        for found in self.ihook.pytest_gpucase_run_env(item=self, spec=spec):
            if found:   # hookspecs.pytest_gpucase_run_env: merged into the child's environment
                spec = replace(spec, env={**spec.env, **{str(k): str(v)
                                                         for k, v in found.items()}})
        verdict = run_spec(spec, start_method=state.start_method(),
                           backend=state.environment().backend,
                           memory_limit=(self.spec.case.memory_limit
                                         or state.settings["gpu_memory_limit"]),
                           reference_cache=state.reference_cache(),
                           isolation=state.settings["gpu_isolation"], pool=state.pool(),
                           localize=not self.config.stash[session_key].settings["gpu_no_localize"])
        fields = verdict_fields(verdict)
        _add_sections(self, verdict)
        _reissue_warnings(verdict)
        if verdict.failed and self.config.stash[session_key].settings["gpu_ablate"]:
            from .ablate import ablate

            found = ablate(self.spec.case, device=self.spec.device, dtype=self.spec.dtype,
                           env=state.environment(), start_method=state.start_method(),
                           variant=self.spec.variant)
            self.add_report_section("call", "gpucase ablation", found.render())
            fields["ablation"] = found.to_dict()
        from .report import property_json

        self.user_properties.append(("gpucase_result", property_json(fields)))
        if verdict.outcome.status == "skipped":
            pytest.skip(verdict.outcome.summary)
        if verdict.failed:
            if xfail_reason(self.spec) is not None and is_known_failure(self.spec.case, verdict):
                raise KnownFailure(verdict)
            raise CaseRunFailed(verdict)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, CaseRunFailed):
            return _failure_text(excinfo.value.verdict.outcome, self.spec)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.spec.case.case_file, 0, self.name


def _failure_text(outcome: Outcome, spec: RunSpec | None = None) -> str:
    from .report import terminal_safe
    from .variants import describe_saved

    text = outcome.summary
    if outcome.details:
        text += "\n\n" + outcome.details.rstrip()
    resized = (describe_saved(spec.variant, spec.case.inputs_file)
               if spec is not None and spec.variant is not None else None)
    if resized:
        text += "\n\n" + resized   # which inputs the variant resized, to what shape
    return terminal_safe(text)   # the child's words must not drive the terminal


def _add_sections(item: pytest.Item, verdict: Verdict) -> None:
    from .report import terminal_safe
    from .runner import describe_rerun, describe_warnings, stderr_section

    child = verdict.child
    sections = [("stdout (child)", child.stdout), ("stderr (child)", stderr_section(verdict))]
    if child.warnings:
        sections.append(("warnings (child)", describe_warnings(child)))
    if verdict.triage is not None:
        sections.append(("gpucase triage", verdict.triage.render()))
    if verdict.localized is not None:
        sections.append(("gpucase launch-blocking rerun", describe_rerun(verdict)))
    for title, text in sections:
        if text:
            item.add_report_section("call", title, terminal_safe(text))


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


def spec_fields(spec: RunSpec, case_path: str | None = None) -> dict[str, Any]:
    """What the JSON report says of an item before it runs (set at collection);
    ``case_path``, the case's shown path, when the caller has it already."""
    return {
        "case": spec.case.name,
        "case_path": _relative(spec.case.path) if case_path is None else case_path,
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
    """``display(path)`` with ``/``; a normalized path below the working directory (every
    collected case) is cut with string operations: pathlib costs a quarter millisecond a
    case at collection."""
    import os

    from .errors import display, printable

    text = os.fspath(path)
    try:
        cwd = os.getcwd().rstrip(os.sep) + os.sep
    except OSError:
        cwd = ""
    if (os.sep == "/" and cwd and text.startswith(cwd) and os.path.isabs(text)
            and os.path.normpath(text) == text):
        return printable(text[len(cwd):])
    return Path(display(path)).as_posix()


def result_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The JSON record of an item once its outcome is known, from its pytest report."""
    from .report import property_value

    props: dict[str, Any] = {name: property_value(value) for name, value in
                             report.user_properties if name in ("gpucase", "gpucase_result")}
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


def crash_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The record of a case item lost with a crashed pytest-xdist worker, from its node id.

    pytest-xdist reports such an item as failed in a phase named "???", with no user
    properties: the controller never collected it, so what it was is read from the id
    (``cases/ce/case.toml::ce[cuda-float32-batch[1]]``).
    """
    import re

    from .backends import DEVICE_TYPES

    if report.when not in ("???", None) or not report.failed:
        return None
    found = re.fullmatch(r"(?P<path>[^\[]+?)(?:/case\.toml)?::(?P<name>[^:\[]+)"
                         r"\[(?P<device>[a-z]+)-(?P<dtype>[a-z0-9]+)(?:-(?P<kind>[a-z]+)\[(?P<value>-?\d+)\])?\]",
                         report.nodeid)
    if found is None or found["device"] not in DEVICE_TYPES:
        return None
    variant = f"{found['kind']}={found['value']}" if found["kind"] else None
    return {"nodeid": report.nodeid, "case": found["name"], "case_path": found["path"],
            "device": found["device"], "dtype": found["dtype"], "variant": variant,
            "launch_blocking": False, "outcome": "failed", "error_type": "WorkerCrash",
            "message": str(report.longrepr), "max_abs": None, "max_rel": None,
            "duration": round(report.duration, 6), "skip_reason": None, "triage": None,
            "localized": None}


class _Recorder:
    """Collects results on the process that writes the report (the controller under xdist)."""

    def __init__(self, state: GpuCaseSession) -> None:
        self.state = state
        self._owner = 0
        self._previous: Any = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.state.record(report)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import os
        import signal

        if self.state.settings["gpu_cases_report"] is None:
            return
        # SIGTERM (a CI job cancelled, a batch system's time limit) ends the session as
        # Ctrl-C does, so that the report of what finished is written on the way out. A
        # handler someone else installed is left in place: it decides how SIGTERM ends.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._owner = os.getpid()
            self._previous = signal.signal(signal.SIGTERM, self._terminate)

    def _terminate(self, signum: int, frame: Any) -> None:
        import os
        import signal

        if os.getpid() != self._owner:   # a forked child that kept the handler: die as asked
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"terminated by signal {signum} ({signal.Signals(signum).name})")

    # While a case runs, isolation's own handler ends the run (and names it) instead of this one.
    _terminate.gpucase_interrupts = True  # type: ignore[attr-defined]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import os

        # Whatever the exit status: an interrupted or terminated run still leaves a valid
        # report of every item that finished.
        complete = session.exitstatus != pytest.ExitCode.INTERRUPTED
        self.state.write_report(complete=complete)
        self.state._finished = True
        if os.environ.get("GITHUB_STEP_SUMMARY") and self.state.results:
            from .report import append_step_summary

            append_step_summary(self.state.build_report(complete=complete))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import signal

        if self._owner:
            signal.signal(signal.SIGTERM, self._previous)
        # The session ended before pytest_sessionfinish could write (an error in another
        # plugin's hook, a second Ctrl-C): write what finished, as unfinished.
        if not self.state._finished and (self.state._unwritten or self.state.results):
            self.state.write_report(complete=False)


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
    report_path = state.settings["gpu_cases_report"]
    if report_path is not None and state.enabled and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"gpucase: JSON report written to {report_path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu_requires")]
    if not marked:
        return
    from .plan import evaluate

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

    from .backends import BACKENDS
    from .case import VERSION_KEYS, Requirements

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
        from .plan import device_list, device_skip

        env = metafunc.config.stash[session_key].environment()
        asked = metafunc.config.stash[session_key].settings["gpu_devices"]
        params = []
        for device in device_list(env, asked=asked):
            reason = device_skip(device, env)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(device, marks=marks, id=device))
        metafunc.parametrize("gpu_device", params, indirect=True)
    if "gpu_dtype" in metafunc.fixturenames:
        dtypes = metafunc.config.stash[session_key].settings["gpu_dtypes"] or ("float32",)
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
        from .plan import single_run
        from .runner import run_spec

        env = self._state.environment()
        spec = single_run(self.case, env, device, dtype, launch_blocking=launch_blocking)
        return run_spec(spec, start_method=self._state.start_method(), backend=env.backend,
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

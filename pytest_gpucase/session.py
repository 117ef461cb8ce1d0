"""The plugin's state for one pytest session, and the writer of its JSON report.

``GpuCaseSession`` (in ``config.stash[session_key]``) holds the resolved settings,
the environment probed once, the notes for the terminal summary, and the JSON
records of finished items; ``_Recorder``, registered on the process that writes
the report (the controller under xdist), keeps it current and writes it on every
way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .case import Case
    from .environment import Environment
    from .isolation import StartMethod


@dataclass
class GpuCaseSession:
    """The plugin's state for one pytest session."""

    config: pytest.Config
    settings: dict[str, Any] = field(default_factory=dict)  # every Setting, resolved once
    _env: Environment | None = None
    notes: list[str] = field(default_factory=list)
    regenerated: dict[Path, str | None] = field(default_factory=dict)  # case dir -> file or None
    cases_seen: int = 0  # case directories collected in this process
    sigint_seen: bool = False  # Ctrl-C came (_SigintWatch): no item runs on
    filtered_out: list[str] = field(default_factory=list)  # emptied by the filters
    results: dict[str, dict[str, Any]] = field(default_factory=dict)   # nodeid -> JSON record
    created: str = field(default_factory=lambda: _now())   # when the run started, said once
    _written_at: float = 0.0
    _unwritten: bool = False    # a record arrived since the report file was last written
    _finished: bool = False     # the report of the whole session has been written
    report_failed: bool = False  # the last write of the JSON report failed (a note says why)
    renderers: tuple[str, ...] = ()   # report formats this session's plugins added
    _reference_cache: Path | None = None
    _pool: Any = None  # isolation.WorkerPool, for --gpu-isolation case or worker
    _temporary: list[Path] = field(default_factory=list)  # removed at pytest_unconfigure

    @property
    def enabled(self) -> bool:
        return bool(self.settings["gpu_cases"])

    def environment(self, packages: tuple[str, ...] = ()) -> Environment:
        """The session's environment snapshot, probed in a child on first use.

        ``packages`` are looked up once each, where the requirements are evaluated (at
        collection) and where the report is written (``record``: under xdist the
        controller, whose interpreter and environment variables its workers share).
        """
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
        from .errors import display

        if not child.returned:
            detail = child.child_error or child.stderr[-2000:]
            pytest.fail(f"{display(case.case_file)}: writing {case.expected_file.name} failed: "
                        f"{child.problem}\n{detail}", pytrace=False)
        if "refused" in child.value:  # the output, not the code: its reason is the message
            pytest.fail(f"{display(case.case_file)}: {child.value['refused']}", pytrace=False)
        self.regenerated[case.path] = child.value["written"]

    def record(self, report: pytest.TestReport) -> None:
        """Keep the JSON record of a finished item; rewrite the report file now and then.

        Rewrites are throttled (a large suite would otherwise rewrite the file once per
        item); what a throttled rewrite leaves out is written at the end of the session,
        however it ends (``pytest_sessionfinish``, else ``pytest_unconfigure``).
        """
        import time

        from .report import crash_record, item_packages, result_record

        record = result_record(report) or crash_record(report)
        if record is None:
            return
        packages = item_packages(report)
        if packages:
            self.environment(packages)
        self.results[report.nodeid] = record
        self._unwritten = True
        if time.monotonic() - self._written_at > REPORT_EVERY:
            self.write_report(complete=False)

    def build_report(self, *, complete: bool) -> dict[str, Any]:
        """The JSON report of what has finished so far."""
        from .report import check_report, new_report, report_version

        report = new_report(self.environment().to_dict(), created=self.created)
        report["results"] = list(self.results.values())
        report["version"] = report_version(report["results"])
        report["complete"] = complete
        check_report(report)   # a record that breaks the schema is a bug here, not in the file
        return report

    def write_report(self, *, complete: bool) -> None:
        """Rewrite the JSON report atomically, so a crash or Ctrl-C leaves what finished."""
        import time

        path: Path | None = self.settings["gpu_cases_report"]
        if path is not None:
            from .report import write_report

            try:
                write_report(path, self.build_report(complete=complete))
            except OSError as exc:   # a full disk, a folder removed: said once, the run goes on
                note = f"could not write the JSON report {path}: {exc.strerror or exc}"
                if note not in self.notes:
                    self.notes.append(note)
                self.report_failed = True
                return
            self._written_at = time.monotonic()
            self._unwritten = False
            self.report_failed = False

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
            from .reference_cache import prime

            prime()  # before the first fork: children inherit the rows of what is loaded
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
    from .report import now

    return now()


session_key = pytest.StashKey[GpuCaseSession]()


def _start_zygote(config: pytest.Config, state: GpuCaseSession) -> None:
    """Start the forkserver's zygote now, before anything in this process can initialize
    CUDA, where runs may need it (auto or forkserver; not on an xdist controller, not for
    ``--collect-only``, which an editor's test view runs at every change and which runs
    nothing: the zygote and the run-time modules it preloads cost a fifth of a second)."""
    from .isolation import forkserver, forkserver_available

    if state.settings["gpu_start_method"] not in ("auto", "forkserver"):
        return
    if config.getoption("collectonly", False):
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # the workers run the items, each with a zygote of its own
    if forkserver_available():
        forkserver()


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


class _SigintWatch:
    """Ctrl-C stops the session even when its ``KeyboardInterrupt`` is lost.

    Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT comes; in a
    finalizer (a ``__del__``, a weakref callback) it is printed as ignored and dropped, and
    the session ran on. The handler also notes the signal: the case that was running is
    then interrupted as its run returns (``CaseItem.runtest``), and no other item starts.
    Only where SIGINT has Python's own handler: one set by someone else is left alone.
    """

    def __init__(self, state: GpuCaseSession) -> None:
        self.state = state
        self.session: pytest.Session | None = None
        self.installed = False

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import signal
        import threading

        self.session = session
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._handle)
            self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.state.sigint_seen = True
        raise KeyboardInterrupt

    def pytest_runtest_logfinish(self) -> None:
        if self.state.sigint_seen and self.session is not None:
            self.session.shouldstop = "interrupted (SIGINT)"

    def pytest_unconfigure(self) -> None:
        import signal

        if self.installed and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)


class _Recorder:
    """Collects results on the process that writes the report (the controller under xdist)."""

    def __init__(self, state: GpuCaseSession) -> None:
        self.state = state
        self._owner = 0
        self._previous: Any = None
        self._done: set[str] = set()   # items whose last report came (teardown, or xdist's crash)
        self._running: dict[str, float] = {}  # started, not finished (one per xdist worker)
        self._interrupt: str | None = None    # what stopped the run, as pytest printed it

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        import time

        self._running[nodeid] = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.state.record(report)
        if report.when in ("teardown", "???"):
            self._done.add(report.nodeid)
            self._running.pop(report.nodeid, None)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # A bare KeyboardInterrupt is what Python raises for SIGINT.
        self._interrupt = str(excinfo.value) or "SIGINT (Ctrl-C)"

    def _record_unfinished(self, session: pytest.Session, complete: bool) -> None:
        """Record what a run that stopped early did not finish, so that the matrix has a
        row for it: the items that were running as ``interrupted`` (the case that hung a
        cancelled job is the one to see), and the case items never started as ``not run``.

        An item running is known from its start (under xdist, the controller hears of
        each worker's); one not started only where this process collected it (not on an
        xdist controller, which has no items: there the unstarted are left out).
        """
        import time

        from .report import item_record, nodeid_fields, property_value

        stopped = session.shouldfail or session.shouldstop
        if complete or session.config.option.collectonly or not (
                self._interrupt or stopped or self._running):
            return   # nothing stopped a run (--collect-only, inline_genitems): none to record
        items = {item.nodeid: item for item in session.items}

        def fields(nodeid: str) -> dict[str, Any] | None:
            item = items.get(nodeid)
            if item is None:
                return nodeid_fields(nodeid)
            for name, value in item.user_properties:
                if name == "gpucase":
                    found: dict[str, Any] = property_value(value)
                    return found
            return None

        why = self._interrupt or "the run was stopped"
        for nodeid, started in self._running.items():
            if nodeid in self.state.results or (spec := fields(nodeid)) is None:
                continue
            self.state.results[nodeid] = item_record(
                nodeid, spec, "interrupted", why, duration=time.monotonic() - started)
        stop = (f"the run was interrupted before it started: {why}" if self._interrupt
                else f"the run stopped before it started ({stopped or 'it ended early'})")
        for nodeid, item in items.items():
            if nodeid in self.state.results or nodeid in self._done or nodeid in self._running:
                continue
            if (spec := fields(nodeid)) is not None and hasattr(item, "spec"):
                self.state.results[nodeid] = item_record(nodeid, spec, "not run", stop)

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
        # Under xdist the items run on the workers; the controller heard which had started.
        running = ", ".join(self._running)
        raise KeyboardInterrupt(f"terminated by signal {signum} ({signal.Signals(signum).name})"
                                + (f" while {running} ran" if running else ""))

    # While a case runs, isolation's own handler ends the run (and names it) instead of this one.
    _terminate.gpucase_interrupts = True  # type: ignore[attr-defined]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import os

        self._asked_devices_missing(session)
        # Whatever the exit status: an interrupted or terminated run still leaves a valid
        # report of every item that finished. Complete means every selected item ran: not
        # after -x or --maxfail stopped early, nor when a cancel reached the xdist workers
        # first and the controller ended "normally" without the item they were running.
        complete = (session.exitstatus != pytest.ExitCode.INTERRUPTED
                    and len(self._done) >= session.testscollected)
        self._record_unfinished(session, complete)
        self.state.write_report(complete=complete)
        self.state._finished = True
        if self.state.report_failed:
            # Asked for and missing (or out of date): a CI job would go green and its runner's
            # column drop out of the matrix without a word.
            self.state.notes.append("the run fails: the JSON report --gpu-cases-report asked "
                                    "for is missing or out of date")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if os.environ.get("GITHUB_STEP_SUMMARY") and self.state.results:
            from .report import append_step_summary

            try:
                append_step_summary(self.state.build_report(complete=complete))
            except OSError as exc:
                # A side output: the run's verdict and its other reports (junit) stand.
                self.state.notes.append(
                    f"could not append the step summary to GITHUB_STEP_SUMMARY "
                    f"({os.environ['GITHUB_STEP_SUMMARY']}): {exc.strerror or exc}; the "
                    "run's results are unchanged")

    def _asked_devices_missing(self, session: pytest.Session) -> None:
        """A device type named by --gpu-devices on the command line that this machine lacks
        fails a run that would pass: a GPU runner that lost its driver, or got a CPU build
        of torch, skipped every item it was there for and turned the gate green. The ini
        key only narrows (a project's setting, read on laptops too), and without either
        such items skip as usual: a machine runs what it can."""
        from .plan import device_skip

        if session.config.getoption("gpu_devices", None) is None:
            return
        asked: tuple[str, ...] = self.state.settings["gpu_devices"] or ()
        env = self.state.environment()
        for device in asked:
            skipped = sum(1 for record in self.state.results.values()
                          if record.get("device") == device and record["outcome"] == "skipped")
            if device_skip(device, env) is None or not skipped:
                continue
            self.state.notes.append(
                f"--gpu-devices asked for {device}, which this machine does not have "
                f"({env.backend} backend, torch {env.torch or 'not installed'}): its "
                f"{skipped} item{'s were' if skipped > 1 else ' was'} skipped, so nothing ran "
                f"on {device}. The run fails: check the runner's driver and torch build, or "
                f"leave {device} out of --gpu-devices where none is expected")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import signal

        if self._owner:
            signal.signal(signal.SIGTERM, self._previous)
        # The session ended before pytest_sessionfinish could write (an error in another
        # plugin's hook, a second Ctrl-C): write what finished, as unfinished.
        if not self.state._finished and (self.state._unwritten or self.state.results):
            self.state.write_report(complete=False)

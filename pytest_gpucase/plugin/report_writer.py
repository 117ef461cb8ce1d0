"""The plugin objects registered on the process that writes the JSON report (the controller
under xdist): ``ReportWriter`` keeps the report current and writes it on every way out;
``SigintWatch`` makes Ctrl-C stop the session even when its ``KeyboardInterrupt`` is lost."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from pytest_gpucase.plan.require import required_names
from pytest_gpucase.plugin.state import GpuCaseSession, SigintLost

__all__ = ["REPORT_EVERY", "ReportWriter", "SigintWatch"]


class SigintWatch:
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


class ReportWriter:
    """Collects results on the process that writes the report (the controller under xdist)."""

    def __init__(self, state: GpuCaseSession) -> None:
        self.state = state
        self._owner = 0
        self._previous: Any = None
        self._done: set[str] = set()   # items whose last report came (teardown, or xdist's crash)
        self._running: dict[str, float] = {}  # started, not finished (one per xdist worker)
        self._interrupt: str | None = None    # what stopped the run, as pytest printed it
        self._unrecorded: set[str] = set()    # case items that ended without a record
        self._lock: int | None = None         # the report's lock, held for the session
        self.results: dict[str, dict[str, Any]] = {}   # nodeid -> JSON record
        # The collected case items, as "not run" until their record comes: what the report
        # says of them when the session dies where it cannot write (a SIGKILL).
        self._pending: dict[str, dict[str, Any]] = {}
        self.created = _now()           # when the run started, said once
        self._written_at = 0.0
        self._unwritten = False         # a record arrived since the report file was last written
        self._finished = False          # the report of the whole session has been written
        self.report_failed = False      # the last write of the report failed (a note says why)
        self._written: tuple[int, int, int] | None = None   # the file as this session left it

    def record(self, report: pytest.TestReport) -> None:
        """Keep the JSON record of a finished item; rewrite the report file now and then.

        Rewrites are throttled (a large suite would otherwise rewrite the file once per
        item); what a throttled rewrite leaves out is written at the end of the session,
        however it ends (``pytest_sessionfinish``, else ``pytest_unconfigure``).
        """
        import time

        from pytest_gpucase.plugin.records import crash_record, item_packages, result_record

        record = result_record(report) or crash_record(report)
        if record is None:
            return
        packages = item_packages(report)
        if packages:
            self.state.environment(packages)
        self.results[report.nodeid] = record
        self._unwritten = True
        if time.monotonic() - self._written_at > REPORT_EVERY:
            self.write_report(complete=False)

    @functools.cached_property
    def _required(self) -> tuple[str, ...]:
        """The extensions the job demands (--gpu-require): recorded whatever imports them."""
        return required_names(self.state.settings.gpu_require or ())

    def build_report(self, *, complete: bool) -> dict[str, Any]:
        """The JSON report of what has finished so far."""
        from pytest_gpucase.report.file import check_report, new_report, report_version

        report = new_report(self.state.environment(self._required).to_dict(),
                            created=self.created)
        report["results"] = [*self.results.values(), *(
            record for nodeid, record in self._pending.items() if nodeid not in self.results)]
        report["version"] = report_version(report["results"])
        report["complete"] = complete
        check_report(report)   # a record that breaks the schema is a bug here, not in the file
        return report

    def write_report(self, *, complete: bool) -> None:
        """Rewrite the JSON report atomically, so a crash or Ctrl-C leaves what finished.

        A report that changed since this session last wrote it was written by another
        writer (where no lock could be taken, or one without a lock): it is left as it is,
        and the run fails saying so, rather than erasing that writer's results in silence.
        """
        import time

        path = self.state.settings.gpu_cases_report
        if path is not None:
            from pytest_gpucase.report.file import write_report

            now = _signature(path)
            # A report removed since (its folder cleaned) erases no one's results: written again.
            if self._written is not None and now is not None and now != self._written:
                self.state.note(f"another writer changed the JSON report {path} while this session "
                          "ran, so this session's results were not written over it: give "
                          "each run its own --gpu-cases-report path")
                self.report_failed = True
                return
            try:
                write_report(path, self.build_report(complete=complete))
            except OSError as exc:   # a full disk, a folder removed: said once, the run goes on
                self.state.note(f"could not write the JSON report {path}: {exc.strerror or exc}")
                self.report_failed = True
                return
            self._written = _signature(path)
            self._written_at = time.monotonic()
            self._unwritten = False
            self.report_failed = False

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        import time

        self._running[nodeid] = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from pytest_gpucase.plan.runs import ItemId

        self.record(report)
        if report.when in ("teardown", "???"):
            self._done.add(report.nodeid)
            self._running.pop(report.nodeid, None)
        # xdist reports an item lost with its worker in a phase named "???".
        if (report.when not in ("setup", "call", "teardown")
                and report.nodeid not in self.results
                and ItemId.is_case_item(report.nodeid)):
            self._unrecorded.add(report.nodeid)   # lost, and not in the report: incomplete

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """An xdist worker's notes (a reference cache refused, say), said once here."""
        notes = getattr(node, "workeroutput", None) or {}
        for note in notes.get("gpucase_notes", ()):
            self.state.note(str(note))

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # A bare KeyboardInterrupt is what Python raises for SIGINT; the item raises its own
        # when that one was lost on the way (SigintLost): the same Ctrl-C.
        value = excinfo.value
        self._interrupt = ("SIGINT (Ctrl-C)" if isinstance(value, SigintLost)
                           else str(value) or "SIGINT (Ctrl-C)")

    def _record_unfinished(self, session: pytest.Session, complete: bool) -> None:
        """Record what a run that stopped early did not finish, so that the matrix has a
        row for it: the items that were running as ``interrupted`` (the case that hung a
        cancelled job is the one to see), and the case items never started as ``not run``.

        An item running is known from its start (under xdist, the controller hears of
        each worker's); one not started only where this process collected it (not on an
        xdist controller, which has no items: there the unstarted are left out).
        """
        import time

        from pytest_gpucase.plugin.records import item_fields, item_record
        from pytest_gpucase.report.file import property_value

        stopped = session.shouldfail or session.shouldstop
        if complete or session.config.option.collectonly or not (
                self._interrupt or stopped or self._running):
            return   # nothing stopped a run (--collect-only, inline_genitems): none to record
        items = {item.nodeid: item for item in session.items}

        def fields(nodeid: str) -> dict[str, Any] | None:
            item = items.get(nodeid)
            if item is None:
                return item_fields(nodeid)
            for name, value in item.user_properties:
                if name == "gpucase":
                    found: dict[str, Any] = property_value(value)
                    return found
            return None

        why = self._interrupt or "the run was stopped"
        for nodeid, started in self._running.items():
            if nodeid in self.results or (spec := fields(nodeid)) is None:
                continue
            self.results[nodeid] = item_record(
                nodeid, spec, "interrupted", why, duration=time.monotonic() - started)
        stop = (f"the run was interrupted before it started: {why}" if self._interrupt
                else f"the run stopped before it started ({stopped or 'it ended early'})")
        for nodeid, item in items.items():
            if nodeid in self.results or nodeid in self._done or nodeid in self._running:
                continue
            if (spec := fields(nodeid)) is not None and hasattr(item, "spec"):
                self.results[nodeid] = item_record(nodeid, spec, "not run", stop)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The report rewritten once the items are known, each case item "not run" until it
        finishes: a session killed where it cannot write its report (an out-of-memory kill,
        a job's time limit) leaves one that names every item it did not finish, incomplete,
        instead of no row for them."""
        from pytest_gpucase.plugin.records import item_fields, item_record

        if self.state.settings.gpu_cases_report is None or session.config.option.collectonly:
            return
        why = ("the session ended before this item finished, without writing its report "
               "(killed: an out-of-memory kill, a job's time limit)")
        for item in session.items:
            fields = item_fields(item.nodeid) if hasattr(item, "spec") else None
            if fields is not None:
                self._pending[item.nodeid] = item_record(item.nodeid, fields, "not run", why)
        if self._pending:
            self.write_report(complete=False)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import os
        import signal

        if self.state.settings.gpu_cases_report is None:
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
                    and len(self._done) >= session.testscollected and not self._unrecorded)
        self._record_unfinished(session, complete)
        self.write_report(complete=complete)
        self._finished = True
        if self.report_failed:
            # Asked for and missing (or out of date): a CI job would go green and its runner's
            # column drop out of the matrix without a word.
            self.state.notes.append("the run fails: the JSON report --gpu-cases-report asked "
                                    "for is missing or out of date")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if os.environ.get("GITHUB_STEP_SUMMARY") and self.results:
            from pytest_gpucase.report.summary import append_step_summary

            try:
                append_step_summary(self.build_report(complete=complete),
                                    exit_status=session.exitstatus, notes=self.state.notes)
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
        from pytest_gpucase.plan.runs import device_skip

        if session.config.getoption("gpu_devices", None) is None:
            return
        asked = self.state.settings.gpu_devices or ()
        env = self.state.environment()
        for device in asked:
            skipped = sum(1 for record in self.results.values()
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

    def lock(self) -> None:
        """Hold the report's lock for the session; a second session aiming at the same path
        (one ini key, two CI jobs on one runner) is a usage error that says who holds it,
        rather than two green runs of which one's results are silently gone."""
        from pytest_gpucase.plugin.report_lock import ReportLocked, lock_report

        path = self.state.settings.gpu_cases_report
        if path is None:
            return
        try:
            self._lock = lock_report(path)
        except ReportLocked as exc:
            raise pytest.UsageError(str(exc)) from None
        # At once, an incomplete report of nothing yet: a report an earlier session left at
        # this path (complete, every item passed) must not outlive a session that is then
        # killed (an out-of-memory kill, a job's time limit) or stops at its start, and be
        # merged as this run's.
        self.write_report(complete=False)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import signal

        if self._owner:
            signal.signal(signal.SIGTERM, self._previous)
        # The session ended before pytest_sessionfinish could write (an error in another
        # plugin's hook, a second Ctrl-C): write what finished, as unfinished.
        if not self._finished and (self._unwritten or self.results):
            self.write_report(complete=False)
        path = self.state.settings.gpu_cases_report
        if self._lock is not None and path is not None:
            from pytest_gpucase.plugin.report_lock import unlock_report

            unlock_report(path, self._lock)
            self._lock = None


REPORT_EVERY = 2.0  # seconds between incremental rewrites of the JSON report


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one write of a file from another (each write replaces it: a new inode)."""
    import os

    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


def _now() -> str:
    from pytest_gpucase.report.file import now

    return now()

"""The plugin's state for one pytest session.

``GpuCaseSession`` (in ``config.stash[session_key]``) holds the resolved settings,
the environment probed once, the notes for the terminal summary, and the JSON
records of finished items, which ``plugin.report_writer`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.environment import Environment
    from pytest_gpucase.run.isolation import StartMethod
    from pytest_gpucase.run.reference_cache import ReferenceCache

__all__ = ["GpuCaseSession", "SigintLost", "add_case_paths", "session_key", "start_zygote"]


class SigintLost(KeyboardInterrupt):
    """Ctrl-C came while a case ran and its own ``KeyboardInterrupt`` was lost on the way
    (raised in a finalizer, say): raised again by the item when its run returns. The report
    tells it as the SIGINT it is."""


@dataclass
class GpuCaseSession:
    """The plugin's state for one pytest session."""

    config: pytest.Config
    settings: dict[str, Any] = field(default_factory=dict)  # every Setting, resolved once
    _env: Environment | None = None
    notes: list[str] = field(default_factory=list)
    regenerated: dict[Path, str | None] = field(default_factory=dict)  # case dir -> file or None
    cases_seen: int = 0  # case directories collected in this process
    sigint_seen: bool = False  # Ctrl-C came (SigintWatch): no item runs on
    filtered_out: list[str] = field(default_factory=list)  # emptied by the filters
    results: dict[str, dict[str, Any]] = field(default_factory=dict)   # nodeid -> JSON record
    created: str = field(default_factory=lambda: _now())   # when the run started, said once
    _written_at: float = 0.0
    _unwritten: bool = False    # a record arrived since the report file was last written
    _finished: bool = False     # the report of the whole session has been written
    report_failed: bool = False  # the last write of the JSON report failed (a note says why)
    renderers: tuple[str, ...] = ()   # report formats this session's plugins added
    _reference_cache: ReferenceCache | None = None
    _written: tuple[int, int, int] | None = None   # the report file as this session left it
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
        from pytest_gpucase.run.probe import probe

        if self._env is None:
            from pytest_gpucase.base.torch_import import import_torch

            import_torch()  # imported once here so that every forked child shares it

            self._env = probe(rootdir=str(self.config.rootpath))
        self._env = self._env.with_packages(packages)   # versions and builds
        return self._env

    def regenerate(self, case: Case) -> None:
        """Write the case's golden once per session (the first of its items asks)."""
        from pytest_gpucase.run.parent import regenerate_golden

        if case.path in self.regenerated:
            return
        self.regenerated[case.path] = None
        child = regenerate_golden(case, start_method=self.start_method())
        from pytest_gpucase.base.errors import display

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

        from pytest_gpucase.plugin.records import crash_record, item_packages, result_record

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
        from pytest_gpucase.report.file import check_report, new_report, report_version

        report = new_report(self.environment().to_dict(), created=self.created)
        report["results"] = list(self.results.values())
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

        path: Path | None = self.settings["gpu_cases_report"]
        if path is not None:
            from pytest_gpucase.report.file import write_report

            if self._written is not None and _signature(path) != self._written:
                self.note(f"another writer changed the JSON report {path} while this session "
                          "ran, so this session's results were not written over it: give "
                          "each run its own --gpu-cases-report path")
                self.report_failed = True
                return
            try:
                write_report(path, self.build_report(complete=complete))
            except OSError as exc:   # a full disk, a folder removed: said once, the run goes on
                self.note(f"could not write the JSON report {path}: {exc.strerror or exc}")
                self.report_failed = True
                return
            self._written = _signature(path)
            self._written_at = time.monotonic()
            self._unwritten = False
            self.report_failed = False

    def worker_env(self) -> dict[str, str]:
        """The device pin of this xdist worker's children (``--gpu-per-worker``), or {}."""
        import os

        from pytest_gpucase.plan.pinning import pin_env

        if not self.settings["gpu_per_worker"]:
            return {}
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        env = self.environment()
        return pin_env(worker, env.backend, len(env.devices), os.environ)

    def reference_cache(self) -> ReferenceCache:
        """Where children cache the float64 references, and the key that authenticates them:
        pytest's cache with the user's key; else (no pytest cache, a folder that passes
        through a symlink, no private place for a key: said once in a note) a private
        temporary folder with a key of its own, removed at the end of the session."""
        if self._reference_cache is None:
            from pytest_gpucase.run.reference_cache import Unusable, prime, session_cache

            prime()  # before the first fork: children inherit the rows of what is loaded
            try:
                self._reference_cache = self._persistent_cache()
            except Unusable as exc:
                self.note(f"reference cache: {exc}; references are cached for this session "
                          "only, in a private temporary folder")
            if self._reference_cache is None:
                self._reference_cache = session_cache()
                assert self._reference_cache.temporary is not None
                self._temporary.append(self._reference_cache.temporary)
        return self._reference_cache

    def _persistent_cache(self) -> ReferenceCache | None:
        """pytest's cache folder of references with the user's key; None without a pytest
        cache (-p no:cacheprovider); ``Unusable`` when either cannot be trusted."""
        import os

        from pytest_gpucase.run.reference_cache import (
            ReferenceCache,
            check_folder,
            open_folder,
            user_key,
        )

        cache = getattr(self.config, "cache", None)
        if cache is None:
            return None
        root_path = self.config.rootpath
        # Where pytest keeps its cache (the ini key cache_dir, as pytest resolves it), computed
        # rather than made: pytest's mkdir would create folders through a link.
        given = os.path.expandvars(os.path.expanduser(str(self.config.getini("cache_dir"))))
        folder = Path(os.path.abspath(Path(root_path, given, "d", "gpucase-references")))
        # Links above the rootdir are the user's own layout; below it, a link may come
        # with the project (a pull request can commit one).
        base = root_path if folder.is_relative_to(root_path) else folder.parent.parent.parent
        check_folder(folder, base)
        made = Path(cache.mkdir("gpucase-references"))
        if made != folder:
            base = made.parent.parent.parent
            check_folder(made, base)
        os.close(open_folder(made, base))
        return ReferenceCache(made, user_key((root_path,)), base=base)

    def note(self, text: str) -> None:
        """A line for the terminal summary, said once (under xdist, the workers' reach the
        controller's summary: ``pytest_testnodedown``)."""
        if text not in self.notes:
            self.notes.append(text)

    def pool(self) -> Any:
        """The session's reusable children (``--gpu-isolation``), or None for ``item``."""
        if self.settings["gpu_isolation"] == "item":
            return None
        if self._pool is None:
            from pytest_gpucase.run.isolation import WorkerPool

            self._pool = WorkerPool()
        return self._pool

    def start_method(self) -> StartMethod:
        from pytest_gpucase.run.isolation import default_start_method

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


session_key = pytest.StashKey[GpuCaseSession]()


def start_zygote(config: pytest.Config, state: GpuCaseSession) -> None:
    """Start the forkserver's zygote now, before anything in this process can initialize
    CUDA, where runs may need it (auto or forkserver; not on an xdist controller, not for
    ``--collect-only``, which an editor's test view runs at every change and which runs
    nothing: the zygote and the run-time modules it preloads cost a fifth of a second)."""
    from pytest_gpucase.run.isolation import forkserver, forkserver_available

    if state.settings["gpu_start_method"] not in ("auto", "forkserver"):
        return
    if config.getoption("collectonly", False):
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # the workers run the items, each with a zygote of its own
    if forkserver_available():
        forkserver()


def add_case_paths(config: pytest.Config, paths: tuple[str, ...]) -> None:
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

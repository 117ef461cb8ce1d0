"""The plugin's state for one pytest session.

``GpuCaseSession`` (in ``config.stash[session_key]``) holds the typed settings, the
environment probed once, the session's ``RunContext`` (built once: every run of the
session goes through it) and the notes for the terminal summary. The JSON report's records
and its writing are ``plugin.report_writer.ReportWriter``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpucase.base.errors import display_posix
from pytest_gpucase.plugin.settings import Settings

if TYPE_CHECKING:
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.environment import Environment
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.isolation import StartMethod
    from pytest_gpucase.run.reference_cache import ReferenceCache
    from pytest_gpucase.run.runcontext import RunContext

__all__ = ["GpuCaseSession", "SigintLost", "add_case_paths", "passed_over", "session_key",
           "start_zygote"]


class SigintLost(KeyboardInterrupt):
    """Ctrl-C came while a case ran and its own ``KeyboardInterrupt`` was lost on the way
    (raised in a finalizer, say): raised again by the item when its run returns. The report
    tells it as the SIGINT it is."""


@dataclass
class GpuCaseSession:
    """The plugin's state for one pytest session."""

    config: pytest.Config
    settings: Settings
    _env: Environment | None = None
    notes: list[str] = field(default_factory=list)
    regenerated: dict[Path, str | None] = field(default_factory=dict)  # case dir -> file or None
    cases_seen: int = 0  # case directories collected in this process
    sigint_seen: bool = False  # Ctrl-C came (SigintWatch): no item runs on
    filtered_out: list[str] = field(default_factory=list)  # emptied by the filters
    renderers: tuple[str, ...] = ()   # report formats this session's plugins added
    case_roots: tuple[Path, ...] | None = None   # gpu_cases_paths, in a run given no path
    outside_paths: list[str] = field(default_factory=list)  # case folders left out by them
    _context: RunContext | None = None
    _temporary: list[Path] = field(default_factory=list)  # removed at pytest_unconfigure
    # A test that is no case item ran in this process: what it left here (a torch setting,
    # a monkeypatch) a forked child would inherit (``run_context``).
    others_ran: bool = False

    @property
    def enabled(self) -> bool:
        return self.settings.gpu_cases

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
        child = regenerate_golden(case, self.run_context())
        from pytest_gpucase.base.errors import display

        if not child.returned:
            detail = child.child_error or child.stderr[-2000:]
            pytest.fail(f"{display(case.case_file)}: writing {case.expected_file.name} failed: "
                        f"{child.problem}\n{detail}", pytrace=False)
        if "refused" in child.value:  # the output, not the code: its reason is the message
            pytest.fail(f"{display(case.case_file)}: {child.value['refused']}", pytrace=False)
        self.regenerated[case.path] = child.value["written"]

    def run_context(self, item: pytest.Item | None = None) -> RunContext:
        """The session's ``RunContext``, built on first use; with ``item``, its
        ``pytest_gpucase_run_env`` hook asked for every run that item makes (its own, its
        launch-blocking rerun, its ablation, a ``gpu_case`` fixture's runs)."""
        if self._context is None:
            from pytest_gpucase.run.runcontext import RunContext

            settings = self.settings
            self._context = RunContext(
                start_method=self._start_method(), backend=self.environment().backend,
                localize=not settings.gpu_no_localize, memory_limit=settings.gpu_memory_limit,
                pin=self._worker_pin(), reference_cache=self._reference_cache_here(),
                isolation=settings.gpu_isolation, pool=self._pool_here())
        if self.others_ran and self._context.start_method == "fork":
            self._context = self._apart_from_other_tests(self._context)
        if item is None:
            return self._context
        hook = item.ihook.pytest_gpucase_run_env

        def run_env(spec: RunSpec) -> dict[str, str]:
            # hookspecs.pytest_gpucase_run_env: merged in the order pluggy calls them.
            merged: dict[str, str] = {}
            for found in hook(item=item, spec=spec):
                if found:
                    merged.update({str(k): str(v) for k, v in found.items()})
            return merged

        return replace(self._context, run_env=run_env)

    def _apart_from_other_tests(self, context: RunContext) -> RunContext:
        """The runs after the session's own tests ran in this process: forked by the zygote,
        started at ``pytest_configure`` before any test, where one runs (``auto`` start
        method), so that nothing a test left here (a torch setting such as the autocast
        dtype, a monkeypatched function) reaches a case's child; else said once."""
        from pytest_gpucase.run.isolation import zygote_running

        if self.settings.gpu_start_method == "auto" and zygote_running():
            self.note("tests that are no case items ran in this session before case items, "
                      "so the cases' children are forked by the zygote started before any "
                      "test (nothing a test left in the pytest process reaches them), at "
                      "some cost per item: run --gpu-cases in a session of its own to avoid it")
            return replace(context, start_method="forkserver")
        self.note("tests that are no case items ran in this session before case items, and "
                  "the cases' children are forked from the pytest process: what those tests "
                  "left there (a torch setting, a monkeypatched function) reaches them; run "
                  "--gpu-cases in a session of its own")
        return context

    def _worker_pin(self) -> dict[str, str]:
        """The device pin of this xdist worker's children (``--gpu-per-worker``), or {}."""
        import os

        from pytest_gpucase.plan.pinning import pin_env

        if not self.settings.gpu_per_worker:
            return {}
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        env = self.environment()
        return pin_env(worker, env.backend, len(env.devices), os.environ)

    def _reference_cache_here(self) -> ReferenceCache:
        """Where children cache the float64 references, and the key that authenticates them:
        pytest's cache with the user's key; else (no pytest cache, a folder that passes
        through a symlink, no private place for a key: said once in a note) a private
        temporary folder with a key of its own, removed at the end of the session."""
        from pytest_gpucase.run.reference_cache import Unusable, prime, session_cache

        prime()  # before the first fork: children inherit the rows of what is loaded
        cache: ReferenceCache | None = None
        try:
            cache = self._persistent_cache()
        except Unusable as exc:
            self.note(f"reference cache: {exc}; references are cached for this session "
                      "only, in a private temporary folder")
        if cache is None:
            cache = session_cache()
            assert cache.temporary is not None
            self._temporary.append(cache.temporary)
        return cache

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

    def close(self) -> None:
        """The session's end: remove its temporary folders, prune its reference cache."""
        import shutil

        for path in self._temporary:
            shutil.rmtree(path, ignore_errors=True)
        cache = self._context.reference_cache if self._context is not None else None
        if cache is not None and cache.temporary is None:  # a temporary one is gone already
            from pytest_gpucase.run.reference_cache import prune

            prune(cache.folder, base=cache.base)

    def note(self, text: str) -> None:
        """A line for the terminal summary, said once (under xdist, the workers' reach the
        controller's summary: ``pytest_testnodedown``)."""
        if text not in self.notes:
            self.notes.append(text)

    def _pool_here(self) -> Any:
        """The session's reusable children (``--gpu-isolation``), or None for ``item``."""
        if self.settings.gpu_isolation == "item":
            return None
        from pytest_gpucase.run.isolation import WorkerPool

        return WorkerPool()

    def _start_method(self) -> StartMethod:
        from pytest_gpucase.run.isolation import default_start_method

        chosen = self.settings.gpu_start_method
        if chosen != "auto":
            return chosen
        method = default_start_method()
        # Only where there is no zygote (not Linux): with one, forkserver costs a fork.
        if method == "spawn":
            self.note("CUDA was initialized in the pytest process, so each run starts a fresh "
                      "interpreter (spawn) instead of a fork: every run pays for importing "
                      "torch again")
        return method


session_key = pytest.StashKey[GpuCaseSession]()


def start_zygote(config: pytest.Config, state: GpuCaseSession) -> None:
    """Start the forkserver's zygote now, before anything in this process can initialize
    CUDA, where runs may need it (auto or forkserver; not on an xdist controller, not for
    ``--collect-only``, which an editor's test view runs at every change and which runs
    nothing: the zygote and the run-time modules it preloads cost a fifth of a second)."""
    from pytest_gpucase.run.isolation import forkserver, forkserver_available

    if state.settings.gpu_start_method not in ("auto", "forkserver"):
        return
    if config.getoption("collectonly", False):
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # the workers run the items, each with a zygote of its own
    if forkserver_available():
        forkserver()


def add_case_paths(config: pytest.Config, state: GpuCaseSession) -> None:
    """With no path on the command line, cases come from ``gpu_cases_paths`` alone.

    As pytest's ``testpaths``: read when pytest runs in the rootdir with no path given;
    each entry is a folder or a glob relative to the rootdir. The folders are added to what
    pytest collects (its ``testpaths`` or the rootdir: the user's tests still run), and a
    case folder outside them is not collected (``passed_over``): a stale case elsewhere
    under the rootdir stays out of the run. A path on the command line is collected as
    given, and this key is not read.
    """
    import glob

    paths = state.settings.gpu_cases_paths
    root = config.rootpath
    if (not paths or config.args_source == pytest.Config.ArgsSource.ARGS
            or config.invocation_params.dir != root):
        return
    roots: list[Path] = []
    for entry in paths:
        found = sorted(glob.iglob(str(root / entry), recursive=True))
        if not found:
            raise pytest.UsageError(
                f"ini key gpu_cases_paths: {display_posix(Path(entry))} matches nothing; list "
                "case folders (or globs) relative to the rootdir")
        roots.extend(Path(name).resolve() for name in found)
    state.case_roots = tuple(roots)
    given = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    for path in roots:
        if not any(path == arg or arg in path.parents for arg in given):
            config.args.append(str(path))


def passed_over(path: Path, state: GpuCaseSession) -> bool:
    """Whether ``path``, a case folder, lies outside the session's ``gpu_cases_paths`` (a
    run with no path given): not collected, and counted for the summary's line."""
    roots = state.case_roots
    if roots is None:
        return False
    from pytest_gpucase.case.model import looks_like_case

    if not looks_like_case(path):
        return False
    resolved = path.resolve()
    if any(resolved == root or root in resolved.parents for root in roots):
        return False
    state.outside_paths.append(display_posix(path))
    return True

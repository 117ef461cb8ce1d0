"""The pytest plugin (entry point ``pytest_gpucase.plugin``): hooks, a few lines each.

The work is done in the modules beside this one: ``settings`` (options and ini keys),
``state`` (the session's state), ``report_writer`` (the JSON report, on the controller),
``items`` (collection and case items), ``fixtures`` (what ordinary tests use), ``records``
(an item's JSON record). Kept light: nothing here imports torch at module level, so a
plain ``pytest`` run that uses no case pays nothing; the engine is imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpucase.base.errors import display_posix
from pytest_gpucase.plan.require import unmet_requirement
from pytest_gpucase.plugin.fixtures import (  # noqa: F401 - fixtures must be attributes of the plugin module
    BadMarker,
    bad_marker_key,
    gpu_case,
    gpu_device,
    gpu_dtype,
    parametrize,
    requirements_from_marker,
)
from pytest_gpucase.plugin.items import (
    BrokenCaseItem,
    CaseDirectory,
    CaseFile,
    CaseItem,
    _OwnIsolation,
    ignored_case,
    refuse_case_configuration,
    refuse_case_conftests,
    run_markers,
    share_conftests,
)
from pytest_gpucase.plugin.report_writer import ReportWriter, SigintWatch
from pytest_gpucase.plugin.settings import SETTINGS, Settings, add_options
from pytest_gpucase.plugin.state import (
    GpuCaseSession,
    add_case_paths,
    passed_over,
    session_key,
    start_zygote,
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpucase.plugin import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before pytest imports the conftests of the folders it is given: none in a case folder;
    # and before it applies a configuration file's pythonpath: none of a case folder's.
    refuse_case_conftests(early_config.pluginmanager)
    refuse_case_configuration(early_config)


def pytest_configure(config: pytest.Config) -> None:
    refuse_case_conftests(config.pluginmanager)  # a plugin registered after the early hooks
    state = GpuCaseSession(config, Settings.read(config))
    config.stash[session_key] = state
    if unmet := unmet_requirement(state.settings.gpu_require):   # --gpu-require
        if state.enabled and not hasattr(config, "workerinput"):
            _report_folder(state.settings.gpu_cases_report)
            writer = ReportWriter(state)
            config.pluginmanager.register(writer, "gpucase-recorder")
            writer.lock()   # the report says this run is incomplete, not the last one's pass
        raise pytest.UsageError(unmet)
    formats = config.hook.pytest_gpucase_report_formats()   # hookspecs.py
    if any(formats):   # report.py is imported only when a plugin adds a format
        from pytest_gpucase.report.render import add_renderers

        state.renderers = add_renderers(formats)
    if not state.enabled:
        given = [spec.flag for spec in SETTINGS
                 if spec.needs_cases and config.getoption(spec.name, None)]
        if given:
            raise pytest.UsageError(
                f"{given[0]} needs --gpu-cases (or gpu_cases = true in the ini): without it no "
                "case is collected, so it would change nothing")
    else:
        add_case_paths(config, state)
    if state.enabled:
        from pytest_gpucase.base.torch_import import import_torch

        import_torch()  # before any engine module imports it, and before anything can fork
        from pytest_gpucase.run.reference_cache import forget_primed

        forget_primed()  # a previous session's module rows must not reach this one's zygote
        from pytest_gpucase.run.isolation import adopt_orphans

        # Every process of the session (the xdist controller too) adopts the orphans below
        # it, so that what a run or a SIGKILLed worker leaves is swept at unconfigure.
        adopt_orphans()
        start_zygote(config, state)
    if state.enabled and not hasattr(config, "workerinput"):
        _report_folder(state.settings.gpu_cases_report)
        writer = ReportWriter(state)
        config.pluginmanager.register(writer, "gpucase-recorder")
        writer.lock()   # registered first: its unconfigure releases the lock, however it ends
        config.pluginmanager.register(SigintWatch(state), "gpucase-sigint")
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


def pytest_unconfigure(config: pytest.Config) -> None:
    import sys

    isolation = sys.modules.get("pytest_gpucase.run.isolation")
    if isolation is not None:
        isolation.shutdown()  # no child, zombie or zygote outlives the session
    state = config.stash.get(session_key, None)
    if state is not None:
        state.close()
    if state is not None and state.renderers:
        from pytest_gpucase.report.render import RENDERERS

        for name in state.renderers:
            RENDERERS.pop(name, None)   # the next session in this process asks its own plugins


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its notes go to the controller's summary
        workeroutput["gpucase_notes"] = list(session.config.stash[session_key].notes)


def pytest_collection_finish(session: pytest.Session) -> None:
    state = session.config.stash[session_key]
    if outside := state.outside_paths:
        state.note(f"{len(outside)} case folder{'s' if len(outside) > 1 else ''} outside "
                   "gpu_cases_paths not collected (" + ", ".join(outside[:3])
                   + (", ..." if len(outside) > 3 else "") + "): name a folder on the "
                   f"command line to run it (pytest --gpu-cases {outside[0]})")
    if state.enabled and state.settings.gpu_isolation == "item":
        _expect_forks(session)
    if hasattr(session.config, "workerinput"):
        return
    if not state.enabled:
        if not session.items and not session.testsfailed:
            _hint_gpu_cases(session.config, state)
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


def _expect_forks(session: pytest.Session) -> None:
    """Tell isolation about how many children this process will fork, one per case item (its
    share of them under xdist): what its memory's huge pages are worth (run/isolation/
    hugepages.py). A zygote's forks are its own; a hint is harmless where nothing forks.
    The workers are this session's (its ``workerinput``), not PYTEST_XDIST_WORKER_COUNT,
    which a pytest run inside an xdist worker inherits."""
    from pytest_gpucase.run.isolation import expect_forks

    items = sum(isinstance(item, CaseItem) for item in session.items)
    workers = getattr(session.config, "workerinput", {}).get("workercount", 1)
    expect_forks(items // (workers if isinstance(workers, int) and workers > 0 else 1))


def _hint_gpu_cases(config: pytest.Config, state: GpuCaseSession) -> None:
    """When a run without --gpu-cases collected nothing, say so if what it was given holds
    case folders (a forgotten flag). Looked for only then, two levels deep: nothing is
    added to a plain run that collects tests."""
    from pytest_gpucase.case.model import is_case_dir

    def case_dirs(path: Path, depth: int) -> list[str]:
        if is_case_dir(path):
            return [display_posix(path)]
        if depth == 0:
            return []
        try:
            below = sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
        except OSError:
            return []
        return [found for sub in below for found in case_dirs(sub, depth - 1)]

    found = [name for arg in config.args for name in case_dirs(Path(arg.split("::")[0]), 2)]
    if found:
        given = (" " + " ".join(config.args)
                 if config.args_source == pytest.Config.ArgsSource.ARGS else "")
        state.notes.append(
            f"{len(found)} case folder{'s' if len(found) > 1 else ''} ("
            + ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            + f") not collected: cases run with --gpu-cases (pytest --gpu-cases{given})")


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash[session_key]
    if not state.enabled:
        return None
    return state.environment().header()


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if not parent.config.stash[session_key].enabled or path.name.startswith("."):
        return None  # hidden: a recorder's unfinished write, never a case
    from pytest_gpucase.case.model import looks_like_case

    if looks_like_case(path):  # one that lost its case.toml too: a broken case, not silence
        share_conftests(path, parent)
        return CaseDirectory.from_parent(parent, path=path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Any:
    from pytest_gpucase.case.model import looks_like_case

    ignored = yield
    state = config.stash[session_key]
    if (not ignored and not state.enabled and collection_path.is_dir()
            and looks_like_case(collection_path)):
        # Without --gpu-cases nothing collects a case, and nothing else may import its code
        # into this process (--doctest-modules, python_files = *.py): a case's code runs
        # only in its child. Its files are then never reached; one given on the command
        # line is stopped at its collector (pytest_make_collect_report).
        return True
    if (ignored and state.enabled
            and not collection_path.name.startswith(".")):
        ignored_case(collection_path, config)
    if not ignored and state.enabled and passed_over(collection_path, state):
        return True   # a case folder outside gpu_cases_paths, in a run given no path
    return ignored


@pytest.hookimpl(tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport | None:
    """A file of a case folder given on the command line (``pytest cases/x/case.py``) is
    collected even where ``pytest_ignore_collect`` says no: another plugin's collector of
    it (the doctest one) would import the case's code into this process. It yields no
    items, and nothing of it is imported; the case's own collector (``case.toml``) runs."""
    from pytest_gpucase.case.model import is_case_dir

    if (isinstance(collector, pytest.File) and not isinstance(collector, CaseFile)
            and is_case_dir(collector.path.parent)):
        return pytest.CollectReport(collector.nodeid, "passed", None, [])
    return None


def _report_folder(path: Path | None) -> None:
    """Make the JSON report's folder now: a path that cannot hold a file is a usage error
    before anything runs, not an internal error at the first item's write."""
    if path is None:
        return
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a file is in the way" if isinstance(exc, FileExistsError) else exc.strerror
        raise pytest.UsageError(f"--gpu-cases-report {display_posix(path)}: cannot make its "
                                f"folder ({why or exc}); give a path in a folder you can "
                                "write") from None
    try:   # a folder that exists but holds no file (/proc, read-only): found before any run
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".gpucase-probe-"):
            pass
    except OSError as exc:
        raise pytest.UsageError(f"--gpu-cases-report {display_posix(path)}: cannot write a "
                                f"file in its folder ({exc.strerror or exc}); give a path in "
                                "a folder you can write") from None


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[session_key]
    for note in state.notes:
        terminalreporter.write_line(f"gpucase: {note}", yellow=True)
    written = [path for path in state.regenerated.values() if path]
    if written:
        terminalreporter.write_sep("-", "gpucase: golden files written")
        for path in written:
            terminalreporter.write_line(display_posix(Path(path)))
    report_path = state.settings.gpu_cases_report
    writer = config.pluginmanager.get_plugin("gpucase-recorder")
    if (report_path is not None and isinstance(writer, ReportWriter)
            and not writer.report_failed):
        terminalreporter.write_line(f"gpucase: JSON report written to {report_path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu_requires")]
    if not marked:
        return
    from pytest_gpucase.plan.runs import evaluate

    state = config.stash[session_key]
    for item in marked:
        marker = item.get_closest_marker("gpu_requires")
        assert marker is not None
        try:
            requirements = requirements_from_marker(item.nodeid, tuple(marker.args),
                                                    dict(marker.kwargs))
        except BadMarker as exc:  # this test errors at its setup; the others run
            item.stash[bad_marker_key] = str(exc)
            continue
        reason = evaluate(requirements, state.environment(tuple(requirements.packages)))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not isinstance(item, (CaseItem, BrokenCaseItem)):
        state = item.config.stash.get(session_key, None)
        if state is not None and state.enabled:
            state.others_ran = True   # what it leaves here must not reach a case's child
    problem = item.stash.get(bad_marker_key, None)
    if problem is not None:
        # As pytest does for a skipif condition it cannot evaluate: an error of this test.
        pytest.fail(problem, pytrace=False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize(metafunc)

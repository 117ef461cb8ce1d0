"""What pytest collects and runs: case directories and their items.

A case directory is a ``CaseDirectory`` whose one file node is its ``case.toml``
(``CaseFile``), with one ``CaseItem`` per run (device x dtype x variant) planned
by ``plan.runs``, or one ``BrokenCaseItem`` when the case cannot load. Each item
runs in a fresh child (``run.parent.run_spec``) and reads its verdict back; the
known-failure rule of a strict xfail is here too. Fixtures are ``plugin.fixtures``.
Nothing here imports torch at module level.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpucase.base.errors import display_posix
from pytest_gpucase.plugin.state import SigintLost, session_key

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr

    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.outcome import Outcome
    from pytest_gpucase.run.parent import Verdict

__all__ = [
    "BrokenCaseItem",
    "CaseDirectory",
    "CaseItem",
    "ignored_case",
    "is_known_failure",
    "refuse_case_configuration",
    "refuse_case_conftests",
    "run_markers",
    "share_conftests",
    "skip_here",
]


def run_markers() -> list[tuple[str, str]]:
    """The markers each case item may carry, read off the tables that define them.

    Devices and backends from ``backends.py``, dtypes from ``case.FLOAT_DTYPES``,
    variant kinds from ``variants.VARIANT_KINDS``: a row added there is a marker
    here, so ``--strict-markers`` never rejects an item's own marker.
    """
    from pytest_gpucase.base.backends import BACKENDS, DEVICE_TYPES
    from pytest_gpucase.case.model import FLOAT_DTYPES
    from pytest_gpucase.case.variants import VARIANT_KINDS

    return [
        *((f"device_{device}", f"a gpucase run on {device}") for device in DEVICE_TYPES),
        *((f"dtype_{dtype}", f"a gpucase run in {dtype}") for dtype in FLOAT_DTYPES),
        *((f"variant_{kind}", f"a gpucase {kind} edge variant") for kind in VARIANT_KINDS),
        *((f"backend_{backend}", f"a gpucase run on the {backend} backend")
          for backend in BACKENDS),
    ]


class CaseDirectory(pytest.Directory):
    """A case directory: its ``case.toml`` is the one file collected from it.

    Items live under the ``case.toml`` file node, so that an item's id
    (``cases/ce_class4/case.toml::ce_class4[cpu-float32]``) is a path pytest
    accepts on its command line, and ``--lf``/``--sw`` can narrow to it.
    """

    def collect(self) -> Iterator[pytest.Collector]:
        yield CaseFile.from_parent(self, path=self.path / "case.toml")


def share_conftests(path: Path, parent: pytest.Collector) -> None:
    """Give a case directory its parent's conftest modules, and never its own.

    pytest looks for ``conftest.py`` in every directory it collects, walking up from
    it to the root, and imports what it finds: in a case folder, that would run a case's
    code in the pytest process (``case.load`` refuses such a case instead). A case
    directory's list is its parent's (pytest builds a directory's list from its
    parent's), so it is filled in from there, which also saves a dozen ``stat`` calls
    per case. Only when pytest keeps the table this relies on (a private one, checked
    here) and has the parent's entry; otherwise pytest searches, and
    ``refuse_case_conftests`` keeps it from importing a case folder's conftest.py.
    """
    known = getattr(parent.config.pluginmanager, "_dirpath2confmods", None)
    if (not isinstance(known, dict) or path in known or parent.path != path.parent
            or not isinstance(inherited := known.get(parent.path), list)):
        return
    known[path] = list(inherited)


def refuse_case_conftests(pluginmanager: pytest.PytestPluginManager) -> None:
    """Make pytest skip every ``conftest.py`` that lies in a case folder, whatever asks for it.

    pytest imports conftests of the folders on its command line before collection starts
    (and of their ``test*`` subfolders), and of each folder it collects: all through
    one private method, wrapped here so that a conftest.py in a case folder is never
    imported (its case fails to load instead, naming it). Where pytest has no such method
    (a later pytest), ``share_conftests`` still covers the folders collected.
    """
    original = getattr(pluginmanager, "_importconftest", None)
    if original is None or getattr(original, "gpucase_refuses_cases", False):
        return
    from pytest_gpucase.case.model import inside_case

    def _importconftest(conftestpath: Path, *args: Any, **kwargs: Any) -> Any:
        if inside_case(conftestpath):
            return _REFUSED  # an empty module: nothing of the file is read or run
        return original(conftestpath, *args, **kwargs)

    _importconftest.gpucase_refuses_cases = True  # type: ignore[attr-defined]
    pluginmanager._importconftest = _importconftest  # type: ignore[method-assign]


def refuse_case_configuration(config: pytest.Config) -> None:
    """Stop the session when pytest took its configuration file from a case folder (it was
    given that folder, or a path in it): a case's file would set the session's options and
    its ``pythonpath``. pytest reads the file before any plugin loads; this runs before it
    applies ``pythonpath`` or imports a conftest."""
    inipath = getattr(config, "inipath", None)
    if inipath is None:
        return
    from pytest_gpucase.case.model import inside_case

    if inside_case(inipath):
        raise pytest.UsageError(
            f"{display_posix(inipath)}: pytest took its configuration from a file inside a case "
            "folder, which a case may not hold (docs/case-format.md); run pytest on the "
            "folder of cases (pytest --gpu-cases cases), or give the project's file with -c")


def ignored_case(path: Path, config: pytest.Config) -> None:
    """Say so when pytest ignores a case folder (``--ignore``, ``collect_ignore``, or a
    ``norecursedirs`` pattern such as ``build`` or ``dist`` matching its name): a case is
    never passed over in silence (``gpucase validate`` checks it all the same)."""
    from pytest_gpucase.case.model import looks_like_case

    if not looks_like_case(path):
        return
    import fnmatch

    matched = [pattern for pattern in config.getini("norecursedirs")
               if fnmatch.fnmatch(path.name, pattern)]
    why = (f"its name matches norecursedirs {matched[0]!r}; rename it or set norecursedirs"
           if matched else "pytest ignores it (--ignore, --ignore-glob, collect_ignore, or "
           "a virtual environment's folder)")
    config.stash[session_key].notes.append(
        f"case folder {display_posix(path)} not collected: {why}")


_REFUSED = types.ModuleType("gpucase_refused_conftest",
                            "A case folder's conftest.py, never imported (plugin.items).")


class CaseFile(pytest.File):
    """A case's ``case.toml``: one item per run (device x dtype x variant)."""

    def collect(self) -> Iterator[pytest.Item]:
        from pytest_gpucase.base.backends import run_backend
        from pytest_gpucase.base.errors import CaseFormatError
        from pytest_gpucase.case.load import load_case
        from pytest_gpucase.plan.runs import expand, label_dtype, one_dtype_without_floats

        state = self.config.stash[session_key]
        case_dir = self.path.parent
        try:
            case = load_case(case_dir)
            # The dtype that names the items where [matrix] dtypes does not (plan.runs).
            saved = None if case.matrix.dtypes else label_dtype(case)
            specs = expand(
                case, state.environment(tuple(case.matrix.packages)),
                saved_dtype=saved,
                devices=state.settings.gpu_devices,
                dtypes=state.settings.gpu_dtypes,
                launch_blocking=state.settings.gpu_launch_blocking,
            )
            specs = one_dtype_without_floats(case, specs)
        except Exception as exc:  # whatever the files hold: one failed item, the session goes on
            from pytest_gpucase.base.errors import display
            from pytest_gpucase.case.model import CASE_FILE, case_name

            problem = str(exc) if isinstance(exc, CaseFormatError) else (
                f"{display(case_dir / CASE_FILE)}: the case cannot be loaded: "
                f"{type(exc).__name__}: {exc}")
            yield BrokenCaseItem.from_parent(self, name=case_name(case_dir), problem=problem,
                                             case_path=display_posix(case_dir))
            return
        state.cases_seen += 1
        if not specs:
            state.filtered_out.append(f"{case.name} (its runs: {_case_runs(case, saved)})")
        build = state.environment().backend
        case_path = display_posix(case_dir) if specs else ""  # once per case, not per item
        for spec in specs:
            item = CaseItem.from_parent(self, name=spec.item_name(), spec=spec,
                                        case_path=case_path,
                                        **_item_id(self, case.name, spec.id))
            # torch.cuda is CUDA on NVIDIA builds and HIP on ROCm builds: backends.py knows.
            item.add_marker(_mark(f"backend_{run_backend(spec.device, build)}"))
            yield item


@functools.cache
def _mark(name: str) -> pytest.MarkDecorator:
    """The marker ``name`` (all registered in pytest_configure), made once, not per item."""
    return getattr(pytest.mark, name)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _skip_mark(reason: str) -> pytest.MarkDecorator:
    """A skip marker, made once per reason: every item of a device missing here shares one."""
    return pytest.mark.skip(reason=reason)


@functools.lru_cache(maxsize=256)
def _xfail_mark(reason: str) -> pytest.MarkDecorator:
    """A case's xfail marker: only the known failure counts as xfailed (``KnownFailure``);
    any other failure is a failure."""
    return pytest.mark.xfail(reason=reason, strict=True, raises=KnownFailure)


def _item_id(parent: pytest.Collector, name: str, params: str) -> dict[str, Any]:
    """pytest >= 9.2 keeps structured ids and matches ``--lf`` on them: give the item its
    params as parametrized functions have them, or ``name[params]`` never equals itself."""
    parent_id = getattr(parent, "id", None)
    if parent_id is None or not hasattr(parent_id, "with_params"):
        return {}
    return {"nodeid": parent_id.child(name).with_params(params)}


def _case_runs(case: Case, saved: str | None) -> str:
    devices = ", ".join(case.matrix.devices or ("any device",))
    dtypes = ", ".join(case.matrix.dtypes or (f"{saved or 'float32'} (its saved dtype)",))
    return f"devices {devices}; dtypes {dtypes}"


class BrokenCaseItem(pytest.Item):
    """A case that cannot be loaded: one failing item, so that the other cases still run."""

    def __init__(self, *, problem: str, case_path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.problem = problem
        from pytest_gpucase.report.file import property_json

        # Recorded like any run, so that the JSON report, the matrix and the step summary
        # show the broken case too; "all": it fails on every device type it would run on.
        from pytest_gpucase.plugin.records import broken_fields

        self.user_properties.append(("gpucase", property_json(broken_fields(self.name,
                                                                             case_path))))
        self.user_properties.append(("gpucase_result", property_json({
            "error_type": "CaseFormatError", "message": problem})))

    def runtest(self) -> None:
        raise CaseFileError(self.problem)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str | TerminalRepr:
        from pytest_gpucase.base.text import terminal_safe

        if isinstance(excinfo.value, CaseFileError):
            return failure_repr(terminal_safe(str(excinfo.value)), self)
        return super().repr_failure(excinfo)

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
    """Whether a failed run is the case's known failure: the *call* failing the same way.

    "The same way" is ``verdict.failure.same_failure``: the failure class (a device-side
    assert captured on CUDA is met by the IndexError the CPU raises for the same inputs),
    and on the device type it was captured on the message's shape too; without a class,
    the exception type named in ``[origin] error`` and the shape of its message. A broken
    case, and a reference that could not run, are never the known failure: the call did
    not fail, so a fix would stay a quiet xfail. A silent recorded failure (``[origin]
    error`` without an exception type: wrong values, a NaN loss) is met by outputs that
    differ; a recorded non-finite output (a NaN check's error) by outputs that differ by
    holding NaN or inf (``Outcome.nonfinite``) only; with no ``[origin] error`` at all, any
    failure of the call counts.
    """
    from pytest_gpucase.run.parent import failure_of
    from pytest_gpucase.verdict.failure import Failure, same_failure
    from pytest_gpucase.verdict.triage import NONFINITE

    outcome = verdict.outcome
    if outcome.broken_case or outcome.kind in ("reference raises", "environment"):
        return False
    error = str(case.origin.get("error", "")).strip()
    if not error:
        return True  # nothing recorded to tell failures apart by
    known = case.origin.get("failure_class")
    recorded = Failure.from_text(error, str(case.origin.get("stderr", "")),
                                 str(case.origin.get("backend", "")) or None,
                                 known if isinstance(known, str) else None)
    differs = outcome.kind in ("mismatch", "golden mismatch")
    if recorded.error_type is None and recorded.kind != NONFINITE:
        return differs  # a silent failure: met by the outputs that differ
    if differs:
        # A NaN check's error is met by outputs that differ by being NaN or inf (where the
        # reference is finite), not by any difference: a fix that leaves rounding, or
        # another bug, is not the captured failure.
        return recorded.kind == NONFINITE and bool(outcome.nonfinite)
    if outcome.kind in ("no exception", "bad output", "timeout"):
        return False  # the captured error is gone (a fix): another failure, not the known one
    found = failure_of(verdict)
    return found is not None and same_failure(recorded, found)


def xfail_reason(spec: RunSpec) -> str | None:
    """The xfail reason that applies to this run (None outside a scoped xfail)."""
    variant = spec.variant.kind if spec.variant is not None else None
    return spec.case.xfail_for(spec.device, spec.dtype, variant)


class CaseItem(pytest.Item):
    """One run of a case, executed in a fresh child process."""

    def __init__(self, *, spec: RunSpec, case_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._case_path = case_path
        self.spec = spec
        self.add_marker(_mark(f"device_{spec.device}"))
        from pytest_gpucase.case.model import FLOAT_DTYPES

        if spec.dtype in FLOAT_DTYPES:
            self.add_marker(_mark(f"dtype_{spec.dtype}"))
        if spec.variant is not None:
            # -m "variant_boundary(value=-1)" selects exactly one value.
            self.add_marker(getattr(pytest.mark, f"variant_{spec.variant.kind}")(
                value=spec.variant.value))
        # -k cuda_float32 selects as in PyTorch's device-type test names (test_x_cuda_float32).
        self.extra_keyword_matches.add(f"{spec.device}_{spec.dtype}")
        if spec.skip is not None:
            self.add_marker(_skip_mark(spec.skip))
        elif (reason := xfail_reason(spec)) is not None:
            self.add_marker(_xfail_mark(reason))

    # The "gpucase" user property (the item's spec as JSON) is written when a report first
    # reads the properties, not at collection: JSON for 20,000 items that a -k or --lf
    # deselects was about a twentieth of collection time.
    _user_properties: list[tuple[str, object]]
    _spec_recorded = False

    @property
    def user_properties(self) -> list[tuple[str, object]]:
        if not self._spec_recorded and hasattr(self, "spec"):
            from pytest_gpucase.plugin.records import spec_fields
            from pytest_gpucase.report.file import property_json

            self._spec_recorded = True
            if not any(name == "gpucase" for name, _ in self._user_properties):
                self._user_properties.insert(0, ("gpucase", property_json(
                    spec_fields(self.spec, self._case_path))))
        return self._user_properties

    @user_properties.setter
    def user_properties(self, value: list[tuple[str, object]]) -> None:
        self._user_properties = value
        self._spec_recorded = False  # a plugin that resets the list gets the spec again

    def runtest(self) -> None:
        from pytest_gpucase.run.parent import incomplete_pass, run_spec

        state = self.config.stash[session_key]
        if (state.settings.gpu_cases_regen and self.spec.variant is None
                and self.spec.case.expect.outcome == "matches"):
            state.regenerate(self.spec.case)
        ctx = state.run_context(self)
        # A pass is reported as a failure too (XPASS(strict)): a reused child's verdict is
        # confirmed in a fresh child, whatever it is.
        verdict = incomplete_pass(run_spec(self.spec, ctx, expects_failure=(
            xfail_reason(self.spec) is not None or self.get_closest_marker("xfail") is not None)))
        if state.sigint_seen:  # Ctrl-C while it ran, its KeyboardInterrupt lost on the way
            raise SigintLost("SIGINT while the case ran")
        for note in verdict.outcome.notes:  # in the session's summary: named by its item
            state.note(f"{self.nodeid}: {note}")
        pool = ctx.pool
        for label, why in pool.take_retired() if pool is not None else ():
            from pytest_gpucase.base.text import terminal_safe

            # The worker runs the case's code: its words are bounded there, made safe here.
            state.note(terminal_safe(f"--gpu-isolation: {label} left its worker unlike a "
                                     f"fresh child ({why[0][:200]}); the next run got a "
                                     "new worker"))
        from pytest_gpucase.plugin.records import verdict_fields
        from pytest_gpucase.tools.offending import triaged

        verdict, advice = triaged(verdict)  # an index error's offending value, from the case
        for note in advice:  # a data bug: once per case, whatever item met it
            state.note(note)
        fields = verdict_fields(verdict)
        _add_sections(self, verdict)
        _reissue_warnings(verdict)
        if (verdict.failed and not verdict.outcome.broken_case   # the case is what to fix
                and verdict.outcome.kind != "environment"   # or a package's build
                and state.settings.gpu_ablate):
            from pytest_gpucase.tools.ablate import ablate

            found = ablate(self.spec.case, device=self.spec.device, dtype=self.spec.dtype,
                           env=state.environment(), ctx=ctx.fresh(), variant=self.spec.variant)
            self.add_report_section("call", "gpucase ablation", found.render())
            fields["ablation"] = found.to_dict()
        from pytest_gpucase.report.file import property_json

        self.user_properties.append(("gpucase_result", property_json(fields)))
        if verdict.outcome.status == "skipped":
            raise skip_here(verdict.outcome.summary)
        if verdict.outcome.status == "passed" and xfail_reason(self.spec) is not None:
            _note_narrowed(self, state)  # an XPASS(strict): its narrowed cases go with it
        if verdict.failed:
            if xfail_reason(self.spec) is not None and is_known_failure(self.spec.case, verdict):
                raise KnownFailure(verdict)
            raise CaseRunFailed(verdict)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str | TerminalRepr:
        if isinstance(excinfo.value, CaseRunFailed):
            known = isinstance(excinfo.value, KnownFailure)  # shown as such under --runxfail
            return failure_repr(_failure_text(excinfo.value.verdict.outcome, self.spec,
                                              known=known), self)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.spec.case.case_file, 0, self.name


def _note_narrowed(item: CaseItem, state: Any) -> None:
    """Name the narrowed cases of a case that now passes, to delete with its xfail line:
    they replay the op with the inputs the fixed bug made, and never pass."""
    from pytest_gpucase.tools.narrowed import narrowed_note

    text = narrowed_note(item.spec.case.path)
    if text is not None:
        state.note(text)
        item.add_report_section("call", "gpucase narrowed cases", text)


def skip_here(reason: str) -> BaseException:
    """A skip that ``-rs`` places at the item (a case's ``case.toml``, a hand-written test),
    as pytest places a skip marker's, not at the line of this plugin that raised it.

    ``_use_item_location`` is how pytest's own skip markers and unittest skips do it (pytest
    7 to 9); a pytest without it still skips, placed at the raise.
    """
    try:
        return pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:
        return pytest.skip.Exception(reason)


def failure_repr(text: str, item: pytest.Item) -> TerminalRepr:
    """A failure's whole text, with its first line as the crash message.

    pytest's one-line summary (``-r``, ``--tb=line``, junit's ``message``) shows the crash
    message; a plain string would be shown there whole on CI (``CI`` set) and under ``-vv``,
    so every failure's full text appeared twice in a CI log. The text itself is shown as is,
    except under ``--tb=line``, which asks for the crash line alone. The pieces are the ones
    pytest-xdist carries between processes.
    """
    from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative

    headline = text.split("\n", 1)[0]
    body = text if text.endswith("\n") else text + "\n"
    if item.config.getoption("tbstyle", "auto") == "line":
        body = ""
    return ReprExceptionInfo(reprtraceback=ReprTracebackNative([body] if body else []),
                             reprcrash=ReprFileLocation(item.nodeid.split("::")[0], 1, headline))


def _failure_text(outcome: Outcome, spec: RunSpec | None = None, *, known: bool = False) -> str:
    from pytest_gpucase.base.text import terminal_safe
    from pytest_gpucase.case.variants import describe_saved
    from pytest_gpucase.run.parent import INCOMPLETE_CASE

    text = outcome.summary
    if outcome.details:
        text += "\n\n" + outcome.details.rstrip()
    # A broken case never reached its variant: there is nothing it set to tell.
    resized = (describe_saved(spec.variant, spec.case)
               if spec is not None and spec.variant is not None and not outcome.broken_case
               else None)
    if resized:
        text += "\n\n" + resized   # which inputs the variant resized, to what shape
    if (spec is not None and not outcome.broken_case and not known
            and xfail_reason(spec) is not None):
        text += "\n\n" + _not_the_known_failure(spec.case, outcome)
    elif spec is not None and _missing_module(outcome) is not None:
        text += "\n\n" + _missing_text(spec.case, outcome)
    if spec is not None and outcome.error_type != INCOMPLETE_CASE:  # else it lists them
        text += _incomplete_text(spec.case)
    return terminal_safe(text)   # the child's words must not drive the terminal


def _incomplete_text(case: Case) -> str:
    """What the Recorder could not save of the case (``[origin] incomplete``), said by its
    item: the failure above is the missing part's, not a verdict on the code."""
    from pytest_gpucase.run.parent import listed_incomplete

    if not case.incomplete:
        return ""
    return ("\n\nThis case is INCOMPLETE ([origin] incomplete): it cannot replay its "
            f"failure as captured until what is missing is added:\n{listed_incomplete(case)}")


_NO_MODULE = re.compile(r"No module named '([A-Za-z_][\w.]*)'")
_SETUP_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z_][\w.]*)'")


def _missing_module(outcome: Outcome) -> str | None:
    """The top-level module a run could not import (a ModuleNotFoundError raised by the call,
    or by the case's setup: importing its factory or target), or None."""
    text = outcome.error_message or outcome.summary or ""
    if outcome.error_type == "ModuleNotFoundError" or (
            outcome.broken_case and outcome.cause_type == "ModuleNotFoundError"):
        found = _NO_MODULE.search(text)
    elif outcome.cause_type is None and outcome.broken_case:
        # An outcome that does not tell its setup failure's cause (one built by hand):
        # its message names it, "(ModuleNotFoundError: No module named 'x')".
        found = _SETUP_NO_MODULE.search(text)
    else:
        found = None
    return found.group(1).split(".")[0] if found else None


def _missing_text(case: Case, outcome: Outcome) -> str:
    """What a case that cannot import a package here should change: not its expectation."""
    name = _missing_module(outcome) or "?"
    for folder in list(case.path.parents)[:8]:
        if (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file():
            return (f"The case imports {name}, the project's code in {folder.name or folder}/, "
                    "which this run cannot import: put that folder on pytest's path "
                    "(pythonpath = [\".\"] in the project's pytest configuration, see "
                    "docs/case-format.md, where call is imported from); never make "
                    "ModuleNotFoundError the case's expectation.")
    return (f"The case imports {name}, which is not installed on this runner: the failure "
            "says nothing of the code under test. Install it here, or declare it in "
            f"{case.path.name}/case.toml so that a runner "
            f"without it skips the case with the reason: [matrix.packages] {name} = \"\" "
            "(the name of its distribution, where that differs); never make "
            "ModuleNotFoundError the case's expectation.")


def _not_the_known_failure(case: Case, outcome: Outcome) -> str:
    """Why an xfail case's failure fails the run: it is not the captured one, and what a fix
    that now rejects the input should change in ``case.toml``."""
    from pytest_gpucase.verdict.triage import current_class

    error = str(case.origin.get("error", "")).partition("\n")[0]
    known = case.origin.get("failure_class")
    captured = (f"{error} ({current_class(known)})" if error and isinstance(known, str)
                else error or "unnamed")
    if outcome.kind == "reference raises":
        return (f"The case's xfail expects the call to fail ({captured}); here the call ran "
                "and its reference could not, so nothing judged the call's outputs: this is "
                "never counted as the known failure. Make the reference run (above) to see "
                "whether the call is fixed.")
    text = (f"This is not the captured failure ({captured}), the only one the case's xfail "
            "counts as expected.")
    if _missing_module(outcome) is not None:
        return text + " " + _missing_text(case, outcome)
    # The call itself raised it: an exception of the case's setup (importing the model,
    # building it, loading its state: run.outcome.CaseSetupError) is a broken case, and
    # expecting it would turn a case that cannot replay into a green test.
    if outcome.error_type is not None and outcome.kind == "raises":
        text += (" If rejecting these inputs is the fix, make the case expect it: [expect] "
                 f"outcome = \"raises\", exception = \"{outcome.error_type}\", and remove "
                 "xfail.")
    return text + " Otherwise it is a new failure."


def _add_sections(item: pytest.Item, verdict: Verdict) -> None:
    from pytest_gpucase.base.text import terminal_safe
    from pytest_gpucase.run.parent import describe_rerun, describe_warnings, stderr_section

    child = verdict.child
    sections = [("stdout (child)", child.stdout), ("stderr (child)", stderr_section(verdict))]
    if child.warnings:
        sections.append(("warnings (child)", describe_warnings(child)))
    if verdict.triage is not None:
        sections.append(("gpucase triage", verdict.triage.render()))
    if verdict.outcome.notes:  # what the verdict could not check: shown on a pass too (-rP)
        sections.append(("gpucase notes", "\n".join(verdict.outcome.notes)))
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

    from pytest_gpucase.run.parent import reissue_warnings

    if verdict.failed:
        with contextlib.suppress(Warning):
            reissue_warnings(verdict.child.warnings)
    else:
        reissue_warnings(verdict.child.warnings)


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

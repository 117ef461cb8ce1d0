"""The ``gpucase`` command: work with cases, reports and checkpoints outside a pytest run.

Each subcommand is a thin front for a function of the module that owns the
concern; modules are imported only when their subcommand runs. Those
functions return values; this module alone parses arguments, prints, and
picks exit codes: 0 done (a valid checkpoint, a case that still fails), 1 done
but the answer is no (problems found, nothing smaller, nothing valid), 2 a
usage error or a case that cannot run, 130 interrupted.

Output cut short by its reader (``gpucase request CASE | head``) ends quietly
with exit code 141, as GNU coreutils and git do: they die of SIGPIPE, which a
shell reports as 128 + 13, so ``set -o pipefail`` sees the same for all of them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.base.version import __version__

# What a shell reports for a process killed by SIGPIPE (128 + 13), on every platform.
EXIT_BROKEN_PIPE = 141
# Commands that import neither torch nor pytest: a CI matrix's merge job installs neither
# (docs/ci.md, "A merge job without torch"). tests/test_cli.py runs them without either.
_WITHOUT_TORCH = frozenset({"matrix", "show", "durations"})


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME...], got {text!r}")
    return names


def _axes(text: str) -> tuple[str, str]:
    parts = tuple(part.strip() for part in text.split(","))
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected ROWS,COLUMNS (e.g. rowext,torch), got {text!r}")
    return parts[0], parts[1]


def _parser() -> argparse.ArgumentParser:
    # neither torch nor pytest: cheap, and the one list of formats
    from pytest_gpucase.report.render import RENDERERS

    parser = argparse.ArgumentParser(
        prog="gpucase", description="Saved GPU failure cases: inspect, merge, shrink, ablate.")
    parser.add_argument("--version", action="version", version=f"gpucase {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    matrix = commands.add_parser(
        "matrix", help="merge JSON reports of several runners into a compatibility matrix")
    matrix.add_argument("reports", nargs="+", type=Path, metavar="REPORT",
                        help="a JSON report written by pytest --gpu-cases-report, one per runner")
    matrix.add_argument("--format", choices=tuple(RENDERERS), default="markdown",
                        help="how to write the matrix (default: %(default)s)")
    matrix.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE for its pytest_gpucase_report_formats hook "
                        "(repeatable; plugins of the entry-point group gpucase are loaded too)")
    matrix.add_argument("-o", "--output", type=Path, metavar="FILE",
                        help="write here instead of stdout")
    matrix.add_argument("--detail", action="store_true", help="one row per case x variant")
    matrix.add_argument("--pivot", type=_axes, metavar="ROWS,COLUMNS",
                        help="one table per case (and one of all) of two environment axes "
                        "in version order, e.g. rowext,torch: a package the reports record, or "
                        "torch, cuda, hip, cudnn, python, backend, gpu, platform, revision "
                        "(markdown or html)")

    durations = commands.add_parser(
        "durations", help="item durations from JSON reports, as pytest-split reads them, to "
        "shard cases across runners (pytest --splits N --group I --durations-path FILE)")
    durations.add_argument("reports", nargs="+", type=Path, metavar="REPORT",
                           help="a JSON report written by pytest --gpu-cases-report")
    durations.add_argument("-o", "--output", type=Path, metavar="FILE",
                           help="write here (e.g. .test_durations) instead of stdout")

    show = commands.add_parser("show", help="a case at a glance")
    show.add_argument("case", type=Path, metavar="CASE", help="the case directory")
    show.add_argument("--report", type=Path, metavar="REPORT",
                      help="a JSON report holding the case's last verdict")

    request = commands.add_parser(
        "request", help="a ready-to-paste, sanitized request for analysis of a case")
    request.add_argument("case", type=Path, metavar="CASE", help="the case directory")

    validate = commands.add_parser("validate", help="check case files without running them")
    validate.add_argument("paths", nargs="*", type=Path, default=[Path("cases")], metavar="PATH",
                          help="a case directory or a folder of cases (default: cases)")
    validate.add_argument("--no-rebuild", dest="rebuild", action="store_false",
                          help="do not build module cases' models (in a child) to check them "
                          "against their saved state: no case code runs at all")

    store = commands.add_parser(
        "store", help="list (or --prune) the capture store's files no case names")
    store.add_argument("paths", nargs="*", type=Path, default=[Path("cases")], metavar="PATH",
                       help="a folder of cases, or its .gpucase-store (default: cases)")
    store.add_argument("--prune", action="store_true", help="remove them")

    narrowed = commands.add_parser(
        "narrowed", help="list (or --delete) the cases the Recorder narrowed from a case")
    narrowed.add_argument("case", type=Path, metavar="CASE", help="the parent case directory")
    narrowed.add_argument("--delete", action="store_true",
                          help="delete them, and the store files no case names any more")

    minimize = commands.add_parser(
        "minimize", help="shrink a failing case to the fewest entries that still fail the same way")
    minimize.add_argument("case", type=Path, metavar="CASE", help="the failing case directory")
    minimize.add_argument("-o", "--output", type=Path, metavar="NEW_CASE",
                          help="where to write the smaller case; never overwritten (default: "
                          "CASE_min beside CASE)")
    minimize.add_argument("--device", default=None, help="device type to run on (default: the "
                          "first the case can run on here)")
    minimize.add_argument("--inputs", type=_names, metavar="NAME[,NAME...]",
                          help="the saved tensors that follow the batch axis, when gpucase "
                          "cannot tell them (default: [variants.batch] inputs, else inferred); "
                          "adds no pytest item, as a [variants.batch] table would")
    minimize.add_argument("--max-tries", type=_positive_int, default=200, metavar="N",
                          help="shrinking tries at most (the first run of the original is "
                          "extra; default: %(default)s)")
    minimize.add_argument("--time-budget", type=_positive_float, default=600.0, metavar="SECONDS",
                          help="stop shrinking after this long and keep the best case so far "
                          "(default: %(default)g)")
    _env_option(minimize)

    data_check = commands.add_parser(
        "data-check", help="turn a case whose saved batch holds the bad value into a regression "
        "case without those samples and a data contract")
    data_check.add_argument("case", type=Path, metavar="CASE", help="the case directory")
    data_check.add_argument("-o", "--output", type=Path, metavar="NEW_CASE",
                            help="where to write the new case (default: CASE_clean beside it)")
    data_check.add_argument("--contract", type=Path, metavar="FILE",
                            help="where to write the contract (default: CASE.contract.toml)")
    data_check.add_argument("--inputs", type=_names, metavar="NAME[,NAME...]",
                            help="the saved tensors that follow the batch axis, when the case "
                            "cannot tell (as for gpucase minimize)")
    data_check.add_argument("--no-run", action="store_true",
                            help="do not run the new case once to see it pass")
    ablate = commands.add_parser(
        "ablate", help="rerun a failing case under one change at a time")
    ablate.add_argument("case", type=Path, metavar="CASE", help="the failing case directory")
    ablate.add_argument("--device", default=None, help="device type to run on (default: the "
                        "first the case can run on here)")
    ablate.add_argument("--dtype", default=None,
                        help="run in this dtype (default: the first of the case's dtypes that "
                        "fails)")
    _env_option(ablate)

    checkpoint = commands.add_parser(
        "checkpoint", help="list checkpoints newest first with their verdict")
    checkpoint.add_argument("paths", nargs="+", metavar="PATH",
                            help="a checkpoint file, or a directory whose checkpoints to list")
    checkpoint.add_argument("--model", metavar="MODEL",
                            help="the model to compare keys and shapes with: a reference "
                            "checkpoint file (its model state dict), or 'pkg.module:attr' "
                            "naming an nn.Module, a state dict, or a function that returns "
                            "one (called with no arguments), imported as pytest would: "
                            "from the working directory and its project's root and "
                            "pythonpath; tied weights saved once (safetensors.torch."
                            "save_model) are not missing")
    checkpoint.add_argument("--all-problems", action="store_true",
                            help="list every problem of each file (default: the first five)")
    checkpoint.add_argument("--require-manifest", action="store_true",
                            help="restart only from a checkpoint whose manifest "
                            "(pytest_gpucase.checkpoint.save) proves it; a plain one that "
                            "loads and is finite (LOADABLE) is not taken")
    return parser


def _env_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", type=_assignment, action="append", default=[],
                        metavar="NAME=VALUE",
                        help="a variable every run's child gets (repeatable), as a "
                        "pytest_gpucase_run_env hook gives it to the items of a pytest run "
                        "(a command loads no conftest)")


def _assignment(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpucase`` command line; return the exit code."""
    try:
        _load_format_plugins(list(sys.argv[1:] if argv is None else argv))
    except (ImportError, ValueError, TypeError) as exc:
        return _error("matrix", f"--plugin: {exc}")
    args = _parser().parse_args(argv)
    if args.command not in _WITHOUT_TORCH:
        from pytest_gpucase.base.torch_import import import_torch

        import_torch()
    try:
        code = _dispatch(args)
        # Flushed here, so that a reader gone away is met in this try and not at exit.
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's own exit would flush stdout again and print a second error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except CaseFormatError as exc:
        return _error(None, exc)
    except (RecursionError, MemoryError, OSError, UnicodeError) as exc:
        # A case no check foresaw (too deep for a parser, unreadable): one line, not a trace.
        return _error(args.command, f"the case cannot be read: {type(exc).__name__}: {exc}")
    return code


def _load_format_plugins(argv: list[str]) -> None:
    """Before the parser offers ``--format``'s choices: the formats plugins add.

    Plugins are the modules named by ``--plugin`` and the entry points of the group
    ``gpucase``; their ``pytest_gpucase_report_formats`` join ``report.RENDERERS``.
    """
    if not argv or argv[0] != "matrix":
        return
    modules = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--plugin"]
    modules += [arg.removeprefix("--plugin=") for arg in argv if arg.startswith("--plugin=")]
    import importlib
    from importlib import metadata

    from pytest_gpucase.report.render import add_renderers

    # The hook as pytest would call it (plugin/hookspecs.py), without pytest or pluggy: a
    # merge job installs neither. Entry points of the group "gpucase" first, then --plugin.
    plugins = [entry.load() for entry in metadata.entry_points(group="gpucase")]
    plugins += [importlib.import_module(name) for name in modules]
    plugins = list({id(plugin): plugin for plugin in plugins}.values())   # once each
    found = []
    for plugin in plugins:
        hook = getattr(plugin, "pytest_gpucase_report_formats", None)
        if callable(hook) and (formats := hook()) is not None:
            found.append(formats)
    add_renderers(found)


def _error(command: str | None, problem: object, code: int = 2) -> int:
    """Print ``problem`` on stderr after the command's name and return ``code``; what it
    quotes from a file (a key, a name) cannot drive the terminal."""
    from pytest_gpucase.base.text import terminal_safe

    name = "gpucase" if command is None else f"gpucase {command}"
    print(terminal_safe(f"{name}: {problem}"), file=sys.stderr)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    command: str = args.command
    handlers = {
        "matrix": _matrix,
        "durations": _durations,
        "show": _show,
        "request": _request,
        "validate": _validate,
        "store": _store,
        "narrowed": _narrowed,
        "minimize": _minimize,
        "ablate": _ablate,
        "data-check": _data_check,
        "checkpoint": _checkpoint,
    }
    return handlers[command](args)  # argparse guards the choices


def _matrix(args: argparse.Namespace) -> int:
    from pytest_gpucase.report.matrix import UnreadableReports, matrix_command
    from pytest_gpucase.report.render import RENDERERS

    try:
        matrix = matrix_command(args.reports, detail=args.detail)
    except UnreadableReports as exc:
        for error in exc.errors:
            _error(None, error)
        return 2
    if args.pivot is not None:
        from pytest_gpucase.report.pivot import (
            PivotError,
            pivot,
            render_pivot_html,
            render_pivot_markdown,
        )

        pivots = {"markdown": render_pivot_markdown, "html": render_pivot_html}
        if args.format not in pivots:
            return _error("matrix", f"--pivot writes markdown or html, not {args.format}")
        try:
            text = pivots[args.format](pivot(matrix, *args.pivot))
        except PivotError as exc:
            return _error("matrix", exc)
    else:
        text = RENDERERS[args.format](matrix)
    failed = _write_out(args.output, text)
    if failed is not None or args.output is None:
        return failed or 0
    print(f"gpucase: wrote {args.output} ({len(matrix.rows)} rows × {len(matrix.columns)} "
          f"environments)")
    return 0


def _write_out(output: Path | None, text: str) -> int | None:
    """``text`` to ``output``, or to stdout without one; the exit status of a failed write."""
    if output is None:
        sys.stdout.write(text)
        return None
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        return _error(None, f"{output}: cannot write: {exc.strerror or exc}")
    return None


def _durations(args: argparse.Namespace) -> int:
    import json

    from pytest_gpucase.report.durations import durations
    from pytest_gpucase.report.file import ReportError, load_report

    loaded = []
    for path in args.reports:
        try:
            loaded.append(load_report(path))
        except ReportError as exc:
            return _error(None, exc)
    return _write_out(args.output, json.dumps(durations(loaded), indent=2) + "\n") or 0


def _show(args: argparse.Namespace) -> int:
    from pytest_gpucase.report.file import ReportError
    from pytest_gpucase.tools.show import show
    from pytest_gpucase.tools.validate import hash_setting

    if args.report is not None and not os.path.lexists(args.report):
        return _error("show", f"--report {args.report}: no such file; give the JSON report "
                      "that --gpu-cases-report wrote")
    try:
        text = show(args.case, report=args.report)
    except ReportError as exc:   # read as gpucase matrix reads a report: refused in one line
        return _error("show", f"--report {exc}")
    except CaseFormatError as exc:
        # The payload's hash is what a malformed inputs_sha256 should say: shown all the same.
        setting = hash_setting(args.case) if "inputs_sha256" in str(exc.key) else None
        if setting is None:
            raise
        _error(None, exc)
        print(f"hash:      {setting}")
        return 2
    print(text)
    return 0


def _request(args: argparse.Namespace) -> int:
    from pytest_gpucase.tools.show import request

    print(request(args.case))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from pytest_gpucase.tools.validate import validate

    notes: list[str] = []
    unchecked: list[str] = []
    problems = validate(args.paths, notes, unchecked, rebuild=args.rebuild)
    from pytest_gpucase.base.text import terminal_safe

    for line in notes:  # what this environment cannot check: no problem, the exit stays 0
        print(terminal_safe(line))
    for problem in problems:
        print(terminal_safe(problem))
    if problems:
        return 2 if unchecked else 1
    print(f"gpucase validate: no problems in {', '.join(map(str, args.paths))}")
    return 0


def _store(args: argparse.Namespace) -> int:
    from pytest_gpucase.base.errors import display
    from pytest_gpucase.case.payload import STORE_DIR
    from pytest_gpucase.tools.record.origin import mib
    from pytest_gpucase.tools.store import orphans, prune, stores_under

    stores = stores_under(args.paths)
    if not stores:
        print(f"gpucase store: no {STORE_DIR} under {', '.join(map(str, args.paths))}")
        return 0
    found = [orphans(store) for store in stores]
    for one in found:
        if one.unknown:
            print(f"{display(one.store)}: not checked: {one.unknown}")
            continue
        for path in one.files:
            print(f"{display(path)}  {mib(one.sizes.get(path, 0))}  (no case names it)")
    if not args.prune:
        count = sum(len(one.files) for one in found)
        print(f"gpucase store: {count} file(s) no case names"
              + (": gpucase store --prune removes them" if count else ""))
        return 0
    removed = prune(found)
    print(f"gpucase store: removed {len(removed)} file(s)")
    return 0


def _narrowed(args: argparse.Namespace) -> int:
    from pytest_gpucase.base.errors import display
    from pytest_gpucase.case.model import CASE_FILE
    from pytest_gpucase.case.payload import STORE_DIR
    from pytest_gpucase.tools.narrowed import delete_narrowed, narrowed_cases
    from pytest_gpucase.tools.store import orphans, prune, stores_under

    case: Path = args.case
    if not (case / CASE_FILE).is_file():
        return _error("narrowed", f"{display(case)} holds no {CASE_FILE}; name the case the "
                      "Recorder narrowed from (the folder beside its narrowed cases)")
    found = delete_narrowed(case) if args.delete else narrowed_cases(case)
    for path in found:
        print(display(path) + ("  (deleted)" if args.delete else ""))
    if not found:
        print(f"gpucase narrowed: no case beside {display(case)} was narrowed from it")
    elif not args.delete:
        print(f"gpucase narrowed: {len(found)} case(s); once {display(case)} passes, "
              f"gpucase narrowed {display(case)} --delete deletes them")
    else:
        removed = prune([orphans(store) for store in stores_under([case.parent / STORE_DIR])])
        print(f"gpucase narrowed: deleted {len(found)} case(s) and {len(removed)} store "
              "file(s) no case names any more; remove the xfail line of "
              f"{display(case / CASE_FILE)} too")
    return 0


def _minimize(args: argparse.Namespace) -> int:
    from pytest_gpucase.plan.runs import NotRunnable
    from pytest_gpucase.tools.minimize import OriginalPasses, minimize_command

    try:
        result = minimize_command(args.case, output=args.output, device=args.device,
                                  max_tries=args.max_tries, time_budget=args.time_budget,
                                  progress=sys.stdout, inputs=args.inputs,
                                  run_env=dict(args.env))
    except KeyboardInterrupt:
        # Ctrl-C during the search writes the best case so far; here it came before one.
        return _error("minimize", "interrupted before any smaller case; nothing written", 130)
    except OriginalPasses as passes:
        print(f"gpucase minimize: {passes}; nothing written")
        return 1
    except (NotRunnable, FileExistsError) as problem:
        return _error("minimize", problem)
    print(result.render())
    return 0 if result.output is not None else 1


def _ablate(args: argparse.Namespace) -> int:
    from pytest_gpucase.plan.runs import NotRunnable
    from pytest_gpucase.tools.ablate import Row, ablate_command

    def show(row: Row) -> None:
        print(f"  {row.label}: {row.verdict}", file=sys.stderr, flush=True)

    try:
        result = ablate_command(args.case, device=args.device, dtype=args.dtype,
                                progress=show if sys.stderr.isatty() else None,
                                run_env=dict(args.env))
    except NotRunnable as problem:
        return _error("ablate", problem)
    except KeyboardInterrupt:
        return _error("ablate", "interrupted", 130)
    print(result.render())
    return 0 if result.failing else 1


def _data_check(args: argparse.Namespace) -> int:
    from pytest_gpucase.plan.runs import NotRunnable
    from pytest_gpucase.tools.datacheck import NotADataFailure, data_check

    try:
        result = data_check(args.case, output=args.output, contract=args.contract,
                            inputs=args.inputs, run=not args.no_run)
    except (NotADataFailure, NotRunnable, FileExistsError) as problem:
        return _error("data-check", problem)
    print(result.render())
    return 1 if result.passes is False else 0


def _checkpoint(args: argparse.Namespace) -> int:
    from pytest_gpucase.tools.checkpoint import ModelSpecError, survey

    try:
        found = survey(args.paths, model=args.model, require_manifest=args.require_manifest)
    except ModelSpecError as exc:
        return _error("checkpoint", f"--model {exc}")
    print(found.render(all_problems=args.all_problems))
    return 0 if found.restart is not None else 1


if __name__ == "__main__":
    sys.exit(main())

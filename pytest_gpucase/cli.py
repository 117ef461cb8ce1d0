"""The ``gpucase`` command: work with cases, reports and checkpoints outside a pytest run.

Each subcommand is a thin front for a function of the module that owns the
concern; modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import CaseFormatError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpucase", description="Saved GPU failure cases: inspect, merge, shrink, ablate.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    matrix = commands.add_parser(
        "matrix", help="merge JSON reports of several runners into a compatibility matrix")
    matrix.add_argument("reports", nargs="+", type=Path, metavar="REPORT")
    matrix.add_argument("--format", choices=("markdown", "html", "json"), default="markdown")
    matrix.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    matrix.add_argument("--detail", action="store_true", help="one row per case x variant")

    show = commands.add_parser("show", help="a case at a glance")
    show.add_argument("case", type=Path, metavar="CASE")
    show.add_argument("--report", type=Path, help="a JSON report holding the case's last verdict")

    request = commands.add_parser(
        "request", help="a ready-to-paste, sanitized request for analysis of a case")
    request.add_argument("case", type=Path, metavar="CASE")

    validate = commands.add_parser("validate", help="check case files without running them")
    validate.add_argument("paths", nargs="*", type=Path, default=[Path("cases")], metavar="PATH")

    minimize = commands.add_parser(
        "minimize", help="shrink a failing case to the fewest entries that still fail the same way")
    minimize.add_argument("case", type=Path, metavar="CASE")
    minimize.add_argument("-o", "--output", type=Path, metavar="NEW_CASE")
    minimize.add_argument("--device", default=None, help="device type to run on (default: the "
                          "first the case can run on here)")
    minimize.add_argument("--max-tries", type=int, default=200,
                          help="shrinking tries at most (the first run of the original is extra)")
    minimize.add_argument("--time-budget", type=float, default=600.0, metavar="SECONDS")

    ablate = commands.add_parser(
        "ablate", help="rerun a failing case under one change at a time")
    ablate.add_argument("case", type=Path, metavar="CASE")
    ablate.add_argument("--device", default=None)
    ablate.add_argument("--dtype", default=None)

    checkpoint = commands.add_parser(
        "checkpoint", help="list checkpoints newest first with their verdict")
    checkpoint.add_argument("paths", nargs="+", metavar="PATH")
    checkpoint.add_argument("--model", help="a reference checkpoint file or 'pkg.mod:attr'")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpucase`` command line; return the exit code."""
    args = _parser().parse_args(argv)
    from ._torch import import_torch

    import_torch()
    try:
        return _dispatch(args)
    except CaseFormatError as exc:
        print(f"gpucase: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "matrix":
        from .report import matrix_command

        return matrix_command(args.reports, fmt=args.format, output=args.output,
                              detail=args.detail)
    if args.command == "show":
        from .request import show

        print(show(args.case, report=args.report))
        return 0
    if args.command == "request":
        from .request import request

        print(request(args.case))
        return 0
    if args.command == "validate":
        from .request import validate

        problems = validate(args.paths)
        for problem in problems:
            print(problem)
        if not problems:
            print(f"gpucase validate: no problems in {', '.join(map(str, args.paths))}")
        return 1 if problems else 0
    if args.command == "minimize":
        from .minimize import minimize_command

        return minimize_command(args.case, output=args.output, device=args.device,
                                max_tries=args.max_tries, time_budget=args.time_budget)
    if args.command == "ablate":
        from .ablate import ablate_command

        return ablate_command(args.case, device=args.device, dtype=args.dtype)
    if args.command == "checkpoint":
        from .checkpoint import ModelSpecError, survey

        try:
            found = survey(args.paths, model=args.model)
        except ModelSpecError as exc:
            print(f"gpucase checkpoint: --model {exc}", file=sys.stderr)
            return 2
        print(found.render())
        return 0 if found.restart is not None else 1
    raise AssertionError(f"unhandled command {args.command}")  # argparse guards the choices


if __name__ == "__main__":
    sys.exit(main())

"""The matrix pivoted on two environment axes (``gpucase matrix --pivot rowext,torch``): for an
extension's maintainer, one table of extension version by torch version per case, and one
of all cases, rows and columns in version order (``packaging.version``), whatever order the
reports were given in.

An axis is a field of the environment (``torch``, ``cuda``, ``hip``, ``cudnn``, ``python``,
``backend``, ``gpu``, ``platform``, ``revision``) or the name of a package the reports record
(``[matrix.packages]``, a ``call``'s distribution). Two builds of one package version are
two values of its axis (``2.0 (build 3f2a…, for torch 2.9)``). Columns of the matrix that
fall into one pivot cell (they differ on a third axis: two GPUs) are each said in it, by
their label; a cell no column falls into is ``—``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_gpucase.base.text import html_text, markdown_text
from pytest_gpucase.plan.environment import build_label, canonical_name, dnn_library
from pytest_gpucase.report.matrix import DEVICE_WORDS, STATUSES, Cell, Column, Matrix, Status
from pytest_gpucase.report.render import (
    _CSS,
    _HTML_SYMBOLS,
    _MARKDOWN_SYMBOLS,
    _footnotes,
    _md_cell,
    html_reasons,
    markdown_notes,
)

__all__ = ["ENVIRONMENT_AXES", "Pivot", "PivotError", "pivot", "render_pivot_html",
           "render_pivot_markdown"]

ENVIRONMENT_AXES = ("torch", "cuda", "hip", "cudnn", "python", "backend", "gpu", "platform",
                    "revision")
_ABSENT = "—"


class PivotError(ValueError):
    """An axis the reports do not have; the message names the axes they do."""


@dataclass(frozen=True)
class Pivot:
    """The columns of a matrix placed on a grid of two environment axes."""

    matrix: Matrix
    axes: tuple[str, str]                       # (rows, columns)
    row_values: tuple[str, ...]                 # in version order
    column_values: tuple[str, ...]
    places: tuple[tuple[str, str], ...]         # each matrix column's (row value, column value)

    def columns_at(self, row_value: str, column_value: str) -> list[int]:
        return [index for index, place in enumerate(self.places)
                if place == (row_value, column_value)]


def pivot(matrix: Matrix, rows: str, columns: str) -> Pivot:
    """Place each column of ``matrix`` by its values of the two axes."""
    if rows == columns:
        raise PivotError(f"--pivot {rows},{columns}: give two different axes")
    places = [(_value(column, rows), _value(column, columns)) for column in matrix.columns]
    # Two builds of one version in one cell (nothing else tells them apart there): that
    # version's values name the build. Each torch with its own build keeps one row.
    split = _colliding_builds(matrix, places, rows) | _colliding_builds(matrix, places, columns)
    if split:
        places = [(_value(column, rows, split), _value(column, columns, split))
                  for column in matrix.columns]
    for axis, values in ((rows, [p[0] for p in places]), (columns, [p[1] for p in places])):
        if all(value is None for value in values):
            raise PivotError(f"--pivot: no report records {axis!r}; axes: "
                             f"{', '.join(_known_axes(matrix))}")
    shown = [(row or "unknown", column or "unknown") for row, column in places]
    return Pivot(matrix=matrix, axes=(rows, columns),
                 row_values=_ordered(p[0] for p in shown),
                 column_values=_ordered(p[1] for p in shown), places=tuple(shown))


def _known_axes(matrix: Matrix) -> list[str]:
    names = sorted({name for column in matrix.columns
                    for name in column.environment.get("packages", {})})
    return [*ENVIRONMENT_AXES, *names]


def _value(column: Column, axis: str,
           split: frozenset[tuple[str, str]] = frozenset()) -> str | None:
    """A column's value of an axis, as the pivot shows it; None where it does not record
    it. A package version in ``split`` (canonical name, version) names its build too."""
    env = column.environment
    if axis in ENVIRONMENT_AXES:
        if axis == "gpu":
            names = Counter(device["name"] for device in env["devices"])
            return " + ".join(f"{n} × {name}" if n > 1 else name
                              for name, n in sorted(names.items())) or "no GPU"
        if axis == "cudnn":
            return dnn_library(env["cudnn"], env["backend"]) or "none"
        found = env.get(axis)
        return str(found) if found is not None else "none"
    wanted = canonical_name(axis)
    for name, version in env.get("packages", {}).items():
        if canonical_name(name) != wanted:
            continue
        if version is None:
            return "not installed"
        build = _build(env, name)
        if build is not None and (wanted, str(version)) in split:
            return f"{version} ({build_label(build)})"
        return str(version)
    return None


def _build(env: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    build = (env.get("builds") or {}).get(name)
    return build if isinstance(build, Mapping) else None


def _colliding_builds(matrix: Matrix, places: Sequence[tuple[str | None, str | None]],
                      axis: str) -> frozenset[tuple[str, str]]:
    """The (package, version) pairs of which two builds fall into one pivot cell."""
    if axis in ENVIRONMENT_AXES:
        return frozenset()
    wanted = canonical_name(axis)
    builds: dict[tuple[tuple[str | None, str | None], str], set[Any]] = {}
    for column, place in zip(matrix.columns, places, strict=True):
        env = column.environment
        for name, version in env.get("packages", {}).items():
            if canonical_name(name) == wanted and version is not None:
                build = _build(env, name)
                builds.setdefault((place, str(version)), set()).add(
                    build.get("fingerprint") if build is not None else None)
    return frozenset((wanted, version) for (_, version), found in builds.items()
                     if len(found) > 1)


def _ordered(values: Any) -> tuple[str, ...]:
    """Distinct values in version order; what is no version after, by text."""
    from packaging.version import InvalidVersion, Version

    def key(value: str) -> tuple[int, Any, str]:
        head = value.split(" (", 1)[0]
        try:
            return (0, Version(head), value)
        except InvalidVersion:
            return (1, head, value)

    return tuple(sorted(set(values), key=key))


def _summary(cells: Sequence[Cell]) -> str:
    """All cases in one pivot cell: how many rows end in each status, in the legend's order."""
    counts = Counter(cell.status for cell in cells)
    order: Sequence[Status] = (*STATUSES[:2], "partial", *STATUSES[2:])
    return " · ".join(f"{_MARKDOWN_SYMBOLS[s]} {counts[s]} {DEVICE_WORDS[s]}"
                      for s in order if counts[s])


def _worst(cells: Sequence[Cell]) -> Status:
    """The status that colours a pivot cell holding ``cells``: the worst of them."""
    return next((s for s in ("fail", "flaky", "xfail", "interrupted", "partial", "pass", "skip")
                 if any(c.status == s for c in cells)), "not run")


def _unfinished(matrix: Any, indexes: Sequence[int]) -> str:
    """" (incomplete run)" where a column of a pivot cell comes from a run that did not
    finish (killed, stopped by -x): its passes are not every run's."""
    return " (incomplete run)" if any(not matrix.columns[i].complete for i in indexes) else ""


def render_pivot_markdown(view: Pivot) -> str:
    """One table of all cases, then one per case; reasons as footnotes shared by all."""
    matrix = view.matrix
    numbers = _footnotes(matrix)
    rows_axis, columns_axis = view.axes
    head = f"| {markdown_text(rows_axis)} \\ {markdown_text(columns_axis)} | " + " | ".join(
        f"**{markdown_text(f'{columns_axis} {value}')}**"
        for value in view.column_values) + " |"
    rule = "| :--- |" + " :---: |" * len(view.column_values)
    lines = [f"### all {len(matrix.rows)} {'case' if len(matrix.rows) == 1 else 'cases'}", "",
             head, rule]
    for row_value in view.row_values:
        cells = []
        for column_value in view.column_values:
            indexes = view.columns_at(row_value, column_value)
            cells.append(_summary([row.cells[i] for row in matrix.rows for i in indexes])
                         + _unfinished(matrix, indexes) if indexes else _ABSENT)
        lines.append(f"| **{markdown_text(f'{rows_axis} {row_value}')}** | "
                     + " | ".join(cells) + " |")
    for row in matrix.rows:
        lines += ["", f"### {markdown_text(row.label)}", "", head, rule]
        for row_value in view.row_values:
            cells = []
            for column_value in view.column_values:
                indexes = view.columns_at(row_value, column_value)
                said = [_md_cell(row.cells[i], numbers) for i in indexes]
                if len(indexes) > 1:   # columns that differ on a third axis: each named
                    said = [f"{markdown_text(matrix.columns[i].label)}: {text}"
                            for i, text in zip(indexes, said, strict=True)]
                cells.append("<br>".join(said) + _unfinished(matrix, indexes)
                             if said else _ABSENT)
            lines.append(f"| **{markdown_text(f'{rows_axis} {row_value}')}** | "
                         + " | ".join(cells) + " |")
    lines += ["", "Environments: " + "; ".join(
        f"**{markdown_text(c.label)}**{'' if c.complete else ' (incomplete run)'}: "
        f"{markdown_text(c.description)}" for c in matrix.columns)]
    return "\n".join(lines + markdown_notes(matrix, numbers)) + "\n"


def render_pivot_html(view: Pivot) -> str:
    """The pivot as one self-contained HTML page (the matrix page's inline CSS)."""
    esc = html_text
    matrix = view.matrix
    numbers = _footnotes(matrix)
    rows_axis, columns_axis = view.axes
    title = f"pytest-gpucase: {rows_axis} × {columns_axis}"
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
           "<main>", f"<h1>{esc(title)}</h1>"]

    def table(caption: str, cell_html: Any) -> None:
        out.extend(['<div class="scroll">', "<table>", f"<caption>{esc(caption)}</caption>",
                    "<thead><tr>", f'<th scope="col">{esc(rows_axis)} \\ {esc(columns_axis)}</th>'])
        out.extend(f'<th scope="col">{esc(columns_axis)} {esc(value)}</th>'
                   for value in view.column_values)
        out.append("</tr></thead><tbody>")
        for row_value in view.row_values:
            out.append(f'<tr><th scope="row">{esc(rows_axis)} {esc(row_value)}</th>')
            for column_value in view.column_values:
                out.append(cell_html(view.columns_at(row_value, column_value)))
            out.append("</tr>")
        out.extend(["</tbody>", "</table>", "</div>"])

    def summary_cell(indexes: list[int]) -> str:
        if not indexes:
            return f'<td class="not-run">{_ABSENT}</td>'
        cells = [row.cells[i] for row in matrix.rows for i in indexes]
        worst = _worst(cells)
        counts = Counter(cell.status for cell in cells)
        body = "".join(f'<span class="device d-{s.replace(" ", "-")}">{_HTML_SYMBOLS[s]} '
                       f"{counts[s]} {DEVICE_WORDS[s]}</span>" for s in counts)
        return (f'<td class="{worst.replace(" ", "-")}">{body}'
                f'{esc(_unfinished(matrix, indexes))}</td>')

    table(f"All {len(matrix.rows)} cases", summary_cell)
    for row in matrix.rows:
        def case_cell(indexes: list[int], row: Any = row) -> str:
            if not indexes:
                return f'<td class="not-run">{_ABSENT}</td>'
            parts = []
            for i in indexes:
                cell = row.cells[i]
                named = f"<b>{esc(matrix.columns[i].label)}</b>" if len(indexes) > 1 else ""
                parts.append(named + "".join(
                    f'<span class="device d-{d.status.replace(" ", "-")}">'
                    f"{_HTML_SYMBOLS[d.status]} {esc(d.text)}"
                    + (f"<sup>{','.join(str(numbers[r]) for r in d.reasons)}</sup>"
                       if d.reasons else "") + "</span>" for d in cell.devices))
            worst = _worst([row.cells[i] for i in indexes])
            return (f'<td class="{worst.replace(" ", "-")}">{"".join(parts)}'
                    f'{esc(_unfinished(matrix, indexes))}</td>')
        table(row.label, case_cell)
    out += html_reasons(numbers)
    out += ["<h2>Environments</h2>", '<dl class="environments">']
    out += [f"<dt>{esc(c.label)}</dt><dd>{esc(c.description)}<br>from "
            f"{esc(', '.join(c.sources))}</dd>" for c in matrix.columns]
    out += ["</dl>", "</main>", "</body>", "</html>"]
    return "\n".join(out) + "\n"

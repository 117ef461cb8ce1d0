"""The matrix as text: Markdown, JSON and a self-contained HTML page, and the renderers
plugins add (``pytest_gpucase_report_formats``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence

from pytest_gpucase.base.text import html_text, markdown_text
from pytest_gpucase.report.file import MATRIX_SCHEMA, MATRIX_VERSION, json_safe
from pytest_gpucase.report.matrix import (
    DEVICE_WORDS,
    STATUS_MEANINGS,
    STATUSES,
    Cell,
    DeviceCell,
    Matrix,
    Status,
)

__all__ = ["RENDERERS", "add_renderers", "html_reasons", "markdown_notes", "render_html",
           "render_json", "render_markdown"]

_MARKDOWN_SYMBOLS: Mapping[Status, str] = {
    "pass": "✅", "fail": "❌", "flaky": "🔀", "xfail": "⚠️", "skip": "⏭️",
    "interrupted": "⏹️", "not run": "—", "partial": "◐",
}
# The HTML page must read well without an emoji font (CI images rarely have one).
_HTML_SYMBOLS: Mapping[Status, str] = {
    "pass": "✓", "fail": "✗", "flaky": "≠", "xfail": "⚠", "skip": "↷", "interrupted": "■",
    "not run": "—", "partial": "◐",
}


def _footnotes(matrix: Matrix) -> dict[str, int]:
    """Number each distinct reason in reading order; one reason shared by many cells is one note."""
    numbers: dict[str, int] = {}
    for row in matrix.rows:
        for cell in row.cells:
            for reason in cell.reasons:
                numbers.setdefault(reason, len(numbers) + 1)
    return numbers


def _counts_text(cell: Cell) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in cell.counts.items()) or "no runs"


def _md_cell(cell: Cell, numbers: Mapping[str, int]) -> str:
    """``✅ cpu: pass · ⏭️ cuda: skipped (no CUDA device here)[^2]``: one part per device type."""
    # Stacked notes are separated ([^1],[^2]): run together they would read as note 12.
    return " · ".join(
        f"{_MARKDOWN_SYMBOLS[device.status]} {markdown_text(device.text)}"
        + ",".join(f"[^{numbers[reason]}]" for reason in device.reasons)
        for device in cell.devices)


def render_markdown(matrix: Matrix) -> str:
    """The matrix as a GitHub Markdown table, with reasons as footnotes."""
    numbers = _footnotes(matrix)
    head = ["case (variant)" if matrix.detail else "case"]
    # The whole environment is said in the header, not only what tells the columns apart.
    head += [f"**{markdown_text(c.label)}**" + ("" if c.complete else " (incomplete run)")
             + f"<br>{markdown_text(c.description)}" for c in matrix.columns]
    lines = ["| " + " | ".join(head) + " |",
             "| :--- |" + " :---: |" * len(matrix.columns)]
    for row in matrix.rows:
        cells = [markdown_text(row.label)] + [_md_cell(cell, numbers) for cell in row.cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", " · ".join(f"{_MARKDOWN_SYMBOLS[s]} {DEVICE_WORDS[s]}: {STATUS_MEANINGS[s]}"
                             for s in STATUSES)]
    return "\n".join(lines + markdown_notes(matrix, numbers)) + "\n"


def markdown_notes(matrix: Matrix, numbers: Mapping[str, int]) -> list[str]:
    """A Markdown matrix's closing lines: the matrix's notes, then the numbered reasons."""
    lines = []
    if matrix.notes:
        lines += [""] + [f"Note: {markdown_text(note)}" for note in matrix.notes]
    if numbers:
        lines.append("")
        lines += [f"[^{n}]: {markdown_text(reason)}" for reason, n in numbers.items()]
    return lines


def html_reasons(numbers: Mapping[str, int]) -> list[str]:
    """An HTML matrix's numbered reasons, which its cells' superscripts point at."""
    if not numbers:
        return []
    return (["<h2>Why runs did not pass</h2>", '<ol class="reasons">']
            + [f'<li id="reason-{n}" value="{n}">{html_text(reason)}</li>'
               for reason, n in numbers.items()]
            + ["</ol>"])


def render_json(matrix: Matrix) -> str:
    """The matrix as JSON (schema ``pytest-gpucase/matrix``), for dashboards and scripts."""
    data = {
        "schema": MATRIX_SCHEMA,
        "version": MATRIX_VERSION,
        "detail": matrix.detail,
        "columns": [{"label": c.label, "description": c.description, "sources": list(c.sources),
                     "created": c.created, "complete": c.complete,
                     "environment": dict(c.environment)} for c in matrix.columns],
        "rows": [{"label": r.label, "case": r.case, "case_path": r.case_path,
                  "variant": r.variant,
                  "cells": [{"status": cell.status, "counts": dict(cell.counts),
                             "reasons": list(cell.reasons),
                             "devices": [{"device": d.device, "status": d.status,
                                          "reasons": list(d.reasons)} for d in cell.devices]}
                            for cell in r.cells]}
                 for r in matrix.rows],
        "notes": list(matrix.notes),
    }
    return json.dumps(json_safe(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


_CSS = """
:root { color-scheme: light; font-family: system-ui, "Segoe UI", "DejaVu Sans", sans-serif;
  color: #1f2328; background: #fff; }
body { margin: 2rem; line-height: 1.45; }
h1 { font-size: 1.5rem; margin: 0 0 .25rem; }
h2 { font-size: 1.15rem; margin: 2rem 0 .5rem; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: 1rem 0; }
caption { text-align: left; font-weight: 600; padding-bottom: .5rem; }
th, td { border: 1px solid #d0d7de; padding: .4rem .7rem; }
thead th { background: #f6f8fa; vertical-align: bottom; min-width: 12rem; max-width: 20rem;
  font-size: .9rem; }
thead th .env { display: block; font-weight: 400; font-size: .8rem; color: #424a53;
  margin-top: .2rem; }
tbody th { text-align: left; font-weight: 600; font-family: ui-monospace, "DejaVu Sans Mono",
  monospace; font-size: .9rem; white-space: nowrap; }
td { text-align: left; white-space: nowrap; }
.device { display: block; font-weight: 600; }
.d-pass { color: #116329; } .d-fail { color: #a40e26; } .d-xfail { color: #7d4e00; }
.d-skip { color: #424a53; } .d-not-run { color: #59636e; font-weight: 400; }
.d-flaky { color: #6639ba; } .d-interrupted { color: #953800; }
.pass { background: #dafbe1; color: #116329; }
.fail { background: #ffebe9; color: #a40e26; }
.d-fixed { color: #0550ae; } .fixed { background: #ddf4ff; color: #0550ae; }
.xfail { background: #fff8c5; color: #7d4e00; }
.skip { background: #eef1f4; color: #424a53; }
.not-run { background: #fff; color: #59636e; }
.flaky { background: #fbefff; color: #6639ba; }
.interrupted { background: #fff1e5; color: #953800; }
.partial { background: #f1f8ff; color: #0a3069; }
.incomplete { display: block; font-weight: 400; color: #7d4e00; }
sup { font-size: .75rem; margin-left: .1rem; }
sup a { color: inherit; text-decoration: underline; }
dl.legend { display: grid; grid-template-columns: max-content 1fr; gap: .3rem 1rem; }
dl.legend dt { padding: .1rem .5rem; border-radius: .25rem; text-align: center; }
dl.legend dd { margin: 0; }
ol.reasons li, ul.notes li { margin-bottom: .3rem; }
ol.reasons li:target { background: #fff8c5; }
dl.environments dt { font-weight: 600; margin-top: .5rem; }
dl.environments dd { margin-left: 1.5rem; }
"""


# A strict xfail that passed (XPASS(strict)): a failure of the run, but news to welcome, not
# a breakage; the HTML page gives it a look of its own (Markdown and JSON say "fail").
_FIXED_SYMBOL = "✓!"
_FIXED_MEANING = ("every failing run passed although marked xfail (strict): the bug is fixed "
                  "here; delete the xfail line from case.toml")


def _html_device(device: DeviceCell, notes: str) -> str:
    """One device type's part of a cell: its symbol, words and notes, in its colour."""
    if device.fixed:
        return (f'<span class="device d-fixed">{_FIXED_SYMBOL} '
                f"{html_text(device.device)}: fixed{notes}</span>")
    return (f'<span class="device d-{device.status.replace(" ", "-")}">'
            f"{_HTML_SYMBOLS[device.status]} {html_text(device.text)}{notes}</span>")


def _html_cell_class(cell: Cell) -> str:
    """A cell's colour: its status, or "fixed" where each failing device type is fixed."""
    failing = [device for device in cell.devices if device.status == "fail"]
    if cell.status == "fail" and failing and all(device.fixed for device in failing):
        return "fixed"
    return cell.status.replace(" ", "-")


def _html_notes(reasons: Sequence[str], numbers: Mapping[str, int]) -> str:
    """One superscript for all the notes of a device: ``¹,²``, never ``12``."""
    if not reasons:
        return ""
    links = ",".join(f'<a href="#reason-{numbers[r]}" aria-label="note {numbers[r]}">'
                     f"{numbers[r]}</a>" for r in reasons)
    return f"<sup>{links}</sup>"


def render_html(matrix: Matrix) -> str:
    """The matrix as one self-contained HTML page: inline CSS, reasons listed below the table.

    Every text from a report is escaped for HTML and made inert (no control character,
    escape sequence or bidirectional override survives). Each text appears once where it
    belongs: a column's label in its header, a reason in its footnote; a cell's tooltip
    says only its own counts, so that the page grows with the reports, not with their
    product.
    """
    esc = html_text
    numbers = _footnotes(matrix)
    cases = len({row.case_path for row in matrix.rows})
    title = "pytest-gpucase compatibility matrix"
    out = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>", f"<style>{_CSS}</style>", "</head>", "<body>", "<main>",
        f"<h1>{title}</h1>",
        (f"<p>{cases} {'case' if cases == 1 else 'cases'} in {len(matrix.columns)} "
         f"{'environment' if len(matrix.columns) == 1 else 'environments'}. A cell says what "
         "the runs of a case did on each device type, over its dtypes; a pass on the CPU says "
         "nothing of CUDA. Follow a note to see why a run did not pass.</p>"),
        '<div class="scroll" role="region" aria-labelledby="matrix-caption" tabindex="0">',
        "<table>", '<caption id="matrix-caption">Cases (rows) by environment (columns)</caption>',
        "<thead>", "<tr>",
        f'<th scope="col">{"case (variant)" if matrix.detail else "case"}</th>',
    ]
    for column in matrix.columns:
        sources = ", ".join(column.sources)
        flag = "" if column.complete else '<span class="incomplete">(incomplete run)</span>'
        out.append(f'<th scope="col" title="from {esc(sources)}">{esc(column.label)}{flag}'
                   f'<span class="env">{esc(column.description)}</span></th>')
    out += ["</tr>", "</thead>", "<tbody>"]
    for row in matrix.rows:
        out.append(f'<tr><th scope="row" title="{esc(row.case_path)}">{esc(row.label)}</th>')
        for cell in row.cells:
            hover = f"{cell.status}: {_counts_text(cell)}"
            body = "".join(_html_device(device, _html_notes(device.reasons, numbers))
                           for device in cell.devices)
            out.append(f'<td class="{_html_cell_class(cell)}" title="{esc(hover)}">{body}</td>')
        out.append("</tr>")
    out += ["</tbody>", "</table>", "</div>", "<h2>Legend</h2>", '<dl class="legend">']
    for status in (*STATUSES, "partial"):
        out.append(f'<dt class="{status.replace(" ", "-")}">{_HTML_SYMBOLS[status]} '
                   f"{DEVICE_WORDS[status]}</dt><dd>{esc(STATUS_MEANINGS[status])}"
                   f"{' (the colour of a cell)' if status == 'partial' else ''}</dd>")
        if status == "fail":
            out.append(f'<dt class="fixed">{_FIXED_SYMBOL} fixed</dt>'
                       f"<dd>{esc(_FIXED_MEANING)}</dd>")
    out.append("</dl>")
    out += html_reasons(numbers)
    if matrix.notes:
        out += ["<h2>Notes</h2>", '<ul class="notes">']
        out += [f"<li>{esc(note)}</li>" for note in matrix.notes]
        out.append("</ul>")
    out += ["<h2>Environments</h2>", '<dl class="environments">']
    for column in matrix.columns:
        state = "" if column.complete else " The run did not finish."
        out.append(f"<dt>{esc(column.label)}</dt><dd>{esc(column.description)}<br>"
                   f"from {esc(', '.join(column.sources))}, started {esc(column.created)}."
                   f"{state}</dd>")
    out += ["</dl>", "</main>", "</body>", "</html>"]
    return "\n".join(out) + "\n"


Renderer = Callable[["Matrix"], str]
# The formats of ``gpucase matrix --format``; plugins add theirs (``add_renderers``).
RENDERERS: dict[str, Renderer] = {
    "markdown": render_markdown, "html": render_html, "json": render_json,
}


def add_renderers(results: Iterable[Mapping[str, Renderer] | None]) -> tuple[str, ...]:
    """Add the renderers plugins return from ``pytest_gpucase_report_formats`` to RENDERERS.

    ``results`` are the hook's results; returns the names added. A format name
    already taken is an error naming the format: a plugin adds formats, it never
    replaces one silently.
    """
    added: list[str] = []
    for found in results:
        for name, render in (found or {}).items():
            if RENDERERS.get(name, render) is not render:
                raise ValueError(f"pytest_gpucase_report_formats: format {name!r} is already "
                                 f"taken ({', '.join(RENDERERS)}); give yours another name")
            if not callable(render):
                raise TypeError(f"pytest_gpucase_report_formats: format {name!r} maps to "
                                f"{type(render).__name__}, not a callable taking a Matrix")
            RENDERERS[name] = render
            added.append(name)
    return tuple(added)

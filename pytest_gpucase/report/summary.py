"""The GitHub step summary of a run: a Markdown table appended to ``GITHUB_STEP_SUMMARY``."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_gpucase.base.text import markdown_code, markdown_text
from pytest_gpucase.case.model import CASE_FILE
from pytest_gpucase.report.file import FAILING, REASON_WORDS, describe_environment
from pytest_gpucase.report.matrix import reason_text

__all__ = ["append_step_summary", "step_summary"]

_MAX_FAILURES_LISTED = 20
_MAX_NOTES = 5   # the session's last notes, under a failed run's heading


def step_summary(report: Mapping[str, Any], exit_status: int = 0,
                 notes: Sequence[str] = ()) -> str:
    """A short Markdown summary of one run, for GitHub's job summary page. ``exit_status``:
    the session's (pytest's exit code); a session that failed with no item failing (a
    device named by ``--gpu-devices`` missing, the report not written) is headed as failed,
    with the session's ``notes``, never with a green mark."""
    results: list[Mapping[str, Any]] = report["results"]
    counts = Counter(result["outcome"] for result in results)
    order = ("failed", "error", "xpassed", "interrupted", "xfailed", "passed", "skipped",
             "not run")
    tally = ", ".join(f"{counts[outcome]} {outcome}" for outcome in order if counts[outcome])
    failures = [result for result in results if result["outcome"] in FAILING]
    session_failed = int(exit_status) not in (0, 5) and not failures
    symbol = ("❌" if failures or session_failed
              else ("⚠️" if not report["complete"] else "✅"))
    lines = [f"### pytest-gpucase: {symbol} {tally or 'no items ran'}", ""]
    if session_failed:
        lines += [f"❌ The run failed (pytest exit status {int(exit_status)}), though no item "
                  "failed" + (":" if notes else "."), ""]
        lines += [f"- {markdown_text(note[:500])}" for note in notes[-_MAX_NOTES:]]
        lines += [""] if notes else []
    if not report["complete"]:
        lines += ["⚠️ The run did not finish: these are the items recorded before it stopped.", ""]
    lines += [markdown_text(describe_environment(report["environment"])), ""]
    if failures:
        lines += ["**Failed**", ""]
        for result in failures[:_MAX_FAILURES_LISTED]:
            # "failed" is the heading already; an error or a strict xpass says what it is.
            said = [] if result["outcome"] == "failed" else [REASON_WORDS[result["outcome"]]]
            said += [text] if (text := _as_in_nodeid(result, reason_text(result))) else []
            said_text = markdown_text(': '.join(said) or 'failed')
            line = f"- {markdown_code(result['nodeid'])}: {said_text}"
            clue = (result["triage"] or {}).get("clue")
            lines.append(line + (f" (clue: {markdown_text(str(clue))})" if clue else ""))
        if len(failures) > _MAX_FAILURES_LISTED:
            lines.append(f"- … and {len(failures) - _MAX_FAILURES_LISTED} more in the JSON report")
        lines.append("")
    return "\n".join(lines)


def _as_in_nodeid(result: Mapping[str, Any], text: str) -> str:
    """``text`` with the case's directory written as the node id beside it writes it.

    A message names the case as the run displayed it: relative to the working
    directory, or absolute when the case lies outside it, while a node id is
    relative to the rootdir. On a CI page only the node id's form means anything.
    """
    case_path = str(result.get("case_path") or "")
    file = str(result["nodeid"]).partition("::")[0]
    directory, _, name = file.rpartition("/")
    if not case_path or not directory or name != CASE_FILE or directory == case_path:
        return text
    # Not where the path goes on with a longer name: cases/bom is no prefix of cases/bomb.
    return re.sub(re.escape(case_path) + r"(?![\w.-])", lambda _: directory, text)


def append_step_summary(report: Mapping[str, Any],
                        env: Mapping[str, str] = os.environ, exit_status: int = 0,
                        notes: Sequence[str] = ()) -> Path | None:
    """Append ``step_summary(report, exit_status, notes)`` to the file GitHub names in
    GITHUB_STEP_SUMMARY, if any."""
    name = env.get("GITHUB_STEP_SUMMARY")
    if not name:
        return None
    path = Path(name)
    # Other steps write to the same file; a blank line keeps our heading out of their paragraph.
    separator = "\n" if path.exists() and path.stat().st_size else ""
    with path.open("a", encoding="utf-8") as stream:
        stream.write(separator + step_summary(report, exit_status, notes))
    return path

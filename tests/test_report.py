"""JSON report files, the compatibility matrix across them, and GitHub step summaries."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import pytest_gpucase
from pytest_gpucase.cli import main
from pytest_gpucase.plan.environment import Device
from pytest_gpucase.report.file import (
    SCHEMA,
    VERSION,
    ReportError,
    check_report,
    describe_environment,
    load_report,
    new_report,
    report_version,
    write_report,
)
from pytest_gpucase.report.summary import append_step_summary, step_summary
from pytest_gpucase.report.matrix import build_matrix, same_environment, short_names
from pytest_gpucase.base.text import markdown_code, markdown_text, terminal_safe
from pytest_gpucase.report.render import render_html, render_json, render_markdown
from tests.helpers import A100, H100, environment, report_file, result

A100_LABEL = "torch 2.3.1 · cu121 · flash-attn 2.5.8 · sm_80"
H100_LABEL = "torch 2.4.0 · cu124 · flash-attn 2.6.3 · sm_90"
A100_ENV = ("cuda backend · torch 2.3.1+cu121 · CUDA 12.1 · cuDNN 9.1.0 · Python 3.11.9 · "
            "1 × NVIDIA A100-SXM4-80GB (8.0) · rev 3f2c1ab · flash-attn 2.5.8")
H100_ENV = ("cuda backend · torch 2.4.0+cu124 · CUDA 12.4 · cuDNN 9.1.0 · Python 3.11.9 · "
            "1 × NVIDIA H100 80GB HBM3 (9.0) · rev 3f2c1ab · flash-attn 2.6.3")
# Each column names its whole environment in visible text, not only what tells it apart.
HEAD = f"**{A100_LABEL}**<br>{A100_ENV} | **{H100_LABEL}**<br>{H100_ENV} |"
ASSERT = "CUDA error: device-side assert triggered"
LEGEND = (
    "✅ pass: every run on this device type ran and passed · "
    "❌ fail: a run failed, errored, or passed although marked as a known failure · "
    "🔀 flaky: a run failed in one report of this environment and passed in another; the note "
    "names them · "
    "⚠️ xfail: a known failure (xfail in case.toml) still fails here · "
    "⏭️ skipped: every run on this device type was skipped; the note says why · "
    "⏹️ interrupted: the run was cancelled while this ran: no verdict · "
    "— not run: no report holds a run of this case on this device type here, or its run "
    "stopped before it started"
)


A100_RESULTS = [
    result("ce_class4", "cpu", "float32", "passed", max_abs=0.0, max_rel=0.0),
    result("ce_class4", "cuda", "float32", "passed", max_abs=1e-7, max_rel=2e-7),
    result("ce_class4", "cuda", "float32", "passed", "batch=1"),
    result("flash_attn_mask", "cuda", "bfloat16", "skipped",
           skip_reason="requires flash-attn>=2.6; found 2.5.8"),
    result("label_map", "cpu", "float32", "xfailed", message="label mapping not fixed yet"),
]
H100_RESULTS = [
    result("ce_class4", "cpu", "float32", "passed"),
    result("ce_class4", "cuda", "float32", "failed", error_type="RuntimeError", message=ASSERT,
           triage={"clue": "device-side assert", "first_check": "indices, targets"}),
    result("ce_class4", "cuda", "float32", "failed", "batch=1", error_type="RuntimeError",
           message=ASSERT),
    result("ce_class4", "cuda", "bfloat16", "passed"),
    result("flash_attn_mask", "cuda", "bfloat16", "passed", max_abs=math.inf, max_rel=math.nan),
    result("label_map", "cpu", "float32", "xfailed", message="label mapping not fixed yet"),
    result("oom_case", "cuda", "float16", "error",
           message="run crashed with signal 11 (SIGSEGV)"),
]


@pytest.fixture
def two_runners(tmp_path: Path) -> list[Path]:
    """The reports of two CI runners: an A100 with older torch, an H100 with newer."""
    return [
        report_file(tmp_path / "a100" / "report.json", A100, A100_RESULTS),
        report_file(tmp_path / "h100" / "report.json", H100, H100_RESULTS,
                    created="2026-12-02T16:05:00+00:00"),
    ]


# ----------------------------------------------------------------------------- the JSON file


def test_new_report_starts_an_unfinished_run_in_the_environment() -> None:
    report = new_report(A100)
    assert report["schema"] == SCHEMA == "pytest-gpucase/report"
    # The lowest version that holds it (1, readable by older readers); this reader reads 2.
    assert report["version"] == 1 and VERSION == 2
    assert report["gpucase"] == pytest_gpucase.__version__
    assert report["created"].endswith("+00:00")
    assert report["environment"] == A100
    assert report["results"] == []
    assert report["complete"] is False


def test_write_then_load_round_trips_in_strict_json(tmp_path: Path) -> None:
    path = report_file(tmp_path / "out" / "run.json", H100, H100_RESULTS)

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    def flash(report: dict[str, Any]) -> dict[str, Any]:
        return next(r for r in report["results"] if r["case"] == "flash_attn_mask")

    on_disk = json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constants)
    assert (flash(on_disk)["max_abs"], flash(on_disk)["max_rel"]) == ("inf", "nan")
    loaded = load_report(path)
    assert flash(loaded)["max_abs"] == math.inf
    assert math.isnan(flash(loaded)["max_rel"])
    assert loaded["results"][0] == H100_RESULTS[0]
    assert loaded["environment"] == json.loads(json.dumps(H100))
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.json"]


def test_write_report_leaves_the_old_file_whole_when_writing_fails(tmp_path: Path) -> None:
    path = report_file(tmp_path / "run.json", A100, A100_RESULTS[:1])
    before = path.read_bytes()
    broken = new_report(A100)
    broken["results"] = [{"nodeid": object()}]
    with pytest.raises(TypeError):
        write_report(path, broken)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_write_report_keeps_the_mode_a_person_expects(tmp_path: Path) -> None:
    path = report_file(tmp_path / "run.json", A100, [])
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _valid() -> dict[str, Any]:
    report = new_report(A100)
    report["results"] = [result("ce_class4", "cpu", "float32", "passed"),
                         result("ce_class4", "cuda", "float32", "passed")]
    return report


def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[], str]:
    """The file text of a valid report after ``change``."""
    def text() -> str:
        report = json.loads(json.dumps(_valid()))
        change(report)
        return json.dumps(report)
    return text


def _set(key: str, value: Any) -> Callable[[], str]:
    return _edit(lambda report: report.update({key: value}))


@pytest.mark.parametrize(("text", "problem"), [
    (lambda: "{not json", ("not JSON: Expecting property name enclosed in double quotes "
                          "at line 1 column 2")),
    (lambda: "", "not JSON: Expecting value at line 1 column 1"),
    (lambda: json.dumps([_valid()]),
     "not a pytest-gpucase report: the top level is a list, expected an object"),
    (lambda: '{"testsuites": []}',
     'not a pytest-gpucase report: "schema" is missing, expected "pytest-gpucase/report"'),
    (_set("schema", "junit"),
     'not a pytest-gpucase report: "schema" is "junit", expected "pytest-gpucase/report"'),
    (_set("version", 3),
     ("report version 3 is newer than this pytest-gpucase reads (up to 2); "
     "upgrade pytest-gpucase")),
    (_set("version", 0), "version: 0 is not a report version this pytest-gpucase reads (1 to 2)"),
    (_edit(lambda r: r["results"][1].update(outcome="interrupted")),
     'results[1].outcome: "interrupted" needs report version 2; write "version": 2'),
    (_set("gpucase", 1), "gpucase: expected a string, found a number"),
    (_set("version", "1"), "version: expected an integer, found a string"),
    (_edit(lambda r: r.pop("results")), 'missing key "results"'),
    (_edit(lambda r: r.pop("complete")), 'missing key "complete"'),
    (_set("created", "yesterday"), 'created: "yesterday" is not an ISO 8601 time'),
    (_set("created", "2026-12-02T16:00:00"), 'created: "2026-12-02T16:00:00" has no UTC offset'),
    (_edit(lambda r: r["environment"].pop("torch")), 'environment: missing key "torch"'),
    (_edit(lambda r: r["environment"]["devices"][0].pop("name")),
     'environment.devices[0]: missing key "name"'),
    (_edit(lambda r: r["environment"]["packages"].update({"flash-attn": 2.5})),
     "environment.packages.flash-attn: expected a string or null, found a number"),
    (_edit(lambda r: r["results"][1].pop("outcome")), 'results[1]: missing key "outcome"'),
    (_edit(lambda r: r["results"][1].update(outcome="broken")),
     ('results[1].outcome: "broken" is not one of passed, failed, skipped, xfailed, xpassed, '
     "error, interrupted, not run")),
    (_edit(lambda r: r["results"][0].update(duration="fast")),
     "results[0].duration: expected a number, found a string"),
    (_edit(lambda r: r["results"][0].update(max_abs="big")),
     ('results[0].max_abs: expected a number, null, or one of "nan", "inf", "-inf", '
     "found a string")),
    (_edit(lambda r: r["results"][0].update(launch_blocking=None)),
     "results[0].launch_blocking: expected a boolean, found null"),
    (_edit(lambda r: r["results"].append("passed")),
     "results[2]: expected an object, found a string"),
])
def test_load_report_names_the_file_and_what_is_wrong(
        tmp_path: Path, text: Callable[[], str], problem: str) -> None:
    path = tmp_path / "report.json"
    path.write_text(text(), encoding="utf-8")
    with pytest.raises(ReportError) as raised:
        load_report(path)
    assert str(raised.value) == f"{path}: {problem}"
    assert raised.value.path == path
    assert isinstance(raised.value, ValueError)


def test_load_report_of_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(ReportError) as raised:
        load_report(path)
    assert str(raised.value) == f"{path}: cannot read: No such file or directory"


def test_load_report_ignores_keys_it_does_not_know(tmp_path: Path) -> None:
    report = _valid()
    report["results"][0]["localized"] = "CUDA error at Loss.cu:245"
    report["runner"] = "gpu-a100-3"
    write_report(tmp_path / "r.json", report)
    loaded = load_report(tmp_path / "r.json")
    assert loaded["results"][0]["localized"] == "CUDA error at Loss.cu:245"


# ----------------------------------------------------------------------------- the matrix


def test_columns_are_labelled_by_what_differs(two_runners: list[Path]) -> None:
    matrix = build_matrix([load_report(p) for p in two_runners], detail=False)
    assert [c.label for c in matrix.columns] == [A100_LABEL, H100_LABEL]
    assert matrix.columns[0].description == A100_ENV
    assert [c.complete for c in matrix.columns] == [True, True]


@pytest.mark.parametrize(("second", "labels"), [
    (environment("2.3.1+cu121", "12.1", "2.5.8", "NVIDIA A100-SXM4-80GB", "8.0",
                 revision="9e0d4b2"), ["rev 3f2c1ab", "rev 9e0d4b2"]),
    (environment("2.3.1+cu121", "12.1", "2.5.8", "NVIDIA A30", "8.0"),
     ["NVIDIA A100-SXM4-80GB", "NVIDIA A30"]),
    (environment("2.3.1+cu121", "12.1", None, "NVIDIA A100-SXM4-80GB", "8.0"),
     ["flash-attn 2.5.8", "no flash-attn"]),
    (environment("2.3.1", None, "2.5.8", "", "", backend="cpu", device_types=("cpu",),
                 devices=(), cudnn=None), ["cuda · cu121 · cuDNN 9.1.0 · sm_80", "cpu"]),
    (environment("2.3.1+cu121", "12.1", "2.5.8", "NVIDIA A100-SXM4-80GB", "8.0",
                 devices=(Device(0, "NVIDIA A100-SXM4-80GB", "8.0", 39.4),)),
     ["a.json", "b.json"]),
])
def test_labels_show_only_the_fields_that_differ(second: dict[str, Any],
                                                 labels: list[str]) -> None:
    first, other = new_report(A100), new_report(second)
    matrix = build_matrix([first, other], detail=False, names=["a.json", "b.json"])
    assert [c.label for c in matrix.columns] == labels


def test_reports_of_one_environment_share_a_column_and_the_later_wins(tmp_path: Path) -> None:
    early = report_file(tmp_path / "shard1.json", A100, [
        result("ce_class4", "cuda", "float32", "failed", message="flaky"),
        result("label_map", "cpu", "float32", "xfailed", message="label mapping not fixed yet"),
    ], created="2026-12-02T16:00:00+00:00")
    late = report_file(tmp_path / "shard2.json", A100, [
        result("ce_class4", "cuda", "float32", "passed"),
    ], created="2026-12-02T17:00:00+00:00", complete=False)
    # Given out of order on purpose: the later report wins by its time, not by its place.
    matrix = build_matrix([load_report(late), load_report(early)], detail=False,
                          names=["shard2.json", "shard1.json"])
    (column,) = matrix.columns
    assert column.label == "shard1.json, shard2.json"
    assert column.sources == ("shard1.json", "shard2.json")
    assert column.created == "2026-12-02T17:00:00+00:00"
    assert column.complete is False
    # The later run passed, the earlier failed: the cell says flaky (it read "pass"), and
    # shows the later run's outcome in its counts.
    assert [(row.label, row.cells[0].status) for row in matrix.rows] == [
        ("ce_class4", "flaky"), ("label_map", "xfail")]
    assert matrix.rows[0].cells[0].counts == {"passed": 1}
    assert matrix.rows[0].cells[0].reasons == (
        "flaky: cuda-float32: failed in shard1.json; passed in shard2.json (failure: flaky)",)
    assert matrix.notes == (
        ("shard1.json, shard2.json come from one environment and share a column; 1 item ran in "
         "more than one of them: the result of the report created later is shown; the outcomes "
         "of 1 item differed between them, marked in the cells: cuda-float32 of ce_class4: "
         "failed in shard1.json; passed in shard2.json (failure: flaky); 1 item is only in an "
         "older report and shown from it."),)


def test_markdown_table_cells_and_footnotes(two_runners: list[Path]) -> None:
    matrix = build_matrix([load_report(p) for p in two_runners], detail=False,
                          names=short_names(two_runners))
    assert render_markdown(matrix) == "\n".join([
        f"| case | {HEAD}",
        "| :--- | :---: | :---: |",
        "| ce_class4 | ✅ cpu: pass · ✅ cuda: pass | ✅ cpu: pass · ❌ cuda: fail[^1] |",
        "| flash_attn_mask | ⏭️ cuda: skipped (requires flash-attn>=2.6)[^2] | ✅ cuda: pass |",
        "| label_map | ⚠️ cpu: xfail[^3] | ⚠️ cpu: xfail[^3] |",
        "| oom_case | — cuda: not run | ❌ cuda: fail[^4] |",
        "",
        LEGEND,
        "",
        f"[^1]: cuda-float32, cuda-float32-batch=1: failed: {ASSERT}",
        "[^2]: skipped: requires flash-attn>=2.6; found 2.5.8",
        "[^3]: xfail: label mapping not fixed yet",
        "[^4]: error: run crashed with signal 11 (SIGSEGV)",
        "",
    ])


def test_detail_mode_has_a_row_per_variant(two_runners: list[Path]) -> None:
    matrix = build_matrix([load_report(p) for p in two_runners], detail=True)
    text = render_markdown(matrix)
    assert text.splitlines()[:8] == [
        f"| case (variant) | {HEAD}",
        "| :--- | :---: | :---: |",
        "| ce_class4 | ✅ cpu: pass · ✅ cuda: pass | ✅ cpu: pass · ❌ cuda: fail[^1] |",
        "| ce_class4 (batch=1) | ✅ cuda: pass | ❌ cuda: fail[^2] |",
        "| flash_attn_mask | ⏭️ cuda: skipped (requires flash-attn>=2.6)[^3] | ✅ cuda: pass |",
        "| label_map | ⚠️ cpu: xfail[^4] | ⚠️ cpu: xfail[^4] |",
        "| oom_case | — cuda: not run | ❌ cuda: fail[^5] |",
        "",
    ]
    # In the row of the case as saved, one of two CUDA runs failed; in the variant's row, all did.
    assert "[^1]: cuda-float32: failed: CUDA error: device-side assert triggered" in text
    assert "[^2]: failed: CUDA error: device-side assert triggered" in text
    base = matrix.rows[0]
    assert (base.case, base.variant, dict(base.cells[1].counts)) == (
        "ce_class4", None, {"passed": 2, "failed": 1})


def test_markdown_escapes_what_github_would_read_as_markup(tmp_path: Path) -> None:
    path = report_file(tmp_path / "r.json", A100, [
        result("masks", "cpu", "float32", "failed",
               message="TypeError: __init__() got x | y <class 'int'> [^1] *args"),
    ])
    text = render_markdown(build_matrix([load_report(path)], detail=False))
    assert r"[^1]: failed: TypeError: \_\_init\_\_() got x \| y \<class 'int'> \[^1\] \*args" \
        in text.splitlines()


def test_cells_say_xfail_and_incomplete_distinctly(tmp_path: Path) -> None:
    path = report_file(tmp_path / "r.json", A100, [
        result("label_map", "cpu", "float32", "xfailed", message="known"),
        result("label_map", "cuda", "float32", "passed"),
        result("strict", "cpu", "float32", "xpassed", message="outputs match"),
    ], complete=False)
    matrix = build_matrix([load_report(path)], detail=False)
    assert [(row.label, row.cells[0].status, row.cells[0].reasons) for row in matrix.rows] == [
        ("label_map", "xfail", ("xfail: known",)),
        ("strict", "fail", ("passed although marked xfail (strict): outputs match",)),
    ]
    assert render_markdown(matrix).startswith("| case | **report 1** (incomplete run)<br>cuda ")


CPU_ONLY = environment("2.3.1", None, "2.5.8", "", "", backend="cpu", device_types=("cpu",),
                       devices=(), cudnn=None)
NO_CUDA = "no CUDA device here (cpu backend): a CPU pass is a hint"


def test_a_cpu_pass_never_reads_as_a_cuda_pass(tmp_path: Path) -> None:
    cpu_runner = report_file(tmp_path / "cpu.json", CPU_ONLY, [
        result("ce_class4", "cpu", "float32", "passed"),
        result("ce_class4", "cuda", "float32", "skipped", skip_reason=NO_CUDA),
        result("cpu_only", "cpu", "float32", "passed"),
    ])
    gpu_runner = report_file(tmp_path / "gpu.json", A100, [
        result("ce_class4", "cuda", "float32", "passed"),
        result("cpu_only", "cpu", "float32", "passed"),
    ])
    matrix = build_matrix([load_report(cpu_runner), load_report(gpu_runner)], detail=False,
                          names=["cpu.json", "gpu.json"])
    ce_class4, cpu_only = matrix.rows
    assert [cell.status for cell in ce_class4.cells] == ["partial", "partial"]
    assert [[d.text for d in cell.devices] for cell in ce_class4.cells] == [
        ["cpu: pass", "cuda: skipped (no CUDA device here)"], ["cpu: not run", "cuda: pass"]]
    # A case that runs only on the CPU passes on the CPU, and says so.
    assert [cell.status for cell in cpu_only.cells] == ["pass", "pass"]
    lines = render_markdown(matrix).splitlines()
    assert lines[2] == ("| ce_class4 | ✅ cpu: pass · ⏭️ cuda: skipped (no CUDA device here)[^1] | "
                        "— cpu: not run · ✅ cuda: pass |")
    assert lines[3] == "| cpu_only | ✅ cpu: pass | ✅ cpu: pass |"
    assert f"[^1]: skipped: {NO_CUDA}" in lines
    assert lines[0].startswith("| case | **cpu**<br>cpu backend · torch 2.3.1 · Python 3.11.9 · ")
    data = json.loads(render_json(matrix))
    assert data["rows"][0]["cells"][0]["devices"] == [
        {"device": "cpu", "status": "pass", "reasons": []},
        {"device": "cuda", "status": "skip", "reasons": [f"skipped: {NO_CUDA}"]}]
    html_text = render_html(matrix)
    assert "✓ cpu: pass" in html_text and "↷ cuda: skipped (no CUDA device here)" in html_text
    assert '<td class="partial"' in html_text


def stacked(tmp_path: Path) -> list[dict[str, Any]]:
    """Loaded reports whose cuda runs fail for two reasons in one cell."""
    path = report_file(tmp_path / "r.json", A100, [
        result("ce_class4", "cuda", "float32", "failed", message=ASSERT),
        result("ce_class4", "cuda", "bfloat16", "skipped", skip_reason="bfloat16 not on sm_70"),
        result("ce_class4", "cpu", "float32", "failed", message="values differ"),
        result("ce_class4", "cpu", "bfloat16", "failed", message="values differ"),
    ])
    return [load_report(path)]


def test_stacked_notes_are_told_apart(tmp_path: Path) -> None:
    matrix = build_matrix(stacked(tmp_path), detail=False)
    assert render_markdown(matrix).splitlines()[2] == (
        "| ce_class4 | ❌ cpu: fail[^1] · ❌ cuda: fail[^2],[^3] |")
    page = render_html(matrix)
    assert ('<sup><a href="#reason-2" aria-label="note 2">2</a>,'
            '<a href="#reason-3" aria-label="note 3">3</a></sup>') in page


def test_json_render(two_runners: list[Path]) -> None:
    matrix = build_matrix([load_report(p) for p in two_runners], detail=False,
                          names=short_names(two_runners))
    data = json.loads(render_json(matrix))
    assert (data["schema"], data["version"], data["detail"]) == ("pytest-gpucase/matrix", 1, False)
    assert [c["label"] for c in data["columns"]] == [A100_LABEL, H100_LABEL]
    assert [c["sources"] for c in data["columns"]] == [["a100/report.json"], ["h100/report.json"]]
    assert data["columns"][1]["environment"]["torch"] == "2.4.0+cu124"
    assert data["rows"][0] == {
        "label": "ce_class4", "case": "ce_class4", "case_path": "cases/ce_class4",
        "variant": None,
        "cells": [
            {"status": "pass", "counts": {"passed": 3}, "reasons": [],
             "devices": [{"device": "cpu", "status": "pass", "reasons": []},
                         {"device": "cuda", "status": "pass", "reasons": []}]},
            {"status": "fail", "counts": {"passed": 2, "failed": 2},
             "reasons": [f"cuda-float32, cuda-float32-batch=1: failed: {ASSERT}"],
             "devices": [{"device": "cpu", "status": "pass", "reasons": []},
                         {"device": "cuda", "status": "fail",
                          "reasons": [f"cuda-float32, cuda-float32-batch=1: failed: {ASSERT}"]}]},
        ],
    }
    assert data["rows"][3]["cells"][0] == {
        "status": "not run", "counts": {}, "reasons": [],
        "devices": [{"device": "cuda", "status": "not run", "reasons": []}]}
    assert data["notes"] == []


def test_short_names_tell_the_files_apart() -> None:
    assert short_names([Path("dl/a100/report.json"), Path("dl/h100/report.json")]) == [
        "a100/report.json", "h100/report.json"]
    assert short_names([Path("x/a.json"), Path("y/b.json")]) == ["a.json", "b.json"]


# ----------------------------------------------------------------------------- step summary


STEP_SUMMARY = "\n".join([
    "### pytest-gpucase: ❌ 2 failed, 1 error, 1 xfailed, 3 passed",
    "",
    ("cuda backend · torch 2.4.0+cu124 · CUDA 12.4 · cuDNN 9.1.0 · Python 3.11.9 · "
    "1 × NVIDIA H100 80GB HBM3 (9.0) · rev 3f2c1ab · flash-attn 2.6.3"),
    "",
    "**Failed**",
    "",
    f"- `cases/ce_class4::ce_class4[cuda-float32]`: {ASSERT} (clue: device-side assert)",
    f"- `cases/ce_class4::ce_class4[cuda-float32-batch=1]`: {ASSERT}",
    "- `cases/oom_case::oom_case[cuda-float16]`: error: run crashed with signal 11 (SIGSEGV)",
    "",
])


def test_step_summary_counts_outcomes_and_lists_failures(two_runners: list[Path]) -> None:
    assert step_summary(load_report(two_runners[1])) == STEP_SUMMARY


def test_step_summary_of_a_clean_unfinished_run(tmp_path: Path) -> None:
    path = report_file(tmp_path / "r.json", A100, A100_RESULTS[:1], complete=False)
    assert step_summary(load_report(path)).splitlines()[:4] == [
        "### pytest-gpucase: ⚠️ 1 passed",
        "",
        "⚠️ The run did not finish: these are the items recorded before it stopped.",
        "",
    ]


def test_append_step_summary_appends_to_githubs_file(
        two_runners: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "step_summary.md"
    summary.write_text("## Build\nok", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report = load_report(two_runners[1])
    assert append_step_summary(report) == summary
    assert summary.read_text(encoding="utf-8") == "## Build\nok\n" + STEP_SUMMARY

    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    assert append_step_summary(report) is None
    assert append_step_summary(report, env={"GITHUB_STEP_SUMMARY": str(tmp_path / "new.md")}) \
        == tmp_path / "new.md"
    assert (tmp_path / "new.md").read_text(encoding="utf-8") == STEP_SUMMARY


FORGED = "x]\n\n## All 500 cases passed\n\n<img src=x onerror=alert(1)> `| cell |`"


def test_step_summary_cannot_be_forged_by_a_node_id_or_message(tmp_path: Path) -> None:
    hostile = result("ce", "cpu", "float32", "failed", nodeid=f"cases/ce::ce[{FORGED}]",
                     message=f"# heading\n{FORGED}\x1b[2J",
                     triage={"clue": "- [ ] task\n> quote"})
    path = report_file(tmp_path / "r.json", A100, [hostile])
    text = step_summary(load_report(path))
    lines = text.splitlines()
    # Our heading is the only line that starts a block; the forged one is inert text.
    assert [line for line in lines if line.startswith(("#", ">", "<", "|", "-"))] == [
        lines[0], lines[6]]
    assert lines[0] == "### pytest-gpucase: ❌ 1 failed"
    item = lines[6]
    assert item.startswith("- ``cases/ce::ce[x] ## All 500 cases passed "
                           "<img src=x onerror=alert(1)> `| cell |`]``: ")
    assert "\\# heading x\\] \\#\\# All 500 cases passed \\<img src=x" in item
    assert "\\x1b" not in item and "\x1b" not in item
    assert item.endswith("(clue: \\- \\[ \\] task > quote)")


@pytest.mark.parametrize(("text", "markdown"), [
    ("## All 500 cases passed", r"\#\# All 500 cases passed"),
    ("a\nb\r\n\tc", "a b c"),
    ("> quote", r"\> quote"),
    ("- item", r"\- item"),
    ("1. first", r"\1. first"),
    ("x | y `z` <b>&amp;</b> ~~no~~ *a* _b_ sm_80", r"x \| y \`z\` \<b>\&amp;\</b> \~\~no\~\~ "
     r"\*a\* \_b\_ sm_80"),
])
def test_markdown_text_is_literal_on_one_line(text: str, markdown: str) -> None:
    assert markdown_text(text) == markdown


@pytest.mark.parametrize(("text", "code"), [
    ("cases/a::a[cpu-float32]", "`cases/a::a[cpu-float32]`"),
    ("a`b", "``a`b``"),
    ("`a``\nb`", "``` `a`` b` ```"),
])
def test_markdown_code_fences_any_backticks(text: str, code: str) -> None:
    assert markdown_code(text) == code


@pytest.mark.parametrize(("text", "safe"), [
    ("\x1b[31mred\x1b[0m plain", "red plain"),
    ("title\x1b]0;pwned\x07 after", "title after"),
    ("link \x1b]8;;http://x\x1b\\text\x1b]8;;\x1b\\", "link text"),
    ("bell\x07 nul\x00 del\x7f csi\x9b", "bell\\x07 nul\\x00 del\\x7f csi\\x9b"),
    ("50%\r100%\r\n", "50%\n100%\n"),
    ("tab\tand\nnewline", "tab\tand\nnewline"),
    ("evil\u202efdp.exe", "evil\\u202efdp.exe"),
    ("lone \x1b escape", "lone \\x1b escape"),
    ("\x1b[" + "1;" * 100 + "m", "\\x1b[" + "1;" * 100 + "m"),
])
def test_terminal_safe_strips_escapes_and_shows_other_controls(text: str, safe: str) -> None:
    assert terminal_safe(text) == safe


def test_html_escapes_every_text_from_a_report(tmp_path: Path) -> None:
    path = report_file(tmp_path / "r.json", environment(
        "2.3.1", None, "2.5.8", "<b>GPU</b>", "8.0", platform="<script>alert(1)</script>"), [
        {**result("ce", "cpu", "float32", "failed", message="<img src=x onerror=alert(1)>"),
         "case": "<i>ce</i>", "case_path": 'c/"><x>'}])
    page = render_html(build_matrix([load_report(path)], detail=False,
                                    names=['<a href="x">r.json</a>']))
    body = page.split("</style>", 1)[1]
    for raw in ("<script>", "<img", "<b>GPU", "<i>ce", '"><x>', '<a href="x">'):
        assert raw not in body
    assert "&lt;img src=x onerror=alert(1)&gt;" in body


# ----------------------------------------------------------------------------- gpucase matrix


def test_gpucase_matrix_prints_markdown(two_runners: list[Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", *map(str, two_runners)]) == 0
    out = capsys.readouterr().out
    expected = build_matrix([load_report(p) for p in two_runners], detail=False,
                            names=short_names(two_runners))
    assert out == render_markdown(expected)
    assert out.startswith(f"| case | {HEAD}\n")


def test_gpucase_matrix_writes_html_with_detail(two_runners: list[Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "matrix.html"
    assert main(["matrix", *map(str, two_runners), "--format", "html", "--detail",
                 "-o", str(output)]) == 0
    assert capsys.readouterr().out == f"gpucase: wrote {output} (5 rows × 2 environments)\n"
    assert "ce_class4 (batch=1)" in output.read_text(encoding="utf-8")


def test_gpucase_matrix_prints_json(two_runners: list[Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", *map(str, two_runners), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "pytest-gpucase/matrix"


def test_gpucase_matrix_names_every_bad_file_and_exits_2(
        two_runners: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junit = tmp_path / "junit.json"
    junit.write_text('{"schema": "junit"}', encoding="utf-8")
    missing = tmp_path / "missing.json"
    assert main(["matrix", str(two_runners[0]), str(junit), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        (f'gpucase: {junit}: not a pytest-gpucase report: "schema" is "junit", '
        'expected "pytest-gpucase/report"'),
        f"gpucase: {missing}: cannot read: No such file or directory",
    ]


@pytest.mark.slow
def test_report_modules_import_neither_torch_nor_pytest() -> None:
    code = ("import sys, pytest_gpucase.report.file, pytest_gpucase.report.matrix, "
            "pytest_gpucase.report.render, pytest_gpucase.report.summary; "
            "print(sorted({'torch', 'pytest'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- HTML, as seen


class _Page(HTMLParser):
    """What a reader of the rendered DOM finds: header cells, row headers, cells with hovers."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str | None]]] = []
        self.cells: list[tuple[str, dict[str, str | None], str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("th", "td", "li", "dt"):
            self.stack.append((tag, dict(attrs)))
            self.text = []

    def handle_endtag(self, tag: str) -> None:
        if self.stack and self.stack[-1][0] == tag:
            name, attrs = self.stack.pop()
            self.cells.append((name, attrs, " ".join("".join(self.text).split())))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("needs Debian's chromium for a headless render: apt-get install -y chromium")
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.slow   # a headless browser
def test_html_renders_the_matrix_in_chromium(two_runners: list[Path], tmp_path: Path) -> None:
    page = tmp_path / "matrix.html"
    matrix = build_matrix([load_report(p) for p in two_runners], detail=False,
                          names=short_names(two_runners))
    page.write_text(render_html(matrix), encoding="utf-8")
    # One file: no stylesheet, script or image to fetch, and every link stays on the page.
    assert not re.search(r'<(link|script|img)\b|(src|href)="(?!#)', page.read_text("utf-8"))

    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile").stdout
    seen = _Page()
    seen.feed(dom)
    headers = [(attrs.get("scope"), text) for tag, attrs, text in seen.cells if tag == "th"]
    assert headers == [
        ("col", "case"), ("col", f"{A100_LABEL}{A100_ENV}"), ("col", f"{H100_LABEL}{H100_ENV}"),
        ("row", "ce_class4"), ("row", "flash_attn_mask"), ("row", "label_map"),
        ("row", "oom_case"),
    ]
    cells = [(attrs["class"], text) for tag, attrs, text in seen.cells if tag == "td"]
    assert cells == [
        ("pass", "✓ cpu: pass✓ cuda: pass"), ("fail", "✓ cpu: pass✗ cuda: fail1"),
        ("skip", "↷ cuda: skipped (requires flash-attn>=2.6)2"), ("pass", "✓ cuda: pass"),
        ("xfail", "⚠ cpu: xfail3"), ("xfail", "⚠ cpu: xfail3"),
        ("not-run", "— cuda: not run"), ("fail", "✗ cuda: fail4"),
    ]
    hovers = [attrs["title"] for tag, attrs, text in seen.cells if tag == "td"]
    # A cell's title holds only its counts (labels once per row and column, reasons once in
    # the notes): the page's size stays linear in its reports.
    assert hovers[1] == "fail: 2 passed, 2 failed"
    assert hovers[2] == "skip: 1 skipped"
    column_hover = next(attrs["title"] for tag, attrs, text in seen.cells
                        if tag == "th" and text.startswith(H100_LABEL))
    assert column_hover == "from h100/report.json"
    assert describe_environment(H100) == H100_ENV
    notes = [(attrs.get("id"), text) for tag, attrs, text in seen.cells if tag == "li"]
    assert notes == [
        ("reason-1", f"cuda-float32, cuda-float32-batch=1: failed: {ASSERT}"),
        ("reason-2", "skipped: requires flash-attn>=2.6; found 2.5.8"),
        ("reason-3", "xfail: label mapping not fixed yet"),
        ("reason-4", "error: run crashed with signal 11 (SIGSEGV)"),
    ]
    legend = [text for tag, attrs, text in seen.cells if tag == "dt"][:8]
    assert legend == ["✓ pass", "✗ fail", "✓! fixed", "≠ flaky", "⚠ xfail", "↷ skipped",
                      "■ interrupted", "— not run"]

    shot = tmp_path / "matrix.png"
    _chromium("--window-size=1280,1000", f"--screenshot={shot}", page.as_uri(),
              profile=tmp_path / "profile")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_shipped_schema_is_the_one_the_docs_point_at() -> None:
    from importlib import resources

    schema = json.loads(resources.files("pytest_gpucase").joinpath("report_schema.json")
                        .read_text(encoding="utf-8"))
    docs = (Path(__file__).parent.parent / "docs" / "report-schema.md").read_text("utf-8")
    assert "pytest_gpucase/report_schema.json" in docs
    assert schema["properties"]["schema"]["const"] == SCHEMA
    assert schema["properties"]["version"]["enum"] == list(range(1, VERSION + 1))
    for name in ("environment", "result"):
        for key in schema["$defs"][name]["required"]:
            assert f"| `{key}` |" in docs or f"`{key}`" in docs, key
    record = result("ce", "cpu", "float32", "passed", max_abs=math.nan, localized=None)
    report = new_report(A100)
    report["results"] = [record]
    check_report(report)   # a record as the plugin writes it, NaN included
    report["results"] = [{**record, "localized": 3}]
    with pytest.raises(ReportError, match=r"results\[0\]\.localized: expected a string or null"):
        check_report(report)


def test_step_summary_names_a_case_as_its_node_id_does(tmp_path: Path) -> None:
    """A case outside the working directory is shown by its absolute path in the run's message;
    the summary writes it relative to the rootdir, as the node id beside it."""
    broken = result("bom", "all", "all", "failed", nodeid="cases/bom/case.toml::bom",
                    case_path="/ci/work/cases/bom", error_type="CaseFormatError",
                    message="/ci/work/cases/bom/case.toml: invalid TOML; in /ci/work/cases/bom, "
                    "not /ci/work/cases/bomb/case.toml nor /ci/work/cases/bom.old")
    path = report_file(tmp_path / "r.json", A100, [broken])
    assert step_summary(load_report(path)).splitlines()[6] == (
        "- `cases/bom/case.toml::bom`: cases/bom/case.toml: invalid TOML; in cases/bom, not "
        "/ci/work/cases/bomb/case.toml nor /ci/work/cases/bom.old")


@pytest.mark.slow
def test_step_summary_of_a_run_outside_the_rootdir(pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\n")
    (pytester.path / "cases" / "bom").mkdir(parents=True)
    (pytester.path / "cases" / "bom" / "case.toml").write_bytes(b"\xef\xbb\xbfformat = 1\n")
    (pytester.path / "ci").mkdir()
    summary = pytester.path / "ci" / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.chdir(pytester.path / "ci")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpu-cases", "../cases")
    [line] = [line for line in summary.read_text(encoding="utf-8").splitlines()
              if line.startswith("- ")]
    assert line.startswith("- `cases/bom/case.toml::bom`: cases/bom/case.toml: ")
    assert str(pytester.path) not in line


# --- which reports share an environment, and how their items merge ---------------------------


def _env(**packages: str | None) -> dict[str, Any]:
    return environment("2.4.0+cu124", "12.4", None, "NVIDIA H100 80GB HBM3", "9.0",
                       packages=dict(packages))


def _one(path: Path, env: dict[str, Any], outcome: str, created: str, case: str = "pool",
         **fields: Any) -> dict[str, Any]:
    return load_report(report_file(path, env, [result(case, "cuda", "float32", outcome,
                                                      **fields)], created=created))


def test_a_package_only_one_report_names_is_unknown_there_not_different(tmp_path: Path) -> None:
    """Shards of one runner: only shard 1's cases ask about tinyext. They are one column (it
    was two, a checkerboard of "not run"), named with the version shard 1 found."""
    shard1 = _one(tmp_path / "shard-1.json", _env(tinyext="2.0"), "passed",
                  "2026-12-02T16:00:00+00:00")
    shard2 = _one(tmp_path / "shard-2.json", _env(), "passed", "2026-12-02T16:00:01+00:00",
                  case="plain")
    assert same_environment(shard1["environment"], shard2["environment"])
    matrix = build_matrix([shard1, shard2], detail=False, names=["shard-1.json", "shard-2.json"])
    (column,) = matrix.columns
    assert column.sources == ("shard-1.json", "shard-2.json")
    assert column.environment["packages"] == {"tinyext": "2.0"}
    assert column.description.endswith("· tinyext 2.0")
    assert [(row.label, row.cells[0].status) for row in matrix.rows] == [
        ("plain", "pass"), ("pool", "pass")]
    # no item in both: nothing was replaced, nothing is called older
    assert matrix.notes == ("shard-1.json, shard-2.json come from one environment and share a "
                            "column.",)


def test_a_package_both_name_at_other_versions_splits_the_column(tmp_path: Path) -> None:
    """tinyext 1.0 fails, 2.0 passes: two columns, the failure shown (it merged into a pass)."""
    old = _one(tmp_path / "1.0.json", _env(tinyext="1.0"), "failed", "2026-12-02T16:00:00+00:00",
               message="wrong mean")
    new = _one(tmp_path / "2.0.json", _env(Tinyext="2.0"), "passed", "2026-12-02T16:00:01+00:00")
    assert not same_environment(old["environment"], new["environment"])
    matrix = build_matrix([old, new], detail=False, names=["1.0.json", "2.0.json"])
    assert [column.label for column in matrix.columns] == ["tinyext 1.0", "Tinyext 2.0"]
    assert [cell.status for cell in matrix.rows[0].cells] == ["fail", "pass"]
    # names compare as pip compares them
    assert same_environment(_env(flash_attn="2.6.3"), _env(**{"Flash-Attn": "2.6.3"}))
    assert not same_environment(_env(flash_attn="2.6.3"), _env(**{"flash-attn": None}))


def test_a_report_that_cannot_tell_two_columns_apart_gets_its_own(tmp_path: Path) -> None:
    one = _one(tmp_path / "a.json", _env(tinyext="1.0"), "failed", "2026-12-02T16:00:00+00:00")
    two = _one(tmp_path / "b.json", _env(tinyext="2.0"), "passed", "2026-12-02T16:00:00+00:00")
    neither = _one(tmp_path / "c.json", _env(), "passed", "2026-12-02T16:00:00+00:00",
                   case="plain")
    for order in ([one, two, neither], [neither, two, one]):
        names = ["a.json", "b.json", "c.json"] if order[0] is one else [
            "c.json", "b.json", "a.json"]
        matrix = build_matrix(order, detail=False, names=names)
        assert sorted(column.sources for column in matrix.columns) == [
            ("a.json",), ("b.json",), ("c.json",)]
        assert matrix.notes == (
            "c.json does not name tinyext, which tells apart the environments it would "
            "otherwise share a column with: it has a column of its own.",)


def test_a_shard_that_names_only_the_project_package_joins_no_extension_column(
        tmp_path: Path) -> None:
    """Two jobs (tinyext 1.0 and 2.0), each split in two shards, the second shard of each
    naming only the project's package: placed greedily in the order the reports were made,
    the 2.0 job's shard joined the 1.0 column, whose case then read failing under 1.0."""
    first_one = _one(tmp_path / "a1.json", _env(tinyext="1.0"), "passed",
                     "2026-12-02T16:00:00+00:00", case="ext")
    second_one = _one(tmp_path / "a2.json", _env(mymodel="0.1"), "passed",
                      "2026-12-02T16:00:01+00:00", case="model")
    second_two = _one(tmp_path / "b2.json", _env(mymodel="0.1"), "failed",
                      "2026-12-02T16:00:02+00:00", case="model")
    first_two = _one(tmp_path / "b1.json", _env(tinyext="2.0"), "failed",
                     "2026-12-02T16:00:03+00:00", case="ext")
    names = ["a1.json", "a2.json", "b2.json", "b1.json"]
    matrix = build_matrix([first_one, second_one, second_two, first_two], detail=False,
                          names=names)
    assert sorted(column.sources for column in matrix.columns) == [
        ("a1.json",), ("a2.json",), ("b1.json",), ("b2.json",)]
    assert matrix.notes == tuple(
        f"{name} does not name tinyext, which tells apart the environments it would "
        "otherwise share a column with: it has a column of its own."
        for name in ("a2.json", "b2.json"))


def test_a_key_a_newer_writer_adds_to_the_environment_does_not_split_it(tmp_path: Path) -> None:
    """The schema lets a writer add keys: one environment read as two columns, with equal
    descriptions and no word why. Only the identity keys compare; the writers are named."""
    old = load_report(report_file(tmp_path / "old.json", _env(), [
        result("pool", "cuda", "float32", "passed")], created="2026-12-02T16:00:00+00:00"))
    old.pop("gpucase")   # as an older writer left it
    new = _one(tmp_path / "new.json", {**_env(), "driver": "550.54"}, "passed",
               "2026-12-02T17:00:00+00:00")
    new["gpucase"] = "0.2.0"
    assert same_environment(old["environment"], new["environment"])
    matrix = build_matrix([new, old], detail=False, names=["new.json", "old.json"])
    (column,) = matrix.columns
    assert column.sources == ("old.json", "new.json")
    assert matrix.notes[0].endswith(
        "; they were written by different versions of pytest-gpucase: an older one (old.json), "
        "0.2.0 (new.json).")
    # a key every version-1 report has still tells environments apart
    assert not same_environment(_env(), {**_env(), "revision": "0000000"})


def test_reports_started_at_the_same_moment_merge_whatever_their_order(tmp_path: Path) -> None:
    """Equal created times: the file named last won, while the note claimed "created later".
    Now the worse outcome is shown, in either order, and the note says why."""
    failed = _one(tmp_path / "try-1.json", _env(), "failed", "2026-12-02T16:00:00+00:00",
                  message="off by 0.5")
    passed = _one(tmp_path / "try-2.json", _env(), "passed", "2026-12-02T16:00:00+00:00")
    forward = build_matrix([failed, passed], detail=False, names=["try-1.json", "try-2.json"])
    backward = build_matrix([passed, failed], detail=False, names=["try-2.json", "try-1.json"])
    assert render_markdown(forward) == render_markdown(backward)
    cell = forward.rows[0].cells[0]
    assert (cell.status, cell.counts) == ("fail", {"failed": 1})
    assert cell.reasons == (
        "flaky: cuda-float32: failed in try-1.json; passed in try-2.json (failure: off by 0.5)",
        "failed: off by 0.5")
    assert forward.notes[0].endswith(
        "; try-1.json, try-2.json were started at the same moment, so which ran later is "
        "unknown: for an item in more than one of them the worse outcome is shown (a failure "
        "before a pass), whatever the order of the files.")


def test_a_pass_then_a_failure_is_a_failure_that_says_it_passed_before(tmp_path: Path) -> None:
    passed = _one(tmp_path / "a.json", _env(), "passed", "2026-12-02T16:00:00+00:00")
    failed = _one(tmp_path / "b.json", _env(), "failed", "2026-12-02T16:00:00.5+00:00",
                  message="race")
    skipped = _one(tmp_path / "c.json", _env(), "skipped", "2026-12-02T16:00:01+00:00",
                   case="other", skip_reason="no CUDA device here")
    matrix = build_matrix([passed, failed, skipped], detail=False,
                          names=["a.json", "b.json", "c.json"])
    pool = next(row for row in matrix.rows if row.label == "pool")
    assert pool.cells[0].status == "fail"
    assert pool.cells[0].reasons[0] == ("flaky: cuda-float32: passed in a.json; failed in "
                                        "b.json (failure: race)")
    text = render_markdown(matrix)
    assert "| pool | ❌ cuda: fail[^2],[^3] |" in text   # [^1] is the other row's skip
    assert "[^2]: flaky: cuda-float32: passed in a.json; failed in b.json (failure: race)" in text


def test_a_run_cut_short_shows_the_interrupted_and_unstarted_items(tmp_path: Path) -> None:
    report = new_report(_env())
    report["results"] = [
        result("a_fast", "cuda", "float32", "passed"),
        result("b_hangs", "cuda", "float32", "interrupted",
               message="pytest received SIGTERM while a case ran (cases/b_hangs::b_hangs"
                       "[cuda-float32]); the run's processes were killed"),
        result("c_later", "cuda", "float32", "not run",
               message="the run was interrupted before it started: terminated"),
    ]
    assert report_version(report["results"]) == 2
    assert report_version(report["results"][:1]) == 1
    report["version"] = 2
    write_report(tmp_path / "r.json", report)
    matrix = build_matrix([load_report(tmp_path / "r.json")], detail=False, names=["r.json"])
    assert [(row.label, row.cells[0].status) for row in matrix.rows] == [
        ("a_fast", "pass"), ("b_hangs", "interrupted"), ("c_later", "not run")]
    text = render_markdown(matrix)
    assert "| b_hangs | ⏹️ cuda: interrupted[^1] |" in text
    assert "| c_later | — cuda: not run[^2] |" in text
    assert "■ cuda: interrupted" in render_html(matrix)
    summary = step_summary(load_report(tmp_path / "r.json"))
    assert summary.startswith("### pytest-gpucase: ⚠️ 1 interrupted, 1 passed, 1 not run")
    # a "not run" never hides a run that happened: a rerun's report is merged with it
    rerun = _one(tmp_path / "older.json", _env(), "passed", "2026-12-01T16:00:00+00:00",
                 case="c_later")
    merged = build_matrix([load_report(tmp_path / "r.json"), rerun], detail=False,
                          names=["r.json", "older.json"])
    assert [(row.label, row.cells[0].status) for row in merged.rows][-1] == ("c_later", "pass")


def test_created_is_written_to_the_microsecond() -> None:
    from datetime import datetime

    created = new_report(_env())["created"]
    assert datetime.fromisoformat(created).tzinfo is not None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", created)


@pytest.mark.slow   # a headless browser
def test_the_pivot_renders_six_torch_columns_in_version_order_in_chromium(
        tmp_path: Path) -> None:
    """extension x torch: the page a maintainer reads at a glance, one self-contained file,
    its columns in version order (2.9.1 before 2.10.0), at 1600 px."""
    from pytest_gpucase.report.pivot import pivot, render_pivot_html

    torches = ["2.14.1", "2.9.1", "2.13.0", "2.10.0", "2.12.1", "2.11.0"]   # as given
    reports = []
    for n, (torch_version, rowext) in enumerate(
            (t, r) for t in torches for r in ("2.0", "1.0", "10.0")):
        env = environment(torch_version, "12.8", None, "x", "9.0", packages={"rowext": rowext})
        outcome = "failed" if rowext == "1.0" else "passed"
        reports.append({"schema": SCHEMA, "version": 1, "environment": env, "complete": True,
                        "created": f"2026-12-01T10:00:{n:02d}+00:00",
                        "results": [result("rowsum", "cuda", "float32", outcome,
                                           message=None if outcome == "passed" else "differ")]})
    page = tmp_path / "pivot.html"
    page.write_text(render_pivot_html(pivot(build_matrix(reports, detail=False), "rowext",
                                            "torch")), encoding="utf-8")
    assert not re.search(r'<(link|script|img)\b|(src|href)="(?!#)', page.read_text("utf-8"))
    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile").stdout
    seen = _Page()
    seen.feed(dom)
    headers = [text for tag, attrs, text in seen.cells if tag == "th"]
    assert headers[:7] == ["rowext \\ torch", "torch 2.9.1", "torch 2.10.0", "torch 2.11.0",
                           "torch 2.12.1", "torch 2.13.0", "torch 2.14.1"]
    assert headers[7:10] == ["rowext 1.0", "rowext 2.0", "rowext 10.0"]
    shot = tmp_path / "pivot.png"
    _chromium("--window-size=1600,1000", f"--screenshot={shot}", page.as_uri(),
              profile=tmp_path / "profile")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_gives_a_fixed_strict_xfail_its_own_look(tmp_path: Path) -> None:
    """XPASS(strict) fails the run, but it is a fix to welcome (delete the xfail line), not
    a breakage: the HTML page shows it apart from a red failure, and says so in the legend."""
    path = report_file(tmp_path / "r.json", A100, [
        result("fixed_case", "cuda", "float32", "xpassed",
               message="[XPASS(strict)] known failure: IndexError"),
        result("fixed_case", "cpu", "float32", "passed"),
        result("broken", "cuda", "float32", "failed", message=ASSERT),
        result("broken", "cpu", "float32", "xpassed", message="[XPASS(strict)] x"),
    ])
    page = render_html(build_matrix([load_report(path)], detail=False))
    rows = [part.split("</tr>")[0] for part in page.split("<tr>")]
    row = next(part for part in rows if ">fixed_case</th>" in part)
    assert '<td class="fixed"' in row
    assert '<span class="device d-fixed">✓! cuda: fixed' in row
    assert "✗" not in row
    broken = next(part for part in rows if ">broken</th>" in part)
    assert '<td class="fail"' in broken   # a real failure beside it keeps the cell red
    assert '✗ cuda: fail' in broken and '✓! cpu: fixed' in broken
    assert ('<dt class="fixed">✓! fixed</dt><dd>every failing run passed although marked '
            "xfail (strict): the bug is fixed here; delete the xfail line from case.toml</dd>"
            ) in page
    assert ".fixed { background:" in page
    markdown = render_markdown(build_matrix([load_report(path)], detail=False))
    assert "❌ cuda: fail" in markdown   # Markdown and JSON keep the status the run had


def test_no_fixed_look_while_another_run_of_the_case_still_fails_as_expected(
        tmp_path: Path) -> None:
    """float64 passed (XPASS(strict)) while float32 still failed as expected: the page said
    "fixed: delete the xfail line", which would turn float32 red."""
    path = report_file(tmp_path / "r.json", A100, [
        result("half_fixed", "cpu", "float64", "xpassed", message="[XPASS(strict)] x"),
        result("half_fixed", "cpu", "float32", "xfailed", message="known failure"),
        result("elsewhere", "cpu", "float32", "xpassed", message="[XPASS(strict)] x"),
        result("elsewhere", "cuda", "float32", "xfailed", message="known failure"),
    ])
    page = render_html(build_matrix([load_report(path)], detail=False))
    rows = [part.split("</tr>")[0] for part in page.split("<tr>")]
    for name in ("half_fixed", "elsewhere"):
        row = next(part for part in rows if f">{name}</th>" in part)
        assert 'class="fixed"' not in row and "d-fixed" not in row, row
        assert "✗ cpu: fail" in row, row


def test_a_device_whose_runs_did_not_all_start_is_no_pass_and_the_pivot_says_so(
        tmp_path: Path) -> None:
    """-x (or a kill) stopped a run after one dtype passed: the device read "pass", whose
    legend says every run on it ran and passed, and the pivot dropped "(incomplete run)"."""
    from pytest_gpucase.report.pivot import pivot, render_pivot_html, render_pivot_markdown

    path = report_file(tmp_path / "r.json", A100, [
        result("a_ok", "cpu", "float32", "passed"),
        result("a_ok", "cpu", "float64", "not run", message="the run stopped"),
    ], complete=False)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": report_version(data["results"])}))
    matrix = build_matrix([load_report(path)], detail=False)
    assert matrix.rows[0].cells[0].devices[0].status == "partial"
    assert matrix.rows[0].cells[0].status == "partial"
    assert "✅" not in render_markdown(matrix).split("\n\n")[0]   # the table, not the legend
    view = pivot(matrix, "torch", "python")
    markdown = render_pivot_markdown(view)
    assert "(incomplete run)" in markdown.split("### a_ok")[0]   # the summary table
    assert markdown.count("(incomplete run)") >= 3   # summary, the case's table, environments
    assert "(incomplete run)" in render_pivot_html(view)


def test_the_step_summary_of_a_run_that_failed_with_no_item_failing_is_red() -> None:
    """--gpu-devices cpu,cuda on a machine without a GPU fails the job (exit 1), but the
    summary's heading was a green mark."""
    report = new_report(A100)
    report.update(results=[result("a", "cpu", "float32", "passed")], complete=True)
    assert step_summary(report).startswith("### pytest-gpucase: ✅")
    note = "--gpu-devices asked for cuda, which this machine does not have"
    failed = step_summary(report, exit_status=1, notes=[note])
    assert failed.startswith("### pytest-gpucase: ❌ 1 passed")
    assert "The run failed (pytest exit status 1), though no item failed:" in failed
    assert f"- {markdown_text(note)}" in failed

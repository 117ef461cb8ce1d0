"""The JSON record of an item, built from its pytest report: what the report writer
stores for each item (checked against ``report_schema.json``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.errors import display_posix
from pytest_gpucase.plan.environment import canonical_name
from pytest_gpucase.report.file import property_value

if TYPE_CHECKING:
    import pytest

    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.parent import Verdict

__all__ = [
    "broken_fields", "crash_record", "item_fields", "item_packages", "item_record",
    "result_record", "spec_fields", "verdict_fields",
]


def spec_fields(spec: RunSpec, case_path: str | None = None) -> dict[str, Any]:
    """What the JSON report says of an item before it runs (set at collection);
    ``case_path``, the case's shown path, when the caller has it already.

    ``packages`` (only when there are some) names the distributions the item depends on:
    its ``[matrix.packages]`` and those its ``call`` imports (a case's own ``.py`` file: the
    distributions its imports name). It crosses to the process
    that writes the report (the xdist controller collects nothing), which records their
    versions in the report's environment; it is no key of the item's record.
    """
    from pytest_gpucase.plan.environment import call_distributions

    fields: dict[str, Any] = {
        "case": spec.case.name,
        "case_path": display_posix(spec.case.path) if case_path is None else case_path,
        "device": spec.device,
        "dtype": spec.dtype,
        "variant": spec.variant.label if spec.variant is not None else None,
        "launch_blocking": spec.launch_blocking,
    }
    named = list(spec.case.matrix.packages)
    spelled = {canonical_name(name) for name in named}
    named += [name for name in call_distributions(spec.case.call, spec.case.path)
              if canonical_name(name) not in spelled]
    if named:
        fields["packages"] = named
    return fields


def item_packages(report: pytest.TestReport) -> tuple[str, ...]:
    """The distributions a case item depends on, from its report (``spec_fields``)."""
    for name, value in report.user_properties:
        if name == "gpucase":
            return tuple(property_value(value).get("packages", ()))
    return ()


def verdict_fields(verdict: Verdict) -> dict[str, Any]:
    """What the JSON report says of a run's verdict (plain data: it crosses xdist)."""
    outcome = verdict.outcome
    return {
        "error_type": outcome.error_type,
        "message": outcome.summary,
        "max_abs": outcome.max_abs,
        "max_rel": outcome.max_rel,
        "triage": verdict.triage.to_dict() if verdict.triage is not None else None,
        "localized": verdict.localized.outcome.summary if verdict.localized is not None else None,
        "budgets": list(outcome.budgets),
        # What failed: "overflow" or "underflow" where the run's dtype cannot hold a value
        # of the computation (verdict.ranges), else the outcome's kind; None on a pass.
        "class": (outcome.verdict_class or outcome.kind or None)
        if outcome.status == "failed" else None,
    }


def result_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The JSON record of an item once its outcome is known, from its pytest report."""
    props: dict[str, Any] = {name: property_value(value) for name, value in
                             report.user_properties if name in ("gpucase", "gpucase_result")}
    if "gpucase" not in props:
        return None
    if report.when == "setup" and report.passed:
        return None  # the call phase will say
    if report.when == "teardown" and not report.failed:
        return None
    xfail = hasattr(report, "wasxfail")
    if report.when != "call":
        outcome = "skipped" if report.skipped else "error"
    elif report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    elif report.passed:
        outcome = "xpassed" if xfail else "passed"
    else:
        strict_xpass = "XPASS(strict)" in str(report.longrepr)
        outcome = "xpassed" if strict_xpass else "failed"
    skip_reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        skip_reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    record = item_record(report.nodeid, props["gpucase"], outcome, duration=report.duration,
                         skip_reason=skip_reason)
    record.update(props.get("gpucase_result", {}))
    if xfail and outcome == "xfailed":
        record["message"] = record["message"] or str(report.wasxfail)
    return record


def crash_record(report: pytest.TestReport) -> dict[str, Any] | None:
    """The record of a case item lost with a crashed pytest-xdist worker, from its node id.

    pytest-xdist reports such an item as failed in a phase named "???", with no user
    properties: the controller never collected it, so what it was is read from the id
    (``cases/ce/case.toml::ce[cuda-float32-batch[1]]``), whatever its folder's name holds.
    """
    if report.when not in ("???", None) or not report.failed:
        return None
    fields = item_fields(report.nodeid)
    if fields is None:
        return None
    return item_record(report.nodeid, fields, "failed", str(report.longrepr),
                       error_type="WorkerCrash", duration=report.duration)


def item_fields(nodeid: str) -> dict[str, Any] | None:
    """What a case item is (``spec_fields``), read from its node id where the item is not at
    hand (``plan.runs.ItemId``); None for another item. An id without run parameters is
    recorded as a broken case's item is, for every device."""
    from pytest_gpucase.plan.runs import ItemId

    found = ItemId.parse(nodeid)
    if found is None:
        return None
    if found.device is None:
        return broken_fields(found.case, found.case_path)
    return {"case": found.case, "case_path": found.case_path, "device": found.device,
            "dtype": found.dtype, "variant": found.variant, "launch_blocking": False}


def broken_fields(name: str, case_path: str) -> dict[str, Any]:
    """What the JSON report says of a case that cannot be loaded (or of an item whose id holds
    no parameters): it fails on every device type it would run on, so device and dtype are
    ``"all"``, which ``report.file`` reads as such."""
    return {"case": name, "case_path": case_path, "device": "all", "dtype": "all",
            "variant": None, "launch_blocking": False}


def item_record(nodeid: str, fields: Mapping[str, Any], outcome: str,
                message: str | None = None, *, error_type: str | None = None,
                duration: float = 0.0, skip_reason: str | None = None) -> dict[str, Any]:
    """An item's JSON record: what it is (``spec_fields``) and its outcome, the verdict's
    fields empty. A run's verdict fills them in (``result_record``); an item that got none
    keeps them: lost with an xdist worker (``failed``), running when the run was cancelled
    (``interrupted``), or never started (``not run``)."""
    record = {"nodeid": nodeid, **fields}
    record.pop("packages", None)   # the environment's, recorded there (spec_fields)
    record.update({"outcome": outcome, "error_type": error_type, "message": message,
                   "max_abs": None, "max_rel": None, "duration": round(duration, 6),
                   "skip_reason": skip_reason, "triage": None, "localized": None})
    return record

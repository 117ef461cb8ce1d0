"""pytest-gpucase: replay saved GPU failure cases as isolated, numerically checked tests.

What users import is named here (and in the public modules ``capture``, ``payload``,
``checks``, ``checkpoint``, ``hookspecs``); every name is loaded on first use, so that
loading the pytest plugin (this package) never imports torch.

The implementation is layered, each layer importing only those before it:
``base`` < ``case`` < ``verdict`` < ``plan`` < ``run`` < ``report`` < ``tools`` < ``plugin``
(docs/architecture.md). A case flows case -> plan -> run -> verdict -> report.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pytest_gpucase.base.version import __version__

if TYPE_CHECKING:
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.plugin.fixtures import GpuCaseHandle
    from pytest_gpucase.report.file import load_report
    from pytest_gpucase.report.matrix import Cell, Column, DeviceCell, Matrix, Row, build_matrix
    from pytest_gpucase.run.outcome import Outcome
    from pytest_gpucase.run.parent import Verdict, run_spec
    from pytest_gpucase.run.runcontext import RunContext
    from pytest_gpucase.tools.checks import check_batch
    from pytest_gpucase.tools.record.recorder import Recorder, Step
    from pytest_gpucase.verdict.compare import Comparison, compare
    from pytest_gpucase.verdict.tolerance import Tolerance

# Public name -> the module that defines it.
_PUBLIC = {
    "Recorder": "pytest_gpucase.tools.record.recorder",
    "Step": "pytest_gpucase.tools.record.recorder",
    "Case": "pytest_gpucase.case.model",
    "load_case": "pytest_gpucase.case.load",
    "RunSpec": "pytest_gpucase.plan.runs",
    "RunContext": "pytest_gpucase.run.runcontext",
    "run_spec": "pytest_gpucase.run.parent",
    "Outcome": "pytest_gpucase.run.outcome",
    "Verdict": "pytest_gpucase.run.parent",
    "Comparison": "pytest_gpucase.verdict.compare",
    "compare": "pytest_gpucase.verdict.compare",
    "Tolerance": "pytest_gpucase.verdict.tolerance",
    "load_report": "pytest_gpucase.report.file",
    "build_matrix": "pytest_gpucase.report.matrix",
    "Matrix": "pytest_gpucase.report.matrix",
    "Row": "pytest_gpucase.report.matrix",
    "Cell": "pytest_gpucase.report.matrix",
    "Column": "pytest_gpucase.report.matrix",
    "DeviceCell": "pytest_gpucase.report.matrix",
    "GpuCaseHandle": "pytest_gpucase.plugin.fixtures",
    "check_batch": "pytest_gpucase.tools.checks",
}

__all__ = ["Case", "Cell", "Column", "Comparison", "DeviceCell", "GpuCaseHandle", "Matrix",
           "Outcome", "Recorder", "Row", "RunContext", "RunSpec", "Step", "Tolerance", "Verdict",
           "__version__", "build_matrix", "check_batch", "compare", "load_case", "load_report",
           "run_spec"]


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_gpucase' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

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
    from pytest_gpucase.case.model import Case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.plugin.fixtures import GpuCaseHandle
    from pytest_gpucase.report.matrix import Cell, Column, DeviceCell, Matrix, Row
    from pytest_gpucase.run.child import Outcome
    from pytest_gpucase.run.parent import Verdict
    from pytest_gpucase.tools.record import Recorder, Step
    from pytest_gpucase.verdict.compare import Comparison, Tolerance

# Public name -> the module that defines it.
_PUBLIC = {
    "Recorder": "pytest_gpucase.tools.record",
    "Step": "pytest_gpucase.tools.record",
    "Case": "pytest_gpucase.case.model",
    "RunSpec": "pytest_gpucase.plan.runs",
    "Outcome": "pytest_gpucase.run.child",
    "Verdict": "pytest_gpucase.run.parent",
    "Comparison": "pytest_gpucase.verdict.compare",
    "Tolerance": "pytest_gpucase.verdict.compare",
    "Matrix": "pytest_gpucase.report.matrix",
    "Row": "pytest_gpucase.report.matrix",
    "Cell": "pytest_gpucase.report.matrix",
    "Column": "pytest_gpucase.report.matrix",
    "DeviceCell": "pytest_gpucase.report.matrix",
    "GpuCaseHandle": "pytest_gpucase.plugin.fixtures",
}

__all__ = ["Case", "Cell", "Column", "Comparison", "DeviceCell", "GpuCaseHandle", "Matrix",
           "Outcome", "Recorder", "Row", "RunSpec", "Step", "Tolerance", "Verdict", "__version__"]


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_gpucase' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

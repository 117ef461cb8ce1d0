"""Hooks other plugins implement to extend gpucase (registered by ``pytest_addhooks``).

Implement them in a ``conftest.py`` or a plugin module, as any pytest hook:

* ``pytest_gpucase_report_formats()``: more renderers for the compatibility
  matrix, name -> callable taking a ``report.Matrix`` and returning text. They
  join ``report.RENDERERS``, the table ``gpucase matrix --format`` offers (the
  command loads installed pytest plugins and ``--plugin MODULE``; a pytest
  session adds its conftests' too). A name already taken is an error: a plugin
  adds formats, it never silently replaces one.
* ``pytest_gpucase_run_env(item, spec)``: variables for one run's child
  environment (a profiler switch, a per-item device pin, a cache directory);
  each implementation's dict is merged into ``spec.env`` in the order pluggy
  calls them (a variable two set: the later call's value), before the child
  starts.

docs/architecture.md shows where they sit in the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.report.matrix import Matrix

__all__ = ["pytest_gpucase_report_formats", "pytest_gpucase_run_env"]


@pytest.hookspec
def pytest_gpucase_report_formats() -> Mapping[str, Callable[[Matrix], str]] | None:
    """Return more matrix renderers by format name, or None.

    Each callable takes the ``report.Matrix`` of merged reports and returns the
    text written to stdout or ``-o FILE``.
    """


@pytest.hookspec
def pytest_gpucase_run_env(item: pytest.Item, spec: RunSpec) -> Mapping[str, str] | None:
    """Return variables to merge into the child environment of ``item``'s run, or None.

    Called in the process that runs the item (an xdist worker under xdist),
    just before the run; ``spec`` is the run as planned, with its own ``env``.
    """

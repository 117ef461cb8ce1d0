"""The hooks other plugins implement to extend gpucase (public; the specifications live in
``pytest_gpucase.plugin.hookspecs``, which the plugin registers)."""

from __future__ import annotations

from pytest_gpucase.plugin.hookspecs import pytest_gpucase_report_formats, pytest_gpucase_run_env

__all__ = ["pytest_gpucase_report_formats", "pytest_gpucase_run_env"]

"""pytest-gpucase: replay saved GPU failure cases as isolated, numerically checked tests."""

from __future__ import annotations

__version__ = "0.1.0"

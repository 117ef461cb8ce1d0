"""Checkpoints saved atomically with a manifest, and validated before a restart (public;
implemented in ``pytest_gpucase.tools.checkpoint``, whose ``__all__`` is this module's)."""

from __future__ import annotations

from pytest_gpucase.tools.checkpoint import *  # noqa: F403  (the names its __all__ lists)
from pytest_gpucase.tools.checkpoint import __all__ as __all__

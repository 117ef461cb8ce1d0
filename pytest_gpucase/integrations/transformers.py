"""``GpuCaseCallback`` for the Hugging Face ``Trainer`` (public):
``Trainer(..., callbacks=[GpuCaseCallback("cases")])``.

Importing this module imports ``transformers``; see
``pytest_gpucase.tools.integrations.transformers``.
"""

from __future__ import annotations

from pytest_gpucase.tools.integrations.transformers import GpuCaseCallback

__all__ = ["GpuCaseCallback"]

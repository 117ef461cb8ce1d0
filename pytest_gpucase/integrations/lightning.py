"""``GpuCaseCallback`` for Lightning (public): ``Trainer(callbacks=[GpuCaseCallback("cases")])``.

Importing this module imports Lightning; see ``pytest_gpucase.tools.integrations.lightning``.
"""

from __future__ import annotations

from pytest_gpucase.tools.integrations.lightning import GpuCaseCallback

__all__ = ["GpuCaseCallback"]

"""The Recorder inside training frameworks (public), one module per framework:

    from pytest_gpucase.integrations.lightning import GpuCaseCallback     # Lightning
    from pytest_gpucase.integrations.transformers import GpuCaseCallback  # Hugging Face

Each imports its framework when it is imported, never before: this package imports
nothing. Install the framework with the extra of the same name
(``pip install "pytest-gpucase[lightning]"``). Accelerate needs no integration of its own:
its prepared model is watched through its wrapper by either callback, or by ``rec.watch`` in
a plain loop. The implementation lives in ``pytest_gpucase.tools.integrations``.
"""

from __future__ import annotations

__all__: list[str] = []

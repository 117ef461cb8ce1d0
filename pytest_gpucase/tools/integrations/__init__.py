"""Ready integrations of the Recorder with training frameworks, one module each, each
importing its framework only when it is imported itself: ``lightning`` (a Lightning
``Callback``) and ``transformers`` (a Hugging Face ``TrainerCallback``). Users import them
from ``pytest_gpucase.integrations``; the frameworks come with the extras
``pytest-gpucase[lightning]`` and ``pytest-gpucase[transformers]``.
"""

from __future__ import annotations

__all__: list[str] = []

"""Import torch for the plugin without turning torch's own import-time warnings into errors.

torch's wheel does not depend on numpy; importing torch without it warns
"Failed to initialize NumPy". A user project with ``filterwarnings = error``
would see that warning raised from inside our hooks (an INTERNALERROR) although
neither the project nor the plugin needs numpy. The plugin therefore makes the
first import of torch itself, with that one warning silenced; every later
``import torch`` finds the module already loaded.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

__all__ = ["cuda_initialized", "import_torch"]

# torch's import-time warnings that say nothing about the user's code.
IMPORT_WARNINGS = (r"Failed to initialize NumPy",)


def import_torch() -> ModuleType:
    """``import torch``, silencing only the import-time warnings above on the first import."""
    module = sys.modules.get("torch")
    if module is not None:
        return module
    with warnings.catch_warnings():
        for message in IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        import torch
    return torch


def cuda_initialized() -> bool:
    """Whether this process made a CUDA (or ROCm) context: torch is loaded and says so.
    Never imports torch; a process that did not is not one that initialized CUDA."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())

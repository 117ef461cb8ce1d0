"""pytest-gpucase: replay saved GPU failure cases as isolated, numerically checked tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Recorder", "__version__"]

if TYPE_CHECKING:
    from .capture import Recorder


def __getattr__(name: str) -> object:
    # Lazily, so that loading the pytest plugin (this package) never imports torch.
    if name == "Recorder":
        from .capture import Recorder

        return Recorder
    raise AttributeError(f"module 'pytest_gpucase' has no attribute {name!r}")

"""The package's version: one home, read by the public facade and by the report writer."""

__all__ = ["__version__"]

__version__ = "0.1.0"

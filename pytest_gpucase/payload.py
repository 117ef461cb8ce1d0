"""Tensors on disk for cases: exact dtype, shape, stride, storage offset and values, in
safetensors, never pickle (public; implemented in ``pytest_gpucase.case.payload``)."""

from __future__ import annotations

from pytest_gpucase.case.payload import TensorInfo, content_hash, describe, load, save, to_device

__all__ = ["TensorInfo", "content_hash", "describe", "load", "save", "to_device"]

"""Checkpoints saved atomically with a manifest, and validated before a restart (public;
implemented in ``pytest_gpucase.tools.checkpoint``)."""

from __future__ import annotations

from pytest_gpucase.tools.checkpoint import (
    CHECKPOINT_SUFFIXES,
    FORMAT_VERSION,
    STATE_DICT_KEYS,
    Manifest,
    ManifestError,
    ModelSpecError,
    Survey,
    TensorRecord,
    Validation,
    manifest_path,
    newest_valid,
    save,
    scan,
    survey,
    validate,
)

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "FORMAT_VERSION",
    "STATE_DICT_KEYS",
    "Manifest",
    "ManifestError",
    "ModelSpecError",
    "Survey",
    "TensorRecord",
    "Validation",
    "manifest_path",
    "newest_valid",
    "save",
    "scan",
    "survey",
    "validate",
]

"""Golden outputs on disk (``expected.safetensors``) for non-regression.

Outputs are nested values (tensors, numbers, None, strings, tuples, lists,
dicts). The tensors go into the payload under their path (``out['logits']``);
the nesting and the plain values go into the payload's metadata as JSON, with
each tensor replaced by a reference to its path. Nothing goes through pickle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import payload
from .errors import CaseFormatError

STRUCTURE_KEY = "gpucase.structure"


def save(path: Path, results: Mapping[str, Any]) -> None:
    """Write a run's results (``{"out": outputs, "grad": gradients}``) to ``path`` atomically."""
    tensors: dict[str, Any] = {}
    structure = {key: _encode(value, key, tensors) for key, value in results.items()}
    payload.save(path, tensors, metadata={STRUCTURE_KEY: json.dumps(structure)})


def load(path: Path) -> dict[str, Any]:
    """Read the results written by ``save``."""
    _, metadata = payload.read_header(path)
    if STRUCTURE_KEY not in metadata:
        raise CaseFormatError(path, f"no '{STRUCTURE_KEY}' metadata; rewrite it with "
                              "pytest --gpu-cases --gpu-cases-regen")
    tensors = payload.load(path)
    try:
        structure = json.loads(metadata[STRUCTURE_KEY])
        return {key: _decode(node, tensors) for key, node in structure.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise CaseFormatError(path, f"malformed '{STRUCTURE_KEY}' metadata ({exc!r}); rewrite it "
                              "with pytest --gpu-cases --gpu-cases-regen") from None


def _encode(value: Any, where: str, tensors: dict[str, Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors[where] = value.detach()
        return {"tensor": where}
    if isinstance(value, Mapping):
        return {"dict": [[key, _encode(item, f"{where}[{key!r}]", tensors)]
                         for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(item, f"{where}[{i}]", tensors) for i, item in enumerate(value)]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # JSON has no nan/inf
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"{where}: cannot save a {type(value).__name__} as a golden output")


def _decode(node: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    ((kind, body),) = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {key: _decode(item, tensors) for key, item in body}
    if kind == "list":
        return [_decode(item, tensors) for item in body]
    if kind == "tuple":
        return tuple(_decode(item, tensors) for item in body)
    if kind == "float":
        return float(body)
    if kind == "complex":
        return complex(*body)
    if kind == "value":
        return body
    raise ValueError(f"unknown node kind {kind!r}")

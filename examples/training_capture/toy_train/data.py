"""The data pipeline: annotation labels read from a CSV file, synthetic features per sample."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

FEATURES = 8


@dataclass(frozen=True)
class Batch:
    """A batch as the loader yields it: sample ids, features, and the labels as annotated."""

    ids: list[str]
    features: torch.Tensor  # (batch, FEATURES), float32
    labels: torch.Tensor    # (batch,), int64, as written in the annotation file (1..4)


def read_annotations(path: Path) -> list[tuple[str, int]]:
    """The (sample id, label) rows of an annotation file with a header line."""
    with open(path, newline="", encoding="utf-8") as handle:
        return [(row["sample_id"], int(row["label"])) for row in csv.DictReader(handle)]


def features_for(index: int, label: int) -> torch.Tensor:
    """Deterministic features of one sample: a per-class centre plus a little noise."""
    noise = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
    centre = torch.zeros(FEATURES)
    centre[label % FEATURES] = 2.0
    return centre + 0.5 * noise


def batches(path: Path, batch_size: int) -> Iterator[Batch]:
    """Batches in file order, the last one possibly shorter."""
    rows = read_annotations(path)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        yield Batch(
            ids=[sample for sample, _ in chunk],
            features=torch.stack([features_for(start + i, label)
                                  for i, (_, label) in enumerate(chunk)]),
            labels=torch.tensor([label for _, label in chunk], dtype=torch.int64),
        )


def class_index(labels: torch.Tensor) -> torch.Tensor:
    """Map annotation labels (1..4 in the file) to the head's class indices (0..3)."""
    return labels  # the bug: used as annotated; the fix is `return labels - 1`

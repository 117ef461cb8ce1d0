"""The data: short strings over a small alphabet, stored as character codes, and the
vocabulary that maps those codes to embedding rows."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

ALPHABET = "abcdefgh"
LENGTH = 12
CLASSES = 3


def build_vocab(alphabet: str) -> torch.Tensor:
    """The embedding row of each character code (0..127); -1 for codes outside the alphabet."""
    rows = torch.full((128,), -1, dtype=torch.int64)
    for row, char in enumerate(alphabet, start=1):  # the bug: rows must count from 0
        rows[ord(char)] = row
    return rows


class Strings(Dataset[dict[str, object]]):
    """``size`` synthetic strings; only sample ``rare`` holds the alphabet's last character."""

    def __init__(self, size: int = 48, rare: int = 37, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        common = torch.tensor([ord(c) for c in ALPHABET[:-1]])
        self.codes = common[torch.randint(0, len(common), (size, LENGTH), generator=gen)]
        self.codes[rare, 5] = ord(ALPHABET[-1])
        # The class: how many 'a' the string holds, modulo 3.
        self.labels = (self.codes == ord("a")).sum(dim=1) % CLASSES

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, index: int) -> dict[str, object]:
        return {"ids": f"s{index:03d}", "codes": self.codes[index],
                "label": self.labels[index]}

"""The comparison kernel's own parts, against torch's answers.

What the kernel decides is tested through compare() in test_compare.py; here, the
searches it uses in place of torch's whole-row ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pytest_gpucase.verdict import _kernel


class TestBlockSearch:
    """The block-by-block searches of a chunk give torch's own answers."""

    @staticmethod
    def rows() -> Iterator[torch.Tensor]:
        gen = torch.Generator().manual_seed(16)
        block = _kernel._BLOCK
        for n in (5, 8 * block, 8 * block + 1, 20 * block, 20 * block + 37, 1 << 18):
            yield torch.rand(n, generator=gen)  # distinct values
            ties = torch.randint(0, 4, (n,), generator=gen).float()
            yield ties  # many ties
            sparse = torch.zeros(n)
            sparse[torch.randint(0, n, (3,), generator=gen)] = 1.0
            sparse[-1] = 1.0  # in the short last block
            yield sparse

    def test_top_values_and_the_first_greatest(self) -> None:
        for row in self.rows():
            for k in (1, 3, min(6, row.numel())):
                values, indices = _kernel._top(row, k)
                assert values == torch.topk(row, k).values.tolist()
                assert [row[i].item() for i in indices] == values
                assert len(set(indices)) == k
            assert _kernel._first_max(row) == int(row.argmax())

    def test_first_and_all_hits_in_order(self) -> None:
        for row in self.rows():
            flags = (row == row.amax()).float()
            hits = flags.nonzero().view(-1).tolist()
            for k in (1, 2, 5):
                assert _kernel._first_hits(flags, k) == hits[:k]
            positions = _kernel._nonzero_positions(flags, len(hits))
            assert positions.tolist() == hits

"""What judging the values of one tensor pair adds up to.

``TensorStats`` is what the chunked judging of tensor values hands back:
how many elements mismatch, the greatest absolute and relative differences,
the flat indices of the worst mismatches, and where mismatches are NaN or
infinite (``NonFinite``). The walk reads the totals; the messages read the
rest. Defined apart from the code that fills it in, so that the judging can
change (or run another way on a device) and nothing that reads it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_gpucase.verdict.tolerance import nan_max

__all__ = ["NonFinite", "TensorStats"]


@dataclass
class NonFinite:
    """Where the mismatches of a tensor are NaN or infinite, and whether expected is too."""

    nan_actual: int = 0  # actual NaN
    nan_both: int = 0  # ... and expected NaN there too
    inf_actual: int = 0  # actual +-inf
    inf_expected_too: int = 0  # ... and expected inf or NaN there too
    nan_expected_only: int = 0  # expected NaN where actual is a number

    def add(self, other: NonFinite) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class TensorStats:
    """What the chunks of one tensor pair add up to."""

    keep: int
    compared: bool = False
    max_abs: float = 0.0  # over all elements, for the run summary
    max_rel: float = 0.0
    mismatched: int = 0
    # (rank, flat index) of the worst mismatches seen, greatest first, at most
    # `keep`; rank is the difference, NaN above inf above every number.
    worst: list[tuple[float, int]] = field(default_factory=list)
    worst_rel: tuple[float, int] | None = None
    nonfinite: NonFinite = field(default_factory=NonFinite)

    def note(self, max_abs: float, max_rel: float) -> None:
        self.compared = True
        self.max_abs = nan_max(self.max_abs, max_abs)
        self.max_rel = nan_max(self.max_rel, max_rel)

    def admits(self, rank: float) -> bool:
        """Whether a mismatch of this rank, later in the tensor than all kept, would be kept."""
        return len(self.worst) < self.keep or rank > self.worst[-1][0]

    def add_worst(self, rank: float, index: int) -> None:
        self.worst.append((rank, index))
        self.worst.sort(key=lambda c: (-c[0], c[1]))
        del self.worst[self.keep :]

    def add_rel(self, rank: float, index: int) -> None:
        if self.worst_rel is None or (-rank, index) < (-self.worst_rel[0], self.worst_rel[1]):
            self.worst_rel = (rank, index)

    def merge(self, other: TensorStats) -> None:
        if other.compared:
            self.note(other.max_abs, other.max_rel)
        self.mismatched += other.mismatched
        for rank, index in other.worst:
            self.add_worst(rank, index)
        if other.worst_rel is not None:
            self.add_rel(*other.worst_rel)
        self.nonfinite.add(other.nonfinite)

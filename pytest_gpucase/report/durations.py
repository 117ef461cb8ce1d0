"""Item durations from JSON reports, in pytest-split's durations file format: shard a case set
across N runners by what its items took last time (``gpucase durations``).

pytest-split (``pytest --splits N --group I --durations-path FILE``) reads a JSON object of
node id -> seconds and gives each group about the same total; the reports already record
every item's duration, so no separate ``--store-durations`` run is needed. The shards'
reports then merge into one column of ``gpucase matrix`` (reports of one environment share
a column).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["durations"]

# Outcomes whose duration is no measure of the item: it never ran, or was cut short.
_NOT_MEASURED = frozenset({"not run", "interrupted"})


def durations(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Node id -> seconds, each item's from the newest report that ran it (a skip is kept:
    it is cheap, and pytest-split places it as such), sorted by node id."""
    found: dict[str, tuple[datetime, float]] = {}
    for report in reports:
        created = datetime.fromisoformat(report["created"])
        for result in report["results"]:
            if result["outcome"] in _NOT_MEASURED:
                continue
            seconds = float(result["duration"])
            known = found.get(result["nodeid"])
            if known is None or created >= known[0]:
                found[result["nodeid"]] = (created, round(seconds, 6))
    return {nodeid: found[nodeid][1] for nodeid in sorted(found)}

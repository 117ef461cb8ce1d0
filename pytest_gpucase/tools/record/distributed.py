"""The Recorder in a run of several processes: which rank failed, where its case goes, and
whether its failure is only the consequence of another rank's.

A collective that fails because a peer died (gloo's "Connection closed by peer", NCCL's
watchdog timeout, a process group aborted) says nothing about this rank's code: replayed
alone it cannot fail the same way, so it is recorded as a consequence, never as a case.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

__all__ = ["Rank", "consequence_of", "rank_folder", "rank_of", "without_addresses"]


@dataclass(frozen=True)
class Rank:
    """This process's place in a run of several: from torch.distributed, else the launcher."""

    rank: int
    local_rank: int
    world_size: int

    def shown(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def rank_of() -> Rank | None:
    """This process's rank, local rank and world size, or None in a run of one process.

    Read from an initialized default process group first, then from the variables that
    torchrun, Lightning and Accelerate set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``).
    """
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK")
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a process group being torn down: the launcher's word stands
        pass
    if rank is None or world is None or world <= 1:
        return None
    return Rank(rank, rank if local is None else local, world)


def rank_folder(rank: Rank | None) -> str | None:
    """The folder of this rank's cases under the Recorder's root (``rank1``), so that ranks
    failing together never share or race for one case name."""
    return None if rank is None else f"rank{rank.rank}"


# What a collective says when a peer, not this rank, failed: the peer's socket closed or
# reset, the watchdog timed out waiting for it, the group was aborted after its error.
_CONSEQUENCES = (
    (r"Connection closed by peer|Connection reset by peer|remote worker crash",
     "a peer closed its connection: another rank ended"),
    (r"Broken pipe|\bEPIPE\b", "a peer's connection broke: another rank ended"),
    (r"[Ww]atchdog caught collective operation timeout|collective operation timeout|"
     r"Timed out waiting .{0,200}(?:rank|peer|recv|send)|\bSocket Timeout\b",
     "a collective timed out waiting for another rank"),
    (r"(?:communicator|process ?group|ProcessGroup\w*)[^\n]{0,120}(?:was |been |is )?abort",
     "the process group was aborted after another rank's error"),
    (r"ncclRemoteError|remote process exited|NCCL error[^\n]{0,200}remote",
     "NCCL reports a remote rank's error"),
)
_DIST_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
# What names the collective layer in a message: its libraries, its process group, its work.
_COLLECTIVE = re.compile(r"gloo|nccl|NCCL|c10d|ProcessGroup|[Cc]ollective|TCPStore|"
                         r"\bWork\w*\(|\b[Rr]ank\b")


def consequence_of(type_name: str, message: str, rank: Rank | None) -> str | None:
    """Why a failure is the consequence of another rank's, or None when it is this rank's own.

    Only in a run of several processes: a single process has no peer to blame.
    """
    if rank is None:
        return None
    text = message[:20_000]
    # torch's collectives raise RuntimeError or a Dist* error; Python's own socket errors
    # (ConnectionResetError, BrokenPipeError: a streaming dataset's connection) are this
    # rank's, unless the message names the collective layer.
    if (type_name != "RuntimeError" and not type_name.startswith("Dist")
            and not _COLLECTIVE.search(text)):
        return None
    for pattern, why in _CONSEQUENCES:
        if re.search(pattern, text):
            return why
    if type_name in _DIST_TYPES and re.search(r"\b(?:peer|rank \d+|remote)\b", text):
        return "a collective failed on another rank's side"
    return None


_ADDRESS = re.compile(r"\[?(?:\d{1,3}\.){3}\d{1,3}\]?(?::\d{1,5})?"
                      r"|\[[0-9A-Fa-f:]{2,39}\](?::\d{1,5})?")


def without_addresses(text: str) -> str:
    """``text`` with IP addresses and ports replaced: they change at every launch and say
    nothing about the failure."""
    return _ADDRESS.sub("<address>", text)

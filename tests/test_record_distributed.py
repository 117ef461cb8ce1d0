"""The Recorder in runs of several processes (issue 22 item 2): each rank names itself and
writes into its own folder, the healthy rank records the peer's failure as a consequence
(never a case that would pass on replay), and a case needs no process group to replay."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext
from pytest_gpucase.tools.record.distributed import (
    Rank,
    consequence_of,
    rank_of,
    without_addresses,
)
from pytest_gpucase.tools.validate import validate
from tests import distributed_targets

ROOT = Path(__file__).parent.parent
PEER_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
               "by peer [127.0.0.1]:29390. This is typically caused by a remote worker crashing.")
TWO = Rank(0, 0, 2)


@pytest.mark.parametrize("message", [
    PEER_CLOSED,
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE)",
    "NCCL communicator was aborted on rank 1. Original reason for failure was: ...",
    "ProcessGroupNCCL is aborted: another rank failed",
    "Connection reset by peer",
])
def test_a_peer_failure_is_a_consequence(message: str) -> None:
    assert consequence_of("RuntimeError", message, TWO) is not None
    assert consequence_of("RuntimeError", message, None) is None  # one process: its own


@pytest.mark.parametrize("message", ["index out of range in self",
                                     "CUDA error: device-side assert triggered",
                                     "mat1 and mat2 shapes cannot be multiplied (2x5 and 4x3)"])
def test_a_rank_s_own_failure_is_not_a_consequence(message: str) -> None:
    assert consequence_of("RuntimeError", message, TWO) is None


@pytest.mark.parametrize(("type_name", "message"), [
    ("ConnectionResetError", "[Errno 104] Connection reset by peer"),
    ("BrokenPipeError", "[Errno 32] Broken pipe"),
    ("ConnectionError", "('Connection aborted.', ConnectionResetError(104, 'Connection reset "
                        "by peer'))"),
    ("TimeoutError", "Socket Timeout while reading shard 7"),
])
def test_a_rank_s_own_socket_error_is_not_a_consequence(type_name: str, message: str) -> None:
    """Issue 30: a streaming dataset's connection reset on one rank is that rank's failure,
    not another rank's end: Python's socket errors are no collective's."""
    assert consequence_of(type_name, message, TWO) is None
    assert consequence_of("DistBackendError", f"NCCL: {message}", TWO) is not None


def test_addresses_and_ports_are_not_kept() -> None:
    assert without_addresses(PEER_CLOSED).endswith(
        "Connection closed by peer <address>. This is typically caused by a remote worker "
        "crashing.")
    assert without_addresses("peer [::1]:4000 closed") == "peer <address> closed"


def test_the_rank_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_of() == Rank(3, 1, 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_of() is None


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def replays_alone(case_dir: Path) -> None:
    case = load_case(case_dir)
    verdict = run_spec(RunSpec(case, "cpu", "float32", cast=False),
                       RunContext("fork", "cpu", localize=False))
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    assert is_known_failure(case, verdict)


def toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def check_run(root: Path, *, healthy_may_be_ended: bool = False) -> None:
    """``healthy_may_be_ended``: under torchrun the agent ends every other rank as soon as
    one fails, and on a loaded machine it can end rank 0 before rank 0 sees its peer gone:
    then rank 0 writes nothing, which is right too (never a case)."""
    rank1 = root / "rank1"
    assert sorted(p.name for p in rank1.iterdir()) == [
        "tiny", "tiny.aten.embedding.default", "tiny.emb"]
    origin = toml(rank1 / "tiny" / "case.toml")["origin"]
    assert (origin["rank"], origin["local_rank"], origin["world_size"]) == (1, 1, 2)
    for case_dir in rank1.iterdir():
        replays_alone(case_dir)  # no process group in the replay's child
    # The healthy rank: a consequence, never a case (its replay would pass: XPASS(strict)).
    if healthy_may_be_ended and not (root / "rank0").exists():
        assert validate([root]) == []
        return
    assert [p.name for p in (root / "rank0").iterdir()] == ["consequence.toml"]
    record = toml(root / "rank0" / "consequence.toml")["consequence"]
    assert record["rank"] == 0 and record["iteration"] == 1
    assert "127.0.0.1" not in record["error"]
    assert validate([root]) == []


@pytest.mark.slow
def test_ddp_under_mp_spawn(tmp_path: Path) -> None:
    root = tmp_path / "cases"
    with pytest.raises(mp.ProcessRaisedException, match="index out of range"):
        mp.spawn(distributed_targets.train, args=(2, str(root), free_port()), nprocs=2)
    assert sorted(p.name for p in (root / "rank1").iterdir()) == [
        "tiny", "tiny.aten.embedding.default", "tiny.emb"]
    replays_alone(root / "rank1" / "tiny")
    # spawn terminates the healthy rank once the other raised, maybe before its collective
    # noticed the peer: it holds no case either way.
    if (root / "rank0").exists():
        assert {p.name for p in (root / "rank0").iterdir()
                if not p.name.startswith(".")} <= {"consequence.toml"}


@pytest.mark.slow
def test_ddp_under_torchrun(tmp_path: Path) -> None:
    root = tmp_path / "cases"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", free_port(), str(Path(distributed_targets.__file__)), str(root)],
        capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode != 0
    assert "gpucase: saved " in done.stderr and "(rank 1 of 2, first failure at iteration 1" \
        in done.stderr, done.stderr
    check_run(root, healthy_may_be_ended=True)

"""Process bodies for tests/test_record_distributed.py: importable, so that
torch.multiprocessing.spawn and torchrun can start them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def train(rank: int, world_size: int, root: str, port: str) -> None:
    """Two ranks train a watched DDP model; rank 1 meets a bad token at iteration 1."""
    from pytest_gpucase import Recorder
    from tests import model_targets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(model_targets.TinyLM())
    rec = Recorder(root)
    assert rec.watch(model, name="tiny") is model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(3):
        bad = rank == 1 and it == 1
        tokens = torch.tensor([[1, 9 if bad else 2]])
        with rec.step(it):
            model(tokens).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun: the launcher's environment names the rank
    sys.path.insert(0, str(Path(__file__).parent.parent))
    dist.init_process_group("gloo")
    from pytest_gpucase import Recorder
    from tests import model_targets

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(model_targets.TinyLM())
    rec = Recorder(sys.argv[1])
    rec.watch(model, name="tiny")
    for it in range(3):
        bad = dist.get_rank() == 1 and it == 1
        with rec.step(it):
            model(torch.tensor([[1, 9 if bad else 2]])).sum().backward()

"""Train the tiny character model; a gpucase Recorder saves the model's first failure as a case.

    python train.py                 # fails at iteration 4 and writes cases/tiny_lm (+ narrowed)
    pytest --gpu-cases cases -rxX   # replays them (see README.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_lm import data
from tiny_lm.model import TinyLM
from torch.utils.data import DataLoader

from pytest_gpucase import Recorder


def main(argv: Sequence[str] | None = None) -> None:
    """Run the training loop; the first failure propagates after the case is saved."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=Path("cases"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    loader = DataLoader(data.Strings(), batch_size=8)
    model = TinyLM().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(args.cases)
    rec.watch(model, name="tiny_lm")

    step = 0
    loss = torch.zeros(())
    for _ in range(args.epochs):
        for batch in loader:
            with rec.step(step, sample_ids=batch["ids"]):
                with torch.autocast(args.device, dtype=torch.bfloat16):
                    logits = model(batch["codes"].to(args.device))
                loss = F.cross_entropy(logits.float(), batch["label"].to(args.device))
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
            step += 1
    print(f"trained {step} iterations; last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()

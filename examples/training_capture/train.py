"""Train the toy classifier on labels.csv; a gpucase Recorder saves the first failure as a case.

    python train.py                 # fails at iteration 3 and writes cases/ce_class4
    pytest --gpu-cases cases -rxX   # replays it (see README.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from toy_train import data, model

from pytest_gpucase.capture import Recorder

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> None:
    """Run the training loop; the first failure propagates after the case is saved."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", type=Path, default=HERE / "labels.csv")
    parser.add_argument("--cases", type=Path, default=Path("cases"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    net = model.MLP().to(args.device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = Recorder(args.cases)
    # A module-level function of an importable package, so that a replay can import it.
    loss_fn = rec.watch(model.loss_fn, name="ce_class4")

    iteration = 0
    loss = torch.zeros(())
    for _ in range(args.epochs):
        for batch in data.batches(args.labels, args.batch_size):
            with rec.step(iteration, "forward", sample_ids=batch.ids):
                logits = net(batch.features.to(args.device))
            with rec.step(iteration, "loss"):
                loss = loss_fn(logits, batch.labels.to(args.device))
            with rec.step(iteration, "backward"):
                optimizer.zero_grad()
                torch.autograd.backward(loss)
            with rec.step(iteration, "optimizer.step"):
                optimizer.step()
            iteration += 1
    print(f"trained {iteration} iterations; last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()

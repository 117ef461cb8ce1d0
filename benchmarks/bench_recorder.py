"""What the Recorder costs: a watched training step against an unwatched one, one capture
with its narrowing (time and disk), and the memory of replaying a model case.

    python benchmarks/bench_recorder.py --quick      # about 3 minutes on 2 loaded cores
    python benchmarks/bench_recorder.py              # more steps and rounds

1. Per-step overhead: a small BERT (4 layers, hidden 256, 4 heads, vocabulary 30522,
   token classification) trained with AdamW on batches of 8 x 64 tokens, the same batches
   unwatched and watched (``rec.watch(model)`` and ``with rec.step(...)``; the same model,
   unwatched again between rounds), interleaved in rounds so that the machine's load falls
   on each; the median step of each, and their
   ratio. Also with ``nonfinite=True`` (a finiteness check of the outputs, the loss and the
   gradients: one sum over each, one device sync per check).
2. One capture: the same model meets a token id past its vocabulary; the time from the
   failing forward to the exception reaching the loop (the model case, then the narrowed
   submodule and op, each checked in a fresh child), and the bytes on disk against the
   model's state.
3. Replay memory: a 128 MiB float32 model's case is run as ``pytest --gpu-cases`` runs it
   (``run.child.run`` on the CPU, float64 reference included) in a fresh interpreter; its
   peak RSS above the same run of a tiny model's case (torch's own footprint and the
   machinery), against the model's bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bert(vocab: int = 30522) -> Any:
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=1024, num_labels=9,
                        max_position_embeddings=128)
    return BertForTokenClassification(config)


def batches(count: int, vocab: int = 30522) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (8, 64), generator=generator),
             "labels": torch.randint(0, 9, (8, 64), generator=generator)}
            for _ in range(count)]


def steps(model: Any, data: list[dict[str, torch.Tensor]], rec: Any = None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for it, batch in enumerate(data):
        start = time.perf_counter()
        if rec is None:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            with rec.step(it):
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step warms the allocator up


def overhead(rounds: int, count: int) -> None:
    """The same model, optimizer and batches in each mode; the mode's order turns round by
    round, so that a drift of the machine's load falls on all of them alike."""
    from pytest_gpucase import Recorder

    data = batches(count)
    model = bert()
    times: dict[str, list[float]] = {"unwatched": [], "watched": [],
                                     "watched, nonfinite=True": []}
    modes = list(times)
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for mode in modes[round_ % 3:] + modes[:round_ % 3]:
                rec = None
                if mode != "unwatched":
                    rec = Recorder(Path(scratch) / str(round_),
                                   nonfinite=mode.endswith("True"))
                    rec.watch(model)
                times[mode] += steps(model, data, rec)
                if rec is not None:
                    rec.unwatch(model)
    base = statistics.median(times["unwatched"])
    print(f"\n## per-step overhead ({rounds} rounds x {count - 1} steps, "
          f"load {os.getloadavg()[0]:.2f})")
    print("| what | median ms/step | x unwatched |\n|---|---:|---:|")
    for label, measured in times.items():
        print(f"| {label} | {statistics.median(measured) * 1e3:.1f} | "
              f"{statistics.median(measured) / base:.3f} |")


def capture() -> None:
    from pytest_gpucase import Recorder

    model = bert()
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "cases"
        rec = Recorder(root)
        rec.watch(model)
        batch = batches(1)[0]
        batch["input_ids"][0, 5] = 30522
        start = time.perf_counter()
        try:
            with rec.step(0):
                model(**batch)
        except IndexError:
            pass
        took = time.perf_counter() - start
        on_disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        cases = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    print(f"\n## one capture with narrowing (load {os.getloadavg()[0]:.2f})")
    print("| what | value |\n|---|---:|")
    print(f"| cases written | {', '.join(cases)} |")
    print(f"| time, failure to exception | {took:.1f} s |")
    print(f"| model state | {state / 2**20:.1f} MiB |")
    print(f"| on disk, all cases and the store | {on_disk / 2**20:.1f} MiB "
          f"({on_disk / state:.2f}x the state) |")


# The peak is VmHWM, this process image's own high-water mark: ru_maxrss would carry over
# the RSS of the (large) benchmark process that forked it before the exec.
_REPLAY = """
import sys
sys.path.insert(0, {root!r})
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.child import run
outcome = run(RunSpec(load_case(__import__("pathlib").Path({case!r})), "cpu", "float32",
                      cast=False))
peak = next(line.split()[1] for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print(outcome.status, outcome.kind, peak)
"""


def _peak(case: Path) -> int:
    done = subprocess.run([sys.executable, "-c", _REPLAY.format(root=str(ROOT), case=str(case))],
                          capture_output=True, text=True, check=True, timeout=600)
    status, _kind, kib = done.stdout.split()[-3:]
    assert status == "passed", done.stdout + done.stderr
    return int(kib) * 1024


def replay_memory(rounds: int) -> None:
    from pytest_gpucase import Recorder
    from pytest_gpucase.case import payload
    from tests import model_targets

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, vocab, dim in (("tiny", 8, 4), ("128 MiB", 32768, 512)):
            torch.manual_seed(0)
            model = model_targets.TinyLM(vocab=vocab, dim=dim)
            rec = Recorder(Path(scratch) / label, narrow=False)
            rec.watch(model)
            with contextlib.suppress(IndexError):
                model(torch.tensor([[1, vocab]]))
            assert rec.case_dir is not None
            # As after the fix: a token in range, so that the call and its float64
            # reference both run (a failing call stops before the reference).
            inputs = rec.case_dir / "inputs.safetensors"
            tensors = payload.load(inputs)
            tensors["tokens"] = torch.tensor([[1, 2]])
            payload.save(inputs, tensors, store=True)
            text = (rec.case_dir / "case.toml").read_text()
            (rec.case_dir / "case.toml").write_text("".join(
                line for line in text.splitlines(keepends=True) if not line.startswith("xfail")))
            state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            results[label] = (rec.case_dir, state)
        tiny = min(_peak(results["tiny"][0]) for _ in range(rounds))
        big = min(_peak(results["128 MiB"][0]) for _ in range(rounds))
    state = results["128 MiB"][1]
    print(f"\n## replay memory (best of {rounds}, load {os.getloadavg()[0]:.2f})")
    print("| what | peak RSS | above the tiny case | x model bytes |\n|---|---:|---:|---:|")
    print(f"| tiny model's case (torch and the machinery) | {tiny / 2**20:.0f} MiB | | |")
    print(f"| 128 MiB model's case | {big / 2**20:.0f} MiB | {(big - tiny) / 2**20:.0f} MiB "
          f"| {(big - tiny) / state:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("overhead", "capture", "replay"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"Python {sys.version.split()[0]}")
    if args.only in (None, "overhead"):
        overhead(rounds=3 if args.quick else 6, count=6 if args.quick else 11)
    if args.only in (None, "capture"):
        capture()
    if args.only in (None, "replay"):
        replay_memory(rounds=2 if args.quick else 3)
    shutil.rmtree(ROOT / "benchmarks" / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()

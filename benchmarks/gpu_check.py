"""The GPU machine's checks, one part at a time (``gpu_check.sh`` runs them all).

    python benchmarks/gpu_check.py cost --out DIR [--items 20]
    python benchmarks/gpu_check.py parity --out DIR
    python benchmarks/gpu_check.py compare --out DIR [--mib 256]

Each part writes ``DIR/<part>.json`` and ``DIR/<part>.txt``; without CUDA it
writes ``{"skipped": reason}`` and exits 0, so that the script runs end to end
on a CPU machine.

- cost: per item on CUDA for each ``--gpu-isolation`` mode, context creation
  included: (run of N - run of 1) / (N - 1) over whole pytest runs, as a ratio
  to ``item``.
- parity: the bundled cases on CUDA, ``--gpu-isolation item`` vs ``worker``:
  the same outcome for every item.
- compare: gpucase's comparison of two CUDA tensors (equal bytes, and within
  tolerance but not equal) vs a device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()  # without torch's "Failed to initialize NumPy" warning

ROOT = Path(__file__).resolve().parents[1]
CASE_PY = "def run(x):\n    return x + 1\n"


def cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__}"
    return None


def pytest_run(root: Path, *args: str) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           "-p", "no:cacheprovider", "--gpu-cases", *args], cwd=root,
                          capture_output=True, text=True, check=False)
    return time.perf_counter() - start, done.returncode, done.stdout[-2000:]


def write_cases(root: Path, count: int) -> None:
    from pytest_gpucase.case import payload

    for index in range(count):
        path = root / "cases" / f"c{index}"
        path.mkdir(parents=True)
        (path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n\n'
                                        '[matrix]\ndevices = ["cuda"]\n')
        (path / "case.py").write_text(CASE_PY)
        payload.save(path / "inputs.safetensors", {"x": torch.ones(1024)})


def cost(out: Path, items: int) -> dict[str, Any]:
    modes = ("item", "case", "worker")
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for count in (1, items):
        with tempfile.TemporaryDirectory() as tmp:
            write_cases(Path(tmp), count)
            for mode in modes:
                elapsed, code, tail = pytest_run(Path(tmp), "--gpu-isolation", mode, "cases")
                if code != 0:
                    raise RuntimeError(f"--gpu-isolation {mode} on {count} items failed:\n{tail}")
                seconds[mode].append(elapsed)
    per_item = {mode: (many - one) / (items - 1) for mode, (one, many) in seconds.items()}
    return {"items": items, "run_seconds": seconds,
            "ms_per_item": {mode: value * 1000 for mode, value in per_item.items()},
            "x_item": {mode: value / per_item["item"] for mode, value in per_item.items()}}


def outcomes(root: Path, mode: str) -> dict[str, str]:
    report = root / f"report-{mode}.json"
    pytest_run(root, "--gpu-devices", "cuda", "--gpu-isolation", mode,
               "--gpu-cases-report", str(report), "cases")
    return {r["nodeid"]: r["outcome"] for r in json.loads(report.read_text())["results"]}


def parity(out: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "cases", Path(tmp) / "cases")
        fresh = outcomes(Path(tmp), "item")
        reused = outcomes(Path(tmp), "worker")
    differ = {node: [fresh.get(node), reused.get(node)] for node in set(fresh) | set(reused)
              if fresh.get(node) != reused.get(node)}
    return {"items": len(fresh), "item": fresh, "differ": differ, "parity": not differ}


def best(action: Any, repeat: int = 5) -> float:
    action()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def compare_on_device(out: Path, mib: int) -> dict[str, Any]:
    from pytest_gpucase.verdict.compare import compare

    numel = mib * 2**20 // 4
    a = torch.randn(numel, device="cuda")
    same = a.clone()
    close = a * (1 + 1e-7)
    target = torch.empty_like(a)
    copy = best(lambda: target.copy_(a))
    equal = best(lambda: compare(a, same))
    within = best(lambda: compare(a, close))
    assert compare(a, close).ok
    return {"mib": mib, "copy_s": copy, "compare_equal_s": equal, "compare_close_s": within,
            "x_copy_equal": equal / copy, "x_copy_close": within / copy,
            "device": torch.cuda.get_device_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("cost", "parity", "compare"))
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    missing = cuda_missing()
    if missing is not None:
        result: dict[str, Any] = {"skipped": missing}
    elif args.part == "cost":
        result = cost(args.out, args.items)
    elif args.part == "parity":
        result = parity(args.out)
    else:
        result = compare_on_device(args.out, args.mib)
    result.update(load_average=os.getloadavg()[0], torch=torch.__version__)
    text = json.dumps(result, indent=2, sort_keys=True)
    (args.out / f"{args.part}.json").write_text(text + "\n")
    (args.out / f"{args.part}.txt").write_text(text + "\n")
    print(f"{args.part}: {text}")
    if result.get("parity") is False:
        sys.exit(1)


if __name__ == "__main__":
    main()

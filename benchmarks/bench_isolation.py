"""Per-item cost of running a case in a fresh child, against a bare ``os.fork`` in the same run.

    python benchmarks/bench_isolation.py [--runs 200]

Measured in one process that has imported torch (as the plugin's pytest
process has), so every child is a fork of the same image:

- bare fork: ``os.fork`` + ``os._exit(0)`` + ``waitpid``, nothing else
- bare fork floor: the child computes ``x + 1`` and sends it back through a pipe
  (``bench_scale.bare_floor``, the floor bench_scale.py times inside pytest; the floor the
  ratios are taken to)
- run_in_child: gpucase's child with its pipes, fd capture, process group and
  result pickling, calling ``os.getpid``
- run_spec: a whole trivial case (load the case's payload in the child, call,
  reference in float64, compare) as each pytest item runs it
- run_spec, forkserver: the same case forked by the zygote (what each run
  costs when CUDA was initialized in the pytest process)
- run_spec, spawn: the same case in a fresh interpreter that imports torch
  again (``--gpu-start-method=spawn``; fewer runs)

Printed as milliseconds per item (median of the runs) and as ratios to the bare
fork floor measured in the same run: these machines are noisy, ratios travel better.
Beside the wall clock, the CPU time of the child (user + system, from the kernel's
accounting of reaped children, its exit included): it counts the copy-on-write
page faults of the child and the work it does, and hardly moves with the load that
other processes put on the machine, which the wall clock does.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()  # first: without torch's "Failed to initialize NumPy" warning

from pytest_gpucase.case import payload  # noqa: E402
from pytest_gpucase.case.load import load_case  # noqa: E402
from pytest_gpucase.run.isolation import (  # noqa: E402
    ChildResult,
    reap_pending,
    run_in_child,
    shutdown,
)
from pytest_gpucase.plan.runs import RunSpec  # noqa: E402
from pytest_gpucase.run.parent import Verdict, run_spec  # noqa: E402
from pytest_gpucase.run.runcontext import RunContext  # noqa: E402

from bench_scale import bare_floor  # noqa: E402  (this folder: the script's own)


def bare_fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def checked(result: ChildResult) -> None:
    assert result.returned, result.problem


def passed(verdict: Verdict) -> None:
    assert verdict.outcome.status == "passed", verdict.outcome


def children_usage() -> tuple[float, int]:
    """CPU seconds (user + system) and page faults of the reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def timed(action: Callable[[], object],
          runs: int) -> tuple[list[float], list[float], list[int]]:
    """Wall seconds of each run, and the CPU seconds and page faults of its child (reaped
    after the clock stops)."""
    action()  # warm up: first-touch page faults, imports in the child
    reap_pending()
    samples, cpu, faults = [], [], []
    for _ in range(runs):
        cpu_before, faults_before = children_usage()
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
        reap_pending()  # outside the clock: a run's child exits after its result came back
        cpu_after, faults_after = children_usage()
        cpu.append(cpu_after - cpu_before)
        faults.append(faults_after - faults_before)
    return samples, cpu, faults


def trivial_case(root: Path) -> RunSpec:
    case_dir = root / "trivial"
    case_dir.mkdir()
    (case_dir / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
    (case_dir / "case.py").write_text("def run(x):\n    return x + 1\n")
    payload.save(case_dir / "inputs.safetensors", {"x": torch.ones(4)})
    return RunSpec(load_case(case_dir), "cpu", "float32", cast=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="30 runs each (under a minute)")
    args = parser.parse_args()
    runs = min(args.runs, 30) if args.quick else args.runs
    with tempfile.TemporaryDirectory() as tmp:
        spec = trivial_case(Path(tmp))
        rows = [
            ("bare os.fork", timed(bare_fork, runs)),
            ("bare fork floor (x + 1)", timed(bare_floor, runs)),
            ("run_in_child (fork)", timed(lambda: checked(run_in_child(os.getpid, timeout=60)),
                                          runs)),
            ("run_spec, trivial case", timed(
                lambda: passed(run_spec(spec, RunContext("fork", "cpu"))), runs)),
            ("run_spec, forkserver", timed(
                lambda: passed(run_spec(spec, RunContext("forkserver", "cpu"))), runs)),
            ("run_spec, spawn", timed(
                lambda: passed(run_spec(spec, RunContext("spawn", "cpu"))),
                max(5, runs // 20))),
        ]
    shutdown()
    floor, floor_cpu, _ = (statistics.median(values) for values in rows[1][1])
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{runs} runs each (spawn: fewer), median per item; the forkserver's children are "
          "the zygote's: their CPU is not counted here")
    print(f"{'what':<26}{'ms/item':>10}{'x floor':>10}{'child CPU ms':>14}{'x floor':>10}"
          f"{'page faults':>13}")
    for name, (samples, cpu, faults) in rows:
        median, median_cpu = statistics.median(samples), statistics.median(cpu)
        counted = median_cpu > 0
        print(f"{name:<26}{median * 1000:>10.2f}{median / floor:>10.2f}"
              f"{median_cpu * 1000 if counted else math.nan:>14.2f}"
              f"{median_cpu / floor_cpu if counted else math.nan:>10.2f}"
              f"{statistics.median(faults) if counted else math.nan:>13.0f}")


if __name__ == "__main__":
    main()

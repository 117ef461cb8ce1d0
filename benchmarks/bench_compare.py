"""Time compare() against torch.testing.assert_close and one read pass.

Run: python benchmarks/bench_compare.py [--mib 256] [--repeats 5] [--warmup 3] [--threads N]

On float32 CPU tensors of the given size, three input pairs (equal, close
within tolerance, differing in a few elements) are each timed with compare(),
torch.testing.assert_close, and a.sum() (one read pass of one tensor; a
comparison reads two, so 2x is its floor). Medians of the repeats are
printed, with the ratios the project aims at: assert_close / compare >= 10
and compare / read pass <= 4. The verdicts of compare() and assert_close must
agree; the script exits with status 1 when they do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from pytest_gpucase.compare import CHUNK_ELEMENTS, compare

SPEEDUP_TARGET = 10.0  # assert_close / compare
READ_PASS_TARGET = 4.0  # compare / read pass


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    # Warm-up runs matter on virtual machines: memory that another large
    # allocation disturbed can read several times slower on its next passes.
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _assert_close_passes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError:
        return False
    return True


def _pairs(n: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randn(n, generator=gen)
    # Within float32's default tolerance (atol 1e-5, rtol 1.3e-6) by a margin,
    # but different almost everywhere: the shape of a GPU-vs-CPU float32 run.
    close = torch.empty(n).uniform_(-1e-6, 1e-6, generator=gen).add_(1).mul_(expected)
    close.add_(torch.empty(n).uniform_(-5e-6, 5e-6, generator=gen))
    differing = expected.clone()
    for index in (n // 7, n // 2, n - 3):
        differing[index] += 1.0
    return {
        "equal": (expected.clone(), expected),
        "close": (close, expected),
        "differing": (differing, expected),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; return 1 when verdicts disagree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of each tensor in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads (default: the CPUs this process may use)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    n = args.mib * (1 << 20) // 4
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"float32 tensors of {args.mib} MiB ({n:,} elements), "
        f"chunk {CHUNK_ELEMENTS:,} elements, median of {args.repeats}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    pairs = _pairs(n, args.seed)

    header = (
        f"{'pair':<10} {'verdict':<8} {'compare s':>10} {'assert_close s':>15} "
        f"{'read pass s':>12} {'assert_close/compare':>21} {'compare/read':>13}"
    )
    print(header)
    print("-" * len(header))
    agree = True
    misses = []
    for name, (actual, expected) in pairs.items():
        verdict = compare(actual, expected).ok
        reference = _assert_close_passes(actual, expected)
        agree &= verdict == reference
        # assert_close goes last: its full-size temporaries disturb the memory
        # the other two read.
        compare_s = _median_seconds(partial(compare, actual, expected), args.repeats, args.warmup)
        read_s = _median_seconds(actual.sum, args.repeats, args.warmup)
        close_s = _median_seconds(partial(_assert_close_passes, actual, expected), args.repeats, 0)
        speedup, cost = close_s / compare_s, compare_s / read_s
        if speedup < SPEEDUP_TARGET:
            misses.append(f"{name}: assert_close/compare {speedup:.1f}x < {SPEEDUP_TARGET:g}x")
        if cost > READ_PASS_TARGET:
            misses.append(f"{name}: compare/read pass {cost:.1f}x > {READ_PASS_TARGET:g}x")
        shown = ("pass" if verdict else "fail") + ("" if verdict == reference else "!")
        print(
            f"{name:<10} {shown:<8} {compare_s:>10.4f} {close_s:>15.4f} {read_s:>12.4f} "
            f"{speedup:>20.1f}x {cost:>12.1f}x"
        )
    print(
        f"targets: assert_close/compare >= {SPEEDUP_TARGET:g}x, "
        f"compare/read pass <= {READ_PASS_TARGET:g}x"
    )
    for miss in misses:
        print(f"missed: {miss}")
    if not agree:
        print("verdicts disagree with torch.testing.assert_close (marked !)")
        return 1
    print("verdicts agree with torch.testing.assert_close")
    return 0


if __name__ == "__main__":
    sys.exit(main())

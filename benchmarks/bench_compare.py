"""Time compare() against torch.testing.assert_close and a read pass, over a grid.

Run: python benchmarks/bench_compare.py [--quick] [--max-bytes 256M] [--min-bytes 0]
     [--rows float32,bfloat16,f16ref64] [--busy] [--repeats 5] [--threads N] [--seed 0]

The grid: tensor sizes from 4 KiB up to --max-bytes (per tensor, actual
side), dtypes (float32, bfloat16, float16, int64, bool), patterns (equal;
close: within tolerance but different almost everywhere; 1%: one element in a
hundred far off; all: every element far off; nan: a few NaN in actual, some of them
NaN in expected too) and the plugin's own path, a low-precision output
against a float64 reference ("ref64"). Every cell times compare(),
torch.testing.assert_close and a read pass (one sum over each operand: the
bytes any comparison must read) in the same run, and prints the medians with
the ratios the project aims at: compare never slower than assert_close, and
within 2x a read pass on tensors of 16 MiB or more. A small-tensor section
times one 100-element pair per call and 1,000 of them in a nested output
(equal, close, one element off; the target: 10 us a tensor). --busy starts
one competing busy process for the whole run. Verdicts must agree with
assert_close, except on the pairs verdict/tolerance.py documents (same-dtype
bfloat16/float16 within rounding of the bound); the script exits with status
1 on any other disagreement.

--quick runs a small subset (under a minute on a 2-core machine).
--min-bytes and --rows select cells: `--min-bytes 256M --max-bytes 256M
--rows float32,bfloat16` measures the one 256 MiB row of those dtypes
(bf16ref64 and f16ref64 name the float64-reference rows).

Equal pairs of one dtype are settled by reading both operands once (a
memcmp) and, for floats, the actual once more (a finite sum proves no NaN):
about the read pass itself, which sums each operand once. assert_close's
`==` then `.all()` is also one read of each operand, writing a bool per
element, so on integers (no tolerance arithmetic to skip) the speed-up is
bounded by the ratio of that op to a read, not by anything compare() can
drop; the script prints that bound for the int64 equal cells.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()  # first: without torch's "Failed to initialize NumPy" warning

from pytest_gpucase.verdict._kernel import CHUNK_ELEMENTS  # noqa: E402
from pytest_gpucase.verdict.compare import DEFAULT_TOLERANCES, compare  # noqa: E402

SPEEDUP_TARGET = 1.0  # assert_close / compare, at least
READ_PASS_TARGET = 2.0  # compare / read pass, at most, from READ_PASS_FROM bytes
READ_PASS_FROM = 16 << 20
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}
PATTERNS = ("equal", "close", "1%", "all", "nan")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
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
        torch.testing.assert_close(actual, expected, check_dtype=False)
    except AssertionError:
        return False
    return True


def _read_pass(actual: torch.Tensor, expected: torch.Tensor) -> None:
    actual.sum()
    expected.sum()


def _pair(
    pattern: str, dtype: torch.dtype, ref64: bool, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (actual, expected) pair of n elements, or None where the pattern does not apply."""
    if dtype == torch.bool:
        if pattern in ("close", "nan"):
            return None
        expected = torch.rand(n, generator=gen) < 0.5
        actual = expected.clone()
    elif dtype == torch.int64:
        if pattern in ("close", "nan"):
            return None
        expected = torch.randint(-1000, 1000, (n,), generator=gen)
        actual = expected.clone()
    else:
        reference = torch.randn(n, generator=gen, dtype=torch.float64)
        expected = reference if ref64 else reference.to(dtype)
        actual = reference.to(dtype)  # one rounding off the float64 reference: close
        if pattern == "close" and not ref64:
            # Within tolerance by a margin, different almost everywhere.
            tol = DEFAULT_TOLERANCES[dtype]
            noise = torch.rand(n, generator=gen, dtype=torch.float64).sub_(0.5)
            bound = tol.atol + tol.rtol * reference.abs()
            actual = (reference + noise * bound).to(dtype)
        elif pattern == "equal" and ref64:
            actual = reference.to(dtype)
            expected = actual.double()
    if pattern == "1%":  # one element in a hundred far off, spread over the tensor
        index = torch.arange(0, n, 100)
        actual[index] = ~actual[index] if dtype == torch.bool else actual[index] + 100
    elif pattern == "all":
        actual = ~expected if dtype == torch.bool else (expected + 100).to(actual.dtype)
    elif pattern == "nan":
        for k, index in enumerate((n // 5, n // 3, n // 2, n - 1)):
            actual[index] = float("nan")
            if k % 2:
                expected[index] = float("nan")
    return actual, expected


def _busy() -> None:
    while True:
        pass


def _fmt_bytes(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _documented(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a disagreement is the documented one: same low-precision dtype, bound rounding."""
    return actual.dtype == expected.dtype and actual.dtype in (torch.bfloat16, torch.float16)


def _row_name(name: str, ref64: bool) -> str:
    """float32, bfloat16, ... and bf16ref64 / f16ref64 for the float64-reference rows."""
    if not ref64:
        return name
    return {"bfloat16": "bf16ref64", "float16": "f16ref64"}.get(name, f"{name}ref64")


def _equal_bound(actual: torch.Tensor, expected: torch.Tensor, repeats: int) -> float:
    """assert_close's own comparison (`==`, `.all()`) over the read pass: the int64-equal bound."""
    eq = _median_seconds(lambda: bool((actual == expected).all()), repeats)
    return eq / _median_seconds(partial(_read_pass, actual, expected), repeats)


def _grid(args: argparse.Namespace) -> tuple[list[str], bool]:
    sizes = [s for s in SIZES if args.min_bytes <= s <= args.max_bytes]
    rows = [(name, False) for name in DTYPES]
    rows += [(name, True) for name in ("bfloat16", "float16")]
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [(name, ref64) for name in DTYPES for ref64 in (False, True)]
        rows = [(n, r) for n, r in rows if (_row_name(n, r) in wanted)]
    header = (
        f"{'size':>8} {'dtype':<14} {'pattern':<7} {'verdict':<8} {'compare s':>10} "
        f"{'assert_close s':>14} {'read s':>9} {'ac/compare':>11} {'compare/read':>13}"
    )
    print(header)
    print("-" * len(header))
    misses: list[str] = []
    agree = True
    gen = torch.Generator().manual_seed(args.seed)
    for size in sizes:
        for name, ref64 in rows:
            dtype = DTYPES[name]
            n = max(1, size // torch.empty((), dtype=dtype).element_size())
            for pattern in PATTERNS:
                pair = _pair(pattern, dtype, ref64, n, gen)
                if pair is None:
                    continue
                actual, expected = pair
                verdict = compare(actual, expected, check_dtype=False).ok
                reference = _assert_close_passes(actual, expected)
                if verdict != reference and not _documented(actual, expected):
                    agree = False
                repeats = args.repeats if size < (64 << 20) else max(3, args.repeats // 2)
                ours = _median_seconds(
                    partial(compare, actual, expected, check_dtype=False), repeats
                )
                read = _median_seconds(partial(_read_pass, actual, expected), repeats)
                # assert_close last: its full-size temporaries disturb the memory
                # the other two read. Slow: fewer repeats on large tensors.
                theirs = _median_seconds(
                    partial(_assert_close_passes, actual, expected),
                    repeats if size < (16 << 20) else 1,
                    0 if size >= (16 << 20) else 1,
                )
                speedup, cost = theirs / ours, ours / read
                label = f"{name}{' vs f64' if ref64 else ''}"
                cell = f"{_fmt_bytes(size)} {label} {pattern}"
                if speedup < SPEEDUP_TARGET:
                    note = ""
                    if pattern == "equal" and not dtype.is_floating_point:
                        # One read of each operand either way: compare/read is the target.
                        bound = _equal_bound(actual, expected, repeats)
                        note = (
                            f" (assert_close's ==/.all() is {bound:.1f}x a read pass, compare "
                            f"{cost:.1f}x: both one read of the same bytes, so the read-pass "
                            "ratio is the honest target)"
                        )
                    misses.append(f"{cell}: assert_close/compare {speedup:.1f}x{note}")
                if cost > READ_PASS_TARGET and size >= READ_PASS_FROM:
                    misses.append(f"{cell}: compare/read pass {cost:.1f}x")
                shown = ("pass" if verdict else "fail") + ("" if verdict == reference else "!")
                print(
                    f"{_fmt_bytes(size):>8} {label:<14} {pattern:<7} {shown:<8} {ours:>10.5f} "
                    f"{theirs:>14.5f} {read:>9.5f} {speedup:>10.1f}x {cost:>12.1f}x",
                    flush=True,
                )
                del actual, expected, pair
    return misses, agree


def _small(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    expected = torch.randn(100, generator=gen)
    equal = expected.clone()
    close = expected + 1e-6
    repeats = 2001 if not args.quick else 501
    print()
    print("small tensors (100 float32 elements), median per call:")
    for name, actual in (("equal", equal), ("close", close)):
        ours = _median_seconds(partial(compare, actual, expected), repeats, 50)
        theirs = _median_seconds(partial(_assert_close_passes, actual, expected), repeats, 50)
        base = _median_seconds(partial(torch.equal, actual, expected), repeats, 50)
        print(
            f"  {name:<6} compare {ours * 1e6:7.1f} us   assert_close {theirs * 1e6:7.1f} us   "
            f"torch.equal {base * 1e6:5.1f} us   ac/compare {theirs / ours:5.1f}x"
        )
    count = 1_000
    print(f"{count:,} such tensors in a nested output (a dict of 100 lists of 10), per tensor:")
    expected_nested = {f"k{i}": [torch.randn(100, generator=gen) for _ in range(10)]
                       for i in range(count // 10)}
    off = {k: [v.clone() for v in values] for k, values in expected_nested.items()}
    off["k50"][5][7] += 1.0
    cases = (("equal", {k: [v.clone() for v in values] for k, values in expected_nested.items()}),
             ("close", {k: [v + 1e-6 for v in values] for k, values in expected_nested.items()}),
             ("one off", off))
    for name, actual_nested in cases:
        ours = _median_seconds(partial(compare, actual_nested, expected_nested), 5)
        theirs = _median_seconds(
            partial(_assert_close_passes, actual_nested, expected_nested), 5)
        verdict = compare(actual_nested, expected_nested).ok
        agree = verdict == _assert_close_passes(actual_nested, expected_nested)
        print(
            f"  {name:<8}{'pass' if verdict else 'fail'}{'' if agree else '!'}  compare "
            f"{ours / count * 1e6:7.1f} us   assert_close {theirs / count * 1e6:7.1f} us   "
            f"ac/compare {theirs / ours:5.1f}x"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables; return 1 when verdicts disagree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small subset, under a minute")
    parser.add_argument(
        "--max-bytes", type=_parse_bytes, default=None, help="largest tensor (e.g. 256M)"
    )
    parser.add_argument(
        "--min-bytes", type=_parse_bytes, default=0, help="smallest tensor (e.g. 256M)"
    )
    parser.add_argument(
        "--rows", default="", help="comma-separated rows: float32,bfloat16,...,bf16ref64,f16ref64"
    )
    parser.add_argument("--busy", action="store_true", help="run one competing busy process")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads (default: the CPUs this process may use)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_bytes is None:
        args.max_bytes = (16 << 20) if args.quick else (256 << 20)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    torch.set_num_threads(args.threads)
    busy = None
    # A terminated run still ends its busy process (in the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if args.busy:
        busy = multiprocessing.get_context("spawn").Process(target=_busy, daemon=True)
        busy.start()
    try:
        print(
            f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
            f"chunk {CHUNK_ELEMENTS:,} elements, median of {args.repeats}, "
            f"busy process: {'yes' if busy else 'no'}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        misses, agree = _grid(args)
        if not args.rows and not args.min_bytes:
            _small(args)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        if busy is not None:
            busy.terminate()
            busy.join()
    print(
        f"targets: assert_close/compare >= {SPEEDUP_TARGET:g}x, "
        f"compare/read pass <= {READ_PASS_TARGET:g}x (tensors >= {_fmt_bytes(READ_PASS_FROM)})"
    )
    for miss in misses:
        print(f"missed: {miss}")
    if not agree:
        print("verdicts disagree with torch.testing.assert_close (marked !) beyond the documented")
        return 1
    print("verdicts agree with torch.testing.assert_close, or differ as documented (marked !)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

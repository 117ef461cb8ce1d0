"""Scale: isolation per item inside pytest, collection of many cases, parent memory, payload I/O.

    python benchmarks/bench_scale.py --quick          # under a minute on 2 idle cores
    python benchmarks/bench_scale.py [--items 200] [--cases 5000] [--gib 1]
    python benchmarks/bench_scale.py --quick --only isolation --baseline-src ../old/checkout

Needs only the project's test extra. Every figure is printed next to a
baseline measured in the same run, as a ratio (these machines are noisy;
ratios travel better than seconds); the load average is printed with them:

1. isolation per trivial item inside pytest: ``pytest --gpu-cases`` on N
   trivial cases (x + 1, float64 reference, compare) and ``--gpu-isolation
   worker`` against two floors: the bare fork floor (N parametrized tests in a
   file that imports torch, each forking a child that computes x + 1 and returns
   it through a pipe, then ``waitpid``) and beside it the same floor whose child
   also computes the float64 reference and compares (so that both are visible:
   the second one holds some of our own work). With ``--baseline-src`` the same
   cases run by an older checkout of the package too. Per item = the time from
   the first item's start to the last item's end over N, timed by a conftest
   inside the same pytest process, so start-up and collection are left out;
   ``--repeat`` interleaved rounds (the order turning each round), each ratio
   taken within a round, the medians printed with the load average.
2. collection of ``--cases`` case directories (4 items each) vs one test file
   that imports torch with one test parametrized 4 x ``--cases`` ways (as many
   items) and ``--cases`` ways (one test per case, the issue's baseline); pytest's
   own floor for that layout (a 25-line plugin making the same directory, file
   and item nodes and reading nothing); and the growth from half as many cases.
3. the pytest process's peak RSS as the number of cases grows: payloads are
   loaded in the children only, so it must stay flat.
4. loading a ``--gib`` GiB payload with ``payload.load`` vs safetensors' own
   ``load_file``, each with one pass over its values (warm page cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()  # first: without torch's "Failed to initialize NumPy" warning

from pytest_gpucase.case import payload  # noqa: E402

TRIVIAL_CASE_PY = "def run(x):\n    return x + 1\n"
# pytest's own floor for one directory per case: the same nodes (a Directory per case
# folder, a File for its case.toml, 4 items), torch imported, and nothing else done.
NODES_ONLY_PLUGIN = textwrap.dedent("""
    import os

    import pytest
    import torch  # noqa: F401 - as the plugin's session imports it


    class NullItem(pytest.Item):
        def runtest(self):
            pass


    class NullFile(pytest.File):
        def collect(self):
            for index in range(4):
                yield NullItem.from_parent(self, name=f"{self.path.parent.name}[{index}]")


    class NullDir(pytest.Directory):
        def collect(self):
            yield NullFile.from_parent(self, path=self.path / "case.toml")


    def pytest_collect_directory(path, parent):
        if os.path.lexists(os.path.join(path, "case.toml")):
            return NullDir.from_parent(parent, path=path)
        return None
""")
RSS_CONFTEST = textwrap.dedent("""
    import resource

    def pytest_sessionfinish(session):
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open("peak_rss_kib", "w") as handle:
            handle.write(str(peak_kib))
""")


def pytest_seconds(root: Path, *args: str, env: dict[str, str] | None = None,
                   timeout: float | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:benchmark", "-p", "no:randomly", *args], cwd=root,
                          capture_output=True, text=True, check=False, env=env,
                          timeout=timeout)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 5):
        raise RuntimeError(f"pytest {' '.join(args)} failed:\n{done.stdout[-3000:]}")
    return elapsed


def write_cases(root: Path, count: int, matrix: str = "", tensor_numel: int = 4) -> None:
    x = torch.ones(tensor_numel)
    first = root / "cases" / "c0"
    first.mkdir(parents=True)
    (first / "case.toml").write_text(f'format = 1\ncall = "case.py:run"\n{matrix}')
    (first / "case.py").write_text(TRIVIAL_CASE_PY)
    payload.save(first / "inputs.safetensors", {"x": x})
    data = {name: (first / name).read_bytes()
            for name in ("case.toml", "case.py", "inputs.safetensors")}
    for index in range(1, count):
        path = root / "cases" / f"c{index}"
        path.mkdir()
        for name, content in data.items():
            (path / name).write_bytes(content)


BENCHMARKS = str(Path(__file__).resolve().parent)


def write_tests(root: Path, tests: Iterable[tuple[str, str]], count: int,
                name: str = "test_it.py") -> None:
    """Each of ``tests`` (folder, module text) as ``name`` in its own folder of ``root``, the
    text formatted with the item ``count`` and this folder (``benchmarks``)."""
    for folder, text in tests:
        (root / folder).mkdir()
        (root / folder / name).write_text(text.format(count=count, benchmarks=BENCHMARKS))


def absolute_pythonpath() -> None:
    """Make ``PYTHONPATH``'s entries absolute: the pytest sessions start in a temporary
    folder, where a relative entry (``.``) would name another package, or none, instead of
    this checkout's."""
    if os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(entry) if entry else entry
            for entry in os.environ["PYTHONPATH"].split(os.pathsep))


X = torch.ones(4)


def bare_floor() -> bytes:
    """The bare fork floor: a fresh forked child computing x + 1 and returning it through a
    pipe; the parent reads it and waits for the child. Nothing else. Timed in-process by
    bench_isolation.py, and inside pytest (``BARE_FLOOR_TEST``) here and in
    bench_item_phases.py: one floor for all three."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, struct.pack("4f", *(X + 1).tolist()))  # no numpy in a torch wheel
        os._exit(0)
    os.close(write)
    data = os.read(read, 64)
    os.close(read)
    os.waitpid(pid, 0)
    return data


# A plain test in a torch-importing session, one per item: ``bare_floor`` and nothing else.
BARE_FLOOR_TEST = textwrap.dedent("""
    import sys

    import pytest

    sys.path.insert(0, {benchmarks!r})
    from bench_scale import bare_floor


    @pytest.mark.parametrize("i", range({count}))
    def test_bare_floor(i):
        assert len(bare_floor()) == 16
""")
REF_FLOOR_TEST = textwrap.dedent("""
    import os

    import pytest
    import torch

    X = torch.ones(4)


    @pytest.mark.parametrize("i", range({count}))
    def test_ref_floor(i):
        # The bare floor plus the case's own work done plainly: x + 1, its float64
        # reference, a comparison, the verdict sent back through a pipe.
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            ok = torch.allclose((X + 1).double(), X.double() + 1)
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        verdict = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert verdict == b"1"
""")


def per_item(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Seconds per item of one pytest run: from the first item's start to the last one's
    end, over the items (start-up and collection left out, inside the same process); and the
    CPU seconds per item of the pytest process and its children over the same span."""
    pytest_seconds(root, *args, env=env)
    # bench_isolation's timer: wall, items, then (CPU s, faults) of the process, its children
    elapsed, items, cpu_self, _, cpu_children, _, *_steady = map(
        float, (root / "item_usage").read_text().split())
    return elapsed / items, (cpu_self + cpu_children) / items


BARE = "bare fork floor"
REF = "floor + reference + compare"


def isolation(items: int, baseline_src: str | None, repeat: int) -> None:
    print(f"\n1. isolation per trivial item inside pytest ({items} items, CPU, "
          f"{repeat} interleaved rounds, medians)")
    baseline_env = {**os.environ, "PYTHONPATH": baseline_src} if baseline_src else None
    worker = ("--gpu-cases", "--gpu-isolation", "worker", "cases")
    runs = [(BARE, ("bare",), None),
            (REF, ("floor",), None),
            ("pytest --gpu-cases", ("--gpu-cases", "cases"), None),
            ("--gpu-isolation worker", worker, None)]
    if baseline_env is not None:
        runs += [("--gpu-cases, baseline src", ("--gpu-cases", "cases"), baseline_env),
                 ("worker, baseline src", worker, baseline_env)]
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cases(root, items, matrix='[matrix]\ndevices = ["cpu"]\n')
        write_tests(root, (("bare", BARE_FLOOR_TEST), ("floor", REF_FLOOR_TEST)), items,
                    name="test_floor.py")
        from bench_isolation import ITEM_CONFTEST  # this folder: the item timer they share

        (root / "conftest.py").write_text(ITEM_CONFTEST)
        for round_ in range(repeat):  # interleaved, so that a burst of load hits every row
            loads.append(os.getloadavg()[0])
            order = runs if round_ % 2 == 0 else runs[::-1]
            for name, args, env in order:
                wall, used = per_item(root, *args, env=env)
                seconds.setdefault(name, []).append(wall)
                cpu.setdefault(name, []).append(used)
    loads.append(os.getloadavg()[0])
    print(f"   load average {min(loads):.2f}-{max(loads):.2f} over the rounds")
    # Ratios are taken within each round (the floors and the row measured minutes apart
    # at most), then their median across rounds. CPU: the pytest process and its children
    # (user + system) over the same span; it moves far less with other processes' load.
    print(f"   {'what':<30}{'ms/item':>9}{'x bare':>8}{'x ref':>7}{'CPU ms':>8}{'x bare':>8}"
          f"{'x ref':>7}   per round x bare (wall)")
    for name, values in seconds.items():
        ratios = [[value / floor for value, floor in zip(column[name], column[base],
                                                           strict=True)]
                  for column in (seconds, cpu) for base in (BARE, REF)]
        rounds = " ".join(f"{ratio:.2f}" for ratio in ratios[0])
        print(f"   {name:<30}{statistics.median(values) * 1000:>9.2f}"
              f"{statistics.median(ratios[0]):>8.2f}{statistics.median(ratios[1]):>7.2f}"
              f"{statistics.median(cpu[name]) * 1000:>8.2f}"
              f"{statistics.median(ratios[2]):>8.2f}{statistics.median(ratios[3]):>7.2f}   "
              f"{rounds}")


def collection(count: int, repeat: int, baseline_src: str | None = None) -> None:
    print(f"\n2. collection: {count} case directories x 4 items vs one test file importing torch "
          f"with one test parametrized {count * 4} or {count} ways")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cases(root, count, matrix='[matrix]\ndtypes = ["float32", "bfloat16"]\n')
        tests = root / "tests"
        tests.mkdir()
        for name, params in (("test_items.py", count * 4), ("test_cases.py", count)):
            (tests / name).write_text(
                "import pytest\nimport torch\n\n"
                f"@pytest.mark.parametrize('p', range({params}))\n"
                "def test_trivial(p):\n    assert p + 1 > 0\n")
        (root / "nodes_only.py").write_text(NODES_ONLY_PLUGIN)
        nodes_env = {**os.environ, "PYTHONPATH": str(root)}
        runs: dict[str, list[float]] = {"tests": [], "cases": [], "one": [], "half": [],
                                        "nodes": [], "baseline": []}
        half = root / "half"
        half.mkdir()
        for index in range(count // 2):  # half of the cases, a folder of their own
            shutil.copytree(root / "cases" / f"c{index}", half / f"c{index}")
        for _ in range(repeat):  # interleaved rounds, the best of each kept
            runs["tests"].append(pytest_seconds(root, "--collect-only", "tests/test_items.py"))
            runs["cases"].append(pytest_seconds(root, "--collect-only", "--gpu-cases", "cases"))
            runs["one"].append(pytest_seconds(root, "--collect-only", "tests/test_cases.py"))
            runs["half"].append(pytest_seconds(root, "--collect-only", "--gpu-cases", "half"))
            runs["nodes"].append(pytest_seconds(root, "--collect-only", "-p", "no:gpucase",
                                                "-p", "nodes_only", "cases", env=nodes_env))
            if baseline_src:
                runs["baseline"].append(pytest_seconds(
                    root, "--collect-only", "--gpu-cases", "cases",
                    env={**os.environ, "PYTHONPATH": baseline_src}))
        python_tests, cases, one_per_case, cases_half, nodes = (
            min(runs[name]) for name in ("tests", "cases", "one", "half", "nodes"))
    print(f"   {count * 4} parametrized tests (as many items) {python_tests:.2f} s, "
          f"cases {cases:.2f} s, ratio cases / tests {cases / python_tests:.2f}")
    print(f"   {count} parametrized tests (one per case) {one_per_case:.2f} s, "
          f"ratio cases / tests {cases / one_per_case:.2f}")
    print(f"   pytest alone, the same directory and file nodes, no case read "
          f"{nodes:.2f} s: {nodes / python_tests:.2f} x the tests as many items, "
          f"{nodes / one_per_case:.2f} x one per case; cases / this floor {cases / nodes:.2f}")
    if runs["baseline"]:
        baseline = min(runs["baseline"])
        print(f"   cases with the baseline source {baseline:.2f} s, ratio to the tests "
              f"{baseline / python_tests:.2f} (this source {cases / python_tests:.2f})")
    print(f"   {count // 2} cases {cases_half:.2f} s: growth from {count // 2} to {count} cases "
          f"{cases / cases_half:.2f}x (start-up included; 2.00 would be linear without it)")


def memory(counts: list[int]) -> None:
    print("\n3. peak RSS of the pytest process as cases grow (64 KiB payload each)")
    print(f"   {'cases':>8}{'peak RSS MiB':>15}{'x smallest':>12}")
    first = None
    for count in counts:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            write_cases(root, count, matrix='[matrix]\ndevices = ["cpu"]\n',
                        tensor_numel=16 * 1024)
            (root / "conftest.py").write_text(RSS_CONFTEST)
            pytest_seconds(root, "--gpu-cases", "cases")
            peak = int((root / "peak_rss_kib").read_text()) / 1024
        first = first or peak
        print(f"   {count:>8}{peak:>15.0f}{peak / first:>12.2f}")


def payload_io(gib: float) -> None:
    import safetensors.torch

    numel = int(gib * 2**30) // 4
    print(f"\n4. payload of {numel * 4 / 2**30:.2f} GiB (float32): payload.load vs "
          "safetensors.torch.load_file, each + one pass over the values")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.safetensors"
        payload.save(path, {"x": torch.randn(numel)})
        plain, ours = [], []
        for _ in range(3):
            start = time.perf_counter()
            loaded = safetensors.torch.load_file(path)["x"]
            float(loaded.max())
            plain.append(time.perf_counter() - start)
            del loaded
            start = time.perf_counter()
            loaded = payload.load(path)["x"]
            float(loaded.max())
            ours.append(time.perf_counter() - start)
            assert loaded.numel() == numel
            del loaded
    print(f"   load_file {min(plain):.3f} s, payload.load {min(ours):.3f} s, "
          f"ratio {min(ours) / min(plain):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--only", choices=("isolation", "collection", "memory", "payload"))
    parser.add_argument("--baseline-src", metavar="DIR", help="also run the cases (sections 1 and "
                        "2) with the pytest_gpucase package found in DIR (a checkout of an older "
                        "commit), for a before/after ratio in one run")
    parser.add_argument("--repeat", type=int, default=3,
                        help="pytest runs per row in sections 1 and 2 (the best is kept)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, about a minute: 100 items, 2 runs, 2000 cases, 64 MiB")
    args = parser.parse_args()
    if args.quick:
        args.items, args.cases, args.gib = min(args.items, 100), min(args.cases, 2000), 1 / 16
        args.repeat = min(args.repeat, 2)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "isolation"):
        isolation(args.items, args.baseline_src, args.repeat)
    if args.only in (None, "collection"):
        collection(args.cases, args.repeat, args.baseline_src)
    if args.only in (None, "memory"):
        memory([25, 100, 200] if args.quick else [50, 200, 800])
    if args.only in (None, "payload"):
        payload_io(args.gib)


if __name__ == "__main__":
    main()

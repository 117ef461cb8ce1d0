"""Per-item cost of running a case in a fresh child, against a bare ``os.fork`` in the same run.

    python benchmarks/bench_isolation.py [--runs 200]
    python benchmarks/bench_isolation.py --pytest [--items 80] [--rounds 5] [--baseline-src DIR]

Measured in one process that has imported torch (as the plugin's pytest
process has), so every child is a fork of the same image:

- bare fork: ``os.fork`` + ``os._exit(0)`` + ``waitpid``, nothing else
- bare fork floor: the child computes ``x + 1`` and sends it back through a pipe
  (``bench_scale.bare_floor``, the floor bench_scale.py times inside pytest; the floor the
  ratios are taken to)
- run_in_child: gpucase's child with its pipes, fd capture, process group and
  checked JSON result, calling ``os.getpid``
- run_spec: a whole trivial case (load the case's payload in the child, call,
  reference in float64, compare) as each pytest item runs it
- run_spec, forkserver: the same case forked by the zygote (what each run
  costs when CUDA was initialized in the pytest process)
- run_spec, spawn: the same case in a fresh interpreter that imports torch
  again (``--gpu-start-method=spawn``; fewer runs)

With ``--pytest``, per item inside pytest instead, in a project that has a pytest
configuration file (``pytest.ini``; ``--no-config`` leaves it out): the bare fork floor
(``bench_scale.BARE_FLOOR_TEST``), a lean fork (``LEAN_TEST``: what a case item needs,
done plainly in a test), the lean fork's work in gpucase's own child (``LAYER_TEST``:
``run_in_child``, every guarantee of the isolation layer), a case's least work prepared in
the parent (``PREPARED_WORK``: its ``case.py`` compiled and its inputs loaded before the
fork; the child runs the module, the call, its float64 reference, the error figures;
nothing of gpucase's verdict) in a lean fork and in gpucase's own child, the same work
unprepared (``CASE_WORK``) under pytest-forked, in the pytest process and in a lean reused
worker, the same plain test of ``x + 1`` under pytest-forked (``--forked``), ``pytest
--gpu-cases`` on as many trivial cases (a fresh child per item), ``--gpu-isolation
worker``, and the same plain test run in the pytest process (pytest's own cost of an item,
which no mode avoids), the cases without huge pages
(``GPUCASE_HUGEPAGES=0``) and with every dense chunk of the pytest process collapsed at its
first pass (what a machine on which a collapse is cheap does); with ``--forkserver``, the
cases forked by the zygote (``--gpu-start-method forkserver``: the zygote is stopped, and
so counted, before the session's end: its own one-time work, collapsing its memory included,
is in the steady column too); with ``--baseline-src DIR`` the cases run by the package in
DIR too (and, with ``--forkserver``, by the zygote of DIR's package).
Interleaved rounds (the order turning each round), per item from the first item's start to
the last one's end in the pytest process (start-up and collection left out); CPU (user +
system) and minor page faults of the pytest process and its reaped children over the same
span; each ratio taken within a round, the medians printed. The "steady" column is the CPU
per item from the sixth item on: what one more item costs, without the session's one-time
work at its first item (importing the run's modules).

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

from bench_scale import (  # noqa: E402  (this folder: the script's own)
    BARE_FLOOR_TEST,
    absolute_pythonpath,
    bare_floor,
    pytest_seconds,
    write_cases,
    write_tests,
)


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


# A conftest's reading of its process's usage: (CPU seconds, minor faults) of the pytest
# process, then of its reaped children (ITEM_CONFTEST's, and bench_pages.py's --populate).
USAGE_FUNCTION = """
import resource


def _usage():
    # (CPU seconds, minor faults) of this process, then of its reaped children
    both = [resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                resource.RUSAGE_CHILDREN)]
    return [value for u in both for value in (u.ru_utime + u.ru_stime, u.ru_minflt)]
"""
# Times the items from inside the pytest process: wall, CPU and minor page faults of the
# process and its reaped children, from the first item's start to the last one's end.
ITEM_CONFTEST = USAGE_FUNCTION + """
import os
import sys
import time

_seen = {}


def pytest_configure(config):
    if os.environ.get("BENCH_COLLAPSE_ALL"):
        # Every dense chunk worth its cost: what a machine on which a collapse is cheap
        # (memory it touched before, 0.55 ms a chunk) collapses, whatever it costs here.
        from pytest_gpucase.run.isolation import hugepages

        hugepages.SAVED_PER_FORK = 1.0


def pytest_runtest_logstart(nodeid, location):
    if "first" not in _seen:
        _seen["first"], _seen["usage"] = time.perf_counter(), _usage()
    if _seen.get("items") == STEADY_FROM:  # past the session's one-time work
        _seen["steady"], _seen["steady usage"] = time.perf_counter(), _usage()


def pytest_runtest_logfinish(nodeid, location):
    _seen["last"] = time.perf_counter()
    _seen["items"] = _seen.get("items", 0) + 1


def pytest_sessionfinish(session):
    isolation = sys.modules.get("pytest_gpucase.run.isolation")
    if isolation is not None:  # the children still pending, and the workers: counted
        isolation.close_pools()
        isolation.reap_pending()
    zygote = sys.modules.get("pytest_gpucase.run.isolation.zygote")
    if zygote is not None and session.config.getoption("gpu_start_method", None) == "forkserver":
        zygote.stop_forkserver()  # the zygote, and the children it forked and reaped: counted
    now = _usage()
    spent = [after - before for after, before in zip(now, _seen["usage"])]
    steady = [after - before for after, before in zip(now, _seen["steady usage"])]
    with open("item_usage", "w") as handle:
        handle.write(" ".join(map(str, [_seen["last"] - _seen["first"], _seen["items"],
                                        *spent, _seen["items"] - STEADY_FROM, *steady])))
"""
# The items left out of the steady figure: the session's one-time work at its first item
# (importing the run's modules, starting a worker, first touches) is paid there.
STEADY_FROM = 5
ITEM_CONFTEST += f"STEADY_FROM = {STEADY_FROM}\n"
FORKED_TEST = """
import pytest
import torch

X = torch.ones(4)


@pytest.mark.parametrize("i", range({count}))
def test_plain(i):
    assert (X + 1).tolist() == [2.0] * 4
"""

# The lean fork: what a case item needs, done plainly in a test: a fresh child per item
# in its own process group that dies with its parent, its output piped, a deadline, and
# the work (``LEAN_TEST``: the call, its float64 reference, a comparison) sent back as a
# JSON verdict; the parent reads it and waits for the child. ``lean_fork(func, *args)`` is
# shared by the rows that use it; the module that takes it sets ``FREEZE`` (``gc.freeze``
# before the fork, as gpucase does).
LEAN_FORK = """
import ctypes
import gc
import json
import select
import signal
import time

PRCTL = ctypes.CDLL(None).prctl


def lean_fork(func, *args):
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    if FREEZE:
        gc.freeze()
    pid = os.fork()
    if pid == 0:
        try:
            if FREEZE:
                gc.disable()
            PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            os.setpgid(0, 0)
            os.close(out_r)
            os.close(res_r)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            try:
                verdict = func(*args)
            except Exception as exc:
                verdict = {{"status": "failed", "error": repr(exc)}}
            os.write(res_w, json.dumps(verdict).encode())
        finally:
            os._exit(0)
    os.close(out_w)
    os.close(res_w)
    poller = select.poll()
    poller.register(res_r, select.POLLIN)
    poller.register(out_r, select.POLLIN)
    deadline, result, open_fds = time.monotonic() + 60, b"", 2
    while open_fds and time.monotonic() < deadline:
        for fd, _ in poller.poll(1000):
            data = os.read(fd, 65536)
            if not data:
                poller.unregister(fd)
                open_fds -= 1
            elif fd == res_r:
                result += data
    os.close(out_r)
    os.close(res_r)
    os.waitpid(pid, 0)
    return json.loads(result)
"""
LEAN_WORK = """
import os

import pytest
import torch

X = torch.ones(4)


def lean_work():
    actual = X + 1
    reference = X.double() + 1
    passed = torch.allclose(actual.double(), reference)
    return {{"status": "passed" if passed else "failed"}}
"""
LEAN_TEST = LEAN_WORK + """
FREEZE = False
""" + LEAN_FORK + """

@pytest.mark.parametrize("i", range({count}))
def test_lean(i):
    assert lean_fork(lean_work)["status"] == "passed"
"""

# The lean fork's work in gpucase's own child (``run_in_child``): every guarantee of the
# isolation layer (the child's containment, its pipes and deadline watched, faulthandler,
# the descendants ended, a checked JSON result; huge pages for the forks, as a session of
# case items has them) around the same call, reference and comparison, without the case's
# machinery (its inputs, import paths, reference cache, binding, context, the verdict and
# the report's fields). Between the lean fork and ``--gpu-cases``: what the guarantees cost,
# and what the rest of an item does.
LAYER_TEST = LEAN_WORK + """
from pytest_gpucase.run.isolation import expect_forks, run_in_child

expect_forks({count})


@pytest.mark.parametrize("i", range({count}))
def test_layer(i):
    child = run_in_child(lean_work, timeout=60)
    assert child.returned and child.value["status"] == "passed", child
"""

# What any case item does beyond the lean work, done plainly (``CASE_WORK``): its inputs
# read from the case's payload file, its ``case.py`` imported from the file, the call, the
# float64 reference through the same function, the report's figures (largest absolute and
# relative error) and a comparison. No reference cache, no binding or context checks, no
# phase notes, no tolerance model. Run whole in pytest-forked's child (``--forked`` on
# ``MINIMAL_DIRECT_TEST``: a test's child, which nothing prepares), in the pytest process
# (the work itself, warm) and in a lean reused worker (``MINIMAL_WORKER_TEST``).
CASE_WORK = """
import importlib.util
import os
import sys

import pytest
import safetensors.torch
import torch

CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cases")


def judged(run, inputs):
    actual = run(**inputs)
    reference = run(**{{name: value.double() for name, value in inputs.items()}})
    error = (actual.double() - reference).abs()
    relative = error / reference.abs().clamp_min(torch.finfo(actual.dtype).tiny)
    passed = torch.allclose(actual.double(), reference, rtol=1.3e-6, atol=1e-5)
    return {{"status": "passed" if passed else "failed", "max_abs": error.max().item(),
            "max_rel": relative.max().item()}}


def case_work(folder):
    inputs = safetensors.torch.load_file(os.path.join(folder, "inputs.safetensors"))
    spec = importlib.util.spec_from_file_location("minimal_case", os.path.join(folder, "case.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return judged(module.run, inputs)
"""
# The same least work with what does not depend on the child done before the fork, as
# gpucase's item does it (``PREPARED_WORK``): the parent compiles ``case.py`` and loads the
# payload's tensors; the child runs the module's body in a fresh namespace, makes the two
# calls, the error figures and the comparison. In a lean fork (``PREPARED_LEAN_TEST``: the
# lean fork's containment, ``gc.freeze`` before the fork) and in gpucase's own child
# (``PREPARED_TEST``: the isolation layer's guarantees, huge pages as a session has them):
# the least a case item costs, with and without those guarantees.
PREPARED_WORK = CASE_WORK + """

def prepared(folder):
    path = os.path.join(folder, "case.py")
    with open(path, "rb") as handle:
        code = compile(handle.read(), path, "exec")
    return code, safetensors.torch.load_file(os.path.join(folder, "inputs.safetensors")), path


def prepared_work(code, inputs, path):
    namespace = {{"__name__": "case", "__file__": path}}
    exec(code, namespace)
    return judged(namespace["run"], inputs)
"""
PREPARED_LEAN_TEST = PREPARED_WORK + """
FREEZE = True
""" + LEAN_FORK + """

@pytest.mark.parametrize("i", range({count}))
def test_prepared(i):
    work = prepared(os.path.join(CASES, f"c{{i}}"))
    assert lean_fork(prepared_work, *work)["status"] == "passed"
"""
PREPARED_TEST = PREPARED_WORK + """
from pytest_gpucase.run.isolation import expect_forks, run_in_child

expect_forks({count})


@pytest.mark.parametrize("i", range({count}))
def test_prepared(i):
    work = prepared(os.path.join(CASES, f"c{{i}}"))
    child = run_in_child(prepared_work, *work, timeout=60)
    assert child.returned and child.value["status"] == "passed", child
"""
MINIMAL_DIRECT_TEST = CASE_WORK + """

@pytest.mark.parametrize("i", range({count}))
def test_minimal(i):
    assert case_work(os.path.join(CASES, f"c{{i}}"))["status"] == "passed"
"""

# The same work in a lean reused worker: one child, forked at the first item, that runs each
# item's case work and answers a line of JSON through a pipe; nothing checked between
# items, no pipes of its own per item, no deadline. What a reused worker costs at the least.
MINIMAL_WORKER_TEST = CASE_WORK + """
import json

_WORKER = []


def _serve(requests, replies):
    with os.fdopen(requests, "rb") as reader, os.fdopen(replies, "wb", buffering=0) as writer:
        for line in reader:
            try:
                verdict = case_work(line.decode().strip())
            except Exception as exc:
                verdict = {{"status": "failed", "error": repr(exc)}}
            writer.write(json.dumps(verdict).encode() + b"\\n")


def worker():
    if not _WORKER:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(requests_w)
                os.close(replies_r)
                _serve(requests_r, replies_w)
            finally:
                os._exit(0)  # never back into pytest, whatever failed
        os.close(requests_r)
        os.close(replies_w)
        _WORKER.append((pid, os.fdopen(requests_w, "wb", buffering=0), os.fdopen(replies_r, "rb")))
    return _WORKER[0]


@pytest.fixture(scope="session", autouse=True)
def _end_worker():
    yield
    if _WORKER:  # reaped before the session ends: its CPU is counted
        pid, requests, replies = _WORKER.pop()
        requests.close()
        os.waitpid(pid, 0)
        replies.close()


@pytest.mark.parametrize("i", range({count}))
def test_minimal(i):
    pid, requests, replies = worker()
    requests.write(os.path.join(CASES, f"c{{i}}").encode() + b"\\n")
    assert json.loads(replies.readline())["status"] == "passed"
"""


def in_pytest(items: int, rounds: int, baseline_src: str | None, config: bool,
              forkserver: bool = False) -> None:
    """Per item inside pytest, in a project with a configuration file (see the docstring)."""
    # The baseline's package first, then whatever this run's path holds (an older pytest
    # and pytest-forked: pytest-forked 1.7.5 cannot send pytest 9.2's reports back).
    base_env = ({**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.abspath(baseline_src), os.environ.get("PYTHONPATH", "")])}
        if baseline_src else None)
    worker = ("--gpu-cases", "--gpu-isolation", "worker", "cases")
    rows: list[tuple[str, tuple[str, ...], dict[str, str] | None]] = [
        ("bare fork floor", ("bare",), None),
        ("lean fork (the case's work)", ("lean",), None),
        ("the lean work, run_in_child", ("layer",), None),
        ("a prepared case, lean fork", ("prepared_lean",), None),
        ("a prepared case, run_in_child", ("prepared",), None),
        ("a minimal case, --forked", ("--forked", "direct"), None),
        ("a minimal case, in-process", ("direct",), None),
        ("a minimal case, lean worker", ("reused",), None),
        ("pytest-forked (--forked)", ("--forked", "plain"), None),
        ("--gpu-cases (item)", ("--gpu-cases", "cases"), None),
        ("--gpu-isolation worker", worker, None),
        ("plain test, in-process", ("plain",), None),
        ("--gpu-cases, no huge pages", ("--gpu-cases", "cases"),
         {**os.environ, "GPUCASE_HUGEPAGES": "0"}),
        ("--gpu-cases, all collapsed", ("--gpu-cases", "cases"),
         {**os.environ, "BENCH_COLLAPSE_ALL": "1"})]
    if forkserver:
        rows.append(("--gpu-start-method forkserver",
                     ("--gpu-cases", "--gpu-start-method", "forkserver", "cases"), None))
    if base_env is not None:
        rows += [("--gpu-cases, baseline", ("--gpu-cases", "cases"), base_env),
                 ("worker, baseline", worker, base_env)]
        if forkserver:
            rows.append(("forkserver, baseline",
                         ("--gpu-cases", "--gpu-start-method", "forkserver", "cases"), base_env))
    found: dict[str, list[tuple[float, float, float]]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cases(root, items, matrix='[matrix]\ndevices = ["cpu"]\n')
        write_tests(root, (("bare", BARE_FLOOR_TEST), ("plain", FORKED_TEST),
                           ("lean", LEAN_TEST), ("layer", LAYER_TEST),
                           ("prepared_lean", PREPARED_LEAN_TEST),
                           ("prepared", PREPARED_TEST), ("direct", MINIMAL_DIRECT_TEST),
                           ("reused", MINIMAL_WORKER_TEST)), items)
        (root / "conftest.py").write_text(ITEM_CONFTEST)
        if config:
            (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")
        for round_ in range(rounds):  # interleaved: a burst of load hits every row
            loads.append(os.getloadavg()[0])
            for name, args, env in (rows if round_ % 2 == 0 else rows[::-1]):
                pytest_seconds(root, *args, env=env)
                wall, count, *spent = map(float, (root / "item_usage").read_text().split())
                cpu, faults, child_cpu, child_faults = (value / count for value in spent[:4])
                steady_count, *steady = spent[4:]
                found.setdefault(name, []).append(
                    (wall / count, cpu + child_cpu, faults + child_faults, cpu, child_cpu, faults,
                     child_faults, (steady[0] + steady[2]) / steady_count))
    loads.append(os.getloadavg()[0])
    floor = found["bare fork floor"]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {items} items, {rounds} rounds, "
          f"load average {min(loads):.2f}-{max(loads):.2f}, "
          f"{'with' if config else 'without'} a pytest.ini; medians per item, ratios to the "
          "bare fork floor taken within each round")
    print("CPU and faults: the pytest process and its children; then each apart (pytest / "
          "children), CPU as a share of the floor's whole")
    print(f"steady: CPU per item from item {STEADY_FROM + 1} on (the session's one-time work "
          "at its first items left out), as a ratio to the floor's own; a worker's CPU is "
          "counted when it is reaped, at the session's end: its start is in both")
    print(f"{'what':<28}{'wall ms':>9}{'x floor':>9}{'CPU ms':>9}{'x floor':>9}{'steady':>8}"
          f"{'faults':>8}{'CPU pytest/child':>18}{'faults pytest/child':>21}"
          "   CPU x floor per round")
    for name, values in found.items():
        ratios = [[value[i] / base[1 if i in (3, 4) else i]
                   for value, base in zip(values, floor, strict=True)] for i in (0, 1, 3, 4, 7)]
        median = [statistics.median(v[i] for v in values) for i in range(8)]
        shares = f"{statistics.median(ratios[2]):.2f} / {statistics.median(ratios[3]):.2f}"
        print(f"{name:<28}{median[0] * 1000:>9.2f}{statistics.median(ratios[0]):>9.2f}"
              f"{median[1] * 1000:>9.2f}{statistics.median(ratios[1]):>9.2f}"
              f"{statistics.median(ratios[4]):>8.2f}{median[2]:>8.0f}"
              f"{shares:>18}{f'{median[5]:.0f} / {median[6]:.0f}':>21}   "
              + " ".join(f"{ratio:.2f}" for ratio in ratios[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="30 runs each (under a minute)")
    parser.add_argument("--pytest", action="store_true",
                        help="per item inside pytest, against pytest-forked (see above)")
    parser.add_argument("--items", type=int, default=80, help="--pytest: items per run")
    parser.add_argument("--rounds", type=int, default=5, help="--pytest: interleaved rounds")
    parser.add_argument("--baseline-src", metavar="DIR",
                        help="--pytest: also run the cases with the package found in DIR")
    parser.add_argument("--no-config", action="store_true",
                        help="--pytest: a project without a pytest configuration file")
    parser.add_argument("--forkserver", action="store_true",
                        help="--pytest: also run the cases forked by the zygote (the start "
                             "method when CUDA was initialized in the pytest process)")
    args = parser.parse_args()
    if args.pytest:
        absolute_pythonpath()
        in_pytest(args.items, args.rounds, args.baseline_src, not args.no_config,
                  args.forkserver)
        return
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

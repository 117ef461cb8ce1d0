"""Where one default item's time goes, in the parent and in its forked child.

    python benchmarks/bench_item_phases.py [--items 100] [--repeat 3] [--baseline-src DIR]

Runs ``pytest --gpu-cases`` on N trivial cases (x + 1, float64 reference,
compare; as ``bench_scale.py`` section 1 does) with a small plugin that takes
CLOCK_MONOTONIC timestamps (shared by the parent and its children) at the
borders of an item: pytest's start of the item, ``run_spec`` entered, the fork
(before, and after in the parent and in the child), the child's ``run`` entered
and returned, its result written, ``run_spec`` returned, pytest's end of the
item. In the child it also counts, around ``run`` and around each step inside
it, the time and the page faults (each one a page of the parent's memory the
child copied, or mapped, on first touch). Medians over the items of the best
of ``--repeat`` runs (the first five items of each left out: imports, first
touches), in milliseconds. With ``--baseline-src`` the same cases are run by an
older checkout of the package, in interleaved runs, for a before/after; the
bare fork floor of ``bench_scale.py`` runs in the same rounds, with the same
borders where it has them (its test's body is the run).

The plugin wraps functions by their names in the package (``run.parent.run``,
``run.parent.run_spec``, ``run.isolation.child._write_all`` and the steps):
this is a profile of the package as it is laid out now, not a public interface.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import BARE_FLOOR_TEST, BENCHMARKS, write_cases

PLUGIN = textwrap.dedent('''
    import functools, importlib, json, os, resource, time

    _now = time.perf_counter  # CLOCK_MONOTONIC on Linux: one clock for parent and children
    _OUT = os.environ["GPUCASE_PHASES_OUT"]
    _item, _items, _child = {}, [], {}
    STEPS = (
        ("run.child", "load_arguments"), ("run.child", "resolve"),
        ("run.child", "check_binding"), ("run.child", "call"),
        ("run.judge", "Judged.__init__"), ("run.judge", "Judged.verdict"),
        ("run.judge", "Judged.fresh_reference"), ("run.judge", "Judged.judged"),
        ("verdict.compare", "compare"), ("run.reference_cache", "entry"),
        ("run.judge", "compare_results"), ("run.reference_cache", "load"),
        ("run.judge", "Judged.stored_look"), ("run.judge", "Judged.store"),
        ("run.judge", "Judged.held"), ("run.child", "prepare"), ("run.child", "replay_context"),
        ("run.child", "apply_settings"), ("run.child", "run_precision"),
        # The child's own set-up and result, each a guarantee (docs/isolation.md)
        ("run.isolation.child", "_contain_self"), ("run.isolation.child", "_drop_channels"),
        ("run.isolation.child", "_flush_std_streams"), ("run.isolation.child", "_answer_dumps"),
        ("run.isolation.child", "_end_descendants"), ("run.isolation.child", "encode"),
        ("run.isolation.child", "_save_coverage"),
    )


    def _faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


    def _cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


    def _wrap(holder, attribute, key):
        original = getattr(holder, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            began, faults, cpu = _now(), _faults(), _cpu()
            try:
                return original(*args, **kwargs)
            finally:
                spent = _child.setdefault(key, [0.0, 0, 0.0])
                spent[0] += _now() - began
                spent[1] += _faults() - faults
                spent[2] += _cpu() - cpu

        setattr(holder, attribute, timed)


    def pytest_configure(config):
        import pytest_gpucase.run.isolation.child as child_side
        import pytest_gpucase.run.parent as parent

        fork = os.fork

        def forked():
            _item["fork"] = _now()
            pid = fork()
            if pid == 0:
                _child.clear()
                _child["fork"], _child["started"] = _item["fork"], _now()
            else:
                _item["forked"] = _now()
            return pid

        os.fork = forked
        run, run_spec, write_all = parent.run, parent.run_spec, child_side._write_all

        def timed_run(spec):
            _child["run"], faults, cpu = _now(), _faults(), _cpu()
            try:
                return run(spec)
            finally:
                _child["ran"], _child["run faults"] = _now(), _faults() - faults
                _child["run cpu"] = _cpu() - cpu

        def timed_run_spec(*args, **kwargs):
            _item["run_spec"] = _now()
            try:
                return run_spec(*args, **kwargs)
            finally:
                _item["returned"] = _now()

        def timed_write_all(fd, data):
            if "ran" not in _child or "written" in _child:
                return write_all(fd, data)  # a phase note, or not a run's result
            _child["written"] = _now()
            write_all(fd, data)
            _child["child faults"], _child["child cpu"] = _faults(), _cpu()
            with open(_OUT + ".child", "a") as handle:
                handle.write(json.dumps(_child) + "\\n")

        parent.run, parent.run_spec = timed_run, timed_run_spec
        child_side._write_all = timed_write_all
        for module, name in STEPS:
            try:
                holder = importlib.import_module(f"pytest_gpucase.{module}")
                *owners, attribute = name.split(".")
                for owner in owners:
                    holder = getattr(holder, owner)
                _wrap(holder, attribute, name)
            except (ImportError, AttributeError):
                pass  # a step an older checkout does not have


    import pytest


    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(pyfuncitem):  # the bare floor's plain test: its body is "the run"
        _item["run_spec"] = _now()
        yield
        _item["returned"] = _now()


    def pytest_runtest_logstart(nodeid, location):
        _item.clear()
        _item["start"] = _now()


    def pytest_runtest_logfinish(nodeid, location):
        _item["end"] = _now()
        _items.append(dict(_item))


    def pytest_unconfigure(config):
        with open(_OUT + ".parent", "w") as handle:
            json.dump(_items, handle)
''')

REPO = str(Path(__file__).resolve().parent.parent)
FLOOR = "floor"  # instead of a package folder: run bench_scale's bare fork floor
PARENT = (("pytest: item start -> the run begins (run_spec; the floor's test)", "start",
           "run_spec"),
          ("-> fork (ours: the parent reads what the child would)", "run_spec", "fork"),
          ("os.fork in the parent", "fork", "forked"),
          ("fork returned -> the run ends (ours: the child's life, decode; the floor: the "
           "child's life and exit, waitpid)", "forked", "returned"),
          ("the run ended -> pytest: item end (report)", "returned", "end"),
          ("item, whole", "start", "end"))
CHILD = (("fork called -> the child runs Python (fork, schedule, at-fork hooks)", "fork",
          "started"),
         ("child set-up -> run() (containment, pipes, faulthandler)", "started", "run"),
         ("run(): inputs, import, call, reference, compare", "run", "ran"),
         ("run() returned -> result written (encode)", "ran", "written"))


def one_run(root: Path, plugin_dir: Path, src: str | None) -> tuple[dict[str, float], ...]:
    """One pytest run of the cases (``src``: the package's folder, None for this one), or of
    the bare fork floor (``src`` ``FLOOR``): the items' and the children's timestamps."""
    out = root / "phases"
    for suffix in (".parent", ".child"):
        Path(str(out) + suffix).unlink(missing_ok=True)
    # This checkout's package unless another one is named: not whatever is installed.
    paths = [str(plugin_dir), src if src and src != FLOOR else REPO]
    env = {**os.environ, "GPUCASE_PHASES_OUT": str(out),
           "PYTHONPATH": os.pathsep.join(paths)}
    target = ["bare"] if src == FLOOR else ["--gpu-cases", "cases"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:benchmark", "-p", "no:randomly", "-p", "gpucase_phases",
                           *target], cwd=root, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pytest failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    items = json.loads(Path(str(out) + ".parent").read_text())[5:]
    written = Path(str(out) + ".child")
    children = ([json.loads(line) for line in written.read_text().splitlines()][5:]
                if written.exists() else [])
    return tuple(items), tuple(children)  # type: ignore[return-value]


def medians(items: tuple[dict[str, float], ...],
            children: tuple[dict[str, object], ...]) -> dict[str, float]:
    found: dict[str, float] = {}
    for label, start, end in PARENT:
        found[label] = statistics.median(i[end] - i[start] for i in items) * 1000
    if not children:  # the bare floor: no run() of ours in its child
        return found
    for label, start, end in CHILD:
        found[label] = statistics.median(float(c[end]) - float(c[start])  # type: ignore[arg-type]
                                         for c in children) * 1000
    for key, label, scale in (("run faults", "run() page faults", 1),
                              ("run cpu", "run() CPU", 1000),
                              ("child faults", "the child's page faults, fork to result", 1),
                              ("child cpu", "the child's CPU, fork to result", 1000)):
        found[label] = statistics.median(float(c.get(key, 0.0))  # type: ignore[arg-type]
                                         for c in children) * scale
    steps = sorted({k for c in children for k, v in c.items() if isinstance(v, list)})
    for step in steps:
        for index, what, scale in ((0, "", 1000), (1, ", page faults", 1), (2, ", CPU", 1000)):
            found[f"  {step}{what}"] = statistics.median(
                c.get(step, [0.0, 0, 0.0])[index]  # type: ignore[union-attr,index]
                for c in children) * scale
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-src", metavar="DIR",
                        help="also run with the pytest_gpucase package found in DIR")
    args = parser.parse_args()
    sources = ({"this": None} | ({"base": args.baseline_src} if args.baseline_src else {})
               | {"bare fork floor": FLOOR})
    best: dict[str, dict[str, float]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cases(root, args.items, matrix='[matrix]\ndevices = ["cpu"]\n')
        # A project with a pytest configuration file, as most are (it is read for each
        # case's import paths).
        (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")
        (root / "bare").mkdir()
        (root / "bare" / "test_floor.py").write_text(
            BARE_FLOOR_TEST.format(count=args.items, benchmarks=BENCHMARKS))
        plugin_dir = root / "plugin"
        plugin_dir.mkdir()
        (plugin_dir / "gpucase_phases.py").write_text(PLUGIN)
        for round_ in range(args.repeat):
            loads.append(os.getloadavg()[0])
            order = list(sources.items())
            for name, src in (order if round_ % 2 == 0 else order[::-1]):
                found = medians(*one_run(root, plugin_dir, src))
                whole = "item, whole"
                if name not in best or found[whole] < best[name][whole]:
                    best[name] = found
    loads.append(os.getloadavg()[0])
    print(f"{args.items} trivial items, best of {args.repeat} runs by the whole item's median, "
          f"load average {min(loads):.2f}-{max(loads):.2f}; milliseconds (page faults where "
          "named)")
    names = list(best)
    print(f"| where, per item | {' | '.join(names)} |")
    print(f"|---|{'---:|' * len(names)}")
    for label in best["this"]:
        cells = [best[name].get(label) for name in names]
        shown = [("-" if value is None else f"{value:.0f}" if "faults" in label
                  else f"{value:.2f}") for value in cells]
        print(f"| {label} | {' | '.join(shown)} |")


if __name__ == "__main__":
    main()

"""Which memory an item's two processes write: the copy-on-write faults, by where they land.

    python benchmarks/bench_pages.py [--items 40] [--at 20] [--rounds 3] [--populate]

Each fork write-protects every writable page of the process that forks; after it, each page
either process writes costs one fault, a copy while the other still maps it. The
per-item rows of ``bench_isolation.py --pytest`` count those faults; this names where they
land. One pytest session per row (the bare fork floor, the lean fork, ``--gpu-cases``, and
``--gpu-cases`` with its children forked by the zygote, ``--gpu-start-method forkserver``)
in a project with a ``pytest.ini``; at one item past the session's first ones (``--at``):

- **the pytest process**: a holder child is forked as the item starts and kept until it
  ends, so that every page the pytest process writes meanwhile is copied; the pages then
  mapped by that process alone (``/proc/PID/pagemap``, bit 56) are the ones it wrote (or
  mapped anew) during the item;
- **the item's child**: read at its ``os._exit``, while its parent still lives: the pages
  it alone maps are the ones it wrote since its fork (or mapped anew); the next item's
  child too, to count the pages the two have in common. A zygote's child, forked by a
  process that was forked before the items, learns that it is measured from a flag file;
  the zygote's own faults over the item come from its ``/proc/PID/stat``.

A process of the session's own reads them (``/proc/PID/pagemap`` of its parent and of its
sibling: a ``kernel.yama.ptrace_scope`` of 1 or more refuses it), on request through two
named pipes, so that no reading writes a page of the process read. A last row runs the
item again with its child read at each step as well (its first line, its run's start,
gpucase's phase notes, the run's end): the pages each step writes.

Each by the kind of mapping (the interpreter's static data, the C heap, anonymous memory:
Python's object arenas, torch's buffers, the libraries' ``.bss``; other libraries' data,
the stack), with how many of them lie in runs of at least ``RUN`` neighbouring pages. Then,
in this process, what a fault costs against breaking the same pages' sharing first, in one
``madvise(MADV_POPULATE_WRITE)`` over neighbours or one ``process_madvise`` over scattered
pages (Linux 6.13+), and what the fork call itself costs. With ``--populate``, paired
sessions of 300 items in which each child breaks, at its first line, the sharing of the
pages an earlier child wrote, against sessions that do not. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()

from bench_isolation import LEAN_TEST, USAGE_FUNCTION  # noqa: E402  (this folder's own)
from bench_scale import (  # noqa: E402
    BARE_FLOOR_TEST,
    BENCHMARKS,
    absolute_pythonpath,
    pytest_seconds,
    write_cases,
    write_tests,
)
from page_sharing import (  # noqa: E402
    MADV_POPULATE_WRITE,
    PAGE,
    break_sharing,
    page_ranges,
)

RUN = 8  # neighbouring pages that count as a run a single call could break at once

# The measured item's two processes are read by a process of their own (``_reader``).
PAGES_CONFTEST = """
import ctypes
import os
import select
import signal

RUN = {run}
AT = {at}
ROOT = {root!r}
WAIT = 120  # seconds a request waits for the reading process before it gives up
ASK, ANSWER = os.path.join(ROOT, "pages_ask"), os.path.join(ROOT, "pages_answer")
# While a measured item runs: for a child forked before it (a zygote's), which one it is.
FLAG = os.path.join(ROOT, "pages_measuring")
_seen = {{"items": 0}}
_exit = os._exit


def _written(pid, keep):
    \"\"\"Per kind of mapping: [pages ``pid`` alone maps, of them in runs >= RUN]; with
    ``keep``, the page numbers too (under "pages").\"\"\"
    found = {{}}
    kept = []
    with open(f"/proc/{{pid}}/maps") as maps:
        lines = maps.read().splitlines()
    with open(f"/proc/{{pid}}/pagemap", "rb", buffering=0) as pagemap:
        for line in lines:
            parts = line.split()
            if "w" not in parts[1]:
                continue
            low, high = (int(value, 16) // {page} for value in parts[0].split("-"))
            name = parts[5] if len(parts) > 5 else ""
            kind = ("anonymous" if not name else "C heap" if name == "[heap]"
                    else "stack" if name.startswith("[stack") else "interpreter"
                    if "libpython" in name else "other" if name.startswith("[")
                    else "libraries")
            counts = found.setdefault(kind, [0, 0])
            pagemap.seek(low * 8)
            entries = memoryview(pagemap.read((high - low) * 8)).cast("Q")
            last, run = -2, 0
            for index, entry in enumerate(entries):
                if not (entry >> 63 & 1 and entry >> 56 & 1):
                    continue
                counts[0] += 1
                if keep:
                    kept.append(low + index)
                if index != last + 1:
                    counts[1] += run if run >= RUN else 0
                    run = 0
                run += 1
                last = index
            counts[1] += run if run >= RUN else 0
    if keep:
        found["pages"] = kept
    return found


def _reader():
    \"\"\"The reading process: reads the pagemap of whoever asks, so that no reading writes a
    page of the process read. A request: "pid label" ("+label": the page numbers kept too);
    "pid =name" saves that pid's readings to ROOT/name. It dies with the pytest process.\"\"\"
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    ask = os.open(ASK, os.O_RDWR)
    answer = os.open(ANSWER, os.O_RDWR)
    readings = {{}}
    pending = b""
    while True:
        pending += os.read(ask, 4096)
        while b"\\n" in pending:
            line, _, pending = pending.partition(b"\\n")
            pid, _, label = line.decode().partition(" ")
            if label == "=stop":
                _exit(0)
            if label.startswith("="):
                with open(os.path.join(ROOT, label[1:]), "w") as handle:
                    handle.write(repr(readings.pop(pid, [])))
            else:
                keep = label.startswith("+")
                label = label.removeprefix("+")
                try:
                    readings.setdefault(pid, []).append((label, _written(pid, keep)))
                except Exception as exc:  # the session's error names it
                    readings.setdefault(pid, []).append((label, {{"error": repr(exc)}}))
            os.write(answer, b"k")


def _start_reader():
    for path in (ASK, ANSWER):
        if not os.path.exists(path):
            os.mkfifo(path)
    if os.fork() == 0:
        try:
            _reader()
        finally:
            _exit(0)


def tell(label):
    # Non-blocking: with no reading process (it died), this raises instead of waiting.
    ask = os.open(ASK, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(ask, f"{{os.getpid()}} {{label}}\\n".encode())
    finally:
        os.close(ask)


def request(label):
    \"\"\"Ask the reader to read this process now, and wait until it has (a few
    syscalls and small objects here: the reading's own pages are not this process's).\"\"\"
    answer = os.open(ANSWER, os.O_RDONLY | os.O_NONBLOCK)
    try:
        tell(label)
        if not select.select([answer], [], [], WAIT)[0] or not os.read(answer, 1):
            raise TimeoutError(f"no answer from the reading process in {{WAIT}} s")
    finally:
        os.close(answer)


_start_reader()


def _measured_child():
    \"\"\"Whether this process is the measured item's child, forked by the pytest process.\"\"\"
    return _seen.get("measuring") and os.getpid() != _seen["parent"]


def step(label):
    if _measured_child():
        request(label)


def measured_exit(code):
    suffix = None
    if _measured_child():
        _seen["measuring"] = False
        suffix = _seen["suffix"]
    elif "parent" not in _seen and os.path.exists(FLAG):
        # Forked by the zygote, itself forked before the session's items: told by the flag.
        with open(FLAG) as flag:
            suffix = flag.read()
    if suffix is not None:
        try:
            request("+the result sent, up to the exit")
            request("=pages_child" + suffix)
        except OSError:
            pass
    _exit(code)


def _zygote_faults():
    \"\"\"The minor faults of the session's zygote so far, if it has one.\"\"\"
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{{task}}/children") as children:
            for pid in children.read().split():
                try:
                    with open(f"/proc/{{pid}}/comm") as comm:
                        if "zygote" not in comm.read():
                            continue
                    with open(f"/proc/{{pid}}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                return int(fields[7])
    return None


os._exit = measured_exit


def pytest_configure(config):
    if config.getoption("gpu_cases", None):
        # A run caches its reference when computing it took 5 ms or more: under load (or
        # the step readings' waits) some would, and a later round's item would then read
        # it from the cache. No session here caches one: the trivial reference takes less.
        from pytest_gpucase.run import reference_cache

        reference_cache.MIN_SECONDS = float("inf")
    if os.environ.get("{steps_env}"):  # a session of case items, read step by step
        _wrap_steps()


def pytest_runtest_logstart(nodeid, location):
    _seen["items"] += 1
    if _seen["items"] == AT + 1:  # the next item's child too: which pages are the same
        _seen.update(measuring=True, parent=os.getpid(), suffix="_next")
        with open(FLAG, "w") as flag:
            flag.write("_next")
    if _seen["items"] != AT:
        return
    with open(FLAG, "w") as flag:
        flag.write("")
    _seen["zygote"] = _zygote_faults()
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # keeps every page shared until the item ends
        os.close(write)
        os.read(read, 1)
        _exit(0)
    os.close(read)
    _seen.update(holder=(holder, write), measuring=True, parent=os.getpid(), suffix="")


def pytest_runtest_logfinish(nodeid, location):
    _seen["measuring"] = False
    if "holder" in _seen:
        request("the item's end")  # first: what follows is the measuring's own
        request("=pages_parent")
        before, after = _seen.pop("zygote"), _zygote_faults()
        if before is not None and after is not None:
            with open(os.path.join(ROOT, "zygote_faults"), "w") as handle:
                handle.write(repr(after - before))
        holder, write = _seen.pop("holder")
        os.close(write)
        os.waitpid(holder, 0)
    if os.path.exists(FLAG):
        os.unlink(FLAG)


def pytest_unconfigure(config):
    tell("=stop")


def _before_first_line(action):
    \"\"\"Have each case child forked from now on call ``action()`` at its first line.\"\"\"
    from pytest_gpucase.run.isolation import child as isolation

    contain = isolation._contain_self

    def first_line(*args, **kwargs):
        action()
        return contain(*args, **kwargs)

    isolation._contain_self = first_line


# In a case item's child: the pages written by each of its steps, read at gpucase's own
# phase notes and around the run.
def _wrap_steps():
    from pytest_gpucase.run import child, judge, parent

    run, child_note, judge_note = parent.run, child.note, judge.note
    _before_first_line(lambda: step("the fork, up to the child's first line"))

    def stepped_run(spec):
        step("the isolation layer's setup, up to the run")
        try:
            return run(spec)
        finally:
            step("the run, from its last note to its verdict")

    def noted(note):
        def stepping(phase):
            step("the run, up to the note: " + phase.split(" (")[0])
            note(phase)
        return stepping

    parent.run = stepped_run
    child.note, judge.note = noted(child_note), noted(judge_note)

"""
KINDS = ("anonymous", "C heap", "interpreter", "libraries", "stack", "other")

# ``--populate``, appended to the conftest with ``USAGE_FUNCTION``: from item AT + 2 on,
# each child first breaks the sharing of the pages item AT's child wrote (read by the
# reading process, page numbers kept) in one ``process_madvise(MADV_POPULATE_WRITE)`` call,
# at its first line; the CPU and faults per item from there to the session's end,
# children reaped.
POPULATE_CONFTEST = """
import ast
import sys

sys.path.insert(0, {benchmarks!r})
from page_sharing import break_sharing, page_ranges

POPULATE = {populate}
_plan = {{}}
_logstart = pytest_runtest_logstart


def pytest_runtest_logstart(nodeid, location):
    _logstart(nodeid, location)
    if _seen["items"] != AT + 2:
        return
    with open(os.path.join(ROOT, "pages_child")) as found:
        pages = ast.literal_eval(found.read())[-1][1]["pages"]
    ranges = page_ranges(pages)
    if POPULATE:
        _before_first_line(lambda: break_sharing(ranges))
    _plan.update(learned=(len(pages), len(ranges)), start=_usage())


def pytest_sessionfinish(session):
    from pytest_gpucase.run import isolation

    isolation.reap_pending()
    items = _seen["items"] - AT - 1
    spent = [(after - before) / items for after, before in zip(_usage(), _plan["start"])]
    with open(os.path.join(ROOT, "populate_usage"), "w") as handle:
        handle.write(repr((spent, _plan["learned"])))
"""


SESSION_LIMIT = 600  # seconds a measured session may take before the script gives up
STEPS_ENV = "BENCH_PAGE_STEPS"  # read by the conftest: the item's child, step by step


def in_pytest(items: int, at: int, rounds: int) -> None:
    steps_env = {**os.environ, STEPS_ENV: "1"}
    rows: list[tuple[str, tuple[str, ...], dict[str, str] | None]] = [
        ("bare fork floor", ("bare",), None), ("lean fork", ("lean",), None),
        ("--gpu-cases (item)", ("--gpu-cases", "cases"), None),
        ("item, forkserver", ("--gpu-cases", "--gpu-start-method", "forkserver", "cases"),
         None),
        ("item, step by step", ("--gpu-cases", "cases"), steps_env)]
    found: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    steps: list[list[tuple[str, int]]] = []
    same: dict[str, list[int]] = {}  # the child's pages the next item's child wrote too
    zygote: list[int] = []  # the zygote's own faults over the item
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _project(root, items)
        write_tests(root, (("bare", BARE_FLOOR_TEST), ("lean", LEAN_TEST)), items)
        (root / "conftest.py").write_text(_conftest(root, at))
        for _ in range(rounds):
            for name, args, env in rows:
                for side in ("pages_parent", "pages_child", "pages_child_next", "zygote_faults"):
                    (root / side).unlink(missing_ok=True)
                pytest_seconds(root, *args, env=env, timeout=SESSION_LIMIT)
                # Each side's readings, in order: (label, {kind: [pages, in runs]}).
                parent, child, following = (
                    ast.literal_eval((root / side).read_text()) if (root / side).exists()
                    else [] for side in ("pages_parent", "pages_child", "pages_child_next"))
                problems = [kinds["error"] for _, kinds in [*parent, *child, *following]
                            if "error" in kinds]
                if not parent or not child or not following or problems:
                    raise RuntimeError(
                        f"{name}: the item's pages were not read: "
                        f"{problems[0] if problems else 'no reading came back'} (the "
                        "reading process reads /proc/PID/pagemap of its parent and of "
                        "its sibling: a kernel.yama.ptrace_scope of 1 or more refuses it)")
                found.setdefault(name, []).append((parent[-1][1], child[-1][1]))
                if "forkserver" in args:
                    zygote.append(int((root / "zygote_faults").read_text()))
                same.setdefault(name, []).append(len(set(child[-1][1]["pages"])
                                                     & set(following[-1][1]["pages"])))
                if env is not None:
                    steps.append([(label, sum(kinds[kind][0] for kind in KINDS if kind in kinds))
                                  for label, kinds in child])
    print(f"pages written during item {at} of {items} (medians of {rounds} sessions); "
          f"in brackets, those in runs of >= {RUN} neighbouring pages")
    print(f"{'what':<22}{'side':<8}{'all':>12}" + "".join(f"{kind:>16}" for kind in KINDS))
    for name, sessions in found.items():
        for index, side in enumerate(("pytest", "child")):
            cells = [_cell([session[index] for session in sessions], kind)
                     for kind in (None, *KINDS)]
            print(f"{name:<22}{side:<8}{cells[0]:>12}" + "".join(f"{c:>16}" for c in cells[1:]))
    print("\nthe child's pages that the next item's child wrote too (median): "
          + ", ".join(f"{name} {statistics.median(counts):.0f}" for name, counts in same.items()))
    if zygote:
        print("forkserver: the zygote's own faults over the item (it forks the child): "
              + ", ".join(map(str, zygote)))
    print("\nthe item's child, step by step (pages written by each step, median; each "
          "named by where it ends)")
    before = [0] * len(steps)
    for index, (label, _) in enumerate(steps[0]):
        after = [found_steps[index][1] for found_steps in steps]
        spent = statistics.median(a - b for a, b in zip(after, before, strict=True))
        print(f"  {spent:6.0f}  {label}")
        before = after


def _project(root: Path, items: int) -> None:
    """``items`` trivial case items for the CPU, in a project with a ``pytest.ini``."""
    write_cases(root, items, matrix='[matrix]\ndevices = ["cpu"]\n')
    (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")


def _conftest(root: Path, at: int) -> str:
    """The measuring conftest for a project at ``root``, item ``at`` (and its next) read."""
    return PAGES_CONFTEST.format(run=RUN, at=at, page=PAGE, root=str(root),
                                 steps_env=STEPS_ENV)


def _cell(sides: list[dict[str, Any]], kind: str | None) -> str:
    """"pages (of them in runs)" of ``kind`` (None: all), the median over the sessions."""
    pages, in_runs = (statistics.median(sum(counts[part] for key, counts in found.items()
                                            if key in (KINDS if kind is None else (kind,)))
                                        for found in sides) for part in (0, 1))
    return f"{pages:.0f} ({in_runs:.0f})"


def populate_trial(items: int, at: int, rounds: int) -> None:
    """``--populate``: paired sessions of ``items`` case items, each child's learned pages
    broken in one call at its first line or not; CPU and faults per item, medians."""
    found: dict[bool, list[list[float]]] = {True: [], False: []}
    learned = (0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _project(root, items)
        for round_ in range(rounds):
            for populate in (True, False) if round_ % 2 == 0 else (False, True):
                (root / "conftest.py").write_text(
                    _conftest(root, at) + USAGE_FUNCTION
                    + POPULATE_CONFTEST.format(populate=populate, benchmarks=BENCHMARKS))
                pytest_seconds(root, "--gpu-cases", "cases", timeout=SESSION_LIMIT)
                spent, learned = ast.literal_eval((root / "populate_usage").read_text())
                found[populate].append(spent)
    print(f"\n{items} case items; item {at}'s child's pages ({learned[0]} in {learned[1]} "
          "ranges) broken in one call at each later child's first line, or not; per item "
          f"from item {at + 2} on, medians of {rounds} paired sessions (each in brackets)")
    for populate, label in ((False, "a fault each"), (True, "broken in one call")):
        values = found[populate]
        cpu, faults, child_cpu, child_faults = (statistics.median(v[i] for v in values)
                                                for i in range(4))
        each = " ".join(f"{v[2] * 1e3:.2f}" for v in values)
        print(f"  {label:<20} pytest CPU {cpu * 1e3:.2f} ms, {faults:.0f} faults; children "
              f"CPU {child_cpu * 1e3:.2f} ms ({each}), {child_faults:.0f} faults")


def fault_cost(pages: int = 1500, repeats: int = 30) -> None:
    """Per page written in a forked child: a copy-on-write fault each (neighbours, 3 and 64
    pages apart), against breaking the same pages' sharing first: one
    ``madvise(MADV_POPULATE_WRITE)`` over neighbours, one call a page, and
    ``process_madvise`` over scattered pages (``page_sharing.break_sharing``); then a fault
    on memory the child mapped itself (nothing to copy) and the writing loop alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    widest = 64
    area = mmap.mmap(-1, PAGE * pages * widest, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for step in (1, 3, widest):
        for index in range(pages):
            area[index * step * PAGE] = 1  # present in this process before the forks
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))
    ranges = {step: page_ranges(start // PAGE + index * step for index in range(pages))
              for step in (3, widest)}

    def child(step: int, how: str) -> float:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            if how == "again":  # written once before the clock: the loop's own cost
                for index in range(pages):
                    area[index * step * PAGE] = 2
            began = time.thread_time()
            status = 0
            if how == "one call":
                status = libc.madvise(start, PAGE * pages, MADV_POPULATE_WRITE)
            elif how == "a call a page":
                for index in range(pages):
                    status |= libc.madvise(start + index * step * PAGE, PAGE,
                                           MADV_POPULATE_WRITE)
            elif how == "process_madvise":
                status = 0 if break_sharing(ranges[step]) else -1
            target = area
            if how == "fresh":  # mapped in the child: a fault each, nothing to copy
                target = mmap.mmap(-1, len(area),
                                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for index in range(pages):
                target[index * step * PAGE] = 2
            spent = -1.0 if status else time.thread_time() - began
            os.write(write, repr(spent).encode())
            os._exit(0)
        os.close(write)
        spent = float(os.read(read, 64))
        os.close(read)
        os.waitpid(pid, 0)
        return spent

    print(f"\na page written in a forked child ({pages} pages, {repeats} children each, "
          "median; microseconds a page, the writing loop included)")
    for label, step, how in (("a fault each, neighbours", 1, "faults"),
                             ("a fault each, 3 apart", 3, "faults"),
                             (f"a fault each, {widest} apart", widest, "faults"),
                             ("one madvise, neighbours", 1, "one call"),
                             ("a madvise a page, 3 apart", 3, "a call a page"),
                             ("process_madvise, 3 apart", 3, "process_madvise"),
                             (f"process_madvise, {widest} apart", widest, "process_madvise"),
                             ("a fault each, mapped anew", 1, "fresh"),
                             ("no fault (written before)", 1, "again")):
        spent = statistics.median(child(step, how) for _ in range(repeats))
        print(f"  {label:<30}" + (f"{spent / pages * 1e6:8.2f}" if spent >= 0
                                  else "     n/a (refused by this kernel)"))
    area.close()
    print(f"\nthe fork itself, in the process that forks (this one: torch imported, none of "
          f"its memory collapsed into huge pages), {fork_cost(repeats) * 1e3:.2f} ms of its "
          f"CPU (median of {repeats})")


def fork_cost(repeats: int) -> float:
    """The CPU an ``os.fork`` costs the process that calls it (its page tables and memory
    map copied, the child's pages marked shared): the child exits at once."""
    spent = []
    for _ in range(repeats):
        began = time.thread_time()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        spent.append(time.thread_time() - began)
        os.waitpid(pid, 0)
    return statistics.median(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--at", type=int, default=20, help="the item measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--populate", action="store_true",
                        help="also pair sessions of 300 items whose children break their "
                             "learned pages' sharing in one process_madvise call (about 2 "
                             "minutes)")
    args = parser.parse_args()
    if not 1 <= args.at < args.items:
        parser.error("--at must name an item that has a next one (1 to --items - 1)")
    absolute_pythonpath()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    in_pytest(args.items, args.at, args.rounds)
    fault_cost()
    if args.populate:
        populate_trial(300, args.at, 4)


if __name__ == "__main__":
    main()

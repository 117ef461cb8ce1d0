"""Which memory an item's two processes write: the copy-on-write faults, by where they land.

    python benchmarks/bench_pages.py [--items 40] [--at 20] [--rounds 3]

Each fork write-protects every writable page of the process that forks; after it, each page
either process writes costs one fault, a copy while the other still maps it. The
per-item rows of ``bench_isolation.py --pytest`` count those faults; this names where they
land. One pytest session per row (the bare fork floor, the lean fork, ``--gpu-cases``) in
a project with a ``pytest.ini``; at one item past the session's first ones (``--at``):

- **the pytest process**: a holder child is forked as the item starts and kept until it
  ends, so that every page the pytest process writes meanwhile is copied; the pages then
  mapped by that process alone (``/proc/self/pagemap``, bit 56) are the ones it wrote (or
  mapped anew) during the item;
- **the item's child**: read at its ``os._exit``, while its parent still lives: the pages
  it alone maps are the ones it wrote since its fork (or mapped anew).

A last row runs the item again with its child read at each step as well (at its run's
start, at gpucase's phase notes, at the run's end): the pages each step writes.

Each by the kind of mapping (the interpreter's static data, the C heap, anonymous memory:
Python's object arenas and torch's buffers, other libraries' data, the stack), with how
many of them lie in runs of at least ``RUN`` neighbouring pages. Then, in this process,
what a fault costs against breaking the same pages' sharing in one call
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+): whether batching could take a share of
the faults' cost, which depends on how the written pages lie.

The reading itself allocates a little (the lists of page numbers): a few pages of each
count are its own. Linux only (``/proc``).
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

from bench_isolation import LEAN_TEST  # noqa: E402  (this folder: the script's own)
from bench_scale import (  # noqa: E402
    BARE_FLOOR_TEST,
    absolute_pythonpath,
    pytest_seconds,
    write_cases,
    write_tests,
)

RUN = 8  # neighbouring pages that count as a run a single call could break at once
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23

# The measured item's two processes are read by a process of their own (``_reader``).
PAGES_CONFTEST = """
import ast
import os

RUN = {run}
AT = {at}
ROOT = {root!r}
ASK, ANSWER = os.path.join(ROOT, "pages_ask"), os.path.join(ROOT, "pages_answer")
_seen = {{"items": 0}}
_exit = os._exit


def _written(pid):
    \"\"\"Per kind of mapping: [pages ``pid`` alone maps, of them in runs >= RUN].\"\"\"
    found = {{}}
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
                if index != last + 1:
                    counts[1] += run if run >= RUN else 0
                    run = 0
                run += 1
                last = index
            counts[1] += run if run >= RUN else 0
    return found


def _reader():
    \"\"\"The reading process: reads the pagemap of whoever asks, so that no reading writes a
    page of the process read. A request: "pid label"; "pid =name" saves that pid's readings
    to ROOT/name.\"\"\"
    ask = os.open(ASK, os.O_RDWR)
    answer = os.open(ANSWER, os.O_RDWR)
    readings = {{}}
    pending = b""
    while True:
        data = os.read(ask, 4096)
        if not data:
            _exit(0)
        pending += data
        while b"\\n" in pending:
            line, _, pending = pending.partition(b"\\n")
            pid, _, label = line.decode().partition(" ")
            if label == "=stop":
                _exit(0)
            if label.startswith("="):
                with open(os.path.join(ROOT, label[1:]), "w") as handle:
                    handle.write(repr(readings.pop(pid, [])))
            else:
                try:
                    readings.setdefault(pid, []).append((label, _written(pid)))
                except OSError as exc:  # the session's error names it
                    readings.setdefault(pid, []).append((label, {{"error": str(exc)}}))
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
    ask = os.open(ASK, os.O_WRONLY)
    try:
        os.write(ask, f"{{os.getpid()}} {{label}}\\n".encode())
    finally:
        os.close(ask)


def request(label):
    \"\"\"Ask the reader to read this process now, and wait until it has (a few
    syscalls and small objects here: the reading's own pages are not this process's).\"\"\"
    tell(label)
    answer = os.open(ANSWER, os.O_RDONLY)
    try:
        os.read(answer, 1)
    finally:
        os.close(answer)


_start_reader()


def step(label):
    if _seen.get("measuring") and os.getpid() != _seen["parent"]:
        request(label)


def measured_exit(code):
    if _seen.get("measuring") and os.getpid() != _seen["parent"]:
        _seen["measuring"] = False
        try:
            request("the result sent, up to the exit")
            request("=pages_child")
        except OSError:
            pass
    _exit(code)


os._exit = measured_exit


def pytest_runtest_logstart(nodeid, location):
    _seen["items"] += 1
    if _seen["items"] != AT:
        return
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # keeps every page shared until the item ends
        os.close(write)
        os.read(read, 1)
        _exit(0)
    os.close(read)
    _seen.update(holder=(holder, write), measuring=True, parent=os.getpid())


def pytest_runtest_logfinish(nodeid, location):
    if "holder" not in _seen:
        return
    request("the item's end")
    request("=pages_parent")
    holder, write = _seen.pop("holder")
    _seen["measuring"] = False
    os.close(write)
    os.waitpid(holder, 0)


def pytest_unconfigure(config):
    tell("=stop")


# In a case item's child: the pages written by each of its steps, read at gpucase's own
# phase notes and around the run.
def _wrap_steps():
    from pytest_gpucase.run import child, judge, parent, reference_cache
    from pytest_gpucase.run.isolation import child as isolation

    # The readings' waits fall inside the reference's clock, and a run caches a reference
    # that took 5 ms or more: the plain item's reference, which takes less, is not cached.
    reference_cache.MIN_SECONDS = float("inf")
    run, child_note, judge_note = parent.run, child.note, judge.note
    contain = isolation._contain_self

    def first_line(*args, **kwargs):
        step("the fork, up to the child's first line")
        return contain(*args, **kwargs)

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

    isolation._contain_self = first_line
    parent.run = stepped_run
    child.note, judge.note = noted(child_note), noted(judge_note)


def pytest_configure(config):
    if os.environ.get("{steps_env}"):  # a session of case items, read step by step
        _wrap_steps()
"""
KINDS = ("anonymous", "C heap", "interpreter", "libraries", "stack", "other")


STEPS_ENV = "BENCH_PAGE_STEPS"  # read by the conftest: the item's child, step by step


def in_pytest(items: int, at: int, rounds: int) -> None:
    steps_env = {**os.environ, STEPS_ENV: "1"}
    rows: list[tuple[str, tuple[str, ...], dict[str, str] | None]] = [
        ("bare fork floor", ("bare",), None), ("lean fork", ("lean",), None),
        ("--gpu-cases (item)", ("--gpu-cases", "cases"), None),
        ("item, step by step", ("--gpu-cases", "cases"), steps_env)]
    found: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    steps: list[list[tuple[str, int]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cases(root, items, matrix='[matrix]\ndevices = ["cpu"]\n')
        write_tests(root, (("bare", BARE_FLOOR_TEST), ("lean", LEAN_TEST)), items)
        (root / "conftest.py").write_text(PAGES_CONFTEST.format(
            run=RUN, at=at, page=PAGE, root=str(root), steps_env=STEPS_ENV))
        (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")
        for _ in range(rounds):
            for name, args, env in rows:
                for side in ("pages_parent", "pages_child"):
                    (root / side).unlink(missing_ok=True)
                pytest_seconds(root, *args, env=env)
                # Each side's readings, in order: (label, {kind: [pages, in runs]}).
                parent, child = (ast.literal_eval((root / side).read_text())
                                 if (root / side).exists() else []
                                 for side in ("pages_parent", "pages_child"))
                problems = [kinds["error"] for _, kinds in [*parent, *child] if "error" in kinds]
                if not parent or not child or problems:
                    raise RuntimeError(
                        f"{name}: the item's pages were not read: "
                        f"{problems[0] if problems else 'no reading came back'} (the "
                        "reading process reads /proc/PID/pagemap of its parent and of "
                        "its sibling: a kernel.yama.ptrace_scope of 1 or more refuses it)")
                found.setdefault(name, []).append((parent[-1][1], child[-1][1]))
                if env is not None:
                    steps.append([(label, sum(counts[0] for counts in kinds.values()))
                                  for label, kinds in child])
    print(f"pages written during item {at} of {items} (medians of {rounds} sessions); "
          f"in brackets, those in runs of >= {RUN} neighbouring pages")
    print(f"{'what':<22}{'side':<8}{'all':>12}" + "".join(f"{kind:>16}" for kind in KINDS))
    for name, sessions in found.items():
        for index, side in enumerate(("pytest", "child")):
            cells = [_cell([session[index] for session in sessions], kind)
                     for kind in (None, *KINDS)]
            print(f"{name:<22}{side:<8}{cells[0]:>12}" + "".join(f"{c:>16}" for c in cells[1:]))
    print("\nthe item's child, step by step (pages written by each step, median; each "
          "named by where it ends)")
    before = [0] * len(steps)
    for index, (label, _) in enumerate(steps[0]):
        after = [found_steps[index][1] for found_steps in steps]
        spent = statistics.median(a - b for a, b in zip(after, before, strict=True))
        print(f"  {spent:6.0f}  {label}")
        before = after


def _cell(sides: list[dict[str, Any]], kind: str | None) -> str:
    """"pages (of them in runs)" of ``kind`` (None: all), the median over the sessions."""
    pages, in_runs = (statistics.median(sum(counts[part] for key, counts in found.items()
                                            if key in (KINDS if kind is None else (kind,)))
                                        for found in sides) for part in (0, 1))
    return f"{pages:.0f} ({in_runs:.0f})"


def fault_cost(pages: int = 1500, repeats: int = 30) -> None:
    """Per page written in a forked child: a copy-on-write fault each, against one
    ``madvise(MADV_POPULATE_WRITE)`` over all of them (neighbours), one call a page (pages
    apart, as the written pages mostly lie), a fault on memory the child mapped itself
    (nothing to copy: what a fault costs without its copy), and the writing loop alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    stride = 3
    area = mmap.mmap(-1, PAGE * pages * stride,
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, len(area), PAGE):
        area[offset] = 1  # present in this process before the forks
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))

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
                             ("a fault each, pages apart", stride, "faults"),
                             ("one madvise, neighbours", 1, "one call"),
                             ("a madvise a page, apart", stride, "a call a page"),
                             ("a fault each, mapped anew", 1, "fresh"),
                             ("no fault (written before)", 1, "again")):
        spent = statistics.median(child(step, how) for _ in range(repeats))
        print(f"  {label:<28}" + (f"{spent / pages * 1e6:8.2f}" if spent >= 0
                                  else "     n/a (MADV_POPULATE_WRITE refused)"))
    area.close()
    print(f"\nthe fork itself, in the process that forks (this one: torch imported), "
          f"{fork_cost(repeats) * 1e3:.2f} ms of its CPU (median of {repeats})")


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
    args = parser.parse_args()
    if not 1 <= args.at <= args.items:
        parser.error("--at must name one of the items (1 to --items)")
    absolute_pythonpath()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    in_pytest(args.items, args.at, args.rounds)
    fault_cost()


if __name__ == "__main__":
    main()

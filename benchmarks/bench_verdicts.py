"""How far the verdicts can be trusted: false alarms on correct code, detection of wrong code,
and what the new verdict path costs.

    python benchmarks/bench_verdicts.py rates [--seeds 20 | --quick] [--device cpu] [--only NAME]
    python benchmarks/bench_verdicts.py needs [--seeds 5]
    python benchmarks/bench_verdicts.py cost --baseline-src DIR [--rounds 5]
    python benchmarks/bench_verdicts.py persisted [--items 8] [--rounds 2] [--baseline-src DIR]
    python benchmarks/bench_verdicts.py autocast [--baseline-src DIR]
    python benchmarks/bench_verdicts.py looks [--seeds 3]

``looks``: what the second look costs where it triggers. For each correct row whose seed
needs its rounding budget, the child's verdict path in this process (no reference cache)
timed whole, and the budget's draws within it: the draws against the rest of the item
(the call, the reference, the comparisons), medians over seeds.

``autocast``: a nanoGPT-shaped model recorded by the Recorder under CPU bfloat16 autocast
(``tests/test_recorded_bf16_fix.py``'s), its captured failure fixed, replayed by pytest with
its logits scaled by 1 + k in bfloat16 only (an error the float32 reference does not
share): per k, the verdict, the logits' RMS error, the RMS error the budget allows and the
constant relative error it lets through (``rule_units``), for this package and the one in
``--baseline-src``.

``rates``: each op of the verdicts issue, in each dtype, over fixed seeds (the inputs are
drawn from ``torch.Generator().manual_seed(seed)``). A *correct* row is the op as users
write it, judged against its own float64 run (the default reference; ``gradients = true``
where the row says so): every failure is a false alarm. A *wrong* row is a deliberately
wrong variant judged against the correct op as an independent ``reference``: every pass is
a missed bug. Each seed is judged twice: *before*, as plain default tolerances judge it
(``torch.testing.assert_close`` of the run against the float64 run, gradients of the sum
of the outputs: what the plugin did before the verdicts issue), and *after*, written as a
case and judged by the child's own code (``run.child.run`` in this process: load, call,
reference, compare, second look, gradcheck; no reference cache). Printed as a Markdown
table with the number of seeds; ``--quick`` runs 3 seeds; ``--device cuda`` runs the same
cases on the GPU (and so also the CPU baseline rule).

``needs``: for the correct rows, the smallest rounding-budget multiplier each seed would
have needed (the greatest error, of the elements past the default tolerance, over the
leaf's greatest change in the draws; and the RMS error over the RMS change), which is what
``verdict.rounding.MULTIPLIER`` is chosen from.

``cost``: per item of the bundled cases (``cases/``, CPU), the child's whole verdict path
(call, reference, comparison, and whatever second look and gradcheck it asks for) against
the same with the package of ``--baseline-src`` (the code before the verdicts issue: the
call plus today's reference), each in its own process, interleaved rounds, medians; and
this package once more with a reference cache (filled by the first, unmeasured run), which
is what a second session pays.

``persisted``: second-look items (float32 matmuls of values ~1e3, bfloat16 layer norms of
1e3 + N(0, 1)) in three pytest sessions, as CI jobs meet them: the first job, on an empty
cache; a later job on a fresh checkout and a fresh home with the cache folder restored and
the key given (``GPUCASE_REFERENCE_KEY_FILE``); the same without the key. The median item's
duration from the JSON report, and the CPU seconds of the session and its children less
those of a session that runs no item (start-up, collection), each with its ratio to the
first job's; with ``--baseline-src``, the same sessions with that package too.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucase.base.torch_import import import_torch

torch = import_torch()

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Op:
    """A case of one op: its code (``run``; ``reference`` for wrong variants), its inputs."""

    name: str
    code: str
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    dtypes: tuple[str, ...]
    gradients: bool = False
    # Wrong variants: label -> the code of ``run`` replacing the correct one (same signature).
    wrong: tuple[tuple[str, str], ...] = ()


def uniform(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale


OPS = (
    Op("matmul 1024x1024, values ~1e3", """
        def run(a, b):
            return a @ b
        """, lambda g: {"a": uniform(g, 1024, 1024, scale=1e3), "b": uniform(g, 1024, 1024,
                                                                             scale=1e3)},
        ("float32",),
        wrong=(("1% scale", "return (a @ b) * 1.01"),
               ("off-by-one row", "return (a @ b).roll(1, 0)"))),
    Op("matmul 256x256, values ~1", """
        def run(a, b):
            return a @ b
        """, lambda g: {"a": uniform(g, 256, 256), "b": uniform(g, 256, 256)},
        ("bfloat16", "float16"),
        wrong=(("1% scale", "return (a @ b) * 1.01"),
               ("10% scale", "return (a @ b) * 1.1"),
               ("off-by-one row", "return (a @ b).roll(1, 0)"))),
    Op("layer_norm of 1e3 + N(0,1)", """
        import torch.nn.functional as F
        def run(x):
            return F.layer_norm(x, (x.shape[-1],))
        """, lambda g: {"x": 1e3 + torch.randn(64, 1024, generator=g, dtype=torch.float64)},
        ("float32",),
        wrong=(("one-pass variance", "m = x.mean(-1, keepdim=True)\n"
                "    v = (x * x).mean(-1, keepdim=True) - m * m\n"
                "    return (x - m) / (v + 1e-5).sqrt()"),
               ("1% scale", "return F.layer_norm(x, (x.shape[-1],)) * 1.01"))),
    Op("layer_norm two-pass, 1e3 + N(0,1)", """
        def run(x):
            mean = x.mean(-1, keepdim=True)
            centred = x - mean
            return centred / ((centred * centred).mean(-1, keepdim=True) + 1e-5).sqrt()
        """, lambda g: {"x": 1e3 + torch.randn(64, 1024, generator=g, dtype=torch.float64)},
        ("float32",)),
    Op("softmax, gradients", """
        import torch
        def run(x):
            return torch.softmax(x, -1)
        """, lambda g: {"x": 3 * torch.randn(64, 512, generator=g, dtype=torch.float64)},
        ("float32", "bfloat16", "float16"), gradients=True,
        wrong=(("wrong dim", "return torch.softmax(x, 0)"),
               ("detached normalizer (wrong gradient)",
                "return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True).detach()"))),
    Op("layer_norm affine, gradients", """
        import torch.nn.functional as F
        def run(x, weight, bias):
            return F.layer_norm(x, (x.shape[-1],), weight, bias)
        """, lambda g: {"x": torch.randn(64, 512, generator=g, dtype=torch.float64),
                        "weight": 1 + 0.1 * torch.randn(512, generator=g, dtype=torch.float64),
                        "bias": 0.1 * torch.randn(512, generator=g, dtype=torch.float64)},
        ("float32", "bfloat16", "float16"), gradients=True,
        wrong=(("dropped bias", "return F.layer_norm(x, (x.shape[-1],), weight)"),
               ("off-by-one row", "return F.layer_norm(x, (x.shape[-1],), weight, bias)"
                ".roll(1, 0)"))),
    Op("batch_norm training, 2 samples, gradients", """
        import torch.nn.functional as F
        def run(x, weight, bias):
            return F.batch_norm(x, None, None, weight, bias, training=True)
        """, lambda g: {"x": torch.randn(2, 64, generator=g, dtype=torch.float64),
                        "weight": 0.5 + torch.rand(64, generator=g, dtype=torch.float64),
                        "bias": torch.randn(64, generator=g, dtype=torch.float64)},
        ("float32", "bfloat16"), gradients=True,
        wrong=(("unbiased variance", "m = x.mean(0)\n"
                "    return (x - m) / (x.var(0) + 1e-5).sqrt() * weight + bias"),)),
    Op("causal attention, gradients", """
        import torch.nn.functional as F
        def run(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        """, lambda g: {n: torch.randn(2, 4, 128, 64, generator=g, dtype=torch.float64)
                        for n in "qkv"},
        ("float32", "bfloat16", "float16"), gradients=True,
        wrong=(("no 1/sqrt(d)", "return F.scaled_dot_product_attention(q, k, v, "
                "is_causal=True, scale=1.0)"),
               ("not causal", "return F.scaled_dot_product_attention(q, k, v)"))),
    Op("cross_entropy .item()", """
        import torch.nn.functional as F
        def run(logits, target):
            return F.cross_entropy(logits, target).item()
        """, lambda g: {"logits": torch.randn(64, 100, generator=g, dtype=torch.float64),
                        "target": torch.randint(0, 100, (64,), generator=g)},
        ("float32", "bfloat16", "float16"),
        wrong=(("5% scale", "return F.cross_entropy(logits, target).item() * 1.05"),
               ("label smoothing 0.1", "return F.cross_entropy(logits, target, "
                "label_smoothing=0.1).item()"))),
)


def write(root: Path, name: str, code: str, tensors: dict[str, torch.Tensor],
          dtype: str | torch.dtype, gradients: bool, reference: str | None) -> Path:
    """A case calling ``case.py:run``, with ``reference`` (a function of its case.py) as its
    independent reference where named; also bench_opinfo.py's."""
    from pytest_gpucase.case import payload

    path = root / name
    path.mkdir(parents=True)
    toml = 'format = 1\ncall = "case.py:run"\ntimeout = 600\n'
    if reference:
        toml += f'reference = "case.py:{reference}"\n'
    if gradients:
        toml += "[expect]\ngradients = true\n"
    (path / "case.toml").write_text(toml)
    (path / "case.py").write_text(code)
    # Saved in the run's dtype, as a case holds what the failing run saw.
    saved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    payload.save(path / "inputs.safetensors",
                 {k: v.to(saved) if v.is_floating_point() else v for k, v in tensors.items()})
    return path


def judge(path: Path, device: str, dtype: str) -> tuple[bool, float]:
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.child import run

    for name in [m for m in sys.modules if m.startswith("gpucase_case_")]:
        del sys.modules[name]
    began = time.perf_counter()
    outcome = run(RunSpec(load_case(path), device, dtype, cast=False))
    if outcome.kind == "broken case" or outcome.status == "skipped":
        raise RuntimeError(f"{path}: {outcome.summary}\n{outcome.details}")
    return outcome.status == "passed", time.perf_counter() - began


def _old_call(func: Callable[..., object], inputs: dict[str, torch.Tensor],
              gradients: bool) -> dict[str, object]:
    """The call as the plugin made it before: gradients of the sum of the float outputs."""
    if not gradients:
        out = func(**inputs)
        return {"out": out.detach() if isinstance(out, torch.Tensor) else out}
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()
              if v.is_floating_point()}
    out = func(**{**inputs, **leaves})
    assert isinstance(out, torch.Tensor)
    grads = torch.autograd.grad(out.float().sum(), list(leaves.values()), allow_unused=True)
    return {"out": out.detach(), "grad": dict(zip(leaves, grads, strict=True))}


def before(code: str, tensors: dict[str, torch.Tensor], dtype: str, gradients: bool) -> bool:
    """Whether plain default tolerances pass the run: ``assert_close`` of the call in
    ``dtype`` against the reference (``reference``, else the call) in float64 on the same
    (rounded) inputs."""
    namespace: dict[str, object] = {}
    exec(code, namespace)
    func = namespace["run"]
    reference = namespace.get("reference", func)
    assert callable(func) and callable(reference)
    precision = getattr(torch, dtype)
    inputs = {k: v.to(precision) if v.is_floating_point() else v for k, v in tensors.items()}
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    actual = _old_call(func, inputs, gradients)
    expected = _old_call(reference, wide, gradients)
    try:
        torch.testing.assert_close(actual, expected, check_dtype=False)
    except AssertionError:
        return False
    return True


def wrong_code(op: Op, body: str) -> str:
    """The op's correct ``run`` as ``reference``, and ``run`` replaced by the wrong body."""
    correct = textwrap.dedent(op.code)
    signature = correct.split("def run(", 1)[1].split(")", 1)[0]
    return (correct.replace("def run(", "def reference(") + f"\ndef run({signature}):\n    "
            + body + "\n")


def rates(seeds: int, device: str, only: str | None) -> None:
    if device != "cpu" and not getattr(torch, device.split(":")[0]).is_available():
        print(f"skipped: no {device} device here")
        return
    rows = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for op in OPS:
            if only and only not in op.name:
                continue
            variants = [("correct", textwrap.dedent(op.code), False)]
            variants += [(label, wrong_code(op, body), True) for label, body in op.wrong]
            for dtype in op.dtypes:
                for label, code, reference in variants:
                    passed_before = passed_after = 0
                    seconds = 0.0
                    for seed in range(seeds):
                        tensors = op.inputs(torch.Generator().manual_seed(seed))
                        passed_before += before(code, tensors, dtype, op.gradients)
                        path = write(root, f"{len(rows)}_{seed}", code, tensors, dtype,
                                     op.gradients, "reference" if reference else None)
                        ok, took = judge(path, device, dtype)
                        passed_after += ok
                        seconds += took
                    rows.append((op.name, dtype, label, passed_before, passed_after, seeds,
                                 seconds / seeds))
                    print(f"  {op.name} | {dtype} | {label}: passed {passed_before}/{seeds} "
                          f"before, {passed_after}/{seeds} after", file=sys.stderr, flush=True)
    print(f"\n{seeds} seeds per row, device {device}, torch {torch.__version__}, "
          f"{time.perf_counter() - began:.0f} s in all, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| op | dtype | variant | seeds | before: default tolerances | after: verdict | "
          "s per item |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, dtype, label, ok_before, ok_after, total, seconds in rows:
        if label == "correct":
            counts = (f"{total - ok_before} false alarms", f"{total - ok_after} false alarms")
        else:
            counts = (f"{ok_before} missed", f"{ok_after} missed")
        print(f"| {name} | {dtype} | {label} | {total} | {counts[0]} | {counts[1]} | "
              f"{seconds:.2f} |")


def needs(seeds: int) -> None:
    """The multiplier each correct row would have needed, the greatest over seeds and leaves:
    of (|error| - default rtol * |expected|) / greatest spread over the elements past the
    default tolerance, and of (RMS error - one rounding of the RMS size) / RMS spread."""

    from pytest_gpucase.run import second_look
    from pytest_gpucase.run.calls import call, upcast
    from pytest_gpucase.verdict.rounding import coarser, unit_roundoff
    from pytest_gpucase.verdict.tolerance import DEFAULT_TOLERANCES

    print("| op | dtype | seeds | greatest need (element) | greatest need (RMS) |")
    print("|---|---|---:|---:|---:|")
    for op in OPS:
        namespace: dict[str, object] = {}
        exec(textwrap.dedent(op.code), namespace)
        func = namespace["run"]
        for dtype in op.dtypes:
            precision = getattr(torch, dtype)
            u = unit_roundoff(precision)
            worst_max = worst_rms = 0.0
            for seed in range(seeds):
                tensors = op.inputs(torch.Generator().manual_seed(seed))
                inputs = {k: v.to(precision) if v.is_floating_point() else v
                          for k, v in tensors.items()}
                cotangents: dict[str, torch.Tensor] = {}
                actual = call(func, inputs, op.gradients, "cpu", cotangents,  # type: ignore[arg-type]
                              precision)
                reference_inputs = upcast(inputs)

                def reference(values: object, cots: object, func: object = func,
                              gradients: bool = op.gradients) -> dict[str, object]:
                    return call(func, values, gradients, "cpu", dict(cots))  # type: ignore[arg-type]

                expected = reference(reference_inputs, cotangents)
                spreads = second_look.spreads_of(expected, second_look.drawn(
                    reference, lambda made=reference_inputs: made, cotangents, precision))
                found = second_look.leaves_of(actual)
                for path, value in second_look.leaves_of(expected).items():
                    a = torch.as_tensor(found[path]).double()
                    e = torch.as_tensor(value).double()
                    error = (a - e).abs()
                    greatest, rms = spreads[path]
                    # Only where the default tolerance does not already accept the element.
                    tol = DEFAULT_TOLERANCES[coarser(a.dtype if a.dtype != torch.float64
                                                     else precision, precision)]
                    past = error > tol.atol + tol.rtol * e.abs()
                    if bool(past.any()) and greatest > 0:
                        # The budget widens atol and keeps rtol: what atol had to cover.
                        beyond = error - tol.rtol * e.abs()
                        worst_max = max(worst_max, float(beyond[past].max()) / greatest)
                    extra = u * float(e.square().mean().sqrt())
                    over = max(float(error.square().mean().sqrt()) - extra, 0.0)
                    worst_rms = max(worst_rms, over / rms if rms else 0.0)
            print(f"| {op.name} | {dtype} | {seeds} | {worst_max:.3g} | {worst_rms:.3g} |")


_TIMING = r"""
import json, os, shutil, sys, time, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec, expand, saved_dtype
from pytest_gpucase.plan.environment import Environment
from pytest_gpucase.run.child import run
cached = sys.argv[1] == "cached"
if cached:
    from pytest_gpucase.run.reference_cache import prime, session_cache
    cache = session_cache()
    os.environ.update(cache.env())
env = Environment(backend="cpu", device_types=("cpu",), torch=torch.__version__)
out = {}
for path in sys.argv[2:]:
    case = load_case(path)
    compute = getattr(case.context, "compute_dtype", None)
    saved = None if case.matrix.dtypes else (compute or saved_dtype(case))
    for spec in expand(case, env, saved_dtype=saved, devices=("cpu",)):
        if spec.skip:
            continue
        run(spec)  # warm: imports, first-touch (and, cached, the entries)
        if cached:
            prime()  # what is loaded now is what a forked child would inherit
        samples = []
        for _ in range(5):
            began = time.perf_counter()
            run(spec)
            samples.append(time.perf_counter() - began)
        samples.sort()
        out[f"{case.name}[{spec.id}]"] = samples[len(samples) // 2]
if cached:
    shutil.rmtree(cache.temporary)
print(json.dumps(out))
"""

# What each column runs: the package, and whether its runs use a reference cache.
_COLUMNS = (("old", "baseline", False), ("new", "this", False), ("cached", "this", True))


def cost(baseline_src: Path, rounds: int) -> None:
    """The child's verdict path on the bundled cases, this package against ``baseline_src``;
    and this package again with a reference cache the first run filled."""
    cases = sorted(str(p.parent) for p in (ROOT / "cases").glob("*/case.toml"))
    results: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in _COLUMNS}
    loads = []
    for round_ in range(rounds):
        loads.append(os.getloadavg()[0])
        order = _COLUMNS if round_ % 2 == 0 else _COLUMNS[::-1]
        for name, package, cached in order:
            src = baseline_src if package == "baseline" else ROOT
            env = {key: value for key, value in os.environ.items()
                   if not key.startswith("GPUCASE_REFERENCE")}
            env["PYTHONPATH"] = str(src)
            done = subprocess.run([sys.executable, "-c", _TIMING,
                                   "cached" if cached else "fresh", *cases],
                                  env=env, cwd=src, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            for item, seconds in json.loads(done.stdout.splitlines()[-1]).items():
                results[name].setdefault(item, []).append(seconds)
    loads.append(os.getloadavg()[0])
    print(f"\n{rounds} interleaved rounds, median of 5 runs each, load average "
          f"{min(loads):.2f}-{max(loads):.2f}\n")
    print("| bundled item (CPU) | before: call + reference, ms | now, ms | x before "
          "| now, cached reference, ms | x before |")
    print("|---|---:|---:|---:|---:|---:|")
    totals = dict.fromkeys(results, 0.0)
    for item in sorted(results["new"]):
        row = {name: statistics.median(results[name].get(item, [float("nan")]))
               for name in results}
        for name, value in row.items():
            totals[name] += value
        print(f"| {item} | {row['old'] * 1e3:.2f} | {row['new'] * 1e3:.2f} | "
              f"{row['new'] / row['old']:.2f} | {row['cached'] * 1e3:.2f} | "
              f"{row['cached'] / row['old']:.2f} |")
    print(f"| all items | {totals['old'] * 1e3:.1f} | {totals['new'] * 1e3:.1f} | "
          f"{totals['new'] / totals['old']:.2f} | {totals['cached'] * 1e3:.1f} | "
          f"{totals['cached'] / totals['old']:.2f} |")


_PERSISTED_CASES = {
    # A float32 matmul of values ~1e3: off the float64 result by more than atol, correctly.
    "matmul": ("import torch\ndef run(a, b):\n    return a @ b\n", "float32",
               lambda g: {"a": torch.randn(128, 1024, generator=g, dtype=torch.float64) * 1e3,
                          "b": torch.randn(1024, 128, generator=g, dtype=torch.float64) * 1e3}),
    # A bfloat16 layer norm of 1e3 + N(0, 1): one rounding of an input moves its output.
    "layer_norm": ("import torch\ndef run(x):\n    return torch.nn.functional.layer_norm("
                   "x, x.shape[-1:])\n", "bfloat16",
                   lambda g: {"x": 1e3 + torch.randn(128, 1024, generator=g,
                                                     dtype=torch.float64)}),
}


def _session(project: Path, src: Path, home: Path, key_file: Path | None,
             *extra: str) -> tuple[dict[str, float], float]:
    """One pytest session over ``project``'s cases, with ``home`` as a fresh home and
    ``key_file`` as GPUCASE_REFERENCE_KEY_FILE (None: the fresh home's own new key): each
    passed item's duration from its JSON report, and the CPU seconds of the session and its
    children (user + system)."""
    import resource
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("GPUCASE_", "XDG_"))}
    env.update(PYTHONPATH=str(src), HOME=str(home))
    if key_file is not None:
        env["GPUCASE_REFERENCE_KEY_FILE"] = str(key_file)
    report = project / "report.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-q",
                           "--gpu-cases", "--gpu-devices", "cpu", "--gpu-cases-report",
                           str(report), *extra, "cases"], env=env, cwd=project,
                          capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 5) if extra else done.returncode:
        raise SystemExit(f"a session failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    if not report.exists():
        return {}, cpu
    results = json.loads(report.read_text())["results"]
    report.unlink()
    return {r["case"]: r["duration"] for r in results if r["outcome"] == "passed"}, cpu


def persisted(items: int, baseline_src: Path | None, rounds: int) -> None:
    """Second-look items in three sessions, as CI jobs meet them: the first job (an empty
    cache); a later job on a fresh checkout (every file new) and a fresh home, with the cache
    folder restored and the key given (GPUCASE_REFERENCE_KEY_FILE); the same without the key
    (the fresh home's new key: nothing trusted)."""
    import shutil

    from pytest_gpucase.case import payload

    root = Path(tempfile.mkdtemp(prefix="gpucase-persisted-"))
    first = root / "job1"
    for index in range(items):
        name = sorted(_PERSISTED_CASES)[index % len(_PERSISTED_CASES)]
        code, dtype, make = _PERSISTED_CASES[name]
        path = first / "cases" / f"{name}{index}"
        path.mkdir(parents=True)
        (path / "case.toml").write_text(f'format = 1\ncall = "case.py:run"\n'
                                        f'[matrix]\ndtypes = ["{dtype}"]\n')
        (path / "case.py").write_text(code)
        tensors = make(torch.Generator().manual_seed(index))
        payload.save(path / "inputs.safetensors",
                     {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()})
    (first / "pytest.ini").write_text("[pytest]\n")
    sources = [("this", ROOT)] + ([("base", baseline_src)] if baseline_src else [])
    sessions = ("first job: empty cache", "same checkout again: all kept",
                "fresh checkout + home, cache restored, same key",
                "fresh checkout + home, cache restored, no key")
    found: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], int] = {}
    loads = [os.getloadavg()[0]]
    for round_ in range(rounds):
        for label, src in sources if round_ % 2 == 0 else sources[::-1]:
            tag = f"{label}{round_}"
            project = root / f"{tag}-job1"
            shutil.copytree(first, project)
            secrets = root / f"{tag}-secrets"
            secrets.mkdir(mode=0o700)
            key = secrets / "key"
            key.write_text(os.urandom(32).hex() + "\n")
            key.chmod(0o600)
            # What a session costs with no item run (start-up, collection): taken off its CPU.
            empty = root / f"{tag}-home-empty"
            empty.mkdir()
            _, startup = _session(project, src, empty, key, "-k", "no_such_item")
            for number, what in enumerate(sessions):
                where = project
                if number >= 2:  # a fresh checkout: the cases copied anew, the cache restored
                    where = root / f"{tag}-job{number + 1}"
                    shutil.copytree(first, where)
                    shutil.copytree(project / ".pytest_cache" / "d" / "gpucase-references",
                                    where / ".pytest_cache" / "d" / "gpucase-references")
                home = root / f"{tag}-home{number}"
                home.mkdir()
                durations, cpu = _session(where, src, home, key if number < 3 else None)
                found.setdefault((label, what), []).append(
                    statistics.median(durations.values()))
                cpus.setdefault((label, what), []).append(max(cpu - startup, 0.0))
                counts[label, what] = len(durations)
            loads.append(os.getloadavg()[0])
    print(f"\n{items} second-look items, {rounds} rounds (medians), load average "
          f"{min(loads):.2f}-{max(loads):.2f}\n")
    print("| package | session | items passed | median item, s | x first job "
          "| CPU of the items, s | x first job |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, _ in sources:
        cold = statistics.median(found[label, sessions[0]])
        cold_cpu = statistics.median(cpus[label, sessions[0]])
        for what in sessions:
            median = statistics.median(found[label, what])
            cpu = statistics.median(cpus[label, what])
            print(f"| {label} | {what} | {counts[label, what]} | {median:.3f} | "
                  f"{median / cold:.2f} | {cpu:.2f} | {cpu / cold_cpu:.2f} |")
    shutil.rmtree(root, ignore_errors=True)


def autocast(baseline_src: Path | None) -> None:
    import shutil

    here = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(here))
    from tests.test_recorded_bf16_fix import TRAIN, source

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "p"
        project.mkdir()
        (project / "pytest.ini").write_text("[pytest]\n")
        (project / "model.py").write_text(source(shape_bug=True))
        (project / "train.py").write_text(textwrap.dedent(TRAIN))
        env = {**os.environ, "PYTHONPATH": str(here)}
        subprocess.run([sys.executable, "train.py"], cwd=project, env=env,
                       capture_output=True, check=False)
        toml = project / "cases" / "GPT" / "case.toml"
        toml.write_text("".join(line for line in toml.read_text().splitlines(keepends=True)
                                if not line.startswith("xfail = ")))
        print("| package | logits x | verdict | RMS error | RMS allowed | ratio | "
              "rule_units |")
        print("|---|---|---|---:|---:|---:|---:|")
        for name, src in (("this", here), ("base", baseline_src)):
            if src is None:
                continue
            for k in (None, 1.02, 1.03, 1.05, 1.1, 1.25):
                (project / "model.py").write_text(source(wrong=k))
                shutil.rmtree(project / ".pytest_cache", ignore_errors=True)
                report = project / "report.json"
                subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-q",
                                "--gpu-cases", "cases/GPT", "--gpu-devices", "cpu",
                                "--gpu-cases-report", str(report)], cwd=project,
                               env={**env, "PYTHONPATH": str(src)}, capture_output=True,
                               check=False)
                result = json.loads(report.read_text())["results"][0]
                budget = (result.get("budgets") or [{}])[0]
                print(f"| {name} | {k or 'correct'} | {result['outcome']} | "
                      f"{budget.get('rms_error', 0):.4f} | {budget.get('rms_allowed', 0):.4f} | "
                      f"{budget.get('ratio', 0):.2f} | {budget.get('rule_units', 0):.1f} |")


def looks(seeds: int) -> None:
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run import second_look
    from pytest_gpucase.run.child import run

    drawn = second_look.drawn
    spent: list[float] = []

    def timed(*args: object, **kwargs: object) -> Callable[[int], object]:
        inner = drawn(*args, **kwargs)  # type: ignore[arg-type]

        def one(seed: int) -> object:
            began = time.perf_counter()
            try:
                return inner(seed)
            finally:
                spent.append(time.perf_counter() - began)
        return one

    second_look.drawn = timed  # type: ignore[assignment]
    print("| op | dtype | seeds with a budget | item, ms | draws, ms | draws / rest |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for op in OPS:
            for dtype in op.dtypes:
                totals, draws = [], []
                for seed in range(seeds):
                    tensors = op.inputs(torch.Generator().manual_seed(seed))
                    path = write(Path(tmp), f"{len(os.listdir(tmp))}", textwrap.dedent(op.code),
                                 tensors, dtype, op.gradients, None)
                    spec = RunSpec(load_case(path), "cpu", dtype, cast=False)
                    run(spec)  # imports and first touches
                    for name in [m for m in sys.modules if m.startswith("gpucase_case_")]:
                        del sys.modules[name]
                    spent.clear()
                    began = time.perf_counter()
                    run(spec)
                    total = time.perf_counter() - began
                    if spent:
                        totals.append(total)
                        draws.append(sum(spent))
                if totals:
                    item, look = statistics.median(totals), statistics.median(draws)
                    print(f"| {op.name} | {dtype} | {len(totals)} | {item * 1e3:.1f} | "
                          f"{look * 1e3:.1f} | {look / max(item - look, 1e-9):.2f} |")
    second_look.drawn = drawn  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rates")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="3 seeds per row (a few minutes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", help="only the ops whose name holds this text")
    p = sub.add_parser("needs")
    p.add_argument("--seeds", type=int, default=5)
    p = sub.add_parser("cost")
    p.add_argument("--baseline-src", type=Path, required=True,
                   help="a checkout of the package before this work (git archive, worktree)")
    p.add_argument("--rounds", type=int, default=5)
    p = sub.add_parser("persisted")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline-src", type=Path,
                   help="a checkout of the package before the budget was named by content")
    p = sub.add_parser("looks")
    p.add_argument("--seeds", type=int, default=3)
    p = sub.add_parser("autocast")
    p.add_argument("--baseline-src", type=Path,
                   help="a checkout of the package before this work")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.command == "rates":
        rates(3 if args.quick else args.seeds, args.device, args.only)
    elif args.command == "needs":
        needs(args.seeds)
    elif args.command == "persisted":
        persisted(args.items, args.baseline_src.resolve() if args.baseline_src else None,
                  args.rounds)
    elif args.command == "looks":
        looks(args.seeds)
    elif args.command == "autocast":
        autocast(args.baseline_src.resolve() if args.baseline_src else None)
    else:
        cost(args.baseline_src.resolve(), args.rounds)


if __name__ == "__main__":
    main()

"""The verdicts on a corpus nobody here wrote: PyTorch's own OpInfo sample inputs, with
mutants of known error size, beside ``torch.testing.assert_close`` on the same outputs.

    python benchmarks/bench_opinfo.py [--ops softmax,prod,...] [--dtypes float32,bfloat16]
                                      [--samples 2] [--mutants scale8,scale64,...]
                                      [--baseline-src DIR] [--json FILE]

Needs ``expecttest`` importable (``torch.testing._internal`` imports it): ``pip install
--target DIR expecttest`` and put DIR on PYTHONPATH.

Each item is one OpInfo sample (``op.sample_inputs("cpu", dtype)``, the first
``--samples`` of each op whose inputs are tensors, numbers, tuples and dtypes) written as a
case (``case.toml``, ``case.py``, ``inputs.safetensors`` saved in the run's dtype) and
judged in this process by the child's own code (``run.child.run``: call, reference,
comparison, second look, gradcheck; no reference cache). Variants:

- ``correct``: the op as written, against its own float64 run (the default reference):
  every failure is a false alarm. ``correct+grad`` the same with ``gradients = true``.
- ``scaleK``: the output times ``1 + K eps(dtype)``, against the correct op named as an
  independent reference. K in 1, 8, 64 (``eps`` the dtype's machine epsilon, 2 units of
  roundoff): K = 64 is a constant relative error of 128 u, a bug; K = 1 is rounding.
- ``element``: the largest-magnitude element of the output off by 10% of the output's RMS.
- ``bwdP``: a custom ``torch.autograd.Function`` whose backward is the op's own times
  ``1 + P/100`` (P in 1, 10), judged with ``gradients = true`` and the default reference
  (so only the gradient check can see it); ``bwdP+ref`` against the correct op named as an
  independent reference.

The baseline column is ``torch.testing.assert_close(actual, expected, check_dtype=False)``
with its default tolerances, the run's output against the correct op in float64 on the same
rounded inputs (gradients along the same cotangents), in the same process.
``--baseline-src DIR`` judges the same items again with the package of another checkout
(a subprocess per dtype), for before/after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# A few dozen ops across the families the verdicts meet: pointwise, reductions, matmul,
# normalizations, softmax, convolutions, pooling, losses, cumulative.
DEFAULT_OPS = (
    "exp,tanh,sigmoid,log,sqrt,rsqrt,sin,mul,div,addcmul,pow,"
    "sum,mean,prod,amax,std,var,logsumexp,norm,"
    "mm,matmul,addmm,baddbmm,linalg.vector_norm,"
    "softmax,log_softmax,nn.functional.layer_norm,nn.functional.rms_norm,"
    "nn.functional.normalize,nn.functional.silu,nn.functional.gelu,"
    "nn.functional.conv1d,nn.functional.linear,nn.functional.avg_pool2d,"
    "nn.functional.cross_entropy,nn.functional.mse_loss,nn.functional.kl_div,"
    "cumsum,cumprod")
DEFAULT_MUTANTS = "correct,scale1,scale8,scale64,element,correct+grad,bwd1,bwd10,bwd1+ref"
NAMESPACES = ("torch", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft")


def resolve(op: object) -> str | None:
    """A dotted path that imports ``op.op`` in a child (``torch.nn.functional.softmax``)."""
    target = getattr(op, "op", None)
    name = getattr(op, "name", "")
    for namespace in NAMESPACES:
        short = name.removeprefix("nn.functional.").removeprefix("linalg.").removeprefix(
            "special.").removeprefix("fft.")
        module = eval(namespace, {"torch": torch})
        if getattr(module, short, None) is target and target is not None:
            return f"{namespace}.{short}"
    return None


def literal(value: object) -> str | None:
    """A Python expression for an argument, or None when it cannot be written as one."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        parts = [literal(v) for v in value]
        if any(p is None for p in parts):
            return None
        inner = ", ".join(parts)  # type: ignore[arg-type]
        return f"({inner},)" if isinstance(value, tuple) else f"[{inner}]"
    return None


def case_of(sample: object) -> tuple[dict[str, torch.Tensor], str] | None:
    """The sample's tensors by name and the call's argument list as source, or None."""
    tensors: dict[str, torch.Tensor] = {}

    def arg(value: object) -> str | None:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_complex():
                return None
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().clone()
            return name
        return literal(value)

    parts = [arg(sample.input)]  # type: ignore[attr-defined]
    parts += [arg(a) for a in sample.args]  # type: ignore[attr-defined]
    parts += [None if (v := arg(val)) is None else f"{key}={v}"
              for key, val in sample.kwargs.items()]  # type: ignore[attr-defined]
    if any(p is None for p in parts) or not tensors:
        return None
    return tensors, ", ".join(parts)  # type: ignore[arg-type]


CODE = '''
import torch
from {target_module} import {target_name} as op

EPS = {eps!r}


def correct({params}):
    return op({args})


class _Wrong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return correct(*tensors)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():  # the op's own backward, recomputed, then scaled
            leaves = [t.detach().requires_grad_(t.is_floating_point())
                      for t in ctx.saved_tensors]
            out = correct(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True,
                                             create_graph=torch.is_grad_enabled()))
        return tuple(((g * {factor!r}) if (g := next(found)) is not None else None)
                     if t.requires_grad else None for t in leaves)


def run({params}):
    {body}
'''

BODIES = {
    "correct": "return correct({params})",
    "scale": "return correct({params}) * (1 + {k} * EPS)",
    "element": ("out = correct({params}).clone()\n    flat = out.view(-1)\n"
                "    i = int(flat.double().abs().argmax())\n"
                "    flat[i] += 0.1 * float(out.double().square().mean().sqrt()) + 0.1 * EPS\n"
                "    return out"),
    "bwd": "return _Wrong.apply({params})",
}


def mutant_parts(mutant: str) -> tuple[str, float, bool, bool]:
    """The body key, its size, whether gradients are compared, whether a reference is named."""
    named = mutant.endswith("+ref")
    base = mutant.removesuffix("+ref")
    if base in ("correct", "correct+grad"):
        return "correct", 0.0, base == "correct+grad", named
    if base.startswith("scale"):
        return "scale", float(base[5:]), False, True
    if base == "element":
        return "element", 0.0, False, True
    if base.startswith("bwd"):
        return "bwd", float(base[3:]), True, named
    raise SystemExit(f"unknown mutant {mutant!r}")


def write(root: Path, name: str, target: str, tensors: dict[str, torch.Tensor], args: str,
          dtype: torch.dtype, mutant: str) -> Path:
    from bench_verdicts import write as write_case  # this folder: the case writer they share

    body_key, size, gradients, named = mutant_parts(mutant)
    params = ", ".join(tensors)
    module, _, attr = target.rpartition(".")
    body = BODIES[body_key].format(params=params, k=size)
    factor = 1 + size / 100 if body_key == "bwd" else 1.0
    code = CODE.format(target_module=module, target_name=attr, eps=torch.finfo(dtype).eps,
                       params=params, args=args, body=body, factor=factor)
    return write_case(root, name, code, tensors, dtype, gradients,
                      "correct" if named else None)


def baseline_passes(path: Path, dtype: torch.dtype, gradients: bool) -> bool:
    """``assert_close`` with default tolerances: the run against the correct op in float64
    on the same inputs (gradients along the cotangents the plugin draws)."""
    from pytest_gpucase.case import payload
    from pytest_gpucase.run.second_look import cotangent

    namespace: dict[str, object] = {}
    exec((path / "case.py").read_text(), namespace)
    run, correct = namespace["run"], namespace["correct"]
    saved = payload.load(path / "inputs.safetensors")

    def outputs(func: object, wide: bool) -> list[torch.Tensor]:
        inputs = {k: (v.double() if wide and v.is_floating_point() else v.clone())
                  for k, v in saved.items()}
        if gradients:
            inputs = {k: v.requires_grad_() if v.is_floating_point() else v
                      for k, v in inputs.items()}
        out = func(**inputs)  # type: ignore[operator]
        found = [out.detach()]
        if gradients:
            cot = cotangent("out", out, dtype).to(out.dtype)
            leaves = [v for v in inputs.values() if v.requires_grad]
            grads = torch.autograd.grad(out, leaves, cot, allow_unused=True)
            found += [g if g is not None else torch.zeros_like(v)
                      for g, v in zip(grads, leaves, strict=True)]
        return found

    try:
        torch.testing.assert_close(outputs(run, False), outputs(correct, True),
                                   check_dtype=False)
    except AssertionError:
        return False
    return True


def judge(path: Path, dtype: torch.dtype) -> tuple[str, float, str]:
    """This package's verdict: passed / failed / broken, seconds, and the summary."""
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.plan.runs import RunSpec
    from pytest_gpucase.run.child import run

    for name in [m for m in sys.modules if m.startswith("gpucase_case_")]:
        del sys.modules[name]
    began = time.perf_counter()
    outcome = run(RunSpec(load_case(path), "cpu", str(dtype).removeprefix("torch."),
                          cast=False))
    took = time.perf_counter() - began
    status = outcome.status if outcome.kind != "broken case" else "broken"
    return status, took, outcome.summary


def corpus(ops: list[str], dtypes: list[torch.dtype], samples: int,
           mutants: list[str]) -> list[dict[str, object]]:
    """The items: one per op, dtype, sample and mutant (``write``'s inputs)."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(ops)
    items: list[dict[str, object]] = []
    for op in op_db:
        if op.name not in wanted or op.variant_test_name:
            continue
        target = resolve(op)
        if target is None:
            print(f"  skipped {op.name}: not reachable by name", file=sys.stderr)
            continue
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            taken = 0
            for sample in op.sample_inputs("cpu", dtype, requires_grad=False):
                if taken >= samples:
                    break
                found = case_of(sample)
                if found is None:
                    continue
                tensors, args = found
                try:  # the sample must run, give one floating tensor, differentiate if asked
                    out = eval(f"{target}({args})", {"torch": torch, **tensors})
                except Exception:
                    continue
                if not (isinstance(out, torch.Tensor) and out.is_floating_point()
                        and out.numel() > 0):
                    continue
                taken += 1
                for mutant in mutants:
                    _, _, gradients, _ = mutant_parts(mutant)
                    if gradients and not (op.supports_autograd and any(
                            t.is_floating_point() for t in tensors.values())):
                        continue
                    items.append({"op": op.name, "target": target, "tensors": tensors,
                                  "args": args, "dtype": dtype, "mutant": mutant,
                                  "sample": taken - 1})
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=DEFAULT_OPS)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--samples", type=int, default=2, help="samples per op and dtype")
    parser.add_argument("--mutants", default=DEFAULT_MUTANTS)
    parser.add_argument("--json", type=Path, help="write each item's verdicts here")
    parser.add_argument("--show", default="", help="print the summary of items whose "
                        "op:dtype:mutant holds this text")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    began = time.perf_counter()
    items = corpus(args.ops.split(","), dtypes, args.samples, args.mutants.split(","))
    print(f"{len(items)} items", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, item in enumerate(items):
            dtype = item["dtype"]
            assert isinstance(dtype, torch.dtype)
            path = write(Path(tmp), str(n), str(item["target"]), item["tensors"],  # type: ignore[arg-type]
                         str(item["args"]), dtype, str(item["mutant"]))
            _, _, gradients, _ = mutant_parts(str(item["mutant"]))
            status, took, summary = judge(path, dtype)
            try:
                base = baseline_passes(path, dtype, gradients)
            except Exception:
                base = None
            row = {"op": item["op"], "dtype": str(dtype).removeprefix("torch."),
                   "mutant": item["mutant"], "sample": item["sample"], "status": status,
                   "seconds": took, "assert_close": base, "summary": summary}
            rows.append(row)
            label = f"{row['op']}:{row['dtype']}:{row['mutant']}"
            if args.show and args.show in label:
                print(f"  {label}#{row['sample']}: {status} ({took:.2f} s) {summary[:300]}",
                      file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    table(rows, time.perf_counter() - began, args)


def table(rows: list[dict[str, object]], seconds: float, args: argparse.Namespace) -> None:
    print(f"\n{len(rows)} items, {seconds:.0f} s, torch {torch.__version__}, "
          f"samples/op {args.samples}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| variant | dtype | items | verdict: false alarms / misses | assert_close | "
          "broken | median s | max s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    groups: dict[tuple[str, str], list[dict[str, object]]] = defaultdict(list)
    for row in rows:
        groups[(str(row["mutant"]), str(row["dtype"]))].append(row)
    for (mutant, dtype), found in groups.items():
        correct = mutant.startswith("correct")
        bad = "failed" if correct else "passed"
        ours = sum(r["status"] == bad for r in found)
        theirs = sum(r["assert_close"] is (not correct) for r in found)
        broken = sum(r["status"] == "broken" for r in found)
        times = sorted(float(r["seconds"]) for r in found)  # type: ignore[arg-type]
        word = "false alarms" if correct else "missed"
        print(f"| {mutant} | {dtype} | {len(found)} | {ours} {word} | {theirs} | {broken} | "
              f"{times[len(times) // 2]:.2f} | {times[-1]:.2f} |")
    wrong = [r for r in rows if (r["status"] == "failed") == str(r["mutant"]).startswith(
        "correct") and r["status"] != "broken"]
    if wrong:
        print("\nfalse alarms and misses:")
        for r in wrong:
            print(f"- {r['op']} {r['dtype']} {r['mutant']} #{r['sample']}: {r['status']}: "
                  f"{str(r['summary'])[:160]}")


if __name__ == "__main__":
    main()

"""Rerun a failing case under one change at a time, each in a fresh child, and read the result.

The field guide's rule: compare one change at a time. The changes are the
CPU instead of the device; float32 instead of a low-precision dtype; float64;
TF32 off; cuDNN off; deterministic algorithms; ``torch.compile`` off; each
optional extension switched off through the variables of ``[ablate] env``; and
the case's reference operator in place of ``call``. A change that cannot apply
here is "not applicable here", with the reason. The baseline (the case
unchanged) runs first and must fail; each change is then judged against that
failure (``minimize.same_way``: the same kind of outcome and
``verdict.failure.same_failure``, so the CPU's IndexError for a CUDA device-side
assert is the same failure, and another RuntimeError is not): still fails the
same way, fails differently, or passes. A pass on the CPU is a hint, not a validation: the CPU
runs a different kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal

from packaging.version import InvalidVersion, Version

from pytest_gpucase.base.dtypes import LOW_PRECISION
from pytest_gpucase.base import backends
from pytest_gpucase.base.errors import display
from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.model import Case
from pytest_gpucase.case.variants import Variant
from pytest_gpucase.plan.environment import Environment
from pytest_gpucase.plan.runs import RunSpec, choose_device, saved_dtype, unchanged_runs
from pytest_gpucase.run.parent import Verdict, run_spec
from pytest_gpucase.run.runcontext import RunContext
from pytest_gpucase.tools.minimize import failure_class, first_failure, same_way

__all__ = [
    "CPU_HINT",
    "FAILS_DIFFERENTLY",
    "NOT_APPLICABLE",
    "PASSES",
    "STILL_FAILS",
    "Row",
    "RowVerdict",
    "ablate",
    "ablate_command",
    "changes",
    "read",
]

STILL_FAILS: Final = "still fails"
FAILS_DIFFERENTLY: Final = "fails differently"
PASSES: Final = "passes"
NOT_APPLICABLE: Final = "not applicable here"
RowVerdict = Literal["fails", "still fails", "fails differently", "passes", "not applicable here"]

CPU_HINT = "a hint, not a validation: the CPU kernel differs"
# cuBLAS and cuDNN read this at handle creation and keep TF32 off whatever the code under
# test sets (a training script often turns TF32 on at import, after the child's switches).
_TF32_OVERRIDE = {"NVIDIA_TF32_OVERRIDE": "0"}


@dataclass(frozen=True)
class Row:
    """One change and what became of the case under it."""

    change: str                 # "cpu", "float32", "float64", "autocast_off",
    #                             "autocast_float16", "autocast_bfloat16", "tf32_off",
    #                             "cudnn_off", "deterministic", "compile_off", "env:NAME",
    #                             "extensions", "reference"; "baseline" for the unchanged run
    label: str                  # the change in words: "on the CPU", "TF32 off", "USE_FLASH_ATTN=0"
    verdict: RowVerdict
    failure: str | None = None  # the failure class of a failing run
    note: str = ""              # why not applicable; the CPU hint on a CPU pass
    summary: str = ""           # the run's own one-line outcome
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        return asdict(self)


@dataclass(frozen=True)
class Ablation:
    """A case's baseline run and its reruns under one change each, with a reading."""

    case: Path
    device: str
    dtype: str
    baseline: Row
    rows: tuple[Row, ...]
    reading: str

    @property
    def failing(self) -> bool:
        """Whether the baseline failed, so that the rows mean something."""
        return self.baseline.verdict == "fails"

    def render(self) -> str:
        """The table (change, verdict, failure class or reason) and the one-line reading."""
        head = (f"gpucase ablate: {display(self.case)} on {self.device} in {self.dtype}: "
                f"{self.baseline.verdict}")
        if self.baseline.failure:
            head += f" ({self.baseline.failure})"
        if not self.rows:
            return f"{head}\nreading: {self.reading}"
        table = [("change", "verdict", "failure class or note")]
        for row in self.rows:
            table.append((row.label, row.verdict, row.failure or row.note))
        widths = [max(len(line[column]) for line in table) for column in range(2)]
        lines = [head]
        lines += [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in table]
        lines.append(f"reading: {self.reading}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The ablation as JSON-ready data, for the JSON report."""
        return {
            "case": str(self.case),
            "device": self.device,
            "dtype": self.dtype,
            "failing": self.failing,
            "baseline": self.baseline.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
            "reading": self.reading,
        }


@dataclass(frozen=True)
class Change:
    """One change to run: the run it makes of the baseline, or why it cannot apply here."""

    key: str
    label: str
    spec: RunSpec | None
    reason: str = ""


def _where(device: str) -> str:
    return "the CPU" if device == "cpu" else device


def _capability(env: Environment) -> Version | None:
    """The lowest CUDA compute capability among the visible devices, if known."""
    found = []
    for device in env.devices:
        try:
            found.append(Version(device.capability or ""))
        except InvalidVersion:
            continue
    return min(found, default=None)


def changes(case: Case, base: RunSpec, env: Environment) -> list[Change]:
    """The single changes for ``base``, in table order; those that cannot apply carry why."""
    found: list[Change] = []
    if base.device == "cpu":
        found.append(Change("cpu", "on the CPU", None, "the run is already on the CPU"))
    else:
        found.append(Change("cpu", "on the CPU",
                             replace(base, device="cpu", env={}, launch_blocking=False)))

    floats = saved_dtype(case) is not None
    autocast = case.context.compute_dtype
    for dtype in ("float32", "float64"):
        if not floats:
            reason = "the case has no floating-point inputs to cast"
        elif autocast is not None:
            reason = (f"under {autocast} autocast the call computes in {autocast} whatever its "
                      "inputs are: see autocast off")
        elif base.dtype == dtype:
            reason = f"the run is already in {dtype}"
        elif dtype == "float32" and base.dtype == "float64":
            reason = "the run is in float64, not a low-precision dtype"
        else:
            found.append(Change(dtype, dtype, replace(base, dtype=dtype, cast=True)))
            continue
        found.append(Change(dtype, dtype, None, reason))

    found += _autocast_changes(base)
    capability = _capability(env)
    # TF32 and cuDNN are torch.backends.cuda/cudnn switches: backends.py says where they apply.
    row = backends.backend(backends.run_backend(base.device, env.backend))
    switches = row is not None and row.cuda_switches
    if not switches:
        found.append(Change("tf32_off", "TF32 off", None, "TF32 is a CUDA matmul and "
                             f"convolution mode; this run is on {_where(base.device)}"))
    elif env.backend == "cuda" and capability is not None and capability < Version("8.0"):
        found.append(Change("tf32_off", "TF32 off", None, "TF32 needs compute capability 8.0 "
                             f"(Ampere) or newer; this GPU is {capability}"))
    else:
        found.append(Change("tf32_off", "TF32 off", replace(
            base, settings=("tf32_off",), env={**base.env, **_TF32_OVERRIDE})))
    if not switches:
        found.append(Change("cudnn_off", "cuDNN off", None, "cuDNN (MIOpen on ROCm) serves "
                             f"CUDA devices only; this run is on {_where(base.device)}"))
    else:
        found.append(Change("cudnn_off", "cuDNN off", replace(base, settings=("cudnn_off",))))
    found.append(Change("deterministic", "deterministic algorithms",
                         replace(base, settings=("deterministic",))))
    found.append(Change("compile_off", "torch.compile off",
                        replace(base, settings=("compile_off",))))

    packages = ", ".join(case.matrix.packages)
    if case.ablate_env:
        for name, value in case.ablate_env.items():
            found.append(Change(f"env:{name}", f"{name}={value}",
                                 replace(base, env={**base.env, name: value})))
    elif packages:
        found.append(Change("extensions", "optional extensions off", None,
                             f"[matrix.packages] names {packages} but case.toml has no "
                             "[ablate] env to switch it off; add e.g. [ablate] env = "
                             "{ USE_FLASH_ATTN = \"0\" }"))
    else:
        found.append(Change("extensions", "optional extensions off", None,
                             "the case declares no optional extension ([matrix.packages]) "
                             "and no [ablate] env"))

    if case.reference is None:
        found.append(Change("reference", "reference operator", None, "the case has no "
                             "reference operator; add reference = \"case.py:reference\""))
    else:
        found.append(Change("reference", "reference operator", replace(base, use_reference=True)))
    return found


def _autocast_changes(base: RunSpec) -> list[Change]:
    """Autocast off, and in the other low-precision dtype: where the case records autocast."""
    autocast = base.case.context.compute_dtype
    if autocast is None:
        why = "the case records no autocast ([context] autocast)"
        return [Change("autocast_off", "autocast off", None, why)]
    found = [Change("autocast_off", "autocast off", base.with_autocast(None))]
    other = next((dtype for dtype in LOW_PRECISION if dtype != autocast), None)
    if autocast in LOW_PRECISION and other is not None:
        found.append(Change(f"autocast_{other}", f"autocast in {other} instead of {autocast}",
                            base.with_autocast(other)))
    return found


def _row(change: Change, verdict: Verdict, baseline: Verdict) -> Row:
    outcome = verdict.outcome
    found = failure_class(verdict)
    seconds = round(verdict.child.duration, 3)
    if outcome.status == "passed":
        note = CPU_HINT if change.key == "cpu" else ""
        return Row(change.key, change.label, PASSES, note=note, summary=outcome.summary,
                   seconds=seconds)
    if outcome.status == "skipped" or found is None:
        return Row(change.key, change.label, NOT_APPLICABLE, note=outcome.summary,
                   summary=outcome.summary, seconds=seconds)
    return Row(change.key, change.label,
               STILL_FAILS if same_way(baseline, verdict) else FAILS_DIFFERENTLY,
               failure=str(found), summary=outcome.summary,
               seconds=seconds)


# What a pass under one switched-off feature points at, by the change's key.
_SWITCH_READINGS = (
    ("tf32_off", "TF32 off: TF32's 10-bit mantissa in matmul and convolution explains the "
                 "difference; keep TF32 off for this operation or widen the float32 tolerance"),
    ("cudnn_off", "cuDNN off: suspect the cuDNN kernel for this shape"),
    ("deterministic", "deterministic algorithms: suspect a nondeterministic kernel (atomic "
                      "adds, split reductions)"),
    ("compile_off", "torch.compile off: suspect the compiled graph, not the eager operator"),
)


def _precision_reading(dtype: str, passes: Callable[[str], bool]) -> list[str]:
    """What the dtype and autocast rows say: precision, rounding, or nothing."""
    if passes("autocast_off"):
        return [f"passes with autocast off but fails under {dtype} autocast: precision of "
                f"{dtype} in the autocast region (overflow/rounding), not the inputs"]
    if passes("autocast_float16"):
        return ["passes under float16 autocast but fails under bfloat16: bfloat16's 8-bit "
                "mantissa (rounding), not the inputs"]
    if passes("autocast_bfloat16"):
        return ["passes under bfloat16 autocast but fails under float16: float16's range "
                "(overflow past 65504), not the inputs"]
    if dtype in LOW_PRECISION and passes("float32") and passes("float64"):
        return [f"passes in float32 and float64 but fails in {dtype}: precision "
                "(overflow/rounding), not a logic bug"]
    if passes("float64") and not passes("float32"):
        return [f"passes only in float64 but fails in {dtype}"
                + (" and float32" if dtype in LOW_PRECISION else "")
                + ": rounding (accumulation order, cancellation) or a tolerance too tight; "
                "look at the reduction, not the kernel choice"]
    if passes("float32"):
        return [f"passes in float32 but fails in {dtype}: precision of {dtype}"]
    return []


def read(rows: Sequence[Row], dtype: str, packages: Sequence[str] = ()) -> str:
    """The one-line reading of an ablation's rows for a run in ``dtype``."""
    verdicts = {row.change: row.verdict for row in rows}

    def passes(key: str) -> bool:
        return verdicts.get(key) == PASSES

    passing = [row for row in rows if row.verdict == PASSES]
    with_ = "passes only with" if len(passing) == 1 else "passes with"
    found = _precision_reading(dtype, passes)
    found += [f"{with_} {reading}" for key, reading in _SWITCH_READINGS if passes(key)]
    for row in passing:
        if row.change.startswith("env:"):
            which = f" ({', '.join(packages)})" if packages else ""
            found.append(f"{with_} {row.label}: suspect the optional extension{which}")
    if passes("reference"):
        found.append(f"{with_} the reference operator: suspect the operator under test, since "
                     "the reference gets it right on the same device and dtype")
    if passes("cpu"):
        found.append(f"passes on the CPU: {CPU_HINT}")
    if not passing:
        found.append("fails under every change tried: not precision, kernel choice or extension; "
                     "the trigger is in the inputs or the operator's logic (shrink it with "
                     "gpucase minimize)")
    for row in rows:
        if row.verdict == FAILS_DIFFERENTLY:
            found.append(f"with {row.label} it fails differently ({row.failure})")
    return "; ".join(found)


def ablate(
    case: Case,
    *,
    device: str,
    dtype: str | None,
    env: Environment,
    ctx: RunContext | None = None,
    variant: Variant | None = None,
    progress: Callable[[Row], None] | None = None,
) -> Ablation:
    """Run ``case`` unchanged, then under each single change, each in a fresh child.

    ``ctx`` is the run context of the session or command (its environment variables, memory
    limit, reference cache; default: this process's, ``RunContext.here``): the unchanged
    run is the run an item makes. ``dtype`` None takes the case's dtypes in order and
    ablates the first that fails; ``variant`` ablates an edge variant instead of the saved
    inputs. ``progress`` is told of each row as it completes.
    """
    ctx = replace(ctx or RunContext.here(env.backend), localize=False).fresh()
    specs = [replace(spec, variant=variant)
             for spec in unchanged_runs(case, env, device=device, dtype=dtype)]
    found, tried = first_failure(specs, ctx)
    if found is None:
        runs = " and ".join(v.spec.numeric for v in tried)
        baseline = Row("baseline", "unchanged", PASSES, summary=tried[-1].outcome.summary,
                       seconds=round(tried[-1].child.duration, 3))
        return Ablation(case.path, device, runs, baseline, (),
                        f"passes unchanged on {_where(device)} in {runs}: nothing to ablate")
    failure = failure_class(found)
    assert failure is not None  # a failed verdict always has a class
    if failure.kind == "broken case":
        # Every change would "still fail" the same way, and the reading would blame the
        # inputs: the case itself is what to fix (as minimize says).
        from pytest_gpucase.plan.runs import NotRunnable

        raise NotRunnable(found.outcome.summary)
    baseline = Row("baseline", "unchanged", "fails", failure=str(failure),
                   summary=found.outcome.summary, seconds=round(found.child.duration, 3))
    rows = []
    for change in changes(case, found.spec, env):
        if change.spec is None:
            row = Row(change.key, change.label, NOT_APPLICABLE, note=change.reason)
        else:
            verdict = run_spec(change.spec, ctx)
            row = _row(change, verdict, found)
        rows.append(row)
        if progress is not None:
            progress(row)
    return Ablation(case.path, device, found.spec.numeric, baseline, tuple(rows),
                    read(rows, found.spec.compute_dtype, tuple(case.matrix.packages)))


def ablate_command(case: Path, *, device: str | None, dtype: str | None,
                   progress: Callable[[Row], None] | None = None,
                   run_env: Mapping[str, str] | None = None) -> Ablation:
    """``gpucase ablate``: ablate the case at ``case`` on this machine (the command prints);
    ``run_env``: variables every run's child gets (``--env NAME=VALUE``).

    Raises NotRunnable when the case cannot run here.
    """
    import torch  # noqa: F401 - imported before the children fork, so that each shares it

    from pytest_gpucase.run.probe import probe

    loaded = load_case(case)
    env = probe(tuple(loaded.matrix.packages))
    chosen = choose_device(loaded, env, device)
    return ablate(loaded, device=chosen, dtype=dtype, env=env,
                  ctx=RunContext.here(env.backend, env=run_env), progress=progress)

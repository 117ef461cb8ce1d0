"""How the child judges a run (run/judge.py): what it holds while the reference runs."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plan.runs import RunSpec
from pytest_gpucase.run.outcome import Outcome
from pytest_gpucase.run.judge import Judged, _identical
from pytest_gpucase.run.parent import run_spec
from pytest_gpucase.run.runcontext import RunContext


def test_the_run_inputs_are_let_go_of_as_the_reference_inputs_are_made(tmp_path: Path) -> None:
    """A model case's state is held once as the run's inputs and once as their float64
    copy, not a third time; a second look that needs the run's inputs loads them again."""
    (tmp_path / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
    (tmp_path / "case.py").write_text("def run(x):\n    return x * 2\n")
    payload.save(tmp_path / "inputs.safetensors", {"x": torch.ones(4)})
    spec = RunSpec(load_case(tmp_path), "cpu", "float32", cast=False)
    x = torch.ones(1024)
    held = weakref.ref(x)
    run_inputs = {"x": x}
    del x
    reloads: list[int] = []

    def reload() -> dict[str, torch.Tensor]:
        reloads.append(1)
        return {"x": torch.full((1024,), 3.0)}

    judged = Judged(spec, len, len, lambda: run_inputs, {}, {}, torch.float32, "",
                    reload=reload)
    inputs = judged.reference_inputs_releasing()
    gc.collect()
    assert held() is None and not run_inputs
    assert inputs["x"].dtype == torch.float64 and bool((inputs["x"] == 1).all())
    assert not reloads
    assert bool((judged.saved()["x"] == 3).all()) and reloads == [1]
    # Without a way to load them again, they are kept.
    kept = {"x": torch.ones(4)}
    plain = Judged(spec, len, len, lambda: kept, {}, {}, torch.float32, "")
    assert plain.reference_inputs_releasing()["x"].dtype == torch.float64 and kept


def test_a_golden_is_taken_for_the_reference_only_when_it_holds_the_same_values() -> None:
    """A golden identical to the reference (structure, types, dtypes, values) is judged by the
    reference's comparison; anything a comparison could tell apart is compared on its own."""
    x = torch.tensor([1.0, -2.0, 3.5])
    reference = {"out": {"a": x, "b": [x.clone(), 2, None]}, "grad": {"x": x * 2}}
    same = {"out": {"a": x.clone(), "b": [x.clone(), 2, None]}, "grad": {"x": x * 2}}
    assert _identical(same, reference)
    for other in (
        {"out": {"b": [x, 2, None], "a": x}, "grad": {"x": x * 2}},  # key order
        {"out": {"a": x, "b": (x, 2, None)}, "grad": {"x": x * 2}},  # list vs tuple
        {"out": {"a": x.double(), "b": [x, 2, None]}, "grad": {"x": x * 2}},  # dtype
        {"out": {"a": x.reshape(3, 1), "b": [x, 2, None]}, "grad": {"x": x * 2}},  # shape
        {"out": {"a": x + 1e-7, "b": [x, 2, None]}, "grad": {"x": x * 2}},  # one ulp
        {"out": {"a": x, "b": [x, 2.0, None]}, "grad": {"x": x * 2}},  # int vs float
        {"out": {"a": x, "b": [x, 2, None]}},  # a key fewer
    ):
        assert not _identical(other, reference)
    nan = torch.tensor([float("nan")])
    assert not _identical({"out": nan}, {"out": nan.clone()})  # NaN: compared on its own


KEPT_BUFFER = """
import torch
_KEPT = {{}}

def {name}(a, b):
    buffer = _KEPT.setdefault("out", torch.empty(a.shape[0], b.shape[1], dtype={dtype}))
    buffer.copy_(a @ b {change})
    return {returned}
"""


def run(spec: RunSpec) -> Outcome:
    """The run's outcome, in a forked child as every item runs (a run in this process would
    leave it marked as a replay, and a Recorder of a later test would save nothing)."""
    return run_spec(spec, RunContext("fork", "cpu")).outcome


def _buffer_case(root: Path, code: str, reference: bool = False) -> RunSpec:
    """A float32 matmul of values ~1e3 (past the default tolerance, within its budget), its
    case directory named apart in every test (a case module imported in this process stays
    imported under its case's name)."""
    root.mkdir()
    (root / "case.toml").write_text('format = 1\ncall = "case.py:run"\n'
                                    + ('reference = "case.py:ref"\n' if reference else ""))
    (root / "case.py").write_text(code)
    gen = torch.Generator().manual_seed(0)
    payload.save(root / "inputs.safetensors", {"a": torch.randn(64, 512, generator=gen) * 1e3,
                                               "b": torch.randn(512, 64, generator=gen) * 1e3})
    return RunSpec(load_case(root), "cpu", "float32", cast=False)


@pytest.mark.slow
def test_a_call_whose_outputs_its_reference_run_writes_over_is_a_broken_case(
        tmp_path: Path) -> None:
    """A wrong call that returns a buffer it keeps: the float64 reference run wrote the right
    values into it, and comparing them with themselves passed the wrong call. The reference
    now runs from a copy of the case's module, with a buffer of its own; the budget's draws
    of it write over its first outputs, and the case is broken, saying so."""
    wrong = "* (1.01 if a.dtype == torch.float32 else 1.0)"
    spec = _buffer_case(tmp_path / "call_kept", KEPT_BUFFER.format(
        name="run", dtype="torch.float32", change=wrong, returned="buffer"))
    outcome = run(spec)
    assert outcome.status == "failed" and outcome.kind == "broken case"
    assert ("the reference's outputs (out) were written again while a draw of the rounding "
            "budget ran") in outcome.summary
    assert "return a new tensor" in outcome.summary
    # The same code returning a copy of its buffer is judged, and fails as the bug it is.
    spec = _buffer_case(tmp_path / "call_copied", KEPT_BUFFER.format(
        name="run", dtype="torch.float32", change=wrong, returned="buffer.clone()"))
    outcome = run(spec)
    assert outcome.status == "failed" and outcome.kind == "mismatch"


@pytest.mark.slow
def test_a_reference_whose_outputs_a_budget_draw_writes_over_is_a_broken_case(
        tmp_path: Path) -> None:
    """The rounding budget calls the reference again: a reference returning a buffer it keeps
    would have its first outputs replaced by a draw's before they were compared."""
    code = ("def run(a, b):\n    return a @ b\n"
            + KEPT_BUFFER.format(name="ref", dtype="torch.float64", change="",
                                 returned="buffer"))
    outcome = run(_buffer_case(tmp_path / "reference_kept", code, reference=True))
    assert outcome.status == "failed" and outcome.kind == "broken case"
    assert ("the reference's outputs (out) were written again while a draw of the rounding "
            "budget ran") in outcome.summary
    # Returning a copy, the same reference judges the call: within its budget, it passes.
    code = ("def run(a, b):\n    return a @ b\n"
            + KEPT_BUFFER.format(name="ref", dtype="torch.float64", change="",
                                 returned="buffer.clone()"))
    assert run(_buffer_case(tmp_path / "reference_copied", code, reference=True)).status == "passed"


def test_the_comparison_runs_no_code_and_budgets_only_the_leaves_that_ask() -> None:
    """The comparison called up into the user's code (the budget's draws) from inside its
    walk, for every leaf at once; it now lists the leaves that need a budget, and the draws
    run outside it, for those leaves only."""
    from pytest_gpucase.run.second_look import Look
    from pytest_gpucase.verdict.compare import compare

    expected = {"clean": torch.linspace(1, 2, 64, dtype=torch.float64),
                "off": torch.linspace(1, 2, 64, dtype=torch.float64)}
    actual = {"clean": expected["clean"].float(), "off": (expected["off"] * 1.001).float()}
    asked: list[list[str]] = []

    def spreads(paths: object) -> dict[str, tuple[float, float]]:
        asked.append(sorted(paths))  # type: ignore[call-overload]
        return {path: (1e-7, 1e-7) for path in asked[-1]}

    look = Look(precision=torch.float32, fresh=True, spreads=spreads)
    first = compare(actual, expected, precision=torch.float32, second_look=look,
                    check_dtype=False)
    assert asked == [] and first.pending == ("out['off']",) and not first.ok
    look.settle()
    assert asked == [["out['off']"]]
    again = compare(actual, expected, precision=torch.float32, second_look=look,
                    check_dtype=False)
    assert again.pending == () and not again.ok  # 1e-3 relative: far past 16 x 1e-7
    assert "rounding budget" in again.report()


@pytest.mark.slow   # a child
def test_an_input_the_call_gives_no_gradient_is_named_not_passed_in_silence(
        tmp_path: Path) -> None:
    """[expect] gradients = true: a custom backward returning None for one input (or a
    detach) passed with nothing said; the float64 run of the same code gives None too, and
    finite differences cannot tell a stop-gradient meant from one forgotten."""
    from tests.helpers import replay_cpu, write_case

    case_dir = write_case(tmp_path, "forgets_dw", """
        format = 1
        call = "case.py:run"
        [expect]
        gradients = true
        """, """
        import torch

        class FusedMul(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return x * w

            @staticmethod
            def backward(ctx, g):
                x, w = ctx.saved_tensors
                return g * w, None

        def run(x, w):
            return FusedMul.apply(x, w)
        """, {"x": torch.linspace(-1, 1, 5), "w": torch.linspace(0.5, 2, 5)})
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.status == "passed", verdict.outcome.summary
    assert any(note.startswith("the call gave no gradient to w ")
               for note in verdict.outcome.notes), verdict.outcome.notes


@pytest.mark.slow   # a child
def test_a_call_that_returns_none_says_nothing_was_compared(tmp_path: Path) -> None:
    """An in-place kernel returning None passed with nothing compared and nothing said."""
    from tests.helpers import replay_cpu, write_case

    case_dir = write_case(tmp_path, "sgd_step", """
        format = 1
        call = "case.py:run"
        """, """
        def run(p, g):
            p.sub_(1000.0 * g)
        """, {"p": torch.ones(3), "g": torch.full((3,), 0.1)})
    verdict = replay_cpu(case_dir)
    assert verdict.outcome.status == "passed", verdict.outcome.summary
    assert any(note.startswith("the call returned None, as the reference did: nothing was "
                               "compared") for note in verdict.outcome.notes)


@pytest.mark.slow   # children
def test_the_reference_shares_no_module_state_with_the_call(tmp_path: Path) -> None:
    """The float64 reference ran in the call's own module: a result the call memoized at
    module level (in float16, inf) was the reference's too, and the run passed. The
    reference now runs from a copy of the case's module; a named tuple the file defines is
    still the same type on both sides, and a body that cannot run twice falls back to the
    shared module, saying so."""
    from tests.helpers import replay_cpu, write_case

    x = {"x": torch.full((4,), 12.0)}
    memo = write_case(tmp_path, "memo", """
        format = 1
        call = "case.py:run"
        """, """
        import torch

        _SEEN = {}

        def run(x):
            if x.shape not in _SEEN:
                _SEEN[x.shape] = torch.exp(x * 2)
            return _SEEN[x.shape]
        """, x)
    named = write_case(tmp_path, "named", """
        format = 1
        call = "case.py:run"
        """, """
        from typing import NamedTuple

        class Pair(NamedTuple):
            low: object
            high: object

        def run(x):
            return Pair(x - 1, x + 1)
        """, x)
    twice = write_case(tmp_path, "twice", """
        format = 1
        call = "case.py:run"
        """, """
        import sys

        if "gpucase_twice_marker" in sys.modules:
            raise RuntimeError("already registered")
        sys.modules["gpucase_twice_marker"] = sys

        def run(x):
            return x * 2
        """, x)
    from pytest_gpucase.case.load import load_case as load
    from pytest_gpucase.plan.runs import RunSpec as Spec
    from pytest_gpucase.run.parent import run_spec
    from pytest_gpucase.run.runcontext import RunContext

    found = run_spec(Spec(load(memo), "cpu", "float16", cast=True),
                     RunContext("fork", "cpu", localize=False))
    assert found.outcome.status == "failed", found.outcome.summary
    assert replay_cpu(named).outcome.status == "passed"
    shared = replay_cpu(twice)
    assert shared.outcome.status == "passed", shared.outcome.summary
    assert any("the reference ran in the call's own module" in note and
               "already registered" in note for note in shared.outcome.notes)

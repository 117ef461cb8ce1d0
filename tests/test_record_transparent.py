"""Watching changes nothing training does: copies, pickles, EMA, torch.compile (with and
without fullgraph, watched before or after), and the Recorder's own faults (issue 22 item 1,
issue 23 item 6). Each test fails on the Recorder before these changes."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from pytest_gpucase.case.keys import REPLAY_MODULE
from pytest_gpucase.case.load import load_case
from pytest_gpucase.plugin.items import is_known_failure
from pytest_gpucase.tools.record import Recorder, inputs, watch
from tests import model_targets
from tests.helpers import replay_cpu as replay, read_toml as toml


def watched_model(tmp_path: Path, **options: Any) -> tuple[Recorder, model_targets.TinyLM]:
    torch.manual_seed(0)
    model = model_targets.TinyLM()
    rec = Recorder(tmp_path / "cases", **options)
    rec.watch(model)
    return rec, model


GOOD = torch.tensor([[1, 2, 3]])
BAD = torch.tensor([[1, 9, 3]])


# -- copies --------------------------------------------------------------------------


def test_a_watched_model_deep_copies_pickles_and_saves_as_unwatched(tmp_path: Path) -> None:
    rec, model = watched_model(tmp_path)
    clone = copy.deepcopy(model)
    data = pickle.dumps(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    # Nothing of the Recorder travels: the file loads where pytest-gpucase is absent.
    assert b"pytest_gpucase" not in data and b"pytest_gpucase" not in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, pickle.loads(data), loaded):
        assert all(not hooks for m in other.modules()
                   for hooks in (m._forward_hooks, m._forward_pre_hooks))
        assert torch.equal(other(GOOD), model(GOOD))
    # The copies are not watched: their failures are not the watched model's.
    with pytest.raises(IndexError):
        clone(BAD)
    assert rec.case_dir is None


def test_ema_of_a_watched_model_averages_and_stays_unwatched(tmp_path: Path) -> None:
    rec, model = watched_model(tmp_path)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        model(GOOD).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
    assert not torch.equal(ema.module.emb.weight, model.emb.weight)
    with pytest.raises(IndexError):
        ema(BAD)
    assert rec.case_dir is None


@pytest.mark.slow
def test_the_recorder_travels_as_its_settings(tmp_path: Path) -> None:
    """A Recorder held by what is pickled (a callback into spawned processes) arrives fresh:
    same root and options, nothing watched, nothing taken."""
    rec, model = watched_model(tmp_path, nonfinite=True, narrow=False)
    with pytest.raises(IndexError):
        model(BAD)
    copied = pickle.loads(pickle.dumps(rec))
    assert (copied.root, copied.narrow, copied.nonfinite_kinds) == (
        rec.root, False, rec.nonfinite_kinds)
    assert copied.case_dir is None and not copied.taken()
    assert copy.deepcopy(rec).root == rec.root


def test_unwatch_removes_the_hooks(tmp_path: Path) -> None:
    rec, model = watched_model(tmp_path)
    rec.unwatch(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(IndexError):
        model(BAD)
    assert rec.case_dir is None


# -- torch.compile -------------------------------------------------------------------


def graphs_of(model: torch.nn.Module, fullgraph: bool, backend: str = "eager") -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    for _ in range(2):
        compiled(GOOD)
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("order", ["watch, compile", "compile, watch", "module.compile"])
def test_compile_sees_no_hook(tmp_path: Path, fullgraph: bool, order: str) -> None:
    """One graph with the Recorder as without it, fullgraph=True holds, whichever of watch
    and compile comes first; the forward's failure is still saved."""
    torch.manual_seed(0)
    model = model_targets.TinyLM()
    unwatched = graphs_of(model, fullgraph)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rec = Recorder(tmp_path / "cases")
    if order == "watch, compile":
        rec.watch(model)
        compiled: Any = torch.compile(model, backend="eager", fullgraph=fullgraph)
    elif order == "compile, watch":
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
        rec.watch(compiled)  # the compiled module: its module inside is watched
    else:
        rec.watch(model)
        model.compile(backend="eager", fullgraph=fullgraph)
        compiled = model
    for _ in range(2):
        compiled(GOOD)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == unwatched == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    with pytest.raises(IndexError), rec.step(3):
        compiled(BAD)
    assert rec.case_dir == tmp_path / "cases" / "TinyLM"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_failure_inside_a_compiled_model_is_a_case_of_the_eager_module(
        tmp_path: Path, backend: str) -> None:
    torch._dynamo.reset()
    rec, model = watched_model(tmp_path)
    compiled = torch.compile(model, backend=backend)
    compiled(GOOD)
    with pytest.raises(IndexError), rec.step(1):
        compiled(BAD)
    case_dir = tmp_path / "cases" / "TinyLM"
    doc = toml(case_dir)
    assert doc["call"] == REPLAY_MODULE
    assert doc["inputs"]["gpucase_module"]["factory"] == "tests.model_targets:TinyLM"
    verdict = replay(case_dir)
    assert verdict.outcome.error_type == "IndexError", verdict.outcome.summary
    assert is_known_failure(load_case(case_dir), verdict)
    # The op is narrowed from an eager replay: the compiled forward runs no submodule hook.
    assert [p.name for p in rec.narrowed] == ["TinyLM.aten.embedding.default"]


class Flattening(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.flatten(1))


@pytest.mark.slow
def test_a_compiled_only_error_is_recorded_as_the_eager_failure(tmp_path: Path) -> None:
    """A longer sequence meets a fixed-width layer while Dynamo traces: the compiled call
    says only 'RuntimeError when making fake tensor call'. The case replays the eager module,
    so its captured failure is the eager error, and the compiled one is kept beside it."""
    torch._dynamo.reset()
    rec = Recorder(tmp_path / "cases")
    model = Flattening()
    compiled = rec.watch(torch.compile(model, backend="eager"))
    compiled(torch.randn(2, 2, 4))
    with pytest.raises(Exception, match="fake tensor") as raised, rec.step(1):
        compiled(torch.randn(2, 3, 4))
    assert "mat1 and mat2" not in str(raised.value).partition("\n")[0]
    case_dir = tmp_path / "cases" / "Flattening"
    doc = toml(case_dir)
    assert doc["origin"]["error"].startswith("RuntimeError: mat1 and mat2 shapes"), doc["origin"]
    assert "fake tensor" in doc["origin"]["compiled_error"]
    assert doc["xfail"].startswith("captured failure: RuntimeError: mat1 and mat2 shapes")
    verdict = replay(case_dir)
    assert is_known_failure(load_case(case_dir), verdict), verdict.outcome.summary


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own use of torch.jit
def test_inductor_compiles_a_watched_model_to_one_graph(tmp_path: Path) -> None:
    """The real CPU backend: fullgraph holds, the outputs are the eager ones."""
    torch._dynamo.reset()
    rec, model = watched_model(tmp_path)
    compiled = torch.compile(model, fullgraph=True)
    assert torch.allclose(compiled(GOOD), model(GOOD))
    assert rec.case_dir is None


def test_a_compiled_function_that_calls_a_watched_one_keeps_one_graph(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases")
    scaled = rec.watch(model_targets.scaled_sum)

    def step(x: torch.Tensor) -> torch.Tensor:
        return scaled(x.sin(), torch.tensor(2.0)) + 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x), step(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# -- the Recorder's own faults (issue 23 item 6) ---------------------------------------


class Unprintable(RuntimeError):
    """An exception whose __str__ raises: ``what`` is what it raises."""

    def __init__(self, what: BaseException) -> None:
        super().__init__("unused")
        self.what = what

    def __str__(self) -> str:
        raise self.what


def raise_it(x: torch.Tensor, error: BaseException) -> None:
    raise error


@pytest.mark.slow
@pytest.mark.parametrize("raised", [ValueError("nested"), SystemExit(3)],
                         ids=["error", "SystemExit"])
def test_an_unprintable_exception_propagates_unchanged(
        tmp_path: Path, raised: BaseException, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path / "cases")
    watched = rec.watch(raise_it)
    error = Unprintable(raised)
    with pytest.raises(Unprintable) as info, rec.step(0):
        watched(torch.ones(2), error)
    assert info.value is error
    doc = toml(rec.case_dir)  # type: ignore[arg-type]
    assert doc["origin"]["error"] == (
        f"Unprintable: <unprintable Unprintable: its __str__ raised {type(raised).__name__}>")


@pytest.mark.slow
@pytest.mark.parametrize("raised", [ValueError("nested"), SystemExit(3)],
                         ids=["error", "SystemExit"])
def test_an_unprintable_exception_in_a_module_propagates_unchanged(
        tmp_path: Path, raised: BaseException) -> None:
    rec, model = watched_model(tmp_path)
    error = Unprintable(raised)
    model.emb.register_forward_hook(lambda *a: raise_it(torch.ones(1), error))
    with pytest.raises(Unprintable) as info, rec.step(0):
        model(GOOD)
    assert info.value is error


def _broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("fault planted in the Recorder")


@pytest.mark.slow
@pytest.mark.parametrize("where", [(inputs, "snapshot_before"), (watch, "tensor_versions"),
                                   (watch, "tensors_of"), (watch, "rng_state")],
                         ids=lambda w: w[1] if isinstance(w, tuple) else str(w))
def test_a_fault_in_the_snapshot_runs_the_call_as_unwatched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: tuple[Any, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    module, name = where
    rec, model = watched_model(tmp_path)
    from pytest_gpucase.tools.record import recorder

    monkeypatch.setattr(module, name, _broken)
    if hasattr(recorder, name):
        monkeypatch.setattr(recorder, name, _broken)
    expected = model_targets.TinyLM()
    expected.load_state_dict(model.state_dict())
    for it in range(2):  # a call that passes, passes (and the note is said once)
        with rec.step(it):
            assert torch.equal(model(GOOD), expected(GOOD))
    err = capsys.readouterr().err
    assert err.count("fault planted in the Recorder") == 1, err
    assert "runs as unwatched there (no snapshot), and training is not affected (said once)" in err
    with pytest.raises(IndexError, match="index out of range in self"), rec.step(2):
        model(BAD)


@pytest.mark.slow
def test_a_fault_in_a_watched_function_snapshot_runs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucase.tools.record import recorder

    monkeypatch.setattr(recorder, "snapshot_before", _broken)
    monkeypatch.setattr(recorder, "rng_state", _broken)
    rec = Recorder(tmp_path / "cases")
    scaled = rec.watch(model_targets.scaled_sum)
    assert scaled(torch.ones(2), torch.tensor(3.0)).item() == 6.0
    with pytest.raises(RuntimeError, match="must match"):
        scaled(torch.ones(2), torch.ones(3))
    assert rec.case_dir is not None  # saved from the inputs as they are after the failure


@pytest.mark.slow
def test_a_killed_interpreter_leaves_no_case_that_looks_valid(tmp_path: Path) -> None:
    """A process that dies while its case is written leaves nothing `pytest --gpu-cases`
    or `gpucase validate` takes for a case (a large model, so its store is written too)."""
    script = tmp_path / "die.py"
    here = str(Path(__file__).parent.parent)
    script.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {here!r})\n"
        "from pytest_gpucase.case import payload\n"
        "from pytest_gpucase import Recorder\n"
        "from tests import model_targets\n"
        "real = payload._write_atomic\n"
        "def dying(path, chunks, **kw):\n"
        "    if path.name.endswith('.safetensors') and '.gpucase-store' not in str(path):\n"
        "        os._exit(9)\n"
        "    return real(path, chunks, **kw)\n"
        "payload._write_atomic = dying\n"
        "model = model_targets.TinyLM(vocab=4096, dim=128)\n"
        f"rec = Recorder({str(tmp_path / 'cases')!r}, narrow=False)\n"
        "rec.watch(model)\n"
        "model(torch.tensor([[4096]]))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 9, done.stderr
    from pytest_gpucase.tools.validate import validate

    root = tmp_path / "cases"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []
    assert validate([root]) == [f"{root}: no case directory (with a case.toml) under {root}"]

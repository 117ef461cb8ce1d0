"""The Lightning callback in real Trainer runs (CPU, tiny): what fails in training_step, in
the module's forward or in the backward pass is a case that replays it; precision and
hyperparameters come with it (issue 22 items 3-6)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from pytest_gpucase.integrations.lightning import GpuCaseCallback  # noqa: E402
from pytest_gpucase.tools.validate import validate  # noqa: E402
from tests import lightning_targets  # noqa: E402
from tests.helpers import read_toml as toml  # noqa: E402
from tests.helpers import replays  # noqa: E402

# Lightning's own advice (workers, logging) and deprecations are not what is tested here.
pytestmark = [pytest.mark.slow,  # real training runs and replays in children
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def fit(tmp_path: Path, model: Any, data: Any, error: type[BaseException] | None,
        precision: str = "32-true", strategy: str = "auto", **options: Any) -> GpuCaseCallback:
    callback = GpuCaseCallback(tmp_path / "cases", **options)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, precision=precision,
                         strategy=strategy,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    if error is None:
        trainer.fit(model, data)
    else:
        with pytest.raises(error):
            trainer.fit(model, data)
    return callback


def test_a_loss_failure_in_training_step_replays_the_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = lightning_targets.TinyLit(dropout=0.2)
    fit(tmp_path, model, lightning_targets.loader(bad_target=True), IndexError)
    case_dir = tmp_path / "cases" / "TinyLit.training_step"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    # Rebuilt from the hyperparameters save_hyperparameters() kept: dropout 0.2 included.
    assert (recipe["factory"], recipe["method"]) == ("tests.lightning_targets:TinyLit",
                                                     "training_step")
    assert recipe["kwargs"] == {"vocab": 16, "dim": 8, "dropout": 0.2, "blow": -1,
                                "boom_backward": -1}
    assert doc["inputs"]["batch_idx"] == 2 and doc["origin"]["iteration"] == 2
    assert validate([tmp_path / "cases"]) == []
    replays(case_dir, "IndexError")
    op = tmp_path / "cases" / "TinyLit.training_step.aten.nll_loss2d_forward.default"
    assert op.is_dir() or (tmp_path / "cases" /
                           "TinyLit.training_step.aten.nll_loss_forward.default").is_dir()


def test_under_ddp_the_step_forward_points_at_is_the_case(tmp_path: Path) -> None:
    """The DDP strategies call training_step through the module's forward (replaced on the
    instance for that call, then DDP's forward): the case is still the training_step's,
    not a forward(batch, batch_idx) no replay can call. One process: the same code path."""
    torch.manual_seed(0)
    model = lightning_targets.TinyLit(dropout=0.0)
    environ = dict(os.environ)
    try:
        fit(tmp_path, model, lightning_targets.loader(bad_target=True), IndexError,
            strategy="ddp")
    finally:  # the process group and the variables DDP set, as a fresh process has them
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    case_dir = tmp_path / "cases" / "TinyLit.training_step"
    doc = toml(case_dir)
    assert doc["inputs"]["gpucase_module"]["method"] == "training_step"
    assert "incomplete" not in doc["origin"], doc["origin"]
    replays(case_dir, "IndexError")


def test_a_forward_failure_is_the_module_case_narrowed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    fit(tmp_path, lightning_targets.TinyLit(), lightning_targets.loader(bad_token=True),
        IndexError, precision="bf16-mixed")
    cases = tmp_path / "cases"
    assert sorted(p.name for p in cases.iterdir()) == [
        "TinyLit", "TinyLit.aten.embedding.default", "TinyLit.emb"]
    doc = toml(cases / "TinyLit")
    assert doc["context"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16",
                                          "enabled": True}
    for case_dir in cases.iterdir():
        replays(case_dir, "IndexError")


def test_precision_bf16_mixed_is_the_training_step_case_context(tmp_path: Path) -> None:
    torch.manual_seed(0)
    fit(tmp_path, lightning_targets.TinyLit(), lightning_targets.loader(bad_target=True),
        IndexError, precision="bf16-mixed")
    doc = toml(tmp_path / "cases" / "TinyLit.training_step")
    assert doc["context"]["autocast"]["dtype"] == "bfloat16"


def test_a_backward_failure_replays_the_step_and_its_backward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    fit(tmp_path, lightning_targets.TinyLit(boom_backward=1), lightning_targets.loader(),
        RuntimeError)
    case_dir = tmp_path / "cases" / "TinyLit.training_step"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["backward"] is True and recipe["loss"] == "output"
    assert doc["summary"].startswith("the backward pass of TinyLit raised RuntimeError")
    assert doc["origin"]["grad_output"].startswith("recomputed")
    replays(case_dir, "RuntimeError")


def test_nonfinite_stops_at_the_first_nan_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    fit(tmp_path, lightning_targets.TinyLit(blow=2), lightning_targets.loader(),
        FloatingPointError, nonfinite=True)
    case_dir = tmp_path / "cases" / "TinyLit.training_step"
    doc = toml(case_dir)
    assert doc["origin"]["error"].startswith("FloatingPointError: non-finite loss of TinyLit")
    assert doc["origin"]["iteration"] == 2 and doc["inputs"]["gpucase_module"]["finite"]
    replays(case_dir, "FloatingPointError")


def test_a_clean_run_writes_nothing_and_leaves_the_module_unwatched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = lightning_targets.TinyLit()
    fit(tmp_path, model, lightning_targets.loader(), None)
    assert not (tmp_path / "cases").exists()
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.slow
def test_ddp_spawn_takes_a_watched_module_and_the_callback(tmp_path: Path) -> None:
    """ddp_spawn pickles the module and the callbacks into its processes: a watched module
    and the callback's Recorder travel (each process watches on its own), and a failure on
    one rank is saved in that rank's folder."""
    from pytest_gpucase import Recorder

    torch.manual_seed(0)
    model = lightning_targets.TinyLit()
    Recorder(tmp_path / "outside").watch(model)
    callback = GpuCaseCallback(tmp_path / "cases")
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(model, lightning_targets.loader())
    assert not (tmp_path / "cases").exists()
    with pytest.raises(Exception, match="Target 99 is out of bounds"):
        trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2,
                             max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[GpuCaseCallback(tmp_path / "cases")])
        trainer.fit(lightning_targets.TinyLit(), lightning_targets.loader(bad_target=True))
    saved = [p for p in (tmp_path / "cases").rglob("case.toml")]
    assert saved and all(p.parent.parent.name.startswith("rank") for p in saved)
    origin = toml(saved[0].parent)["origin"]
    assert origin["world_size"] == 2

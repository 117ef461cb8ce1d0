"""The Lightning callback in real Trainer runs (CPU, tiny): what fails in training_step, in
the module's forward or in the backward pass is a case that replays it; precision and
hyperparameters come with it (issue 22 items 3-6)."""

from __future__ import annotations

import os
import socket
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


@pytest.fixture(autouse=True)
def _own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port for each test's process group: Lightning keeps the first MASTER_PORT it
    picks in os.environ, and a later test's group (or one in another xdist worker) would
    meet the earlier one's socket there (EADDRINUSE)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))


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


def test_secret_hyperparameters_never_reach_the_case(tmp_path: Path) -> None:
    """Issue 30: save_hyperparameters() kept a logger key and a database URL with a password;
    the case holds <secret> in their place, lists them, and still replays."""
    torch.manual_seed(0)
    model = lightning_targets.SecretLit(
        wandb_api_key="wk0123456789abcdef0123456789abcdef01234567",
        db_url="postgresql://trainer:s3cretpw@db.internal:5432/runs")
    fit(tmp_path, model, lightning_targets.loader(bad_target=True), IndexError)
    case_dir = tmp_path / "cases" / "SecretLit.training_step"
    for file in case_dir.iterdir():
        if file.suffix in (".toml", ".json", ".py"):
            text = file.read_text()
            assert "wk0123456789abcdef" not in text and "s3cretpw" not in text, file
    doc = toml(case_dir)
    kwargs = doc["inputs"]["gpucase_module"]["kwargs"]
    assert kwargs["wandb_api_key"] == "<secret>"
    assert kwargs["db_url"] == "postgresql://<user>:<secret>@db.internal:5432/runs"
    scrubbed = doc["origin"]["scrubbed"]
    assert "inputs.gpucase_module.kwargs.wandb_api_key" in scrubbed
    assert "inputs.gpucase_module.kwargs.db_url" in scrubbed
    assert "<secret>" in doc["origin"]["scrubbed_note"]
    replays(case_dir, "IndexError")


def test_a_rebuild_that_needs_a_secret_says_so(tmp_path: Path) -> None:
    """Issue 30: the secret is not written, so a rebuild that reads it would be another model:
    the case is incomplete and says which field and what to pass."""
    torch.manual_seed(0)
    model = lightning_targets.KeyedLit(api_key="live-3")
    fit(tmp_path, model, lightning_targets.loader(bad_target=True), IndexError)
    doc = toml(tmp_path / "cases" / "KeyedLit.training_step")
    assert "xfail" not in doc
    assert any("building the model needs api_key, which look secret" in reason
               for reason in doc["origin"]["incomplete"])
    assert "live-3" not in (tmp_path / "cases" / "KeyedLit.training_step" / "case.toml"
                            ).read_text()


def test_a_failure_in_the_optimizer_step_is_not_a_training_step_case_that_passes(
        tmp_path: Path) -> None:
    """Issue 30: Adam raises on a sparse gradient after training_step returned; a replay of
    training_step would pass (XPASS: "fixed"), so the case is incomplete and says where."""
    torch.manual_seed(0)
    model = lightning_targets.SparseAdamLit()
    fit(tmp_path, model, lightning_targets.loader(), RuntimeError)
    doc = toml(tmp_path / "cases" / "SparseAdamLit.training_step")
    assert "xfail" not in doc
    assert any("outside SparseAdamLit.training_step" in reason and "adam.py" in reason
               for reason in doc["origin"]["incomplete"])


def test_a_criterion_failure_outside_the_forward_is_saved_or_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: the loss fails in a criterion training_step calls after the forward. With
    the callback it is the training_step case; with a plain rec.watch of the module (no
    callback) nothing can see it, and a line at watch time says so and what to pass."""
    from pytest_gpucase import Recorder

    torch.manual_seed(0)
    fit(tmp_path / "callback", lightning_targets.CriterionLit(),
        lightning_targets.loader(bad_target=True), IndexError)
    replays(tmp_path / "callback" / "cases" / "CriterionLit.training_step", "IndexError")
    assert "watched without GpuCaseCallback" not in capsys.readouterr().err

    rec = Recorder(tmp_path / "plain" / "cases")
    model = rec.watch(lightning_targets.CriterionLit())
    err = capsys.readouterr().err
    assert ("CriterionLit is a LightningModule watched without GpuCaseCallback" in err
            and "GpuCaseCallback(recorder=rec)" in err), err
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(IndexError):
        trainer.fit(model, lightning_targets.loader(bad_target=True))


def test_a_fit_inside_a_step_saves_the_training_step_not_optimizer_step(
        tmp_path: Path) -> None:
    """Issue 30: without the callback, trainer.fit inside rec.step: the traceback passes
    through the module's optimizer_step (its optimizer and closure no case holds) and then
    its training_step, which raised: the case is training_step's, and it replays."""
    from pytest_gpucase import Recorder

    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases", narrow=False)
    model = lightning_targets.CriterionLit()
    rec.watch(model)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(IndexError), rec.step(0):
        trainer.fit(model, lightning_targets.loader(bad_target=True))
    found = sorted(p.name for p in (tmp_path / "cases").iterdir())
    assert found == ["CriterionLit.training_step"], found
    doc = toml(tmp_path / "cases" / "CriterionLit.training_step")
    assert doc["inputs"]["gpucase_module"]["method"] == "training_step"
    replays(tmp_path / "cases" / "CriterionLit.training_step", "IndexError")


def test_under_ddp_spawn_a_criterion_failure_is_saved_as_under_ddp(tmp_path: Path) -> None:
    """Issue 30: ddp_spawn captures like ddp: the loss fails in a criterion training_step calls
    after the forward, on the rank whose shard holds the bad target; that rank's folder holds
    the training_step case, which replays the failure alone (no process group)."""
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[GpuCaseCallback(tmp_path / "cases")])
    with pytest.raises(Exception, match="Target 99 is out of bounds"):
        trainer.fit(lightning_targets.CriterionLit(dropout=0.0),
                    lightning_targets.loader(bad_target=True))
    # The rank whose shard holds row 9 (DistributedSampler's split) saved it; no other case.
    found = sorted(p.parent for p in (tmp_path / "cases").rglob("case.toml"))
    case_dir = found[0]  # then its narrowed cases, in the same rank's folder
    assert case_dir.name == "CriterionLit.training_step", found
    assert len(found) > 1 and all(p.parent == case_dir.parent for p in found), found
    doc = toml(case_dir)
    assert "incomplete" not in doc["origin"], doc["origin"]
    assert case_dir.parent.name == f"rank{doc['origin']['rank']}"
    assert doc["origin"]["world_size"] == 2
    assert doc["inputs"]["gpucase_module"]["method"] == "training_step"
    assert validate([tmp_path / "cases"]) == []
    replays(case_dir, "IndexError")


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_the_frameworks_own_conventions_are_no_shared_memory_note(
        tmp_path: Path, strategy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: a LightningModule holding a GPT-2 (LM head tied to the embedding), batches of
    labels=input_ids (one tensor under both names), under DDP (gradients in its buckets):
    none of it is a note that the case holds shared memory apart, in the step's case or in
    the cases narrowed from it, in training and in Trainer.validate (inference mode)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    environ = dict(os.environ)
    try:
        fit(tmp_path, lightning_targets.GptLit(), lightning_targets.lm_loader(bad_token=True),
            IndexError, strategy=strategy)
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[GpuCaseCallback(tmp_path / "validate")])
        with pytest.raises(IndexError):
            trainer.validate(lightning_targets.GptLit(),
                             lightning_targets.lm_loader(bad_token=True))
    finally:  # the process group and the variables DDP set, as a fresh process has them
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    err = capsys.readouterr().err
    assert "share memory" not in err, err
    saved = sorted(tmp_path.rglob("case.toml"))
    assert {p.parent.name for p in saved} >= {"GptLit.training_step",
                                              "GptLit.validation_step"}, saved
    for case_file in saved:
        assert "shared memory" not in toml(case_file.parent)["origin"].get("snapshot", "")
    assert toml(tmp_path / "cases" / "GptLit.training_step")["inputs"]["gpucase_module"][
        "tied"] == {"model.lm_head.weight": "model.transformer.wte.weight"}


@pytest.mark.parametrize(("data", "error"), [
    ({"bad_target": True}, "IndexError"),    # in the loss, before manual_backward
    ({}, "RuntimeError"),                      # inside manual_backward
])
def test_manual_optimization_replays_its_training_step_without_a_trainer(
        tmp_path: Path, data: dict[str, bool], error: str) -> None:
    """Issue 30: a training_step that steps its own optimizer asks its Trainer for it
    (self.optimizers(), manual_backward): its case replays without one, instead of raising
    'not attached to a Trainer', a failure that is not the captured one."""
    torch.manual_seed(0)
    model = lightning_targets.ManualLit(boom_backward=-1 if data else 1)
    fit(tmp_path, model, lightning_targets.loader(**data), Exception, narrow=False)
    case_dir = tmp_path / "cases" / "ManualLit.training_step"
    doc = toml(case_dir)
    recipe = doc["inputs"]["gpucase_module"]
    assert recipe["manual_optimization"] is True and recipe["backward"] is False
    assert "xfail" in doc, doc["origin"]
    replays(case_dir, error)


def test_a_validation_step_of_the_second_dataloader_replays_with_its_index(
        tmp_path: Path) -> None:
    """Lightning passes dataloader_idx to validation_step when there are several loaders:
    the case passes it too, so the step replays what ran (loader 1), not loader 0's."""
    torch.manual_seed(0)
    callback = GpuCaseCallback(tmp_path / "cases", narrow=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with pytest.raises(ValueError, match="loader 1 holds class"):
        trainer.validate(lightning_targets.TwoValLit(),
                         [lightning_targets.loader(), lightning_targets.loader()])
    case_dir = tmp_path / "cases" / "TwoValLit.validation_step"
    assert toml(case_dir)["inputs"]["dataloader_idx"] == 1
    replays(case_dir, "ValueError")


def test_a_step_that_takes_no_batch_idx_replays(tmp_path: Path) -> None:
    """Lightning passes batch_idx only to a step that takes it: so does the case."""
    torch.manual_seed(0)
    fit(tmp_path, lightning_targets.NoIndexLit(dropout=0.0),
        lightning_targets.loader(bad_target=True), IndexError, narrow=False)
    case_dir = tmp_path / "cases" / "NoIndexLit.training_step"
    assert "batch_idx" not in toml(case_dir)["inputs"]
    replays(case_dir, "IndexError")

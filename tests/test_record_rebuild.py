"""Faithful rebuilds and bounded size (issue 22 items 5, 7, 8, 9): a rebuild that would be
another model is refused with the difference, tied weights stay tied, a class of the script
that was run is found in it, shared tensors are stored once, a large state is referenced in
its checkpoint, and narrowing keeps what is the same failure."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file

from pytest_gpucase.case import payload
from pytest_gpucase.run.replay import replay_module, script_definitions
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.verdict.failure import Failure, same_failure
from pytest_gpucase.tools.record.rebuild import rebuild_of
from pytest_gpucase.tools.validate import validate
from tests import model_targets
from tests.helpers import python_in, replays, read_toml as toml, replay_cpu as verdict_of

pytestmark = pytest.mark.slow  # every test here starts processes



# -- faithful rebuilds ------------------------------------------------------------------


def test_a_hyperparameter_the_rebuild_cannot_read_makes_it_unfaithful() -> None:
    """TinyDropLM keeps its dropout only inside nn.Dropout: read back, the rebuild would
    use the default 0.1 where the model has 0.2. Said with the difference, not replayed."""
    model = model_targets.DropLM(dropout=0.2)
    rebuild = rebuild_of(model, None, None)
    assert rebuild.factory is None
    assert ("would not be the watched model: the rebuilt model has (drop): Dropout(p=0.1, "
            "inplace=False) where the model has (drop): Dropout(p=0.2, inplace=False)"
            ) in rebuild.why_not
    assert rebuild_of(model_targets.DropLM(), None, None).factory == "tests.model_targets:DropLM"


def test_a_module_changed_after_construction_is_not_rebuilt_as_constructed() -> None:
    model = model_targets.TinyLM()
    model.head = torch.nn.Linear(4, 3)  # a new head for fine-tuning
    rebuild = rebuild_of(model, None, None)
    assert rebuild.factory is None
    assert "head.weight is [8, 4] in the rebuilt model, [3, 4] in the model" in rebuild.why_not


class NeedsNet(torch.nn.Module):
    """A network passed in, and a value kept under another name: the constructor cannot
    be called back with what the module holds, and ``offset`` is not readable."""

    def __init__(self, net: torch.nn.Module, offset: int = 0) -> None:
        super().__init__()
        self.net = net
        self.shift = offset


class Shifted(torch.nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 4, offset: int = 0) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.shift = offset


def test_a_rebuild_that_cannot_run_is_refused_with_its_error() -> None:
    rebuild = rebuild_of(NeedsNet(torch.nn.Linear(2, 2)), "tests.test_record_rebuild:NeedsNet",
                         {})
    assert rebuild.factory is None
    assert "building it again raised TypeError" in rebuild.why_not, rebuild.why_not
    assert "'net'" in rebuild.why_not


def test_a_constructor_argument_no_check_can_see_is_named_in_a_note() -> None:
    """vocab and dim change the shapes the rebuild is checked against; offset is read only
    by forward: the rebuild takes its default, and the note says so and how to name it."""
    rebuild = rebuild_of(Shifted(offset=1), None, None)
    assert rebuild.factory is not None
    (note,) = rebuild.notes
    assert "offset=0" in note and "vocab" not in note and "dim=" not in note
    assert "rec.watch(model, factory=..., kwargs=...)" in note


class ShiftedLit(Shifted, pl.LightningModule):
    """Shifted trained by Lightning's Trainer, without save_hyperparameters()."""


def test_a_lightning_model_is_told_the_callbacks_factory() -> None:
    """Lightning users never call rec.watch: where a factory would help, the note names
    GpuCaseCallback(factory=...) too."""
    (note,) = rebuild_of(ShiftedLit(offset=1), None, None).notes
    assert ("rec.watch(model, factory=..., kwargs=...), or with the Trainer "
            "GpuCaseCallback(factory=..., kwargs=...)") in note
    (plain,) = rebuild_of(Shifted(offset=1), None, None).notes
    assert "GpuCaseCallback" not in plain


def test_an_unfaithful_rebuild_is_an_incomplete_case_validate_reports(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path / "cases")
    model = model_targets.DropLM(dropout=0.2)
    rec.watch(model)
    assert "Dropout(p=0.1, inplace=False) where the model has" in capsys.readouterr().err
    with pytest.raises(IndexError):
        model(torch.tensor([[9]]))
    case_dir = tmp_path / "cases" / "DropLM"
    assert "xfail" not in toml(case_dir)
    problems = validate([case_dir])
    assert any("[origin] incomplete" in p and "would not be the watched model" in p
               for p in problems), problems


def test_tied_parameters_are_stored_once_and_tied_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.TiedLM()
    rec = Recorder(tmp_path / "cases", narrow=False)
    rec.watch(model)
    with pytest.raises(IndexError):
        model(torch.tensor([[9]]))
    case_dir = tmp_path / "cases" / "TiedLM"
    recipe = toml(case_dir)["inputs"]["gpucase_module"]
    assert recipe["tied"] == {"head.weight": "emb.weight"}
    saved = payload.load(case_dir / "inputs.safetensors")
    assert "state.emb.weight" in saved and "state.head.weight" not in saved
    rebuilt: list[torch.nn.Module] = []
    original = model_targets.TiedLM.forward

    def spy(self: model_targets.TiedLM, tokens: torch.Tensor) -> torch.Tensor:
        rebuilt.append(self)
        return original(self, tokens)

    model_targets.TiedLM.forward = spy  # type: ignore[method-assign]
    try:
        replay_module(gpucase_module=recipe, tokens=torch.tensor([[1]]),
                      **{k: v for k, v in saved.items() if k.startswith("state.")})
    finally:
        model_targets.TiedLM.forward = original  # type: ignore[method-assign]
    assert rebuilt[0].head.weight is rebuilt[0].emb.weight
    replays(case_dir, "IndexError")


def test_a_class_of_the_script_that_was_run_is_rebuilt_from_it(tmp_path: Path) -> None:
    """python train.py with the model class in train.py (the usual research script): the
    case loads the class from the script without running its training."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(textwrap.dedent('''
        import torch
        from pytest_gpucase import Recorder

        VOCAB = 8

        class ScriptLM(torch.nn.Module):
            def __init__(self, dim=4, dropout=0.0):
                super().__init__()
                self.dim = dim
                self.dropout = dropout
                self.emb = torch.nn.Embedding(VOCAB, dim)

            def forward(self, tokens):
                return self.emb(tokens)

        model = ScriptLM(dim=6)
        print("training starts")  # top-level code: never run by a replay
        rec = Recorder("cases")
        rec.watch(model)
        for step in range(3):
            with rec.step(step):
                model(torch.tensor([[1, 2 + 3 * step]]))
    '''))
    run_script(project, "IndexError")
    case_dir = project / "cases" / "ScriptLM"
    doc = toml(case_dir)
    assert "incomplete" not in doc["origin"], doc["origin"]
    assert doc["inputs"]["gpucase_module"]["factory"] == "case.py:make_model"
    assert json.loads((case_dir / "model.json").read_text()) == {
        "class": "ScriptLM", "kwargs": {"dim": 6, "dropout": 0.0}, "script": "../../train.py"}
    assert validate([case_dir]) == []
    replays(case_dir, "IndexError")
    assert "training starts" not in verdict_of(case_dir).child.stdout
    for narrowed in sorted((project / "cases").iterdir()):
        if narrowed.name != "ScriptLM" and not narrowed.name.startswith("."):
            replays(narrowed, "IndexError")


def test_a_function_of_the_script_is_named_in_the_summary_once_with_its_iteration(
        tmp_path: Path) -> None:
    """A loss defined in train.py replays through a stand-in case.py: the summary names the
    user's function, not ``case.py:run``, and says the iteration once."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(textwrap.dedent('''
        import torch
        from pytest_gpucase import Recorder

        def loss_fn(probs):
            return -torch.log(probs).mean()

        rec = Recorder("cases", nonfinite=True)
        loss = rec.watch(loss_fn)
        for step in range(3):
            with rec.step(step):
                loss(torch.tensor([0.5, 0.25 if step < 2 else 0.0]))
    '''))
    run_script(project, "FloatingPointError")
    doc = toml(project / "cases" / "loss_fn")
    assert doc["summary"].startswith("loss_fn raised FloatingPointError: non-finite "), doc
    assert doc["summary"].count("iteration 2") == 1, doc["summary"]


def test_script_definitions_keep_definitions_and_drop_what_runs() -> None:
    kept = script_definitions(textwrap.dedent('''
        """doc"""
        import torch
        SIZE = 4
        ACT = torch.nn.GELU
        data = load_everything()
        class M(torch.nn.Module):
            pass
        def helper():
            return SIZE
        for i in range(3):
            train()
        if __name__ == "__main__":
            main()
    '''))
    assert "load_everything" not in kept and "train()" not in kept and "main()" not in kept
    assert all(name in kept for name in ("import torch", "SIZE = 4", "ACT = torch.nn.GELU",
                                         "class M", "def helper"))


def test_script_definitions_keep_the_computed_constants_definitions_read() -> None:
    """``VOCAB = len(CHARS)`` read by a class's default is kept (with what it reads); a call
    only a function's local of the same name matches, or that nothing reads, is not run."""
    kept = script_definitions(textwrap.dedent('''
        import torch
        CHARS = "abcdefgh"
        VOCAB = len(CHARS)
        WIDTH = max(VOCAB, 4)
        model = build_everything()
        class M(torch.nn.Module):
            def __init__(self, vocab=VOCAB):
                super().__init__()
                self.emb = torch.nn.Embedding(vocab, WIDTH)
        def helper(x):
            model = x
            return model
    '''))
    assert all(line in kept for line in ("VOCAB = len(CHARS)", "WIDTH = max(VOCAB, 4)"))
    assert "build_everything" not in kept
    namespace: dict[str, Any] = {}
    exec(compile(kept, "train.py", "exec"), namespace)
    assert namespace["M"]().emb.num_embeddings == 8


def test_a_function_of_the_script_that_was_run_replays_its_nan(tmp_path: Path) -> None:
    """A loss function defined in the script that was run, watched with nonfinite=True:
    its case calls it from the script (case.py:run, from the case directory) and fails
    again with the NaN."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(textwrap.dedent('''
        import torch
        from pytest_gpucase import Recorder

        def log_loss(out, target):
            return (out - target).log().mean()

        if __name__ == "__main__":
            rec = Recorder("cases", nonfinite=True)
            loss_fn = rec.watch(log_loss)
            for step in range(3):
                with rec.step(step):
                    loss_fn(torch.full((4,), 2.0), torch.full((4,), 1.0 + step))
    '''))
    run_script(project, "FloatingPointError")
    (case_dir,) = [p for p in (project / "cases").iterdir() if not p.name.startswith(".")]
    assert toml(case_dir)["inputs"]["gpucase_function"]["target"] == "case.py:run"
    assert validate([case_dir]) == []
    replays(case_dir, "FloatingPointError")


# -- bounded size --------------------------------------------------------------------------


def test_tensors_shared_by_the_model_and_its_narrowed_cases_are_stored_once(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = model_targets.TinyLM(vocab=4096, dim=128)  # 2 MiB embedding, 2 MiB head
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with pytest.raises(IndexError):
        model(torch.tensor([[4096]]))
    root = tmp_path / "cases"
    names = sorted(p.name for p in root.iterdir())
    assert names == [".gpucase-store", "TinyLM", "TinyLM.aten.embedding.default", "TinyLM.emb"]
    weights = 2 * 4096 * 128 * 4
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert weights < total < weights * 1.1  # each weight once, not once per case
    assert len(list((root / ".gpucase-store").iterdir())) == 2
    for case_dir in (root / name for name in names[1:]):
        replays(case_dir, "IndexError")
    assert validate([root]) == []
    # A store file that changed is a problem, named.
    blob = next((root / ".gpucase-store").iterdir())
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert any("does not hold what its name (its sha256) says" in p for p in validate([root]))


def run_script(project: Path, error: str) -> None:
    """Run the project's train.py in a fresh interpreter, as a user does; it fails with
    ``error``."""
    done = python_in(project, "train.py")
    assert error in done.stderr, done.stderr


def _big_model_failure(tmp_path: Path, checkpoint: Path | None) -> Path:
    torch.manual_seed(0)
    model = model_targets.TinyLM(vocab=64, dim=16)
    if checkpoint is not None:
        if checkpoint.suffix == ".safetensors":
            pytest.importorskip("numpy", reason="safetensors.torch.save_file needs numpy")
            save_file(model.state_dict(), str(checkpoint))
        else:
            torch.save(model.state_dict(), checkpoint)
    rec = Recorder(tmp_path / "cases", state_limit=1024, narrow=False)
    rec.watch(model, checkpoint=checkpoint)
    with pytest.raises(IndexError):
        model(torch.tensor([[64]]))
    return tmp_path / "cases" / "TinyLM"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_state_above_the_limit_references_its_checkpoint(tmp_path: Path, suffix: str) -> None:
    checkpoint = tmp_path / f"model{suffix}"
    case_dir = _big_model_failure(tmp_path, checkpoint)
    recipe = toml(case_dir)["inputs"]["gpucase_module"]
    # Issue 30: relative to the case directory, never absolute (no home folder in a case).
    assert recipe["checkpoint"]["path"] == f"../../model{suffix}"
    assert str(tmp_path) not in (case_dir / "case.toml").read_text()
    assert recipe["checkpoint"]["sha256"].startswith("sha256:")
    assert not any(k.startswith("state.") for k in payload.load(case_dir / "inputs.safetensors"))
    assert validate([case_dir]) == []
    replays(case_dir, "IndexError")
    # The project moved as a whole (another checkout): the case still finds its checkpoint.
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.copytree(tmp_path, moved)
    assert validate([moved / "cases" / "TinyLM"]) == []
    replays(moved / "cases" / "TinyLM", "IndexError")
    checkpoint.write_bytes(checkpoint.read_bytes() + b"\0")
    assert any("the checkpoint changed since the capture" in p for p in validate([case_dir]))


def test_a_state_above_the_limit_without_its_checkpoint_is_incomplete(tmp_path: Path) -> None:
    case_dir = _big_model_failure(tmp_path, None)
    doc = toml(case_dir)
    assert "xfail" not in doc
    assert "above Recorder(state_limit=0.0 MiB) and no checkpoint was named" in \
        doc["origin"]["incomplete"][0]


def test_a_checkpoint_of_another_model_state_is_not_referenced(tmp_path: Path) -> None:
    pytest.importorskip("numpy", reason="safetensors.torch.save_file needs numpy")
    checkpoint = tmp_path / "old.safetensors"
    torch.manual_seed(1)
    save_file(model_targets.TinyLM(vocab=64, dim=16).state_dict(), str(checkpoint))
    torch.manual_seed(0)
    model = model_targets.TinyLM(vocab=64, dim=16)
    rec = Recorder(tmp_path / "cases", state_limit=1024, narrow=False)
    rec.watch(model, checkpoint=checkpoint)
    with pytest.raises(IndexError):
        model(torch.tensor([[64]]))
    reason = toml(tmp_path / "cases" / "TinyLM")["origin"]["incomplete"][0]
    assert "the model has changed since its checkpoint" in reason


# -- narrowing keeps the same failure ---------------------------------------------------------


@pytest.mark.parametrize("build,tokens,error", [
    (lambda: model_targets.BagLM(), torch.tensor([[1, 64]]), "RuntimeError"),
    (lambda: model_targets.ShapeLM(), torch.ones(2, 5), "RuntimeError"),
], ids=["embedding_bag", "shape"])
def test_failures_no_class_names_are_narrowed(tmp_path: Path, build: Any,
                                              tokens: torch.Tensor, error: str) -> None:
    torch.manual_seed(0)
    model = build()
    rec = Recorder(tmp_path / "cases")
    rec.watch(model)
    with pytest.raises(Exception):  # noqa: B017 - the type is the parameter's
        model(tokens)
    assert len(rec.narrowed) == 2, [p.name for p in rec.narrowed]
    for case_dir in rec.narrowed:
        replays(case_dir, error)


def test_narrowing_keeps_what_is_the_same_failure_by_class_or_shape() -> None:
    """The definition narrowing uses: verdict.failure (the verdicts share it)."""
    bag = "Index 29 of input takes value 64 which is not in the valid range [0, 64)"
    assert same_failure(Failure("RuntimeError", bag, "", "cpu"),
                        Failure("RuntimeError", bag.replace("29", "3"), "", "cpu"))
    shape = Failure("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (2x5 and 4x3)")
    assert same_failure(shape, Failure("RuntimeError", "mat1 and mat2 shapes cannot be "
                                                       "multiplied (1x5 and 4x3)"))
    assert not same_failure(shape, Failure("RuntimeError", "The size of tensor a (3) must "
                                                           "match the size of tensor b (4)"))
    assert same_failure(Failure("RuntimeError", "CUDA error: device-side assert triggered",
                                "", "cuda"),
                        Failure("IndexError", "index out of range in self", "", "cpu"))


_DATACLASS_SCRIPT = '''
    import torch
    from dataclasses import dataclass, field
    from pytest_gpucase import Recorder

    @dataclass
    class Sizes:
        vocab: int = 8
        dim: int = 4

    @dataclass
    class Config:
        sizes: Sizes = field(default_factory=Sizes)
        name: str = "tiny"

    class TiedLM(torch.nn.Module):
        def __init__(self, cfg: Config):
            super().__init__()
            self.cfg = cfg
            self.emb = torch.nn.Embedding(cfg.sizes.vocab, cfg.sizes.dim)
            self.head = torch.nn.Linear(cfg.sizes.dim, cfg.sizes.vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, tokens):
            return self.head(self.emb(TOKENS_FIX))

    if __name__ == "__main__":
        model = TiedLM(Config(Sizes(vocab=8, dim=6)))
        rec = Recorder("cases", narrow=False)
        rec.watch(model)
        with rec.step(0):
            model(torch.tensor([[1, 9]]))
'''


def test_a_dataclass_configured_model_with_tied_weights_turns_xpass_when_fixed(
        tmp_path: Path) -> None:
    """Issue 30: a model built from a (nested) dataclass config, its head tied to its
    embedding: the case rebuilds it from the config's fields, replays the failure, and turns
    XPASS(strict) once the script is fixed."""
    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text(textwrap.dedent(_DATACLASS_SCRIPT).replace("TOKENS_FIX", "tokens"))
    run_script(project, "IndexError")
    case_dir = project / "cases" / "TiedLM"
    doc = toml(case_dir)
    assert "incomplete" not in doc["origin"], doc["origin"]
    assert doc["inputs"]["gpucase_module"]["tied"] == {"head.weight": "emb.weight"}
    assert json.loads((case_dir / "model.json").read_text())["kwargs"] == {"cfg": {
        "gpucase_config": "dataclass", "class": "Config", "fields": {
            "sizes": {"gpucase_config": "dataclass", "class": "Sizes",
                      "fields": {"vocab": 8, "dim": 6}},
            "name": "tiny"}}}
    assert validate([case_dir]) == []
    replays(case_dir, "IndexError")
    script.write_text(textwrap.dedent(_DATACLASS_SCRIPT).replace(
        "TOKENS_FIX", "tokens.clamp(max=self.cfg.sizes.vocab - 1)"))
    fixed = verdict_of(case_dir)
    assert fixed.outcome.error_type is None, fixed.outcome.summary

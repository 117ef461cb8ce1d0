"""Issue 30: a capture survives its own faults. A meta submodule, a store that cannot be
written, a name too long for the file system, a capture killed midway, a file system that
refuses the payload: the first failure's origin is always saved, and what is missing said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.tools.record import Recorder
from pytest_gpucase.tools.validate import validate
from tests import model_targets
from tests.helpers import read_toml, replays

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # replays and killed writers: other processes


def test_a_meta_submodule_makes_the_case_incomplete_not_lost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(tmp_path / "cases", narrow=False)
    model = rec.watch(model_targets.MetaPart(), name="meta")
    with pytest.raises(ValueError, match="input above 1"), rec.step(4, sample_ids=[7, 8]):
        model(torch.full((1, 3), 2.0))
    assert "could not record" not in capsys.readouterr().err
    doc = read_toml(tmp_path / "cases" / "meta")
    assert doc["origin"]["iteration"] == 4 and doc["origin"]["sample_ids"] == [7, 8]
    assert "xfail" not in doc
    assert set(doc["origin"]["unsaved_state"]) == {"offloaded.weight", "offloaded.bias"}
    assert "meta tensor" in doc["origin"]["unsaved_state"]["offloaded.weight"]
    assert any("offloaded.weight" in p for p in validate([tmp_path / "cases"]))


def test_a_store_that_cannot_be_written_keeps_the_tensors_in_the_case(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The store's place is taken by a file (what a read-only or full store does to the
    write, and root is not stopped by permissions): the case holds its tensors itself."""
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / payload.STORE_DIR).write_text("not a folder")
    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases", narrow=False)
    model = rec.watch(model_targets.Wide(), name="wide")
    with pytest.raises(ValueError), rec.step(0):
        model(-torch.ones(1, 512))
    assert "could not be written" in capsys.readouterr().err
    case_dir = tmp_path / "cases" / "wide"
    assert payload.store_files(case_dir / "inputs.safetensors") == {}
    saved = payload.load(case_dir / "inputs.safetensors")
    assert torch.equal(saved["state.lin.weight"], model.lin.weight.detach())
    replays(case_dir, "ValueError")


def test_a_name_too_long_for_the_file_system_is_shortened_with_a_hash(tmp_path: Path) -> None:
    name = "encoder_" + "very_long_experiment_name_" * 9  # 242 characters
    rec = Recorder(tmp_path / "cases")
    model = rec.watch(model_targets.TinyLM(), name=name)
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[1, 9, 3]]))
    written = sorted(p.name for p in (tmp_path / "cases").iterdir())
    assert len(written) == 3, written  # the model, its embedding, the op: none dropped
    for found in written:
        assert len(found.encode()) <= 100 and found.startswith("encoder_very_long")
    assert len(set(written)) == 3
    whole = rec.case_dir
    assert whole is not None
    replays(whole, "IndexError")


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pytest_gpucase.case.write import write_case_dir
    from pytest_gpucase.base.files import write_atomic

    root = Path(sys.argv[1])
    (root / ".gpucase-store").mkdir(parents=True, exist_ok=True)

    def forever(path):
        path.write_bytes(b"partial")
        print("writing", flush=True)
        time.sleep(600)

    def store_forever(chunks):
        yield b"partial store bytes"
        write_case_dir(root / "TinyLM", {"format": 1}, {"inputs.safetensors": forever})

    write_atomic(root / ".gpucase-store" / ("ab" * 32 + ".safetensors"), store_forever(None))
""")


def test_a_killed_captures_staging_folder_and_partial_store_file_are_swept(
        tmp_path: Path) -> None:
    root = tmp_path / "cases"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root)], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=60)
    writer.stdout.close()
    left = [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
    left += [p.name for p in (root / ".gpucase-store").iterdir()]
    assert any(name.startswith(".TinyLM.") for name in left), left
    assert any(name.endswith(".tmp") and "safetensors" in name for name in left), left
    rec = Recorder(root, narrow=False)
    model = rec.watch(model_targets.TinyLM())
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[9]]))
    hidden = [p.name for p in root.iterdir() if p.name.startswith(".") and
              p.name != payload.STORE_DIR]
    assert hidden == []
    assert [p.name for p in (root / ".gpucase-store").iterdir()] == []


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    import torch
    from pytest_gpucase.tools.record import Recorder
    from tests import model_targets

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write is an error, not a kill
    torch.manual_seed(0)
    rec = Recorder(sys.argv[1], narrow=False)
    model = rec.watch(model_targets.Wide(), name="wide")
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    try:
        with rec.step(12, sample_ids=["s-1", "s-2"]):
            model(-torch.ones(1, 512))
    except ValueError:
        print("raised", flush=True)
""")


def test_a_file_system_that_refuses_the_payload_still_keeps_the_origin(
        tmp_path: Path) -> None:
    """Files are limited to 64 KiB (RLIMIT_FSIZE: the write fails as on a full disk): the
    2 MiB state cannot be written anywhere, and the case keeps the origin, incomplete."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "cases")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.stdout == "raised\n", done.stderr
    doc = read_toml(tmp_path / "cases" / "wide")
    origin = doc["origin"]
    assert origin["error"] == "ValueError: negative input"
    assert origin["iteration"] == 12 and origin["sample_ids"] == ["s-1", "s-2"]
    assert "xfail" not in doc and doc["summary"].startswith("INCOMPLETE: the full case could")
    assert "state.lin.weight" in origin["incomplete"][-1]
    assert not (tmp_path / "cases" / "wide" / "inputs.safetensors").exists()


def test_store_files_no_case_names_are_listed_and_pruned(tmp_path: Path) -> None:
    """A case deleted leaves the store files only it named: validate notes them, `gpucase
    store` lists them, `--prune` removes them and keeps those another case still names."""
    torch.manual_seed(0)
    root = tmp_path / "cases"
    for name, seed in (("kept", 0), ("deleted", 1)):
        torch.manual_seed(seed)
        rec = Recorder(root, narrow=False)
        model = rec.watch(model_targets.Wide(), name=name)
        with pytest.raises(ValueError), rec.step(0):
            model(-torch.ones(1, 512))
    kept = set(payload.store_files(root / "kept" / "inputs.safetensors").values())
    gone = set(payload.store_files(root / "deleted" / "inputs.safetensors").values()) - kept
    assert kept and gone
    import shutil

    shutil.rmtree(root / "deleted")
    notes: list[str] = []
    assert validate([root], notes) == []
    assert any(f"{len(gone)} file(s) no case names" in note for note in notes), notes
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "pytest_gpucase.cli", "store"]
    listed = subprocess.run([*cli, str(root)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert listed.returncode == 0, listed.stderr
    for blob in gone:
        assert blob.name in listed.stdout
    assert all(blob.exists() for blob in gone)
    pruned = subprocess.run([*cli, "--prune", str(root)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert f"removed {len(gone)} file(s)" in pruned.stdout, pruned.stdout + pruned.stderr
    assert not any(blob.exists() for blob in gone) and all(blob.exists() for blob in kept)
    replays(root / "kept", "ValueError")

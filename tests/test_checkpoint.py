"""Atomic checkpoint save, manifest, and validation before a restart."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_gpucase
from pytest_gpucase.tools import checkpoint
from pytest_gpucase.tools.checkpoint import (
    MAX_MANIFEST_BYTES,
    NO_MANIFEST,
    Manifest,
    ModelSpecError,
    manifest_path,
    newest_valid,
    save,
    scan,
    survey,
    validate,
)
from pytest_gpucase.cli import main

ROOT = Path(pytest_gpucase.__file__).resolve().parents[1]
TRUNCATED = re.compile(r"size (\d+) bytes but manifest says (\d+) \(truncated write\?\)")
CANNOT_LOAD_ZIP = (
    "cannot load: RuntimeError: PytorchStreamReader failed reading zip archive: "
    "failed finding central directory"
)
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL and select()")

# The writer a training loop would run, in a child we kill. It writes the first
# half of a 4 MiB checkpoint to whatever path it is given, then hangs as a slow
# disk would, so SIGKILL lands mid-write every time instead of by luck of timing.
# "plain": straight to the final path, as torch.save(state, path) does.
# "atomic": through checkpoint.save, which hands the writer a temporary path.
WRITER = r"""
import io, sys, time
import torch

real_save = torch.save

def stalled_save(obj, path):
    buffer = io.BytesIO()
    real_save(obj, buffer)
    data = buffer.getbuffer()
    with open(path, "wb") as out:
        out.write(data[: len(data) // 2])
        out.flush()
        print("half written", flush=True)
        time.sleep(600)
        out.write(data[len(data) // 2 :])

mode, path = sys.argv[1:]
torch.manual_seed(1)
state = {"model": {"layer1.weight": torch.randn(1024, 1024)}, "step": 2}
if mode == "atomic":
    from pytest_gpucase.tools import checkpoint

    torch.save = stalled_save
    checkpoint.save(state, path)
else:
    stalled_save(state, path)
"""


# Re-saves to one path forever, in children we SIGKILL at random moments. The helper
# imports torch once and forks a saver per kill: 60 interpreter start-ups would cost more
# than the whole test. Protocol on stdin/stdout: "go N" forks a saver that starts at
# version N and answers its pid; "wait" reaps it and answers the signal that ended it.
RESAVER = r"""
import os, sys, traceback
import torch

torch.set_num_threads(1)  # no OpenMP pool in this parent: a forked child could not use it
from pytest_gpucase.tools.checkpoint import save

path, sizes = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]


def version(i):
    generator = torch.Generator().manual_seed(i)
    return {"w": torch.randn(sizes[i], generator=generator), "step": i}


child = None
for line in sys.stdin:
    command = line.split()
    if command[0] == "go":
        child = os.fork()
        if child == 0:
            try:
                i = int(command[1])
                while True:
                    save(version(i % len(sizes)), path)
                    i += 1
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        print(child, flush=True)
    elif command[0] == "wait":
        _, status = os.waitpid(child, 0)
        print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
"""
# 2, 4, 4 and 8 MB: sizes that differ and sizes that are equal (the hash must decide).
RESAVE_SIZES = (1 << 19, 1 << 20, 1 << 20, 1 << 21)


def resave_version(i: int) -> dict[str, object]:
    """Version ``i`` of the object RESAVER saves, built the same way."""
    generator = torch.Generator().manual_seed(i)
    return {"w": torch.randn(RESAVE_SIZES[i], generator=generator), "step": i}


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layer1 = nn.Linear(4, hidden)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.layer1(x)
        out: torch.Tensor = self.fc(hidden)
        return out


class Renamed(nn.Module):
    """Net after a refactor: layer1 became encoder, and fc takes 16 features."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 16)
        self.fc = nn.Linear(16, 10)


def training_state(model: nn.Module, step: int = 10) -> dict[str, object]:
    """A checkpoint as a training loop writes it: model, Adam-shaped optimizer state, step."""
    # Built by hand in Adam's state_dict layout: importing torch.optim costs seconds.
    params = list(model.parameters())
    optimizer = {
        "state": {
            i: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn_like(p),
                "exp_avg_sq": torch.rand_like(p),
            }
            for i, p in enumerate(params)
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(len(params)))}],
    }
    return {"model": model.state_dict(), "optimizer": optimizer, "step": step}


def kill_writer_midway(mode: str, path: Path) -> None:
    """Run WRITER in a child and SIGKILL it once half the checkpoint is on disk."""
    # The child imports this checkout of pytest_gpucase, installed or not.
    pythonpath = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, mode, str(path)], stdout=subprocess.PIPE, env=env
    ) as child:
        assert child.stdout is not None
        try:
            ready, _, _ = select.select([child.stdout], [], [], 60)
            assert ready, "the writer never reported its first half"
            assert child.stdout.readline() == b"half written\n"
        finally:
            os.kill(child.pid, signal.SIGKILL)
    assert child.returncode == -signal.SIGKILL


def test_round_trip_is_valid(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "step-10.pt"

    manifest = save(training_state(model), path)

    data = path.read_bytes()
    assert manifest.size == len(data)
    assert manifest.sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.format == 1 and manifest.finite
    records = {r.name: r for r in manifest.tensors}
    assert records["model.layer1.weight"].shape == (8, 4)
    assert records["model.layer1.weight"].dtype == "float32"
    assert records["optimizer.state.0.exp_avg"].shape == (8, 4)
    assert Manifest.from_json(json.loads(manifest_path(path).read_text())) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10.pt", "step-10.pt.manifest.json"]

    result = validate(path, model)
    assert result, result.problems
    assert result.problems == ()
    assert result.verdict == "VALID"
    assert result.layout == "under 'model'"
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["fc.weight"], model.state_dict()["fc.weight"])


def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = Net()
    path = tmp_path / "model.safetensors"

    manifest = save(model.state_dict(), path)

    assert {r.name for r in manifest.tensors} == set(model.state_dict())
    result = validate(path, model)
    assert result, result.problems
    assert result.layout == "at top level"


def test_safetensors_refuses_nested_objects(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"flat mapping of names to tensors.*at 'model'"):
        save(training_state(Net()), tmp_path / "state.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@posix_only
def test_plain_write_killed_midway_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    torch.manual_seed(0)
    save({"model": {"layer1.weight": torch.randn(1024, 1024)}, "step": 1}, path)

    kill_writer_midway("plain", path)

    result = validate(path)
    assert not result
    match = TRUNCATED.fullmatch(result.problems[0])
    assert match, result.problems
    assert int(match[1]) == path.stat().st_size < int(match[2])
    assert result.problems[1:] == (CANNOT_LOAD_ZIP,)

    manifest_path(path).unlink()   # no manifest: the zip's own structure says it
    size = path.stat().st_size
    assert validate(path).problems == (
        f"not a whole zip archive: its directory, which torch.save writes last, is missing "
        f"({size} bytes): truncated write?", NO_MANIFEST)


@pytest.mark.slow
@posix_only
def test_atomic_save_killed_midway_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    torch.manual_seed(0)
    save({"model": {"layer1.weight": torch.randn(1024, 1024)}, "step": 1}, path)
    before = path.read_bytes()

    kill_writer_midway("atomic", path)

    assert path.read_bytes() == before
    result = validate(path)
    assert result, result.problems
    assert torch.load(path, weights_only=True)["step"] == 1
    # The half-written bytes exist, but only under a hidden temporary name that scans skip.
    (partial,) = tmp_path.glob(".latest.pt.*.tmp")
    assert 0 < partial.stat().st_size < len(before)
    assert [r.path for r in scan(tmp_path)] == [path]


@pytest.mark.slow
@posix_only
def test_resave_killed_at_random_moments_always_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    started = time.monotonic()
    save(resave_version(0), path)
    one_save = time.monotonic() - started
    versions = [resave_version(i) for i in range(len(RESAVE_SIZES))]
    rng = random.Random(20240611)
    pythonpath = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    sizes = ",".join(map(str, RESAVE_SIZES))
    with (
        (tmp_path / "helper.err").open("w+") as errors,
        subprocess.Popen(
            [sys.executable, "-c", RESAVER, str(path), sizes], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=errors, env=env, text=True, bufsize=1,
        ) as helper,
    ):
        assert helper.stdin is not None and helper.stdout is not None

        def ask(command: str) -> int:
            assert helper.stdin is not None and helper.stdout is not None
            helper.stdin.write(command + "\n")
            ready, _, _ = select.select([helper.stdout], [], [], 120)
            errors.seek(0)
            assert ready, f"the helper did not answer {command!r}: {errors.read()}"
            answer = helper.stdout.readline()
            assert answer, f"the helper ended: {errors.read()}"
            return int(answer)

        try:
            for attempt in range(60):
                pid = ask(f"go {attempt + 1}")
                # Up to three saves long: kills land in every step of a save, and between saves.
                time.sleep(rng.uniform(0, 3 * one_save))
                os.kill(pid, signal.SIGKILL)
                errors.seek(0)
                assert ask("wait") == signal.SIGKILL, errors.read()

                result = validate(path)
                assert result, f"kill {attempt}: {result.problems}"
                loaded = torch.load(path, weights_only=True)
                assert loaded["step"] in range(len(versions)), loaded
                assert torch.equal(loaded["w"], versions[loaded["step"]]["w"]), attempt
        finally:
            helper.stdin.close()
    assert helper.returncode == 0

    # The writers are dead: the next save removes every temporary they left.
    save(resave_version(0), path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "helper.err") == [
        "latest.pt", "latest.pt.manifest.json"
    ]


class Killed(BaseException):
    """Stands for SIGKILL at one step of a save."""


@pytest.mark.parametrize(
    ("step", "left"),
    [(1, "old file, old manifest"), (2, "old file, two-record manifest"),
     (3, "new file, two-record manifest")],
)
def test_resave_interrupted_at_each_rename_stays_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: int, left: str
) -> None:
    path = tmp_path / "latest.pt"
    old, new = {"w": torch.ones(1000), "step": 1}, {"w": torch.zeros(1000), "step": 2}
    save(old, path)
    renames = []
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        renames.append(Path(dst).name)
        if len(renames) == step:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(Killed):
        save(new, path)
    monkeypatch.undo()

    # The renames of a re-save: manifest for both, the file, manifest for the new one.
    assert renames[-1] == ["latest.pt.manifest.json", "latest.pt", "latest.pt.manifest.json"][
        step - 1
    ]
    result = validate(path)
    assert result, result.problems
    expected = new if left.startswith("new") else old
    assert torch.load(path, weights_only=True)["step"] == expected["step"]
    records = json.loads(manifest_path(path).read_text())
    assert ("previous" in records) == ("two-record" in left)
    # The next save ends the swap: one record, for the file in place.
    final = save(new, path)
    assert final.previous == ()
    assert "previous" not in json.loads(manifest_path(path).read_text())
    assert validate(path).manifest == final


@pytest.mark.slow
@posix_only
def test_temporaries_of_gone_writers_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    dead, alive, here = int(gone.stdout), os.getpid(), checkpoint._HOST
    elsewhere = "0" * 8 if here != "0" * 8 else "1" * 8
    removed = [
        f".latest.pt.{here}.{dead}.0123abcd.tmp",  # its writer was killed
        f"..latest.pt.{here}.{dead}.0123abcd.tmp.0123456789ab.tmp",  # ...inside payload.save
        f".latest.pt.manifest.json.{here}.{dead}.0123abcd.tmp",
        f".latest.pt.{here}.{alive}.0badf00d.tmp",  # a day untouched, though its pid runs
        f".latest.pt.{elsewhere}.{alive}.deadbeef.tmp",  # a day untouched on another host
    ]
    kept = [
        f".latest.pt.{here}.{alive}.89abcdef.tmp",  # a writer at work
        f".latest.pt.{elsewhere}.{dead}.76543210.tmp",  # another host's pid means nothing here
        f".other.pt.{here}.{dead}.0123abcd.tmp",  # another checkpoint's
        ".latest.pt.123.abcd.tmp",  # not named by this writer
    ]
    for name in removed + kept:
        (tmp_path / name).write_bytes(b"partial")
    two_days_ago = time.time() - 2 * 24 * 3600
    for name in removed[3:]:
        os.utime(tmp_path / name, (two_days_ago, two_days_ago))

    save({"step": 1}, tmp_path / "latest.pt")

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*kept, "latest.pt", "latest.pt.manifest.json"]
    )


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_dev_zero_link(path: Path) -> None:
    path.symlink_to("/dev/zero")


def make_huge(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk


NOT_REGULAR = (
    "manifest unreadable: not a regular file (a FIFO, device or directory); "
    "save() writes a JSON file"
)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p.write_text("[" * 100_000), "JSON nested too deeply to be a manifest"),
        (lambda p: p.write_text('{"format": 1, "previous": ' + "[" * 100_000),
         "JSON nested too deeply to be a manifest"),
        (make_dev_zero_link, NOT_REGULAR),
        (make_fifo, NOT_REGULAR),
        (Path.mkdir, NOT_REGULAR),
        (make_huge, f"{MAX_MANIFEST_BYTES + 1} bytes, more than a manifest holds"),
        (lambda p: p.write_bytes(b"\xff\xfe{"), "'utf-8' codec can't decode"),
        (lambda p: p.write_text("{"), "Expecting property name enclosed in double quotes"),
        (lambda p: p.write_text('{"previous": [{}]}'), "format: expected int, got None"),
    ],
    ids=["nested", "nested-previous", "dev-zero", "fifo", "directory", "huge", "not-utf8",
         "bad-json", "bad-field"],
)
@posix_only
def test_scan_names_the_older_valid_checkpoint_whatever_a_manifest_holds(
    tmp_path: Path, make: Callable[[Path], object], reason: str
) -> None:
    older, newer = tmp_path / "step-1.pt", tmp_path / "step-2.pt"
    save({"step": 1}, older)
    save({"step": 2}, newer)
    os.utime(older, (1_700_000_000, 1_700_000_000))
    manifest_path(newer).unlink()
    make(manifest_path(newer))

    results = scan(tmp_path)

    assert [(r.path, r.verdict) for r in results] == [(newer, "INVALID"), (older, "VALID")]
    assert results[0].problems[0].startswith("manifest unreadable: ")
    assert reason in results[0].problems[0]
    assert newest_valid(tmp_path) == older


@pytest.mark.skipif(
    sys.platform == "win32" or os.geteuid() == 0, reason="needs POSIX permissions, not as root"
)
def test_unreadable_files_are_verdicts(tmp_path: Path) -> None:
    files = [tmp_path / name for name in ("step-1.pt", "step-2.pt", "step-3.pt")]
    for i, path in enumerate(files):
        save({"step": i}, path)
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    manifest_path(files[2]).chmod(0)
    files[1].chmod(0)
    try:
        results = scan(tmp_path)
    finally:
        manifest_path(files[2]).chmod(0o644)
        files[1].chmod(0o644)

    assert [r.verdict for r in results] == ["INVALID", "INVALID", "VALID"]
    assert results[0].problems[0].startswith("manifest unreadable: [Errno 13] Permission denied")
    assert "Permission denied" in results[1].problems[0]


def test_a_failure_while_validating_one_file_is_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = tmp_path / "step-1.pt", tmp_path / "step-2.pt"
    save({"step": 1}, older)
    save({"step": 2}, newer)
    os.utime(older, (1_700_000_000, 1_700_000_000))
    real_hash = checkpoint._sha256_file

    def failing_disk(path: Path) -> str:
        if path == newer:
            raise OSError(5, "Input/output error")
        return real_hash(path)

    monkeypatch.setattr(checkpoint, "_sha256_file", failing_disk)

    results = scan(tmp_path)

    assert [r.problems for r in results] == [
        ("cannot validate: OSError: [Errno 5] Input/output error",), ()
    ]
    assert newest_valid(tmp_path) == older


def test_survey_returns_the_verdicts_and_the_restart(tmp_path: Path) -> None:
    paths = make_checkpoints(tmp_path / "ckpts")

    found = survey([str(tmp_path / "ckpts")])

    assert [r.path for r in found.results] == [
        paths["step-300"], paths["step-200"], paths["step-100"]
    ]
    assert found.restart is found.results[2]
    assert found.render().splitlines()[-1] == (
        f"restart from: {paths['step-100']} (2 newer checkpoints invalid)"
    )
    assert survey([str(tmp_path / "nothing")]).restart is None
    with pytest.raises(ModelSpecError, match=r"^nope: ValueError: expected a checkpoint file"):
        survey([str(tmp_path)], model="nope")


def test_nan_weights_are_recorded_and_invalid(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        model.layer1.weight[0, :3] = float("nan")
        model.fc.bias[2] = float("-inf")
    path = tmp_path / "diverged.pt"

    manifest = save({"model": model.state_dict(), "step": 1834}, path)

    assert not manifest.finite
    records = {r.name: (r.nan, r.inf) for r in manifest.tensors}
    assert records["model.layer1.weight"] == (3, 0)
    assert records["model.fc.bias"] == (0, 1)
    assert validate(path, model).problems == (
        "model.layer1.weight: 3 NaN, 0 inf",
        "model.fc.bias: 0 NaN, 1 inf",
    )


def test_keys_that_no_longer_match_the_model(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    save(training_state(Net()), path)

    result = validate(path, Renamed())

    assert not result
    assert result.layout == "under 'model'"
    assert result.problems == (
        "missing keys: encoder.weight, encoder.bias",
        "unexpected keys: layer1.weight, layer1.bias",
        "model.fc.weight: shape (10, 8) but model has (10, 16)",
    )


@pytest.mark.parametrize(
    ("wrap", "layout"),
    [
        (lambda sd: sd, "at top level"),
        (lambda sd: {"state_dict": sd, "epoch": 3}, "under 'state_dict'"),
        (
            lambda sd: {"model_state_dict": sd, "optimizer_state_dict": {}},
            "under 'model_state_dict'",
        ),
        (lambda sd: {"module": sd, "global_steps": 7}, "under 'module'"),
    ],
    ids=["plain", "lightning", "tutorial", "deepspeed"],
)
def test_common_layouts_are_found_and_named(
    tmp_path: Path, wrap: Callable[[dict[str, torch.Tensor]], object], layout: str
) -> None:
    model = Net()
    path = tmp_path / "ckpt.pt"
    save(wrap(model.state_dict()), path)

    result = validate(path, model.state_dict())

    assert result, result.problems
    assert result.layout == layout


def test_ddp_prefix_is_named(tmp_path: Path) -> None:
    model = Net()
    path = tmp_path / "ddp.pt"
    save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)

    assert validate(path, model).problems == (
        (
            "keys carry the 'module.' prefix of DistributedDataParallel: "
            "save model.module.state_dict(), or strip the prefix before loading"
        ),
    )


def test_no_state_dict_found(tmp_path: Path) -> None:
    path = tmp_path / "odd.pt"
    save({"weights": [torch.ones(2)], "step": 1}, path)

    assert validate(path, Net()).problems == (
        (
            "no model state dict found: expected tensors at top level or a mapping under "
            "'model', 'state_dict', 'model_state_dict', 'module'; found weights, step"
        ),
    )


def test_same_size_corruption_fails_the_hash(tmp_path: Path) -> None:
    path = tmp_path / "flipped.pt"
    save({"model": Net().state_dict()}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    assert validate(path).problems[0] == "sha256 differs from manifest"


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save({"step": 1}, path)
    manifest = json.loads(manifest_path(path).read_text())

    manifest_path(path).write_text(json.dumps({**manifest, "format": 2}))
    assert validate(path).problems == (
        "manifest unreadable: format 2 is newer than this gpucase understands (1)",
    )
    manifest_path(path).write_text(json.dumps({**manifest, "size": "big"}))
    assert validate(path).problems == ("manifest unreadable: size: expected int, got 'big'",)
    manifest_path(path).write_text("{")
    assert validate(path).problems[0].startswith("manifest unreadable: Expecting property name")


def test_missing_file(tmp_path: Path) -> None:
    assert validate(tmp_path / "nope.pt").problems == ("file not found",)


class Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_malicious_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    # A genuine manifest: integrity checks alone would pass this file.
    save({"model": {"w": torch.ones(1)}, "payload": Exploit(marker)}, path)

    result = validate(path)

    assert result.problems == (
        (
            "cannot load: refused by torch.load(weights_only=True): "
            "Unsupported global: GLOBAL exec was not an allowed global by default"
        ),
    )
    assert not marker.exists()
    # Control: the payload is live, so the check above is not vacuous.
    torch.load(path, weights_only=False)
    assert marker.exists()


def make_checkpoints(directory: Path) -> dict[str, Path]:
    """step-100 valid, step-200 with NaN weights, step-300 truncated; mtimes in that order."""
    directory.mkdir()
    paths = {name: directory / f"{name}.pt" for name in ("step-100", "step-200", "step-300")}
    model = Net()
    save(training_state(model, 100), paths["step-100"])
    with torch.no_grad():
        model.layer1.weight[1, 1:4] = float("nan")
    save({"model": model.state_dict(), "step": 200}, paths["step-200"])
    save(training_state(Net(), 300), paths["step-300"])
    with paths["step-300"].open("r+b") as f:
        f.truncate(1000)
    for i, path in enumerate(paths.values()):
        os.utime(path, (1_700_000_000 + 60 * i, 1_700_000_000 + 60 * i))
    # Neither a manifest, nor a hidden temporary, nor an unrelated file is a checkpoint.
    (directory / "notes.txt").write_text("lr 3e-4")
    (directory / ".step-400.pt.123.abcd.tmp").write_bytes(b"PK\x03\x04")
    return paths


def test_scan_newest_first_and_newest_valid(tmp_path: Path) -> None:
    paths = make_checkpoints(tmp_path / "ckpts")

    results = scan(tmp_path / "ckpts")

    assert [r.path for r in results] == [paths["step-300"], paths["step-200"], paths["step-100"]]
    assert [r.verdict for r in results] == ["INVALID", "INVALID", "VALID"]
    assert newest_valid(tmp_path / "ckpts") == paths["step-100"]
    assert newest_valid([paths["step-200"], paths["step-300"]]) is None


def local(timestamp: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def test_gpucase_checkpoint_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    paths = make_checkpoints(Path("ckpts"))
    size = json.loads(manifest_path(paths["step-300"]).read_text())["size"]

    assert main(["checkpoint", "ckpts"]) == 0

    truncated = f"size 1000 bytes but manifest says {size} (truncated write?)"
    s = os.sep
    below = " " * 81   # a file's further problems, under PROBLEM
    full = "weights + optimizer + step 100"
    assert capsys.readouterr().out.splitlines() == [
        f"TIME                 FILE               VERDICT  HOLDS{' ' * 27}PROBLEM",
        f"{local(1_700_000_120)}  ckpts{s}step-300.pt  INVALID  -{' ' * 31}{truncated}",
        f"{below}cannot load: RuntimeError: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory",
        f"{local(1_700_000_060)}  ckpts{s}step-200.pt  INVALID  weights + step 200{' ' * 14}"
        "model.layer1.weight: 3 NaN, 0 inf",
        f"{local(1_700_000_000)}  ckpts{s}step-100.pt  VALID    {full}",
        f"restart from: ckpts{s}step-100.pt (2 newer checkpoints invalid)",
    ]


def test_gpucase_checkpoint_with_reference_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    paths = make_checkpoints(Path("ckpts"))
    paths["step-300"].unlink()
    save(Renamed().state_dict(), "renamed.safetensors")

    assert main(["checkpoint", "ckpts", "--model", "renamed.safetensors"]) == 1

    # The reference comes from a safetensors file, which lists its keys sorted.
    missing = "missing keys: encoder.bias, encoder.weight"
    below = " " * 81   # a file's further problems, under PROBLEM
    keys = [f"{below}unexpected keys: layer1.weight, layer1.bias",
            f"{below}model.fc.weight: shape (10, 8) but model has (10, 16)"]
    s = os.sep
    assert capsys.readouterr().out.splitlines() == [
        f"TIME                 FILE               VERDICT  HOLDS{' ' * 27}PROBLEM",
        f"{local(1_700_000_060)}  ckpts{s}step-200.pt  INVALID  weights + step 200{' ' * 14}"
        "model.layer1.weight: 3 NaN, 0 inf",
        f"{below}{missing}", *keys,
        f"{local(1_700_000_000)}  ckpts{s}step-100.pt  INVALID  weights + optimizer + step 100  "
        f"{missing}", *keys,
        "no valid checkpoint: nothing to restart from",
    ]


def test_gpucase_checkpoint_model_from_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "refmodel.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Linear(4, 8)\n"
    )
    save({"model": nn.Linear(4, 8).state_dict(), "step": 5}, "lin.pt")
    os.utime("lin.pt", (1_700_000_000, 1_700_000_000))

    assert main(["checkpoint", "lin.pt", "--model", "refmodel:build"]) == 0

    assert capsys.readouterr().out.splitlines() == [
        "TIME                 FILE    VERDICT  HOLDS             PROBLEM",
        f"{local(1_700_000_000)}  lin.pt  VALID    weights + step 5",
        "restart from: lin.pt (model state dict under 'model'; it holds weights + step 5: a "
        "restart from it starts the optimizer afresh)",
    ]


def test_gpucase_checkpoint_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    assert main(["checkpoint", "empty", "--model", "no_such_module_xyz:Net"]) == 2
    assert capsys.readouterr().err == (
        "gpucase checkpoint: --model no_such_module_xyz:Net: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'\n"
    )
    Path("empty").mkdir()
    assert main(["checkpoint", "empty"]) == 1
    assert capsys.readouterr().out == "no checkpoint found in empty\n"

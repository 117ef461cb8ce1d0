"""Faults injected for real into a capture (issue 30 item 6): a tmpfs that fills while the
narrowed cases are being written. The module's case is saved, and a line says that the
narrowing stopped and why: no narrowed case is dropped in silence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # captures in fresh interpreters, replays in children

_CAPTURE = textwrap.dedent("""
    import sys
    import torch
    from pytest_gpucase import Recorder
    from tests import model_targets

    torch.manual_seed(0)
    rec = Recorder(sys.argv[1])
    model = rec.watch(model_targets.TinyLM(vocab=64, dim=16))
    try:
        with rec.step(5, sample_ids=["a"]):
            model(torch.tensor([[1, 64]]))
    except IndexError:
        print("raised", flush=True)
""")


def _capture(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CAPTURE, str(root)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _pages(folder: Path) -> int:
    """The bytes ``folder``'s files take on a tmpfs: whole 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A mount point for a tmpfs of the size the test asks (``mount`` needs CAP_SYS_ADMIN)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    yield point
    subprocess.run(["umount", str(point)], capture_output=True, check=False)


def test_a_tmpfs_that_fills_while_narrowing_says_the_narrowing_stopped(
        tmp_path: Path, small_tmpfs: Path) -> None:
    roomy = _capture(tmp_path / "roomy")
    assert roomy.stdout == "raised\n", roomy.stderr
    whole = sorted(p.name for p in (tmp_path / "roomy").iterdir() if not p.name.startswith("."))
    assert whole == ["TinyLM", "TinyLM.aten.embedding.default", "TinyLM.emb"], whole
    # Room for the model's case and its module case, not for the op case after them.
    size = _pages(tmp_path / "roomy" / "TinyLM") + _pages(tmp_path / "roomy" / "TinyLM.emb")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size + 4096}", "tmpfs",
                              str(small_tmpfs)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    full = _capture(small_tmpfs / "cases")
    assert full.stdout == "raised\n", full.stderr
    saved = sorted(p.name for p in (small_tmpfs / "cases").iterdir() if not p.name.startswith("."))
    assert saved[0] == "TinyLM" and "TinyLM.aten.embedding.default" not in saved, saved
    assert "narrowing TinyLM stopped: OSError: [Errno 28] No space left on device" \
        in full.stderr, full.stderr
    if "TinyLM.emb" in saved:  # the words say what was written before the disk filled
        assert "written before it stopped: " in full.stderr and "TinyLM.emb" in full.stderr

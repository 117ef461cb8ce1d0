"""Issue 30: secrets never reach the case folder. What the Recorder writes as text (summary,
xfail line, [origin] error and stderr, sample ids, hyperparameters) passes the scrubbing
rules `gpucase request` applies, with [origin] scrubbed saying where; prose without a secret
stays as it was; the case still replays its failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_gpucase.tools.record import Recorder
from tests import model_targets
from tests.helpers import read_toml, replays

pytestmark = pytest.mark.slow  # replays in a child

SIGNED = ("https://bucket.s3.amazonaws.com/shards/shard-7.tar?X-Amz-Algorithm=AWS4"
          "&X-Amz-Signature=deadbeef0123456789abcdef")


def _all_text(case_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in case_dir.iterdir()
                     if p.suffix in (".toml", ".json", ".py"))


def test_secrets_of_the_error_stderr_and_sample_ids_are_removed(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text("wandb: starting\nWANDB_API_KEY=wk8s7d6f5g4h3j2k1 exported\n"
                      f"opening {model_targets.DB_URL}\n")
    rec = Recorder(tmp_path / "cases", stderr_file=stderr)
    load = rec.watch(model_targets.load_shard)
    with pytest.raises(ConnectionError, match="hunter2pw"), \
            rec.step(3, sample_ids=[SIGNED, 17]):
        load(torch.ones(2))
    case_dir = tmp_path / "cases" / "load_shard"
    text = _all_text(case_dir)
    for secret in ("hunter2pw", model_targets.GH_TOKEN, "wk8s7d6f5g4h3j2k1",
                   "deadbeef0123456789abcdef"):
        assert secret not in text
    doc = read_toml(case_dir)
    origin = doc["origin"]
    assert "<secret>" in origin["error"] and "<secret>" in doc["summary"]
    assert "WANDB_API_KEY=<secret>" in origin["stderr"]
    # A sample id keeps what identifies the sample, the signature goes.
    assert origin["sample_ids"][0].startswith("https://bucket.s3.amazonaws.com/shards/shard-7.tar")
    assert origin["sample_ids"][1] == 17
    assert {"origin.error", "origin.stderr", "origin.sample_ids[0]", "summary",
            "xfail"} <= set(origin["scrubbed"])
    # The scrubbed message is still the failure its replay raises in full.
    replays(case_dir, "ConnectionError")


def test_prose_without_a_secret_is_kept_as_it_was(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "cases")
    check = rec.watch(model_targets.clamp_check)
    with pytest.raises(ValueError), rec.step(0):
        check(torch.full((2,), 3.0))
    doc = read_toml(tmp_path / "cases" / "clamp_check")
    assert doc["origin"]["error"] == (
        "ValueError: logits above 1: do not clamp them to make it pass: mask the padding "
        "instead; the sort key: length")
    assert "scrubbed" not in doc["origin"]


def test_inputs_named_like_secrets_are_not_scrubbed(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An input called ``tokens`` (its description "int64 (1, 3) ...") is no secret field:
    names tell secrets among hyperparameters and config fields only."""
    rec = Recorder(tmp_path / "cases", narrow=False)
    model = rec.watch(model_targets.TinyLM())
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[1, 9, 3]]))
    doc = read_toml(tmp_path / "cases" / "TinyLM")
    assert "scrubbed" not in doc["origin"]
    assert doc["origin"]["inputs"]["tokens"].startswith("int64 (1, 3)")
    assert "secrets removed" not in capsys.readouterr().err

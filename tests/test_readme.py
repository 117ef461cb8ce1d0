"""README's snippets do what they say where a reader runs them: on a CPU machine too."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


class TinyLM(nn.Module):
    """Says whether autocast was on for the device type its input is on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)
        self.autocast: list[bool] = []

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        self.autocast.append(torch.is_autocast_enabled(codes.device.type))
        out: torch.Tensor = self.head(self.embed(codes).mean(1))
        return out


def test_the_recording_loop_runs_under_autocast_on_the_model_s_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.autocast("cuda")`` on a CPU machine is a no-op (with a warning): the loop
    must name the device type the model is on."""
    snippet = re.search(r"Three lines in the loop you already have:\n\n```python\n(.*?)```",
                        README.read_text(encoding="utf-8"), re.S)
    assert snippet is not None
    monkeypatch.chdir(tmp_path)
    model = TinyLM()
    loader = [{"ids": [f"ex{4 * i + j:04d}" for j in range(4)],
               "codes": torch.randint(0, 16, (4, 5)), "label": torch.randint(0, 4, (4,))}
              for i in range(2)]
    scope: dict[str, Any] = {"torch": torch, "F": F, "model": model, "loader": loader,
                             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(compile(snippet[1], str(README), "exec"), scope)   # our own README
    assert model.autocast == [True, True]

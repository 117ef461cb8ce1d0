"""Narrowed cases tell the truth about their lifecycle: what they reproduce, which case they
were narrowed from, and that they go with it once it passes (tools.narrowed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase import cli
from pytest_gpucase.case import payload
from pytest_gpucase.tools.narrowed import narrowed_cases, narrowed_note
from pytest_gpucase.tools.show import show
from tests.helpers import read_toml

PASSING_PY = "def run(x):\n    return x * 2\n"


def case(root: Path, name: str, origin: str = "", xfail: str = "") -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(textwrap.dedent(f"""\
        format = 1
        call = "case.py:run"
        {xfail}
        [origin]
        error = "IndexError: index out of range in self"
        {origin}
    """))
    (path / "case.py").write_text(PASSING_PY)
    payload.save(path / "inputs.safetensors", {"x": torch.ones(2, 3)})
    return path


def family(root: Path) -> tuple[Path, list[Path]]:
    """A model case, its two narrowed cases (one of a name that does not start with the
    parent's), and two unrelated cases beside them."""
    parent = case(root, "gpt", xfail='xfail = "captured failure: IndexError"')
    children = [case(root, "gpt.transformer.wte", 'narrowed_from = "gpt"'),
                case(root, "cut_name_3f2a", 'narrowed_from = "gpt"')]
    case(root, "gpt2", 'narrowed_from = "gpt2_other"')
    broken = root / "gpt.broken"
    broken.mkdir()
    (broken / "case.toml").write_text("not toml [")
    return parent, sorted(children)


def test_a_case_s_narrowed_cases_are_those_naming_it_beside_it(tmp_path: Path) -> None:
    parent, children = family(tmp_path)
    assert narrowed_cases(parent) == children
    assert narrowed_cases(children[0]) == []
    note = narrowed_note(parent)
    assert note is not None
    assert all(str(child) in note for child in children)
    assert note.endswith(f"delete them with its xfail line: gpucase narrowed {parent} --delete")
    assert narrowed_note(tmp_path / "gpt2") is None


def test_show_of_a_narrowed_case_names_its_parent(tmp_path: Path) -> None:
    parent, children = family(tmp_path)
    text = show(children[0])
    assert f"narrowed: from {parent}: replays a submodule or an op on the inputs gpt's " in text
    assert f"(gpucase narrowed {parent} --delete)" in text
    assert (f"narrowed: to {children[0].name}, {children[1].name} beside it; once it passes, "
            f"delete them with its xfail line (gpucase narrowed {parent} --delete)") in show(parent)
    assert f"narrowed: from {tmp_path / 'gpt2_other'} (not found beside it)" in show(
        tmp_path / "gpt2")
    assert "narrowed:" not in show(case(tmp_path / "apart", "alone"))


def test_gpucase_narrowed_lists_then_deletes_them(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    parent, children = family(tmp_path)
    assert cli.main(["narrowed", str(parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [str(child) for child in children]
    assert cli.main(["narrowed", str(parent), "--delete"]) == 0
    out = capsys.readouterr().out
    assert not any(child.exists() for child in children)
    assert parent.exists() and (tmp_path / "gpt2").exists()
    assert "deleted 2 case(s)" in out and f"remove the xfail line of {parent / 'case.toml'}" in out
    assert cli.main(["narrowed", str(tmp_path / "nowhere")]) == 2
    assert "holds no case.toml" in capsys.readouterr().err


@pytest.mark.slow
def test_a_parent_turning_xpass_names_its_narrowed_cases(pytester: pytest.Pytester) -> None:
    parent, children = family(pytester.path / "cases")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-rA",
                                           str(parent))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*XPASS(strict)*", "*gpucase narrowed cases*",
                                 f"*cases/gpt passes: its narrowed cases (cases/"
                                 f"{children[0].name}, cases/{children[1].name}) replay a submodule*"])


@pytest.mark.slow
def test_the_recorder_s_narrowed_cases_say_what_they_are(tmp_path: Path) -> None:
    from pytest_gpucase.tools.record import Recorder
    from tests import model_targets

    torch.manual_seed(0)
    rec = Recorder(tmp_path / "cases")
    model = rec.watch(model_targets.TinyLM())
    with pytest.raises(IndexError), rec.step(0):
        model(torch.tensor([[1, 9, 3]]))
    assert sorted(p.name for p in rec.narrowed) == ["TinyLM.aten.embedding.default",
                                                   "TinyLM.emb"]
    for path, what in ((tmp_path / "cases" / "TinyLM.emb", "module emb"),
                       (tmp_path / "cases" / "TinyLM.aten.embedding.default",
                        "op aten.embedding.default")):
        doc = read_toml(path)
        assert doc["origin"]["narrowed_from"] == "TinyLM"
        assert doc["xfail"].startswith(f"narrowed from TinyLM: {what} fails on the inputs the "
                                       "failure of TinyLM gave it (IndexError: index out of "
                                       "range in self)")
        assert "passes only if" in doc["xfail"] and "remove this line" not in doc["xfail"]
    assert "remove this line once fixed" in read_toml(tmp_path / "cases" / "TinyLM")["xfail"]
    assert narrowed_cases(tmp_path / "cases" / "TinyLM") == sorted(rec.narrowed)

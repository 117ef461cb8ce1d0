"""The ``gpucase`` command behaves as a command should: version, help, pipes, exit codes."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pytest_gpucase
from pytest_gpucase import cli
from pytest_gpucase.tools import validate as validate_module
from pytest_gpucase.cli import EXIT_BROKEN_PIPE, main
from pytest_gpucase.report.render import RENDERERS
from pytest_gpucase.plugin.settings import SETTINGS
from tests.helpers import RICH, rich_case, write_bare_case

ROOT = Path(pytest_gpucase.__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, by name, as ``gpucase`` builds them."""
    (commands,) = (a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"gpucase {pytest_gpucase.__version__}\n"


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_documents_every_argument(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    # argparse wraps lines where it likes: compare with the whitespace evened out.
    shown = " ".join(capsys.readouterr().out.split())
    for action in subcommands()[command]._actions:
        assert action.help, f"gpucase {command}: {action.dest} has no help"
        if action.option_strings:
            assert action.option_strings[-1] in shown
        else:
            assert str(action.metavar) in shown.split("positional arguments:", 1)[1]
        # The help text as argparse fills it in: %(default)s and the like.
        text = action.help % {**vars(action), "prog": subcommands()[command].prog}
        assert " ".join(text.split()) in shown, f"gpucase {command}: {action.dest}"


def test_format_choices_are_the_renderers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["matrix", "--help"])
    assert f"{{{','.join(RENDERERS)}}}" in capsys.readouterr().out


def test_bad_numbers_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["minimize", "some_case", "--max-tries", "0"])
    assert exited.value.code == 2
    assert "argument --max-tries: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["minimize", "some_case", "--time-budget", "nan"])
    assert exited.value.code == 2
    assert "argument --time-budget: must be positive, got nan" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("head") is None, reason="needs head")
def test_output_cut_short_by_head_ends_quietly(tmp_path: Path) -> None:
    # 2000 context lines: far more than a pipe holds, so the reader leaves while we write.
    notes = "".join(f'note_{i} = "{"x" * 80}"\n' for i in range(2000))
    case = write_bare_case(tmp_path, "chatty", textwrap.dedent(RICH) + notes)
    pythonpath = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    with (tmp_path / "stderr").open("w+b") as errors:
        with subprocess.Popen(
            [sys.executable, "-m", "pytest_gpucase.cli", "request", str(case)],
            stdout=subprocess.PIPE, stderr=errors, env=env,
        ) as gpucase:
            assert gpucase.stdout is not None
            # head holds the only read end of the pipe: when it exits, the pipe is broken.
            head = subprocess.run(["head", "-1"], stdin=gpucase.stdout, capture_output=True,
                                  timeout=120, check=True)
            gpucase.stdout.close()
            gpucase.wait(timeout=120)
        errors.seek(0)
        assert errors.read() == b""
    assert head.stdout == b"## GPU failure: `RuntimeError: CUDA error: device-side assert " \
                          b"triggered`\n"
    assert gpucase.returncode == EXIT_BROKEN_PIPE


def test_validate_exit_code_follows_the_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    good = rich_case(tmp_path / "good")
    assert main(["validate", str(good)]) == 0
    assert capsys.readouterr().out == f"gpucase validate: no problems in {good}\n"

    bad = write_bare_case(tmp_path / "bad", "typo", 'format = 1\ncalll = "case.py:run"\n')
    assert main(["validate", str(good), str(bad)]) == 1
    assert "calll: unknown key; did you mean 'call'?" in capsys.readouterr().out

    # Whatever validate reports is a problem: "no case found" included.
    monkeypatch.setattr(validate_module, "validate",
                        lambda paths, notes=None, unchecked=None, rebuild=True:
                        [f"{paths[0]}: no case found"])
    assert main(["validate", "empty"]) == 1
    assert capsys.readouterr().out == "empty: no case found\n"


def test_validate_fails_on_a_directory_without_a_case(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["validate", str(tmp_path / "empty")]) != 0


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_names_only_pytest_options_that_exist(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # matrix's help once sent its reader to a --gpu-report that pytest never had.
    with pytest.raises(SystemExit):
        main([command, "--help"])
    named = set(re.findall(r"--gpu[a-z-]*", " ".join(capsys.readouterr().out.split())))
    assert named <= {setting.flag for setting in SETTINGS}
    if command == "matrix":
        assert named == {"--gpu-cases-report"}


def test_show_prints_the_payload_hash_ready_to_paste(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """inputs_sha256's own message sends its reader to `gpucase show`: show prints the hash,
    even when the case.toml's hash is the malformed one to mend."""
    monkeypatch.chdir(tmp_path)
    case = rich_case(Path("cases"))
    setting = ('inputs_sha256 = "sha256:'
               f'{hashlib.sha256((case / "inputs.safetensors").read_bytes()).hexdigest()}"')
    assert main(["show", str(case)]) == 0
    assert f"hash:      {setting}" in capsys.readouterr().out.splitlines()

    toml = (case / "case.toml").read_text()
    (case / "case.toml").write_text('inputs_sha256 = "73877274"\n' + toml)
    assert main(["show", str(case)]) == 2
    out, err = capsys.readouterr()
    assert err == ("gpucase: cases/ce_class4/case.toml: inputs_sha256: '73877274' is not "
                   "\"sha256:\" followed by 64 lowercase hex digits; set it to the "
                   "inputs_sha256 line `gpucase show CASE` prints (or \"sha256:\" and the first "
                   "field of `sha256sum inputs.safetensors`), or remove the key\n")
    assert out == f"hash:      {setting}\n"
    (case / "case.toml").write_text(setting + "\n" + toml)  # pasted as shown: the case loads
    assert main(["show", str(case)]) == 0
    assert main(["validate", str(case)]) == 0
    capsys.readouterr()
    # Another mistake is only itself: no hash line to wonder about.
    (case / "case.toml").write_text("colour = 'red'\n" + toml)
    assert main(["show", str(case)]) == 2
    out, err = capsys.readouterr()
    assert "colour" in err and out == ""

    (case / "inputs.safetensors").unlink()  # no payload: no hash to show, the error alone
    (case / "case.toml").write_text('inputs_sha256 = "73877274"\n' + toml)
    assert main(["show", str(case)]) == 2
    assert capsys.readouterr().out == ""


def test_show_with_a_report_that_is_not_there_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    case = rich_case(Path("cases"))
    assert main(["show", str(case), "--report", "missing.json"]) == 2
    out, err = capsys.readouterr()
    assert err == ("gpucase show: --report missing.json: no such file; give the JSON report "
                   "that --gpu-cases-report wrote\n") and out == ""

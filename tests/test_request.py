"""show, request and validate: reading cases without running them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import payload
from pytest_gpucase.cli import main
from pytest_gpucase.tools.show import request, show
from pytest_gpucase.tools.validate import validate
from tests.helpers import RICH, result, rich_case, write_bare_case


def report_of(path: Path, results: list[dict[str, object]]) -> Path:
    """A JSON report of a CPU runner holding ``results``, as the plugin writes it."""
    from pytest_gpucase.plan.environment import Environment
    from pytest_gpucase.report.file import new_report, write_report

    report = new_report(Environment(backend="cpu", device_types=("cpu",)).to_dict())
    report.update(results=results, complete=True)
    write_report(path, report)
    return path


def test_show_gives_the_case_at_a_glance(tmp_path: Path) -> None:

    case_dir = rich_case(tmp_path)
    report = report_of(tmp_path / "report.json", [
        result("other", "cpu", "float32", "passed"),
        result("ce_class4", "cuda", "bfloat16", "skipped", "batch=1", case_path="ce_class4"),
        result("ce_class4", "cpu", "float32", "xfailed", case_path="ce_class4",
               message="the call raised IndexError: Target 4 is out of bounds.\nmore"),
    ])
    text = show(case_dir, report=report)
    pytest.LineMatcher(text.splitlines()).fnmatch_lines([
        "ce_class4  (*ce_class4)",
        "summary:   CrossEntropyLoss target holds class 4 on a 4-class head",
        "call:      case.py:run",
        "reference: case.py:run",
        "expect:    outputs match the reference, gradients included; tolerance bfloat16: "
        "rtol=0.02, atol=0.001",
        "xfail:     labels not remapped yet (strict)",
        "timeout:   60 s",
        "origin:",
        "  error: RuntimeError: CUDA error: device-side assert triggered",
        "  stderr: Loss.cu:250: * Assertion `t >= 0 && t < n_classes` failed.",
        "  where: iteration 1834, in loss, after optimizer.step",
        "  versions: Python 3.11.7, torch 2.3.1, CUDA 12.1",
        "  revision: 3f2c1ab",
        "  later_errors: 12",
        "  sample_ids: 3 (img_00412, img_00413, img_00414)",
        "inputs:",
        "  logits  float32   [[]4, 3[]] stride [[]1, 5[]], offset 1  non-contiguous",
        "  target  int64     [[]3[]] stride [[]1[]]  contiguous",
        "  num_classes = 4",
        "matrix:    devices cuda, cpu; dtypes float32, bfloat16; torch>=2.1",
        "variants:  batch axis 0 sizes 1, 2; boundaries of 'target' (4 classes, ignore_index -100)",
        f"last verdicts ({report}):",
        "  cuda-bfloat16-batch=1: skipped",
        "  cpu-float32: xfailed: the call raised IndexError: Target 4 is out of bounds. ...",
    ])
    assert "other" not in text


@pytest.mark.parametrize(("content", "says", "code"), [
    (None, "gpucase show: --report report.json: no such file; give the JSON report that "
     "--gpu-cases-report wrote", 2),
    ("{not json", "gpucase show: --report report.json: not JSON: Expecting property name *", 2),
    ('{"results": {"a": 1}}', 'gpucase show: --report report.json: not a pytest-gpucase '
     'report: "schema" is missing, expected "pytest-gpucase/report"', 2),
    ("fifo", "gpucase show: --report report.json: is a FIFO (named pipe), not a regular file; "
     "give the JSON report that --gpu-cases-report wrote", 2),
    ("[]", "  no verdict of this case in the report", 0),
])
def test_show_reads_a_report_as_the_matrix_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        content: str | None, says: str, code: int) -> None:
    """A report is untrusted input here too: refused in one line with exit status 2 (a FIFO
    without blocking), never read whole when it is not a file, never a traceback."""
    import os

    monkeypatch.chdir(tmp_path)
    rich_case(tmp_path / "cases")
    report = Path("report.json")
    if content == "fifo":
        os.mkfifo(report)
    elif content == "[]":
        report_of(report, [])
    elif content is not None:
        report.write_text(content)
    assert main(["show", "cases/ce_class4", "--report", str(report)]) == code
    out, err = capsys.readouterr()
    pytest.LineMatcher((err if code else out).splitlines()).fnmatch_lines([says])
    if code:
        assert len(err.splitlines()) == 1 and not out


def test_show_survives_a_broken_payload_and_lists_unsaved_inputs(tmp_path: Path) -> None:
    case_dir = write_bare_case(tmp_path, "meta_only", """
        format = 1
        call = "case.py:run"
        [expect]
        outcome = "raises"
        exception = "IndexError"
        match = "out of bounds"
        [origin]
        snapshot = "not saved: device unusable after device-side assert"
        [origin.inputs]
        logits = "float32 (3, 4) stride (4, 1) cuda:0"
        [origin.skipped_inputs]
        model = "toy.MLP"
    """)
    text = show(case_dir)
    pytest.LineMatcher(text.splitlines()).fnmatch_lines([
        "expect:    raises IndexError matching 'out of bounds'",
        "  snapshot: not saved: device unusable after device-side assert",
        "  logits: float32 (3, 4) stride (4, 1) cuda:0 (recorded, not saved)",
        "  model: toy.MLP (skipped: not storable)",
    ])
    (case_dir / "inputs.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "inputs.safetensors: " in show(case_dir)


def test_request_removes_private_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("USER", "LOGNAME"):
        monkeypatch.setenv(name, "alice_gpu")
    monkeypatch.setenv("HOME", "/home/alice_gpu")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-17.cluster.example.org")
    case_dir = tmp_path / "cases" / "ce_secret"
    planted = RICH.replace(
        'summary = "CrossEntropyLoss target holds class 4 on a 4-class head"',
        'summary = "failed for alice_gpu in /mnt/alice/runs/exp42 on gpu-node-17"',
    ).replace(
        'stderr = "Loss.cu:250: nll_loss: block: [0,0] Assertion',
        'stderr = "[gpu-node-17:4242] reading /home/alice_gpu/data/p_00412.png, '
        '/srv/private/cohort7/labels.csv and ' + str(case_dir) + '/case.py\\n'
        'HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345 ghp_0123456789abcdefghijABCDEFGHIJ0123 '
        'Authorization: Bearer eyJhbGciOi.eyJzdWIiOi.c2lnbmF0dXJl api_key: \\"q9w8e7r6t5\\"\\n'
        'key aGVsbG8gd29ybGQgdGhpcyBpcyBhIHNlY3JldCBrZXkx contact alice.smith@example.com\\n'
        '/pytorch/aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward: block: [0,0] '
        'Assertion',
    ).replace('last_step = "optimizer.step"', 'last_step = "eval as alice_gpu on '
              'gpu-node-17.cluster.example.org (~/runs, C:\\\\Users\\\\alice\\\\x)"').replace(
        'sample_ids = ["img_00412", "img_00413", "img_00414"]',
        'sample_ids = ["patient_00412_scan", "patient_00413_scan", 91234]\n'
        'error_detail = "batch patient_00413_scan, index 91234"')
    rich_case(tmp_path / "cases", "ce_secret", planted)
    text = request(case_dir)
    for secret in ("alice", "gpu-node-17", "example.com", "example.org", "patient_004", "91234",
                   "/home/", "/srv/", "cohort7", "p_00412", "/mnt/", "exp42", "hf_AbCd",
                   "ghp_0123", "eyJ", "q9w8e7r6t5", "aGVsbG8", str(tmp_path), "Users"):
        assert secret not in text, f"{secret!r} survived:\n{text}"
    for kept in ("HF_TOKEN=<secret>", "<email>", "<host>", "<user>", "<sample id>", "<path>",
                 "- error_detail: batch <sample id>, index <sample id>", "<secret> api_key: ",
                 "Authorization: Bearer <secret>", " case.py\n", "(<path>, <path>)",
                 "<path>/Loss.cu:250: nll_loss_forward", "`case.py:run`",
                 "Assertion `t >= 0 && t < n_classes` failed.", "3 recorded (withheld)"):
        assert kept in text, f"{kept!r} is missing:\n{text}"


def test_request_is_a_ready_to_paste_report(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rich_case(tmp_path / "cases")
    text = request(Path("cases/ce_class4"))
    pytest.LineMatcher(text.splitlines()).fnmatch_lines([
        "## GPU failure: `RuntimeError: CUDA error: device-side assert triggered`",
        "- **Operation**: `case.py:run`",
        "- **First error**: `RuntimeError: CUDA error: device-side assert triggered`",
        "- **Kernel assertion**: ``Loss.cu:250: * Assertion `t >= 0 && t < n_classes` failed.``",
        "- **Backend**: cuda (NVIDIA A100-SXM4-80GB)",
        "- **Versions**: Python 3.11.7, torch 2.3.1, CUDA 12.1",
        "- **Revision**: `3f2c1ab`",
        "- **Where**: iteration 1834, in loss, after optimizer.step",
        "- **Later errors**: 12 after the first (likely consequences, not separate causes)",
        "| `logits` | float32 | [[]4, 3[]] | [[]1, 5[]] | no |",
        "| `target` | int64 | [[]3[]] | [[]1[]] | yes |",
        "Literals: `num_classes = 4`",
        "- clue: device-side assert*",
        "- first check: Check the indices, targets and operator conditions*",
        "- note: meaning: a class target is outside [[]0, num_classes) *",
        "pytest --gpu-cases cases/ce_class4 -k ce_class4 -rxX",
        "*add `--runxfail` to see the failure itself.",
    ])


def test_validate_reports_every_problem_once_per_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cases = tmp_path / "cases"
    good = rich_case(cases, "good")
    rich_case(cases / "group", "nested")
    write_bare_case(cases, "typo", 'format = 1\ncalll = "case.py:run"\n')
    truncated = rich_case(cases, "truncated")
    data = (truncated / "inputs.safetensors").read_bytes()
    (truncated / "inputs.safetensors").write_bytes(data[:-8])
    write_bare_case(cases, "clash", 'format = 1\ncall = "case.py:run"\n[inputs]\ntarget = 1\n'
               "num_classes = 4\n", {"target": torch.tensor([1]), "logits": torch.ones(1, 4)})
    rich_case(cases, "noboundary", RICH.replace('input = "target"', 'input = "labels"'))
    (cases / "lost").mkdir()
    payload.save(cases / "lost" / "inputs.safetensors", {"x": torch.ones(1)})
    (cases / ".ce.1234.tmp").mkdir()
    (cases / ".ce.1234.tmp" / "case.toml").write_text("not toml [")
    (cases / "empty").mkdir()

    problems = validate([Path("cases"), Path("nowhere")])
    assert problems[:3] == [
        "cases/clash/case.toml: [inputs]: target given both here and in inputs.safetensors; "
        "keep one",
        "cases/lost/case.toml: missing, but the directory holds inputs.safetensors: an "
        "interrupted write or a deleted case.toml",
        "cases/noboundary/case.toml: [variants] boundaries: input 'labels' is not a saved tensor "
        "(inputs.safetensors holds logits, target)",
    ]
    # Without its boundaries input the batch has no anchor: logits (4, 3) or target (3,)?
    assert problems[3].startswith("cases/noboundary/case.toml: [variants] batch: cannot tell "
                                  "which input holds the samples on axis 0")
    assert problems[4].startswith("cases/truncated/inputs.safetensors: ")
    assert problems[5] == "cases/typo/case.toml: calll: unknown key; did you mean 'call'?"
    assert problems[6:] == ["nowhere: not found"]
    assert validate([good, good / "case.toml", cases / "group"]) == []


def test_cli_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rich_case(tmp_path / "cases", "good")
    assert main(["validate"]) == 0
    assert capsys.readouterr().out == "gpucase validate: no problems in cases\n"
    assert main(["show", "cases/good"]) == 0
    assert capsys.readouterr().out.startswith("good  (cases/good)\n")
    assert main(["request", "cases/good"]) == 0
    assert "pytest --gpu-cases cases/good -k good" in capsys.readouterr().out
    write_bare_case(tmp_path / "cases", "bad", "format = 2\n")
    assert main(["validate", "cases"]) == 1
    assert capsys.readouterr().out.startswith("cases/bad/case.toml: format: unsupported format 2")
    assert main(["show", "cases/bad"]) == 2
    assert "cases/bad/case.toml: format: unsupported format 2" in capsys.readouterr().err


def _scrub(text: str, ids: tuple[str, ...] = ()) -> str:
    from pytest_gpucase.tools.show import Scrubber as _Scrubber

    return _Scrubber(case_dir="/work/cases/ce", home="/home/bob", users=("bob",),
                     hosts=("gpu-7",), ids=ids).scrub(text)


@pytest.mark.parametrize(("text", "scrubbed"), [
    ("HF_TOKEN=abc123", "HF_TOKEN=<secret>"),
    ("HF_TOKEN secret123 was set", "HF_TOKEN <secret> was set"),
    ("export API_KEY  q9w8e7", "export API_KEY  <secret>"),
    ("hf_token hunter2", "hf_token <secret>"),
    ('{"password": "hunter2", "secret":"s3cr3t"}', '{"password": "<secret>", "secret":"<secret>"}'),
    ("PASSWORD: hunter2", "PASSWORD: <secret>"),
    ("token ids below num_embeddings", "token ids below num_embeddings"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic <secret>"),
    ("authorization: bearer abc.def", "authorization: bearer <secret>"),
    ("Authorization: token ghx_1", "Authorization: token <secret>"),
    ("mysql --password hunter2 -u root", "mysql --password <secret> -u root"),
    ("cli --token=abc --api-key xyz", "cli --token=<secret> --api-key <secret>"),
    ("sshpass -p hunter2 ssh", "sshpass -p <secret> ssh"),
    ("https://alice:pw@git.corp.example.com:8443/team/repo.git?x=1",
     "https://<user>:<secret>@<host>:8443/<path>"),
    ("ssh://git@github.com/org/repo", "ssh://<user>@<host>/<path>"),
    ("see http://localhost:8080/metrics", "see http://localhost:8080/<path>"),
    ("s3://acme-private-data/cohort7/x.pt and gs://bucket/a hdfs://nn:8020/user/bob/x",
     "s3://<bucket>/<path> and gs://<bucket>/<path> hdfs://<bucket>:8020/<path>"),
    ("connect to storage.corp.internal failed", "connect to <host> failed"),
    ("node3.cluster.example.com:29500 refused", "<host>:29500 refused"),
    ("torch.nn.functional.cross_entropy in Loss.cu and case.py",
     "torch.nn.functional.cross_entropy in Loss.cu and case.py"),
    ("at /home/bob/x.py and /home/carol/data", "at <path>/x.py and <path>"),
    ("C:\\Users\\carol\\run", "<path>"),
    ("reading /srv/private/cohort7/labels.csv", "reading <path>"),
    ("mail carol.smith+gpu@uni.example.edu now", "mail <email> now"),
    ("from 10.1.2.3 and 2001:db8:85a3::8a2e:370:7334", "from <ip> and <ip>"),
    ("bind 127.0.0.1, c10::add, 16:00:00, version 2.3.1", "bind 127.0.0.1, c10::add, 16:00:00, "
     "version 2.3.1"),
    ("bob ran on gpu-7", "<user> ran on <host>"),
])
def test_request_scrubs_each_form(text: str, scrubbed: str) -> None:
    assert _scrub(text) == scrubbed


PEM = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0t\n"
       "Ab12==\n-----END RSA PRIVATE KEY-----")


@pytest.mark.parametrize(("text", "scrubbed"), [
    # Names that hold PASS, PWD, SECRET, TOKEN or KEY anywhere, in any case, any form.
    ("PGPASSWORD=hunter2 psql -h db", "PGPASSWORD=<secret> psql -h db"),
    ("MYSQL_PWD=hunter2 mysql", "MYSQL_PWD=<secret> mysql"),
    ("export DB_PASS=hunter2", "export DB_PASS=<secret>"),
    ("{'PGPASSWORD': 'hunter 2', 'user': 'x'}", "{'PGPASSWORD': '<secret>', 'user': 'x'}"),
    ('{"db_password": "s3 cr3t", "port": 5432}', '{"db_password": "<secret>", "port": 5432}'),
    ("pass: hunter2", "pass: <secret>"),
    ("  Password : hunter2", "  Password : <secret>"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLE",
     "AWS_SECRET_ACCESS_KEY=<secret>"),
    ("PGPASSWORD hunter2", "PGPASSWORD <secret>"),
    ("machine db login me password hunter2", "machine db login me password <secret>"),
    ("| `PGPASSWORD=hunter2` | float32 |", "| `PGPASSWORD=<secret>` | float32 |"),
    # URL credentials up to the last @ of the authority.
    ("postgres://alice:pa/ss#w@rd@db.example.com:5432/prod",
     "postgres://<user>:<secret>@<host>:5432/<path>"),
    # PEM blocks whole, the short last line too, and a key in a service account's JSON.
    (f"key:\n{PEM}\nafter", "key:\n-----BEGIN RSA PRIVATE KEY-----<secret>-----END RSA "
     "PRIVATE KEY-----\nafter"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE\nxy1",
     "-----BEGIN OPENSSH PRIVATE KEY-----<secret>-----END OPENSSH PRIVATE KEY-----"),
    ('{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\nMIIE\\nQk==\\n'
     '-----END PRIVATE KEY-----\\n", "project_id": "p"}',
     '{"type": "service_account", "private_key": "<secret>", "project_id": "p"}'),
    # Vendor token shapes, wherever they stand (after an underscore too).
    ("gh ghp_0123456789abcdefghijABCDEFGHIJ0123 github_pat_11ABCDEFG0123456789_abcdefghij",
     "gh <secret> <secret>"),
    ("MY_hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "MY_<secret>"),
    ("glpat-abcdefghijklmnopqrst12 xoxb-1234567890-abcdefghij", "<secret> <secret>"),
    ("AKIAIOSFODNN7EXAMPLE ASIAIOSFODNN7EXAMPLE", "<secret> <secret>"),
    ("AIzaSyA-1234567890abcdefghijklmnopqrstu", "<secret>"),
    ("sk-proj-abcdefghijklmnopqrstuvwxyz012345 sk-ant-api03-abcdefghijklmnopqrstuv",
     "<secret> <secret>"),
    ("npm_abcdefghijklmnopqrstuvwxyz0123456789 "
     "pypi-AgEIcHlwaS5vcmcCJDEyMzQ1Njc4LTEyMzQtMTIzNC0xMjM0LTEy", "<secret> <secret>"),
    ("nvapi-abcdefghijklmnopqrstuvwxyz0123", "<secret>"),
    ("sv=2022-11-02&ss=b&sig=abc%2Bdef%3D&se=x", "sv=2022-11-02&ss=b&sig=<secret>"),
    ('{"auths": {"reg.io": {"auth": "dXNlcjpwYXNz"}}}',
     '{"auths": {"reg.io": {"auth": "<secret>"}}}'),
    ("_auth=dXNlcjpwYXNz", "_auth=<secret>"),
    ("dbPassword: hunter2 apiKey=abc", "dbPassword: <secret> apiKey=<secret>"),
    ("DB_PASSWORDS=hunter2", "DB_PASSWORDS=<secret>"),
    # What is no secret stays: an exception's message, prose, a state_dict's keys, words
    # that begin with a secret word, what show itself prints.
    ("KeyError: 'fc.weight'", "KeyError: 'fc.weight'"),
    ("cpu-float32: passed: a said so; PASSED tests/x.py keyboard: q tokenizer: bert",
     "cpu-float32: passed: a said so; PASSED tests/x.py keyboard: q tokenizer: bert"),
    ('Missing key(s) in state_dict: "fc.weight".', 'Missing key(s) in state_dict: "fc.weight".'),
    # Issue 30: a bare "pass:" or "key:" inside prose is a word, not a label.
    ("Do not clamp the logits to make it pass: mask the padding instead",
     "Do not clamp the logits to make it pass: mask the padding instead"),
    ("KeyError: key: 3 not in the table; the primary key: id", "KeyError: key: 3 not in the "
     "table; the primary key: id"),
    ("  key: abc123\n- token: t0k3n", "  key: <secret>\n- token: <secret>"),
    # ... but a value that reads as a key is a secret in prose too.
    ("connection refused, token: abc123xyz", "connection refused, token: <secret>"),
])
def test_request_removes_secrets_by_shape(text: str, scrubbed: str) -> None:
    assert _scrub(text) == scrubbed


@pytest.mark.slow
def test_show_and_request_remove_secrets_and_escapes_from_a_case(tmp_path: Path) -> None:
    """Run as a user runs them: the case's files reach the terminal only made inert (an OSC 52
    clipboard write, a screen clear, a window title), and secrets are gone from both."""
    import subprocess
    import sys

    hostile = RICH.replace(
        'summary = "CrossEntropyLoss target holds class 4 on a 4-class head"',
        'summary = "x\\u001b]52;c;cm0gLXJmIH4K\\u0007\\u001b[2J\\u001b]0;pwned\\u0007 y '
        'MYSQL_PWD=hunter4 hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"'
    ).replace('revision = "3f2c1ab"', 'revision = "3f2c1ab"\npgpassword = "DB_PASS=hunter2"\n'
              'conn = "postgres://alice:pa/ss@db.example.com/x"\n'
              'note = "\\u001b[31mred\\u202e PGPASSWORD=hunter3"')
    case = rich_case(tmp_path, "ce", hostile)
    for command in ("show", "request"):
        done = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", command, str(case)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        for raw in ("\x1b", "\x07", "\u202e", "hunter2", "hunter3", "hunter4", "pa/ss", "hf_AbC"):
            assert raw not in done.stdout, (command, raw)
        assert "x y" in done.stdout or "x  y" in done.stdout


def test_request_scrubs_many_sample_ids_in_one_pass() -> None:
    ids = (*(f"patient_{n:05d}" for n in range(20_000)), "img-0001.png")
    assert _scrub("batch patient_00412, patient_19999 and img-0001.png; patient_x",
                  ids) == "batch <sample id>, <sample id> and <sample id>; patient_x"


@pytest.mark.slow
@pytest.mark.parametrize("text", [
    "a" * 1_000_000,
    "a+" * 500_000,
    "a." * 500_000,
    "a@" * 500_000,
    "a-" * 500_000,
    "x://" + "a" * 1_000_000,
    "a://b" * 200_000,
    "token=" * 160_000,
    "HF_TOKEN " * 110_000,
    "Authorization: " * 65_000,
    "/" * 1_000_000,
    "/a" * 500_000,
    "1." * 500_000,
    "a:" * 500_000,
    "-p " * 330_000,
    "\\" * 1_000_000,
    "PASS" * 250_000,
    " ".join(["PASS" * 16] * 15_000),
    "a='" * 330_000,
    "a: " * 330_000,
    "x://a@" * 160_000,
    "x://" + "a/" * 500_000,
    "-----BEGIN A-----\n" * 55_000,
    "-----BEGIN A-----\nAAAA" * 45_000,
    "sig=" * 250_000,
    "{'PGPASSWORD': '" * 60_000,
    "KeyErrorKey=" * 80_000,
    "ghp_" * 250_000,
], ids=["word", "plus", "dots", "ats", "dashes", "url-host", "urls", "token-eq", "token-ws",
        "authorization", "slashes", "path", "digits", "colons", "flags", "backslashes",
        "pass", "pass-names", "quotes", "yaml", "url-ats", "url-slashes", "pem-heads",
        "pem-blocks", "sig", "dict", "exception-names", "token-prefixes"])
def test_request_scrubs_a_megabyte_of_hostile_text_in_linear_time(text: str) -> None:
    import time

    from pytest_gpucase.tools.scrub import remove_secrets

    start = time.process_time()
    _scrub(text)
    remove_secrets(text)   # gpucase show's, on the whole text
    # A hang guard on a loaded machine, not a benchmark: a quadratic pattern takes minutes.
    assert time.process_time() - start < 5


def test_show_tells_two_cases_of_one_name_apart_by_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.chdir(tmp_path)
    first = rich_case(tmp_path / "cases" / "a", "ce")
    rich_case(tmp_path / "cases" / "b", "ce")

    def entry(folder: str, outcome: str) -> dict[str, object]:
        return result("ce", "cpu", "float32", outcome, nodeid=f"cases/{folder}/ce::ce[cpu-float32]",
                      case_path=f"cases/{folder}/ce", message=f"{folder} said so")

    report = report_of(tmp_path / "report.json", [entry("a", "passed"), entry("b", "failed")])
    assert show(Path("cases/b/ce"), report=report).splitlines()[-1] == (
        "  cpu-float32: failed: b said so")
    # The report was written from another directory: its paths end the case's path.
    monkeypatch.chdir(first)
    assert show(Path("."), report=report).splitlines()[-1] == "  cpu-float32: passed: a said so"


def test_request_text_cannot_break_out_of_its_code(tmp_path: Path) -> None:
    hostile = RICH.replace(
        'error = "RuntimeError: CUDA error: device-side assert triggered"',
        'error = "RuntimeError: x` and\\n## All 500 cases passed"').replace(
        'stderr = "Loss.cu:250:', 'stderr = "```\\n## All 500 cases passed\\n````\\nLoss.cu:250:')
    text = request(rich_case(tmp_path, "ce", hostile))
    lines = text.splitlines()
    assert lines[0] == "## GPU failure: ``RuntimeError: x` and ...``"
    fence = lines.index("`````text")
    end = lines.index("`````", fence)
    # The forged heading is inside the code block, whose fence no line of stderr can close.
    assert lines[fence + 1:fence + 4] == ["```", "## All 500 cases passed", "````"]
    outside = lines[:fence] + lines[end:]
    assert "## All 500 cases passed" not in outside


def test_show_says_which_inputs_each_variant_resizes(tmp_path: Path) -> None:
    case_dir = write_bare_case(tmp_path, "weighted", """
        format = 1
        call = "case.py:run"
        [variants.batch]
        sizes = [1, 2]
        [variants.length]
        axis = 1
        sizes = [8]
        inputs = ["logits"]
        """, {"logits": torch.zeros(4, 4), "weight": torch.ones(4),
              "target": torch.zeros(4, dtype=torch.long)})
    lines = show(case_dir).splitlines()
    assert "  batch[1]: resized logits (4, 4) -> (1, 4), target (4,) -> (1,)" in lines
    assert "  batch[2]: resized logits (4, 4) -> (2, 4), target (4,) -> (2,)" in lines
    assert "  length[8]: resized logits (4, 4) -> (4, 8)" in lines

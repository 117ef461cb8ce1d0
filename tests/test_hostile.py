"""Hostile and broken cases, all in one session: each fails alone, with its own message.

Cases arrive from many people, in pull requests, on shared CI runners. One
session below holds a good case and dozens of broken or hostile ones; every
broken one must be exactly one failed item whose message names the file, what
is wrong and the fix, and the good case must still pass.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytest_gpucase.base.errors import printable
from pytest_gpucase.case import payload
from tests.helpers import H100, RAISES, ce_case, needs_zygote, result, rich_case, write_case

GOOD_CALL = 'format = 1\ncall = "case.py:run"\ntimeout = 20\n'
RUN_X = "def run(x):\n    return x + 1\n"


class Marker:
    """A pickle that would leave a file behind if anything ever unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return (open, (self.path, "w"))


def build(root: Path, name: str, toml: str, code: str | None = RUN_X,
          tensors: dict[str, torch.Tensor] | None = None,
          extra: Callable[[Path], None] | None = None) -> None:
    path = write_case(root, name, toml, code, tensors)
    if extra is not None:
        extra(path)


def corrupt_payload(path: Path) -> None:
    data = (path / "inputs.safetensors").read_bytes()
    (path / "inputs.safetensors").write_bytes(data[:-8])


def pickle_payload(path: Path) -> None:
    with open(path / "inputs.safetensors", "wb") as handle:
        pickle.dump({"x": Marker(str(path / "unpickled"))}, handle)


def header_too_long(path: Path) -> None:
    (path / "inputs.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")


def escaping_symlink(path: Path) -> None:
    outside = path.parent.parent / "outside.py"
    outside.write_text(RUN_X)
    (path / "link.py").symlink_to(outside)


def huge_view(path: Path) -> None:
    import json

    header = {"__metadata__": {"gpucase.layout": json.dumps(
        {"x": {"shape": [2**20, 2**20], "stride": [0, 0], "storage_offset": 0}})},
        "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "inputs.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4))


def strides_outside(path: Path) -> None:
    import json

    header = {"__metadata__": {"gpucase.layout": json.dumps(
        {"x": {"shape": [4, 4], "stride": [4, 1], "storage_offset": 0}})},
        "x": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "inputs.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(32))


def huge_offset(path: Path) -> None:
    """220 bytes that asked the child for 2**40 zeros before the stored run."""
    header = {"__metadata__": {"gpucase.layout": json.dumps(
        {"x": {"shape": [2], "stride": [1], "storage_offset": 2**40, "stored_from": 2**40}})},
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "inputs.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8))


def replace_case_toml(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def extra(path: Path) -> None:
        (path / "case.toml").unlink()
        make(path / "case.toml")
    return extra


def replace_payload(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def extra(path: Path) -> None:
        (path / "inputs.safetensors").unlink(missing_ok=True)
        make(path / "inputs.safetensors")
    return extra


def sparse_case_toml(path: Path) -> None:
    with open(path / "case.toml", "r+b") as handle:  # 3 MB that cost no disk
        handle.truncate(3 * 10**6)


ONE = {"x": torch.ones(3)}
# A fork bomb that never has more than 200 processes (a counter in shared memory, under a
# lock every fork takes in turn); past that, each keeps forking children that exit at once.
FORK_BOMB = """import fcntl, mmap, os, tempfile

def run(x):
    counter = mmap.mmap(-1, 8)
    lock = tempfile.TemporaryFile()
    while True:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        count = int.from_bytes(counter[:8], "little")
        grow = count < 200
        if grow:
            counter[:8] = (count + 1).to_bytes(8, "little")
        fcntl.lockf(lock, fcntl.LOCK_UN)
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0 and not grow:
            os._exit(0)
        if pid and not grow:
            os.waitpid(pid, 0)
"""
# A daemon (its own session, no exec) left behind by a child that then dies without a result.
DAEMON_THEN_DIES = """import os, time

def run(x):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    os.wait()
    os._exit(3)
"""
NOT_UTF8 = os.fsdecode(b"name_\xff_not_utf8")
# name -> (case.toml, case.py, tensors, extra step, the line the user must see)
BROKEN: dict[str, tuple[str, str | None, dict[str, torch.Tensor] | None,
                        Callable[[Path], None] | None, str]] = {
    "toml_invalid": ("format = 1\ncall = \n", None, None, None,
                     "cases/toml_invalid/case.toml: invalid TOML: *"),
    "key_unknown": ('format = 1\ncalll = "case.py:run"\n', None, None, None,
                    "cases/key_unknown/case.toml: calll: unknown key; did you mean 'call'?"),
    "format_missing": ('call = "case.py:run"\n', None, None, None,
                       "cases/format_missing/case.toml: format: missing; *"),
    "format_future": ('format = 2\ncall = "case.py:run"\n', None, None, None,
                      "cases/format_future/case.toml: format: unsupported format 2*"),
    "call_missing": ("format = 1\n", None, None, None,
                     "cases/call_missing/case.toml: call: missing; *"),
    "call_malformed": ('format = 1\ncall = "case.py"\n', None, None, None,
                       "cases/call_malformed/case.toml: call: 'case.py' is not *"),
    "call_parent": ('format = 1\ncall = "../x.py:run"\n', None, None, None,
                    "cases/call_parent/case.toml: call: '../x.py' escapes the case directory*"),
    "call_absolute": ('format = 1\ncall = "/etc/x.py:run"\n', None, None, None,
                      "cases/call_absolute/case.toml: call: '/etc/x.py' escapes the case *"),
    "call_symlink": ('format = 1\ncall = "link.py:run"\n', None, None, escaping_symlink,
                     "cases/call_symlink/case.toml: call: 'link.py' resolves outside the case*"),
    "call_file_missing": ('format = 1\ncall = "nope.py:run"\n', None, None, None,
                          "cases/call_file_missing/case.toml: call: 'nope.py' not found*"),
    "timeout_string": ('format = 1\ncall = "case.py:run"\ntimeout = "10"\n', RUN_X, None, None,
                       "cases/timeout_string/case.toml: timeout: expected a number of seconds*"),
    "backend_unknown": (GOOD_CALL + '[matrix]\nbackends = ["rocm7"]\n', RUN_X, None, None,
                        "cases/backend_unknown/case.toml: [[]matrix[]] backends: unknown 'rocm7'; "
                        "expected one of cuda, rocm, cpu, mps, xpu"),
    "specifier_bad": (GOOD_CALL + '[matrix]\ntorch = ">=two"\n', RUN_X, None, None,
                      "cases/specifier_bad/case.toml: [[]matrix[]] torch: *PEP 440*"),
    "rtol_alone": (GOOD_CALL + "[expect.tolerance.bfloat16]\nrtol = 0.1\n", RUN_X, None, None,
                   "cases/rtol_alone/case.toml: [[]expect.tolerance.bfloat16[]] rtol: given "
                   "without atol; give both rtol and atol, or neither"),
    "raises_no_type": (GOOD_CALL + '[expect]\noutcome = "raises"\n', RUN_X, None, None,
                       "cases/raises_no_type/case.toml: [[]expect[]] exception: missing*"),
    "regex_bad": (GOOD_CALL + '[expect]\noutcome = "raises"\nexception = "E"\nmatch = "("\n',
                  RUN_X, None, None,
                  "cases/regex_bad/case.toml: [[]expect[]] match: invalid regular expression*"),
    "payload_empty": (GOOD_CALL, RUN_X, None,
                      lambda p: (p / "inputs.safetensors").write_bytes(b""),
                      "cases/payload_empty/inputs.safetensors: *"),
    "payload_truncated": (GOOD_CALL, RUN_X, ONE, corrupt_payload,
                          "cases/payload_truncated/inputs.safetensors: *"),
    "payload_header_long": (GOOD_CALL, RUN_X, None, header_too_long,
                            "cases/payload_header_long/inputs.safetensors: *"),
    "payload_pickle": (GOOD_CALL, RUN_X, None, pickle_payload,
                       "cases/payload_pickle/inputs.safetensors: *pickle*"),
    "payload_huge": (GOOD_CALL, RUN_X, None, huge_view,
                     "cases/payload_huge/inputs.safetensors: *refusing to allocate*"),
    "payload_strides": (GOOD_CALL, RUN_X, None, strides_outside,
                        "cases/payload_strides/inputs.safetensors: tensor 'x': its view *"),
    "hash_mismatch": (GOOD_CALL + 'inputs_sha256 = "sha256:' + "0" * 64 + '"\n', RUN_X, ONE, None,
                      "cases/hash_mismatch/inputs.safetensors: content hash sha256:* differs "
                      "from inputs_sha256 in case.toml*"),
    "import_fails": (GOOD_CALL, "import not_a_module_anywhere\n", ONE, None,
                     "cases/import_fails/case.toml: call: importing 'case.py' failed"),
    "target_missing": ('format = 1\ncall = "case.py:nope"\n', RUN_X, ONE, None,
                       "cases/target_missing/case.toml: call: 'case.py' has no 'nope'; *"),
    "target_not_callable": ('format = 1\ncall = "case.py:VALUE"\n', "VALUE = 3\n", ONE, None,
                            "cases/target_not_callable/case.toml: call: 'case.py:VALUE' is a "
                            "int, not a function"),
    "literal_clash": (GOOD_CALL + "[inputs]\nx = 3\n", RUN_X, ONE, None,
                      "cases/literal_clash/case.toml: [[]inputs[]]: x given both here and in "
                      "inputs.safetensors; keep one"),
    "signature_wrong": (GOOD_CALL, "def run(y):\n    return y\n", ONE, None,
                        "cases/signature_wrong/inputs.safetensors: tensor 'x' is not a parameter "
                        "of case.py:run(y); save the tensor under a parameter's name, or add the "
                        "parameter"),
    "tensor_missing": (GOOD_CALL, "def run(x, mask):\n    return x\n", ONE, None,
                       "cases/tensor_missing/case.toml: parameter 'mask' of case.py:run has no "
                       "value: add it to [[]inputs[]] or as a tensor in inputs.safetensors "
                       "(holds: x)"),
    "literal_extra": (GOOD_CALL + "[inputs]\ntemperature = 1.0\n", RUN_X, ONE, None,
                      "cases/literal_extra/case.toml: [[]inputs[]] 'temperature' is not a "
                      "parameter of case.py:run(x); remove it or add the parameter"),
    "deep_arrays": (GOOD_CALL + "[origin]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n", RUN_X,
                    None, None, "cases/deep_arrays/case.toml: arrays or tables nest deeper than 32 "
                    "levels; *"),
    "deep_tables": (GOOD_CALL + "[origin]\nx = " + "{a = " * 100_000 + "1" + "}" * 100_000
                    + "\n", RUN_X, None, None,
                    "cases/deep_tables/case.toml: arrays or tables nest deeper than 32 levels; *"),
    "int_over_64_bits": ('format = 1\ncall = "case.py:run"\ntimeout = ' + "9" * 30 + "\n", RUN_X,
                         None, None, "cases/int_over_64_bits/case.toml: timeout: integer * does "
                         "not fit in 64 bits; write a smaller number"),
    "int_of_5000_digits": ('format = 1\ncall = "case.py:run"\ntimeout = ' + "9" * 5000 + "\n",
                           RUN_X, None, None,
                           "cases/int_of_5000_digits/case.toml: invalid TOML: Exceeds the limit*"),
    "timeout_years": ('format = 1\ncall = "case.py:run"\ntimeout = 1e12\n', RUN_X, None, None,
                      "cases/timeout_years/case.toml: timeout: 1e+12 seconds is over the limit *"),
    "payload_fifo": (GOOD_CALL, RUN_X, None, replace_payload(os.mkfifo),
                     "cases/payload_fifo/inputs.safetensors: is a FIFO (named pipe), not a "
                     "regular file; *"),
    "payload_dev_zero": (GOOD_CALL, RUN_X, None,
                         replace_payload(lambda f: f.symlink_to("/dev/zero")),
                         "cases/payload_dev_zero/inputs.safetensors: is a symlink to "
                         "/dev/zero, outside the case directory; replace it with the file "
                         "itself"),
    "payload_offset_huge": (GOOD_CALL, RUN_X, None, huge_offset,
                            "cases/payload_offset_huge/inputs.safetensors: tensor 'x': layout "
                            "storage_offset 1099511627776 is over the limit of *; refusing to "
                            "allocate"),
    "toml_fifo": (GOOD_CALL, RUN_X, None, replace_case_toml(os.mkfifo),
                  "cases/toml_fifo/case.toml: is a FIFO (named pipe), not a regular file; *"),
    "toml_dev_zero": (GOOD_CALL, RUN_X, None,
                      replace_case_toml(lambda f: f.symlink_to("/dev/zero")),
                      "cases/toml_dev_zero/case.toml: is a symlink to /dev/zero, outside the case "
                      "directory; *"),
    "toml_dangling": (GOOD_CALL, RUN_X, None,
                      replace_case_toml(lambda f: f.symlink_to("gone.toml")),
                      "cases/toml_dangling/case.toml: is a symlink to gone.toml, which does not "
                      "exist; *"),
    "toml_loop": (GOOD_CALL, RUN_X, None,
                  replace_case_toml(lambda f: f.symlink_to("case.toml")),
                  "cases/toml_loop/case.toml: is a symlink to case.toml that leads back to "
                  "itself (a loop); replace it with the file itself"),
    "payload_loop": (GOOD_CALL, RUN_X, None,
                     replace_payload(lambda f: f.symlink_to("inputs.safetensors")),
                     "cases/payload_loop/inputs.safetensors: is a symlink to inputs.safetensors "
                     "that leads back to itself (a loop); replace it with the file itself"),
    "toml_directory": (GOOD_CALL, RUN_X, None, replace_case_toml(Path.mkdir),
                       "cases/toml_directory/case.toml: is a directory, not a regular file; *"),
    "toml_3_mb": (GOOD_CALL, RUN_X, None, sparse_case_toml,
                  "cases/toml_3_mb/case.toml: is 3000000 bytes, over the limit of 1048576; *"),
    "length_1e9": (GOOD_CALL + "[variants]\nlength = { axis = 0, sizes = [1000000000] }\n", RUN_X,
                   ONE, None, "cases/length_1e9/case.toml: [[]variants.length[]] sizes: 1000000000 "
                   "is over the limit of 1048576; *"),
    "sizes_20000": (GOOD_CALL + "[variants]\nbatch = { sizes = "
                    + str(list(range(1, 20_001))) + " }\n", RUN_X, ONE, None,
                    "cases/sizes_20000/case.toml: [[]variants.batch[]] sizes: lists 20000 sizes, "
                    "over the limit of 64; *"),
    "exits_zero": (GOOD_CALL, "import os\n\ndef run(x):\n    os._exit(0)\n", ONE, None,
                   "cases/exits_zero/case.toml: run exited with code 0 without returning a "
                   "result"),
    "segfaults": (GOOD_CALL, "import os, signal\n\ndef run(x):\n"
                  "    os.kill(os.getpid(), signal.SIGSEGV)\n", ONE, None,
                  "cases/segfaults/case.toml: run crashed with signal 11 (SIGSEGV)"),
    "ignores_sigterm": ('format = 1\ncall = "case.py:run"\ntimeout = 1\n',
                        "import signal, time\n\ndef run(x):\n"
                        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(600)\n",
                        ONE, None, "cases/ignores_sigterm/case.toml: run timed out after 1 s*"),
    "grandchildren_hang": ('format = 1\ncall = "case.py:run"\ntimeout = 1\n',
                           "import os, time\n\ndef run(x):\n    os.fork()\n    time.sleep(600)\n",
                           ONE, None,
                           "cases/grandchildren_hang/case.toml: run timed out after 1 s*"),
    "fork_bomb": ('format = 1\ncall = "case.py:run"\ntimeout = 2\n', FORK_BOMB, ONE, None,
                  "cases/fork_bomb/case.toml: run timed out after 2 s*"),
    "daemon_then_dies": (GOOD_CALL, DAEMON_THEN_DIES, ONE, None,
                         "cases/daemon_then_dies/case.toml: run exited with code 3 without "
                         "returning a result"),
    "floods_output": (GOOD_CALL, "import sys\n\ndef run(x):\n    for _ in range(200000):\n"
                      "        sys.stdout.write('y' * 1000 + '\\n')\n    raise ValueError('after "
                      "the flood')\n", ONE, None,
                      "the call raised ValueError: after the flood"),
    "output_unpicklable_type": (GOOD_CALL + 'reference = "case.py:ref"\n',
                                "def run(x):\n    return lambda: x\n\ndef ref(x):\n"
                                "    return x\n", ONE, None,
                                "outputs differ from the reference*"),
}


def test_each_broken_case_fails_alone_with_its_message(pytester: pytest.Pytester) -> None:
    broken_cases_fail_alone(pytester)


def test_each_broken_case_fails_alone_in_a_reused_worker_too(pytester: pytest.Pytester) -> None:
    """One worker serves the whole table: each case that crashes, hangs, forks or leaves a
    daemon ends it, and the next case gets the verdict and message a fresh child gives."""
    broken_cases_fail_alone(pytester, "--gpu-isolation", "worker")


def broken_cases_fail_alone(pytester: pytest.Pytester, *args: str) -> None:
    ce_case(pytester.path, "good", [0, 2, 4], RAISES)
    for name, (toml, code, tensors, extra, _) in BROKEN.items():
        build(pytester.path, name, toml, code, tensors, extra)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-p",
                                           "no:cacheprovider", "--gpu-cases-report",
                                           "report.json", *args, "cases", timeout=600)
    result.assert_outcomes(passed=1, failed=len(BROKEN))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    for name, (*_, message) in BROKEN.items():
        section = text.split(f"_ {name}")[1].split("\n____")[0]
        assert any(fnmatch.fnmatch(line, message) for line in section.splitlines()), (
            name, section[:2000])
    assert not (pytester.path / "cases" / "payload_pickle" / "unpickled").exists()
    # The flood was bounded: its captured stdout kept the head and the tail only.
    flood = text.split("_ floods_output")[1].split("\n____")[0]
    assert "bytes omitted" in flood and len(flood) < 200_000
    report = json.loads((pytester.path / "report.json").read_text(encoding="utf-8"))
    assert report["complete"] is True
    assert {entry["case"] for entry in report["results"]} >= {"good", "tensor_missing"}


def test_a_directory_name_that_is_not_utf8(pytester: pytest.Pytester) -> None:
    """A broken one is one item with a printable name; a good one runs and is in the report.

    pytest itself prints the node id with the name's raw bytes, which
    pytester cannot decode: the session's output is read here as bytes.
    """
    ce_case(pytester.path, NOT_UTF8, [0, 2, 4], RAISES)
    build(pytester.path, NOT_UTF8 + "_broken", 'format = 1\ncall = "case.py:run"\ntimeout = 0\n')
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--gpu-cases", "--gpu-devices", "cpu", "-p",
         "no:cacheprovider", "--gpu-cases-report", "report.json", "-rf", "cases"],
        cwd=pytester.path, capture_output=True, timeout=600, check=False)
    text = done.stdout.decode("utf-8", "backslashreplace")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, text
    assert "1 failed, 1 passed" in text
    shown = printable(NOT_UTF8)
    assert (f"cases/{shown}_broken/case.toml: timeout: must be a positive number of seconds, "
            "got 0" in text)
    report = json.loads((pytester.path / "report.json").read_text(encoding="utf-8"))
    assert report["complete"] is True
    entries = sorted((entry["case"], entry["case_path"], entry["outcome"])
                     for entry in report["results"])
    assert entries == [(shown, f"cases/{shown}", "passed"),
                       (f"{shown}_broken", f"cases/{shown}_broken", "failed")]


# ----------------------------------------------------------------------------- hostile reports
# Reports arrive as artifacts of other CI jobs: any file, any content. Every reader
# (gpucase matrix, gpucase show --report) refuses a bad one in one line naming the file,
# with exit status 2, in bounded time and memory, and never with a traceback.


def _report_text(change: Callable[[dict[str, object]], object] | None = None) -> str:

    report = {"schema": "pytest-gpucase/report", "version": 1,
              "created": "2026-12-02T16:00:00+00:00", "environment": H100,
              "results": [result("ce", "cuda", "float32", "passed")], "complete": True}
    report = json.loads(json.dumps(report))
    if change is not None:
        change(report)
    return json.dumps(report)


def _written(text: str | bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        if isinstance(text, str):
            path.write_text(text, encoding="utf-8")
        else:
            path.write_bytes(text)
    return make


def _sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with open(path, "wb") as handle:  # gigabytes that cost no disk
            handle.truncate(size)
    return make


def _cpu_only(report: dict[str, object]) -> None:
    from pytest_gpucase.plan.environment import Environment

    report["environment"] = Environment(backend="cpu", device_types=("cpu",)).to_dict()


def _result(**fields: object) -> Callable[[dict[str, object]], None]:
    return lambda report: report["results"][0].update(fields)  # type: ignore[index]


# name -> (how the file is made, the one line gpucase matrix prints after "gpucase: <file>: ")
HOSTILE_REPORTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (os.mkfifo, "is a FIFO (named pipe), not a regular file; give the JSON report that "
             "--gpu-cases-report wrote"),
    "dev_zero": (lambda p: p.symlink_to("/dev/zero"),
                 "is a character device, not a regular file; *"),
    "directory": (Path.mkdir, "is a directory, not a regular file; *"),
    "three_gb": (_sparse(3 * 10**9), "is 3000000000 bytes, over the limit of 134217728 for a "
                 "report"),
    "nested_arrays": (_written("[" * 200_000 + "]" * 200_000),
                      "not a pytest-gpucase report: arrays and objects nest deeper than 32 "
                      "levels"),
    "nested_objects": (_written('{"a": ' * 100_000 + "1" + "}" * 100_000),
                       "not a pytest-gpucase report: arrays and objects nest deeper than 32 *"),
    "unclosed_arrays": (_written("[" * 200_000), "not a pytest-gpucase report: arrays and "
                        "objects nest deeper than 32 levels"),
    "nested_in_unknown_key": (_written(_report_text(
        lambda r: r.update(extra=json.loads("[" * 40 + "]" * 40)))),
        "not a pytest-gpucase report: arrays and objects nest deeper than 32 levels"),
    "int_of_5000_digits": (_written(_report_text().replace('"duration": 0.25',
                                                           '"duration": ' + "9" * 5000)),
                           "not a pytest-gpucase report: an integer of 5000 digits; *"),
    "float_overflow": (_written(_report_text().replace('"duration": 0.25', '"duration": 1e999')),
                       "not a pytest-gpucase report: 1e999 overflows a float; *"),
    "nan": (_written(_report_text().replace('"duration": 0.25', '"duration": NaN')),
            "not a pytest-gpucase report: NaN is not JSON; *"),
    "duplicate_key": (_written(_report_text().replace('"outcome": "passed"',
                                                      '"outcome": "failed", "outcome": "passed"')),
                      'not a pytest-gpucase report: the key "outcome" appears twice in one '
                      "object"),
    "duplicate_item": (_written(_report_text(lambda r: r["results"].append(  # type: ignore
        dict(r["results"][0], outcome="failed")))),  # type: ignore[index]
        'results[[]1[]].nodeid: "cases/ce::ce[[]cuda-float32[]]" is the node id of results[[]0[]] '
        "too; a report holds each item once"),
    "cuda_pass_from_cpu_runner": (_written(_report_text(_cpu_only)),
                                  'results[[]0[]]: passed on "cuda", a device type its '
                                  'environment does not have (device_types: "cpu"): a run '
                                  "that cannot have happened there"),
    "cuda_pass_said_lost": (_written(_report_text(lambda r: (
        _cpu_only(r), r["results"][0].update(error_type="WorkerCrash")))),  # type: ignore
        'results[[]0[]]: passed on "cuda", a device type its environment does not have *'),
    "pass_on_all": (_written(_report_text(lambda r: (
        _cpu_only(r), r["results"][0].update(device="all")))),  # type: ignore[index]
        'results[[]0[]]: passed on "all", a device type its environment does not have *'),
    "accelerator_without_device": (_written(_report_text(
        lambda r: r["environment"].update(devices=[]))),  # type: ignore[attr-defined]
        'environment.device_types names "cuda" but environment.devices lists no device: *'),
    "string_of_2_mib": (_written(_report_text(_result(case="x" * 2**21))),
                        "not a pytest-gpucase report: a string of 2097152 characters, over the "
                        "limit of 1048576"),
    "not_utf8": (_written(b'{"schema": "\xff"}'), "cannot read: not UTF-8 (invalid start byte "
                 "at byte 12)"),
    "device_an_object": (_written(_report_text(_result(device={"cuda": True}))),
                         "results[[]0[]].device: expected a string, found an object"),
    "outcome_a_megabyte": (_written(_report_text(_result(outcome="p" * 10**6))),
                           'results[[]0[]].outcome: "ppppp*… is not one of passed, *'),
}


@pytest.mark.slow
def test_each_hostile_report_is_refused_in_one_line(tmp_path: Path) -> None:
    """All of them in one gpucase matrix: each named on a line of its own, exit 2, in
    seconds (a FIFO blocked forever, 3 GB were read whole, 200,000 nested arrays and a
    5,000-digit number raised tracebacks, a duplicate key read as a pass)."""
    import time

    paths = []
    for name, (make, _) in HOSTILE_REPORTS.items():
        make(tmp_path / f"{name}.json")
        paths.append(tmp_path / f"{name}.json")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "matrix", *map(str, paths)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert time.monotonic() - began < 120
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == len(HOSTILE_REPORTS), done.stderr
    for line, (name, (_, message)) in zip(lines, HOSTILE_REPORTS.items(), strict=True):
        assert fnmatch.fnmatch(line, f"gpucase: {tmp_path / name}.json: {message}"), (name, line)


@pytest.mark.slow
def test_gpucase_show_refuses_a_hostile_report_the_same_way(tmp_path: Path) -> None:

    case = rich_case(tmp_path / "cases")
    for name in ("fifo", "nested_arrays", "duplicate_key", "cuda_pass_from_cpu_runner"):
        make, message = HOSTILE_REPORTS[name]
        report = tmp_path / f"{name}.json"
        make(report)
        done = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "show", str(case),
                               "--report", str(report)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and done.stdout == "", (name, done.stderr)
        (line,) = done.stderr.splitlines()
        assert fnmatch.fnmatch(line, f"gpucase show: --report {report}: {message}"), line


@pytest.mark.slow
def test_a_refusal_is_one_inert_line_whatever_the_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "evil\x1b]0;owned\x07\nname\u202e.json"
    path.write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "matrix", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line
    assert line.endswith("name\\u202e.json: not JSON: Expecting property name enclosed in "
                         "double quotes at line 1 column 2")


def _matrix_of(paths: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "matrix",
                           *map(str, paths), *args],
                          capture_output=True, text=True, timeout=300, check=False)


def _report_file(path: Path, environment: dict[str, object],
                 results: list[dict[str, object]]) -> Path:
    from pytest_gpucase.report.file import new_report, write_report

    report = new_report(environment, created="2026-12-02T16:00:00+00:00")
    report.update(results=results, complete=True)
    write_report(path, report)
    return path


@pytest.mark.slow
def test_html_grows_with_the_reports_not_with_their_product(tmp_path: Path) -> None:
    """0.4 MB of reports made 110 MB of HTML (each column's label in every cell's title),
    and a 100 MB message 200 MB: labels are said once per column now, a message is cut as
    the writer cuts a run's text (and a string over a mebibyte refused: string_of_2_mib)."""

    paths = []
    for n in range(12):   # a long label that tells the columns apart: a package version
        env = dict(H100, packages={"ext": f"{n}." + "9" * 4000})
        rows = [result(f"case{i:03}", "cuda", "float32", "failed" if i % 2 else "passed",
                       message=f"failure {i}") for i in range(300)]
        paths.append(_report_file(tmp_path / f"r{n}.json", env, rows))
    flood = [result("flood", "cuda", "float32", "failed", message="y" * 10**6)]
    paths.append(_report_file(tmp_path / "flood.json", H100, flood))
    given = sum(path.stat().st_size for path in paths[:-1])
    output = tmp_path / "matrix.html"
    done = _matrix_of(paths, "--format", "html", "-o", str(output))
    assert done.returncode == 0, done.stderr
    page = output.read_text(encoding="utf-8")
    assert len(page) < given + 2**20, (len(page), given)
    # Each column's label and environment, in its header and in the list of environments.
    assert page.count("9" * 4000) == 4 * 12
    assert "bytes omitted" in page and page.count("y" * 1000) < 40


@pytest.mark.slow
def test_no_escape_or_bidi_override_reaches_the_html_or_the_terminal(tmp_path: Path) -> None:

    forged = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\u202eok\u2066"
    env = dict(H100, platform=f"Linux{forged}", packages={"ext": f"1{forged}"})
    rows = [result(f"ce{forged}", "cuda", "float32", "failed", message=f"boom {forged}",
                   case_path=f"cases/{forged}"),
            result("skipped", "cuda", "float32", "skipped", skip_reason=f"why {forged}")]
    path = _report_file(tmp_path / "r.json", env, rows)
    other = _report_file(tmp_path / "s.json", dict(H100, packages={"ext": "2"}), rows[:1])
    for form in ("html", "markdown"):
        done = _matrix_of([path, other], "--format", form)
        assert done.returncode == 0, done.stderr
        for control in ("\x1b", "\x07", "\u202e", "\u2066"):
            assert control not in done.stdout, (form, control)
        assert "\\u202eok" in done.stdout


@pytest.mark.slow
def test_a_megabyte_node_id_and_thousands_of_devices_cost_seconds(tmp_path: Path) -> None:
    """The run-id pattern was quadratic in a node id's length (a 1 MB one: 50 minutes), and
    each cell scanned its runs once per device type (quadratic in their number)."""
    import time

    # The failing run is named in its cell's reason (the other CUDA run passed): its run id
    # is read from its node id.
    long_id = "a[" * 500_000
    rows = [result("ce", "cuda", "float32", "failed", message="boom", nodeid=long_id),
            result("ce", "cuda", "bfloat16", "passed"),
            *(result("ce", f"dev{n}", "float32", "skipped", skip_reason="not here")
              for n in range(40_000))]
    path = _report_file(tmp_path / "r.json", H100, rows)
    began = time.monotonic()
    done = _matrix_of([path])
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 60
    assert "dev39999: skipped" in done.stdout
    assert "cuda-float32: failed: boom" in done.stdout   # the fields, where the id has none


@pytest.mark.slow
def test_version_strings_of_any_digits_are_only_shown(tmp_path: Path) -> None:
    """int() on "²" ("²".isdigit() is True) and on 5,000 digits raised a traceback."""

    rows = [result("ce", "cuda", "float32", "passed")]
    paths = [_report_file(tmp_path / f"r{n}.json", dict(H100, cudnn=cudnn, cuda=cuda), rows)
             for n, (cudnn, cuda) in enumerate([("²", "¹².⁴"), ("9" * 5000, "1" * 5000 + ".2"),
                                                ("90100", "12.4")])]
    done = _matrix_of(paths)
    assert done.returncode == 0, done.stderr
    assert "cuDNN ²" in done.stdout and "CUDA ¹².⁴" in done.stdout and "cuDNN 9.1.0" in done.stdout


@pytest.mark.slow
def test_many_reports_naming_many_packages_cost_seconds(tmp_path: Path) -> None:
    """Each column's label was made from every package any report named (environments ×
    packages), and every report's packages were rebuilt for each column it was compared
    with."""
    import time

    paths = [_report_file(tmp_path / f"r{n}.json",
                          dict(H100, revision=f"r{n}",
                               packages={f"ext{n}-{p}": "1.0" for p in range(400)}),
                          [result("ce", "cuda", "float32", "passed")])
             for n in range(400)]
    began = time.monotonic()
    done = _matrix_of(paths, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 60
    columns = json.loads(done.stdout)["columns"]
    assert len(columns) == 400 and columns[0]["label"].startswith("ext0-0 1.0 · ext0-1 1.0")


# Round four: what the pytest process and the CLI read from a case, and run of it.

SIDE_EFFECT = "import pathlib\npathlib.Path({path!r}).write_text('ran')\n"
CASE_TOML = 'format = 1\ncall = "case.py:run"\ntimeout = 20\n[inputs]\nx = 1\n'


def _pytest_files_cases(root: Path) -> dict[str, str]:
    """Case folders holding what pytest itself imports or reads, each leaving a file behind
    if pytest ever ran it; name -> the line the user must see."""
    expected = {}
    for name, file in (("conftest", "conftest.py"), ("test_named", "conftest.py"),
                       ("package", "__init__.py"), ("ini", "pytest.ini"),
                       ("pyproject", "pyproject.toml"), ("tox", "tox.ini"),
                       ("setup", "setup.cfg"), ("toml", "pytest.toml")):
        path = write_case(root, name, CASE_TOML, RUN_X)
        marker = str(root / f"ran_{name}")
        if file.endswith(".py"):
            (path / file).write_text(SIDE_EFFECT.format(path=marker))
        else:   # a configuration that would load a plugin of the case's own
            (path / "evil_plugin.py").write_text(SIDE_EFFECT.format(path=marker))
            (path / file).write_text("[pytest]\naddopts = -p evil_plugin\npythonpath = .\n")
        expected[name] = f"cases/{name}/{file}: *"
    nested = write_case(root, "outer", CASE_TOML, RUN_X)
    write_case(nested, "inner", CASE_TOML, RUN_X)
    expected["outer"] = ("cases/outer/cases/inner/case.toml: a case folder inside the case "
                         "folder outer: *")
    return expected


@pytest.mark.parametrize("args", [(), ("--collect-only",)], ids=["run", "collect-only"])
def test_no_file_of_a_case_folder_runs_in_the_pytest_process(pytester: pytest.Pytester,
                                                              args: tuple[str, ...]) -> None:
    """A conftest.py, __init__.py or pytest configuration in a case folder is never imported
    or read: the case is one broken item naming the file, and validate says the same."""
    (pytester.path / "pytest.ini").write_text("[pytest]\n")
    expected = _pytest_files_cases(pytester.path)
    write_case(pytester.path, "good", CASE_TOML, RUN_X)
    # Given as folders too: pytest imports the conftests of the folders it is given (and
    # of their test* subfolders) before collection starts.
    result = pytester.runpytest_subprocess(
        "--gpu-cases", "--gpu-devices", "cpu", "-p", "no:cacheprovider", *args, "cases",
        "cases/conftest", "cases/test_named/case.toml", timeout=300)
    assert not list(pytester.path.glob("ran_*")), result.stdout.str()
    if not args:
        result.assert_outcomes(passed=1, failed=len(expected))
        text = result.stdout.str()
        for name, line in expected.items():
            section = text.split(f"_ {name} (broken case)")[1].split("\n____")[0]
            assert any(fnmatch.fnmatch(got, line) for got in section.splitlines()), section
    validated = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "validate", "cases"],
                               cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert validated.returncode == 1, validated.stdout + validated.stderr
    lines = validated.stdout.splitlines()
    for name, line in expected.items():
        assert any(fnmatch.fnmatch(got, line) for got in lines), (name, lines)
    assert not list(pytester.path.glob("ran_*"))
    if args:
        return
    # Given the case folder itself, pytest takes its pytest.ini before any plugin loads (and
    # applies its pythonpath and -p): the session stops at once, naming the file.
    alone = pytester.runpytest_subprocess("--gpu-cases", "-p", "no:cacheprovider",
                                          "cases/ini", timeout=300)
    assert alone.ret == pytest.ExitCode.USAGE_ERROR
    alone.stderr.fnmatch_lines(["ERROR: cases/ini/pytest.ini: pytest took its configuration "
                                "from a file inside a case folder*"])


def test_without_gpu_cases_no_case_folder_code_is_imported_by_other_collectors(
        pytester: pytest.Pytester) -> None:
    """A project whose ini adds --doctest-modules: its plain ``pytest`` run imported a case
    folder's case.py, __init__.py and conftest.py in the pytest process (without
    --gpu-cases nothing of gpucase collected, and the doctest collector imported them)."""
    (pytester.path / "pytest.ini").write_text("[pytest]\naddopts = --doctest-modules\n")
    (pytester.path / "test_unit.py").write_text("def test_ok():\n    pass\n")
    path = write_case(pytester.path, "from_pr", CASE_TOML, RUN_X)
    for file in ("case.py", "__init__.py", "conftest.py", "test_x.py"):
        marker = str(pytester.path / f"ran_{file}")
        (path / file).write_text(SIDE_EFFECT.format(path=marker) + RUN_X)
    for args in ((), ("cases",), ("cases/from_pr/case.py",)):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=300)
        assert not list(pytester.path.glob("ran_*")), (args, result.stdout.str())
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.slow  # an interpreter of its own
def test_validate_survives_a_case_too_deep_to_parse(tmp_path: Path) -> None:
    """A 600 KB `Y = 1+1+...` case.py (RecursionError, or MemoryError, in the parser) is one
    line for its case; the other cases are still checked."""
    deep = write_case(tmp_path, "deep", CASE_TOML, "Y = " + "+".join(["1"] * 300_000)
                      + "\n" + RUN_X)
    write_case(tmp_path, "good", CASE_TOML, RUN_X)
    write_case(tmp_path, "typo", CASE_TOML.replace("call", "calll"), RUN_X)
    result = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "validate", "cases"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert result.returncode == 2, result.stdout + result.stderr[-2000:]  # one not checked
    assert [line for line in lines if line.startswith("cases/deep/")] == [
        "cases/deep/case.py: cannot be parsed (RecursionError: maximum recursion depth "
        "exceeded during ast construction); Python itself will fail to import it: write it "
        "in plainer statements"], lines
    assert any(line.startswith("cases/typo/case.toml: calll: unknown key") for line in lines)
    assert deep.exists()


def _safetensors(header: dict[str, object], data: bytes = b"", pad: int = 0) -> bytes:
    raw = json.dumps(header).encode() + b" " * pad
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


FLOAT = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def _blob(store: Path, data: bytes) -> str:
    store.mkdir(parents=True, exist_ok=True)
    digest = __import__("hashlib").sha256(data).hexdigest()
    (store / f"{digest}.safetensors").write_bytes(data)
    return digest


def _store_case(root: Path, blob: bytes, names: tuple[str, ...] = ("w",),
                store_extra: Callable[[Path], None] | None = None) -> Path:
    """A case of a capture folder whose payload keeps its tensors in the capture's store."""
    store = root / "capture" / "cases" / ".gpucase-store"
    digest = _blob(store, blob)
    if store_extra is not None:
        store_extra(store / f"{digest}.safetensors")
        data = (store / f"{digest}.safetensors").read_bytes()
        (store / f"{digest}.safetensors").unlink()
        digest = _blob(store, data)
    case = write_case(root / "capture", "c", 'format = 1\ncall = "case.py:run"\n',
                      f"def run({', '.join(names)}):\n    return {names[0]}\n")
    (case / "inputs.safetensors").write_bytes(_safetensors(
        {"__metadata__": {"gpucase.store": json.dumps(dict.fromkeys(names, digest))}}))
    return case


def _holes(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(8 * 2**20)


PLAIN_BLOB = _safetensors({"tensor": FLOAT}, b"\0\0\x80?")
HOSTILE_STORE_FILES: dict[str, tuple[bytes, Callable[[Path], None] | None, str]] = {
    "names_another_store_file": (
        b"", None, "*holds tensor (metadata: gpucase.store): a store file holds exactly one "
        "tensor 'tensor' and no store reference; not a store file; capture the case again"),
    "two_tensors": (_safetensors({"tensor": FLOAT, "more": {**FLOAT, "data_offsets": [4, 8]}},
                                 bytes(8)), None, "*holds more, tensor (metadata: none)*"),
    "header_of_100_kb": (_safetensors({"tensor": FLOAT}, bytes(4), pad=100_000), None,
                         "*header of 100* bytes is not within the 65536 a store file's holds*"),
    "trailing_holes": (PLAIN_BLOB, _holes, "*is 8388608 bytes, not the * of its header and "
                       "the 4 of its tensor; not a store file; capture the case again"),
}


@pytest.mark.parametrize("kind", HOSTILE_STORE_FILES)
def test_a_store_file_is_checked_as_one_before_use(tmp_path: Path, kind: str) -> None:
    """Exactly one tensor, no store reference, a small header, a size of exactly header and
    data: else refused by validate and by a load, before any hash or recursion."""
    from pytest_gpucase.base.errors import CaseFormatError
    from pytest_gpucase.case import payload
    from pytest_gpucase.tools.validate import validate

    blob, extra, message = HOSTILE_STORE_FILES[kind]
    if kind == "names_another_store_file":
        inner = _blob(tmp_path / "capture" / "cases" / ".gpucase-store", PLAIN_BLOB)
        blob = _safetensors({"__metadata__": {"gpucase.store": json.dumps({"v": inner})},
                             "tensor": FLOAT}, b"\0\0\x80?")
    case = _store_case(tmp_path, blob, store_extra=extra)
    os.chdir(tmp_path)
    problems = validate([case])
    assert any(fnmatch.fnmatch(line, message) for line in problems), problems
    with pytest.raises(CaseFormatError) as refused:
        payload.load(case / "inputs.safetensors")
    assert fnmatch.fnmatch(str(refused.value), message), str(refused.value)


def test_a_store_file_named_for_thousands_of_tensors_is_read_once(tmp_path: Path) -> None:
    """Collection describes each payload: one store file named 3,000 times (with a header
    near its bound) is read once, not once per name."""
    from pytest_gpucase.case import payload

    names = tuple(f"t{i}" for i in range(3000))
    case = _store_case(tmp_path, _safetensors({"tensor": FLOAT}, b"\0\0\x80?", pad=60_000),
                       names)
    io = Path("/proc/self/io")
    if not io.exists():
        pytest.skip("needs /proc/self/io to count the bytes read")

    def read_so_far() -> int:
        return int(dict(line.split(": ") for line in io.read_text().splitlines())["rchar"])

    before = read_so_far()
    infos = payload.describe(case / "inputs.safetensors")
    assert len(infos) == 3000 and {info.shape for info in infos} == {(1,)}
    assert read_so_far() - before < 2_000_000  # a 60 KB header 3,000 times: 180 MB


def test_a_checkpoints_metadata_never_leads_outside_its_folder(tmp_path: Path) -> None:
    """A downloaded .safetensors checkpoint naming ../.gpucase-store files is refused; the
    store beside its folder is never read."""
    from pytest_gpucase.tools.checkpoint import survey

    digest = _blob(tmp_path / ".gpucase-store", PLAIN_BLOB)
    folder = tmp_path / "downloads"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(_safetensors(
        {"__metadata__": {"gpucase.store": json.dumps({"w": digest})}}))
    [found] = survey([str(folder / "model.safetensors")]).results
    assert any("names store files outside its folder" in problem
               for problem in found.problems), found.problems


def test_nothing_that_looks_like_a_case_is_passed_over_in_silence(
        pytester: pytest.Pytester) -> None:
    """A case folder pytest would not recurse into (norecursedirs: build, dist), a folder that
    lost its case.toml, and a case below a case: each is an item or a note, and validate
    names the same folders."""
    (pytester.path / "pytest.ini").write_text("[pytest]\n")
    write_case(pytester.path, "good", CASE_TOML, RUN_X)
    write_case(pytester.path, "build", CASE_TOML, RUN_X)
    write_case(pytester.path / "cases" / "group", "deep", CASE_TOML, RUN_X)
    lost = write_case(pytester.path, "lost", CASE_TOML, RUN_X)
    payload.save(lost / "inputs.safetensors", {"x": torch.ones(1)})
    (lost / "case.toml").unlink()
    outer = write_case(pytester.path, "outer", CASE_TOML, RUN_X)
    write_case(outer, "inner", CASE_TOML, RUN_X)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "-p",
                                           "no:cacheprovider", "cases", timeout=300)
    result.assert_outcomes(passed=2, failed=2)  # good and group/deep; lost and outer
    result.stdout.fnmatch_lines([
        "cases/lost/case.toml: missing, but the directory holds inputs.safetensors: an "
        "interrupted write or a deleted case.toml",
        "cases/outer/cases/inner/case.toml: a case folder inside the case folder outer: *",
        "gpucase: case folder cases/build not collected: its name matches norecursedirs "
        "'build'; rename it or set norecursedirs"], consecutive=False)
    validated = subprocess.run([sys.executable, "-m", "pytest_gpucase.cli", "validate", "cases"],
                               cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert [line.split(":")[0] for line in validated.stdout.splitlines()] == [
        "cases/lost/case.toml", "cases/outer/cases/inner/case.toml"], validated.stdout


@needs_zygote
def test_what_a_plain_test_leaves_in_the_pytest_process_never_reaches_a_case(
        pytester: pytest.Pytester) -> None:
    """A unit test of the same session set torch's default dtype and stubbed a function; a
    case forked after it from the pytest process inherited both, and its verdict flipped
    with the order the tests ran in. Its child now comes from the zygote started before any
    test ran, and the session says so."""
    pytester.makepyfile(test_leak="""
        import torch
        import torch.nn.functional as F

        def test_leaves_state():
            torch.set_default_dtype(torch.float64)
            F.gelu = lambda x, approximate="none": x
    """)
    write_case(pytester.path, "fresh", CASE_TOML, """
        import torch
        import torch.nn.functional as F

        def run(x):
            assert torch.get_default_dtype() == torch.float32, torch.get_default_dtype()
            assert F.gelu(torch.tensor([-1.0])).item() != -1.0, "gelu stubbed"
            return x + 1
        """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--gpu-cases",
                                           "--gpu-devices", "cpu", "test_leak.py", "cases")
    result.assert_outcomes(passed=2)
    assert "the cases' children are forked by the zygote started before any test" in (
        result.stdout.str())

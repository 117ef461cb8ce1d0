"""case.toml loading: every mistake names the file, the key and the fix; a valid case loads."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_gpucase.case.load import BACKENDS, DEVICE_TYPES, load_case
from pytest_gpucase.case.model import (
    CASE_FILE,
    EXPECTED_FILE,
    FLOAT_DTYPES,
    INPUTS_FILE,
    AxisSizes,
    Boundaries,
    Case,
    Expectation,
    Requirements,
    ToleranceOverride,
    VariantTables,
    is_case_dir,
)
from pytest_gpucase.base.errors import CaseFormatError

CASES = Path(__file__).resolve().parents[1] / "cases"
SHOWN = "cases/ce_class4/case.toml"
MINIMAL = 'format = 1\ncall = "case.py:run"\n'
CASE_PY = "def run(**inputs):\n    return inputs\n\n\ndef reference(**inputs):\n    return inputs\n"


@pytest.fixture
def case_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``cases/ce_class4`` below the working directory, with a case.py and no case.toml yet."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cases" / "ce_class4"
    path.mkdir(parents=True)
    (path / "case.py").write_text(CASE_PY)
    return path


def load_error(case_dir: Path, toml: str) -> CaseFormatError:
    (case_dir / CASE_FILE).write_text(textwrap.dedent(toml))
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(case_dir)
    return excinfo.value


def message(case_dir: Path, toml: str) -> str:
    return str(load_error(case_dir, toml))


# --- the file itself -------------------------------------------------------------------------

def test_missing_case_toml(case_dir: Path) -> None:
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(case_dir)
    assert str(excinfo.value) == f"{SHOWN}: missing; a case directory needs a case.toml"


def test_invalid_toml_names_the_line(case_dir: Path) -> None:
    assert message(case_dir, 'format = 1\ncall = "case.py:run\n') == (
        f"{SHOWN}: invalid TOML: Illegal character '\\n' (at line 2, column 20)")


def test_duplicate_key_is_invalid_toml(case_dir: Path) -> None:
    assert message(case_dir, MINIMAL + "timeout = 1\ntimeout = 2\n") == (
        f"{SHOWN}: invalid TOML: Cannot overwrite a value (at line 4, column 12)")


def test_not_utf8(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_bytes(b"\xff" + MINIMAL.encode())
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(case_dir)
    assert str(excinfo.value) == (
        f"{SHOWN}: is not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 0: "
        "invalid start byte); save it as UTF-8, as TOML requires")


def test_case_toml_is_a_directory(case_dir: Path) -> None:
    (case_dir / CASE_FILE).mkdir()
    assert is_case_dir(case_dir)  # collected, and reported as broken
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(case_dir)
    assert str(excinfo.value) == (
        f"{SHOWN}: is a directory, not a regular file; replace it with the case's TOML text file")


@pytest.mark.parametrize(("make", "expected"), [
    (os.mkfifo,
     "is a FIFO (named pipe), not a regular file; replace it with the case's TOML text file"),
    (lambda f: f.symlink_to("/dev/zero"),
     "is a symlink to /dev/zero, outside the case directory; replace it with the file itself"),
    (lambda f: f.symlink_to("../shared.toml"),
     "is a symlink to ../shared.toml, outside the case directory; replace it with the file "
     "itself"),
    (lambda f: f.symlink_to("gone.toml"),
     "is a symlink to gone.toml, which does not exist; replace it with the file itself"),
], ids=["fifo", "device", "escaping", "dangling"])
def test_special_case_toml_is_refused_before_opening(
        case_dir: Path, make: Callable[[Path], None], expected: str) -> None:
    (case_dir.parent / "shared.toml").write_text(MINIMAL)
    make(case_dir / CASE_FILE)
    assert is_case_dir(case_dir)
    assert message_of(case_dir) == f"{SHOWN}: {expected}"


def test_symlink_inside_the_case_is_followed(case_dir: Path) -> None:
    (case_dir / "real.toml").write_text(MINIMAL)
    (case_dir / CASE_FILE).symlink_to("real.toml")
    assert load_case(case_dir).call == "case.py:run"


def test_oversized_case_toml_is_refused_from_its_size(case_dir: Path) -> None:
    with open(case_dir / CASE_FILE, "wb") as handle:  # sparse: 3 MB that cost no disk
        handle.write(MINIMAL.encode())
        handle.truncate(3 * 10**6)
    assert message_of(case_dir) == (
        f"{SHOWN}: is 3000000 bytes, over the limit of 1048576; a case.toml holds settings, not "
        "data: put tensors in inputs.safetensors")


@pytest.mark.parametrize("toml", [
    "x = " + "[" * 100_000 + "]" * 100_000,
    "x = " + "{a = " * 100_000 + "1" + "}" * 100_000,
    "x = " + "[" * 33 + "]" * 33,
], ids=["arrays", "inline_tables", "just_over"])
def test_deep_nesting_is_refused_before_parsing(case_dir: Path, toml: str) -> None:
    assert message(case_dir, MINIMAL + "[origin]\n" + toml + "\n") == (
        f"{SHOWN}: arrays or tables nest deeper than 32 levels; a case needs a few: flatten the "
        "structure")


def test_brackets_in_strings_and_comments_do_not_nest(case_dir: Path) -> None:
    deep = "[" * 40
    quote3 = "'" * 3
    toml = (f'summary = "{deep}"\n# {deep}\n[origin]\na = \'{deep}\'\nb = """\n{deep}\n"""\n'
            f"c = {quote3}{deep}{quote3}\nd = [[[1]]]\n")
    case = load_case_from(case_dir, MINIMAL + toml)
    assert case.summary == deep and case.origin["d"] == [[[1]]]


def test_deep_dotted_keys_are_refused(case_dir: Path) -> None:
    got = message(case_dir, MINIMAL + "[origin]\n" + ".".join(["a"] * 50) + " = 1\n")
    assert got.startswith(f"{SHOWN}: origin.a.a.a")
    assert got.endswith(": tables nest deeper than 32 levels; a case needs a few: flatten the "
                        "structure")


@pytest.mark.parametrize(("number", "shown"), [
    ("0x8000000000000000", "9223372036854775808"),   # 16 hex digits, one past int64
    ("0o1000000000000000000000", "9223372036854775808"),
    ("0b1" + "0" * 63, "9223372036854775808"),
    ("9_223_372_036_854_775_808", "9223372036854775808"),
    ("-9_223_372_036_854_775_809", "-9223372036854775809"),
])
def test_every_spelling_of_a_too_large_integer_is_refused(case_dir: Path, number: str,
                                                          shown: str) -> None:
    # load_case walks the document only when the text holds a run of 16 digit characters
    # (or enough nesting): each TOML spelling of the smallest integer past 64 bits has one.
    assert message(case_dir, MINIMAL + f"[origin]\nn = {number}\n") == (
        f"{SHOWN}: origin.n: integer {shown} does not fit in 64 bits; write a smaller number")


def test_a_byte_order_mark_and_crlf_lines_are_read(case_dir: Path) -> None:
    # As Windows editors save it: a UTF-8 BOM and CRLF line ends.
    (case_dir / "case.toml").write_bytes(
        b"\xef\xbb\xbf" + (MINIMAL + 'summary = "from Windows"\n').replace("\n", "\r\n").encode())
    assert load_case(case_dir).summary == "from Windows"


def test_nesting_at_the_limit_is_read_and_one_more_is_refused(case_dir: Path) -> None:
    # [origin] plus dotted keys: the value of a 31-part key sits 32 levels deep.
    case = load_case_from(case_dir, MINIMAL + "[origin]\n" + ".".join(["a"] * 31) + " = 1\n")
    assert case.origin["a"]["a"]
    assert message(case_dir, MINIMAL + "[origin]\n" + ".".join(["a"] * 32) + " = 1\n").endswith(
        ": tables nest deeper than 32 levels; a case needs a few: flatten the structure")


@pytest.mark.parametrize(("toml", "expected"), [
    ("timeout = " + "9" * 5000,
     "invalid TOML: Exceeds the limit (4300 digits) for integer string conversion: value has "
     "5000 digits; use sys.set_int_max_str_digits() to increase the limit; TOML integers are "
     "64-bit"),
    ("timeout = 99999999999999999999",
     "timeout: integer 99999999999999999999 does not fit in 64 bits; write a smaller number"),
    ("[origin]\nn = -9223372036854775809",
     "origin.n: integer -9223372036854775809 does not fit in 64 bits; write a smaller number"),
    ("timeout = 9223372036854775807",
     "timeout: 9.22337e+18 seconds is over the limit of 604800; give a smaller number"),
    ("timeout = 1e300",
     "timeout: 1e+300 seconds is over the limit of 604800; give a smaller number"),
    ("memory_limit = 0", "memory_limit: must be a positive number of GiB, got 0"),
    ("memory_limit = nan", "memory_limit: must be a positive number of GiB, got nan"),
    ('memory_limit = "8"',
     'memory_limit: expected a number of GiB, got "8"; write it without quotes'),
    ("memory_limit = 2e6",
     "memory_limit: 2e+06 GiB is over the limit of 1.04858e+06; give a smaller number"),
], ids=["thousands_of_digits", "over_64_bits", "under_64_bits", "timeout_int", "timeout_float",
        "memory_zero", "memory_nan", "memory_string", "memory_huge"])
def test_numbers_fit_their_field(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, MINIMAL + toml + "\n") == f"{SHOWN}: {expected}"


def test_memory_limit_in_bytes(case_dir: Path) -> None:
    assert load_case_from(case_dir, MINIMAL).memory_limit is None
    assert load_case_from(case_dir, MINIMAL + "memory_limit = 1.5\n").memory_limit == 3 * 2**29
    assert load_case_from(case_dir, MINIMAL + "timeout = 604800\n").timeout == 604800.0


def test_name_that_is_not_utf8_is_printable(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = Path(os.fsdecode(b"bad\xffname"))
    path.mkdir()
    (path / "case.py").write_text(CASE_PY)
    (path / CASE_FILE).write_text(MINIMAL + "timeout = 0\n")
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(path)
    assert str(excinfo.value).startswith("bad\\xffname/case.toml: timeout: ")
    str(excinfo.value).encode("utf-8")  # printable and writable as JSON
    (path / CASE_FILE).write_text(MINIMAL)
    assert load_case(path).name == "bad\\xffname"


def message_of(case_dir: Path) -> str:
    with pytest.raises(CaseFormatError) as excinfo:
        load_case(case_dir)
    return str(excinfo.value)


def load_case_from(case_dir: Path, toml: str) -> Case:
    (case_dir / CASE_FILE).write_text(toml)
    return load_case(case_dir)


# --- format ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    ('call = "case.py:run"\n', "format: missing; add `format = 1` as the first line"),
    ('format = 2\ncall = "case.py:run"\n',
     ("format: unsupported format 2; this pytest-gpucase reads format 1: upgrade pytest-gpucase, "
     "or write the case in format 1")),
    ('format = "1"\ncall = "case.py:run"\n',
     'format: expected an integer, got "1"; write it without quotes'),
    ('format = 1.0\ncall = "case.py:run"\n', "format: expected an integer, got 1.0"),
    ('format = true\ncall = "case.py:run"\n', "format: expected an integer, got true"),
])
def test_format(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, toml) == f"{SHOWN}: {expected}"


def test_newer_format_is_reported_before_its_unknown_keys(case_dir: Path) -> None:
    assert message(case_dir, 'format = 2\ncall = "case.py:run"\nseed = 3\n') == (
        f"{SHOWN}: format: unsupported format 2; this pytest-gpucase reads format 1: "
        "upgrade pytest-gpucase, or write the case in format 1")


# --- unknown keys ----------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    ('format = 1\ncalll = "case.py:run"\n', "calll: unknown key; did you mean 'call'?"),
    (MINIMAL + "timout = 10\n", "timout: unknown key; did you mean 'timeout'?"),
    (MINIMAL + "seed = 3\n",
     ("seed: unknown key; expected one of format, summary, call, reference, timeout, "
     "memory_limit, launch_blocking, xfail, inputs_sha256, inputs, expect, matrix, variants, "
     "ablate, origin, context")),
    (MINIMAL + '[expect]\noutcom = "raises"\n',
     "[expect] outcom: unknown key; did you mean 'outcome'?"),
    (MINIMAL + '[matrix]\ndevice = ["cpu"]\n',
     "[matrix] device: unknown key; did you mean 'devices'?"),
    (MINIMAL + "[matrix]\nhost = 1\n",
     ("[matrix] host: unknown key; expected one of devices, dtypes, backends, torch, python, "
     "cuda, hip, capability, packages")),
    (MINIMAL + "[variants]\nbatches = { axis = 0, sizes = [1] }\n",
     "[variants] batches: unknown key; did you mean 'batch'?"),
    (MINIMAL + "[variants]\nbatch = { axis = 0, size = [1] }\n",
     "[variants.batch] size: unknown key; did you mean 'sizes'?"),
    (MINIMAL + '[variants]\nboundaries = { input = "t", classes = 4, ignore = -1 }\n',
     "[variants.boundaries] ignore: unknown key; did you mean 'ignore_index'?"),
    (MINIMAL + "[expect.tolerance.bfloat16]\nrtoll = 1e-2\natol = 1e-3\n",
     "[expect.tolerance.bfloat16] rtoll: unknown key; did you mean 'rtol'?"),
    (MINIMAL + "[ablate]\nenvs = {}\n", "[ablate] envs: unknown key; did you mean 'env'?"),
])
def test_unknown_key(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, toml) == f"{SHOWN}: {expected}"


# --- types -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    (MINIMAL + 'timeout = "10"\n',
     'timeout: expected a number of seconds, got "10"; write it without quotes'),
    (MINIMAL + "timeout = true\n", "timeout: expected a number of seconds, got true"),
    (MINIMAL + 'timeout = "true"\n', 'timeout: expected a number of seconds, got "true"'),
    (MINIMAL + "timeout = 0\n", "timeout: must be a positive number of seconds, got 0"),
    (MINIMAL + "timeout = -1.5\n", "timeout: must be a positive number of seconds, got -1.5"),
    (MINIMAL + "timeout = inf\n", "timeout: must be a positive number of seconds, got inf"),
    (MINIMAL + 'launch_blocking = "yes"\n', 'launch_blocking: expected true or false, got "yes"'),
    (MINIMAL + 'launch_blocking = "true"\n',
     'launch_blocking: expected true or false, got "true"; write it without quotes'),
    (MINIMAL + "launch_blocking = 1\n", "launch_blocking: expected true or false, got 1"),
    (MINIMAL + "summary = 3\n", "summary: expected a string, got 3"),
    (MINIMAL + 'xfail = " "\n', "xfail: is empty; give the reason the case is known to fail"),
    (MINIMAL + "xfail = true\n", "xfail: expected a string giving the reason, got true"),
    (MINIMAL + "inputs = 3\n", "inputs: expected a table [inputs], got 3"),
    (MINIMAL + 'origin = "cuda"\n', 'origin: expected a table [origin], got "cuda"'),
    (MINIMAL + "expect = [1]\n", "expect: expected a table [expect], got [1]"),
    (MINIMAL + '[expect]\ngradients = "true"\n',
     '[expect] gradients: expected true or false, got "true"; write it without quotes'),
    (MINIMAL + "[expect]\nequal_nan = 1\n", "[expect] equal_nan: expected true or false, got 1"),
    (MINIMAL + '[matrix]\ndevices = "cuda"\n',
     '[matrix] devices: expected a list of strings, got "cuda"; write devices = ["cuda"]'),
    (MINIMAL + "[matrix]\ndevices = [1]\n",
     "[matrix] devices: expected a list of strings, found 1"),
    (MINIMAL + "[matrix]\npackages = []\n", ("[matrix] packages: expected a table "
     "[matrix.packages], got []")),
    (MINIMAL + "[ablate]\nenv = { USE_FLASH_ATTN = 0 }\n",
     '[ablate] env: USE_FLASH_ATTN: expected a string, got 0; write USE_FLASH_ATTN = "0"'),
    (MINIMAL + "[ablate]\nenv = { USE_FLASH_ATTN = false }\n",
     ('[ablate] env: USE_FLASH_ATTN: expected a string, got false; write '
     'USE_FLASH_ATTN = "false"')),
])
def test_wrong_type_or_value(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, toml) == f"{SHOWN}: {expected}"


# --- [matrix] values -------------------------------------------------------------------------

def test_unknown_backend_reads_like_the_style_guide(case_dir: Path) -> None:
    assert message(case_dir, MINIMAL + '[matrix]\nbackends = ["rocm7"]\n') == (
        "cases/ce_class4/case.toml: [matrix] backends: unknown 'rocm7'; "
        "expected one of cuda, rocm, cpu, mps, xpu")


@pytest.mark.parametrize(("toml", "expected"), [
    ('devices = ["gpu"]', "devices: unknown 'gpu'; expected one of cuda, cpu, mps, xpu"),
    ('devices = ["cuda", "rocm"]', "devices: unknown 'rocm'; expected one of cuda, cpu, mps, xpu"),
    ('dtypes = ["fp16"]',
     "dtypes: unknown 'fp16'; expected one of float16, bfloat16, float32, float64"),
    ("devices = []", "devices: is empty; remove the key to use the default"),
    ('devices = ["cpu", "cpu"]', "devices: 'cpu' is listed twice; list it once"),
    ('dtypes = ["float32", "bfloat16", "float32"]',
     "dtypes: 'float32' is listed twice; list it once"),
    ('torch = "2.1"', ("torch: '2.1' is not a PEP 440 specifier; a bare version needs an "
     'operator: write ">=2.1" or "==2.1.*"')),
    ('torch = ">=two"', ("torch: '>=two' is not a PEP 440 specifier; write it like \">=2.1\" or "
     '">=2.1,<3"')),
    ('python = "~=3"', ("python: '~=3' is not a PEP 440 specifier; write it like \">=2.1\" or "
     '">=2.1,<3"')),
    ("cuda = 12.1", 'cuda: expected a version specifier string like ">=2.1", got 12.1'),
])
def test_matrix_values(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, f"{MINIMAL}[matrix]\n{toml}\n") == f"{SHOWN}: [matrix] {expected}"


def test_package_specifier(case_dir: Path) -> None:
    assert message(case_dir, MINIMAL + '[matrix.packages]\nflash-attn = "2.5"\n') == (
        f"{SHOWN}: [matrix.packages] flash-attn: '2.5' is not a PEP 440 specifier; a bare "
        'version needs an operator: write ">=2.5" or "==2.5.*"')


def test_valid_specifiers_are_kept_as_written(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(MINIMAL + textwrap.dedent("""\
        [matrix]
        torch = ">= 2.1, <3"
        capability = ">=8.0"
        python = ""
        [matrix.packages]
        flash-attn = ""
        triton = "==3.*"
        """))
    matrix = load_case(case_dir).matrix
    assert matrix.versions == {"torch": ">= 2.1, <3", "python": "", "capability": ">=8.0"}
    assert matrix.packages == {"flash-attn": "", "triton": "==3.*"}


# --- call and reference ----------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    ("format = 1\n",
     'call: missing; name the function to run, e.g. call = "case.py:run"'),
    ('format = 1\ncall = "case.py"\n',
     ("call: 'case.py' is not 'FILE.py:func' or 'package.module:func'; write it like "
     '"case.py:run"')),
    ('format = 1\ncall = "case.py:"\n',
     ("call: 'case.py:' is not 'FILE.py:func' or 'package.module:func'; write it like "
     '"case.py:run"')),
    ('format = 1\ncall = "case.py:run."\n',
     ("call: 'case.py:run.' is not 'FILE.py:func' or 'package.module:func'; write it like "
     '"case.py:run"')),
    ('format = 1\ncall = "case.py:1run"\n',
     ("call: 'case.py:1run' is not 'FILE.py:func' or 'package.module:func'; write it like "
     '"case.py:run"')),
    ('format = 1\ncall = "case.py:run:x"\n',
     ("call: 'case.py:run:x' is not 'FILE.py:func' or 'package.module:func'; write it like "
     '"case.py:run"')),
    ('format = 1\ncall = ["case.py:run"]\n',
     "call: expected a string 'FILE.py:func' or 'package.module:func', got [\"case.py:run\"]"),
    ('format = 1\ncall = "my-pkg.losses:run"\n',
     "call: 'my-pkg.losses' is not an importable module name"),
    ('format = 1\ncall = "missing.py:run"\n',
     "call: 'missing.py' not found in ce_class4/; create it or correct the file name"),
    ('format = 1\ncall = "../x.py:f"\n',
     "call: '../x.py' escapes the case directory; put the file inside ce_class4/"),
    ('format = 1\ncall = "sub/../case.py:run"\n',
     "call: 'sub/../case.py' escapes the case directory; put the file inside ce_class4/"),
    ('format = 1\ncall = "/etc/x.py:f"\n',
     "call: '/etc/x.py' escapes the case directory; put the file inside ce_class4/"),
    (MINIMAL + 'reference = "../ref.py:f"\n',
     "reference: '../ref.py' escapes the case directory; put the file inside ce_class4/"),
    (MINIMAL + 'reference = "ref.py:f"\n',
     "reference: 'ref.py' not found in ce_class4/; create it or correct the file name"),
])
def test_call_and_reference(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, toml) == f"{SHOWN}: {expected}"


def test_symlinked_file_pointing_outside(case_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_text(CASE_PY)
    (case_dir / "evil.py").symlink_to(outside)
    assert message(case_dir, 'format = 1\ncall = "evil.py:run"\n') == (
        f"{SHOWN}: call: 'evil.py' resolves outside the case directory (a symlink?); "
        "put the file inside ce_class4/")


def test_symlinked_folder_pointing_outside(case_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "x.py").write_text(CASE_PY)
    (case_dir / "sub").symlink_to(tmp_path / "lib")
    assert message(case_dir, 'format = 1\ncall = "sub/x.py:run"\n') == (
        f"{SHOWN}: call: 'sub/x.py' resolves outside the case directory (a symlink?); "
        "put the file inside ce_class4/")


def test_symlinked_case_dir_and_file_inside_it_are_fine(case_dir: Path, tmp_path: Path) -> None:
    (case_dir / "sub").mkdir()
    (case_dir / "sub" / "helpers.py").write_text(CASE_PY)
    (case_dir / "alias.py").symlink_to(case_dir / "case.py")
    (case_dir / CASE_FILE).write_text(
        'format = 1\ncall = "sub/helpers.py:run"\nreference = "alias.py:reference"\n')
    link = tmp_path / "linked"
    link.symlink_to(case_dir)
    case = load_case(link)
    assert (case.name, case.path, case.call, case.reference) == (
        "linked", link, "sub/helpers.py:run", "alias.py:reference")


def test_importable_target_is_not_imported_at_load(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(
        'format = 1\ncall = "no_such_package.losses:Loss.forward"\nreference = "os.path:join"\n')
    case = load_case(case_dir)
    assert case.call == "no_such_package.losses:Loss.forward"
    assert case.reference == "os.path:join"


# --- [expect] --------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    ('outcome = "raises"',
     'exception: missing; name the exception type, e.g. exception = "ValueError"'),
    ('outcome = "raise"\nexception = "ValueError"',
     "outcome: unknown 'raise'; expected one of matches, raises"),
    ('exception = "ValueError"',
     'exception: only applies with outcome = "raises"; add outcome = "raises" or remove exception'),
    ('match = "out of range"',
     'match: only applies with outcome = "raises"; add outcome = "raises" or remove match'),
    ('outcome = "raises"\nexception = "Value Error"',
     ("exception: 'Value Error' is not an exception type name; write it like \"ValueError\" or "
     '"torch.OutOfMemoryError"')),
    ('outcome = "raises"\nexception = "ValueError"\nmatch = "(out of range"',
     ("match: invalid regular expression: missing ), unterminated subpattern at position 0; "
     "to match a special character literally, escape it with a backslash")),
])
def test_expect(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, f"{MINIMAL}[expect]\n{toml}\n") == f"{SHOWN}: [expect] {expected}"


@pytest.mark.parametrize(("toml", "expected"), [
    ("rtol = 1e-2", "rtol: given without atol; give both rtol and atol, or neither"),
    ("atol = 1e-3", "atol: given without rtol; give both rtol and atol, or neither"),
    ("rtol = -1e-2\natol = 1e-3", "rtol: must be a finite number >= 0, got -0.01"),
    ("rtol = 1e-2\natol = -1", "atol: must be a finite number >= 0, got -1"),
    ("rtol = nan\natol = 0", "rtol: must be a finite number >= 0, got nan"),
    ("ulps = inf", "ulps: expected a whole number of units in the last place, got inf"),
    ("ulps = 1.5", "ulps: expected a whole number of units in the last place, got 1.5"),
    ("ulps = 0", "ulps: must be a whole number from 1 to 1048576, got 0"),
    ("ulps = 1048577", "ulps: must be a whole number from 1 to 1048576, got 1048577"),
    ('rtol = "1e-2"\natol = 0', 'rtol: expected a number, got "1e-2"; write it without quotes'),
])
def test_tolerance(case_dir: Path, toml: str, expected: str) -> None:
    got = message(case_dir, f"{MINIMAL}[expect.tolerance.bfloat16]\n{toml}\n")
    assert got == f"{SHOWN}: [expect.tolerance.bfloat16] {expected}"


def test_empty_tolerance_table(case_dir: Path) -> None:
    assert message(case_dir, f"{MINIMAL}[expect.tolerance.bfloat16]\n") == (
        f"{SHOWN}: [expect.tolerance.bfloat16]: is empty; give rtol and atol, or ulps")


@pytest.mark.parametrize(("toml", "expected"), [
    ("[expect.tolerance.bfloat]\nrtol = 0\natol = 0",
     "[expect.tolerance] bfloat: unknown dtype; did you mean 'bfloat16'?"),
    ("[expect.tolerance.int64]\nrtol = 0\natol = 0",
     "[expect.tolerance] int64: unknown dtype; expected a floating dtype name"),
    ("[expect.tolerance]\nbfloat16 = 0.01",
     "[expect.tolerance] bfloat16: expected a table [expect.tolerance.bfloat16], got 0.01"),
])
def test_tolerance_dtype(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, f"{MINIMAL}{toml}\n") == f"{SHOWN}: {expected}"


def test_tolerance_values_become_floats(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(MINIMAL + textwrap.dedent("""\
        [expect.tolerance.float16]
        rtol = 0
        atol = 1
        [expect.tolerance.complex64]
        ulps = 2
        """))
    tolerance = load_case(case_dir).expect.tolerance
    assert tolerance == {"float16": ToleranceOverride(rtol=0.0, atol=1.0),
                         "complex64": ToleranceOverride(ulps=2.0)}
    assert all(isinstance(v, float) for v in (tolerance["float16"].rtol, tolerance["float16"].atol))


# --- [variants] ------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "expected"), [
    ('boundaries = { input = "target", classes = 4 }',
     ("[variants] reject: missing; boundaries need [variants.reject] with the exception that "
     "out-of-range values must raise")),
    ('[variants.reject]\nexception = "ValueError"',
     ("[variants] reject: only applies with boundaries; add boundaries = { input = ..., classes = "
     "... } or remove [variants.reject]")),
    ('boundaries = { input = "target", classes = 4 }\n[variants.reject]\nmatch = "range"',
     ("[variants.reject] exception: missing; name the exception out-of-range values must raise, "
     'e.g. exception = "ValueError"')),
    ('boundaries = { input = "target", classes = 4 }\n[variants.reject]\noutcome = "raises"',
     "[variants.reject] outcome: unknown key; expected one of exception, match"),
    ("boundaries = { classes = 4 }",
     '[variants.boundaries] input: missing; name the class-index input, e.g. input = "target"'),
    ('boundaries = { input = "target", classes = 0 }',
     "[variants.boundaries] classes: missing or < 1; give the number of classes of the head"),
    ('boundaries = { input = "target", classes = "4" }',
     ('[variants.boundaries] classes: expected the number of classes, got "4"; write it without '
     "quotes")),
    ('boundaries = { input = "target", classes = 4, ignore_index = -100.0 }',
     "[variants.boundaries] ignore_index: expected an integer, got -100.0"),
    ("batch = { axis = 0 }",
     "[variants.batch] sizes: missing or empty; list the sizes to try, e.g. sizes = [1, 2]"),
    ("batch = { axis = 0, sizes = [] }",
     "[variants.batch] sizes: missing or empty; list the sizes to try, e.g. sizes = [1, 2]"),
    ("batch = { sizes = [1, 0] }", "[variants.batch] sizes: expected positive integers, found 0"),
    ("length = { axis = 1, sizes = [-4] }",
     "[variants.length] sizes: expected positive integers, found -4"),
    ('length = { axis = 1, sizes = ["1"] }',
     '[variants.length] sizes: expected positive integers, found "1"'),
    ("length = { axis = 1, sizes = [1.5] }",
     "[variants.length] sizes: expected positive integers, found 1.5"),
    ("length = { axis = 1, sizes = [true] }",
     "[variants.length] sizes: expected positive integers, found true"),
    ("length = { axis = 1, sizes = 4 }",
     "[variants.length] sizes: expected a list of positive integers, got 4"),
    ("batch = { sizes = [1, 2, 1] }", "[variants.batch] sizes: 1 is listed twice; list it once"),
    ("length = { axis = 1, sizes = [1, 1000000000] }",
     ("[variants.length] sizes: 1000000000 is over the limit of 1048576; a variant checks an "
      "edge, not a workload")),
    ("batch = { sizes = " + str(list(range(1, 20_001))) + " }",
     ("[variants.batch] sizes: lists 20000 sizes, over the limit of 64; keep the edges (1, the "
      "saved size, a large one)")),
    ("batch = { axis = 64, sizes = [1] }",
     "[variants.batch] axis: 64 is over the limit of 63; torch tensors have at most 64 dimensions"),
    ("batch = { axis = -1, sizes = [1] }",
     "[variants.batch] axis: must be >= 0, got -1; count axes from the front"),
    ('batch = { axis = "0", sizes = [1] }',
     '[variants.batch] axis: expected an integer axis, got "0"; write it without quotes'),
    ("batch = [1, 2]", "[variants] batch: expected a table [variants.batch], got [1, 2]"),
])
def test_variants(case_dir: Path, toml: str, expected: str) -> None:
    assert message(case_dir, f"{MINIMAL}[variants]\n{toml}\n") == f"{SHOWN}: {expected}"


def test_variants_load(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(MINIMAL + textwrap.dedent("""\
        [variants]
        batch = { sizes = [1, 2] }
        length = { axis = 1, sizes = [1, 4096] }
        boundaries = { input = "target", classes = 4 }
        [variants.reject]
        exception = "IndexError"
        """))
    assert load_case(case_dir).variants == VariantTables(
        batch=AxisSizes(axis=0, sizes=(1, 2)),
        length=AxisSizes(axis=1, sizes=(1, 4096)),
        boundaries=Boundaries(input="target", classes=4, ignore_index=None),
        reject=Expectation(outcome="raises", exception="IndexError"),
    )


# --- where the message points ----------------------------------------------------------------

def test_path_outside_the_working_directory_is_shown_whole(
        case_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    error = load_error(case_dir, MINIMAL + '[matrix]\nbackends = ["rocm7"]\n')
    assert str(error) == (f"{case_dir / CASE_FILE}: [matrix] backends: unknown 'rocm7'; "
                          "expected one of cuda, rocm, cpu, mps, xpu")
    assert (error.path, error.key) == (case_dir / CASE_FILE, "[matrix] backends")
    assert error.problem == "unknown 'rocm7'; expected one of cuda, rocm, cpu, mps, xpu"


def test_path_given_relative(case_dir: Path) -> None:
    error = load_error(Path("cases/ce_class4"), MINIMAL + "timeout = 0\n")
    assert str(error) == f"{SHOWN}: timeout: must be a positive number of seconds, got 0"


def test_symlinked_case_dir_is_shown_as_given(case_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "cases" / "alias").symlink_to(case_dir)
    error = load_error(tmp_path / "cases" / "alias", MINIMAL + "timeout = 0\n")
    assert str(error) == (
        "cases/alias/case.toml: timeout: must be a positive number of seconds, got 0")


def test_error_survives_pickling(case_dir: Path) -> None:
    error = load_error(case_dir, MINIMAL + '[matrix]\nbackends = ["rocm7"]\n')
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.path, copy.key, copy.problem) == (
        str(error), error.path, error.key, error.problem)


def test_error_without_key() -> None:
    error = CaseFormatError("/nowhere/case.toml", "missing")
    assert (str(error), error.key) == ("/nowhere/case.toml: missing", None)


# --- valid cases -----------------------------------------------------------------------------

DESIGN_EXAMPLE = """\
format = 1
summary = "CrossEntropyLoss target holds class 4 on a 4-class head"
call = "case.py:run"
reference = "case.py:reference"
timeout = 120
launch_blocking = false
xfail = "label mapping not fixed yet"

[inputs]
num_classes = 4
ignore_index = -100

[expect]
outcome = "raises"
exception = "ValueError"
match = "out of range"
gradients = false
[expect.tolerance.bfloat16]
rtol = 2e-2
atol = 1e-3

[matrix]
devices = ["cuda", "cpu"]
dtypes = ["float32", "bfloat16"]
backends = ["cuda", "rocm", "cpu", "mps", "xpu"]
torch = ">=2.1"
python = ">=3.10"
cuda = ">=12.1"
hip = ">=6.0"
capability = ">=8.0"
[matrix.packages]
flash-attn = ">=2.5"

[variants]
batch = { axis = 0, sizes = [1, 2] }
length = { axis = 1, sizes = [1, 4096] }
boundaries = { input = "target", classes = 4, ignore_index = -100 }
[variants.reject]
exception = "ValueError"
match = "out of range"

[ablate]
env = { USE_FLASH_ATTN = "0" }

[origin]
error = "RuntimeError: CUDA error: device-side assert triggered"
stderr = "Loss.cu:245: ... Assertion `t >= 0 && t < n_classes` failed."
iteration = 1834
last_step = "optimizer.step"
revision = "3f2c1ab"
python = "3.11.7"
torch = "2.3.1"
backend = "cuda"
device = "NVIDIA A100-SXM4-80GB"
sample_ids = ["img_00412", "img_00413", "img_00414"]
"""


def test_design_example_loads_field_by_field(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(DESIGN_EXAMPLE)
    assert is_case_dir(case_dir)
    case = load_case(case_dir)
    assert isinstance(case, Case)
    assert case.name == "ce_class4"
    assert case.path == case_dir
    assert case.summary == "CrossEntropyLoss target holds class 4 on a 4-class head"
    assert case.call == "case.py:run"
    assert case.reference == "case.py:reference"
    assert case.timeout == 120.0
    assert isinstance(case.timeout, float)
    assert case.launch_blocking is False
    assert case.xfail == "label mapping not fixed yet"
    assert case.literals == {"num_classes": 4, "ignore_index": -100}
    assert case.expect == Expectation(
        outcome="raises", exception="ValueError", match="out of range", gradients=False,
        equal_nan=False, tolerance={"bfloat16": ToleranceOverride(rtol=2e-2, atol=1e-3)})
    assert case.matrix == Requirements(
        devices=("cuda", "cpu"),
        dtypes=("float32", "bfloat16"),
        backends=("cuda", "rocm", "cpu", "mps", "xpu"),
        versions={"torch": ">=2.1", "python": ">=3.10", "cuda": ">=12.1", "hip": ">=6.0",
                  "capability": ">=8.0"},
        packages={"flash-attn": ">=2.5"},
    )
    assert case.variants == VariantTables(
        batch=AxisSizes(axis=0, sizes=(1, 2)),
        length=AxisSizes(axis=1, sizes=(1, 4096)),
        boundaries=Boundaries(input="target", classes=4, ignore_index=-100),
        reject=Expectation(outcome="raises", exception="ValueError", match="out of range"),
    )
    assert case.ablate_env == {"USE_FLASH_ATTN": "0"}
    assert case.origin["iteration"] == 1834
    assert case.origin["sample_ids"] == ["img_00412", "img_00413", "img_00414"]
    assert case.origin["device"] == "NVIDIA A100-SXM4-80GB"
    assert len(case.origin) == 10
    assert case.case_file == case_dir / CASE_FILE
    assert case.inputs_file == case_dir / INPUTS_FILE
    assert case.expected_file == case_dir / EXPECTED_FILE


def test_minimal_case_takes_the_defaults(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(MINIMAL)
    case = load_case(case_dir)
    assert (case.summary, case.reference, case.timeout, case.launch_blocking, case.xfail) == (
        "", None, 120.0, False, None)
    assert case.literals == {}
    assert case.expect == Expectation()
    assert case.matrix == Requirements()
    assert case.variants == VariantTables()
    assert (case.ablate_env, case.origin) == ({}, {})


def test_missing_inputs_payload_is_fine_at_load(case_dir: Path) -> None:
    # A case may take only literals; the payload is read by the child that runs it.
    (case_dir / CASE_FILE).write_text(MINIMAL + "[inputs]\nn = 3\n")
    case = load_case(case_dir)
    assert not case.inputs_file.exists()
    assert case.literals == {"n": 3}


def test_loaded_from_inside_the_case_dir(case_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (case_dir / CASE_FILE).write_text(MINIMAL)
    monkeypatch.chdir(case_dir)
    assert load_case(Path(".")).name == "ce_class4"


def test_constants() -> None:
    assert (CASE_FILE, INPUTS_FILE, EXPECTED_FILE) == (
        "case.toml", "inputs.safetensors", "expected.safetensors")
    assert BACKENDS == ("cuda", "rocm", "cpu", "mps", "xpu")
    assert DEVICE_TYPES == ("cuda", "cpu", "mps", "xpu")
    assert FLOAT_DTYPES == ("float16", "bfloat16", "float32", "float64")


def test_is_case_dir(tmp_path: Path) -> None:
    assert not is_case_dir(tmp_path)
    (tmp_path / CASE_FILE).write_text(MINIMAL)
    assert is_case_dir(tmp_path)


@pytest.mark.parametrize("name", sorted(p.parent.name for p in CASES.glob(f"*/{CASE_FILE}")))
def test_bundled_cases_load(name: str) -> None:
    case = load_case(CASES / name)
    assert case.name == name
    # Self-contained: the call, or a module case's factory, is in the case's own case.py.
    target = case.call
    if case.call == "pytest_gpucase.capture:replay_module":
        target = case.literals["gpucase_module"]["factory"]
    assert target.startswith("case.py:")


@pytest.mark.slow
def test_loading_does_not_import_torch(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(DESIGN_EXAMPLE)
    code = ("import sys; from pathlib import Path; from pytest_gpucase.case.load import load_case; "
            f"load_case(Path({str(case_dir)!r})); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_variant_inputs_name_the_inputs_that_follow_the_axis(case_dir: Path) -> None:
    (case_dir / CASE_FILE).write_text(textwrap.dedent("""\
        format = 1
        call = "case.py:run"
        [variants.batch]
        sizes = [1]
        inputs = ["logits", "target"]
        """))
    assert load_case(case_dir).variants.batch == AxisSizes(0, (1,), ("logits", "target"))
    problem = message(case_dir, """\
        format = 1
        call = "case.py:run"
        [variants.length]
        sizes = [1]
        inputs = "logits"
        """)
    assert "[variants.length] inputs" in problem and 'inputs = ["logits"]' in problem

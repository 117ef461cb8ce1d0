"""Reading a case directory's ``case.toml`` (format 1) into the ``Case`` model: bounds
checked before the work, every mistake a ``CaseFormatError`` naming the file, the key and
the fix. Nothing here imports torch or reads tensor data."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pytest_gpucase.base.backends import BACKENDS, DEVICE_TYPES
from pytest_gpucase.base.errors import CaseFormatError, link_inside
from pytest_gpucase.base.files import FileTooLarge, NotRegularFile, read_regular
from pytest_gpucase.case.keys import REPLAY_MODULE
from pytest_gpucase.case.model import (
    CASE_FILE,
    DEFAULT_TIMEOUT,
    EXPECTED_FILE,
    FLOAT_DTYPES,
    FORMATS,
    INPUTS_FILE,
    MAX_AXIS,
    MAX_CASE_BYTES,
    MAX_FOLDER_ENTRIES,
    MAX_MEMORY_LIMIT_GIB,
    MAX_TIMEOUT,
    MAX_TOML_DEPTH,
    MAX_ULPS,
    MAX_VARIANT_SIZE,
    MAX_VARIANT_VALUES,
    OUTCOMES,
    PYTEST_FILES,
    TF32_KEYS,
    TOML_INT_BITS,
    VARIANT_KINDS,
    VERSION_KEYS,
    Autocast,
    AxisSizes,
    Boundaries,
    Case,
    Expectation,
    ReplayContext,
    Requirements,
    ToleranceOverride,
    VariantTables,
    XfailScope,
    case_name,
)

__all__ = ["load_case", "read_case_file"]

_TOP_KEYS = (
    "format", "summary", "call", "reference", "timeout", "memory_limit", "launch_blocking",
    "xfail", "inputs_sha256", "inputs", "expect", "matrix", "variants", "ablate", "origin",
    "context",
)
_XFAIL_KEYS = ("reason", "devices", "dtypes", "variants")
_CONTEXT_KEYS = ("autocast", "grad", "inference", "deterministic", "tf32", "default_dtype", "rng")
_AUTOCAST_KEYS = ("device_type", "dtype", "enabled")
_RNG_KEYS = ("cpu", "cuda")
_EXPECT_KEYS = ("outcome", "exception", "match", "gradients", "equal_nan", "tolerance")
_TOLERANCE_KEYS = ("rtol", "atol", "ulps")
_MATRIX_KEYS = ("devices", "dtypes", "backends", *VERSION_KEYS, "packages")
_VARIANT_KEYS = ("batch", "length", "boundaries", "reject")
_AXIS_KEYS = ("axis", "sizes", "inputs")
_BATCH_KEYS = (*_AXIS_KEYS, "independent")
_BOUNDARY_KEYS = ("input", "classes", "ignore_index")
_REJECT_KEYS = ("exception", "match")
_ABLATE_KEYS = ("env",)
_CALL_RE = re.compile(r"^(?P<target>[^:]+):(?P<func>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
_DOTTED_NAME_RE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def load_case(path: Path) -> Case:
    """Read and validate the case directory at ``path``; raise ``CaseFormatError`` if wrong."""
    path = Path(path)
    file = path / CASE_FILE
    _check_folder(path)
    text = _read_text(file, path)
    # Each level of nesting needs a bracket or a brace (or a dot in a key, which tomllib
    # does not recurse on): a text with fewer of them cannot nest too deep.
    brackets = text.count("[") + text.count("{")
    if brackets > MAX_TOML_DEPTH and _nesting(text) > MAX_TOML_DEPTH:
        raise CaseFormatError(file, f"arrays or tables nest deeper than {MAX_TOML_DEPTH} levels; "
                              "a case needs a few: flatten the structure")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CaseFormatError(file, f"invalid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, say
        raise CaseFormatError(file, f"invalid TOML: {exc}; TOML integers are 64-bit") from None
    if brackets + text.count(".") >= MAX_TOML_DEPTH or _LONG_NUMBER.search(text):
        _check_bounds(doc, file)
    return _parse(doc, path, file)


def _check_folder(path: Path) -> None:
    """Refuse a case folder that holds what pytest itself imports or reads (``PYTEST_FILES``)
    or, at any depth, another case folder.

    pytest imports a ``conftest.py`` (and a package's ``__init__.py``) in its own process,
    and reads a configuration file of a folder it is given: a case's code runs only in a
    run's child, so none of them is ever imported or read (``plugin.items``), and the case
    is refused rather than run without them. A case below a case would never be collected:
    refused too, naming it. Hidden folders are skipped, as collection skips them; the
    names looked at are bounded (``MAX_FOLDER_ENTRIES``).
    """
    seen = 0
    pending = [path]
    while pending:
        folder = pending.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue  # the case folder itself: reading case.toml says what is wrong
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_FOLDER_ENTRIES:
                    raise CaseFormatError(path / CASE_FILE, f"its folder holds over "
                                          f"{MAX_FOLDER_ENTRIES} files and folders; a case is "
                                          "a minimal reproduction: keep its own files only")
                name = entry.name
                if folder is path and name in PYTEST_FILES:
                    raise CaseFormatError(Path(entry.path), _PYTEST_FILE_FIX[
                        name in ("conftest.py", "__init__.py")])
                if folder is not path and name == CASE_FILE:
                    inner = os.path.relpath(folder, path)
                    raise CaseFormatError(Path(entry.path), f"a case folder inside the case "
                                          f"folder {case_name(path)}: a case does not hold "
                                          "cases, and this one would never run; move "
                                          f"{inner} beside {case_name(path)}")
                with contextlib.suppress(OSError):
                    if (not name.startswith(".") and name != "__pycache__"
                            and entry.is_dir(follow_symlinks=False)):
                        pending.append(Path(entry.path))


_PYTEST_FILE_FIX = {
    True: ("pytest would import it in its own process, and a case's code runs only in a run's "
           "child: it is never imported; remove it (a conftest.py or a package belongs above "
           "the cases folder)"),
    False: ("a pytest configuration file in a case folder: pytest reads it as its own "
            "configuration when given this folder, and it does not say where the case imports "
            "from, so it is never read; remove it (configure pytest above the cases folder)"),
}


# An integer beyond 64 bits has at least 16 digits (hex), 19 decimal: a text without such a
# run of digit characters (underscores count, TOML allows them in numbers) holds none.
_LONG_NUMBER = re.compile(r"[0-9a-fA-F_]{16}")


def read_case_file(file: Path, limit: int, fix: str, case_dir: Path | None = None, *,
                   too_large: str | None = None) -> bytes:
    """The bytes of a file read from a case, within ``limit``: the one way the pytest process
    and the tools read a case's files (every bound in the table "Bounds" of
    docs/case-format.md), on ``base.files.read_regular``.

    With ``case_dir``, a symlink must stay inside it; a FIFO, a device or a directory is
    refused from the open file's ``fstat`` without blocking, and the size before any byte
    is read. ``fix`` ends the refusal (``too_large``, when given, that of a file too large).
    Raises ``CaseFormatError``, and ``OSError`` as
    ``os.open`` does (``FileNotFoundError`` included) for the caller to word.
    """
    if case_dir is not None:
        link_inside(file, case_dir)
    try:
        return read_regular(file, limit)
    except NotRegularFile as exc:
        raise CaseFormatError(file, f"is {exc.kind}, not a regular file; {fix}") from None
    except FileTooLarge as exc:
        raise CaseFormatError(file, f"is {exc.size} bytes, over the limit of {limit}; "
                              f"{too_large or fix}") from None


def _read_text(file: Path, case_dir: Path) -> str:
    """The text of ``case.toml``, refused before reading when it is not a small regular file
    (a symlink must stay inside the case directory)."""
    target = link_inside(file, case_dir)
    try:
        data = read_case_file(file, MAX_CASE_BYTES, "replace it with the case's TOML text file",
                              too_large="a case.toml holds settings, not data: put tensors "
                              "in inputs.safetensors")
    except FileNotFoundError:
        if target is not None:
            raise CaseFormatError(file, f"is a symlink to {target}, which does not exist; "
                                  "replace it with the file itself") from None
        held = [name for name in (INPUTS_FILE, EXPECTED_FILE)
                if os.path.lexists(case_dir / name)]
        if held:  # collected and validated as a case, not passed over in silence
            raise CaseFormatError(file, f"missing, but the directory holds {', '.join(held)}: "
                                  "an interrupted write or a deleted case.toml") from None
        raise CaseFormatError(file, "missing; a case directory needs a case.toml") from None
    except OSError as exc:
        raise CaseFormatError(file, f"cannot be read: {exc}") from None
    try:
        # A byte order mark (what some Windows editors write) is not TOML: left out.
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise CaseFormatError(file, f"is not UTF-8 text ({exc}); save it as UTF-8, as TOML "
                              "requires") from None



# What tomllib recurses on: brackets and braces outside strings and comments.
_TOML_TOKEN = re.compile(
    r'#[^\n]*'                      # a comment
    r'|"""(?:\\.|[^\\])*?"""'       # a multi-line basic string
    r"|'''.*?'''"                   # a multi-line literal string
    r'|"(?:\\.|[^"\\\n])*"'         # a basic string
    r"|'[^'\n]*'"                   # a literal string
    r"|[\[\]{}]",
    re.S)


def _nesting(text: str) -> int:
    """How deep arrays and inline tables nest in TOML text, read before tomllib recurses."""
    depth = deepest = 0
    for token in _TOML_TOKEN.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in ("]", "}"):
            depth = max(depth - 1, 0)
    return deepest


def _check_bounds(doc: Mapping[str, Any], file: Path) -> None:
    """Every integer is 64-bit and no value nests deeper than ``MAX_TOML_DEPTH`` (dotted keys
    nest without brackets); walked without recursion."""
    low, high = -(2 ** (TOML_INT_BITS - 1)), 2 ** (TOML_INT_BITS - 1) - 1
    stack: list[tuple[str, Any, int]] = [("", doc, 0)]
    while stack:
        where, value, depth = stack.pop()
        if depth > MAX_TOML_DEPTH:
            raise CaseFormatError(file, f"tables nest deeper than {MAX_TOML_DEPTH} levels; a case "
                                  "needs a few: flatten the structure", key=where or None)
        if isinstance(value, dict):
            stack.extend((f"{where}.{key}" if where else str(key), item, depth + 1)
                         for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((where, item, depth + 1) for item in value)
        elif _fits(value, int) and not low <= value <= high:
            raise CaseFormatError(file, f"integer {value} does not fit in {TOML_INT_BITS} bits; "
                                  "write a smaller number", key=where or None)


def _toml(value: Any) -> str:
    """A value written as in TOML, so that a message quotes what the user wrote."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return f"[{', '.join(_toml(item) for item in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{key} = {_toml(item)}' for key, item in value.items())}}}"
    return str(value)


def _fits(value: Any, kind: type | tuple[type, ...]) -> bool:
    # bool is an int in Python, but `timeout = true` is a mistake, not one second.
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kind) and (bool in kinds or not isinstance(value, bool))


class _Reader:
    """Typed access to one TOML table, with errors that name the file and key."""

    def __init__(self, file: Path, table: Mapping[str, Any], section: str) -> None:
        self.file = file
        self.table = table
        self.section = section  # dotted table name, "" for the top level

    def key(self, name: str) -> str:
        if not self.section:
            return name
        return f"[{self.section}] {name}" if name else f"[{self.section}]"

    def error(self, name: str, message: str) -> CaseFormatError:
        return CaseFormatError(self.file, message, key=self.key(name))

    def only(self, allowed: tuple[str, ...]) -> None:
        for name in self.table:
            if name not in allowed:
                guess = difflib.get_close_matches(name, allowed, n=1)
                hint = (f"did you mean '{guess[0]}'?" if guess
                        else f"expected one of {', '.join(allowed)}")
                raise self.error(name, f"unknown key; {hint}")

    def get(self, name: str, kind: type | tuple[type, ...], what: str, default: Any = None) -> Any:
        if name not in self.table:
            return default
        value = self.table[name]
        if _fits(value, kind):
            return value
        fix = ""
        if isinstance(value, str) and kind is list:
            fix = f"; write {name} = [{_toml(value)}]"
        elif isinstance(value, str):
            try:
                unquoted = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                unquoted = None
            if unquoted is not None and _fits(unquoted, kind):
                fix = "; write it without quotes"
        raise self.error(name, f"expected {what}, got {_toml(value)}{fix}")

    def table_at(self, name: str) -> _Reader:
        section = f"{self.section}.{name}" if self.section else name
        value = self.get(name, dict, f"a table [{section}]", default={})
        return _Reader(self.file, value, section)

    def strings(self, name: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...] | None:
        values = self.get(name, list, "a list of strings")
        if values is None:
            return None
        for index, value in enumerate(values):
            if not isinstance(value, str):
                raise self.error(name, f"expected a list of strings, found {_toml(value)}")
            if allowed is not None and value not in allowed:
                raise self.error(name, f"unknown '{value}'; expected one of {', '.join(allowed)}")
            if value in values[:index]:
                # Each entry is a run with its own id; a repeat would collide.
                raise self.error(name, f"'{value}' is listed twice; list it once")
        if not values:
            raise self.error(name, "is empty; remove the key to use the default")
        return tuple(values)

    def specifier(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.error(name, f"expected a version specifier string like \">=2.1\", "
                             f"got {_toml(value)}")
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            try:
                Version(value)
            except InvalidVersion:
                fix = "write it like \">=2.1\" or \">=2.1,<3\""
            else:
                fix = f"a bare version needs an operator: write \">={value}\" or \"=={value}.*\""
            raise self.error(name, f"'{value}' is not a PEP 440 specifier; {fix}") from None
        return value


def _parse(doc: Mapping[str, Any], path: Path, file: Path) -> Case:
    top = _Reader(file, doc, "")
    # The format decides which keys are valid, so it is checked first: a newer
    # case must read as "newer format", not as a list of unknown keys.
    fmt = top.get("format", int, "an integer")
    if fmt is None:
        raise top.error("format", "missing; add `format = 1` as the first line")
    if fmt not in FORMATS:
        supported = ", ".join(str(f) for f in FORMATS)
        raise top.error("format", f"unsupported format {fmt}; this pytest-gpucase reads format "
                        f"{supported}: upgrade pytest-gpucase, or write the case in format "
                        f"{supported}")
    top.only(_TOP_KEYS)
    call = top.get("call", str, "a string 'FILE.py:func' or 'package.module:func'")
    if call is None:
        raise top.error("call", "missing; name the function to run, e.g. call = \"case.py:run\"")
    _check_target(top, "call", call, path)
    reference = top.get("reference", str, "a string 'FILE.py:func' or 'package.module:func'")
    if reference is not None:
        _check_target(top, "reference", reference, path)
    timeout = _positive(top, "timeout", "a number of seconds", MAX_TIMEOUT, "seconds")
    memory_gib = _positive(top, "memory_limit", "a number of GiB", MAX_MEMORY_LIMIT_GIB, "GiB")
    xfail, xfail_scope = _parse_xfail(top)

    literals = top.get("inputs", dict, "a table [inputs]", default={})
    expect = _parse_expectation(top.table_at("expect"), with_extras=True)
    context = _parse_context(top.table_at("context"))
    if _recorder_default_tolerance(call, context, expect):
        expect = dataclasses.replace(expect, tolerance={})
    return Case(
        name=case_name(path),
        path=path,
        summary=top.get("summary", str, "a string", ""),
        call=call,
        reference=reference,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        launch_blocking=top.get("launch_blocking", bool, "true or false", False),
        xfail=xfail,
        literals=literals,
        expect=expect,
        matrix=_parse_matrix(top.table_at("matrix")),
        variants=_parse_variants(top.table_at("variants")),
        ablate_env=_parse_ablate(top.table_at("ablate")),
        origin=top.get("origin", dict, "a table [origin]", default={}),
        inputs_sha256=_parse_hash(top),
        memory_limit=None if memory_gib is None else int(memory_gib * 2**30),
        xfail_scope=xfail_scope,
        context=context,
    )


# What the Recorder once wrote into every module case recorded under autocast, for both the
# autocast dtype and float32: four epsilons of that dtype as rtol and atol (the same number).
_RECORDER_TOLERANCE = {"bfloat16": 2.0**-5, "float16": 2.0**-8}


def _recorder_default_tolerance(call: str, context: ReplayContext, expect: Expectation) -> bool:
    """Whether ``expect.tolerance`` is exactly the table the Recorder wrote before it left
    the verdict's default rule to judge its cases: a default it chose, not the user's
    choice, and one that turned the rounding budget off (a correct bf16 model failed). Such a
    case is judged by the default rule, as one recorded now is; any other figure is the
    user's, applied as written."""
    autocast = context.autocast
    if call != REPLAY_MODULE or autocast is None:
        return False
    figure = _RECORDER_TOLERANCE.get(autocast.dtype)
    written = ToleranceOverride(rtol=figure, atol=figure)
    return figure is not None and dict(expect.tolerance) == {autocast.dtype: written,
                                                             "float32": written}


def _parse_xfail(top: _Reader) -> tuple[str | None, XfailScope]:
    """``xfail = "reason"`` (every run) or ``xfail = { reason = ..., devices = [...], ... }``."""
    if isinstance(top.table.get("xfail"), dict):
        table = top.table_at("xfail")
        table.only(_XFAIL_KEYS)
        reason = table.get("reason", str, "a string giving the reason")
        if reason is None or not reason.strip():
            raise table.error("reason", "missing or empty; give the reason the case is known "
                              "to fail")
        scope = XfailScope(devices=table.strings("devices", DEVICE_TYPES),
                           dtypes=table.strings("dtypes", FLOAT_DTYPES),
                           variants=table.strings("variants", VARIANT_KINDS))
        return reason, scope
    xfail = top.get("xfail", str, "a string giving the reason")
    if xfail is not None and not xfail.strip():
        raise top.error("xfail", "is empty; give the reason the case is known to fail")
    return xfail, XfailScope()


def _parse_context(reader: _Reader) -> ReplayContext:
    reader.only(_CONTEXT_KEYS)
    autocast = None
    if "autocast" in reader.table:
        table = reader.table_at("autocast")
        table.only(_AUTOCAST_KEYS)
        device_type = table.get("device_type", str, "a device type like \"cuda\"")
        if device_type not in DEVICE_TYPES:
            raise table.error("device_type", f"expected one of {', '.join(DEVICE_TYPES)}")
        dtype = table.get("dtype", str, "a dtype name like \"bfloat16\"")
        if dtype not in FLOAT_DTYPES:
            raise table.error("dtype", f"expected one of {', '.join(FLOAT_DTYPES)}")
        autocast = Autocast(device_type, dtype, table.get("enabled", bool, "true or false", True))
    tf32 = reader.table_at("tf32")
    tf32.only(TF32_KEYS)
    default_dtype = reader.get("default_dtype", str, "a dtype name like \"float32\"")
    if default_dtype is not None and default_dtype not in FLOAT_DTYPES:
        raise reader.error("default_dtype", f"expected one of {', '.join(FLOAT_DTYPES)}")
    rng = reader.table_at("rng")
    rng.only(_RNG_KEYS)
    return ReplayContext(
        autocast=autocast,
        grad=reader.get("grad", bool, "true or false"),
        inference=reader.get("inference", bool, "true or false"),
        deterministic=reader.get("deterministic", bool, "true or false"),
        tf32_matmul=tf32.get("matmul", bool, "true or false"),
        tf32_cudnn=tf32.get("cudnn", bool, "true or false"),
        default_dtype=default_dtype,
        rng={name: rng.get(name, str, "the name of a uint8 tensor in inputs.safetensors")
             for name in _RNG_KEYS if name in rng.table},
    )


def _positive(top: _Reader, name: str, what: str, bound: float, unit: str) -> float | None:
    """A positive, finite number no larger than ``bound`` (compared before any conversion)."""
    value = top.get(name, (int, float), what)
    if value is None:
        return None
    if not (value > 0 and math.isfinite(value)):
        raise top.error(name, f"must be a positive number of {unit}, got {value:g}")
    if value > bound:
        raise top.error(name, f"{value:g} {unit} is over the limit of {bound:g}; give a "
                        "smaller number")
    return float(value)


def _parse_hash(top: _Reader) -> str | None:
    value: str | None = top.get("inputs_sha256", str, 'a string "sha256:<64 hex digits>"')
    if value is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", value):
        raise top.error("inputs_sha256", f"'{value}' is not \"sha256:\" followed by 64 "
                        "lowercase hex digits; set it to the inputs_sha256 line `gpucase show "
                        "CASE` prints (or \"sha256:\" and the first field of `sha256sum "
                        "inputs.safetensors`), or remove the key")
    return value


def _check_target(top: _Reader, name: str, value: str, case_dir: Path) -> None:
    """A ``call``/``reference`` is ``FILE.py:func`` inside the case dir, or ``pkg.mod:func``."""
    found = _CALL_RE.match(value)
    if not found:
        raise top.error(name, f"'{value}' is not 'FILE.py:func' or 'package.module:func'; "
                        "write it like \"case.py:run\"")
    target = found["target"]
    if not target.endswith(".py"):
        if not all(part.isidentifier() for part in target.split(".")):
            raise top.error(name, f"'{target}' is not an importable module name")
        return
    if "/" not in target and os.sep not in target:
        # The common case, without pathlib or resolving (slow, per case, at scale): a
        # file directly in the case directory that is no symlink cannot lie outside it.
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(os.path.join(case_dir, target)).st_mode):
                return
    file = Path(target)
    if file.is_absolute() or ".." in file.parts:
        raise top.error(name, f"'{target}' escapes the case directory; put the file inside "
                        f"{case_dir.name}/")
    resolved = (case_dir / file).resolve()
    if not resolved.is_relative_to(case_dir.resolve()):
        raise top.error(name, f"'{target}' resolves outside the case directory (a symlink?); "
                        f"put the file inside {case_dir.name}/")
    if not resolved.is_file():
        raise top.error(name, f"'{target}' not found in {case_dir.name}/; create it or correct "
                        "the file name")


def _parse_tolerance(reader: _Reader) -> ToleranceOverride:
    reader.only(_TOLERANCE_KEYS)
    rtol = reader.get("rtol", (int, float), "a number")
    atol = reader.get("atol", (int, float), "a number")
    ulps = reader.get("ulps", int, "a whole number of units in the last place")
    if (rtol is None) != (atol is None):
        given, missing = ("rtol", "atol") if atol is None else ("atol", "rtol")
        raise reader.error(given, f"given without {missing}; give both rtol and atol, or neither")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise reader.error(name, f"must be a finite number >= 0, got {value}")
    if ulps is not None and not 1 <= ulps <= MAX_ULPS:
        raise reader.error("ulps", f"must be a whole number from 1 to {MAX_ULPS}, got {ulps}")
    if rtol is None and ulps is None:
        raise reader.error("", "is empty; give rtol and atol, or ulps")
    return ToleranceOverride(
        rtol=None if rtol is None else float(rtol),
        atol=None if atol is None else float(atol),
        ulps=None if ulps is None else float(ulps),
    )


def _parse_expectation(reader: _Reader, *, with_extras: bool) -> Expectation:
    reader.only(_EXPECT_KEYS if with_extras else _REJECT_KEYS)
    outcome = reader.get("outcome", str, "\"matches\" or \"raises\"", "raises" if not with_extras
                         else "matches")
    if outcome not in OUTCOMES:
        raise reader.error("outcome", f"unknown '{outcome}'; expected one of {', '.join(OUTCOMES)}")
    exception = reader.get("exception", str, "an exception type name like \"ValueError\"")
    if exception is not None and not _DOTTED_NAME_RE.match(exception):
        raise reader.error("exception", f"'{exception}' is not an exception type name; write it "
                           "like \"ValueError\" or \"torch.OutOfMemoryError\"")
    match = _parse_match(reader)
    _check_outcome_keys(reader, outcome, exception, match, with_extras=with_extras)
    tolerance = _parse_tolerances(reader) if with_extras else {}
    return Expectation(
        outcome=outcome,
        exception=exception,
        match=match,
        gradients=reader.get("gradients", bool, "true or false", False) if with_extras else False,
        equal_nan=reader.get("equal_nan", bool, "true or false", False) if with_extras else False,
        tolerance=tolerance,
    )


def _parse_match(reader: _Reader) -> str | None:
    """The ``match`` key, if given, when it compiles as a regular expression."""
    match: str | None = reader.get("match", str, "a regular expression")
    if match is not None:
        try:
            re.compile(match)
        except re.error as exc:
            raise reader.error("match", f"invalid regular expression: {exc}; to match a special "
                               "character literally, escape it with a backslash") from None
    return match


def _check_outcome_keys(reader: _Reader, outcome: str, exception: str | None,
                        match: str | None, *, with_extras: bool) -> None:
    """Whether ``exception`` and ``match`` are given exactly as the outcome needs them."""
    if outcome == "raises" and exception is None:
        fix = ("name the exception type, e.g. exception = \"ValueError\"" if with_extras else
               "name the exception out-of-range values must raise, e.g. exception = \"ValueError\"")
        raise reader.error("exception", f"missing; {fix}")
    if outcome == "matches" and (exception is not None or match is not None):
        key = "exception" if exception is not None else "match"
        raise reader.error(key, "only applies with outcome = \"raises\"; add outcome = "
                           f"\"raises\" or remove {key}")


def _parse_tolerances(reader: _Reader) -> dict[str, ToleranceOverride]:
    """The ``[tolerance.<dtype>]`` tables, each under a known floating dtype name."""
    tolerance: dict[str, ToleranceOverride] = {}
    tables = reader.table_at("tolerance")
    for dtype in tables.table:
        if dtype not in (*FLOAT_DTYPES, "complex64", "complex128"):
            guess = difflib.get_close_matches(dtype, FLOAT_DTYPES, n=1)
            hint = f"did you mean '{guess[0]}'?" if guess else "expected a floating dtype name"
            raise tables.error(dtype, f"unknown dtype; {hint}")
        tolerance[dtype] = _parse_tolerance(tables.table_at(dtype))
    return tolerance


def _parse_matrix(reader: _Reader) -> Requirements:
    reader.only(_MATRIX_KEYS)
    versions = {
        name: reader.specifier(name, reader.table[name])
        for name in VERSION_KEYS
        if name in reader.table
    }
    packages_reader = reader.table_at("packages")
    packages = {
        name: packages_reader.specifier(name, value) if value != "" else ""
        for name, value in packages_reader.table.items()
    }
    return Requirements(
        devices=reader.strings("devices", DEVICE_TYPES),
        dtypes=reader.strings("dtypes", FLOAT_DTYPES),
        backends=reader.strings("backends", BACKENDS),
        versions=versions,
        packages=packages,
    )


def _parse_axis_sizes(reader: _Reader, keys: tuple[str, ...] = _AXIS_KEYS) -> AxisSizes:
    reader.only(keys)
    axis = reader.get("axis", int, "an integer axis", 0)
    if axis < 0:
        # Inputs differ in rank, so an axis counted from the end names different axes.
        raise reader.error("axis", f"must be >= 0, got {axis}; count axes from the front")
    if axis > MAX_AXIS:
        raise reader.error("axis", f"{axis} is over the limit of {MAX_AXIS}; torch tensors have "
                           f"at most {MAX_AXIS + 1} dimensions")
    sizes = reader.get("sizes", list, "a list of positive integers")
    if not sizes:
        raise reader.error("sizes", "missing or empty; list the sizes to try, e.g. sizes = [1, 2]")
    if len(sizes) > MAX_VARIANT_VALUES:
        # Each size is a child process: a few edges, not a sweep.
        raise reader.error("sizes", f"lists {len(sizes)} sizes, over the limit of "
                           f"{MAX_VARIANT_VALUES}; keep the edges (1, the saved size, a large one)")
    seen: set[int] = set()
    for size in sizes:
        if not _fits(size, int) or size < 1:
            raise reader.error("sizes", f"expected positive integers, found {_toml(size)}")
        if size > MAX_VARIANT_SIZE:
            raise reader.error("sizes", f"{size} is over the limit of {MAX_VARIANT_SIZE}; a "
                               "variant checks an edge, not a workload")
        if size in seen:
            raise reader.error("sizes", f"{size} is listed twice; list it once")
        seen.add(size)
    return AxisSizes(axis=axis, sizes=tuple(sizes), inputs=reader.strings("inputs"),
                     independent=reader.get("independent", bool, "true or false", True))


def _parse_variants(reader: _Reader) -> VariantTables:
    reader.only(_VARIANT_KEYS)
    batch = (_parse_axis_sizes(reader.table_at("batch"), _BATCH_KEYS) if "batch" in reader.table
             else None)
    length = _parse_axis_sizes(reader.table_at("length")) if "length" in reader.table else None
    boundaries = None
    if "boundaries" in reader.table:
        table = reader.table_at("boundaries")
        table.only(_BOUNDARY_KEYS)
        name = table.get("input", str, "the name of a class-index input")
        if name is None:
            raise table.error("input", "missing; name the class-index input, e.g. "
                              "input = \"target\"")
        classes = table.get("classes", int, "the number of classes")
        if classes is None or classes < 1:
            raise table.error("classes", "missing or < 1; give the number of classes of the head")
        boundaries = Boundaries(name, classes, table.get("ignore_index", int, "an integer"))
    reject = None
    if "reject" in reader.table:
        if boundaries is None:
            raise reader.error("reject", "only applies with boundaries; add boundaries = { input "
                               "= ..., classes = ... } or remove [variants.reject]")
        reject = _parse_expectation(reader.table_at("reject"), with_extras=False)
    elif boundaries is not None:
        raise reader.error("reject", "missing; boundaries need [variants.reject] with the "
                           "exception that out-of-range values must raise")
    return VariantTables(batch=batch, length=length, boundaries=boundaries, reject=reject)


def _parse_ablate(reader: _Reader) -> dict[str, str]:
    reader.only(_ABLATE_KEYS)
    env = reader.get("env", dict, "a table of environment variables", default={})
    for name, value in env.items():
        if not isinstance(value, str):
            raise reader.error("env", f"{name}: expected a string, got {_toml(value)}; write "
                               f"{name} = {_toml(_toml(value))}")
    return dict(env)

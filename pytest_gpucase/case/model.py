"""The ``Case`` model of a ``case.toml`` (format 1), its file names and its bounds; read by
``case.load``.

Nothing here imports torch or reads tensor data: collection of thousands of
cases must stay cheap, and a broken case must be reported before anything runs.
"""

from __future__ import annotations

from pytest_gpucase.base.dtypes import FLOAT_DTYPES as _FLOAT_DTYPES
import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on Python 3.10 only
    pass

__all__ = [
    "CASE_FILE",
    "CASE_MODULE_PREFIX",
    "DEFAULT_TIMEOUT",
    "EXPECTED_FILE",
    "FLOAT_DTYPES",
    "FORMATS",
    "INPUTS_FILE",
    "MAX_AXIS",
    "MAX_CASE_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_FOLDER_ENTRIES",
    "MAX_MEMORY_LIMIT_GIB",
    "MAX_SOURCE_BYTES",
    "MAX_TIMEOUT",
    "MAX_TOML_DEPTH",
    "MAX_ULPS",
    "MAX_VARIANT_ELEMENTS",
    "MAX_VARIANT_SIZE",
    "MAX_VARIANT_VALUES",
    "OUTCOMES",
    "PYTEST_FILES",
    "TOML_INT_BITS",
    "VARIANT_KINDS",
    "VERSION_KEYS",
    "Autocast",
    "AxisSizes",
    "Boundaries",
    "Case",
    "Expectation",
    "ReplayContext",
    "Requirements",
    "ToleranceOverride",
    "VariantTables",
    "XfailScope",
    "case_name",
    "inside_case",
    "is_case_dir",
    "looks_like_case",
]

# The start of the name a case's own ``FILE.py`` is imported under (``run.prepared``), which
# no other module's name has.
CASE_MODULE_PREFIX = "gpucase_case_"

CASE_FILE = "case.toml"
INPUTS_FILE = "inputs.safetensors"
EXPECTED_FILE = "expected.safetensors"
FORMATS = (1,)
DEFAULT_TIMEOUT = 120.0

# Bounds, each checked before the work or the allocation it limits (the table "Bounds" in
# docs/case-format.md): a case is a minimal reproduction, and a hostile one must cost a
# collecting process nothing but a failed item.
MAX_CASE_BYTES = 2**20             # case.toml, checked with stat before it is read
MAX_SOURCE_BYTES = 16 * 2**20      # a case's own .py file (validate parses it, keys hash it)
MAX_CONFIG_BYTES = 2**20           # a pytest configuration file above a case (case.project)
MAX_TOML_DEPTH = 32                # arrays and tables inside each other (tomllib recurses)
TOML_INT_BITS = 64                 # every integer in case.toml, as TOML itself specifies
MAX_TIMEOUT = 7 * 24 * 3600.0      # seconds
MAX_MEMORY_LIMIT_GIB = 2.0**20     # memory_limit, in GiB
MAX_AXIS = 63                      # a variant axis (torch tensors have at most 64 dimensions)
MAX_VARIANT_SIZE = 2**20           # each batch or length size
MAX_VARIANT_VALUES = 64            # sizes of one variant kind (each is a child process)
MAX_VARIANT_ELEMENTS = 2**28       # elements of a variant's resized inputs, all together
MAX_ULPS = 2**20                   # units in the last place
MAX_FOLDER_ENTRIES = 4096          # names in a case folder and the folders below it, together

# What pytest itself imports or reads from a directory it collects or is given, before or
# without any plugin: a conftest.py and a package's __init__.py run code in the pytest
# process, a configuration file configures pytest. A case folder holds none of them
# (``case.load`` refuses it, and no conftest.py in a case folder is ever imported).
PYTEST_FILES = ("conftest.py", "__init__.py", "pytest.toml", ".pytest.toml", "pytest.ini",
                ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")

FLOAT_DTYPES = _FLOAT_DTYPES   # the dtypes a run may use: base.dtypes.DTYPE_TABLE
OUTCOMES = ("matches", "raises")
VERSION_KEYS = ("torch", "python", "cuda", "hip", "capability")

VARIANT_KINDS = ("none", "batch", "length", "boundary")  # "none": the run without a variant
TF32_KEYS = ("matmul", "cudnn")


@dataclass(frozen=True)
class ToleranceOverride:
    """An ``[expect.tolerance.<dtype>]`` override: rtol and atol together, and/or ulps."""

    rtol: float | None = None
    atol: float | None = None
    ulps: float | None = None


@dataclass(frozen=True)
class Expectation:
    """What a run must produce: outputs matching the reference, or a given exception."""

    outcome: Literal["matches", "raises"] = "matches"
    exception: str | None = None
    match: str | None = None
    gradients: bool = False
    equal_nan: bool = False
    tolerance: Mapping[str, ToleranceOverride] = field(default_factory=dict)

    @property
    def wanted(self) -> str:
        """The exception a ``raises`` outcome asks for, in words: ``ValueError matching 'out
        of range'`` (a failure, ``gpucase show``, a reject variant's description)."""
        return (self.exception or "Exception") + (f" matching {self.match!r}" if self.match
                                                  else "")


@dataclass(frozen=True)
class Requirements:
    """The ``[matrix]`` table: where the case runs and what it requires."""

    devices: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None
    versions: Mapping[str, str] = field(default_factory=dict)  # key in VERSION_KEYS -> specifier
    packages: Mapping[str, str] = field(default_factory=dict)  # distribution -> specifier


@dataclass(frozen=True)
class AxisSizes:
    """A ``batch`` or ``length`` variant table: an axis and the sizes to try on it."""

    axis: int
    sizes: tuple[int, ...]
    inputs: tuple[str, ...] | None = None  # the inputs that follow the axis; None: inferred
    # batch only: false when the samples of a batch meet by design (statistics over the
    # batch, a contrastive loss): the variant's rows are not compared with the full batch's
    independent: bool = True


@dataclass(frozen=True)
class Boundaries:
    """A ``boundaries`` variant table: a class-index input and its valid range."""

    input: str
    classes: int
    ignore_index: int | None = None


@dataclass(frozen=True)
class VariantTables:
    """The ``[variants]`` table as written in the case."""

    batch: AxisSizes | None = None
    length: AxisSizes | None = None
    boundaries: Boundaries | None = None
    reject: Expectation | None = None


@dataclass(frozen=True)
class XfailScope:
    """Where a case's ``xfail`` applies; None on an axis means every value of it."""

    devices: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    variants: tuple[str, ...] | None = None  # variant kinds, "none" for the unvaried run

    def covers(self, device: str, dtype: str, variant_kind: str | None) -> bool:
        """Whether the run on ``device`` in ``dtype`` (with a variant of that kind) is in scope."""
        return ((self.devices is None or device in self.devices)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.variants is None or (variant_kind or "none") in self.variants))


@dataclass(frozen=True)
class Autocast:
    """``[context] autocast``: the autocast region the captured call ran in."""

    device_type: str
    dtype: str
    enabled: bool = True


@dataclass(frozen=True)
class ReplayContext:
    """The ``[context]`` table: the numeric state a replay restores around the call.

    None on a key means "as the child starts" (torch's defaults), so that a hand-written
    case without the table runs as before.
    """

    autocast: Autocast | None = None
    grad: bool | None = None
    inference: bool | None = None
    deterministic: bool | None = None
    tf32_matmul: bool | None = None
    tf32_cudnn: bool | None = None
    default_dtype: str | None = None
    rng: Mapping[str, str] = field(default_factory=dict)  # "cpu"/"cuda" -> payload tensor name

    @property
    def compute_dtype(self) -> str | None:
        """The dtype the call really computes in under autocast, or None without it."""
        if self.autocast is not None and self.autocast.enabled:
            return self.autocast.dtype
        return None


@dataclass(frozen=True)
class Case:
    """One case directory, validated; tensors stay on disk until a child loads them."""

    name: str
    path: Path
    summary: str
    call: str
    reference: str | None
    timeout: float
    launch_blocking: bool
    xfail: str | None
    literals: Mapping[str, Any]
    expect: Expectation
    matrix: Requirements
    variants: VariantTables
    ablate_env: Mapping[str, str]
    origin: Mapping[str, Any]
    inputs_sha256: str | None = None  # "sha256:<hex>" of inputs.safetensors, checked before use
    memory_limit: int | None = None  # bytes a run's child may use (memory_limit in GiB), or None
    xfail_scope: XfailScope = field(default_factory=XfailScope)  # where ``xfail`` applies
    context: ReplayContext = field(default_factory=ReplayContext)

    def xfail_for(self, device: str, dtype: str, variant_kind: str | None) -> str | None:
        """The xfail reason of one run, or None when the run lies outside the xfail's scope."""
        if self.xfail is None or not self.xfail_scope.covers(device, dtype, variant_kind):
            return None
        return self.xfail

    @property
    def incomplete(self) -> tuple[str, ...]:
        """What the Recorder could not save of the case (``[origin] incomplete``): while it
        holds a reason, the case cannot replay its failure as captured, and a pass of it
        says nothing of the code (``run.parent.incomplete_pass``)."""
        reasons = self.origin.get("incomplete")
        if isinstance(reasons, str):
            reasons = [reasons]
        if not isinstance(reasons, list):
            return ()
        return tuple(str(reason) for reason in reasons if str(reason).strip())

    # Each made once per case (a run asks for them several times, and a forked child that
    # builds a path runs pathlib's parsing, each of its objects a page copied from the parent):
    # the parent's first use leaves them in the instance's dict, inherited by its children.
    @functools.cached_property
    def case_file(self) -> Path:
        return self.path / CASE_FILE

    @functools.cached_property
    def inputs_file(self) -> Path:
        return self.path / INPUTS_FILE

    @functools.cached_property
    def expected_file(self) -> Path:
        return self.path / EXPECTED_FILE


def is_case_dir(path: Path) -> bool:
    """Whether a directory holds a case: anything named ``case.toml``, even a broken one.

    A dangling symlink, a FIFO or a directory named ``case.toml`` is a case
    that cannot load, reported as such, rather than a case silently skipped.
    """
    return os.path.lexists(os.path.join(path, CASE_FILE))


def looks_like_case(path: Path) -> bool:
    """Whether a directory is a case (``is_case_dir``) or one that lost its ``case.toml``: it
    holds a payload only a case holds. Both are collected and validated, the second as a
    broken case, rather than passed over in silence."""
    return is_case_dir(path) or any(os.path.lexists(os.path.join(path, name))
                                    for name in (INPUTS_FILE, EXPECTED_FILE))


def inside_case(path: Path | str) -> bool:
    """Whether ``path`` (a file or folder) lies in a case folder: its folder or one above holds
    a ``case.toml``. For the rare question (a conftest.py pytest is about to import); each
    level costs one ``lstat``."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        if is_case_dir(Path(folder)):
            return True
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent


def case_name(path: Path) -> str:
    """A case's name as text that any terminal or JSON writer takes.

    A directory name that is not valid UTF-8 reaches Python with lone
    surrogates; its undecodable bytes are shown as ``\\xNN`` instead.
    """
    name = path.name or path.resolve().name
    return os.fsencode(name).decode("utf-8", "backslashreplace")

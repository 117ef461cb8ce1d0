"""The plugin's settings: each one a command-line option and an ini key of the same name.

``SETTINGS`` is the one table of them (name, help, kind, default): ``add_options``
declares them, ``setting`` reads one (the command line wins over the ini), checked the
same way from either place, a mistake being a usage error that names where it came from.
``Settings`` is every one of them read once, as typed attributes of the same names
(``Settings.read(config)``): nothing else reads an option by its string.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import pytest

from pytest_gpucase.base.backends import launch_blocking_words, visible_devices_words
from pytest_gpucase.base.errors import display_posix

__all__ = ["SETTINGS", "Setting", "Settings", "add_options", "setting"]


@dataclass(frozen=True)
class Setting:
    """One setting: a command-line option and the ini key of the same name."""

    name: str            # the ini key and the option's dest, e.g. "gpu_devices"
    help: str
    kind: Literal["bool", "csv", "path", "choice", "paths", "gib", "list"] = "bool"
    choices: tuple[str, ...] = ()
    default: Any = None
    needs_cases: bool = False  # meaningless without --gpu-cases: a usage error on the command line

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS = (
    Setting("gpu_cases", "collect case directories (with a case.toml) and replay each run in a "
            "fresh child process", default=False),
    Setting("gpu_cases_paths", "case folders collected by --gpu-cases when no path is given on "
            "the command line (ini only; relative to the rootdir)", kind="paths", default=()),
    Setting("gpu_launch_blocking", "run device items with the backend's launch-blocking variable, "
            f"{launch_blocking_words(None)}; never for timing", default=False,
            needs_cases=True),
    Setting("gpu_devices", "only these device types, e.g. cuda,cpu (narrows each case's list)",
            kind="csv"),
    Setting("gpu_dtypes", "only these dtypes, e.g. float32,bfloat16 (narrows each case's list)",
            kind="csv"),
    Setting("gpu_no_localize", "do not rerun an asynchronous device error with launch blocking",
            default=False, needs_cases=True),
    Setting("gpu_cases_regen", "write or rewrite each case's expected.safetensors from its "
            "reference run, and list the files written", default=False, needs_cases=True),
    Setting("gpu_cases_report", "write the run's results (environment and every item) as JSON "
            "here", kind="path", needs_cases=True),
    Setting("gpu_ablate", "rerun each failing item under one change at a time (CPU, float32, "
            "float64, TF32 off, cuDNN off, ...) and report which make it pass", default=False,
            needs_cases=True),
    Setting("gpu_per_worker", "under pytest-xdist, give each worker's runs one device of the "
            f"visible ones, round-robin ({visible_devices_words()})", default=False),
    Setting("gpu_memory_limit", "kill a run's whole process tree when its resident memory "
            "passes this many GiB, e.g. 8 (a case's own memory_limit wins)", kind="gib",
            needs_cases=True),
    Setting("gpu_start_method", "how each run's child starts: auto (fork, or forkserver when "
            "CUDA is already initialized in the pytest process), fork, forkserver (forked by a "
            "zygote started with the session, before CUDA could be initialized), spawn (a fresh "
            "interpreter per run)", kind="choice",
            choices=("auto", "fork", "forkserver", "spawn"), default="auto"),
    Setting("gpu_isolation", "how fresh each run's child is: item (a fresh child per run), "
            "case (one child runs a case's runs in turn), worker (one child per device runs "
            "them all, keeping its device context); a reused child ends on a crash, a timeout "
            "or any state a fresh child would not have, and a failure after its first run (any "
            "outcome of a strict xfail) is judged again in a fresh child; a timeout is not",
            kind="choice", choices=("item", "case", "worker"), default="item"),
    Setting("gpu_require", "fail the session at its start unless this package is installed, "
            "in this range: e.g. rowext or \"rowext>=2,<3\" (repeatable; the ini key takes a "
            "list)", kind="list", default=()),
)


_SETTINGS = {setting.name: setting for setting in SETTINGS}


@dataclass(frozen=True)
class Settings:
    """Every setting of ``SETTINGS``, resolved once per session: a field per row, of the same
    name (a test holds the two together). Defaults and help live in the table."""

    gpu_cases: bool
    gpu_cases_paths: tuple[str, ...]
    gpu_launch_blocking: bool
    gpu_devices: tuple[str, ...] | None
    gpu_dtypes: tuple[str, ...] | None
    gpu_no_localize: bool
    gpu_cases_regen: bool
    gpu_cases_report: Path | None
    gpu_ablate: bool
    gpu_per_worker: bool
    gpu_memory_limit: int | None    # bytes
    gpu_start_method: Literal["auto", "fork", "forkserver", "spawn"]
    gpu_isolation: Literal["item", "case", "worker"]
    gpu_require: tuple[str, ...]    # pip requirements, checked at the session's start

    @classmethod
    def read(cls, config: pytest.Config) -> Settings:
        """Every setting from ``config`` (a mistake is a usage error naming its source)."""
        return cls(**{spec.name: setting(config, spec.name) for spec in SETTINGS})

    @classmethod
    def defaults(cls, **given: Any) -> Settings:
        """The table's defaults, with ``given`` instead where named (for callers without a
        pytest session, and tests)."""
        values = {spec.name: spec.default for spec in SETTINGS}
        values["gpu_cases_paths"] = tuple(values["gpu_cases_paths"] or ())
        unknown = set(given) - set(values)
        if unknown:
            raise TypeError(f"no setting named {sorted(unknown)[0]!r}")
        return cls(**{**values, **given})


assert {f.name for f in fields(Settings)} == set(_SETTINGS), "Settings and SETTINGS differ"


def add_options(parser: pytest.Parser) -> None:
    """Every setting as a command-line option and an ini key of the same name."""
    group = parser.getgroup("gpucase", "saved GPU failure cases")
    for setting in SETTINGS:
        # A list setting reads both spellings of its ini key: "cpu,cuda" in an ini file, and
        # the TOML list ["cpu", "cuda"] of pyproject.toml (as gpu_cases_paths and a case's
        # [matrix] dtypes are written); "args" gives both as a list of strings.
        ini_type = {"bool": "bool", "paths": "paths", "csv": "args",
                    "list": "args"}.get(setting.kind, "string")
        default = [] if setting.kind == "csv" and setting.default is None else setting.default
        parser.addini(setting.name, setting.help, type=ini_type,  # type: ignore[arg-type]
                      default=default)
        if setting.kind == "paths":
            continue
        if setting.kind == "bool":
            group.addoption(setting.flag, action="store_true", default=None, help=setting.help)
        elif setting.kind == "list":
            group.addoption(setting.flag, action="append", default=None,
                            metavar=setting.name.removeprefix("gpu_").upper(), help=setting.help)
        elif setting.kind == "choice":
            group.addoption(setting.flag, choices=setting.choices, default=None,
                            help=setting.help)
        else:
            group.addoption(setting.flag, metavar=setting.name.removeprefix("gpu_").upper(),
                            default=None, help=setting.help)


def setting(config: pytest.Config, name: str) -> Any:
    """A setting's value: the command line's, else the ini key's, else the default.

    Values from either place are checked the same way; a mistake is a usage error
    naming where it came from.
    """
    spec = _SETTINGS[name]
    value = config.getoption(name, None) if spec.kind != "paths" else None
    source = f"argument {spec.flag}"
    if value is None:
        value = config.getini(name)
        source = f"ini key {name}"
        if spec.kind == "csv" and isinstance(value, list):
            value = ",".join(str(part) for part in value)
        if value in (None, "", []):
            value = spec.default
    if spec.kind == "bool":
        return bool(value)
    if spec.kind in ("paths", "list"):
        return tuple(value or ())
    if value is None:
        return None
    if spec.kind == "path":
        path = Path(str(value))
        if path.is_dir():   # found at the first item's write, as an internal error
            raise pytest.UsageError(f"{source}: {str(value)!r} is a directory; give a file "
                                    f"name, e.g. {display_posix(path / 'gpucase.json')}")
        return path
    if spec.kind == "gib":
        return _gib(str(value), source)
    if spec.kind == "choice":
        if value not in spec.choices:
            raise pytest.UsageError(f"{source}: {value!r} is not one of {', '.join(spec.choices)}")
        return value
    from pytest_gpucase.base.backends import DEVICE_TYPES
    from pytest_gpucase.case.model import FLOAT_DTYPES

    known = DEVICE_TYPES if name == "gpu_devices" else FLOAT_DTYPES
    return _csv(str(value), known, source)


def _gib(value: str, source: str) -> int:
    """``"8"`` or ``"0.5"`` GiB as bytes; anything else is a usage error."""
    import math

    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise pytest.UsageError(f"{source}: {value!r} is not a positive number of GiB")
    return int(gib * 2**30)


def _csv(value: str, known: tuple[str, ...], source: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    for name in names:
        if name not in known:
            # A typo would otherwise narrow every case to nothing, without a word.
            raise pytest.UsageError(f"{source}: unknown {name!r}; expected one of "
                                    f"{', '.join(known)}")
    return names

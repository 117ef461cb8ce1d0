"""The one table of backends and device types: every backend fact lives here, once.

A *device type* is what a tensor's ``device.type`` says (``cuda``, ``cpu``,
``mps``, ``xpu``); a *backend* is what the torch build was made for
(``torch.version.cuda``, ``torch.version.hip``, ...). They differ on ROCm:
a ROCm build drives its GPUs through the ``cuda`` device type.

Every other module reads these tables: the environment probe (which backend a
build is), triage (which variable makes launches blocking, and the backend's
name in words), pinning (the visible-devices variable), the requirements and
the planner (the build in words), case validation (``BACKENDS``,
``DEVICE_TYPES``), the plugin's markers, capture (the backend of a captured
tensor), execute and capture (how to synchronize), ablation (whether the
TF32/cuDNN switches apply) and compare (whether float64 exists on the device).

Adding a backend is one row in ``BACKEND_TABLE`` (and one in
``DEVICE_TYPE_TABLE`` if it brings a new device type), plus its tests.
Nothing here imports torch: collection reads these tables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = [
    "AUTOCAST_DEVICE_TYPES",
    "BACKENDS",
    "BACKEND_TABLE",
    "BY_NAME",
    "DEVICE_TYPES",
    "Backend",
    "asserts_note",
    "backend",
    "backend_of_text",
    "build_words",
    "detect",
    "dnn_name",
    "float64_on",
    "launch_blocking_env",
    "launch_blocking_words",
    "run_backend",
    "synchronize",
    "title",
    "visible_variable",
]


@dataclass(frozen=True)
class DeviceType:
    """One ``torch.device`` type, as runs and comparisons see it."""

    name: str                        # "cuda", "cpu", "mps", "xpu"
    synchronize: str | None = None   # the torch module whose synchronize() waits: "cuda"
    synchronize_takes_device: bool = False  # synchronize(device) rather than synchronize()
    float64: bool = True             # whether the device computes in float64 (MPS does not)


@dataclass(frozen=True)
class Backend:
    """One backend a torch build can be made for, and what differs on it."""

    name: str                        # "cuda", "rocm", "cpu", "mps", "xpu"
    title: str                       # in words, as triage and headers say it: "CUDA", "ROCm"
    build: str                       # the build in words: "a CUDA build"
    device_type: str                 # the device type its accelerators use ("cuda" on ROCm)
    version: str | None = None       # the torch.version attribute that marks the build: "hip"
    built: str | None = None         # else the torch.backends module whose is_built() does
    launch_blocking: Mapping[str, str] = field(default_factory=dict)  # makes launches synchronous
    # Set (if unset) where a run asks for deterministic algorithms: cuBLAS needs a fixed
    # workspace for deterministic results (CUDA >= 10.2).
    deterministic_env: Mapping[str, str] = field(default_factory=dict)
    visible_devices: tuple[str, ...] = ()  # variables that select devices; the first is set
    cuda_switches: bool = False      # torch.backends.cuda/cudnn switches (TF32, cuDNN) apply
    dnn_library: str | None = None   # "cuDNN", "MIOpen": what torch.backends.cudnn.version() names
    # Texts that mark an error or a log as this backend's (regexes; triage reads the backend
    # off a failure with them, in _DETECTION_ORDER): never seen in another backend's text.
    text_markers: tuple[str, ...] = ()
    # Said of a failure that a kernel assert would catch (triage rules with kernel_asserts):
    # where this backend's release builds have the asserts off.
    asserts_note: str | None = None


# Detection order matters: a ROCm build also sets torch.version.cuda to None but reuses the
# "cuda" device type, so hip is asked first; the CPU row, with no marker, is the fallback.
BACKEND_TABLE: tuple[Backend, ...] = (
    Backend("cuda", "CUDA", "a CUDA build", "cuda", version="cuda",
            launch_blocking={"CUDA_LAUNCH_BLOCKING": "1"},
            deterministic_env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
            visible_devices=("CUDA_VISIBLE_DEVICES",), cuda_switches=True, dnn_library="cuDNN",
            text_markers=(
                r"\bCUDA (driver )?error\b", r"\bCUDA out of memory", r"\bcuda runtime error\b",
                r"\bTHCudaCheck\b", r"\bcudaError\w+", r"TORCH_USE_CUDA_DSA",
                r"CUDA_LAUNCH_BLOCKING", r"\bCUBLAS(LT)?_STATUS|\bCUSOLVER_STATUS",
                r"\bcuDNN error|\bCUDNN_STATUS", r"\.cu:\d+", r"CUDA capability sm_\d+",
                r"\bNVIDIA\b", r"not compiled with CUDA",
            )),
    # A ROCm build's texts keep CUDA spellings in places (PYTORCH_CUDA_ALLOC_CONF, the 'CUDA'
    # dispatch key, cuda:0): its markers are asked first, and never appear in an NVIDIA text.
    Backend("rocm", "ROCm", "a ROCm build", "cuda", version="hip",
            launch_blocking={"AMD_SERIALIZE_KERNEL": "3"},
            visible_devices=("HIP_VISIBLE_DEVICES",),
            cuda_switches=True, dnn_library="MIOpen",
            text_markers=(
                r"\bHIP (error|out of memory)\b", r"\bhipError\w+", r"TORCH_USE_HIP_DSA",
                r"AMD_SERIALIZE_KERNEL", r"HIP_LAUNCH_BLOCKING", r"Memory access fault by GPU node",
                r"PYTORCH_HIP_ALLOC_CONF", r"\bMIOpen\b|\bmiopenStatus",
                r"\bHIPBLAS|\brocblas_status", r"\.hip:\d+", r"Device-side assertion `",
                r"rocm\.docs\.amd\.com",
            ),
            asserts_note=(
                "ROCm release wheels are built with kernel asserts off, so on another ROCm "
                "install the same out-of-range index may not raise at all (or may surface as a "
                "memory access fault or wrong values): validate indices and targets in data "
                "preparation.")),
    Backend("cpu", "CPU", "a CPU-only build", "cpu"),
    Backend("mps", "MPS", "an MPS (Apple) build", "mps", built="mps"),
    Backend("xpu", "XPU", "an XPU build", "xpu", version="xpu"),
)
_DETECTION_ORDER = ("rocm", "cuda", "xpu", "mps")

DEVICE_TYPE_TABLE: tuple[DeviceType, ...] = (
    DeviceType("cuda", synchronize="cuda", synchronize_takes_device=True),
    DeviceType("cpu"),
    DeviceType("mps", synchronize="mps", float64=False),
    DeviceType("xpu", synchronize="xpu", synchronize_takes_device=True),
)

# The device types torch's autocast keeps a state for (its switch and dtype), in the order a
# region is looked for when several are on: an accelerator's before the CPU's.
AUTOCAST_DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu", "xpu", "mps", "hpu")

BY_NAME: Mapping[str, Backend] = {backend.name: backend for backend in BACKEND_TABLE}
DEVICE_TYPES_BY_NAME: Mapping[str, DeviceType] = {kind.name: kind for kind in DEVICE_TYPE_TABLE}
BACKENDS: tuple[str, ...] = tuple(BY_NAME)
DEVICE_TYPES: tuple[str, ...] = tuple(DEVICE_TYPES_BY_NAME)


def backend(name: str) -> Backend | None:
    """The row of ``name``, or None for a backend this version does not know."""
    return BY_NAME.get(name)


def title(name: str | None) -> str | None:
    """A backend in words (``ROCm``); an unknown name as given; None stays None."""
    if name is None:
        return None
    row = BY_NAME.get(name)
    return row.title if row is not None else name


def build_words(name: str) -> str:
    """The build in words, for skip reasons: ``a ROCm build``."""
    row = BY_NAME.get(name)
    return row.build if row is not None else f"a {name} build"


def detect(torch: ModuleType | Any) -> str:
    """The backend the imported ``torch`` was built for (``cpu`` when none)."""
    for name in _DETECTION_ORDER:
        row = BY_NAME[name]
        if row.version is not None and getattr(torch.version, row.version, None):
            return name
        if row.built is not None:
            module = getattr(torch.backends, row.built, None)
            if module is not None and module.is_built():
                return name
    return "cpu"


def run_backend(device_type: str, build: str) -> str:
    """The backend a run on ``device_type`` uses under a ``build`` backend.

    ``cuda`` on a ROCm build is ROCm; a device type the build does not drive
    is the first backend whose device type it is.
    """
    if device_type == "cpu":
        return "cpu"
    row = BY_NAME.get(build)
    if row is not None and row.device_type == device_type:
        return build
    return next((b.name for b in BACKEND_TABLE if b.device_type == device_type), device_type)


def launch_blocking_env(name: str) -> dict[str, str]:
    """The variables that make kernel launches synchronous on this backend (none elsewhere)."""
    row = BY_NAME.get(name)
    return dict(row.launch_blocking) if row is not None else {}


def deterministic_env() -> dict[str, str]:
    """The variables deterministic algorithms need, every backend's (a run sets those unset)."""
    return {key: value for row in BACKEND_TABLE for key, value in row.deterministic_env.items()}


def visible_devices_words() -> str:
    """Every backend's visible-devices variable, as help texts name them."""
    return " / ".join(name for row in BACKEND_TABLE for name in row.visible_devices[:1])


def _assignments(row: Backend) -> str:
    return " ".join(f"{key}={value}" for key, value in row.launch_blocking.items())


def launch_blocking_words(name: str | None) -> str:
    """How to make launches blocking, as triage and help texts tell it; every backend's when
    not known.

    ``CUDA_LAUNCH_BLOCKING=1`` on CUDA; with no backend,
    ``CUDA_LAUNCH_BLOCKING=1 (ROCm: AMD_SERIALIZE_KERNEL=3)``.
    """
    row = BY_NAME.get(name) if name is not None else None
    if row is not None and row.launch_blocking:
        return _assignments(row)
    rows = [b for b in BACKEND_TABLE if b.launch_blocking]
    first, others = rows[0], rows[1:]
    rest = "; ".join(f"{b.title}: {_assignments(b)}" for b in others)
    return _assignments(first) + (f" ({rest})" if rest else "")


def visible_variable(name: str) -> str | None:
    """The variable pinning sets to give a child devices on this backend, or None."""
    row = BY_NAME.get(name)
    return row.visible_devices[0] if row is not None and row.visible_devices else None


def _markers() -> tuple[tuple[str, re.Pattern[str]], ...]:
    rows = [BY_NAME[name] for name in _DETECTION_ORDER]
    return tuple((row.name, re.compile("|".join(row.text_markers)))
                 for row in rows if row.text_markers)


_TEXT_MARKERS = _markers()


def backend_of_text(text: str) -> str | None:
    """The backend an error text or a log was written by (``rocm``, ``cuda``), read off the
    spellings only that backend's builds use; None when the text names none."""
    for name, pattern in _TEXT_MARKERS:
        if pattern.search(text):
            return name
    return None


def asserts_note(name: str | None) -> str | None:
    """What to know of kernel asserts on this backend (off in ROCm release wheels), or None."""
    row = BY_NAME.get(name or "")
    return row.asserts_note if row is not None else None


def dnn_name(name: str) -> str | None:
    """The DNN library of a backend (``cuDNN``, ``MIOpen``), or None where there is none."""
    row = BY_NAME.get(name)
    return row.dnn_library if row is not None else None


def float64_on(device_type: str) -> bool:
    """Whether ``device_type`` computes in float64."""
    row = DEVICE_TYPES_BY_NAME.get(device_type)
    return row.float64 if row is not None else True


def synchronize(torch: ModuleType | Any, device: Any) -> None:
    """Wait for the kernels queued on ``device`` (a ``torch.device`` or ``"cuda:0"``)."""
    text = str(device)
    kind = DEVICE_TYPES_BY_NAME.get(text.split(":")[0])
    if kind is None or kind.synchronize is None:
        return
    wait = getattr(getattr(torch, kind.synchronize, None), "synchronize", None)
    if wait is None:
        return
    if kind.synchronize_takes_device and ":" in text:
        wait(device)
    else:
        wait()

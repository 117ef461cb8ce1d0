"""One snapshot of where the cases run: backend, devices, versions, extensions, git revision.

The snapshot is taken once per session in a child process, so the pytest
process never initializes CUDA (a CUDA context does not survive a fork).
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Device:
    """One visible accelerator."""

    index: int
    name: str
    capability: str | None = None  # "9.0" on CUDA; the gcnArch name on ROCm
    memory_gib: float | None = None


@dataclass(frozen=True)
class Environment:
    """What this run has: the backend of the torch build and what it can see."""

    backend: str                     # "cuda", "rocm", "mps", "xpu" or "cpu"
    device_types: tuple[str, ...]    # usable device types, "cpu" always among them
    devices: tuple[Device, ...] = ()
    torch: str | None = None
    cuda: str | None = None
    hip: str | None = None
    cudnn: str | None = None
    python: str = platform.python_version()
    platform: str = f"{platform.system()}-{platform.machine()}"
    packages: Mapping[str, str | None] = field(default_factory=dict)
    revision: str | None = None

    def header(self) -> str:
        """One line for the pytest header, as a PyTorch engineer reads it."""
        build = f"torch {self.torch or 'not installed'}"
        if self.cuda:
            build += f" · CUDA {self.cuda}"
        if self.hip:
            build += f" · HIP {self.hip}"
        if self.cudnn:
            build += f" · cuDNN {self.cudnn}"
        if self.devices:
            names = sorted({d.name for d in self.devices})
            caps = sorted({d.capability for d in self.devices if d.capability})
            seen = f"{len(self.devices)} × {', '.join(names)}"
            if caps:
                seen += f" ({', '.join(caps)})"
        else:
            seen = "no accelerator: CPU items only (a CPU pass is a hint, not GPU validation)"
        line = f"gpucase: {self.backend} backend · {build} · Python {self.python} · {seen}"
        if self.revision:
            line += f" · rev {self.revision}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_here(packages: Iterable[str] = (), rootdir: str | None = None) -> Environment:
    """Take the snapshot in this process (call it in a child: it may initialize the device)."""
    import torch

    hip = getattr(torch.version, "hip", None)
    backend, devices, types = "cpu", [], ["cpu"]
    if torch.cuda.is_available():
        backend = "rocm" if hip else "cuda"
        types.insert(0, "cuda")
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            capability = getattr(props, "gcnArchName", None) if hip else f"{props.major}.{props.minor}"
            devices.append(Device(index, props.name, capability,
                                  round(props.total_memory / 2**30, 1)))
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        backend = "mps"
        types.insert(0, "mps")
        devices.append(Device(0, "Apple MPS"))
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        backend = "xpu"
        types.insert(0, "xpu")
        for index in range(torch.xpu.device_count()):
            devices.append(Device(index, torch.xpu.get_device_name(index)))
    cudnn = None
    if backend in ("cuda", "rocm") and torch.backends.cudnn.is_available():
        cudnn = str(torch.backends.cudnn.version())
    return Environment(
        backend=backend,
        device_types=tuple(types),
        devices=tuple(devices),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=hip,
        cudnn=cudnn,
        packages={name: package_version(name) for name in sorted(set(packages))},
        revision=git_revision(rootdir),
    )


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_revision(rootdir: str | None) -> str | None:
    """The short commit of the repository holding ``rootdir``, with ``-dirty`` if changed."""
    if rootdir is None:
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(Path(rootdir)), "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def probe(packages: Iterable[str] = (), rootdir: str | None = None) -> Environment:
    """Take the snapshot in a child process, so that this process never touches the device."""
    from .isolation import default_start_method, run_in_child

    result = run_in_child(probe_here, tuple(packages), rootdir, timeout=120,
                          start_method=default_start_method())
    if not result.returned:
        detail = result.child_error or result.stderr[-2000:]
        raise RuntimeError(f"gpucase: probing the environment {result.problem}:\n{detail}")
    env: Environment = result.value
    return env


def launch_blocking_env(backend: str) -> dict[str, str]:
    """The variable that makes kernel launches synchronous on this backend (none elsewhere)."""
    if backend == "cuda":
        return {"CUDA_LAUNCH_BLOCKING": "1"}
    if backend == "rocm":
        return {"AMD_SERIALIZE_KERNEL": "3"}
    return {}


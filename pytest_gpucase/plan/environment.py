"""One snapshot of where the cases run: backend, devices, versions, extensions, git revision.

The snapshot is taken once per session in a child process, so the pytest
process never initializes CUDA (a CUDA context does not survive a fork).

``backend`` is what the torch build was made for (``torch.version.cuda``,
``torch.version.hip``, ...), and ``device_types`` what it can use here: a CUDA
wheel on a runner without a GPU is a ``cuda`` backend whose only device type is
``cpu``, as ``python -m torch.utils.collect_env`` tells "CUDA used to build
PyTorch" apart from "Is CUDA available".
"""

from __future__ import annotations

import functools
import os
import platform as _platform
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpucase.base import backends
from pytest_gpucase.base.results import result_type

__all__ = ["Device", "Environment", "build_label", "call_distributions", "canonical_name",
           "dnn_library", "git_revision", "package_build", "package_version", "probe_here"]


@result_type   # the probe's child sends it back (isolation.wire)
@dataclass(frozen=True)
class Device:
    """One visible accelerator."""

    index: int
    name: str
    capability: str | None = None  # "9.0" on CUDA; the gcnArch name on ROCm
    memory_gib: float | None = None


@result_type
@dataclass(frozen=True)
class Environment:
    """What this run has: the backend of the torch build and what it can see."""

    backend: str                     # "cuda", "rocm", "mps", "xpu" or "cpu"
    device_types: tuple[str, ...]    # usable device types, "cpu" always among them
    devices: tuple[Device, ...] = ()
    torch: str | None = None
    cuda: str | None = None
    hip: str | None = None
    cudnn: str | None = None         # torch.backends.cudnn.version(): "90100"; MIOpen on ROCm
    python: str = _platform.python_version()
    platform: str = f"{_platform.system()}-{_platform.machine()}"
    packages: Mapping[str, str | None] = field(default_factory=dict)
    revision: str | None = None
    # For a package of ``packages`` with compiled files: what tells its build from another
    # build of the same version (``package_build``); absent for a pure-Python one.
    builds: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)

    def header(self) -> str:
        """One line for the pytest header, as a PyTorch engineer reads it.

        ``gpucase: cuda backend · torch 2.4.0+cu124 · CUDA 12.4 · cuDNN 9.1.0 ·
        Python 3.11.7 · 2 × NVIDIA H100 80GB HBM3 (9.0) · rev 3f2c1ab``
        """
        parts = [f"{self.backend} backend", f"torch {self.torch or 'not installed'}"]
        if self.cuda:
            parts.append(f"CUDA {self.cuda}")
        if self.hip:
            parts.append(f"HIP {self.hip}")
        dnn = dnn_library(self.cudnn, self.backend)
        if dnn:
            parts.append(dnn)
        parts.append(f"Python {self.python}")
        if self.devices:
            # One group per kind of device, in index order: "1 × Tesla T4 (7.5) + 1 × ...".
            kinds = Counter((d.name, d.capability) for d in self.devices)
            parts.append(" + ".join(f"{count} × {name}" + (f" ({capability})" if capability else "")
                                    for (name, capability), count in kinds.items()))
        else:
            parts.append("no accelerator: CPU items only "
                         "(a CPU pass is a hint, not GPU validation)")
        if self.revision:
            parts.append(f"rev {self.revision}")
        return "gpucase: " + " · ".join(parts)

    def with_packages(self, names: Iterable[str]) -> Environment:
        """The snapshot with ``names`` looked up too: each one's version and, for one with
        compiled files, its build (``package_build``); names already known are not read
        again."""
        from dataclasses import replace

        missing = [name for name in dict.fromkeys(names) if name not in self.packages]
        if not missing:
            return self
        versions = {name: package_version(name) for name in missing}
        builds = {name: found for name in missing
                  if versions[name] is not None and (found := package_build(name)) is not None}
        return replace(self, packages={**self.packages, **versions},
                       builds={**self.builds, **builds})

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as plain JSON data (the ``environment`` of a JSON report)."""
        return asdict(self)


def dnn_library(cudnn: str | None, backend: str) -> str | None:
    """The cuDNN version as people write it (``cuDNN 9.1.0`` for ``90100``); MIOpen on ROCm."""
    if not cudnn:
        return None
    name = backends.dnn_name(backend) or "cuDNN"
    # ASCII digits only, and few of them: "²".isdigit() is true and int() refuses it, and a
    # report is read from anywhere (int() refuses 5,000 digits too).
    if not (cudnn.isascii() and cudnn.isdigit() and len(cudnn) <= 12):
        return f"{name} {cudnn}"  # already written out
    number = int(cudnn)
    if backend == "rocm":       # MAJOR*1000000 + MINOR*1000 + PATCH
        major, rest = divmod(number, 1_000_000)
        minor, patch = divmod(rest, 1_000)
    elif number >= 90_000:      # from cuDNN 9: MAJOR*10000 + MINOR*100 + PATCH
        major, rest = divmod(number, 10_000)
        minor, patch = divmod(rest, 100)
    else:                       # up to cuDNN 8: MAJOR*1000 + MINOR*100 + PATCH
        major, rest = divmod(number, 1_000)
        minor, patch = divmod(rest, 100)
    return f"{name} {major}.{minor}.{patch}"


def probe_here(packages: Iterable[str] = (), rootdir: str | None = None) -> Environment:
    """Take the snapshot in this process (call it in a child: it may initialize the device)."""
    import torch

    hip: str | None = getattr(torch.version, "hip", None)
    mps = getattr(torch.backends, "mps", None)
    types: list[str] = []
    devices: list[Device] = []
    if torch.cuda.is_available():
        types.append("cuda")
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            capability = (getattr(props, "gcnArchName", None) if hip
                          else f"{props.major}.{props.minor}")
            devices.append(Device(index, props.name, capability,
                                  round(props.total_memory / 2**30, 1)))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        types.append("xpu")
        devices += [Device(index, torch.xpu.get_device_name(index))
                    for index in range(torch.xpu.device_count())]
    if mps is not None and mps.is_available():
        types.append("mps")
        devices.append(Device(0, "Apple MPS"))
    backend = backends.detect(torch)
    if backend == "cpu" and types:
        backend = types[0]
    return Environment(
        backend=backend,
        device_types=(*types, "cpu"),
        devices=tuple(devices),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=hip,
        cudnn=_cudnn_version() if backends.dnn_name(backend) else None,
        python=_platform.python_version(),
        revision=git_revision(rootdir),
    ).with_packages(sorted(set(packages)))


def _cudnn_version() -> str | None:
    import torch

    version: Callable[[], int | None] = torch.backends.cudnn.version
    try:
        found = version()
    except RuntimeError:
        return None  # a cuDNN the build cannot load: the runs say so, the probe must not die
    return None if found is None else str(found)


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed.

    Names compare as pip compares them: ``flash-attn``, ``flash_attn`` and ``Flash-Attn`` agree.
    """
    from importlib import metadata

    if not name.strip():
        return None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# A compiled file of a distribution: an extension module or a shared library it ships.
_COMPILED = re.compile(r"\.(?:so|pyd|dylib|dll)(?:\.[0-9]{1,6}){0,4}\Z", re.IGNORECASE)
_ENDS = 1 << 20       # bytes hashed from each end of a compiled file that RECORD has no hash for
_MAX_WALK = 20_000    # files looked at under an editable install's package folder
# The torch a build names in its version or wheel file name: "+pt21cu121" (PyG), "+pt2.4",
# "torch2.4" (flash-attn's wheels).
# "pt" or "torch" starts a word ("opt2" is none), and a minor version is there: "pt2" alone
# could be any 2.x.
_TORCH_LABEL = re.compile(r"(?<![a-z])(?:pt|torch)(?P<major>[0-9])\.?(?P<minor>[0-9]{1,2})"
                          r"(?![0-9])", re.IGNORECASE)


def package_build(name: str) -> dict[str, str | None] | None:
    """What tells this build of an installed distribution from another build of the same
    version, or None for one without compiled files (or not installed).

    * ``fingerprint``: 12 hex digits of a SHA-256 over its compiled files (extension
      modules, shared libraries) with their paths: their RECORD hashes as the installer
      wrote them, else (an editable install, a RECORD without hashes) each file's size and
      its first and last MiB, which hold the ELF or Mach-O headers and the GNU build id.
      Two builds of one version (for two torch releases, two CUDA versions) differ here.
    * ``tag``: the wheel tags it was installed from (``cp311-cp311-linux_x86_64``), if any.
    * ``torch``: the torch it was built for where the distribution says so: a local version
      label (``2.1.2+pt21cu121``, ``+torch2.4``), an exact ``Requires-Dist: torch==X``, or
      the name of the wheel file it came from (``...+cu123torch2.4cxx11abiFALSE...whl``);
      None where it does not say (a build from source records nothing of the kind).

    Read once per name and ``sys.path``; a few milliseconds from RECORD.
    """
    if not name.strip():
        return None
    return _build_of(canonical_name(name), tuple(sys.path))


def build_label(build: Mapping[str, str | None]) -> str:
    """``build 3f2a9c1d4e5b, for torch 2.13``: a build in the words a matrix label uses."""
    said = f"build {str(build.get('fingerprint') or '?')[:12]}"
    if build.get("torch"):
        said += f", for torch {build['torch']}"
    return said


@functools.lru_cache(maxsize=256)
def _build_of(name: str, path: tuple[str, ...]) -> dict[str, str | None] | None:
    import hashlib
    from importlib import metadata

    try:
        dist = metadata.distribution(name)
        files = list(dist.files or ())
    except Exception:
        return None   # not installed, or metadata the installer left unreadable
    digest = hashlib.sha256()
    count = 0
    for file in sorted((f for f in files if _COMPILED.search(f.name)), key=str):
        if file.hash is not None:
            entry = f"{file.hash.mode}={file.hash.value}"
        else:
            entry = _ends_hash(Path(str(file.locate())))
        digest.update(f"{file.as_posix()}\0{entry}\n".encode())
        count += 1
    if not count:   # an editable install: its compiled files are in the source tree
        for found in _package_files(dist):
            digest.update(f"{found.name}\0{_ends_hash(found)}\n".encode())
            count += 1
    if not count:
        return None
    return {"fingerprint": digest.hexdigest()[:12], "tag": _wheel_tag(dist),
            "torch": _built_for(dist)}


def _ends_hash(path: Path) -> str:
    """A file's size and a SHA-256 of its first and last MiB ("missing" when unreadable)."""
    import hashlib

    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest = hashlib.sha256(handle.read(_ENDS))
            if size > 2 * _ENDS:
                handle.seek(size - _ENDS)
                digest.update(handle.read(_ENDS))
            elif size > _ENDS:
                digest.update(handle.read())
    except OSError:
        return "missing"
    return f"{size}:{digest.hexdigest()}"


def _package_files(dist: Any) -> list[Path]:
    """The compiled files under the folders of a distribution's top-level modules, found
    without importing them (``find_spec`` of a top-level name runs no code of it)."""
    import importlib.util

    tops = (dist.read_text("top_level.txt") or "").split()
    if not tops:
        name = canonical_name(dist.metadata["Name"] or "")
        tops = [top for top, names in _distributions_by_module(tuple(sys.path)).items()
                if any(canonical_name(n) == name for n in names)]
    found: list[Path] = []
    seen = 0
    for top in sorted(set(tops)):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        for folder in spec.submodule_search_locations or ():
            for root, dirs, names in os.walk(folder):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for leaf in sorted(names):
                    seen += 1
                    if _COMPILED.search(leaf):
                        found.append(Path(root, leaf))
                if seen > _MAX_WALK:
                    return found
        if spec.origin and _COMPILED.search(spec.origin):
            found.append(Path(spec.origin))
    return found


def _wheel_tag(dist: Any) -> str | None:
    text = dist.read_text("WHEEL") or ""
    tags = [line.partition(":")[2].strip() for line in text.splitlines()
            if line.startswith("Tag:")]
    return ".".join(tags) or None


def _built_for(dist: Any) -> str | None:
    """The torch a distribution says it was built for (``package_build``), or None."""
    import json

    version = str(dist.version or "")
    if "+" in version and (found := _torch_label(version.partition("+")[2])):
        return found
    for requirement in dist.requires or ():
        found_pin = re.fullmatch(r"\s*torch\s*===?\s*([0-9][0-9A-Za-z.+]*)\s*(;.*)?",
                                 requirement)
        if found_pin:
            return found_pin.group(1)
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except (ValueError, AttributeError):
        return None
    leaf = str(url).rsplit("/", 1)[-1]
    if leaf.endswith(".whl") and "+" in leaf:
        return _torch_label(leaf.partition("+")[2].split("-")[0])
    return None


def _torch_label(label: str) -> str | None:
    found = _TORCH_LABEL.search(label)
    return None if found is None else f"{found['major']}.{found['minor']}"


def canonical_name(name: str) -> str:
    """A distribution name as pip compares it (PEP 503): ``Flash_Attn`` -> ``flash-attn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


# Distributions whose version every report records elsewhere (``torch``; the writer's own
# version is the report's ``gpucase`` key): a call into them adds no package.
_RECORDED_ELSEWHERE = frozenset({"torch", "pytest-gpucase"})


def call_distributions(call: str, case_dir: Path | str | None = None) -> tuple[str, ...]:
    """The installed distributions that provide the module a case's ``call`` imports.

    ``tinyext:pool`` and ``mypkg.losses:step`` name an installed package whose version
    decides the verdict as much as torch's does, listed in ``[matrix.packages]`` or not.
    A ``FILE.py:func`` of the case directory gives the distributions its own imports name
    (``import rowext`` in ``case.py``, at the top or inside a function), read from its
    source when ``case_dir`` is given, never run. The standard library, a module of the
    project that no distribution installed, and torch itself (recorded already) give
    none. Nothing is imported: the top-level name is looked up in the metadata of what
    is installed (``importlib.metadata.packages_distributions``), read once per
    ``sys.path``.
    """
    target = call.partition(":")[0]
    if not target:
        return ()
    if target.endswith(".py"):
        if case_dir is None:
            return ()
        tops: tuple[str, ...] = _file_imports(Path(case_dir) / target)
    else:
        tops = (target.split(".")[0],)
    tops = tuple(top for top in tops if top not in sys.stdlib_module_names)
    if not tops:  # nothing to look up: the installed metadata is not read (0.1 s)
        return ()
    by_module = _distributions_by_module(tuple(sys.path))
    found = {name for top in tops for name in by_module.get(top, ())}
    return tuple(sorted(name for name in found
                        if canonical_name(name) not in _RECORDED_ELSEWHERE))


_MAX_SOURCE = 1 << 20   # bytes of a case's .py file read for its imports


def _file_imports(path: Path) -> tuple[str, ...]:
    """The top-level modules a Python file imports (absolute imports), read, never run."""
    try:
        found = path.stat()
    except OSError:
        return ()
    return _imports_of(str(path), found.st_mtime_ns, found.st_size)


@functools.lru_cache(maxsize=256)
def _imports_of(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    import ast

    if size > _MAX_SOURCE:
        return ()
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return ()   # the run says what is wrong with the file
    tops: dict[str, None] = {}
    # Imports are statements: only lists of statements are walked (a body, an else, an
    # except's, a match case's), never an expression (a third of the nodes of ast.walk).
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            tops.update((alias.name.split(".")[0], None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops[node.module.split(".")[0]] = None
        for name in _STATEMENT_LISTS:  # the last first: the stack gives the file's order
            inner = getattr(node, name, None)
            if type(inner) is list:
                pending.extend(reversed(inner))
    return tuple(tops)


# The fields of a node that hold statements (or nodes that do: except handlers, match cases),
# last in the file first.
_STATEMENT_LISTS = ("cases", "finalbody", "orelse", "handlers", "body")


@functools.lru_cache(maxsize=4)
def _distributions_by_module(path: tuple[str, ...]) -> Mapping[str, list[str]]:
    """Top-level module -> distributions providing it, for one ``sys.path`` (the cache key:
    reading every installed distribution's metadata takes tens of milliseconds)."""
    from importlib import metadata

    try:
        return metadata.packages_distributions()
    except Exception:
        # One installed distribution's unreadable metadata (a latin-1 METADATA, a RECORD row
        # of four fields) must not end the run: no call package is recorded instead.
        return {}


def git_revision(rootdir: str | None) -> str | None:
    """The short commit of the repository holding ``rootdir``, with ``-dirty`` if changed.

    A change is one to a tracked file, staged or not (as ``git describe --dirty``);
    None outside a repository, in one without commits, or without git.
    """
    if rootdir is None:
        return None
    commit = _git(rootdir, "rev-parse", "--short=7", "HEAD")
    if not commit:
        return None
    changes = _git(rootdir, "--no-optional-locks", "status", "--porcelain",
                   "--untracked-files=no")
    return f"{commit}-dirty" if changes else commit


def _git(rootdir: str, *args: str) -> str | None:
    """Git's output for ``args`` run on ``rootdir``, or None when it fails."""
    try:
        done = subprocess.run(["git", "-C", str(Path(rootdir)), *args], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None

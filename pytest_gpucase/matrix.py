"""Requirements against the environment, and the expansion of a case into runs.

``evaluate`` says whether a case may run here (``None``) or why it is skipped;
``expand`` lists a case's runs over devices, dtypes and edge variants. Both are
pure functions on plain data: no torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .case import FLOAT_DTYPES, Case, Requirements
from .environment import Environment, launch_blocking_env
from .payload import DTYPES, TensorInfo
from .variants import Variant, expand as expand_variants

DEFAULT_DEVICES = ("cpu", "cuda")
_BACKEND_WORDS = {"cuda": "a CUDA build", "rocm": "a ROCm build", "cpu": "a CPU-only build",
                  "mps": "an MPS (Apple) build", "xpu": "an XPU build"}


@dataclass(frozen=True)
class RunSpec:
    """One run of a case: where, in which dtype, on which variant, with which child environment."""

    case: Case
    device: str
    dtype: str
    cast: bool                       # floating inputs are cast to ``dtype`` before the call
    variant: Variant | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    launch_blocking: bool = False
    skip: str | None = None
    settings: tuple[str, ...] = ()   # torch switches applied in the child (execute.SETTINGS)
    use_reference: bool = False      # call the case's reference in place of ``call``

    @property
    def id(self) -> str:
        """The parametrization token: ``cpu-float32``, ``cuda-bfloat16-batch=1``."""
        parts = [self.device, self.dtype]
        if self.variant is not None:
            parts.append(self.variant.label)
        return "-".join(parts)


def _satisfies(found: str, specifier: str) -> bool:
    try:
        return SpecifierSet(specifier).contains(Version(found), prereleases=True)
    except InvalidVersion:
        return False


def saved_float_dtype(inputs: Sequence[TensorInfo]) -> str | None:
    """The dtype token of saved inputs: the floating dtype of the largest floating tensor."""
    floats = [info for info in inputs if DTYPES[info.dtype][0] in FLOAT_DTYPES]
    if not floats:
        return None
    largest = max(floats, key=lambda info: _numel(info.shape))
    return DTYPES[largest.dtype][0]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def evaluate(req: Requirements, env: Environment) -> str | None:
    """``None`` when the case may run here, else the reason it is skipped, naming both sides."""
    if req.backends is not None and env.backend not in req.backends:
        return (f"requires backend {' or '.join(req.backends)}; "
                f"this is {_BACKEND_WORDS.get(env.backend, env.backend)}")
    for key, specifier in req.versions.items():
        reason = _version_reason(key, specifier, env)
        if reason is not None:
            return reason
    for name, specifier in req.packages.items():
        version = env.packages.get(name)
        wanted = f"{name}{specifier}"
        if version is None:
            return f"requires {wanted}; not installed"
        if specifier and not _satisfies(version, specifier):
            return f"requires {wanted}; found {version}"
    return None


def _version_reason(key: str, specifier: str, env: Environment) -> str | None:
    wanted = f"requires {key}{specifier}"
    if key == "capability":
        if not env.devices:
            return f"{wanted}; no accelerator here"
        for device in env.devices:
            if device.capability is None or not _satisfies(device.capability, specifier):
                shown = device.capability or "unknown"
                return f"{wanted}; found {shown} ({device.name})"
        return None
    found = {"torch": env.torch, "python": env.python, "cuda": env.cuda, "hip": env.hip}[key]
    if found is None:
        what = {"torch": "torch is not installed", "cuda": "this torch build has no CUDA",
                "hip": "this torch build has no HIP"}.get(key, "unknown")
        return f"{wanted}; {what} ({env.backend})"
    if not _satisfies(found, specifier):
        return f"{wanted}; found {found}"
    return None


def device_skip(device: str, env: Environment) -> str | None:
    """Why a device type cannot run here, or None."""
    if device in env.device_types:
        return None
    if device == "cuda":
        return (f"no CUDA device here ({env.backend} backend): the CPU pass of this case is a hint, "
                "not CUDA validation; run it on a GPU runner")
    return f"no {device} device here ({env.backend} backend)"


def expand(
    case: Case,
    env: Environment,
    *,
    saved_dtype: str | None,
    devices: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    launch_blocking: bool = False,
) -> list[RunSpec]:
    """Every run of ``case``: devices x dtypes x (original + variants), skipped ones included.

    ``devices`` and ``dtypes`` (from ``--gpu-devices``/``--gpu-dtypes``) narrow the case's
    own lists; ``saved_dtype`` is the floating dtype of the saved inputs, if any.
    """
    case_devices = case.matrix.devices or DEFAULT_DEVICES + tuple(
        t for t in env.device_types if t not in DEFAULT_DEVICES)
    if devices is not None:
        case_devices = tuple(d for d in case_devices if d in devices)
    cast = case.matrix.dtypes is not None
    case_dtypes = case.matrix.dtypes or (saved_dtype or "float32",)
    if dtypes is not None:
        case_dtypes = tuple(d for d in case_dtypes if d in dtypes)
    requirement = evaluate(case.matrix, env)
    blocking = launch_blocking or case.launch_blocking
    specs = []
    for device in case_devices:
        skip = requirement or device_skip(device, env)
        child_env = launch_blocking_env(env.backend) if blocking and device != "cpu" else {}
        for dtype in case_dtypes:
            for variant in [None, *expand_variants(case.variants)]:
                specs.append(RunSpec(case, device, dtype, cast, variant, child_env,
                                     bool(child_env), skip))
    return specs

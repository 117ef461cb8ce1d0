"""The one run planner: which runs a case has here, each a ``RunSpec``.

Everything that turns a case and an environment into runs lives here, once:

* ``evaluate``: whether a case's ``[matrix]`` requirements hold here (``None``)
  or why it is skipped, naming both sides; ``run_skip`` adds a missing device type;
* ``device_list``: the device types a case (or the ``gpu_device`` fixture) runs
  on: its own list, else ``DEFAULT_DEVICES`` and what this machine adds,
  narrowed by ``--gpu-devices``;
* ``expand``: a case's runs over devices, dtypes and edge variants (the items);
* ``single_run``: one run as ``GpuCaseHandle.run`` asks for it;
* ``choose_device`` and ``unchanged_runs``: the baseline that ``minimize`` and
  ``ablate`` start from.

Pure functions on plain data: no torch, no pytest. ``matrix.py`` re-exports the
old names (``from .matrix import expand, RunSpec, saved_dtype``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from pytest_gpucase.base.backends import DEVICE_TYPES, build_words, launch_blocking_env
from pytest_gpucase.base.errors import display
from pytest_gpucase.case.model import CASE_FILE, FLOAT_DTYPES, Case, Requirements
from pytest_gpucase.case.payload import DTYPES, TensorInfo
from pytest_gpucase.case.variants import Variant
from pytest_gpucase.case.variants import expand as expand_variants
from pytest_gpucase.plan.environment import Environment

__all__ = ["DEFAULT_DEVICES", "ItemId", "NotRunnable", "RunSpec", "choose_device", "device_list",
           "device_skip", "evaluate", "expand", "label_dtype", "one_dtype_without_floats",
           "run_skip",
           "saved_dtype", "saved_float_dtype", "single_run", "unchanged_runs"]

DEFAULT_DEVICES = ("cpu", "cuda")
_RELEASE = re.compile(r"^\d+(?:\.\d+)*")
_CAPABILITY = re.compile(r"^\d+\.\d+$")


class NotRunnable(Exception):
    """The case cannot run here as asked (requirements, device, dtype, no tensors to shrink)."""


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
        """The parametrization token: ``cpu-float32``, ``cuda-bfloat16-batch[1]``
        (``ItemId.parse`` reads it back from a node id)."""
        parts = [self.device, self.dtype]
        if self.variant is not None:
            parts.append(self.variant.id)
        return "-".join(parts)

    @property
    def compute_dtype(self) -> str:
        """The dtype the call computes in: the autocast dtype under ``[context] autocast``,
        else the run's own."""
        return self.case.context.compute_dtype or self.dtype

    @property
    def numeric(self) -> str:
        """The run's real numeric context in words, beginning with the dtype its item is
        named by (``id``): ``float32``; ``bfloat16 autocast`` for the saved inputs under
        bfloat16 autocast (item ``[cpu-bfloat16]``); ``float64 under bfloat16 autocast`` for
        inputs cast to float64 under it. What ablate and minimize say they ran."""
        compute = self.case.context.compute_dtype
        if compute is None:
            return self.dtype
        if not self.cast and self.dtype == compute:
            return f"{compute} autocast"
        return f"{self.dtype} under {compute} autocast"

    def with_autocast(self, dtype: str | None) -> RunSpec:
        """This run with its case's autocast off (None) or in ``dtype`` instead: a change of
        the case's ``[context]``, so the child, the judge and the reference cache all see it.
        A run named by its autocast dtype (``label_dtype``) is named by the new one."""
        context = self.case.context
        autocast = (None if dtype is None or context.autocast is None
                    else replace(context.autocast, dtype=dtype, enabled=True))
        case = replace(self.case, context=replace(context, autocast=autocast))
        named = self.dtype
        if not self.cast and self.dtype == context.compute_dtype:
            named = label_dtype(case) or "float32"
        return replace(self, case=case, dtype=named)

    def item_name(self) -> str:
        """The name of this run's pytest item: ``ce_class4[cuda-float32-batch[1]]``."""
        return f"{self.case.name}[{self.id}]"


# The parameters that end a case item's id (``RunSpec.id``): device, dtype and an optional
# variant. Found at the end (a case folder's name may hold brackets, dashes, anything),
# bounded: linear.
_PARAMS = re.compile(r"\[(?P<device>[a-z]{1,16})-(?P<dtype>[a-z0-9_]{1,32})"
                     r"(?:-(?P<kind>[a-z]{1,16})\[(?P<value>-?[0-9]{1,20})\])?\]\Z")


@dataclass(frozen=True)
class ItemId:
    """A case item's node id read back (``cases/ce/case.toml::ce[cuda-float32-batch[1]]``),
    where the item is not at hand: an xdist worker that crashed, a cancelled run."""

    case: str
    case_path: str
    device: str | None = None     # None: the id holds no run parameters (a broken case)
    dtype: str | None = None
    variant: str | None = None    # ``Variant.label``: ``batch=1``

    @staticmethod
    def is_case_item(nodeid: str) -> bool:
        """Whether ``nodeid`` is the id of a case item (an item of a ``case.toml``)."""
        return f"/{CASE_FILE}::" in nodeid or nodeid.startswith(f"{CASE_FILE}::")

    @classmethod
    def parse(cls, nodeid: str) -> ItemId | None:
        """The case item ``nodeid`` names, or None for another item.

        Read from the right, so that a case folder may be named anything a file system
        allows (``cases/ce[1]``): the case's name follows the last ``/case.toml::`` (a name
        holds no ``/``), and the run's parameters (``RunSpec.id``) end the id.
        """
        head, separator, tail = nodeid.rpartition(f"/{CASE_FILE}::")
        if not separator:
            if not nodeid.startswith(f"{CASE_FILE}::"):
                return None
            head, tail = ".", nodeid[len(CASE_FILE) + 2:]
        found = _PARAMS.search(tail)
        if found is None or found["device"] not in DEVICE_TYPES:
            return cls(tail, head)
        variant = f"{found['kind']}={found['value']}" if found["kind"] else None
        return cls(tail[:found.start()], head, found["device"], found["dtype"], variant)


def _version(found: str) -> Version | None:
    """``found`` as a version; a suffix PEP 440 lacks (HIP's ``6.0.32830-d62f6a171``) is dropped."""
    try:
        return Version(found)
    except InvalidVersion:
        release = _RELEASE.match(found)
        return Version(release[0]) if release else None


def _satisfies(found: Version, specifier: str) -> bool:
    # Nightly and source builds report pre-releases (2.4.0a0+git3f2c1ab, 2.4.0.dev20240401):
    # they carry the features of the release they lead to, so ">=2.3" accepts them.
    return SpecifierSet(specifier).contains(found, prereleases=True)


def saved_float_dtype(inputs: Sequence[TensorInfo]) -> str | None:
    """The dtype token of saved inputs: the floating dtype of the largest floating tensor."""
    floats = [info for info in inputs if DTYPES[info.dtype][0] in FLOAT_DTYPES]
    if not floats:
        return None
    largest = max(floats, key=lambda info: _numel(info.shape))
    return DTYPES[largest.dtype][0]


def label_dtype(case: Case) -> str | None:
    """The dtype that names the runs of ``case`` where ``[matrix] dtypes`` does not (its
    items' ``[cpu-bfloat16]``, and what ablate and minimize say they ran): under
    ``[context] autocast`` the autocast dtype, which the call computes in; else the saved
    inputs' floating dtype; None without either. The inputs are not cast to it."""
    return case.context.compute_dtype or saved_dtype(case)


def saved_dtype(case: Case) -> str | None:
    """The floating dtype of a case's saved inputs, read from the payload's header only."""
    from pytest_gpucase.case.payload import describe

    if not case.inputs_file.exists():
        return None
    return saved_float_dtype(describe(case.inputs_file))


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def evaluate(req: Requirements, env: Environment, device: str | None = None) -> str | None:
    """``None`` when the case may run here, else the reason it is skipped, naming both sides.

    ``device`` is the device type of the run, when known: a compute capability is asked of
    the accelerators, so it does not hold a CPU run back (a case needing sm_80 kernels
    still has its CPU check on a T4 or CPU-only runner).
    """
    if req.backends is not None and env.backend not in req.backends:
        return (f"requires backend {' or '.join(req.backends)}; "
                f"this is {build_words(env.backend)}")
    for key, specifier in req.versions.items():
        if key == "capability" and device == "cpu":
            continue
        reason = _version_reason(key, specifier, env)
        if reason is not None:
            return reason
    for name, specifier in req.packages.items():
        found = env.packages.get(name)
        wanted = f"requires {name}{specifier}"
        if found is None:
            return f"{wanted}; not installed"
        if not specifier:
            continue  # "" asks only that the package be installed
        reason = _found_reason(wanted, found, specifier)
        if reason is not None:
            return reason
    return None


def _found_reason(wanted: str, found: str, specifier: str) -> str | None:
    """Why the ``found`` version does not meet ``specifier``, or None when it does."""
    version = _version(found)
    if version is None:
        return f"{wanted}; found {found}, which is not a PEP 440 version"
    if not _satisfies(version, specifier):
        return f"{wanted}; found {found}"
    return None


def _version_reason(key: str, specifier: str, env: Environment) -> str | None:
    wanted = f"requires {key}{specifier}"
    if key == "capability":
        return _capability_reason(wanted, specifier, env)
    found = {"torch": env.torch, "python": env.python, "cuda": env.cuda, "hip": env.hip}.get(key)
    if found is None:
        missing = {"torch": "torch is not installed",
                   "cuda": f"this is {build_words(env.backend)} "
                           "(torch.version.cuda is None)",
                   "hip": f"this is {build_words(env.backend)} "
                          "(torch.version.hip is None)"}
        return f"{wanted}; {missing.get(key, 'not known here')}"
    return _found_reason(wanted, found, specifier)


def _capability_reason(wanted: str, specifier: str, env: Environment) -> str | None:
    """Every visible device must meet a compute capability requirement (a run may use any)."""
    if not env.devices:
        return f"{wanted}; no accelerator here"
    for device in env.devices:
        if device.capability is None:
            return f"{wanted}; {device.name} reports no compute capability"
        version = _version(device.capability) if _CAPABILITY.match(device.capability) else None
        if version is None:
            # ROCm reports a GPU architecture (gfx90a:sramecc+:xnack-), not a number.
            return (f"{wanted}; {device.name} reports {device.capability}, a ROCm architecture "
                    "name, not a CUDA compute capability")
        if not _satisfies(version, specifier):
            return f"{wanted}; found {device.capability} ({device.name})"
    return None


def device_skip(device: str, env: Environment) -> str | None:
    """Why a device type cannot run here, or None."""
    if device in env.device_types:
        return None
    if device == "cuda":
        # Said of any test on the device (a case, a hand-written one, one whose CPU run fails).
        return (f"no CUDA device here ({env.backend} backend): a CPU pass is a hint, not CUDA "
                "validation; run it on a GPU runner")
    return f"no {device} device here ({env.backend} backend)"


def run_skip(req: Requirements, env: Environment, device: str) -> str | None:
    """Why a run of a case with requirements ``req`` on ``device`` cannot happen here: an
    unmet requirement (named first: it holds on every runner), else a missing device type."""
    return evaluate(req, env, device) or device_skip(device, env)


def device_list(env: Environment, own: Sequence[str] | None = None,
                asked: Sequence[str] | None = None,
                backends: Sequence[str] | None = None) -> tuple[str, ...]:
    """The device types to run on: ``own`` (a case's list), else the defaults and the local ones.

    ``asked`` (``--gpu-devices``) narrows a case's own list; without one, every
    device asked for is run (skipped with the reason where this machine has none).
    ``backends`` (a case's ``[matrix] backends``) drops from the defaults a device type
    that none of those builds has: ``backends = ["cpu"]`` made a CUDA item whose skip
    advised a GPU runner, where the case skips whole.
    """
    devices = tuple(own) if own else DEFAULT_DEVICES + tuple(
        t for t in env.device_types if t not in DEFAULT_DEVICES)
    if not own and backends is not None:
        from pytest_gpucase.base.backends import BY_NAME

        provided = {BY_NAME[name].device_type for name in backends if name in BY_NAME}
        devices = tuple(d for d in devices if d == "cpu" or d in provided)
    if asked is None:
        return devices
    return tuple(asked) if not own else tuple(d for d in devices if d in asked)


def blocking_env(backend: str, device: str, blocking: bool) -> dict[str, str]:
    """The child variables of a launch-blocking run; the CPU runs synchronously anyway."""
    return launch_blocking_env(backend) if blocking and device != "cpu" else {}


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
    own lists; ``saved_dtype`` names the runs where ``[matrix] dtypes`` does not
    (``label_dtype``: the autocast dtype, else the saved inputs' floating dtype).
    """
    cast = case.matrix.dtypes is not None
    case_dtypes = case.matrix.dtypes or (saved_dtype or "float32",)
    if dtypes is not None:
        case_dtypes = tuple(d for d in case_dtypes if d in dtypes)
    blocking = launch_blocking or case.launch_blocking
    variants: list[Variant | None] = [None, *expand_variants(case.variants)]
    specs: list[RunSpec] = []
    for device in device_list(env, case.matrix.devices, devices, case.matrix.backends):
        skip = run_skip(case.matrix, env, device)
        child_env = blocking_env(env.backend, device, blocking)
        specs += [RunSpec(case, device, dtype, cast, variant, dict(child_env), bool(child_env),
                          skip)
                  for dtype in case_dtypes for variant in variants]
    return specs


def one_dtype_without_floats(case: Case, specs: list[RunSpec]) -> list[RunSpec]:
    """A case with no floating input runs in its first dtype only; its other ``[matrix] dtypes``
    items are skipped, saying why.

    A dtype run casts the floating inputs and nothing else: with integer (or bool) inputs
    alone, a ``bfloat16`` item would run the very ``float32`` computation again and the report
    would record a bfloat16 pass that never computed in bfloat16.
    """
    from pytest_gpucase.base.errors import CaseFormatError
    from pytest_gpucase.case.model import INPUTS_FILE

    if not specs or not case.matrix.dtypes or len(case.matrix.dtypes) < 2:
        return specs
    try:
        if saved_dtype(case):
            return specs
    except CaseFormatError:
        return specs  # a payload that cannot be read: each run says so
    first = specs[0].dtype
    held = (f"{INPUTS_FILE} holds no floating tensor" if case.inputs_file.exists()
            else f"the case has no {INPUTS_FILE}")
    return [spec if spec.dtype == first or spec.skip is not None else replace(
                spec, skip=f"no floating input to cast to {spec.dtype} ({held}): this run would "
                f"repeat the {first} run; list one dtype in [matrix] dtypes")
            for spec in specs]


def single_run(case: Case, env: Environment, device: str, dtype: str | None = None, *,
               launch_blocking: bool | None = None) -> RunSpec:
    """One unchanged run of ``case`` on ``device``, in ``dtype`` or the dtype its items are
    named by (``label_dtype``), as ``expand`` makes it.

    ``launch_blocking`` None follows the case's own ``launch_blocking``.
    """
    own = label_dtype(case) or "float32"
    # A case with [matrix] dtypes casts (as expand); an explicit other dtype casts too.
    cast = case.matrix.dtypes is not None or (dtype is not None and dtype != own)
    blocking = case.launch_blocking if launch_blocking is None else launch_blocking
    child_env = blocking_env(env.backend, device, blocking)
    return RunSpec(case, device, dtype or own, cast, env=child_env,
                   launch_blocking=bool(child_env))


def unchanged_runs(case: Case, env: Environment, *, device: str,
                   dtype: str | None = None) -> list[RunSpec]:
    """The baseline of minimize and ablate: ``case`` on ``device`` in ``dtype``, else in each
    of its dtypes."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise NotRunnable(f"unknown dtype '{dtype}'; expected one of {', '.join(FLOAT_DTYPES)}")
    dtypes = (dtype,) if dtype is not None else case.matrix.dtypes or (None,)
    return [single_run(case, env, device, d) for d in dtypes]


def choose_device(case: Case, env: Environment, device: str | None = None) -> str:
    """``device`` if it can run here; else an accelerator the case can run on, else the CPU.

    An accelerator comes first because the failures worth shrinking or ablating
    are device failures; a CPU run of a GPU failure may not reproduce it.
    """
    reason = evaluate(case.matrix, env, "cpu")  # what no device escapes
    if reason is not None:
        raise NotRunnable(f"{display(case.case_file)}: cannot run here: {reason}")
    if device is not None:
        reason = run_skip(case.matrix, env, device)
        if reason is not None:
            raise NotRunnable(f"{display(case.case_file)}: --device {device}: {reason}")
        return device
    wanted = device_list(env, case.matrix.devices, backends=case.matrix.backends)
    usable = [d for d in wanted if run_skip(case.matrix, env, d) is None]
    if not usable:
        why = device_skip(wanted[0], env) or run_skip(case.matrix, env, wanted[0])
        raise NotRunnable(f"{display(case.case_file)}: {why}")
    return next((d for d in usable if d != "cpu"), usable[0])

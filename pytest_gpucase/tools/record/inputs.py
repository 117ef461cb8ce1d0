"""A watched call's inputs: the snapshot taken before each call, the arguments bound to
names and sorted into what a case holds (tensors on the host, TOML literals, dicts of
tensors) and what it cannot, and the numeric context (RNG states, autocast and math flags)
the call ran under.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base import backends
from pytest_gpucase.base.tensors import is_tensor, nbytes, tensor_versions, tensors_in
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import DICT_PREFIX, NESTED_PREFIX, RNG_NAMES, TENSORS_KEY
from pytest_gpucase.tools.record.origin import INT64, Watched, error_line, mib
from pytest_gpucase.verdict.triage import Triage

if TYPE_CHECKING:
    import torch

__all__ = ["NOT_LITERAL", "Before", "Inputs", "as_literal", "autocast_dtype", "collect",
           "encode_nested", "numeric_context", "rng_state", "snapshot_before", "storable",
           "synchronize", "tensors_of", "unusable"]

# Host inputs copied before each call from this size up are named once (the copy is paid at
# every step of a loop that never fails).
_HOST_COPY_NOTE = 64 * 2**20


@dataclass(frozen=True)
class Before:
    """A watched call's tensor arguments as they were before it ran, keyed by ``id``: host
    copies where the snapshot rule took them, and every one's version counter (a read)."""

    copies: Mapping[int, torch.Tensor] = field(default_factory=dict)
    versions: Mapping[int, int] = field(default_factory=dict)
    # Why a tensor without a copy has none, and how to get one: the fix a note names.
    why_not: str = ""


@dataclass(frozen=True)
class Inputs:
    """A watched call's arguments, sorted into what a case can hold and what it cannot."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)  # on the host
    literals: Mapping[str, Any] = field(default_factory=dict)
    described: Mapping[str, str] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    snapshot: str | None = None
    problems: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # changed in place by the failing call, saved as changed
    shared: tuple[str, ...] = ()   # "buf, view": arguments sharing memory, held apart in a case
    # Arguments nesting tensors in lists, tuples and dicts (a batch (x, y)): name -> the
    # structure, its tensors named ``nested.<name>.<path>`` among ``tensors``.
    nested: Mapping[str, Any] = field(default_factory=dict)


def snapshot_before(watched: Watched, args: Any, kwargs: Any, *, snapshot: str,
                    snapshot_limit: int, device_names: dict[str, str],
                    note: Callable[[str, str], None]) -> Before:
    """Host copies of the tensor arguments while they fit ``snapshot_limit`` (device ones
    first: a sticky error would lose them), and every one's version counter.

    A host tensor is copied too: the call may change it in place before it raises,
    and the case must hold what was passed. The version counters cost a read each,
    and tell, after a failure, which tensors without a copy the call changed. Each
    device's name is asked for on the way (into ``device_names``); ``note(key, line)`` says
    a line once per key.
    """
    tensors = list({id(t): t for t in tensors_of(args, kwargs)}.values())
    if not tensors:
        return Before()
    versions = tensor_versions(tensors)
    try:
        device = [t for t in tensors if t.device.type != "cpu"]
        _remember_device_names(device, device_names)
        if snapshot != "before":
            return Before(versions=versions, why_not=(
                'snapshot="after"; Recorder(snapshot="before") copies them before each call, '
                "as passed"))
        stored = [t for t in tensors if storable(t)]
        total = sum(nbytes(t) for t in stored)
        taken = stored
        why_not = ""
        if total > snapshot_limit:
            taken, why_not = _over_limit(watched, stored, total, snapshot_limit, note)
        copies = {id(t): payload.to_device(t, "cpu", copy=True) for t in taken}
        _note_host_copy(watched, taken, note)
        return Before(copies, versions, why_not)
    except Exception:
        # The device did not answer before the call; the call itself will tell.
        return Before(versions=versions, why_not="the copy before the call failed")


def _over_limit(watched: Watched, stored: list[torch.Tensor], total: int, snapshot_limit: int,
                note: Callable[[str, str], None]) -> tuple[list[torch.Tensor], str]:
    """Which tensors over the snapshot limit are still copied (the device ones if they fit),
    and why the others are not; noted once."""
    on_device = [t for t in stored if t.device.type != "cpu"]
    device_total = sum(nbytes(t) for t in on_device)
    taken = on_device if on_device and device_total <= snapshot_limit else []
    what = ("only the device ones are copied before each call" if taken else
            "they are not copied before the call: device ones are copied after "
            "a failure, if the device still answers")
    limit = mib(snapshot_limit)
    why_not = (f"over the snapshot limit of {limit}; Recorder(snapshot_limit=...) "
               f"of {mib(total)} or more copies them before each call, "
               "as passed")
    note(f"limit:{watched.name}", (
        f"gpucase: note: the inputs of {watched.name} hold {mib(total)}, "
        f"over the snapshot limit of {limit}: {what}, and host ones are saved as "
        "they are after a failure (Recorder(snapshot_limit=...) to change)"))
    return taken, why_not


def _note_host_copy(watched: Watched, taken: list[torch.Tensor],
                    note: Callable[[str, str], None]) -> None:
    """Whether the host copies taken before each call are large enough to be noted once."""
    host = sum(nbytes(t) for t in taken if t.device.type == "cpu")
    if host >= _HOST_COPY_NOTE:
        # Paid by every step of a loop that never fails: said once, with the way out.
        note(f"host-copy:{watched.name}", (
            f"gpucase: note: {mib(host)} of host inputs of {watched.name} are "
            "copied before each call, so that a failure saves them as passed; "
            "Recorder(snapshot_limit=...) below that size, or snapshot=\"after\", "
            "skips the copy"))


def _remember_device_names(tensors: list[torch.Tensor], names: dict[str, str]) -> None:
    """Ask each device its name while it answers, so a sticky error cannot hide it."""
    import torch

    for tensor in tensors:
        device = str(tensor.device)
        if device in names:
            continue
        name = device
        try:
            if tensor.device.type == "cuda":
                name = torch.cuda.get_device_name(tensor.device)
            elif tensor.device.type == "xpu":
                name = torch.xpu.get_device_name(tensor.device)
        except Exception:
            pass
        names[device] = name


def tensors_of(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among the arguments, and those nested in lists, tuples and dicts of them
    (a batch ``(x, y)``, a dict of tensors)."""
    return list(tensors_in([list(args), list(kwargs.values())]))


def _tensor_dict(value: Any) -> dict[str, torch.Tensor] | None:
    """``value`` when it is a non-empty dict of tensors under string keys, else None."""
    if (isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value)
            and all(is_tensor(v) for v in value.values())):
        return dict(value)
    return None


def storable(tensor: Any) -> bool:
    """Whether the payload format holds ``tensor`` as it is: a plain tensor, strided, of a
    dtype it knows (other kinds it holds as parts: ``payload.unstorable`` says which)."""
    import torch

    names = {name for name, _ in payload.DTYPES.values()}
    return (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided
            and not tensor.is_quantized and str(tensor.dtype).removeprefix("torch.") in names)


def synchronize(tensors: list[torch.Tensor]) -> None:
    """Wait for the devices of ``tensors``, so that an asynchronous error is raised now."""
    import torch

    for device in {t.device for t in tensors if t.device.type != "cpu"}:
        backends.synchronize(torch, device)


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    text = f"{dtype} {tuple(tensor.shape)} stride {tuple(tensor.stride())}"
    if tensor.storage_offset():
        text += f" offset {tensor.storage_offset()}"
    return f"{text} {tensor.device}"


def _bind(watched: Watched, args: Any, kwargs: Any,
          ) -> tuple[list[tuple[str, Any, inspect.Parameter | None]], list[str]]:
    """The call's arguments by name, and why some could not be passed by keyword in a replay."""
    problems: list[str] = []
    if watched.signature is None:
        if args:
            problems.append(f"the signature of {watched.name} cannot be read, so its positional "
                            "arguments are saved as arg0, arg1, ...: rename them in the case")
        return ([(f"arg{i}", v, None) for i, v in enumerate(args)]
                + [(k, v, None) for k, v in kwargs.items()], problems)
    try:
        bound = watched.signature.bind(*args, **kwargs)
    except TypeError as exc:
        problems.append(f"the arguments do not fit the signature of {watched.name} ({exc})")
        return ([(f"arg{i}", v, None) for i, v in enumerate(args)]
                + [(k, v, None) for k, v in kwargs.items()], problems)
    named: list[tuple[str, Any, inspect.Parameter | None]] = []
    for name, value in bound.arguments.items():
        param = watched.signature.parameters[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                problems.append(f"*{name} got {len(value)} extra positional arguments, which a "
                                "replay cannot pass by keyword")
                named.extend((f"{name}{i}", v, None) for i, v in enumerate(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            named.extend((key, v, None) for key, v in value.items())
        else:
            if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                problems.append(f"{name} is positional-only, and a replay passes inputs by "
                                "keyword: wrap the function")
            named.append((name, value, param))
    return named, problems


def collect(watched: Watched, args: Any, kwargs: Any, before: Before,
            found: Triage | None, exc: BaseException) -> Inputs:
    """Sort the arguments into tensors (on the host), literals and skipped values."""
    named, problems = _bind(watched, args, kwargs)
    sorted_ = _Sorted(before)
    for name, value, param in named:
        _sort_argument(sorted_, name, value, param)
    unsaved = _copy_pending(sorted_, found, exc)
    snapshot, changed, shared = _snapshot_line(sorted_, unsaved)
    skipped = sorted_.skipped
    if skipped:
        problems.append(f"{', '.join(sorted(skipped))} could not be saved (see [origin] "
                        "skipped_inputs): add them to [inputs] or to inputs.safetensors")
    return Inputs(tensors=sorted_.tensors, literals=sorted_.literals,
                  described=sorted_.described, skipped=skipped, snapshot=snapshot,
                  problems=tuple(problems), devices=tuple(sorted_.devices),
                  changed=tuple(changed), shared=shared, nested=sorted_.nested)


@dataclass
class _Sorted:
    """A watched call's arguments as ``collect`` sorts them, one by one."""

    before: Before
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    literals: dict[str, Any] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    host_after: list[str] = field(default_factory=list)
    device_after: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    storages: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    unwritten: set[str] = field(default_factory=set)  # the call wrote nothing into these
    nested: dict[str, Any] = field(default_factory=dict)


def _sort_argument(sorted_: _Sorted, name: str, value: Any,
                   param: inspect.Parameter | None) -> None:
    """Where one argument goes: a tensor, nested tensors, a dict of tensors, a literal, or
    skipped."""
    import torch

    if isinstance(value, torch.Tensor):
        _take(sorted_, name, value)
        return
    if _take_nested(sorted_, name, value):
        return
    group = _tensor_dict(value)
    if group is not None:
        # Each tensor under its own payload name; [inputs] says how to rebuild the dict.
        members = {key: f"{DICT_PREFIX}{name}.{key}" for key in group}
        for key, tensor in group.items():
            _take(sorted_, members[key], tensor)
        sorted_.literals[name] = {TENSORS_KEY: members}
        return
    if value is None and param is not None and param.default is None:
        return  # the replay gets the same None from the default
    literal = as_literal(value)
    if literal is NOT_LITERAL:
        sorted_.skipped[name] = _type_name(value)
    else:
        sorted_.literals[name] = literal


def _take_nested(sorted_: _Sorted, name: str, value: Any) -> bool:
    """Whether the argument nests tensors in lists, tuples and dicts, taken if so."""
    if not isinstance(value, (list, tuple, Mapping)) or _tensor_dict(value) is not None:
        return False
    found_tensors: dict[str, torch.Tensor] = {}
    spec = encode_nested(value, f"{NESTED_PREFIX}{name}", found_tensors)
    if spec is None or not found_tensors:
        return False
    for key, tensor in found_tensors.items():
        _take(sorted_, key, tensor)
    sorted_.nested[name] = spec
    return True


def _take(sorted_: _Sorted, name: str, value: torch.Tensor) -> None:
    """Where one tensor goes: copied before the call, saved from the host now, or pending
    a copy from its device."""
    before = sorted_.before
    sorted_.described[name] = _describe(value)
    sorted_.devices.append(str(value.device))
    known = before.versions.get(id(value))
    if (tensor_versions([value]).get(id(value)) == known if known is not None
            else _as_copied(before.copies.get(id(value)), value)):
        sorted_.unwritten.add(name)
    with contextlib.suppress(Exception):   # no storage (a functional tensor): no sharing
        where = value.untyped_storage().data_ptr()
        if where:
            sorted_.storages.setdefault((str(value.device), where), []).append(name)
    if not storable(value):  # complex128, sparse, quantized: saved as their exact parts
        why = payload.unstorable(value)
        if why is not None:
            sorted_.skipped[name] = f"Tensor ({why}): not storable"
        else:
            sorted_.tensors[name] = value.detach().to("cpu", copy=True)
        return
    if id(value) in before.copies:
        sorted_.tensors[name] = before.copies[id(value)]
        sorted_.copied.append(name)
        return
    version = before.versions.get(id(value))
    if version is not None and tensor_versions([value]).get(id(value), version) != version:
        sorted_.changed.append(name)
    if value.device.type == "cpu":
        sorted_.tensors[name] = value.detach()
        sorted_.host_after.append(name)
    else:
        sorted_.pending[name] = value


def _as_copied(copy: torch.Tensor | None, value: torch.Tensor) -> bool:
    """Whether a host tensor without a version counter (an inference tensor: evaluation under
    ``torch.inference_mode``) still holds what its copy before the call held. A device tensor
    is not read here (the device may not answer after the failure): unknown, so False."""
    import torch

    if copy is None or value.device.type != "cpu":
        return False
    try:
        return bool(torch.equal(copy, value.detach()))
    except Exception:
        return False


def _copy_pending(sorted_: _Sorted, found: Triage | None, exc: BaseException) -> str | None:
    """Copy the device tensors to the host if the device may answer; why they were not
    saved otherwise."""
    pending, tensors = sorted_.pending, sorted_.tensors
    if not pending:
        return None
    reason = unusable(found)
    if reason is None:
        try:
            for name, value in pending.items():
                tensors[name] = payload.to_device(value, "cpu")
            sorted_.device_after.extend(pending)
        except Exception as copy_error:
            reason = (f"{found.clue if found else type(exc).__name__} (copying {name} to the "
                      f"host raised {error_line(copy_error)})")
            for name in pending:
                tensors.pop(name, None)
    if reason is None:
        return None
    unsaved = f"not saved: device unusable after {reason}"
    if tensors:
        unsaved += f"; saved from the host: {', '.join(sorted(tensors))}"
    return unsaved


def _snapshot_line(sorted_: _Sorted, unsaved: str | None,
                   ) -> tuple[str | None, list[str], tuple[str, ...]]:
    """The ``[origin] snapshot`` line, the tensors saved as changed, and the arguments that
    shared memory."""
    groups = [(label, names) for label, names in (
        ("tensors copied before the call", sorted_.copied),
        ("host tensors, as they were after the failure", sorted_.host_after),
        ("device tensors copied after the failure", sorted_.device_after)) if names]
    snapshot = unsaved
    if snapshot is None and groups:
        snapshot = (groups[0][0] if len(groups) == 1 else
                    "; ".join(f"{label}: {', '.join(names)}" for label, names in groups))
    changed = [name for name in sorted_.changed if name in sorted_.tensors]
    if changed and snapshot is not None:
        snapshot += (f"; changed in place by the failing call, so saved as changed: "
                     f"{', '.join(changed)} (not copied before the call: "
                     f"{sorted_.before.why_not})")
    # A case holds each tensor on its own: a failure that needs a write through one argument
    # to show in another (a buffer and a view of it) cannot replay as captured.
    # Memory shared by arguments the call never wrote into (labels=input_ids, the Hugging
    # Face convention) holds the same values apart as together: nothing to say then.
    shared = tuple(", ".join(names) for names in sorted_.storages.values()
                   if len(names) > 1 and not set(names) <= sorted_.unwritten)
    if shared and snapshot is not None:
        snapshot += f"; shared memory in the call, held apart in the case: {'; '.join(shared)}"
    return snapshot, changed, shared


def encode_nested(value: Any, path: str, tensors: dict[str, torch.Tensor],
                  depth: int = 0) -> Any:
    """``value`` (lists, tuples, dicts under string keys of tensors and literals) as plain
    data naming its tensors (``{tensor = "nested.batch.0"}``), which go to ``tensors``; None
    when it holds anything else. ``run.replay.decode_nested`` reads it back."""
    import torch

    if depth > 16:
        return None
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {"tensor": path}
    if value is None:
        return {"none": True}
    if isinstance(value, (list, tuple)):
        items = [encode_nested(v, f"{path}.{i}", tensors, depth + 1) for i, v in enumerate(value)]
        if any(i is None for i in items):
            return None
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            return None
        table = {k: encode_nested(v, f"{path}.{k}", tensors, depth + 1)
                 for k, v in value.items()}
        return None if any(v is None for v in table.values()) else {"dict": table}
    literal = as_literal(value)
    return None if literal is NOT_LITERAL else {"value": literal}


def unusable(found: Triage | None) -> str | None:
    """Why the device must not be touched again, or None when it may still answer."""
    return found.clue if found is not None and found.sticky else None


def _type_name(value: Any) -> str:
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class _NotLiteral:
    """Marks a value TOML cannot hold."""


NOT_LITERAL: Any = _NotLiteral()


def as_literal(value: Any) -> Any:
    """``value`` as plain TOML data (tuples become arrays), or ``NOT_LITERAL``."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value) if INT64[0] <= value <= INT64[1] else NOT_LITERAL
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [as_literal(v) for v in value]
        return NOT_LITERAL if any(i is NOT_LITERAL for i in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return NOT_LITERAL
        table = {k: as_literal(v) for k, v in value.items()}
        return NOT_LITERAL if any(v is NOT_LITERAL for v in table.values()) else table
    return NOT_LITERAL


def rng_state(tensors: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The RNG states random ops will consume, taken before the call (a few KB, no sync)."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is not None:
        with contextlib.suppress(Exception):
            states["cuda"] = torch.cuda.get_rng_state(cuda)
    return states


# torch < 2.4 asks each device type's autocast state by its own name.
_LEGACY_AUTOCAST = {"cuda": ("is_autocast_enabled", "get_autocast_gpu_dtype"),
                    "cpu": ("is_autocast_cpu_enabled", "get_autocast_cpu_dtype"),
                    "xpu": ("is_autocast_xpu_enabled", "get_autocast_xpu_dtype")}


def autocast_dtype(kind: str) -> str | None:
    """The dtype of the autocast region of device type ``kind`` the caller runs in, or None
    outside one (or for a device type this build does not know).

    ``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype`` came with
    torch 2.4; before, each device type had its own pair of functions, and the typed call
    raised a TypeError that left ``[context] autocast`` silently out of the case.
    """
    import torch

    if hasattr(torch, "get_autocast_dtype"):
        try:
            if torch.is_autocast_enabled(kind):
                return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
        except Exception:  # a device type this build does not know
            return None
        return None
    names = _LEGACY_AUTOCAST.get(kind)
    enabled = getattr(torch, names[0], None) if names else None
    dtype = getattr(torch, names[1], None) if names else None
    if enabled is None or dtype is None:
        return None
    import warnings

    with warnings.catch_warnings():   # deprecated from torch 2.4: reached there only in tests
        warnings.simplefilter("ignore")
        try:
            return str(dtype()).removeprefix("torch.") if enabled() else None
        except Exception:
            return None


def numeric_context(devices: Iterable[str], rng: Mapping[str, torch.Tensor],
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``[context]`` table of the failing call, read while still inside its regions, and
    the RNG state tensors it names (docs/case-format.md, "[context]")."""
    import torch

    kinds = [d.split(":")[0] for d in devices]
    device_type = next((k for k in kinds if k != "cpu"), "cpu")
    context: dict[str, Any] = {}
    for kind in dict.fromkeys((device_type, "cpu")):
        dtype = autocast_dtype(kind)
        if dtype is not None:
            context["autocast"] = {"device_type": kind, "dtype": dtype, "enabled": True}
            break
    context["grad"] = torch.is_grad_enabled()
    context["inference"] = torch.is_inference_mode_enabled()
    context["deterministic"] = torch.are_deterministic_algorithms_enabled()
    context["tf32"] = {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                       "cudnn": bool(torch.backends.cudnn.allow_tf32)}
    context["default_dtype"] = str(torch.get_default_dtype()).removeprefix("torch.")
    tensors = {RNG_NAMES[kind]: state for kind, state in rng.items() if kind in RNG_NAMES}
    if tensors:
        context["rng"] = {kind: RNG_NAMES[kind] for kind in rng if kind in RNG_NAMES}
    return context, tensors

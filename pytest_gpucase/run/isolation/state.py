"""What a reused worker compares between calls: the state of the process that a call may
change and a fresh child would not have.

Runs in the worker only. ``WorkerState`` is taken once, before the worker's first call,
when the worker is exactly a fresh child (a fork of the same parent); after each call
``settle`` puts back what can be put back completely and cheaply, and names everything
else that differs. Anything named ends the worker: the next call gets a fresh one. The
check is built for the passing path: identities and flags taken once, compared after in
C loops over the saved values (no copy per call); the watched dicts first by their version
tags (CPython 3.11-3.13), which prove an untouched dict unchanged without its values.

What is restored, and why that is complete: global switches that every later operation
reads afresh and nothing caches (grad mode, default dtype, deterministic algorithms,
TF32 and matmul precision, cuDNN's switches, the intra-op thread count), the random
states (Python's, NumPy's, torch's CPU and CUDA generators), the working directory,
``sys.path``, and the modules imported from the user's own code (outside the standard
library and site-packages), which are forgotten so that the next case imports them
afresh, as a fresh child would.

What ends the worker, because putting it back would not be complete (or not cheap):

- environment variables (``os.environ`` and the C ``environ``): native libraries read
  them once, at an arbitrary first use (cuBLAS's workspace, OpenMP, the CUDA context);
- an attribute of torch (public names of every torch module, functions and classes of
  its private ones), of the standard library's numeric and process modules, of NumPy,
  of ``builtins``, of the user's modules (which may be shared helpers), or of a class
  torch's public modules hold (``torch.nn.Linear.forward``, ``torch.optim.SGD.step``),
  replaced, added or removed; a global of a user module, or a public one of gpucase's
  own, changed in place (a list, dict or set by content, four levels deep, a tensor or a
  torch module by version counters, another object by its attributes, a class by its
  methods); a kernel registered from Python (``torch.library``, an aten kernel
  overridden); a module of ``sys.modules`` replaced or removed; an import hook;
- torch's flags that are not restored: flush-denormal, anomaly mode, default device,
  warn-always, autocast and inference mode left on, a torch function or dispatch mode
  left on its stack, saved-tensor hooks, interop threads, and the other backend switches;
- a Python thread left running; warnings filters, the locale; signal handlers, the
  signal mask, a pending timer; resource limits, umask, nice, CPU affinity, process group
  or session, user ids; the interpreter's recursion limit, switch interval, trace or
  profile function, gc settings; ``sys.stdout`` or ``sys.stderr`` closed or reconfigured;
- a device left in an error state (a sticky CUDA error raises at the synchronize).

Not seen (and so not confirmed to be absent): private data of torch's and third-party
modules (lazily filled caches change there in normal use), globals of a library module
first imported during the call and changed after its import, objects reachable only
inside other objects, native threads, file descriptors, audit hooks, and anything a
C extension keeps to itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import itertools
import operator
import os
import random
import _signal
import signal
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from pytest_gpucase.base.backends import AUTOCAST_DEVICE_TYPES

__all__ = ["WorkerState", "prime"]

# Standard-library modules a replay's arithmetic or the process's behaviour depends on:
# all their names are compared. The rest of the standard library is not watched.
WATCHED_STDLIB = frozenset({
    "builtins", "sys", "os", "posixpath", "math", "cmath", "operator", "functools",
    "itertools", "random", "statistics", "decimal", "fractions", "numbers", "copy",
    "threading", "time", "contextlib", "warnings",
})
MAX_REASONS = 20
# Environment variables a library sets when one of its modules is imported, to its own
# default (variable, module, the function giving that default): a call that imports the
# module first leaves them set, as a fresh child does; restored by unsetting them.
_SET_AT_IMPORT = (
    ("TORCHINDUCTOR_CACHE_DIR", "torch._inductor.runtime.cache_dir_utils", "default_cache_dir"),
)
# Zero-argument getters of torch._C: global switches not restored here. Not the preferred
# BLAS, linear-algebra or attention backends: their first read may ask the device.
_TORCH_GETTERS = (
    "_get_backcompat_broadcast_warn", "_get_backcompat_keepdim_warn",
    "_get_cpu_allow_fp16_reduced_precision_reduction",
    "_get_cublas_allow_bf16_reduced_precision_reduction",
    "_get_cublas_allow_fp16_accumulation",
    "_get_cublas_allow_fp16_reduced_precision_reduction", "_get_cudnn_sdp_enabled",
    "_get_default_device", "_get_deterministic_fill_uninitialized_memory",
    "_get_fa3_sdp_enabled", "_get_flash_sdp_enabled",
    "_get_math_sdp_allow_fp16_bf16_reduction", "_get_math_sdp_enabled",
    "_get_mem_efficient_sdp_enabled", "_get_miopen_immediate", "_get_mkldnn_deterministic",
    "_get_mkldnn_enabled", "_get_nnpack_enabled", "_get_onednn_allow_tf32",
    "_get_overrideable_sdp_enabled", "_get_qengine", "_get_sdp_priority_order",
    "_get_sm_carveout_experimental", "_get_warnAlways",
    "_get_autograd_fallback_mode", "_get_graph_executor_optimize", "_get_tracing_state",
    "_is_any_autocast_enabled", "_is_fwd_grad_enabled", "_is_grad_layout_enforcement_enabled",
    "_is_multithreading_enabled", "_is_torch_function_enabled",
    "_is_torch_function_mode_enabled", "_is_view_replay_enabled", "_is_xnnpack_enabled",
    "_are_functorch_transforms_active", "_len_torch_function_stack",
    "_len_torch_dispatch_stack",
)
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: setattr on the class raises
_DEFAULT_CUDA_SEED = 67280421310721  # c10::default_rng_seed_val: a fresh CUDA generator's


def _autocast_probes(torch: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Autocast's dtype and switch of each device type this build knows
    (``torch.set_autocast_dtype("cpu", torch.float16)`` outlives the call that made it: a
    later case's matmul would run in float16)."""
    probes: list[tuple[str, Callable[[], Any]]] = []
    for kind in AUTOCAST_DEVICE_TYPES:
        try:
            torch.get_autocast_dtype(kind)
            torch.is_autocast_enabled(kind)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue   # a device type this build does not know, or an older torch
        probes.append((f"torch.get_autocast_dtype({kind!r})",
                       functools.partial(torch.get_autocast_dtype, kind)))
        probes.append((f"torch.is_autocast_enabled({kind!r})",
                       functools.partial(torch.is_autocast_enabled, kind)))
    return probes


@functools.cache
def _library_roots() -> tuple[str, ...]:
    roots: set[str] = set()
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars)
        roots.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    try:
        import site

        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except (AttributeError, ImportError):  # a virtualenv's old site module
        pass
    return tuple(os.path.join(os.path.normpath(root), "") for root in roots if root)



def prime() -> None:
    """In the parent, before it forks workers: what every worker's ``WorkerState`` reads
    once (where the standard library and the installed packages are)."""
    _library_roots()


def _user_code(module: Any) -> bool:
    """Whether ``module`` was loaded from a file outside the standard library and the
    installed packages (the project's own code, a helper next to the cases)."""
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and not os.path.normpath(file).startswith(_library_roots())


# Public parts of torch off a replay's path (graph tools, quantization, distributed, export,
# profiling), left out of the comparison to keep it cheap; and the registries filled on
# first use (torch.ops, torch.classes).
_TORCH_UNWATCHED = (
    "torch.ops", "torch.classes", "torch.ao", "torch.fx", "torch.distributed", "torch.export",
    "torch.quantization", "torch.onnx", "torch.testing", "torch.package", "torch.profiler",
    "torch.utils.benchmark", "torch.utils.tensorboard", "torch.utils.data.datapipes",
    "torch.nn.quantized", "torch.nn.qat", "torch.nn.intrinsic", "torch.nn.quantizable",
)

_UNWATCHED_PREFIXES = tuple(f"{name}." for name in _TORCH_UNWATCHED)


def _public_library_module(name: str) -> bool:
    """torch's and NumPy's modules a later case reads: the public ones (no part of the name
    private) and torch's C bindings, less ``_TORCH_UNWATCHED``."""
    if name in _TORCH_UNWATCHED or name.startswith(_UNWATCHED_PREFIXES):
        return False
    return name == "torch._C" or name.startswith("torch._C.") or "._" not in name


def _machinery(name: str) -> bool:
    return name == "pytest_gpucase" or name.startswith("pytest_gpucase.")


class _Namespaces:
    """Module and class dicts whose values are compared by identity.

    The values of every watched dict are kept in one flat list, so that the passing path
    is one C loop (``map(operator.is_, ...)``) and a comparison of lengths; only when it
    fails are the dicts looked at one by one.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.dicts: list[dict[str, Any]] = []
        self.strict: list[bool] = []  # every name compared (else public names and callables)
        self.lengths: list[int] = []
        self.keys: list[list[str]] = []
        self.values: list[Any] = []
        self.starts: list[int] = [0]
        self.versions = _Versions()
        self.containers: list[tuple[str, Any, Any]] = []  # (where, the object, a copy)
        self.tensors: list[tuple[str, Any, Any]] = []  # (where, the object, its versions)

    def add(self, name: str, namespace: dict[str, Any], strict: bool) -> None:
        self.names.append(name)
        self.dicts.append(namespace)
        self.strict.append(strict)

    def freeze(self) -> None:
        # The versions first: a dict changed meanwhile (another thread) shows as changed.
        self.versions.take(self.dicts)
        self.lengths = list(map(len, self.dicts))
        self.keys = list(map(list, self.dicts))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.starts = [0, *itertools.accumulate(self.lengths)]

    def unchanged(self) -> bool:
        """Whether every watched dict holds what it held: each pair of values the same
        object or, rarely, a replacement equal to it (an equal number). Where the
        interpreter keeps version tags, only the dicts modified since (a few: ``warnings``'
        module, whose ``showwarning`` each call replaces and puts back) are compared;
        else every value, in one list comparison in C."""
        versions = self.versions
        if not versions.views:
            return self._same(range(len(self.dicts)))
        now = versions.read()
        if now == versions.tags:
            return True
        modified = itertools.compress(range(len(now)), map(operator.ne, now, versions.tags))
        if not self._same(modified):
            return False
        versions.tags = now  # modified and put back: by identity, the same from here
        return True

    def _same(self, indices: Iterable[int]) -> bool:
        """Whether the dicts at ``indices`` hold what they held (length and values)."""
        dicts, lengths, values, starts = self.dicts, self.lengths, self.values, self.starts
        try:
            return all(len(dicts[index]) == lengths[index] and list(dicts[index].values())
                       == values[starts[index]:starts[index + 1]] for index in indices)
        except Exception:  # a replacement whose == raises (a tensor of several values)
            return False

    def changed(self) -> list[tuple[int, dict[str, Any]]]:
        """The index of each dict that differs from its frozen self (``_same``), with what it
        held."""
        starts = self.starts
        return [(index, dict(zip(self.keys[index], self.values[starts[index]:starts[index + 1]],
                                 strict=True)))
                for index in range(len(self.dicts)) if not self._same((index,))]


_VERSION = operator.attrgetter("value")


class _Versions:
    """The version tags of the watched dicts (CPython 3.11-3.13, PEP 509), read in one C loop:
    any change to a dict (an item added, removed, or bound to another object) gives it a new
    tag, so equal tags prove the dicts unchanged without comparing their 28,000 values (0.05
    ms against 1 ms). Where the interpreter keeps no such tag (``_version_offset``: checked
    on a dict of its own), ``unchanged`` is False and the values are compared instead."""

    def __init__(self) -> None:
        self.views: list[ctypes.c_uint64] = []
        self.tags: list[int] = []

    def take(self, dicts: list[dict[str, Any]]) -> None:
        """The tags of ``dicts`` now (dicts are only ever added to the watched list)."""
        offset = _version_offset()
        if offset is not None:
            # The dicts stay alive: ``_Namespaces.dicts`` holds them.
            self.views.extend(ctypes.c_uint64.from_address(id(d) + offset)
                              for d in dicts[len(self.views):])
        self.refresh()

    def read(self) -> list[int]:
        return list(map(_VERSION, self.views))

    def unchanged(self) -> bool:
        return bool(self.views) and self.read() == self.tags

    def refresh(self) -> None:
        self.tags = self.read()


@functools.cache
def _version_offset() -> int | None:
    """Where a dict keeps its version tag (after ``ma_used``), if this interpreter keeps one
    that changes on every modification, as CPython 3.11 to 3.13 do; else None."""
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    offset = object.__basicsize__ + ctypes.sizeof(ctypes.c_ssize_t)

    class Probe:
        pass

    probe: dict[str, Any] = {}
    owned = gc.get_referents(Probe.__dict__)[0]
    tags = []
    for step in (lambda: None, lambda: probe.__setitem__("a", object()),
                 lambda: probe.__setitem__("a", object()), lambda: probe.pop("a"),
                 lambda: setattr(Probe, "a", object()), lambda: delattr(Probe, "a")):
        step()
        tags.append((ctypes.c_uint64.from_address(id(probe) + offset).value,
                     ctypes.c_uint64.from_address(id(owned) + offset).value))
    kept = [tags[0][0], tags[1][0], tags[2][0], tags[3][0]]
    classes = [tags[3][1], tags[4][1], tags[5][1]]
    if len(set(kept)) != 4 or len(set(classes)) != 3 or tags[3][0] != tags[5][0]:
        return None
    return offset


class WorkerState:  # pragma: no cover - the worker
    """The worker's state before its first call, and what ``settle`` does after each call."""

    def __init__(self) -> None:
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.random = random.getstate()
        self.environ = self._environ()
        self.c_environ = _c_environ()
        self.threads = _python_threads()
        self.modules = dict(sys.modules)
        self.module_names = list(self.modules)
        self.module_objects = list(self.modules.values())
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.probes: list[tuple[str, Callable[[], Any]]] = []
        self.namespaces = _Namespaces()
        self.classes: set[int] = set()  # the classes whose dicts are watched
        self.cuda_started = False  # CUDA was first used by a call of this worker
        torch = sys.modules.get("torch")
        self.torch: dict[str, Any] = {}
        if torch is not None:
            self._take_torch(torch)
        numpy = sys.modules.get("numpy")
        self.numpy_random = None
        if numpy is not None:
            try:
                self.numpy_random = numpy.random.get_state()
                self.probes.append(("numpy.geterr()", numpy.geterr))
            except Exception:  # a NumPy without its random module: nothing to restore
                pass
        self.probes.extend(_process_probes())
        self.probed = [_safe(probe) for _, probe in self.probes]
        for name, module in list(sys.modules.items()):
            self._watch(name, module)
        self.namespaces.freeze()

    # --- taking ---------------------------------------------------------------------------

    @staticmethod
    def _environ() -> dict[Any, Any]:
        data = getattr(os.environ, "_data", None)  # CPython: the bytes behind os.environ
        return dict(data) if isinstance(data, dict) else dict(os.environ)

    def _take_torch(self, torch: Any) -> None:
        backends = torch.backends
        self.torch = {
            "grad": torch.is_grad_enabled(),
            "dtype": torch.get_default_dtype(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "matmul_tf32": backends.cuda.matmul.allow_tf32,
            "precision": torch.get_float32_matmul_precision(),
            "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark,
                      backends.cudnn.deterministic, backends.cudnn.allow_tf32),
            "threads": torch.get_num_threads(),
            "rng": torch.random.get_rng_state(),
            "cuda": torch.cuda.is_initialized(),
            "denormal": torch.tensor([1e-39], dtype=torch.float32),
        }
        if self.torch["cuda"]:
            self.torch["device"] = torch.cuda.current_device()
            self.torch["cuda_rng"] = torch.cuda.get_rng_state_all()
        tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
        # The seeds the parent queued for CUDA's first use: what a fresh child seeds it with.
        self.torch["cuda_seeds"] = [call[0] for call in getattr(tracker, "get_calls", list)()
                                    if call]
        denormal = self.torch["denormal"]
        probes: list[tuple[str, Callable[[], Any]]] = [
            ("torch.set_flush_denormal", lambda: float(denormal.mul(1.0).item()) == 0.0),
            ("torch.is_anomaly_enabled()", torch.is_anomaly_enabled),
            ("torch.is_anomaly_check_nan_enabled()", torch.is_anomaly_check_nan_enabled),
            ("torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled),
            ("torch.is_autocast_cache_enabled()", torch.is_autocast_cache_enabled),
            ("torch.get_num_interop_threads()", torch.get_num_interop_threads),
            ("torch.get_deterministic_debug_mode()", torch.get_deterministic_debug_mode),
        ]
        getter = getattr(torch, "get_default_device", None)
        if getter is not None:
            probes.append(("torch.get_default_device()", getter))
        probes.extend(_autocast_probes(torch))
        hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks",
                        None)
        if hooks is not None:
            probes.append(("saved tensors hooks", lambda: _identity(hooks(False))))
        for name in _TORCH_GETTERS:
            found = getattr(torch._C, name, None)
            if found is not None:
                probes.append((f"torch._C.{name}()", found))
        self.probes.extend(probes)
        for cls in (torch.Tensor, torch.nn.Module, torch.nn.Parameter,
                    torch.autograd.Function):
            self._watch_class(f"{cls.__module__}.{cls.__qualname__}", cls, strict=True)
        self.registrations = _count_registrations(torch)
        if self.registrations is not None:
            counter = self.registrations
            self.probes.append(("kernels or operators registered from Python (torch.library)",
                                lambda: counter[0]))

    def _watch(self, name: str, module: Any) -> None:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or name.startswith("gpucase_case_"):
            return
        top = name.partition(".")[0]
        if top in ("torch", "numpy"):
            # The public modules, and the bindings public functions call at run time; not
            # torch.ops and torch.classes, registries filled on first use.
            if _public_library_module(name):
                self.namespaces.add(name, namespace, strict=False)
                for value in list(namespace.values()):
                    # Its classes too (torch.nn.Linear.forward, torch.optim.SGD.step), where
                    # they are defined in torch, public or not (torch.optim.sgd).
                    if (isinstance(value, type) and id(value) not in self.classes
                            and str(getattr(value, "__module__", "")).startswith(top)):
                        self._watch_class(f"{value.__module__}.{value.__qualname__}", value,
                                          strict=False)
        elif _machinery(name):
            # gpucase's own code runs the next case (its comparison, its tolerance tables):
            # its functions, classes and public tables, not its private data, which it
            # sets itself between calls (case.project._READ, the configuration files read
            # while a worker finds a case's import paths; the reference cache's rows).
            self.namespaces.add(name, namespace, strict=False)
            self._watch_globals(name, namespace, strict=False, private=False)
        elif name in WATCHED_STDLIB or name in ("__main__", "__mp_main__"):
            self.namespaces.add(name, namespace, strict=True)
        elif _user_code(module):
            self.namespaces.add(name, namespace, strict=True)
            self._watch_globals(name, namespace, strict=True)

    def _watch_globals(self, name: str, namespace: dict[str, Any], strict: bool,
                       private: bool = True) -> None:
        """What a module's globals hold: its containers' contents, its tensors' versions,
        its classes' and other objects' attributes (``strict``: private names too;
        ``private``: the globals of private names are watched at all)."""
        for key, value in list(namespace.items()):
            if key.startswith("__") or (not private and key.startswith("_")):
                continue  # __builtins__ (the builtins' own dict, watched), __all__, ...
            if type(value) in (list, dict, set):
                self.namespaces.containers.append((f"{name}.{key}", value, _copy(value)))
                continue
            if isinstance(value, type):
                if value.__module__ == name:
                    self._watch_class(f"{name}.{value.__qualname__}", value, strict=strict)
                continue
            versions = _versions(value)
            if versions is not None:  # a tensor, or a module's, changed in place
                self.namespaces.tensors.append((f"{name}.{key}", value, versions))
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is dict and not isinstance(value, _NOT_DATA):
                # An object's attributes (a settings namespace, a module's training flag).
                self.namespaces.add(f"{name}.{key}", attributes, strict=strict)

    def _watch_class(self, name: str, cls: type, strict: bool) -> None:
        self.classes.add(id(cls))  # the classes live as long as their modules: ids are stable
        if cls.__flags__ & _IMMUTABLE_TYPE:
            return  # a C type nothing can assign to (torch._C's, the legacy tensor types)
        referents = gc.get_referents(cls.__dict__)  # the dict behind the mappingproxy
        if len(referents) == 1 and isinstance(referents[0], dict):
            self.namespaces.add(name, referents[0], strict)

    # --- settling after a call ------------------------------------------------------------

    def settle(self) -> list[str]:
        """Restore what is restored, forget the user's modules the call imported, and name
        what else differs from a fresh child (empty: the worker may take the next call)."""
        reasons: list[str] = []
        try:
            # First: a torch mode left on its stack would intercept the restore's calls.
            for (name, probe), before in zip(self.probes, self.probed, strict=True):
                if name.startswith("torch._C._len_torch") and _safe(probe) != before:
                    return [f"{name} changed: a torch mode was left on (such as the one "
                            "torch.set_default_device sets)"]
            self._restore(reasons)
            self._compare(reasons)
        except Exception as exc:  # a restore or a probe that fails: nothing is vouched for
            reasons.append(f"the state could not be checked: {type(exc).__name__}: {exc}")
        return reasons[:MAX_REASONS]

    def _restore(self, reasons: list[str]) -> None:
        os.chdir(self.cwd)
        for variable, module, default in _SET_AT_IMPORT:
            # Set by a library module that the call imported first, to the library's own
            # default: unset again, as in a fresh child that has not imported it yet (the
            # library sets it again, the same, when it next needs it).
            found = sys.modules.get(module)
            if (variable not in self.environ and variable.encode() not in self.environ
                    and found is not None and module not in self.modules):
                with contextlib.suppress(Exception):
                    if os.environ.get(variable) == getattr(found, default)():
                        del os.environ[variable]
        sys.path[:] = self.path
        random.setstate(self.random)
        if self.numpy_random is not None:
            sys.modules["numpy"].random.set_state(self.numpy_random)
        torch = sys.modules.get("torch")
        if torch is None or not self.torch:
            return
        saved, backends = self.torch, torch.backends
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a sticky device error raises here: end the worker
        torch.set_grad_enabled(saved["grad"])
        torch.set_default_dtype(saved["dtype"])
        if (torch.are_deterministic_algorithms_enabled(), saved["warn_only"]) != (
                saved["deterministic"], torch.is_deterministic_algorithms_warn_only_enabled()):
            # As execute's switch does: the public call would import inductor (seconds).
            torch._C._set_deterministic_algorithms(saved["deterministic"],
                                                   warn_only=saved["warn_only"])
        backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
        torch.set_float32_matmul_precision(saved["precision"])
        (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
         backends.cudnn.allow_tf32) = saved["cudnn"]
        if torch.get_num_threads() != saved["threads"]:
            torch.set_num_threads(saved["threads"])
        torch.random.set_rng_state(saved["rng"])
        if torch.cuda.is_initialized():
            self._restore_cuda(torch, reasons)

    def _restore_cuda(self, torch: Any, reasons: list[str]) -> None:
        saved = self.torch
        if "cuda_rng" not in saved:
            # CUDA was first used in this worker: a fresh child's generators are seeded at
            # that moment, with the default seed and what the parent queued for it.
            try:
                for generator in torch.cuda.default_generators:
                    generator.manual_seed(_DEFAULT_CUDA_SEED)
                for seed in saved["cuda_seeds"]:
                    seed()
                saved["cuda_rng"] = torch.cuda.get_rng_state_all()
                saved["device"] = 0
            except Exception as exc:
                reasons.append(f"CUDA's random state could not be made fresh: {exc}")
                return
        torch.cuda.set_device(saved["device"])
        torch.cuda.set_rng_state_all(saved["cuda_rng"])

    def _compare(self, reasons: list[str]) -> None:
        if self._environ() != self.environ or _c_environ() != self.c_environ:
            reasons.append(f"environment variables changed: {_env_changes(self.environ)}")
        if _python_threads() > self.threads:
            reasons.append(f"a Python thread was left running: {_thread_names()}")
        self._compare_modules(reasons)
        for (name, probe), before in zip(self.probes, self.probed, strict=True):
            after = _safe(probe)
            if after != before:
                reasons.append(f"{name} changed: {_short(before)} -> {_short(after)}")
        if sys.meta_path != self.meta_path or sys.path_hooks != self.path_hooks:
            reasons.append("an import hook was added or removed (sys.meta_path, sys.path_hooks)")

    def _compare_modules(self, reasons: list[str]) -> None:
        new = self._new_modules()
        dropped = _drop_user_code(new)
        self._compare_watched(reasons)
        kept = [name for name in new if name not in dropped and name in sys.modules]
        cuda_started = self._first_cuda_use()
        if not self.namespaces.unchanged():
            reasons.extend(self._namespace_changes(set(kept), cuda_started))
        for name in kept:
            self._watch(name, sys.modules[name])
            self.modules[name] = sys.modules[name]
        if kept:
            self.module_names = list(self.modules)
            self.module_objects = list(self.modules.values())
            self.namespaces.freeze()

    def _new_modules(self) -> list[str]:
        """The modules imported since the last look, in import order."""
        known = len(self.module_objects)
        objects = list(sys.modules.values())
        if objects[:known] == self.module_objects:
            # Nothing removed or replaced (modules are equal only to themselves): what was
            # imported is at the end (a call's case module, each call).
            return [name for name in itertools.islice(sys.modules, known, None)
                    if name not in self.modules]
        return [name for name in sys.modules if name not in self.modules]

    def _compare_watched(self, reasons: list[str]) -> None:
        """Whether a watched module was replaced, or a watched container or tensor changed."""
        if not all(map(operator.is_, map(sys.modules.get, self.module_names),
                       self.module_objects)):
            gone = [name for name, module in self.modules.items()
                    if sys.modules.get(name) is not module]
            reasons.append(f"sys.modules[{gone[0]!r}] was replaced or removed")
        for where, value, copy in self.namespaces.containers:
            if not _same_contents(value, copy):
                reasons.append(f"{where} was changed in place")
        for where, value, versions in self.namespaces.tensors:
            if _versions(value) != versions:
                reasons.append(f"{where} was changed in place (its tensors)")

    def _first_cuda_use(self) -> bool:
        """Whether this call was the worker's first to use CUDA (then remembered)."""
        cuda_started = bool(self.torch) and not self.torch["cuda"] and not self.cuda_started
        if cuda_started and sys.modules["torch"].cuda.is_initialized():
            self.cuda_started = True
            return True
        return False

    def _namespace_changes(self, imported: set[str], cuda_started: bool) -> list[str]:
        """The changes in the watched dicts, each named, less those an import makes (a
        package gains its new submodule as an attribute) and, on the call that first used
        CUDA, the data CUDA's initialization sets (``torch.cuda.default_generators``, what
        the build has), which a fresh child's first use sets alike; the rest is frozen
        anew."""
        found: list[str] = []
        spaces = self.namespaces
        for index, before in spaces.changed():
            name, namespace, strict = spaces.names[index], spaces.dicts[index], spaces.strict[index]
            for key in set(before) | set(namespace):
                old, new = before.get(key, _ABSENT), namespace.get(key, _ABSENT)
                if old is new:
                    continue
                if (old is _ABSENT and isinstance(new, types.ModuleType)
                        and new.__name__ == f"{name}.{key}" and new.__name__ in imported):
                    continue  # an import of a submodule, which a fresh child makes too
                if not strict and key.startswith("_") and not (_code(old) or _code(new)):
                    continue  # private data of a library (a cache filled in normal use)
                if (cuda_started and name.startswith("torch.cuda")
                        and not (_code(old) or _code(new))):
                    continue
                verb = ("added" if old is _ABSENT else "removed" if new is _ABSENT
                        else "replaced")
                found.append(f"{name}.{key} was {verb}")
        self.namespaces.freeze()
        return found



def _drop_user_code(new: list[str]) -> dict[str, Any]:
    """Which newly imported modules are the user's code, removed as a fresh child has none."""
    dropped: dict[str, Any] = {}
    for name in new:
        module = sys.modules[name]
        if name.startswith("gpucase_case_") or (_user_code(module) and not _machinery(name)):
            # The user's code, imported by this call: a fresh child imports it afresh.
            dropped[name] = sys.modules.pop(name)
    for name, module in dropped.items():
        parent, _, attribute = name.rpartition(".")
        holder = sys.modules.get(parent)
        if holder is not None and getattr(holder, attribute, None) is module:
            delattr(holder, attribute)  # as before the import: a fresh child has no such
    return dropped

_ABSENT = object()
# Globals whose ``__dict__`` is code, not data a later case reads.
_NOT_DATA = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
             types.MethodType, functools.partial)


def _versions(value: Any) -> Any:
    """A tensor's version counter (every in-place change bumps it), or those of a torch
    module's parameters and buffers with their identities; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if isinstance(value, torch.Tensor):
            return value._version
        if isinstance(value, torch.nn.Module):
            return [(name, id(tensor), tensor._version) for name, tensor in itertools.chain(
                value.named_parameters(), value.named_buffers())]
    except Exception:  # a tensor without versions (an inference tensor), a broken module
        return None
    return None


def _code(value: Any) -> bool:
    return callable(value) or isinstance(value, types.ModuleType)


_CONTAINERS = (list, dict, set)
_NESTED_DEPTH = 4  # containers inside containers compared this deep
_NESTED_MAX = 1000  # inner containers and tensors of one global compared at most


def _copy(value: Any, depth: int = 0) -> Any:
    """A container's snapshot: its items by identity (a list compared in C), and those
    containers and tensors among them, each with its own snapshot or versions
    (``CONFIG["opts"]["scale"] = 0``, ``TABLES["exp"].mul_(0)``)."""
    if type(value) is dict:
        shallow: Any = list(value.items())
        items: Any = value.values()
    elif type(value) is list:
        shallow = items = list(value)
    else:
        return set(value), ()  # hashable items: nothing inside them to change in place
    nested: list[tuple[Any, bool, Any]] = []
    if depth < _NESTED_DEPTH:
        for item in items:
            if type(item) in _CONTAINERS:
                nested.append((item, True, _copy(item, depth + 1)))
            elif (versions := _versions(item)) is not None:
                nested.append((item, False, versions))
            if len(nested) >= _NESTED_MAX:
                break
    return shallow, tuple(nested)


def _same_contents(value: Any, copy: Any) -> bool:
    shallow, nested = copy
    try:  # in C: each pair is the same object, or (rarely) a replacement equal to it
        if type(value) is dict:
            same = len(value) == len(shallow) and list(value.items()) == shallow
        else:
            same = len(value) == len(shallow) and (list(value) if type(value) is list
                                                   else value) == shallow
    except Exception:  # a replacement whose == raises (a tensor of several values)
        return False
    return same and all(_same_contents(item, inner) if container else _versions(item) == inner
                        for item, container, inner in nested)


def _identity(value: Any) -> Any:
    return None if value is None else tuple(map(id, value)) if isinstance(value, tuple) else id(
        value)


def _safe(probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except Exception as exc:
        return f"<{type(exc).__name__}>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _python_threads() -> int:
    import _thread

    count = getattr(_thread, "_count", None)
    return int(count()) if count is not None else threading.active_count() - 1


def _thread_names() -> str:
    names = [thread.name for thread in threading.enumerate()
             if thread is not threading.main_thread()]
    return ", ".join(names[:5]) or "started outside threading"


def _env_changes(before: dict[Any, Any]) -> str:
    after = WorkerState._environ()
    names = sorted({os.fsdecode(k) if isinstance(k, bytes) else str(k)
                    for k in set(before) ^ set(after)
                    | {k for k in before if k in after and before[k] != after[k]}})
    return ", ".join(names[:10]) or "outside os.environ (os.putenv or C code)"


_C_ENVIRON: Any = None


def _c_environ() -> frozenset[bytes] | None:
    """The C library's ``environ``, which native code reads (``os.putenv`` changes it
    without ``os.environ``), as a set of ``NAME=value`` strings; None where unreadable."""
    global _C_ENVIRON
    try:
        if _C_ENVIRON is None:
            _C_ENVIRON = ctypes.c_void_p.in_dll(ctypes.CDLL(None), "environ")
        array = ctypes.cast(_C_ENVIRON.value, ctypes.POINTER(ctypes.c_char_p))
    except (OSError, ValueError, AttributeError):
        return None
    if not array:
        return frozenset()
    found = []
    for index in range(1 << 16):
        entry = array[index]
        if entry is None:
            break
        found.append(entry)
    return frozenset(found)


def _count_registrations(torch: Any) -> list[int] | None:  # pragma: no cover - the worker
    """Count, from now on, the libraries of kernels and operators that code outside torch
    registers with the dispatcher (``torch.library``: ``Library``, ``custom_op``, ``impl``).

    A kernel that overrides an aten one (aten::exp on CPU) changes ``torch.exp`` without
    changing its identity, and outlives the call while its ``Library`` lives; the registry
    of names ``torch.library`` keeps can forget it (a second ``Library`` for the same
    kernel, then the first collected). Every such library passes through
    ``torch._C._dispatch_library``, wrapped here; those torch makes for itself, lazily, at
    the first use of a feature (a fresh child makes them alike) are not counted."""
    original = getattr(torch._C, "_dispatch_library", None)
    if original is None:
        return None
    root = os.path.join(os.path.dirname(torch.__file__), "")
    machinery = (os.path.join(root, "library.py"), os.path.join(root, "_library", ""))
    count = [0]

    def dispatch_library(*args: Any, **kwargs: Any) -> Any:
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(machinery):
            frame = frame.f_back  # torch.library's own frames: who called it?
        if frame is None or not frame.f_code.co_filename.startswith(root):
            count[0] += 1
        return original(*args, **kwargs)

    torch._C._dispatch_library = dispatch_library
    return count


def _process_probes() -> list[tuple[str, Callable[[], Any]]]:
    """Per-process settings a call may change and a fresh child would not have."""
    import resource

    limits = [getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")]
    catchable = [number for number in signal.valid_signals()
                 if number not in (signal.SIGKILL, signal.SIGSTOP)]

    def umask() -> int:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask

    def handlers() -> tuple[Any, ...]:
        # signal.getsignal without its wrapper, which makes an enum of each of the 62 numbers
        # (0.15 ms of each settle), and each handler by identity (a number, None or a
        # callable: ``_identity``'s), all in C.
        return tuple(map(id, map(_signal.getsignal, catchable)))

    probes: list[tuple[str, Callable[[], Any]]] = [
        ("signal handlers", handlers),
        ("the signal mask", lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        ("a timer (signal.setitimer, signal.alarm)",
         lambda: [signal.getitimer(which) for which in (
             signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)]),
        ("resource limits", lambda: [resource.getrlimit(limit) for limit in limits]),
        ("umask", umask),
        ("nice", lambda: os.getpriority(os.PRIO_PROCESS, 0)),
        ("the process group and session", lambda: (os.getpgid(0), os.getsid(0))),
        ("user and group ids", lambda: (os.getresuid(), os.getresgid(), os.getgroups())),
        ("sys.getrecursionlimit()", sys.getrecursionlimit),
        ("sys.getswitchinterval()", sys.getswitchinterval),
        ("sys.gettrace()", lambda: _identity(sys.gettrace())),
        ("sys.getprofile()", lambda: _identity(sys.getprofile())),
        ("sys.getdlopenflags()", sys.getdlopenflags),
        ("gc settings", lambda: (gc.isenabled(), gc.get_threshold(), len(gc.callbacks))),
        # The worker's calls share its two stream objects: one closed or reconfigured in
        # place (same object) would fail, or change, what the next call prints.
        ("sys.stdout or sys.stderr closed or reconfigured", lambda: [
            (stream.closed, stream.encoding, stream.errors, stream.line_buffering,
             getattr(stream, "write_through", None)) for stream in (sys.stdout, sys.stderr)]),
    ]
    try:
        import locale

        probes.append(("the locale", lambda: locale.setlocale(locale.LC_ALL)))  # a query
    except ImportError:
        pass
    filters = sys.modules.get("warnings")
    if filters is not None:  # changed in place (simplefilter): the list is the same object
        probes.append(("warnings filters", lambda: list(filters.filters)))
    if hasattr(os, "sched_getaffinity"):
        probes.append(("CPU affinity", lambda: os.sched_getaffinity(0)))
    if hasattr(sys, "get_int_max_str_digits"):
        probes.append(("sys.get_int_max_str_digits()", sys.get_int_max_str_digits))
    if "decimal" in sys.modules:
        decimal = sys.modules["decimal"]
        probes.append(("the decimal context", lambda: repr(decimal.getcontext())))
    return probes

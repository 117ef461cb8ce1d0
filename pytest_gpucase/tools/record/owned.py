"""Which entries of a module's saved state its code owns: those equal to what its
constructor builds, whatever the RNG draws.

A causal mask made in ``__init__`` (``register_buffer("bias", torch.tril(...))``), a constant
table, a positional encoding never trained, a frozen constant init: saved as captured and
loaded over the rebuilt model, such an entry would keep a bug planted in the constructor
forever, and a fix in ``__init__`` could never reach the replay. The Recorder builds the
model again as the replay does (``rebuild``), twice, under two seeds, and marks each saved
entry bit-equal to both builds' value (``torch.equal``, in the saved entry's device and
dtype) as the code's, but a parameter that trains: ``[inputs.gpucase_module] code_owned``,
which the replay takes from the model it builds (``run.replay``). An entry the RNG draws
(initial weights), or that training changed (trained weights, running statistics),
differs, and loads from the saved state as before.

Nothing is marked where the comparison cannot be trusted or afforded: a state above
``OWNED_CHECK_LIMIT``, a constructor that raises, or one that opens a data file while it
runs (a factory that loads weights from a checkpoint: that file may change, where the case's
payload does not). The user's training never runs here; the constructor does, as the
rebuild check already runs it.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.tensors import nbytes
from pytest_gpucase.case.keys import STATE_PREFIX

if TYPE_CHECKING:
    import torch

    from pytest_gpucase.tools.record.rebuild import Rebuild

__all__ = ["OWNED_CHECK_LIMIT", "code_owned"]

# A state above this many bytes is not compared: each build holds another copy of the model.
OWNED_CHECK_LIMIT = 2**30
_SEEDS = (0, 1)
# Files a constructor may open that hold code, not data: imports, extension libraries.
_CODE_SUFFIXES = (".py", ".pyc", ".pyi", ".so", ".pyd", ".dll", ".dylib", ".pth")


def code_owned(module: torch.nn.Module, rebuild: Rebuild,
               state: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The names (without ``state.``) of the ``state.<name>`` tensors of ``module`` equal to
    the value the model ``rebuild`` builds holds, under each of two seeds; () where that
    cannot be told. A parameter that trains (``requires_grad``) is training's, never the
    code's, even while it still holds its initial value (a LayerNorm weight at step 0)."""
    try:
        return _owned(module, rebuild, state)
    except Exception:  # the case is saved whatever happens here, with no entry marked
        return ()


def _owned(module: torch.nn.Module, rebuild: Rebuild,
           state: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    if rebuild.factory is None or sum(nbytes(t) for t in state.values()) > OWNED_CHECK_LIMIT:
        return ()
    trained = {name for name, p in module.named_parameters(remove_duplicate=False)
               if p.requires_grad}
    candidates = {name.removeprefix(STATE_PREFIX): tensor for name, tensor in state.items()
                  if name.startswith(STATE_PREFIX) and _plain(tensor)
                  and name.removeprefix(STATE_PREFIX) not in trained}
    build = _build_of(rebuild)
    for seed in _SEEDS:
        if not candidates:
            break
        fresh = _fresh_state(build, seed)
        if fresh is None:
            return ()
        candidates = {k: t for k, t in candidates.items() if _equal(t, fresh.get(k))}
        del fresh
    return tuple(sorted(candidates))


def _build_of(rebuild: Rebuild) -> Callable[[], Any]:
    """The function that builds the model as the replay will (as ``needs_secrets`` does)."""
    from pytest_gpucase.tools.record.rebuild import _builder

    if rebuild.recipe is not None:
        return _builder(str(rebuild.recipe["class"]), rebuild.script,
                        dict(rebuild.recipe.get("kwargs", {})), rebuild.config)
    return _builder(str(rebuild.factory), None, dict(rebuild.kwargs), None)


def _plain(tensor: Any) -> bool:
    import torch

    return (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided
            and not tensor.is_quantized and not tensor.is_meta)


def _equal(saved: torch.Tensor, fresh: Any) -> bool:
    """Whether the constructor's ``fresh`` value is bit-equal to the ``saved`` entry, in its
    device and dtype (the model may have been cast after construction: ``model.half()``)."""
    import torch

    if not _plain(fresh) or tuple(fresh.shape) != tuple(saved.shape):
        return False
    kinds = {(t.dtype == torch.bool, t.is_complex(), t.is_floating_point()) for t in (saved, fresh)}
    if len(kinds) != 1:
        return False
    return bool(torch.equal(fresh.detach().to(device=saved.device, dtype=saved.dtype), saved))


def _fresh_state(build: Callable[[], Any], seed: int) -> dict[str, Any] | None:
    """The state dict of the model ``build`` makes under ``seed``, every RNG left as it was;
    None when it raises or opens a data file."""
    import torch

    from pytest_gpucase.run.replay import rng_kept

    with _python_rng_kept(), rng_kept(), _data_files() as opened, \
            contextlib.redirect_stdout(sys.stderr):
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.manual_seed_all(seed)
        try:
            module = build()
            state = dict(module.state_dict())
        except Exception:
            return None
    return None if opened else state


@contextlib.contextmanager
def _python_rng_kept() -> Iterator[None]:
    """Python's and (when imported) numpy's global RNG states as they were."""
    kept = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(kept)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


# The data files this thread opened while a build runs (``_data_files``); None otherwise.
_opened: list[str] | None = None
_thread: int | None = None
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is None or event != "open" or threading.get_ident() != _thread or not args:
        return
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return  # a descriptor already open
    name = os.fsdecode(path)
    if not name.endswith(_CODE_SUFFIXES) and not name.startswith(("/proc/", "/sys/", "/dev/")):
        _opened.append(name)


@contextlib.contextmanager
def _data_files() -> Iterator[list[str]]:
    """The list of data files this thread opens meanwhile (an audit hook, added once to the
    process: audit hooks cannot be removed, so it does nothing outside this block)."""
    global _opened, _thread, _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    opened: list[str] = []
    _opened, _thread = opened, threading.get_ident()
    try:
        yield opened
    finally:
        _opened, _thread = None, None

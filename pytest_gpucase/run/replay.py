"""The child's side of module and op cases: the generated calls a recorded case names.

``call = "pytest_gpucase.capture:replay_module"`` (and ``replay_op``, ``replay_function``)
in a saved ``case.toml`` resolve here through the ``pytest_gpucase.capture`` facade, as does
``build_model``, which the ``case.py`` the Recorder writes beside a model it cannot name by
an import (a Hugging Face model and its config, a LightningModule and its hyperparameters, a
class defined in the script that was run) calls to build it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.files import file_sha256
from pytest_gpucase.base.tensors import named_tensors, tensors_in
from pytest_gpucase.case.keys import (
    CODE_OWNED,
    GRAD_PREFIX,
    LOSS_PREFIX,
    NESTED_PREFIX,
    STATE_PREFIX,
)
from pytest_gpucase.run.outcome import CaseSetupError, StaleCaseError, describe_exception

if TYPE_CHECKING:
    import torch

__all__ = ["CONFIG_KEY", "CONFIG_KINDS", "DATACLASS_KEY", "build_model", "constructed",
           "decode_configs", "decode_nested", "find_class", "import_target", "load_checkpoint",
           "load_script", "replay_function", "replay_module", "replay_op", "require_finite",
           "retie", "rng_kept", "script_definitions", "with_aliases"]


def import_target(target: str) -> Any:
    """The object ``"package.module:Qual.name"`` names, imported."""
    import importlib

    where, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(where)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def require_finite(what: str, value: Any) -> None:
    """Raise FloatingPointError naming each floating tensor in ``value`` that holds NaN or
    inf: how a case captured from a non-finite value fails again, and passes once fixed."""
    import torch

    problems = []
    for name, tensor in named_tensors(value, "out"):
        if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta:
            continue
        nan, inf = (int(n) for n in torch.stack((tensor.isnan().sum(),
                                                 tensor.isinf().sum())).tolist())
        if nan or inf:
            kinds = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "inf")) if n)
            problems.append(f"{name} holds {kinds}")
    if problems:
        raise FloatingPointError(f"non-finite {what}: {'; '.join(problems)}")


def retie(module: torch.nn.Module, tied: Mapping[str, str]) -> None:
    """Make each ``alias`` parameter the very Parameter at ``source`` again (an embedding and
    an LM head sharing one weight), as the model had them: a state dict holds them apart."""
    for alias, source in tied.items():
        owner_name, _, attr = alias.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        target_name, _, target_attr = source.rpartition(".")
        target = module.get_submodule(target_name) if target_name else module
        setattr(owner, attr, getattr(target, target_attr))


def _loss_of(out: Any) -> torch.Tensor | None:
    """The loss a training step returns: the tensor itself, ``out["loss"]`` or ``out.loss``."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _backward(out: Any, recipe: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Run the captured backward pass from ``out``: from the loss when the case recomputes
    it (``loss = "output"``), else from the saved ``grad_output`` tensors."""
    how = recipe.get("loss")
    if how == "output" or isinstance(how, Mapping):
        _backward_from_loss(out, recipe, inputs, how)
        return
    _backward_from_grad_outputs(out, recipe, inputs)


def _backward_from_loss(out: Any, recipe: Mapping[str, Any], inputs: Mapping[str, Any],
                        how: Any) -> None:
    """Backward from the loss: the call's own, or the watched loss function's on it."""
    if isinstance(how, Mapping):  # the watched loss function, called on the output again
        function = import_target(str(how["call"]))
        given = {k.removeprefix(LOSS_PREFIX): v for k, v in inputs.items()
                 if k.startswith(LOSS_PREFIX)}
        given.update(dict(how.get("inputs", {})))
        given[str(how["output"])] = list(tensors_in(out))[int(how.get("index", 0))]
        out = function(**given)
        if recipe.get("finite"):
            require_finite("loss", out)
    loss = (_loss_of(out) if "loss_index" not in recipe or isinstance(how, Mapping)
            else list(tensors_in(out))[int(recipe["loss_index"])])
    if loss is None:
        raise TypeError("the case replays backward from the loss its call returns, but "
                        f"the call returned {type(out).__name__} without one")
    loss.backward()  # type: ignore[no-untyped-call]


def _backward_from_grad_outputs(out: Any, recipe: Mapping[str, Any],
                                inputs: Mapping[str, Any]) -> None:
    """Backward from the saved ``grad_output`` tensors, else from the sum of the outputs."""
    import torch

    outs = [t for t in tensors_in(out) if t.requires_grad]
    saved = recipe.get("grad_outputs", [])
    if isinstance(saved, Mapping):  # output index -> payload name
        pairs = [(outs[int(i)], inputs[name]) for i, name in saved.items() if int(i) < len(outs)]
        if pairs and len(pairs) == len(saved):
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
            return
    else:  # cases written before the index was kept: one gradient per output
        grads = [inputs[name] for name in saved]
        if grads and len(grads) == len(outs):
            torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs,
                                                                          strict=True)])
            return
    torch.autograd.backward(sum((t.float().sum() for t in outs), torch.zeros(())))


def replay_module(*, gpucase_module: Mapping[str, Any], **inputs: Any) -> Any:
    """Rebuild a captured module, load its saved state and call it on the saved inputs.

    The generated ``call`` of a module case. ``gpucase_module`` is the ``[inputs]`` table
    capture writes: ``factory`` ("pkg.mod:make" or a torch.nn class; "case.py:make_model",
    which the child imports from the case directory) and its ``kwargs``, ``training`` (the
    train/eval mode), ``method`` (a method called instead of forward: a LightningModule's
    ``training_step``), ``tied`` (alias = source: parameters shared in the model),
    ``backward`` (the failure was in backward: run it, from the loss the call returns when
    ``loss = "output"``, its ``loss_index``-th output tensor when given; from the loss
    function ``loss = {call, output, index, inputs}`` names, called on output ``index`` as
    argument ``output`` with the ``loss.<name>`` tensors; else from the saved
    ``grad_output.<i>`` tensors), ``nested`` (arguments of lists, tuples and dicts of
    tensors), ``finite``
    (the failure was a non-finite value: outputs and gradients must be finite) and
    ``manual_optimization`` (a LightningModule's ``training_step`` that steps its own
    optimizers: what it asks of its Trainer is given without one, ``_without_trainer``).
    ``state.<name>`` tensors are the state dict.
    """
    import torch

    recipe = dict(gpucase_module)
    factory = recipe["factory"]
    # A "FILE.py:make" factory arrives already imported from the case directory (execute).
    try:
        make = factory if callable(factory) else import_target(str(factory))
    except Exception as exc:
        raise CaseSetupError(f"importing the model's factory {factory} failed "
                             f"({describe_exception(exc)}); the case's call never ran"
                             ) from exc
    state = {k.removeprefix(STATE_PREFIX): v for k, v in inputs.items()
             if k.startswith(STATE_PREFIX)}
    args = _arguments(recipe, inputs, (STATE_PREFIX, GRAD_PREFIX, LOSS_PREFIX))
    module = _rebuilt(make, recipe, state)
    device = next((t.device for t in tensors_in(list(inputs.values()))), None)
    if device is not None:
        module.to(device)  # non-persistent buffers, made by the constructor on the host
    module.train(bool(recipe.get("training", False)))
    if recipe.get("manual_optimization"):
        _without_trainer(module)
    call = getattr(module, str(recipe["method"])) if recipe.get("method") else module
    finite = bool(recipe.get("finite"))
    with warnings.catch_warnings():
        # A LightningModule's self.log() without a Trainer says so and does nothing.
        warnings.filterwarnings("ignore", message=r"You are trying to `self\.log\(\)`")
        if not recipe.get("backward"):
            out = call(**args)
            if finite:
                require_finite("output", out)
            return out
        with torch.enable_grad():
            out = call(**args)
            if finite:
                require_finite("output", out)
            _backward(out, recipe, inputs)
    grads = {name: p.grad for name, p in module.named_parameters()}
    if finite:
        require_finite("gradient", grads)
    return {"out": out, "grad": grads}


def _optimizers_of(made: Any) -> tuple[list[Any], list[Any]]:
    """The optimizers and schedulers a LightningModule's ``configure_optimizers()`` returns,
    in any of the shapes Lightning takes: one optimizer, a list of them, ``(optimizers,
    schedulers)``, a dict ``{"optimizer", "lr_scheduler"}`` (the scheduler itself or a dict
    holding it under ``scheduler``), or a list of such dicts."""
    if made is None:
        return [], []
    if isinstance(made, Mapping):
        scheduler = made.get("lr_scheduler")
        if isinstance(scheduler, Mapping):
            scheduler = scheduler.get("scheduler")
        return [made["optimizer"]], [] if scheduler is None else [scheduler]
    if (isinstance(made, tuple | list) and len(made) == 2
            and all(isinstance(part, list | tuple) for part in made)):
        return list(made[0]), [s.get("scheduler") if isinstance(s, Mapping) else s
                               for s in made[1]]
    if isinstance(made, list | tuple):
        optimizers: list[Any] = []
        schedulers: list[Any] = []
        for item in made:
            found = _optimizers_of(item)
            optimizers += found[0]
            schedulers += found[1]
        return optimizers, schedulers
    return [made], []


def _without_trainer(module: torch.nn.Module) -> None:
    """What a LightningModule's manual optimization (``automatic_optimization = False``)
    asks of its Trainer in ``training_step``, given without one: ``self.optimizers()`` and
    ``self.lr_schedulers()`` from its own ``configure_optimizers()``, ``manual_backward``
    as ``loss.backward()``, ``toggle_optimizer``/``untoggle_optimizer`` as nothing to do
    (one module, all parameters trainable), ``clip_gradients`` as torch's clipping."""
    import torch

    optimizers, schedulers = _optimizers_of(module.configure_optimizers())  # type: ignore[operator]

    def one_or_all(found: list[Any]) -> Any:
        return found[0] if len(found) == 1 else (found or None)

    def clip(optimizer: Any, gradient_clip_val: float | None = None,
             gradient_clip_algorithm: str | None = None) -> None:
        if not gradient_clip_val:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if str(gradient_clip_algorithm or "norm") == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    stand_ins: dict[str, Any] = {
        "optimizers": lambda use_pl_optimizer=True: one_or_all(optimizers),
        "lr_schedulers": lambda: one_or_all(schedulers),
        "manual_backward": lambda loss, *args, **kwargs: loss.backward(*args, **kwargs),
        "toggle_optimizer": lambda optimizer, *args: None,
        "untoggle_optimizer": lambda optimizer, *args: None,
        "clip_gradients": clip,
    }
    for name, stand_in in stand_ins.items():
        object.__setattr__(module, name, stand_in)


def _rebuilt(make: Any, recipe: Mapping[str, Any],
             state: dict[str, Any]) -> torch.nn.Module:
    """The module ``make`` builds, holding ``state``: its saved tensors become its parameters
    and persistent buffers (``assign``: in the device and dtype of the run, no copy).

    While the constructor runs, each parameter it registers is moved to the meta device
    (``torch.empty`` touches no memory, and the initialization then runs on meta), so that
    the weights the saved state replaces are never written: a replay holds the state once,
    not twice. Non-persistent buffers (position ids, rotary frequencies, lookup tables) are
    built as the constructor builds them, from the code as it is now, so a fix to how they
    are computed shows; so are the entries ``code_owned`` names (a causal mask, a constant
    table the Recorder found equal to the constructor's own value). A module that keeps a
    parameter the state lacks, or whose constructor cannot run so, is built again the
    ordinary way. Saved state that no longer fits the model raises ``StaleCaseError``
    (``_fitted``); a model that cannot be built, ``CaseSetupError``.
    """
    kwargs = dict(recipe.get("kwargs", {}))
    tied = with_aliases(recipe, state)
    owned = frozenset(str(k) for k in recipe.get(CODE_OWNED, ()))
    if not state:
        return _built(make, kwargs)
    module: torch.nn.Module | None = None
    with contextlib.suppress(Exception):  # else the ordinary way
        module = constructed(make, recipe, on_meta=True)
    if module is not None and not _owned_on_meta(module, owned):
        try:
            _load(module, state, owned, tied)
            if not any(_on_meta(m) for m in module.modules()):
                return module
        except StaleCaseError:
            raise  # the ordinary way builds the same state dict
        except CaseSetupError:
            pass  # a load the meta tensors stopped: built again the ordinary way below
    module = _built(make, kwargs)
    _load(module, state, owned, tied)
    return module


def _built(make: Any, kwargs: Mapping[str, Any]) -> torch.nn.Module:
    """``make(**kwargs)``, the RNG states as they were (the replay restored the captured
    ones for the call, which the initialization must not draw from); CaseSetupError when
    it raises."""
    try:
        with rng_kept():
            return make(**kwargs)  # type: ignore[no-any-return]
    except Exception as exc:
        raise CaseSetupError(f"building the model to replay failed ({describe_exception(exc)})"
                             "; the case's call never ran") from exc


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """torch's RNG states (the host's, and each CUDA device's once CUDA is initialized) as
    they were, whatever a constructor run meanwhile draws or seeds."""
    import torch

    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))
                               if initialized else []):
        yield


def _owned_on_meta(module: torch.nn.Module, owned: frozenset[str]) -> bool:
    """Whether an entry the code owns is a parameter left on meta: its value must come from
    a module built the ordinary way."""
    if not owned:
        return False
    return any(getattr(value, "is_meta", False) for key, value in
               module.state_dict(keep_vars=True).items() if key in owned)


def _load(module: torch.nn.Module, state: Mapping[str, Any], owned: frozenset[str],
          tied: Mapping[str, str]) -> None:
    """Load ``state`` into ``module`` (``_fitted``) and tie its parameters again."""
    fitted = _fitted(module, state, owned)
    try:
        module.load_state_dict(fitted, strict=True, assign=True)
        retie(module, tied)
    except Exception as exc:
        raise CaseSetupError(
            f"loading the case's saved state into {type(module).__qualname__} failed "
            f"({describe_exception(exc)}); if the model's code changed since the case was "
            f"recorded, {_RERECORD}") from exc


_RERECORD = ("record the case again (run the training with the Recorder), or bring the "
             "model's code back to what it was")


def _fitted(module: torch.nn.Module, state: Mapping[str, Any],
            owned: frozenset[str]) -> dict[str, Any]:
    """The state to load into ``module``: the saved entries, those the code owns taken from
    ``module`` as its constructor built them (in the saved entry's device, and dtype where
    both hold one kind of values), and those the code owned but the model saves no more dropped.
    StaleCaseError, naming the keys, when the rest does not fit the model."""
    theirs: dict[str, Any] = module.state_dict(keep_vars=True)
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    fitted: dict[str, Any] = {}
    for key, value in theirs.items():
        saved = state.get(key)
        if key in owned and not getattr(value, "is_meta", True):
            fitted[key] = _like(value.detach(), saved)
        elif saved is not None and key not in parameters and getattr(saved, "requires_grad",
                                                                     False):
            # a buffer is no parameter: with [expect] gradients = true every float input
            # requires grad, and a batch norm refuses a running_mean that does
            fitted[key] = saved.detach()
        elif saved is not None:
            fitted[key] = saved
    problems = _misfits(module, theirs, state, owned)
    if problems:
        raise StaleCaseError(
            f"stale case: the state it saved no longer fits the {type(module).__qualname__} "
            f"its code builds now: {'; '.join(problems)}. The case was recorded from other "
            f"code, so it cannot replay the captured failure: {_RERECORD}")
    return fitted


def _like(fresh: torch.Tensor, saved: Any) -> torch.Tensor:
    """The constructor's value ``fresh`` where the saved entry was: its device, and its dtype
    where both hold one kind of values (the run casts the saved state to its dtype)."""
    if saved is None or not hasattr(saved, "device"):
        return fresh
    same_kind = _kind(fresh) == _kind(saved)
    return fresh.to(device=saved.device, dtype=saved.dtype if same_kind else fresh.dtype)


def _kind(tensor: Any) -> str:
    """What kind of values a tensor holds: the run may change its dtype, never its kind."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__qualname__
    if tensor.dtype == torch.bool:
        return "bool"
    if tensor.is_quantized:
        return "quantized"
    if tensor.is_complex():
        return "complex"
    return "floating" if tensor.is_floating_point() else "integer"


def _listed(keys: list[str]) -> str:
    more = len(keys) - 5
    return ", ".join(keys[:5]) + (f" and {more} more" if more > 0 else "")


def _misfits(module: torch.nn.Module, theirs: Mapping[str, Any], state: Mapping[str, Any],
             owned: frozenset[str]) -> list[str]:
    """How the saved ``state`` misfits the model's state dict ``theirs``, in words."""
    buffers = {name for name, _ in module.named_buffers()}
    extra = [k for k in state if k not in theirs]
    # An entry the code owned and the model saves no more is simply not loaded; named only
    # beside another misfit (a layer renamed: its mask gone with its weights).
    dropped = [k for k in extra if k in buffers and k not in owned]
    unknown = [k for k in extra if k not in buffers]
    missing = [k for k in theirs if k not in state
               and (k not in owned or getattr(theirs[k], "is_meta", True))]
    problems = []
    if unknown and (missing or any(k not in owned for k in unknown)):
        problems.append(f"the model has no {_listed(unknown)}, which the case holds "
                        "(a layer renamed or removed?)")
    if dropped:
        are = "is a buffer" if len(dropped) == 1 else "are buffers"
        problems.append(f"{_listed(dropped)} {are} the model no longer saves "
                        "(persistent=False), which the case holds as recorded")
    if missing:
        problems.append(f"the case holds no {_listed(missing)}, which the model has")
    return problems + _changed(theirs, state, owned)


def _changed(theirs: Mapping[str, Any], state: Mapping[str, Any],
             owned: frozenset[str]) -> list[str]:
    """The saved entries whose shape, or kind of values, the model's no longer has."""
    problems = []
    for key, value in theirs.items():
        saved = state.get(key)
        if saved is None or key in owned or not hasattr(saved, "shape"):
            continue
        if hasattr(value, "shape") and tuple(saved.shape) != tuple(value.shape):
            problems.append(f"{key} is {list(saved.shape)} in the case, {list(value.shape)} "
                            "in the model")
        elif _kind(saved) != _kind(value):
            problems.append(f"{key} holds {_kind(saved)} values ({saved.dtype}) in the case, "
                            f"{_kind(value)} ones in the model")
    return problems


def with_aliases(recipe: Mapping[str, Any], state: dict[str, Any]) -> dict[str, str]:
    """The recipe's tied parameters (alias -> source); each alias added to ``state`` with its
    source's value, as the module's own state dict holds it."""
    tied = {str(k): str(v) for k, v in dict(recipe.get("tied", {})).items()}
    for alias, source in tied.items():
        if source in state:
            state.setdefault(alias, state[source])
    return tied


def constructed(make: Any, recipe: Mapping[str, Any], *, on_meta: bool) -> torch.nn.Module:
    """The module ``make`` builds from the recipe's ``kwargs``, before any state is loaded:
    with ``on_meta``, each parameter on the meta device, as a replay first builds it (see
    ``_rebuilt``); ``gpucase validate`` checks that module against the saved state."""
    kwargs = dict(recipe.get("kwargs", {}))
    if not on_meta:
        return make(**kwargs)  # type: ignore[no-any-return]
    with _parameters_on_meta():
        return make(**kwargs)  # type: ignore[no-any-return]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered meanwhile go to the meta device (as Accelerate's
    ``init_empty_weights(include_buffers=False)`` does); buffers stay where they are made."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and not held.is_meta:
            module._parameters[name] = torch.nn.Parameter(
                held.to("meta"), requires_grad=held.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _on_meta(module: torch.nn.Module) -> bool:
    """Whether a module still holds a tensor on the meta device: a parameter the state did
    not fill, or a buffer or tensor attribute its constructor made from one."""
    import torch

    values = [*module._parameters.values(), *module._buffers.values(),
              *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in values)


def replay_function(*, gpucase_function: Mapping[str, Any], **inputs: Any) -> Any:
    """Call the function ``target`` names on the saved inputs (the ``nested`` ones rebuilt);
    with ``finite``, its outputs must be finite (a case captured from the first non-finite
    value a function returned)."""
    target = gpucase_function["target"]
    try:
        func = target if callable(target) else import_target(str(target))
    except Exception as exc:
        raise CaseSetupError(f"importing {target} failed ({describe_exception(exc)}); the "
                             "case's call never ran") from exc
    out = func(**_arguments(gpucase_function, inputs, ()))
    if gpucase_function.get("finite"):
        require_finite("output", out)
    return out


def decode_nested(spec: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """An argument that nested tensors in lists, tuples and dicts, rebuilt from the table the
    Recorder wrote (``record.inputs.encode_nested``) and the tensors it names."""
    if "tuple" in spec:
        return tuple(decode_nested(item, tensors) for item in spec["tuple"])
    if "dict" in spec:
        return {str(k): decode_nested(v, tensors) for k, v in spec["dict"].items()}
    return _decode_arg(spec, tensors)


def _arguments(table: Mapping[str, Any], inputs: Mapping[str, Any],
               skip: tuple[str, ...]) -> dict[str, Any]:
    """The call's keyword arguments: the inputs but those under ``skip`` prefixes and the
    nested tensors, with the nested arguments the table describes rebuilt."""
    args = {k: v for k, v in inputs.items() if not k.startswith((*skip, NESTED_PREFIX))}
    for name, spec in dict(table.get("nested", {})).items():
        args[str(name)] = decode_nested(spec, inputs)
    return args


def _decode_arg(spec: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    import torch

    if "tensor" in spec:
        return tensors[spec["tensor"]]
    if "none" in spec:
        return None
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "list" in spec:
        return [decode_nested(item, tensors) for item in spec["list"]]
    return spec["value"]


def replay_op(*, gpucase_op: Mapping[str, Any], **tensors: Any) -> Any:
    """Call one ATen op (``op = "aten.embedding.default"``) on its saved arguments.

    The generated ``call`` of an op case: ``args`` and ``kwargs`` describe each argument,
    ``{tensor = "arg0"}`` naming a saved tensor.
    """
    import torch

    namespace, name, overload = str(gpucase_op["op"]).split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    args = [_decode_arg(a, tensors) for a in gpucase_op.get("args", [])]
    kwargs = {k: _decode_arg(v, tensors) for k, v in gpucase_op.get("kwargs", {}).items()}
    return op(*args, **kwargs)


# Statements of a script kept when its definitions are loaded without running it.
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef,
                ast.AsyncFunctionDef)


def _call_free(node: ast.AST) -> bool:
    """No call outside a lambda's body: evaluating it runs no one's code."""
    if isinstance(node, ast.Lambda):
        return True
    if isinstance(node, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)):
        return False
    return all(_call_free(child) for child in ast.iter_child_nodes(node))


def _kept(node: ast.stmt) -> bool:
    if isinstance(node, _DEFINITIONS):
        return True
    if isinstance(node, ast.Assign | ast.AnnAssign):
        return node.value is not None and _call_free(node.value)
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, ast.Try):  # try: import fast except ImportError: import slow
        return all(_kept(n) or isinstance(n, ast.Pass) for n in
                   [*node.body, *(n for h in node.handlers for n in h.body), *node.orelse,
                    *node.finalbody])
    return False


def script_definitions(source: str) -> str:
    """The definitions of a script (imports, classes, functions, call-free assignments, and
    the assignments with calls those need: ``VOCAB = len(CHARS)`` read by a class), without
    what it runs: its training loop, under ``if __name__ == "__main__":`` or not."""
    tree = ast.parse(source)
    kept = [_kept(node) for node in tree.body]
    changed = True
    while changed:  # a needed assignment may need another, defined above it
        changed = False
        needed = set().union(
            *(_free_names(node) for node, k in zip(tree.body, kept, strict=True) if k))
        for i, node in enumerate(tree.body):
            if (not kept[i] and isinstance(node, ast.Assign | ast.AnnAssign)
                    and node.value is not None and _assigned(node) & needed):
                kept[i] = changed = True
    tree.body = [node for node, k in zip(tree.body, kept, strict=True) if k]
    return ast.unparse(tree)


def _assigned(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _free_names(node: ast.AST) -> set[str]:
    """The names ``node`` reads from the module (approximately: in a function, those it
    reads that are neither its parameters nor assigned in it)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        args = node.args
        local = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                 *([args.vararg] if args.vararg else []),
                                 *([args.kwarg] if args.kwarg else [])]}
        inner: set[str] = set()
        body = node.body if isinstance(node.body, list) else [node.body]
        for stmt in body:
            local |= {n.id for n in ast.walk(stmt)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            inner |= _free_names(stmt)
        outer = {name for default in [*args.defaults, *args.kw_defaults] if default
                 for name in _free_names(default)}
        decorators = {name for d in getattr(node, "decorator_list", ())
                      for name in _free_names(d)}
        return (inner - local) | outer | decorators
    names = {node.id} if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) else set()
    for child in ast.iter_child_nodes(node):
        names |= _free_names(child)
    return names


def load_script(path: Path) -> ModuleType:
    """The definitions of the script at ``path`` as a module of their own (see
    ``script_definitions``): how a replay finds a model class defined in ``__main__``."""
    path = Path(path).resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    name = f"gpucase_script_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{digest}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    source = script_definitions(path.read_text(encoding="utf-8"))
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses and pickle look their module up there
    # The script's own folder first, as when it was run: its sibling modules import.
    added = str(path.parent) not in sys.path
    if added:
        sys.path.insert(0, str(path.parent))
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def build_model(recipe_file: Path) -> torch.nn.Module:
    """Build the model a ``model.json`` describes (the Recorder writes it, with the
    ``case.py`` that calls this): ``class`` ("pkg.mod:Qual", or "Qual" of ``script``, a path
    relative to that file), then either ``config`` (a Hugging Face config file, read with
    the class's ``config_class``) or ``kwargs`` (the constructor's keyword arguments, config
    objects among them as ``decode_configs`` reads them)."""
    recipe_file = Path(recipe_file)
    recipe = json.loads(recipe_file.read_text(encoding="utf-8"))
    target = str(recipe["class"])
    script = (load_script(recipe_file.parent / str(recipe["script"]))
              if recipe.get("script") else None)
    cls = find_class(target, script)
    if recipe.get("config"):
        config = cls.config_class.from_json_file(str(recipe_file.parent / recipe["config"]))
        attention = recipe.get("attn_implementation")
        if attention:
            config._attn_implementation = attention
        return cls(config)  # type: ignore[no-any-return]
    kwargs = decode_configs(dict(recipe.get("kwargs", {})), script)
    return cls(**kwargs)  # type: ignore[no-any-return]


# A constructor argument that is a config object (a dataclass, a namespace, a named tuple, a
# pydantic model, a Hugging Face ``PretrainedConfig``), as ``model.json`` holds it:
# ``{CONFIG_KEY: kind, "class": "pkg.mod:Config" or "Config" of the script, "fields": {...}}``
# (``tools.record.configs`` reads one; ``CONFIG_KINDS`` builds it again). Cases written before
# hold a dataclass as ``{DATACLASS_KEY: "pkg.mod:Config", "fields": {...}}``.
CONFIG_KEY = "gpucase_config"
DATACLASS_KEY = "gpucase_dataclass"


def _from_fields(cls: Any, fields: dict[str, Any]) -> Any:
    return cls(**fields)


def _pydantic(cls: Any, fields: dict[str, Any]) -> Any:
    validate = getattr(cls, "model_validate", None) or getattr(cls, "parse_obj", None)
    return validate(fields) if callable(validate) else cls(**fields)


def _hf_config(cls: Any, fields: dict[str, Any]) -> Any:
    return cls.from_dict(fields)


def _enum_member(cls: Any, fields: dict[str, Any]) -> Any:
    return cls[fields["name"]]


def _dtype(cls: Any, fields: dict[str, Any]) -> Any:
    import torch

    found = getattr(torch, str(fields["name"]), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"model.json: torch has no dtype {fields['name']!r}")
    return found


# kind -> how the object is built again from its class and its fields (nested ones first),
# and, in words, for the case.py a rebuild writes.
CONFIG_KINDS: dict[str, tuple[Any, str]] = {
    "dataclass": (_from_fields, "Class(**fields)"),
    "namespace": (_from_fields, "Class(**fields)"),
    "namedtuple": (_from_fields, "Class(**fields)"),
    "pydantic": (_pydantic, "Class.model_validate(fields)"),
    "hf_config": (_hf_config, "Class.from_dict(fields)"),
    "enum": (_enum_member, "Class[name]"),
    "dtype": (_dtype, "torch.<name>"),
}


def find_class(target: str, script: ModuleType | None) -> Any:
    """The class ``target`` names: "pkg.mod:Qual", or "Qual" of the ``script`` module."""
    if script is None or ":" in target:
        return import_target(target)
    obj: Any = script
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def decode_configs(value: Any, script: ModuleType | None = None) -> Any:
    """``value`` with each config object ``model.json`` describes (``CONFIG_KEY``, or a
    dataclass of an older case under ``DATACLASS_KEY``) built again from its fields, nested
    ones first."""
    if isinstance(value, list):
        return [decode_configs(v, script) for v in value]
    if not isinstance(value, Mapping):
        return value
    if CONFIG_KEY in value:
        kind = str(value[CONFIG_KEY])
        if kind not in CONFIG_KINDS:
            raise ValueError(f"model.json: {CONFIG_KEY} = {kind!r} is not a kind this version "
                             f"builds ({', '.join(CONFIG_KINDS)}): record the case again")
        cls = find_class(str(value["class"]), script)
        return CONFIG_KINDS[kind][0](cls, decode_configs(dict(value.get("fields", {})),
                                                          script))
    if DATACLASS_KEY in value:
        cls = find_class(str(value[DATACLASS_KEY]), script)
        return cls(**decode_configs(dict(value.get("fields", {})), script))
    return {k: decode_configs(v, script) for k, v in value.items()}


def load_checkpoint(path: Path, sha256: str | None, prefix: str = "",
                    ) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint a model case references (``[inputs.gpucase_module]
    checkpoint``), under ``state.<name>``, after its hash is checked: a safetensors file
    read lazily, else a ``torch.save`` file read with ``weights_only=True`` and ``mmap``.
    ``prefix`` keeps the tensors below it (a submodule's), named without it; a ``sha256`` of
    None skips the check (the Recorder comparing the file with the model it holds)."""
    import torch

    found = file_sha256(path) if sha256 is not None else None
    if found != sha256:
        raise ValueError(f"checkpoint {path}: sha256 {found} differs from the {sha256} the "
                         "case recorded: the file changed since the failure was captured")
    tensors: dict[str, torch.Tensor] = {}
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith(prefix):
                    tensors[key[len(prefix):]] = handle.get_tensor(key)
    else:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
            loaded = loaded["state_dict"]  # a Lightning checkpoint
        for key, value in dict(loaded).items():
            if isinstance(value, torch.Tensor) and str(key).startswith(prefix):
                tensors[str(key)[len(prefix):]] = value
    return {f"{STATE_PREFIX}{k}": v for k, v in tensors.items()}



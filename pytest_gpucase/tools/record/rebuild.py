"""How a replay rebuilds a watched module, and the proof that the rebuild is the model.

In order: a factory the user names; a Hugging Face ``PreTrainedModel`` (its config saved as
the config's own JSON, ``config.json``, and rebuilt with its class); a LightningModule whose
``save_hyperparameters()`` kept its constructor's arguments; otherwise the class called
with the constructor arguments read back from its same-named attributes (what torch.nn
built-ins keep), a config object among them kept as its kind, class and fields
(``configs``: nanoGPT's ``GPT(GPTConfig(...))``). A class defined in the script that was
run (``__main__``) is found again in that script, whose definitions a replay loads without
running it (``load_script``): the replay sees the script as it is then, so a fix to the
class shows as XPASS, where a copy kept with the case would fail forever.

Every rebuild is checked when it is chosen: the model is built again on the ``meta`` device
(no memory, no time, the RNG untouched) and must print as the watched one does and hold the
same state names and shapes. A dropout of 0.2 the rebuild would make 0.1, a head replaced
after construction, a hyperparameter not saved: each makes the rebuild unfaithful, and the
case says so with the difference, instead of replaying another model.

Which parameters are tied (an embedding and an LM head sharing one weight) is kept beside
the state, which holds them once; the replay ties them again.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import os
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.tensors import is_tensor
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import STATE_PREFIX
from pytest_gpucase.tools.record.configs import FIX, Plain, class_target, config_kind, \
    holds_config, plain
from pytest_gpucase.tools.record.inputs import NOT_LITERAL, as_literal, storable
from pytest_gpucase.tools.record.origin import error_line

if TYPE_CHECKING:
    import torch

__all__ = ["CASE_BUILDER", "PASS_FACTORY", "Rebuild", "State", "case_relative",
           "in_framework_words", "lightning_module",
           "module_state", "needs_secrets",
           "on_host", "rebuild_files", "rebuild_of", "script_function_files"]

# How a user names the function that builds the model; for a model trained by a framework's
# Trainer, whose callback watches it, ``in_framework_words`` adds the callback's form.
PASS_FACTORY = "rec.watch(model, factory=..., kwargs=...)"
_CALLBACK_FACTORY = "or with the Trainer GpuCaseCallback(factory=..., kwargs=...)"

# The factory of a model a case.py builds (model.json describes it).
CASE_BUILDER = "case.py:make_model"
_MODEL_FILE = "model.json"
_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Rebuild:
    """How a replay rebuilds a module: an importable factory and its literal arguments, or a
    ``model.json`` recipe that the case's ``case.py`` builds; ``why_not`` when it cannot."""

    factory: str | None
    kwargs: Mapping[str, Any]
    why_not: str = ""
    recipe: Mapping[str, Any] | None = None   # model.json, when a case.py builds the model
    script: str | None = None                  # the __main__ script the class is defined in
    config: str | None = None                  # a Hugging Face config, as its own JSON
    how: str = ""                              # how it is rebuilt, in words
    notes: tuple[str, ...] = field(default=())  # said once: what could not be checked


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host: itself, detached, when it is there already."""
    return tensor.detach() if tensor.device.type == "cpu" else payload.to_device(tensor, "cpu")


@dataclass(frozen=True)
class State:
    """A module's tensors as a case holds them."""

    tensors: dict[str, torch.Tensor]  # state.<name>: parameters and buffers, each once
    tied: dict[str, str]               # alias -> the name its Parameter is stored under
    # name -> what it is, for each state entry a case cannot hold exactly (not saved)
    unsaved: dict[str, str] = field(default_factory=dict)

    def why_incomplete(self, module_name: str, part_of: str | None = None) -> str | None:
        """The reason a case of a module with this state is incomplete, or None.
        ``part_of``: the module is a submodule of the model whose case is ``part_of`` (no
        factory builds a submodule: the model's case holds the failure)."""
        if not self.unsaved:
            return None
        named = "; ".join(f"{name} ({what})" for name, what in sorted(self.unsaved.items())[:8])
        more = len(self.unsaved) - 8
        named += f"; and {more} more" if more > 0 else ""
        fix = (f"or nothing to do: {part_of}, the model's case, holds the failure"
               if part_of is not None else f"or rebuild them in a factory ({PASS_FACTORY})")
        return (f"the state of {module_name} holds what a case cannot hold exactly, so it "
                f"was not saved: {named}; a replay would rebuild these with the "
                "constructor's values, not the trained ones: save the module so that these "
                f"are plain, complex, sparse or quantized tensors, {fix}")


def module_state(module: torch.nn.Module) -> State:
    """The state dict's tensors on the host under ``state.<name>``, each tensor once, and
    the tied parameters (alias -> the name it is stored under). Buffers the state dict
    leaves out (``persistent=False``: position ids, rotary frequencies) are left out too:
    the replay builds them from the code as it is then, so a fix to them shows.

    Written before training goes on, so host tensors are not copied.
    """
    import torch

    state: dict[str, Any] = module.state_dict(keep_vars=True)
    stored: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    unsaved: dict[str, str] = {}
    for name, value in state.items():
        why = payload.unstorable(value)  # a meta tensor too: a shape, no values
        if why is not None:
            unsaved[name] = why
            continue
        first = stored.get(id(value))
        if first is not None and isinstance(value, torch.nn.Parameter):
            tied[name] = first
            continue
        stored[id(value)] = name
        tensors[f"{STATE_PREFIX}{name}"] = (on_host(value) if storable(value)
                                            else value.detach().to("cpu", copy=True))
    return State(tensors, tied, unsaved)


def lightning_module(module: Any) -> bool:
    """Whether ``module`` is a LightningModule (without importing Lightning)."""
    return any(cls.__name__ == "LightningModule"
               and cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
               for cls in type(module).__mro__)


def _hugging_face(module: Any) -> bool:
    if not any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
        return False
    try:
        return (hasattr(module.config, "to_json_string")
                and hasattr(type(module), "config_class"))
    except Exception:
        return False


def _read_back(module: Any, reading: Plain) -> tuple[dict[str, Any] | None, str]:
    """The constructor's arguments read back from the module's same-named attributes, config
    objects as their fields (``configs.plain``); a required argument kept under another name
    is the one config object the module keeps (``GPT(config)`` that keeps ``self.cfg``). An
    argument with a default the module keeps under no such name is left to its default (see
    ``_assumed_defaults``)."""
    cls = type(module)
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None, f"the constructor of {cls.__qualname__} has no readable signature: {FIX}"
    found: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name in ("device",
                                                                                 "dtype"):
            continue
        value = getattr(module, name, NOT_LITERAL)
        if value is NOT_LITERAL and param.default is param.empty:
            value = _config_attribute(module, param)
        if isinstance(param.default, bool) and not isinstance(value, bool) and (
                value is None or is_tensor(value)):
            value = value is not None  # Linear(bias=True) keeps bias as a Parameter or None
        literal, why = ((NOT_LITERAL, "") if value is None or value is NOT_LITERAL
                        else plain(value, name, reading))
        if literal is not NOT_LITERAL:
            found[name] = literal
        elif value is None and param.default is None:
            continue
        elif param.default is param.empty and why:
            return None, (f"{cls.__qualname__}({name}=...) cannot be rebuilt from what the "
                          f"model keeps: {why}: {FIX}")
        elif param.default is param.empty:
            return None, (f"{cls.__qualname__}({name}=...) cannot be read back from the "
                          f"module: it keeps no attribute named {name}, nor one config "
                          f"object under another name: {FIX}")
    return found, ""


def _config_attribute(module: Any, param: inspect.Parameter) -> Any:
    """The one config object (``configs.config_kind``) the module keeps as an attribute,
    when there is exactly one and it fits ``param``'s annotation; else NOT_LITERAL. A wrong
    guess is caught by the rebuild's check on meta."""
    kept = {id(v): v for k, v in vars(module).items()
            if not k.startswith("_") and config_kind(v) is not None}
    if len(kept) != 1:
        return NOT_LITERAL
    value = next(iter(kept.values()))
    annotation = param.annotation
    if isinstance(annotation, type) and not isinstance(value, annotation):
        return NOT_LITERAL
    if isinstance(annotation, str) and annotation.rpartition(".")[2] not in (
            type(value).__name__, "Any") and "|" not in annotation and "[" not in annotation:
        return NOT_LITERAL
    return value


def _assumed_defaults(module: Any, found: Mapping[str, Any]) -> tuple[str, ...]:
    """A note per constructor argument that has a default but no same-named attribute: the
    rebuild takes the default, which training may not have passed (``self.shift = offset``)."""
    cls = type(module)
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    unread = [p for p in parameters
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
              and p.name not in found and p.name not in ("device", "dtype")
              and p.default is not p.empty and p.default is not None
              and not hasattr(module, p.name)]
    if not unread:
        return ()
    shapes = _meta_shapes(cls, dict(found))
    assumed = [f"{p.name}={p.default!r}" for p in unread
               if not _shapes_tell(cls, dict(found), shapes, p.name, p.default)]
    if not assumed:
        return ()
    return (f"{cls.__qualname__} keeps no attribute named like its constructor's "
            f"{', '.join(assumed)}: a replay rebuilds it with these defaults; if training "
            f"passed other values, name them: {PASS_FACTORY}",)


def _meta_shapes(cls: type, kwargs: Mapping[str, Any]) -> dict[str, tuple[int, ...] | str] | None:
    """The state dict's shapes of ``cls(**kwargs)`` built on meta, or None if it cannot be."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), \
                contextlib.redirect_stdout(sys.stderr):
            built = cls(**kwargs)
    except Exception:
        return None
    return {k: _shape(v) for k, v in built.state_dict().items()}


def _shapes_tell(cls: type, found: dict[str, Any], shapes: dict[str, tuple[int, ...] | str] | None,
                 name: str, default: Any) -> bool:
    """Whether another value of argument ``name`` builds (on meta) a model of other shapes
    than ``shapes`` (the model's with the defaults), so that the rebuild's check against the
    model's shapes already tells a wrong one (``vocab``, ``dim``); False for a value only the
    forward reads (``offset``)."""
    if shapes is None or isinstance(default, bool) or not isinstance(default, int | float):
        return False
    other = _meta_shapes(cls, {**found, name: default * 2 + 1})
    return other is not None and other != shapes


def _lightning_hparams(module: Any, reading: Plain) -> tuple[dict[str, Any] | None, str]:
    """A LightningModule's saved constructor arguments (``save_hyperparameters()``)."""
    hparams = getattr(module, "hparams_initial", None)
    if not hparams:
        return None, ""
    if getattr(module, "_hparams_name", "kwargs") not in (None, "kwargs"):
        return None, (f"{type(module).__qualname__} saved its hyperparameters as one "
                      f"argument ({module._hparams_name}), which a replay cannot pass back: "
                      f"{FIX}")
    values: dict[str, Any] = {}
    bad: list[str] = []
    for key, value in dict(hparams).items():
        values[str(key)], why = plain(value, str(key), reading)
        if why:
            bad.append(why)
    if bad:
        return None, (f"the hyperparameters {type(module).__qualname__} saved cannot be "
                      f"passed back by a replay: {'; '.join(bad)}: {FIX}")
    return values, ""


def _builder(cls_target: str, script: str | None, kwargs: Mapping[str, Any],
             config: str | None) -> Callable[[], Any]:
    """A function that builds the module as a replay will (for the check on ``meta``)."""
    from pytest_gpucase.run.replay import decode_configs, find_class, load_script

    def build() -> Any:
        module = load_script(Path(script)) if script is not None else None
        obj = find_class(cls_target, module)
        if config is not None:
            return obj(obj.config_class.from_dict(json.loads(config)))
        return obj(**decode_configs(dict(kwargs), module))
    return build


def _difference(module: Any, build: Callable[[], Any]) -> tuple[str | None, str | None]:
    """(how the rebuilt module differs from ``module``, or why it could not be checked)."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), \
                contextlib.redirect_stdout(sys.stderr):
            fresh = build()
    except Exception:
        # Some constructors cannot run on meta; one that cannot run at all (a missing
        # argument, a name the script computes) is a rebuild that would fail every replay.
        try:
            with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(sys.stderr):
                fresh = build()
        except Exception as exc:
            return f"building it again raised {error_line(exc)}", None
    theirs = {k: _shape(v) for k, v in fresh.state_dict().items()}
    mine = {k: _shape(v) for k, v in module.state_dict().items()}
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing or extra:
        parts = ([f"lacks {', '.join(missing[:5])}"] if missing else []) + (
            [f"has {', '.join(extra[:5])} the model has not"] if extra else [])
        return "the rebuilt model " + " and ".join(parts), None
    shapes = [k for k in mine if mine[k] != theirs[k] and theirs[k] != _LAZY]
    if shapes:
        k = shapes[0]
        return f"{k} is {list(theirs[k])} in the rebuilt model, {list(mine[k])} in the model", None
    for line_mine, line_theirs in zip(repr(module).splitlines(), repr(fresh).splitlines(),
                                      strict=False):
        if line_mine != line_theirs:
            return (f"the rebuilt model has {line_theirs.strip()} where the model has "
                    f"{line_mine.strip()}"), None
    if len(repr(module).splitlines()) != len(repr(fresh).splitlines()):
        return "the rebuilt model's modules differ from the model's", None
    return None, None


_LAZY = "lazy"  # an uninitialized parameter (nn.LazyLinear): the state gives its shape


def _shape(value: Any) -> tuple[int, ...] | str:
    """A state entry's shape, or what it is when it is no tensor (an extra state, a packed
    parameter), or ``_LAZY``."""
    from torch.nn.parameter import is_lazy

    if is_tensor(value) and is_lazy(value):
        return _LAZY
    return tuple(value.shape) if is_tensor(value) else type(value).__qualname__


def rebuild_of(module: torch.nn.Module, factory: str | None,
               kwargs: Mapping[str, Any] | None, *, check: bool = True,
               part_of: str | None = None) -> Rebuild:
    """How a replay rebuilds ``module`` (see the module's docstring), checked on ``meta``
    unless ``check`` is False; when there is none, why, and the factory to pass, in the
    words of the model's framework (``_fix_for``). ``part_of``: ``module`` is a submodule
    of the model whose case is named so; a factory for the model does not build it, so
    the fix said is the submodule's own (``_fix_for_part``)."""
    rebuild = _rebuild_of(module, factory, kwargs, check=check)
    if rebuild.factory is None and FIX in rebuild.why_not:
        fix = _fix_for(module) if part_of is None else _fix_for_part(module, part_of)
        rebuild = replace(rebuild, why_not=rebuild.why_not.replace(FIX, fix))
    return replace(rebuild, why_not=in_framework_words(module, rebuild.why_not),
                   notes=tuple(in_framework_words(module, note) for note in rebuild.notes))


def in_framework_words(module: Any, text: str) -> str:
    """``text`` with the factory to pass said for the callback too, for a model a
    framework's Trainer trains (a LightningModule, a Hugging Face model): its users never
    call rec.watch."""
    if PASS_FACTORY not in text or _CALLBACK_FACTORY in text or not (
            lightning_module(module) or _hugging_face_class(module)):
        return text
    return text.replace(PASS_FACTORY, f"{PASS_FACTORY}, {_CALLBACK_FACTORY}")


def _hugging_face_class(module: Any) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _fix_for_part(module: Any, part_of: str) -> str:
    """What helps a replay build a submodule alone: a factory for the model does not (the
    submodule is built from its own class, found by its import path); a class a replay can
    import, its constructor's arguments kept as same-named attributes do; or nothing, since
    the model's case holds the failure."""
    name = type(module).__qualname__
    if class_target(type(module))[0] is None:
        helps = (f"define {name} at the top level of an importable module (or of the script "
                 "that was run)")
    else:
        helps = (f"keep {name}.__init__'s arguments as same-named attributes "
                 "(self.<name> = <name>)")
    return (f"a factory for the model does not build {name}, which a replay builds again "
            f"from its own class: {helps} so that a replay can build it alone; or nothing to "
            f"do: {part_of}, the model's case, holds the failure, and the op that raised is "
            "looked for in it")


def _fix_for(module: Any) -> str:
    """What to pass so that a replay can build ``module``: a factory, named the way its
    framework's callback takes it too (a Hugging Face model: the class and its config
    class said, and ``GpuCaseCallback(factory=...)``)."""
    name = type(module).__qualname__
    if _hugging_face_class(module):
        config = getattr(getattr(type(module), "config_class", None), "__name__", "its config")
        return (f"{name} is a Hugging Face model; pass a function that builds it as training "
                f"did ({name}({config}(...)), or {name}.from_pretrained of a local folder, "
                "then any change made to it): rec.watch(model, factory=\"mypkg.models:build\", "
                "kwargs={...}), or with the Trainer GpuCaseCallback(factory="
                "\"mypkg.models:build\", kwargs={...})")
    if lightning_module(module):
        return (f"{name} is a LightningModule; pass a function that builds it: "
                "rec.watch(model, factory=\"mypkg.models:build\", kwargs={...}), or with the "
                "Trainer GpuCaseCallback(factory=\"mypkg.models:build\", kwargs={...})")
    return FIX


def _rebuild_of(module: torch.nn.Module, factory: str | None,
                kwargs: Mapping[str, Any] | None, *, check: bool) -> Rebuild:
    name = type(module).__qualname__
    if factory is not None:
        literal = as_literal(dict(kwargs or {}))
        if literal is NOT_LITERAL:
            bad = sorted(str(k) for k, v in dict(kwargs or {}).items()
                         if as_literal(v) is NOT_LITERAL)
            return Rebuild(None, {}, f"rec.watch(..., kwargs=...) for {factory}: "
                           f"{', '.join(bad) or 'a key'} holds what TOML cannot (None, an "
                           "object): pass numbers, strings, booleans, lists and tables only")
        rebuild = Rebuild(factory, literal, how=f"{factory}(**kwargs)")
        build = _builder(factory, None, dict(literal), None)
    else:
        found = _found_rebuild(module)
        if isinstance(found, str):
            return Rebuild(None, {}, found)
        rebuild = found
        target = str(rebuild.recipe["class"]) if rebuild.recipe else str(rebuild.factory)
        args = (dict(rebuild.recipe.get("kwargs", {})) if rebuild.recipe
                else dict(rebuild.kwargs))
        build = _builder(target, rebuild.script, args, rebuild.config)
    if not check:
        return rebuild
    differs, unchecked = _difference(module, build)
    if differs is not None:
        return Rebuild(None, {}, f"{rebuild.how} would not be the watched model: {differs}; "
                       f"{FIX}")
    if unchecked is not None:
        return replace(rebuild, notes=(*rebuild.notes, f"the rebuild of {name} could not be "
                                       f"checked ({unchecked})"))
    return rebuild


def needs_secrets(module: torch.nn.Module, rebuild: Rebuild) -> str | None:
    """Why the rebuild cannot do without the secrets a case never holds (``tools.scrub``:
    hyperparameters and config fields that look secret are written as ``<secret>``), or None
    when it builds the same model with them so replaced (checked on ``meta``, as any rebuild)."""
    from pytest_gpucase.tools.scrub import scrub_data

    removed: list[str] = []
    kwargs = scrub_data(dict(rebuild.kwargs), removed)
    recipe = scrub_data(dict(rebuild.recipe or {}), removed)
    config = rebuild.config
    if config is not None:
        with contextlib.suppress(ValueError):
            config = json.dumps(scrub_data(json.loads(config), removed))
    if not removed:
        return None
    if rebuild.recipe is not None:
        build = _builder(str(recipe["class"]), rebuild.script, dict(recipe.get("kwargs", {})),
                         config)
    else:
        build = _builder(str(rebuild.factory), None, kwargs, None)
    differs, _ = _difference(module, build)
    if differs is None:
        return None
    return (f"building the model needs {', '.join(sorted(set(removed))[:5])}, which look secret "
            f"and are written as <secret> ({differs}): pass {PASS_FACTORY} naming a function "
            "that reads them from the environment")


def _found_rebuild(module: Any) -> Rebuild | str:
    """The rebuild of a module no factory was named for, or why there is none."""
    name = type(module).__qualname__
    target, script, why = class_target(type(module))
    if target is None:
        return why
    config: str | None = None
    if _hugging_face(module):
        with contextlib.suppress(Exception):
            config = str(module.config.to_json_string(use_diff=False))
    args: dict[str, Any] | None = {}
    notes: tuple[str, ...] = ()
    how = f"{name}(config) from config.json"
    reading = Plain()
    if config is None:
        args, why = (_lightning_hparams(module, reading) if lightning_module(module)
                     else (None, ""))
        how = f"{name}(**hyperparameters saved by save_hyperparameters())"
        if args is None and why:
            return why
        if args is None:
            args, why = _read_back(module, reading)
            how = f"{name}(**constructor arguments read back from the model)"
            if args is None:
                return why
            notes = _assumed_defaults(module, args)
    literal = as_literal(args)
    if (script is None and config is None and literal is not NOT_LITERAL
            and not holds_config(args)):  # a config object: model.json builds it
        return Rebuild(target, literal, how=how, notes=notes)
    recipe: dict[str, Any] = {"class": target}
    if config is not None:
        recipe["config"] = _CONFIG_FILE
        attention = getattr(module.config, "_attn_implementation", None)
        if isinstance(attention, str):
            recipe["attn_implementation"] = attention
    else:
        recipe["kwargs"] = args
        configs = _configs_in(args)
        if configs:
            how += f"; config objects built again from model.json's fields ({configs})"
    if script is None and reading.scripts:
        script = sorted(reading.scripts)[0]  # a config class of the script that was run
    if script is not None:
        how += f"; classes loaded from {Path(script).name}"
    return Rebuild(CASE_BUILDER, {}, recipe=recipe, script=script, config=config, how=how,
                   notes=notes)


def _configs_in(args: Any) -> str:
    """``GPTConfig: dataclass, ...``: the config objects of ``args``, outermost first."""
    from pytest_gpucase.run.replay import CONFIG_KEY, CONFIG_KINDS

    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, Mapping):
            if CONFIG_KEY in value:
                cls = str(value.get("class", "")).rpartition(":")[2]
                kind = str(value[CONFIG_KEY])
                line = f"{cls}: {kind}, {CONFIG_KINDS.get(kind, (None, '?'))[1]}"
                if line not in found:
                    found.append(line)
                walk(value.get("fields", {}))
            else:
                for item in value.values():
                    walk(item)
    walk(args)
    return "; ".join(found)


def script_function_files(fn: Any, root: Path) -> tuple[str, dict[str, str]] | None:
    """``("case.py:run", files)`` for a function defined at the top level of the script
    that was run (``__main__``): the case's ``case.py`` loads the script's definitions
    (``load_script``) and calls it. None for any other function."""
    if getattr(fn, "__module__", None) != "__main__" or not inspect.isfunction(fn):
        return None
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or "." in fn.__qualname__:
        return None
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    if not any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               and node.name == fn.__name__ for node in tree.body):
        return None
    path = case_relative(str(Path(script).resolve()), root)
    return "case.py:run", {"case.py": _SCRIPT_CALL_PY.format(
        name=fn.__name__, script=Path(script).name, path=json.dumps(path))}


def case_relative(path: str, root: Path) -> str:
    """``path`` relative to a case directory under ``root``, so the project moves as a whole
    (a CI checkout); absolute where it cannot be (another drive)."""
    try:
        return str(Path("..") / os.path.relpath(path, root))
    except ValueError:
        return path


def rebuild_files(rebuild: Rebuild, root: Path) -> dict[str, str]:
    """The files a case directory under ``root`` needs to build the model: ``case.py``,
    ``model.json`` and ``config.json``, when the rebuild is not a plain import."""
    if rebuild.recipe is None:
        return {}
    recipe = dict(rebuild.recipe)
    if rebuild.script is not None:
        recipe["script"] = case_relative(rebuild.script, root)
    files = {_MODEL_FILE: json.dumps(recipe, indent=2) + "\n",
             "case.py": _CASE_PY.format(how="\n".join(textwrap.wrap(
                 f"Builds the model this case replays: {rebuild.how}.", 88)))}
    if rebuild.config is not None:
        files[_CONFIG_FILE] = rebuild.config
    return files


_CASE_PY = '''"""{how}

Written by the gpucase Recorder; model.json says what is built.
"""

from pathlib import Path

from pytest_gpucase.capture import build_model


def make_model():
    return build_model(Path(__file__).with_name("model.json"))
'''


_SCRIPT_CALL_PY = '''"""Calls {name} as defined in {script}, the script that was run.

Written by the gpucase Recorder: the script's definitions are loaded without running it.
"""

from pathlib import Path

from pytest_gpucase.capture import load_script


def run(**inputs):
    return load_script(Path(__file__).parent / {path}).{name}(**inputs)
'''

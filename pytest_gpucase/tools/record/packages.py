"""The frameworks a recorded case needs to replay, declared in its ``[matrix.packages]``, so
that a runner without one skips the case with the reason ("requires transformers; not
installed") instead of failing it with a ModuleNotFoundError.

What the case imports is read off what it names: its ``call``, its module case's
``factory``, and ``model.json``'s class and config classes. Each is looked up in the
modules already imported (nothing is imported here), and each class's bases too (a model
of the project subclassing ``transformers.PreTrainedModel`` or ``lightning.LightningModule``
needs that framework). A module counts when it was installed (its file lies in a
``site-packages`` or ``dist-packages`` folder): the project's own code, the script that was
run, the standard library and torch (every report records its version) are never declared.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from pytest_gpucase.case.keys import MODULE_KEY
from pytest_gpucase.plan.environment import call_distributions

__all__ = ["declared_packages"]

_INSTALLED = ("site-packages", "dist-packages")


def _targets(call: str, literals: Mapping[str, Any], files: Mapping[str, str]) -> Iterator[str]:
    """The ``"pkg.mod:Qual"`` (or script ``"Qual"``) targets a case imports."""
    from pytest_gpucase.run.replay import CONFIG_KEY, DATACLASS_KEY

    yield call
    recipe = literals.get(MODULE_KEY)
    if isinstance(recipe, Mapping) and isinstance(recipe.get("factory"), str):
        yield recipe["factory"]
    try:
        model = json.loads(files.get("model.json", "{}"))
    except ValueError:
        return
    stack: list[Any] = [model]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, Mapping):
            for key in ("class", DATACLASS_KEY):
                if isinstance(value.get(key), str) and (key != "class" or value is model
                                                        or CONFIG_KEY in value):
                    yield value[key]
            stack.extend(value.values())


def _found(target: str) -> Any:
    """The object ``target`` names among the modules already imported, or None."""
    module_name, _, qualname = target.rpartition(":")
    module = sys.modules.get(module_name or "__main__")
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _installed(module_name: str) -> bool:
    file = getattr(sys.modules.get(module_name), "__file__", None)
    return isinstance(file, str) and any(
        part in _INSTALLED for part in os.path.normpath(file).split(os.sep))


def declared_packages(call: str, literals: Mapping[str, Any],
                      files: Mapping[str, str]) -> dict[str, str]:
    """``{distribution: ""}`` for each installed framework the case needs (see the module's
    docstring); ``""`` asks only that it be installed."""
    modules: set[str] = set()
    for target in _targets(call, literals, files):
        obj = _found(target)
        if obj is None:
            continue
        classes = obj.__mro__ if isinstance(obj, type) else (obj,)
        modules.update(m for c in classes if isinstance(m := getattr(c, "__module__", None), str))
    names: set[str] = set()
    for module_name in modules:
        if module_name != "builtins" and _installed(module_name):
            names.update(call_distributions(f"{module_name}:_"))
    return {name: "" for name in sorted(names)}

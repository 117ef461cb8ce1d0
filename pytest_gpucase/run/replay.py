"""The child's side of module and op cases: the generated calls a recorded case names.

``call = "pytest_gpucase.capture:replay_module"`` (and ``replay_op``) in a saved
``case.toml`` resolve here through the ``pytest_gpucase.capture`` facade.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpucase.base.tensors import tensors_in
from pytest_gpucase.case.keys import GRAD_PREFIX, STATE_PREFIX

__all__ = ["import_target", "replay_module", "replay_op"]


def import_target(target: str) -> Any:
    import importlib

    where, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(where)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def replay_module(*, gpucase_module: Mapping[str, Any], **inputs: Any) -> Any:
    """Rebuild a captured module, load its saved state and call it on the saved inputs.

    The generated ``call`` of a module case. ``gpucase_module`` is the ``[inputs]`` table
    capture writes: ``factory`` ("pkg.mod:make" or a torch.nn class; a bundled case may name
    "case.py:make", which the child imports from the case directory) and its ``kwargs``,
    ``training`` (the train/eval mode), ``backward`` (the failure was in backward: run it
    with the saved ``grad_output.<i>`` tensors). ``state.<name>`` tensors are the state dict.
    """
    import torch

    recipe = dict(gpucase_module)
    factory = recipe["factory"]
    # A "FILE.py:make" factory arrives already imported from the case directory (execute).
    make = factory if callable(factory) else import_target(str(factory))
    module = make(**dict(recipe.get("kwargs", {})))
    state = {k.removeprefix(STATE_PREFIX): v for k, v in inputs.items()
             if k.startswith(STATE_PREFIX)}
    grads = [inputs[name] for name in recipe.get("grad_outputs", [])]
    args = {k: v for k, v in inputs.items() if not k.startswith((STATE_PREFIX, GRAD_PREFIX))}
    # assign: the saved tensors become the parameters, in the device and dtype of the run.
    module.load_state_dict(state, strict=True, assign=True)
    device = next((t.device for t in tensors_in(list(inputs.values()))), None)
    if device is not None:
        module.to(device)  # non-persistent buffers, made by the constructor on the host
    module.train(bool(recipe.get("training", False)))
    if not recipe.get("backward"):
        return module(**args)
    with torch.enable_grad():
        out = module(**args)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        if grads and len(grads) == len(outs):
            torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs,
                                                                          strict=True)])
        else:
            torch.autograd.backward(sum((t.float().sum() for t in outs), torch.zeros(())))
    return {"out": out, "grad": {name: p.grad for name, p in module.named_parameters()}}


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
        return [_decode_arg(item, tensors) for item in spec["list"]]
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

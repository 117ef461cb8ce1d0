"""The value an index, target or class-range check refused, read from a case's saved inputs:
which value, where, in which sample, against which valid range (``gpucase show``, the
triage of a case item, ``gpucase request``, ``gpucase data-check``).

Read from what the case stores, never guessed: an op case (``aten.embedding``,
``index_select``, ``gather``, ``scatter``, ``index``, ``take``, ``nll_loss``, ``one_hot``)
and a module case of ``nn.Embedding``, ``nn.EmbeddingBag``, ``nn.CrossEntropyLoss`` or
``nn.NLLLoss`` name their index and the size it indexes. A model's case does not say which
of its inputs reaches which layer: its narrowed cases do (``[origin] narrowed_from``), and
a saved input of the model holding the very values the narrowed op got (flattened, as
``targets.view(-1)`` gives them) is where they came from. Where no case says it, the
finding says so instead of guessing.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import (
    MODULE_KEY,
    OP_KEY,
    REPLAY_MODULE,
    REPLAY_OP,
    STATE_PREFIX,
    argument_path,
)
from pytest_gpucase.case.load import load_case
from pytest_gpucase.case.model import Case

if TYPE_CHECKING:
    import torch

    from pytest_gpucase.run.parent import Verdict

__all__ = ["INDEX_CLASSES", "Finding", "Offending", "data_note", "find", "index_failure",
           "item_notes", "triaged"]

# The failure classes whose cause is a value outside the range it indexes.
INDEX_CLASSES = ("index-out-of-range", "device-side-assert")
_SHOWN = 3       # offending positions named; the count is always given
_SIBLINGS = 64   # narrowed cases looked at beside a model's case
_DATA_NOTE = "the failure is in the saved batch"


@dataclass(frozen=True)
class _Check:
    """One saved integer tensor and the range its values must lie in."""

    field: str                 # its name in the case's payload
    low: int                   # valid values: low..high, inclusive, and ``allowed``
    high: int
    size: str                  # what it indexes, in words: "wte has 19 rows"
    kind: str                  # "token", "target", "index", "class value"
    allowed: int | None = None  # ignore_index, padding beyond the range
    only: bool = False         # the range is unknown: the entries equal to low are sought


@dataclass(frozen=True)
class Offending:
    """The values of one saved tensor outside their range, where they are, whose they are."""

    case: Path                 # the case whose saved input holds them
    field: str                 # the input's name there
    shape: tuple[int, ...]
    kind: str
    low: int
    high: int
    size: str
    allowed: int | None
    count: int                                   # every offending entry
    shown: tuple[tuple[int, tuple[int, ...]], ...]  # (value, position), the first few
    rows: tuple[int, ...]                        # entries on ``axis`` holding them
    axis: int
    samples: tuple[str, ...]                     # their sample ids; () when unknown
    values: tuple[int, ...]                      # the distinct offending values (a few)
    saved: bool = True                           # held by the batch the case saved
    via: str | None = None                       # the narrowed case that named the range
    # The same values in the model's input they came from (a narrowed case's tensor is the
    # model's idx, or its targets.view(-1)): named so, with the model's positions and ids.
    alias: Offending | None = None
    check: _Check | None = None                  # the check that found them
    how: str | None = None                       # how it relates to what the op got
    # The name the user's code knows it by (``batch['targets']`` for a Lightning step's
    # ``nested.batch.targets``); None: ``field`` itself.
    label: str | None = None

    @property
    def named(self) -> str:
        return self.label or self.field

    def describe(self) -> str:
        """``idx holds 19 at [2, 10] (sample ex0042); wte has 19 rows (valid 0..18)``."""
        if self.alias is not None:
            return f"{self.alias.describe()} (this case's {self.named})"
        ids = dict(zip(self.rows, self.samples, strict=False)) if self.samples else {}
        parts = []
        for value, position in self.shown:
            sample = ids.get(position[self.axis]) if len(position) > self.axis else None
            parts.append(f"{value} at {list(position)}"
                         + (f" (sample {sample})" if sample is not None else ""))
        more = (f"; {self.count} entries out of range in all" if self.count > len(self.shown)
                else "")
        text = f"{self.named} holds {', '.join(parts)}{more}; {self.size}"
        if self.how is not None:
            text += f" ({self.how})"
        if self.via is not None:
            text += f"; read with the narrowed case {self.via}"
        return text

    def sample_words(self) -> str:
        """``sample ex0042 holds token 19``, or ``entry 1 of idx holds token 19``."""
        if self.alias is not None:
            return self.alias.sample_words()
        values = ", ".join(map(str, self.values))
        noun = self.kind + ("s" if len(self.values) > 1 else "")
        if self.samples:
            whose = ("sample " if len(self.samples) == 1 else "samples ") + ", ".join(
                self.samples[:_SHOWN]) + (" …" if len(self.samples) > _SHOWN else "")
        else:
            which = ", ".join(map(str, self.rows[:_SHOWN])) + (
                " …" if len(self.rows) > _SHOWN else "")
            whose = f"entr{'y' if len(self.rows) == 1 else 'ies'} {which} of {self.named}"
        verb = "holds" if len(self.samples or self.rows) == 1 else "hold"
        size = self.check.size if self.check is not None else self.size
        return f"{whose} {verb} {noun} {values}, {size}"


@dataclass(frozen=True)
class Finding:
    """What the saved inputs say of an index failure: the offending values, or why not."""

    offending: Offending | None
    why: str | None = None       # why the value cannot be named from the case

    def lines(self) -> list[str]:
        if self.offending is None:
            return [f"offending value: {self.why}"]
        found = self.offending
        if found.saved:
            return [f"offending value: {found.describe()}"]
        return [f"offending value: {found.describe()}; {self.why}"]


def index_failure(case: Case) -> bool:
    """Whether the case's captured failure is an index, target or class-range error."""
    known = case.origin.get("failure_class")
    if isinstance(known, str):
        return known in INDEX_CLASSES
    from pytest_gpucase.verdict.triage import failure_class  # the failure path's (run.parent)

    error = str(case.origin.get("error", ""))
    error_type, _, message = error.partition(": ")
    return failure_class(error_type, message, str(case.origin.get("stderr", ""))) in INDEX_CLASSES


def find(case: Case, *, failed: str | None = None, message: str | None = None,
         replay: bool = False) -> Finding | None:
    """The offending values of ``case``'s index failure; None when it is no index failure
    (the class of the failure met, ``failed``, and its ``message``, else the ones the case
    captured). ``replay``: a function's case that nothing else names the range of may be
    replayed in a child to find the op that raised (``_through_replay``); ``gpucase show``
    and ``request`` read cases without running them, a case's run and data-check may."""
    if not (failed in INDEX_CLASSES if failed is not None else index_failure(case)):
        return None
    if importlib.util.find_spec("torch") is None:  # gpucase show in a job without torch
        return Finding(None, "not read here: torch is not installed, and the saved values "
                             "need it")
    if not case.inputs_file.exists():
        return Finding(None, "the case saved no inputs (no inputs.safetensors), so the value "
                             "cannot be read; the error message is all there is")
    tensors = _load(case)
    if tensors is None:
        return Finding(None, "the case's inputs.safetensors cannot be read")
    own = _offending(case, tensors)
    if own is not None:
        parent = _parent(case)
        if parent is None:
            return Finding(own)
        named = _named_in(own, tensors, parent)
        if named.alias is not None:
            return Finding(named)
        # The op got values no input of the model's case holds: the model made them.
        return Finding(replace(named, saved=False), f"no saved input of {parent[0].name}, the "
                       "case this one was narrowed from, holds these values: the model "
                       "computed them, so no fix upstream of this call can make this case "
                       "pass; keep it as the record that the call rejects them ([expect] "
                       "outcome = \"raises\") or delete it")
    if case.call in (REPLAY_OP, REPLAY_MODULE) and _checks(case, tensors):
        return Finding(None, "every saved index is within its range: the failing value is "
                             "computed inside the call")
    return _through_narrowed(case, tensors, message, replay)


def triaged(verdict: Verdict) -> tuple[Verdict, list[str]]:
    """``verdict`` with the offending value (and the data-fix advice) in its triage's notes
    when its run failed on an index, target or class-range check, and the advice alone for
    the session's summary (an xfail item shows no section); as it is otherwise."""
    found, outcome = verdict.triage, verdict.outcome
    if found is None or not verdict.failed:
        return verdict, []
    from pytest_gpucase.verdict.triage import failure_class  # the failure path's (run.parent)

    kind = failure_class(outcome.error_type or "", outcome.error_message or outcome.summary,
                         verdict.child.stderr)
    if kind not in INDEX_CLASSES:
        return verdict, []
    notes = _notes_once(verdict.spec.case, kind, outcome.error_message or outcome.summary)
    if not notes:
        return verdict, []
    advice = [note for note in notes if note.startswith(_DATA_NOTE)]
    return replace(verdict, triage=replace(found, notes=(*found.notes, *notes))), advice


# A session's items of one case (devices, dtypes, variants) read its payload once.
_READ: dict[tuple[str, str, int, int], list[str]] = {}


def _notes_once(case: Case, kind: str, message: str) -> list[str]:
    try:
        stat = case.inputs_file.stat()
        key = (str(case.path.resolve()), f"{kind}\n{message}", stat.st_mtime_ns, stat.st_size)
    except OSError:
        return item_notes(case, failed=kind, message=message, replay=True)
    if key not in _READ:
        if len(_READ) >= 256:
            _READ.clear()
        _READ[key] = item_notes(case, failed=kind, message=message, replay=True)
    return list(_READ[key])


def item_notes(case: Case, *, failed: str | None = None, message: str | None = None,
               replay: bool = False) -> list[str]:
    """The lines an index failure's triage adds: the offending value, and what to do once
    the data is fixed when the saved batch holds it (``tools.datacheck``). Advice only: a
    case this cannot read is said so in a line, never raised to the item or the command."""
    try:
        found = find(case, failed=failed, message=message, replay=replay)
    except Exception as exc:  # a file anyone may have written: said, never raised
        return [f"offending value: not read ({type(exc).__name__}: {str(exc)[:200]})"]
    if found is None:
        return []
    lines = found.lines()
    if found.offending is not None and found.offending.saved:
        lines.append(data_note(found.offending))
    return lines


def data_note(found: Offending) -> str:
    """What to do with a case whose saved batch holds the offending value. The same words
    for a model's case and its narrowed cases (a session's summary says them once): the
    model's case is the one to turn into a data check, its narrowed cases go with it."""
    from pytest_gpucase.tools.narrowed import narrowed_cases

    case = found.alias.case if found.alias is not None else found.case
    where = _case_arg(case)
    narrowed = narrowed_cases(case)
    these = "it and its narrowed cases" if narrowed else "this case"
    text = (f"{_DATA_NOTE} of {where} ({found.sample_words()}): after a data fix {these} "
            f"cannot pass; turn it into a data check with `gpucase data-check {where}` (a "
            "case without those samples, expected to pass, and the data contract they "
            "broke)")
    if narrowed:
        text += f" and delete its narrowed cases (`gpucase narrowed {where} --delete`)"
    return text + ", or delete " + ("them all" if narrowed else "it")


# --- reading the case --------------------------------------------------------------------


def _load(case: Case) -> dict[str, torch.Tensor] | None:
    from pytest_gpucase.tools.minimize import one_thread

    try:
        with one_thread():
            return payload.load(case.inputs_file)
    except (CaseFormatError, OSError, ValueError, RuntimeError):
        return None


def _offending(case: Case, tensors: Mapping[str, torch.Tensor]) -> Offending | None:
    """The first check of the case's own op or module whose tensor holds offending values."""
    for check in _checks(case, tensors):
        found = _measure(case, tensors[check.field], check)
        if found is not None:
            return found
    return None


def _measure(case: Case, tensor: torch.Tensor, check: _Check) -> Offending | None:
    import torch

    from pytest_gpucase.tools.minimize import one_thread

    with one_thread():
        values = tensor.detach().to("cpu", torch.int64)
        bad = ((values == check.low) if check.only
               else (values < check.low) | (values > check.high))
        if check.allowed is not None:
            bad &= values != check.allowed
        count = int(bad.sum())
        if not count:
            return None
        where = bad.nonzero()
        axis = _axis(case, tensor)
        shown = tuple((int(values[tuple(p)]), tuple(int(i) for i in p))
                      for p in where[:_SHOWN].tolist())
        rows = (tuple(int(r) for r in torch.unique(where[:, axis]).tolist())
                if tensor.dim() > axis else ())
        distinct = tuple(int(v) for v in torch.unique(values[bad]).tolist()[:_SHOWN])
    return Offending(case=case.path, field=check.field, label=_label(case, check.field),
                     shape=tuple(tensor.shape),
                     kind=check.kind, low=check.low, high=check.high,
                     size=_range_words(check),
                     allowed=check.allowed, count=count, shown=shown, rows=rows, axis=axis,
                     samples=_samples(case, tensor, rows, axis), values=distinct, check=check)


def _label(case: Case, name: str) -> str | None:
    """``batch['targets']``, ``batch[1]``: a tensor the case saved inside an argument (a
    batch of dicts, tuples, lists), named as the user's code reaches it; None for an
    argument saved as itself."""
    found = argument_path(case.literals, name)
    if found is None:
        return None
    arg, path = found
    return arg + "".join(f"[{step}]" if step.isdigit() else f"[{step!r}]" for step in path)


def _range_words(check: _Check) -> str:
    """``wte has 19 rows (valid 0..18)``: what the index indexes and the range it allows."""
    if check.only:
        return check.size
    allowed = f", or {check.allowed} (ignore_index)" if check.allowed is not None else ""
    return f"{check.size} (valid {check.low}..{check.high}{allowed})"


def _axis(case: Case, tensor: torch.Tensor) -> int:
    batch = case.variants.batch
    return batch.axis if batch is not None else 0


def _samples(case: Case, tensor: torch.Tensor, rows: Sequence[int], axis: int) -> tuple[str, ...]:
    """The sample ids of ``rows``: the case's ids when there is one per entry on the axis."""
    ids = case.origin.get("sample_ids")
    if not isinstance(ids, list) or tensor.dim() <= axis or len(ids) != tensor.shape[axis]:
        return ()
    return tuple(str(ids[row]) for row in rows)


def _checks(case: Case, tensors: Mapping[str, torch.Tensor]) -> list[_Check]:
    if case.call == REPLAY_OP:
        table = case.literals.get(OP_KEY)
        return _op_checks(case, table, tensors) if isinstance(table, Mapping) else []
    if case.call == REPLAY_MODULE:
        table = case.literals.get(MODULE_KEY)
        return _module_checks(case, table, tensors) if isinstance(table, Mapping) else []
    return []


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], position: int, name: str,
         default: Any = None) -> Any:
    """An op argument as the case describes it: ``{tensor = ...}`` -> its payload name,
    ``{value = ...}`` -> the value, ``{none = true}`` -> None."""
    spec = args[position] if position < len(args) else kwargs.get(name)
    if not isinstance(spec, Mapping):
        return default
    if "tensor" in spec:
        return ("tensor", str(spec["tensor"]))
    if "none" in spec:
        return None
    if isinstance(spec.get("list"), list):
        return spec["list"]
    return spec.get("value", default)


def _tensor(tensors: Mapping[str, torch.Tensor], spec: Any) -> tuple[str, torch.Tensor] | None:
    if isinstance(spec, tuple) and spec[0] == "tensor" and spec[1] in tensors:
        return spec[1], tensors[spec[1]]
    return None


def _integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex()) and str(tensor.dtype) != \
        "torch.bool"


def _op_checks(case: Case, table: Mapping[str, Any],
               tensors: Mapping[str, torch.Tensor]) -> list[_Check]:
    op = str(table.get("op", ""))
    name = op.split(".")[1] if op.count(".") >= 2 else op
    args = table.get("args", [])
    kwargs = table.get("kwargs", {})
    args = args if isinstance(args, list) else []
    kwargs = kwargs if isinstance(kwargs, Mapping) else {}

    def arg(position: int, key: str, default: Any = None) -> Any:
        return _arg(args, kwargs, position, key, default)

    module = case.origin.get("module")
    if name in ("embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"):
        weight, indices = _tensor(tensors, arg(0, "weight")), _tensor(tensors, arg(1, "indices"))
        if weight is None or indices is None or weight[1].dim() < 1:
            return []
        rows = int(weight[1].shape[0])
        owner = str(module) if isinstance(module, str) and module else "the embedding"
        return [_Check(indices[0], 0, rows - 1, f"{owner} has {rows} rows", "token")]
    if name in ("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd",
                "nll_loss2d", "cross_entropy_loss"):
        scores, target = _tensor(tensors, arg(0, "self")), _tensor(tensors, arg(1, "target"))
        ignore = arg(4, "ignore_index", -100)
        if scores is None or target is None or not _integer(target[1]):
            return []
        return [_loss_check(target[0], scores[1], ignore if isinstance(ignore, int) else None)]
    if name == "one_hot":
        values, classes = _tensor(tensors, arg(0, "self")), arg(1, "num_classes", -1)
        if values is None or not isinstance(classes, int) or classes <= 0:
            return []
        return [_Check(values[0], 0, classes - 1, f"one_hot's num_classes is {classes}",
                       "class value")]
    return _dim_checks(name, arg, tensors)


def _dim_checks(name: str, arg: Any, tensors: Mapping[str, torch.Tensor]) -> list[_Check]:
    """index_select, gather, scatter (an index on a dimension), index (one per dimension),
    take (into the flattened tensor)."""
    source = _tensor(tensors, arg(0, "self"))
    if source is None:
        return []
    shape = tuple(source[1].shape)
    if name in ("index_select", "gather", "scatter", "scatter_add", "scatter_reduce",
                "index_add", "index_copy", "index_fill"):
        dim, index = arg(1, "dim"), _tensor(tensors, arg(2, "index"))
        if not isinstance(dim, int) or index is None or not shape:
            return []
        dim = dim % len(shape)
        return [_Check(index[0], 0, shape[dim] - 1,
                       f"dimension {dim} of the indexed tensor has size {shape[dim]}", "index")]
    if name == "take":
        index, total = _tensor(tensors, arg(1, "index")), math.prod(shape)
        return [] if index is None else [
            _Check(index[0], -total, total - 1, f"the indexed tensor has {total} elements",
                   "index")]
    if name in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        spec = arg(1, "indices")
        found = []
        for dim, item in enumerate(spec if isinstance(spec, list) else []):
            index = _tensor(tensors, _arg([item], {}, 0, ""))
            if index is not None and _integer(index[1]) and dim < len(shape):
                found.append(_Check(index[0], -shape[dim], shape[dim] - 1,
                                    f"dimension {dim} of the indexed tensor has size "
                                    f"{shape[dim]}", "index"))
        return found
    return []


def _loss_check(field: str, scores: torch.Tensor, ignore: int | None) -> _Check:
    classes = int(scores.shape[1] if scores.dim() >= 2 else scores.shape[0])
    return _Check(field, 0, classes - 1, f"the loss's input has {classes} classes", "target",
                  ignore)


def _module_checks(case: Case, table: Mapping[str, Any],
                   tensors: Mapping[str, torch.Tensor]) -> list[_Check]:
    factory = str(table.get("factory", ""))
    kind = factory.rpartition(":")[2]
    if not factory.startswith("torch.nn"):
        return []
    kwargs = table.get("kwargs", {})
    kwargs = kwargs if isinstance(kwargs, Mapping) else {}
    module = case.origin.get("module")
    owner = str(module) if isinstance(module, str) and module else kind
    if kind in ("Embedding", "EmbeddingBag"):
        weight = tensors.get(f"{STATE_PREFIX}weight")
        rows = (int(weight.shape[0]) if weight is not None and weight.dim() >= 1
                else kwargs.get("num_embeddings"))
        if not isinstance(rows, int) or "input" not in tensors:
            return []
        return [_Check("input", 0, rows - 1, f"{owner} has {rows} rows", "token")]
    if kind in ("CrossEntropyLoss", "NLLLoss"):
        scores, target = tensors.get("input"), tensors.get("target")
        if scores is None or target is None or not _integer(target):
            return []
        ignore = kwargs.get("ignore_index", -100)
        return [_loss_check("target", scores, ignore if isinstance(ignore, int) else None)]
    return []


# --- a model's case and its narrowed cases -------------------------------------------------


def _parent(case: Case) -> tuple[Case, dict[str, torch.Tensor]] | None:
    """The case a narrowed case was narrowed from, with its saved tensors, when beside it."""
    name = case.origin.get("narrowed_from")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        return None
    folder = case.path.parent / name
    try:
        parent = load_case(folder)
    except (CaseFormatError, OSError):
        return None
    tensors = _load(parent) if parent.inputs_file.exists() else None
    return (parent, tensors) if tensors is not None else None


def _narrowed(case: Case) -> list[Case]:
    """The cases narrowed from ``case`` beside it (``tools.narrowed``); for a narrowed module
    case, the op cases narrowed from the same model in the same module. Op cases first:
    they name the very tensor the failing op got."""
    from pytest_gpucase.tools.narrowed import NARROWED_FROM, narrowed_cases

    parent = case.origin.get(NARROWED_FROM)
    module = case.origin.get("module")
    paths = narrowed_cases(case.path.parent / parent if isinstance(parent, str) and parent
                           else case.path)
    found: list[Case] = []
    for path in paths[:_SIBLINGS]:
        if path.resolve() == case.path.resolve():
            continue
        try:
            loaded = load_case(path)
        except (CaseFormatError, OSError):
            continue
        if not isinstance(parent, str) or (loaded.call == REPLAY_OP
                                           and loaded.origin.get("module") == module):
            found.append(loaded)
    return sorted(found, key=lambda c: c.call != REPLAY_OP)


def _through_narrowed(case: Case, tensors: Mapping[str, torch.Tensor],
                      message: str | None, replay: bool = False) -> Finding:
    narrowed = _narrowed(case)
    if not narrowed:
        named = _named_by_message(case, tensors, message)
        if named is not None and named.check is not None and not named.check.only:
            return Finding(named)
        replayed = _through_replay(case, tensors) if replay else None
        if replayed is not None:
            return replayed
        if named is not None:
            return Finding(named)
        return Finding(None, f"cannot be named from this case: the failing index is used "
                             f"inside {_model_name(case)}, and neither a narrowed case of "
                             "the failing op or layer beside it nor the error message says "
                             f"which saved value it is{_extremes(case, tensors)}")
    inside = None
    for other in narrowed:
        other_tensors = _load(other) if other.inputs_file.exists() else None
        if other_tensors is None:
            continue
        found = _offending(other, other_tensors)
        if found is None:
            continue
        mapped = _map_into(found, other_tensors[found.field], case, tensors)
        if mapped is not None:
            return Finding(replace(mapped, via=other.name))
        inside = inside or replace(found, saved=False, via=None)
    if inside is not None:
        return Finding(inside, f"no saved input of {case.name} holds these values (the "
                               f"narrowed case {Path(inside.case).name} does): they were "
                               "computed inside the model, a bug of the code, not the data")
    return Finding(None, "no narrowed case beside it holds an out-of-range value: the failing "
                         "index is computed inside the model")


def _through_replay(case: Case, tensors: Mapping[str, torch.Tensor]) -> Finding | None:
    """A function's case (or one written by hand) that no narrowed case names: the op that
    raised and its arguments, found by replaying the case in a child under a dispatch mode
    (``record.narrow.find_raising_op``, the Recorder's own op narrowing), read with the op
    rules, and the values mapped into the case's saved inputs. None for a model's case (its
    narrowed cases say it; ``Recorder(narrow=False)`` asked for none) or when no op says it."""
    if case.call in (REPLAY_OP, REPLAY_MODULE):
        return None
    from pytest_gpucase.tools.record.narrow import find_raising_op

    found = find_raising_op(case.path, timeout=min(case.timeout, 60.0))
    if isinstance(found, str):
        return None
    table, op_tensors = found
    for check in _op_checks(case, table, op_tensors):
        got = _measure(case, op_tensors[check.field], check)
        if got is None:
            continue
        mapped = _map_into(got, op_tensors[check.field], case, tensors)
        if mapped is not None:
            return Finding(mapped)
        return Finding(replace(got, saved=False, field=f"{table['op']}'s {check.kind}s"),
                       f"no saved input of {case.name} holds these values: they were computed "
                       "inside the call, a bug of the code, not the data")
    return None


def _named_in(own: Offending, tensors: Mapping[str, torch.Tensor],
              parent: tuple[Case, dict[str, torch.Tensor]]) -> Offending:
    """A narrowed case's finding, with the name, position and sample of the model's input
    that holds the same values, when one does."""
    mapped = _map_into(own, tensors[own.field], *parent)
    return own if mapped is None else replace(own, alias=mapped)


def _extremes(case: Case, tensors: Mapping[str, torch.Tensor]) -> str:
    """``; its integer inputs: labels 1..5 (5 at [1], sample ex0042)``: the largest value of
    each saved integer input and where it is, facts to compare with the size it indexes."""
    import torch

    from pytest_gpucase.tools.minimize import one_thread

    parts: list[str] = []
    with one_thread():
        for name, tensor in tensors.items():
            if (name.startswith((STATE_PREFIX, "context.")) or not _integer(tensor)
                    or not tensor.numel() or len(parts) >= _SHOWN + 1):
                continue
            values = tensor.detach().to("cpu", torch.int64)
            top = int(values.max())
            at = tuple(int(i) for i in (values == top).nonzero()[0].tolist())
            rows = (at[_axis(case, tensor)],) if len(at) > _axis(case, tensor) else ()
            sample = _samples(case, tensor, rows, _axis(case, tensor))
            whose = f", sample {sample[0]}" if sample else ""
            parts.append(f"{name} {int(values.min())}..{top} ({top} at {list(at)}{whose})")
    return f"; its integer inputs hold {', '.join(parts)}" if parts else ""


def _model_name(case: Case) -> str:
    table = case.literals.get(MODULE_KEY)
    if isinstance(table, Mapping) and table.get("factory"):
        return str(table["factory"]).rpartition(":")[2]
    return f"the call {case.call}"


# Messages that name the refused value: (pattern, kind); ``size`` when they say the range.
_NAMED = (
    (re.compile(r"index (?P<value>-?\d{1,19}) is out of bounds for dimension (?P<dim>\d{1,3}) "
                r"with size (?P<size>\d{1,19})"), "index"),
    (re.compile(r"Target (?P<value>-?\d{1,19}) is out of bounds"), "target"),
)


def _named_by_message(case: Case, tensors: Mapping[str, torch.Tensor],
                      message: str | None) -> Offending | None:
    """The value the error message names (``Target 19 is out of bounds``, ``index 4 is out
    of bounds for dimension 1 with size 4``), found in the one saved integer input that holds
    it; None when the message names none, or no input or several hold it."""
    if message is None:
        message = str(case.origin.get("error", ""))
    for pattern, kind in _NAMED:
        hit = pattern.search(message)
        if hit is None:
            continue
        value = int(hit["value"])
        holders = [name for name, tensor in tensors.items()
                   if not name.startswith((STATE_PREFIX, "context.")) and _integer(tensor)
                   and tensor.numel() and bool((tensor == value).any())]
        if len(holders) != 1:
            return None
        if hit.groupdict().get("size") is not None:
            size = int(hit["size"])
            check = _Check(holders[0], 0, size - 1,
                           f"dimension {hit['dim']} it indexes has size {size}", kind)
        else:  # the range is not in the case: the entries holding the named value
            check = _Check(holders[0], value, value, "the error names this value; the valid "
                           "range is not saved in the case", kind, only=True)
        return _measure(case, tensors[holders[0]], check)
    return None


def _map_into(found: Offending, tensor: torch.Tensor, case: Case,
              tensors: Mapping[str, torch.Tensor]) -> Offending | None:
    """``found`` re-read in the saved input of ``case`` that holds the same values (the same
    tensor, or a view of it: ``targets.view(-1)``), with its positions and sample ids."""
    import torch

    from pytest_gpucase.tools.minimize import one_thread

    if found.check is None:
        return None
    with one_thread():
        flat = tensor.detach().reshape(-1)
        for name, other in tensors.items():
            if (name.startswith((STATE_PREFIX, "context.")) or other.numel() != flat.numel()
                    or other.dtype != tensor.dtype or other.dim() == 0):
                continue
            if not torch.equal(other.detach().reshape(-1), flat):
                continue
            return _measure(case, other, replace(found.check, field=name))
    return _same_values(found, case, tensors)


def _same_values(found: Offending, case: Case,
                 tensors: Mapping[str, torch.Tensor]) -> Offending | None:
    """The one saved integer input of ``case`` holding, outside the same range, every value
    the failing op refused, when none holds the op's very tensor: a slice or a shift of it
    (a language model's ``labels[..., 1:]``) reached the op."""
    assert found.check is not None
    held = []
    for name, other in tensors.items():
        if name.startswith((STATE_PREFIX, "context.")) or not _integer(other) or \
                other.dim() == 0:
            continue
        measured = _measure(case, other, replace(found.check, field=name))
        if measured is not None and all(bool((other == value).any()) for value in found.values):
            held.append(measured)
    if len(held) != 1:
        return None
    return replace(held[0], how="not the very tensor the failing op got, a slice or a "
                                "shift of it holding the same out-of-range values")


def _case_arg(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)

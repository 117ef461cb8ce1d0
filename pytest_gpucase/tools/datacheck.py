"""``gpucase data-check``: a case whose failure is in its saved batch turned into what still
guards against it once the data is fixed.

A case that froze a batch holding a token id equal to the vocabulary size stays XFAIL
forever after the data fix: its batch still holds the token. This writes, beside it and
never over it:

- a regression case without the offending samples (``<case>_clean``): the same call and
  state, every input and target that shares the batch axis cut along it (``minimize``'s
  ``plan_axes`` and ``select``: one rule for both), no xfail line, so that it is expected to
  pass; it is run once here to say whether it does;
- the data contract the case revealed (``<case>.contract.toml``): each checked field, its
  dtype and its valid range, which ``pytest_gpucase.checks.check_batch`` applies to any
  batch of the user's own (docs/recorder.md, "After a data fix").

The offending values are those ``tools.offending`` reads from the case's saved inputs; a
case whose failure is no index, target or class-range error, or whose offending value the
batch does not hold (a model that computed it), is refused with the reason.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from pytest_gpucase.base.errors import display
from pytest_gpucase.case import payload
from pytest_gpucase.case.keys import argument_path
from pytest_gpucase.case.load import load_case, read_case_file
from pytest_gpucase.case.model import CASE_FILE, EXPECTED_FILE, INPUTS_FILE, MAX_CASE_BYTES, Case
from pytest_gpucase.case.write import write_case_dir
from pytest_gpucase.tools.checks import CONTRACT_FORMAT
from pytest_gpucase.tools.minimize_write import free_path, origin_path
from pytest_gpucase.tools.offending import Offending, find

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

    from pytest_gpucase.tools.minimize import Axes

__all__ = ["DataCheck", "NotADataFailure", "batch_field", "contract_text", "data_check"]

_NOT_COPIED = {CASE_FILE, INPUTS_FILE, EXPECTED_FILE, "__pycache__"}


class NotADataFailure(Exception):
    """The case's failure is not a value its saved batch holds: nothing to turn into a check."""


@dataclass(frozen=True)
class DataCheck:
    """What ``data_check`` wrote, and what the new case did here."""

    original: Path
    contract: Path | None
    case: Path | None                 # None: every entry of the batch was offending
    axis: int
    dropped: tuple[int, ...]          # entries removed along the axis
    dropped_ids: tuple[str, ...]
    kept: int
    passes: bool | None = None        # the new case's run here; None when not run
    verdict: str = ""                 # its summary when it did not pass
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        lines = [f"gpucase data-check: {display(self.original)}"]
        which = ", ".join(map(str, self.dropped[:10])) + (" …" if len(self.dropped) > 10 else "")
        noun = "sample" if len(self.dropped_ids) == 1 else "samples"
        ids = f" ({noun} {', '.join(self.dropped_ids[:10])})" if self.dropped_ids else ""
        lines.append(f"  offending entries on axis {self.axis}: {which}{ids}")
        if self.case is None:
            lines.append("  every entry holds an offending value: no regression case is left "
                         "to write")
        else:
            lines.append(f"  wrote {display(self.case)}: {self.kept} of "
                         f"{self.kept + len(self.dropped)} entries kept, expected to pass")
            if self.passes is True:
                lines.append("  it passes here")
            elif self.passes is False:
                lines.append(f"  it does NOT pass here: {self.verdict}; the rest of the batch "
                             "fails too, so the failure is not the offending samples alone")
        if self.contract is not None:
            lines.append(f"  wrote {display(self.contract)}: check your batches with "
                         f"pytest_gpucase.checks.check_batch(batch, \"{display(self.contract)}\")")
        lines.append(f"  {display(self.original)} is kept: delete it once the data is fixed")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def data_check(case_dir: Path, *, output: Path | None = None, contract: Path | None = None,
               inputs: Sequence[str] | None = None, run: bool = True) -> DataCheck:
    """Write the regression case without the offending samples (at ``output``, default
    ``<case>_clean`` beside it) and the data contract (at ``contract``, default
    ``<case>.contract.toml`` beside it); ``run``: run the new case once here. Raises
    ``NotADataFailure`` when the saved batch holds no offending value, ``FileExistsError``
    when a target exists."""
    from pytest_gpucase.tools.minimize import Selection, one_thread, select

    case = load_case(Path(case_dir))
    found = _offending(case)
    target, where = _targets(case, output, contract)
    with one_thread():
        tensors = payload.load(case.inputs_file)
    axes = _axes(case, tensors, found, inputs)
    size = axes.batch_size or 0
    kept = tuple(i for i in range(size) if i not in set(found.rows))
    ids = case.origin.get("sample_ids")
    ids = ids if isinstance(ids, list) and len(ids) == size else None
    written = (_write_contract(where, case, found)
               if found.check is not None and not found.check.only else None)
    notes = [] if written is not None else [
        "no contract written: the valid range is not saved in the case (the error named the "
        "value only)"]
    result = DataCheck(original=case.path, contract=written, case=None, axis=axes.batch_axis,
                       dropped=found.rows, dropped_ids=tuple(str(ids[i]) for i in found.rows)
                       if ids else (), kept=len(kept), notes=tuple(notes))
    if not kept:
        return result
    _, metadata = payload.read_header(case.inputs_file)
    metadata = {k: v for k, v in metadata.items() if k != payload.LAYOUT_KEY}
    with one_thread():
        cut = select(tensors, axes, Selection(entries=kept))
        document = _document(case, target, found, kept, ids, written)
        new = write_case_dir(target, document,
                             {INPUTS_FILE: lambda path: payload.save(path, cut, metadata)},
                             [p for p in case.path.iterdir() if p.name not in _NOT_COPIED],
                             check=load_case)
    outcome = _run(new) if run else None
    return replace(result, case=new, passes=None if outcome is None else outcome[0],
                   verdict="" if outcome is None else outcome[1],
                   notes=(*notes, *_left_out(case)))


def _targets(case: Case, output: Path | None, contract: Path | None) -> tuple[Path, Path]:
    """Where the new case and the contract go: given, else beside the case; never over a file."""
    target = output if output is not None else free_path(case.path.with_name(f"{case.name}_clean"))
    where = contract if contract is not None else case.path.with_name(
        f"{case.name}.contract.toml")
    for path in (target, where):
        if path.exists():
            raise FileExistsError(f"{display(path)} exists; data-check never overwrites, give "
                                  "another path")
    if target.resolve().is_relative_to(case.path.resolve()):
        raise NotADataFailure(f"{display(target)} lies inside the case it derives from; write "
                              "the new case beside it")
    return target, where


def _axes(case: Case, tensors: Mapping[str, torch.Tensor], found: Offending,
          inputs: Sequence[str] | None) -> Axes:
    """The batch axis and its members (minimize's rule); in doubt (an op's indices (B, T)
    beside a weight (V, D)), the input holding the offending values alone."""
    from pytest_gpucase.plan.runs import NotRunnable
    from pytest_gpucase.tools.minimize import plan_axes

    try:
        axes = plan_axes(case, tensors, tuple(inputs) if inputs is not None else None)
    except NotRunnable:
        if inputs is not None:
            raise
        axes = plan_axes(case, tensors, (found.field,))
    if found.field not in axes.batch_members or axes.batch_axis != found.axis:
        raise NotADataFailure(
            f"{display(case.path)}: {found.field} does not follow the batch axis "
            f"{axes.batch_axis} ({', '.join(sorted(axes.batch_members)) or 'no input does'}): "
            "the offending entries cannot be cut as samples; name the inputs that hold the "
            "samples with --inputs")
    return axes


def _left_out(case: Case) -> list[str]:
    notes = []
    if case.expected_file.exists():
        notes.append(f"{EXPECTED_FILE} is not copied: its golden outputs belong to the full "
                     "batch; write new ones with --gpu-cases-regen")
    if _has_hash(case):
        notes.append("inputs_sha256 is left out: the new payload has its own; pin it again "
                     "with the line gpucase show prints")
    return notes


def _offending(case: Case) -> Offending:
    """The offending values the case's saved batch holds, or NotADataFailure saying why not."""
    found = find(case, replay=True)   # it runs the new case too
    if found is None:
        error = str(case.origin.get("error", "")).partition("\n")[0] or "no recorded error"
        raise NotADataFailure(
            f"{display(case.path)}: its failure ({error}) is not an index, target or "
            "class-range error, the data failures data-check turns into a data check; a "
            "case that fails for its code turns XPASS once the code is fixed")
    offending = found.offending
    if offending is None:
        raise NotADataFailure(f"{display(case.path)}: the offending value {found.why}")
    if not offending.saved or Path(offending.case) != case.path:
        raise NotADataFailure(
            f"{display(case.path)}: no saved input holds the offending value "
            f"({offending.describe()}): the model computed it, so a data fix cannot be the "
            "fix; fix the code and the case turns XPASS")
    return offending


def contract_text(case: Case, found: Offending, where: Path) -> str:
    """The contract file: a header saying where it comes from and how to use it, then one
    ``[fields.NAME]`` table (dtype, min, max, allowed, reason)."""
    assert found.check is not None
    held = found.alias if found.alias is not None else found
    field = batch_field(case, held.field)
    rule: dict[str, Any] = {"dtype": _dtype(case, held.field), "min": found.check.low,
                            "max": found.check.high}
    if found.check.allowed is not None:
        rule["allowed"] = [found.check.allowed]
    rule["reason"] = found.check.size
    header = [
        f"# The data contract the case {case.name} revealed (gpucase data-check):",
        f"# {replace(held, field=field, label=None, alias=None).sample_words()}.",
        "# Check your own batches with it before they reach the model, in a test or the loop:",
        "#",
        "#     from pytest_gpucase.checks import check_batch",
        (f"#     check_batch(batch, \"{where.as_posix()}\")   # as your DataLoader yields it"
         if field != held.field else
         f"#     check_batch({{{field!r}: tensor}}, \"{where.as_posix()}\")"),
        "#",
        "# It raises ValueError naming each value outside [min, max] (allowed: an ignore_index),",
        "# its position and, given sample_ids=, its sample. docs/recorder.md, After a data fix.",
    ]
    doc = {"format": CONTRACT_FORMAT, "case": case.name, "fields": {field: rule}}
    return "\n".join(header) + "\n" + tomli_w.dumps(doc)


def batch_field(case: Case, name: str) -> str:
    """The contract's name of the payload tensor ``name``: its key path in the argument as the
    user's code passed it (``targets`` for a Lightning step's ``batch["targets"]``, saved as
    ``dict.batch.targets`` or ``nested.batch.targets``; ``1`` for a tuple's second item), so
    that ``check_batch(batch, contract)`` reads the very batch the DataLoader yields; the
    argument's name for a tensor passed alone."""
    found = argument_path(case.literals, name)
    if found is None:
        return name
    arg, path = found
    return ".".join(path) if path else arg


def _write_contract(where: Path, case: Case, found: Offending) -> Path:
    from pytest_gpucase.base.files import write_atomic

    where.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(where, [contract_text(case, found, where).encode("utf-8")])
    return where


def _dtype(case: Case, name: str) -> str:
    for info in payload.describe(case.inputs_file):
        if info.name == name:
            return payload.DTYPES.get(info.dtype, (info.dtype, 0))[0]
    return "int64"


def _has_hash(case: Case) -> bool:
    text = read_case_file(case.case_file, MAX_CASE_BYTES, "a case.toml holds settings, not "
                          "data", case.path).decode("utf-8", "replace")
    return "inputs_sha256" in tomllib.loads(text)


def _document(case: Case, target: Path, found: Offending, kept: Sequence[int],
              ids: list[Any] | None, contract: Path | None) -> dict[str, Any]:
    """The new case.toml: the original's, without xfail and the inputs' hash, expecting the
    outputs to match, its origin naming what was cut and why."""
    text = read_case_file(case.case_file, MAX_CASE_BYTES, "a case.toml holds settings, not "
                          "data", case.path).decode("utf-8", "replace")
    doc = tomllib.loads(text)
    doc.pop("xfail", None)
    doc.pop("inputs_sha256", None)
    expect = dict(doc.get("expect", {}))
    for key in ("outcome", "exception", "match"):
        expect.pop(key, None)
    doc["expect"] = {"outcome": "matches", **expect}
    origin = dict(doc.get("origin", {}))
    if ids is not None:
        origin["sample_ids"] = [ids[i] for i in kept]
    record: dict[str, Any] = {
        "case": origin_path(case.path, target),
        "inputs": payload.content_hash(case.inputs_file),
        "axis": found.axis,
        "dropped": list(found.rows),
        "offending": found.describe(),
    }
    if ids is not None:
        record["dropped_sample_ids"] = [ids[i] for i in found.rows]
    if contract is not None:
        record["contract"] = origin_path(contract, target)
    origin["data_check_from"] = record
    doc["origin"] = origin
    return doc


def _run(case_dir: Path) -> tuple[bool, str]:
    """Whether the new case passes here, and its summary when it does not (the runs of an
    unchanged case on the first device it can run on)."""
    import torch  # noqa: F401 - imported before the child forks, as minimize does

    from pytest_gpucase.plan.runs import choose_device, unchanged_runs
    from pytest_gpucase.run.probe import probe
    from pytest_gpucase.run.runcontext import RunContext
    from pytest_gpucase.tools.minimize import first_failure

    case = load_case(case_dir)
    env = probe(tuple(case.matrix.packages))
    device = choose_device(case, env, None)
    failing, tried = first_failure(unchanged_runs(case, env, device=device),
                                   replace(RunContext.here(env.backend), localize=False).fresh())
    if failing is not None:
        return False, failing.outcome.summary.partition("\n")[0]
    skipped = [v for v in tried if v.outcome.status == "skipped"]
    if tried and len(skipped) == len(tried):
        return False, "every run was skipped here: " + skipped[0].outcome.summary
    return True, ""


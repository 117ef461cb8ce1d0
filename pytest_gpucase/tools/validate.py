"""The dry run behind ``gpucase validate``: everything that can be checked without running a case.

For each case directory: ``case.toml`` loads; the payloads are present where
needed and readable (headers and bounds; the hash when one is named); the
call and reference resolve (a ``FILE.py`` defines the function, read with
``ast``; a module is found with ``importlib.util.find_spec`` and never
imported, on the ``sys.path`` a run gets from ``project.import_paths``); the
inputs bind to the function's parameters; each variant axis is within the
rank of the inputs that follow it, and its resized inputs within bounds.
Case code is never executed in this process, and torch is not imported here. One check
needs it: a module case's model is built as its replay builds it (``run.replay``), in a
fresh child as every run is, and held against the saved state: a parameter or buffer the
model gained or changed since the capture, or a saved entry it no longer takes, is named
before a run fails on it.

``Parameters``, ``binding_problems`` and ``rng_problems`` are shared with the
child (``execute``), so that a dry run and a run word the same mistake the same way.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pytest_gpucase.base.errors import CaseFormatError, display
from pytest_gpucase.base.files import file_sha256
from pytest_gpucase.base.text import one_line
from pytest_gpucase.case import payload, project
from pytest_gpucase.case.binding import Parameters, binding_problems, rng_problems
from pytest_gpucase.case.keys import MODULE_KEY, REPLAY_MODULE, checkpoint_path
from pytest_gpucase.case.load import load_case, read_case_file
from pytest_gpucase.case.model import (
    CASE_FILE,
    EXPECTED_FILE,
    INPUTS_FILE,
    MAX_CASE_BYTES,
    MAX_SOURCE_BYTES,
    AxisSizes,
    Case,
    Requirements,
    is_case_dir,
)
from pytest_gpucase.case.variants import (
    Shape,
    Variant,
    VariantNotApplicable,
    VariantTooLarge,
    applicable,
    case_shapes,
    check_size,
    class_indices_problem,
    header_shapes,
    index_dtype,
    members_of,
)

if TYPE_CHECKING:
    import torch

__all__ = ["REBUILD_TIMEOUT", "NotChecked", "hash_setting", "rebuild_check", "validate"]

# Files that only a case directory holds: a directory with one of them and no case.toml
# is a case that lost its case.toml (or was never finished).
_PAYLOADS = (INPUTS_FILE, EXPECTED_FILE)


def hash_setting(case_dir: Path) -> str | None:
    """``inputs_sha256 = "sha256:<hex>"`` for the payload in ``case_dir``, ready to paste into its
    case.toml; ``None`` without a payload that can be read (the dry run reports why).

    Needs only the file, not a loadable case.toml: a malformed hash is the case it mends.
    """
    file = Path(case_dir) / INPUTS_FILE
    if not os.path.lexists(file):
        return None
    try:
        return f'inputs_sha256 = "{payload.content_hash(file)}"'
    except (CaseFormatError, OSError):
        return None


def validate(paths: Sequence[Path], notes: list[str] | None = None,
             unchecked: list[str] | None = None, *, rebuild: bool = True) -> list[str]:
    """Every problem of the case directories under ``paths``, one line each; empty when all good.

    ``notes`` receives what was not checked here and why (a call into a package that
    ``[matrix.packages]`` requires and this environment lacks: the run skips the case, so
    the dry run must not fail it); notes are no problems. ``unchecked`` receives the line
    of each case that could not be checked at all (whatever it raised: a RecursionError,
    a MemoryError), also among the problems: the other cases are checked all the same.
    ``rebuild``: a module case's model is built as its replay builds it, in a child, and
    checked against the saved state (``_rebuild_problems``); off, no case code runs at all.
    """
    problems: list[str] = []
    notes = [] if notes is None else notes
    unchecked = [] if unchecked is None else unchecked
    for path in paths:
        path = Path(path)
        if path.name == CASE_FILE and not path.is_dir():
            path = path.parent
        if not os.path.lexists(path):
            problems.append(f"{display(path)}: not found")
            continue
        if not path.is_dir():
            problems.append(f"{display(path)}: not a directory; give a case directory or a "
                            "folder of cases")
            continue
        found = False
        for directory in _case_dirs(path):
            found = True
            try:
                problems.extend(_problems(directory, notes, rebuild))
            except NotChecked as exc:
                unchecked.append(str(exc))
                problems.append(unchecked[-1])
            except Exception as exc:
                unchecked.append(f"{display(directory / CASE_FILE)}: cannot be checked: "
                                 f"{type(exc).__name__}: {one_line(str(exc), 300)}")
                problems.append(unchecked[-1])
        if not found:
            problems.append(f"{display(path)}: no case directory (with a {CASE_FILE}) under "
                            f"{display(path)}")
    notes.extend(_store_notes(paths))
    return problems


class NotChecked(CaseFormatError):
    """A case that cannot be checked at all (its source defeats the parser): one line for
    it, the other cases checked all the same, and validate exits 2."""


def _store_notes(paths: Sequence[Path]) -> list[str]:
    """A note per capture store holding files no case names (``tools.store``): they cost
    disk and get committed with the cases; ``gpucase store --prune`` removes them."""
    from pytest_gpucase.tools.record.origin import mib
    from pytest_gpucase.tools.store import orphans, stores_under

    lines = []
    for store in stores_under([Path(p) for p in paths]):
        found = orphans(store)
        if found.files:
            lines.append(f"{display(store)}: {len(found.files)} file(s) no case names "
                         f"({mib(found.total)}): gpucase store --prune "
                         f"{display(store.parent)} removes them")
    return lines


def _case_dirs(root: Path) -> Iterable[Path]:
    """Case directories at or under ``root``, and directories that look like lost cases.

    Hidden directories are skipped, as pytest's collection skips them: they hold
    cases being written, not cases.
    """
    for current, dirs, files in os.walk(root):
        here = Path(current)
        if here != root and here.name.startswith("."):
            dirs[:] = []
            continue
        if is_case_dir(here) or any(name in files for name in _PAYLOADS):
            dirs[:] = []  # a case does not hold cases
            yield here
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")


def _problems(directory: Path, notes: list[str], rebuild: bool) -> list[str]:
    """The problems of one case directory, each as ``file: key: what is wrong``."""
    try:  # a directory holding payloads and no case.toml: load_case words it
        case = load_case(directory)
    except CaseFormatError as exc:
        return [str(exc)]
    except Exception as exc:  # whatever a file holds, the dry run reports it and goes on
        return [f"{display(directory / CASE_FILE)}: cannot be loaded: {type(exc).__name__}: "
                f"{exc}"]
    problems: list[CaseFormatError] = []
    problems.extend(_incomplete(case))
    problems.extend(_module_problems(case))
    infos = _payloads(case, problems)
    shapes = None if infos is None else header_shapes(infos)
    tensors = None if shapes is None else set(shapes)
    readable = shapes is not None or not os.path.lexists(case.inputs_file)
    clash = sorted((tensors or set()) & set(case.literals))
    if clash:
        problems.append(CaseFormatError(case.case_file, f"{', '.join(clash)} given both here "
                                        f"and in {INPUTS_FILE}; keep one", key="[inputs]"))
    if readable:
        problems.extend(rng_problems(case, tensors or ()))
    problems.extend(_boundaries_problems(case, infos, tensors, readable))
    _target_problems(case, readable, tensors, notes, problems)
    if readable:
        problems.extend(_variant_problems(case, shapes or {}))
    problems.extend(_origin_problems(case))
    if readable and rebuild and not problems and _unmet_requirement(case) is None:
        problems.extend(_rebuild_problems(case, notes))
    return [str(problem) for problem in problems]


def _boundaries_problems(case: Case, infos: list[payload.TensorInfo] | None,
                         tensors: set[str] | None, readable: bool) -> list[CaseFormatError]:
    """Whether ``[variants] boundaries`` names a saved tensor of a class-index dtype."""
    problems: list[CaseFormatError] = []
    boundaries = case.variants.boundaries
    # An unreadable payload is reported once, not again as a missing input.
    if boundaries is not None and readable and (tensors is None
                                                or boundaries.input not in tensors):
        where = (f"{INPUTS_FILE} holds {', '.join(sorted(tensors)) or 'no tensors'}"
                 if tensors is not None else f"there is no {INPUTS_FILE}")
        problems.append(CaseFormatError(
            case.case_file, f"input '{boundaries.input}' is not a saved tensor ({where})",
            key="[variants] boundaries"))
    elif boundaries is not None and infos is not None:
        dtypes = {info.name: payload.DTYPES[info.dtype][0] for info in infos}
        problem = class_indices_problem(boundaries.input, dtypes[boundaries.input],
                                        [n for n, d in dtypes.items() if index_dtype(d)])
        if problem is not None:
            problems.append(CaseFormatError(case.case_file, problem, key="[variants] boundaries"))
    return problems


def _target_problems(case: Case, readable: bool, tensors: set[str] | None, notes: list[str],
                     problems: list[CaseFormatError]) -> None:
    """The call's and the reference's signature problems, appended; a note where unchecked."""
    targets = [("call", case.call)] + ([("reference", case.reference)]
                                       if case.reference and case.reference != case.call else [])
    unmet = _unmet_requirement(case)
    if unmet is not None:  # the run skips the case here: its code is not checked either
        notes.append(f"{display(case.case_file)}: call and reference not checked here: {unmet}")
        targets = []
    for key, target in targets:
        params = _parameters(case, key, target, problems)
        if params is not None and readable:
            problems.extend(binding_problems(case, target, params, tensors))


def _origin_problems(case: Case) -> list[CaseFormatError]:
    """A minimized case that records another failure than the one it was captured with.

    ``gpucase minimize`` keeps only tries that fail the same way (``verdict.failure``) and
    writes the failure it kept as ``[origin.minimized_from] error``; a case whose kept
    failure is not ``[origin] error`` (an older minimize compared exception types only, or
    a hand edit) replays another bug than the one it documents.
    """
    from pytest_gpucase.verdict.failure import Failure, same_failure

    origin = case.origin
    minimized = origin.get("minimized_from")
    if not isinstance(minimized, Mapping):
        return []
    kept, error = minimized.get("error"), origin.get("error")
    if not isinstance(kept, str) or not isinstance(error, str) or not error.strip():
        return []
    known = origin.get("failure_class")
    recorded = Failure.from_text(error, str(origin.get("stderr", "")),
                                 str(origin.get("backend", "")) or None,
                                 known if isinstance(known, str) else None)
    found = Failure.from_text(kept, device=str(minimized.get("device", "")) or None)
    if recorded.error_type is None or same_failure(recorded, found):
        return []
    return [CaseFormatError(case.case_file, f"the minimized case fails with {found.describe()!r}"
                            f", not the captured failure {recorded.describe()!r} ([origin] "
                            "error): it reproduces another bug; minimize the original again "
                            "with this gpucase", key="[origin.minimized_from] error")]


def _payloads(case: Case, problems: list[CaseFormatError]) -> list[payload.TensorInfo] | None:
    """The saved inputs' header (``None`` without a readable payload); problems appended."""
    shapes: list[payload.TensorInfo] | None = None
    for file in (case.inputs_file, case.expected_file):
        if not os.path.lexists(file):
            continue
        try:
            infos = payload.describe(file)
        except CaseFormatError as exc:
            problems.append(exc)
            continue
        if file == case.inputs_file:
            shapes = infos
        try:
            hashed: set[Path] = set()
            for name, blob in payload.store_files(file).items():
                if blob in hashed:
                    continue  # one file named for several tensors: hashed once
                hashed.add(blob)
                payload.store_info(blob)  # checked as a store file before it is hashed
                if payload.content_hash(blob) != f"sha256:{blob.stem}":
                    problems.append(CaseFormatError(
                        file, f"tensor '{name}': its store file {blob.parent.name}/"
                        f"{blob.stem[:12]}… does not hold what its name (its sha256) says: "
                        "changed or corrupted since the capture; capture the case again"))
        except (CaseFormatError, OSError) as exc:
            problems.append(exc if isinstance(exc, CaseFormatError)
                            else CaseFormatError(file, f"cannot be read: {exc}"))
    if case.inputs_sha256 is not None:
        if not os.path.lexists(case.inputs_file):
            problems.append(CaseFormatError(
                case.case_file, f"names a hash but {INPUTS_FILE} is missing; restore the file or "
                "remove the key", key="inputs_sha256"))
        elif shapes is not None:
            found = payload.content_hash(case.inputs_file)
            if found != case.inputs_sha256:
                problems.append(CaseFormatError(
                    case.inputs_file, f"content hash {found} differs from inputs_sha256 in "
                    f"{CASE_FILE} (changed or corrupted since the case was saved); restore it, "
                    f"or if the change is intended set inputs_sha256 = \"{found}\""))
    return shapes


def _incomplete(case: Case) -> list[CaseFormatError]:
    """What the Recorder wrote it could not save (``[origin] incomplete``): each a problem,
    since such a case cannot replay its failure until it is completed."""
    reasons = case.origin.get("incomplete", ())
    if isinstance(reasons, str):
        reasons = [reasons]
    if not isinstance(reasons, (list, tuple)):
        return []
    return [CaseFormatError(case.case_file, str(reason), key="[origin] incomplete")
            for reason in reasons]


def _module_problems(case: Case) -> list[CaseFormatError]:
    """A module case's rebuild: the files its ``case.py`` reads (``model.json``, a config, the
    script it loads the class from) and the checkpoint it references, present and unchanged."""
    import json

    recipe = case.literals.get(MODULE_KEY)
    if case.call != REPLAY_MODULE or not isinstance(recipe, dict):
        return []
    key = f"[inputs] {MODULE_KEY}"
    problems: list[CaseFormatError] = []
    reference = recipe.get("checkpoint")
    if isinstance(reference, dict):
        path = checkpoint_path(case.path, reference)
        if not path.is_file():
            problems.append(CaseFormatError(case.case_file, f"names {path}, which is not a file "
                                            "here: the model's state is in that checkpoint",
                                            key=f"{key}.checkpoint"))
        else:
            found = file_sha256(path)
            if found != reference.get("sha256"):
                problems.append(CaseFormatError(
                    case.case_file, f"{path} has sha256 {found}, not the {reference.get('sha256')} "
                    "recorded: the checkpoint changed since the capture, so the case would "
                    "replay another model", key=f"{key}.checkpoint"))
    model_file = case.path / "model.json"
    if str(recipe.get("factory", "")).startswith("case.py:") and model_file.exists():
        try:
            model = json.loads(read_case_file(model_file, MAX_CASE_BYTES, "write it as the "
                                              "Recorder does", case.path))
        except CaseFormatError as exc:
            return [*problems, exc]
        except (OSError, ValueError, RecursionError) as exc:
            return [*problems, CaseFormatError(model_file, f"cannot be read: {exc}")]
        for name in ("config", "script"):
            if isinstance(model, dict) and model.get(name):
                needed = case.path / str(model[name])
                if not needed.is_file():
                    problems.append(CaseFormatError(
                        model_file, f"{name} {model[name]} is not a file here: the model is "
                        "rebuilt from it"))
    return problems


def _unmet_requirement(case: Case) -> str | None:
    """Why the run skips ``case`` here for a ``[matrix.packages]`` requirement this environment
    does not meet (the reason ``pytest --gpu-cases`` gives), else None.

    Any unmet requirement skips the whole case, so none of its code runs here and its
    imports cannot be checked either, whatever module provides the package (flash-attn-3
    installs flash_attn_interface: a name match missed it).
    """
    from pytest_gpucase.plan.environment import Environment, package_version
    from pytest_gpucase.plan.runs import evaluate

    if not case.matrix.packages:
        return None
    env = Environment(backend="cpu", device_types=("cpu",),
                      packages={name: package_version(name) for name in case.matrix.packages})
    return evaluate(Requirements(packages=dict(case.matrix.packages)), env)


def _parameters(case: Case, key: str, target: str,
                problems: list[CaseFormatError]) -> Parameters | None:
    """The parameters of ``target`` read from its source, or ``None`` when they cannot be known
    without running code (a decorated function, a method, an assigned name)."""
    where, _, qualname = target.partition(":")
    if where.endswith(".py"):
        source = case.path / where
    else:
        with project.importable(case.path):  # as the run will import it
            found = _find_module(where)
        if found is None:
            problems.append(CaseFormatError(
                case.case_file, f"module '{where}' is not importable here; install it, or "
                "correct the name", key=key))
            return None
        if not found.endswith(".py"):
            return None  # an extension module or a namespace package: nothing to read
        source = Path(found)
    try:
        text = read_case_file(source, MAX_SOURCE_BYTES, "make it a Python source file",
                              case.path if where.endswith(".py") else None)
        tree = ast.parse(text, filename=str(source))
    except CaseFormatError as exc:
        problems.append(exc)
        return None
    except SyntaxError as exc:
        problems.append(CaseFormatError(source, f"line {exc.lineno}: {exc.msg}; the {key} cannot "
                                        "be imported until the syntax is fixed"))
        return None
    except (OSError, ValueError) as exc:
        problems.append(CaseFormatError(source, f"cannot be read: {exc}"))
        return None
    except (RecursionError, MemoryError) as exc:  # `Y = 1+1+...`: too deep for the parser
        raise NotChecked(source, f"cannot be parsed ({type(exc).__name__}: {exc}); Python "
                         "itself will fail to import it: write it in plainer statements"
                         ) from None
    node = _defined(tree.body, qualname.split("."))
    if node is _UNKNOWN:
        return None
    if node is None:
        problems.append(CaseFormatError(
            case.case_file, f"'{where}' has no '{qualname}'; check the name after the colon",
            key=key))
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
        return Parameters.of_function(node)
    return None  # a class, a method or a decorated function: its signature needs running code


_UNKNOWN = ast.Pass()  # a name bound in a way the source alone cannot follow


def _defined(body: list[ast.stmt], parts: list[str]) -> ast.AST | None:
    """The statement defining ``parts[0]`` at the top of ``body`` (then ``parts[1]`` in it).

    A name bound twice where one binding sits in a branch (``try``/``if``)
    depends on which branch ran: it is ``_UNKNOWN``, as any binding but a
    ``def`` or ``class`` is.
    """
    name = parts[0]
    bindings: list[tuple[ast.AST, bool]] = []
    for statement, nested in _top_statements(body, nested=False):
        bindings.extend((found, nested) for found in _bindings(statement, name))
    if not bindings:
        return None
    found = bindings[-1][0]
    if len(bindings) > 1 and any(nested for _, nested in bindings):
        found = _UNKNOWN
    if found is _UNKNOWN or len(parts) == 1:
        return found
    if isinstance(found, ast.ClassDef):
        inner = _defined(found.body, parts[1:])
        return _UNKNOWN if inner is None else inner  # an inherited method is not in the source
    return _UNKNOWN


def _bindings(statement: ast.stmt, name: str) -> list[ast.AST]:
    """What ``statement`` binds ``name`` to, once per binding (``_UNKNOWN`` but a def/class)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement] if statement.name == name else []
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [_UNKNOWN for alias in statement.names
                if alias.name == "*" or (alias.asname or alias.name.split(".")[0]) == name]
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For,
                              ast.AsyncFor, ast.With, ast.AsyncWith)):
        targets = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)
                   and isinstance(n.ctx, ast.Store)}
        return [_UNKNOWN] if name in targets else []
    if any(isinstance(n, ast.NamedExpr) for n in ast.walk(statement)):
        return [_UNKNOWN]
    return []


def _top_statements(body: list[ast.stmt], nested: bool) -> Iterable[tuple[ast.stmt, bool]]:
    """Statements run at import, and whether they sit in a branch (``if``, ``try``, a loop)."""
    for statement in body:
        yield statement, nested
        if isinstance(statement, (ast.If, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor,
                                  ast.While)):
            yield from _top_statements(statement.body, True)
            yield from _top_statements(getattr(statement, "orelse", []), True)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody,
                          *(handler.body for handler in statement.handlers)):
                yield from _top_statements(block, True)


def _find_module(name: str) -> str | None:
    """Where ``name`` would be imported from (a file, or "" for no file), without importing it.

    ``importlib.util.find_spec`` imports the parent packages of a dotted name;
    only the top-level name is looked up that way, the rest in its package's
    search path.
    """
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for depth in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[:depth + 1]), list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin if spec.has_location and spec.origin else ""


def _variant_problems(case: Case, shapes: Mapping[str, Shape]) -> list[CaseFormatError]:
    """Each ``batch``/``length`` axis within the rank of the inputs, its sizes within bounds."""
    problems = []
    shapes = case_shapes(case, shapes)  # as the variants see them: no RNG state, no state dict
    tables = case.variants
    anchor = tables.boundaries.input if tables.boundaries is not None else None
    axes: tuple[tuple[Literal["batch", "length"], AxisSizes | None], ...] = (
        ("batch", tables.batch), ("length", tables.length))
    for kind, table in axes:
        if table is None:
            continue
        key = f"[variants] {kind}"
        try:
            found = members_of(shapes, table.axis, anchor, table.inputs, table=kind)
        except VariantNotApplicable as exc:
            problems.append(CaseFormatError(case.case_file, str(exc), key=key))
            continue
        if found is None:
            ranks = ", ".join(f"{name} {len(shape)}" for name, (shape, _) in sorted(shapes.items()))
            held = f"ranks: {ranks}" if ranks else f"no tensor in {INPUTS_FILE}"
            problems.append(CaseFormatError(
                case.case_file, f"axis {table.axis} is beyond the rank of every tensor input "
                f"({held}); give an axis the inputs have", key=key))
            continue
        for size in table.sizes:
            variant = Variant(kind, size, axis=table.axis, input=anchor, inputs=table.inputs)
            try:
                applicable(variant, shapes)  # the rule the run and gpucase show apply
                check_size(variant, shapes)
            except VariantNotApplicable as exc:
                problems.append(CaseFormatError(
                    case.case_file, f"{variant.label}: {exc}, so its item is always skipped; "
                    f"remove {size} from sizes", key=key))
            except VariantTooLarge as exc:
                problems.append(CaseFormatError(case.case_file, str(exc), key=key))
    return problems


# A rebuild's child: importing the model's code and building it on the meta device.
REBUILD_TIMEOUT = 300.0


def _rebuild_problems(case: Case, notes: list[str]) -> list[CaseFormatError]:
    """The model of a module case built as its replay builds it, in a fresh child (the case's
    code never runs in this process), and held against its saved state (``rebuild_check``);
    a child that could not tell is a note, not a problem."""
    recipe = case.literals.get(MODULE_KEY)
    if case.call != REPLAY_MODULE or not isinstance(recipe, dict) or not recipe.get("factory"):
        return []
    from pytest_gpucase.run.isolation import default_start_method, run_in_child

    result = run_in_child(rebuild_check, str(case.path), timeout=REBUILD_TIMEOUT,
                          start_method=default_start_method())
    if not result.returned or not isinstance(result.value, dict):
        detail = (result.child_error or "").strip().rpartition("\n")[2]
        notes.append(f"{display(case.case_file)}: its model's rebuild was not checked: the "
                     f"child {result.problem or 'returned no list'}"
                     + (f" ({one_line(detail, 300)})" if detail else ""))
        return []
    key = f"[inputs] {MODULE_KEY}"
    notes.extend(f"{display(case.case_file)}: [inputs] {MODULE_KEY}: {line}"
                 for line in result.value.get("notes", ()))
    return [CaseFormatError(case.case_file, str(line), key=key)
            for line in result.value.get("problems", ())]


def rebuild_check(case_dir: str) -> dict[str, list[str]]:
    """In a child: what keeps the saved state of the module case at ``case_dir`` from
    loading into its model built as the replay builds it (``run.replay.constructed``, its
    parameters on meta), one line each under ``problems``: a parameter or buffer the model
    has and the state lacks, a saved entry the model does not take, a shape that differs
    (each fails ``load_state_dict(strict=True)``, so every run). Under ``notes``, a dtype
    of another kind (integer, floating, complex, bool): the replay assigns the saved tensor,
    dtype and all, so it replays as captured, but the code changed. Entries the capture
    marked unstorable (``[origin] unsaved_state``) are reported as the case's
    incompleteness, not here again.
    """
    from pytest_gpucase.case.keys import CODE_OWNED, REPLAY_ENV
    from pytest_gpucase.run.child import resolve
    from pytest_gpucase.run.replay import constructed, with_aliases

    os.environ[REPLAY_ENV] = "1"  # a Recorder in the user's code records nothing here
    case = load_case(Path(case_dir))
    project.prepend(project.import_paths(case.path))
    recipe = dict(case.literals[MODULE_KEY])
    saved = _saved_state(case, recipe)
    if saved is None:
        return {}  # nothing to hold it against: the case says why (incomplete, checkpoint)
    with_aliases(recipe, saved)
    factory = str(recipe["factory"])
    try:
        make = resolve(case, factory, f"[inputs] {MODULE_KEY}.factory")
    except Exception as exc:  # run.child's _Failed: the words a run gives, and the cause
        outcome = getattr(exc, "outcome", None)
        cause = str(getattr(outcome, "details", "") or "").strip().rpartition("\n")[2]
        line = f"{exc}" + (f" ({one_line(cause, 300)})" if cause else "")
        if getattr(outcome, "kind", None) == "environment":  # a loader that refused it here
            return {"notes": [f"the model's rebuild was not checked here: {line}"]}
        return {"problems": [line]}
    try:
        try:
            module = constructed(make, recipe, on_meta=True)
        except Exception:  # a constructor that cannot run so: built as the replay then does
            module = constructed(make, recipe, on_meta=False)
    except Exception as exc:
        return {"problems": [f"building the model as its replay does ({factory}) raised "
                             f"{type(exc).__name__}: {one_line(str(exc), 300)}: every run of "
                             "the case fails on it"]}
    unsaved = case.origin.get("unsaved_state", {})
    # Entries the code owns are the constructor's, as the replay takes them (run.replay):
    # neither their absence nor their shape is a mismatch.
    owned = {str(key) for key in recipe.get(CODE_OWNED, ())}
    saved = {name: held for name, held in saved.items() if name not in owned}
    return _state_mismatch(module, saved,
                           (set(unsaved) if isinstance(unsaved, dict) else set()) | owned)


_Saved = dict[str, tuple[tuple[int, ...], "str | None"]]


def _saved_state(case: Case, recipe: Mapping[str, object]) -> _Saved | None:
    """Name -> (shape, dtype) of each saved state entry (its dtype None where the payload
    holds it as parts: complex, sparse, quantized), from the payload's header and the
    checkpoint the case references; None when the case holds no state to check against."""
    from pytest_gpucase.case.keys import STATE_PREFIX
    from pytest_gpucase.case.kinds import KINDS_KEY

    saved: _Saved = {}
    if os.path.lexists(case.inputs_file):
        _, metadata = payload.read_header(case.inputs_file)
        try:
            parted = json.loads(metadata.get(KINDS_KEY, "{}"))
        except (ValueError, RecursionError):
            parted = {}
        for info in payload.describe(case.inputs_file):
            if info.name.startswith(STATE_PREFIX):
                dtype = (None if isinstance(parted, dict) and info.name in parted
                         else payload.DTYPES[info.dtype][0])
                saved[info.name.removeprefix(STATE_PREFIX)] = (info.shape, dtype)
    reference = recipe.get("checkpoint")
    if isinstance(reference, Mapping):
        from pytest_gpucase.run.replay import load_checkpoint

        path = checkpoint_path(case.path, reference)
        try:
            held = load_checkpoint(path, str(reference.get("sha256", "")),
                                   str(reference.get("prefix", "")))
        except (OSError, ValueError):
            return None  # a checkpoint missing or changed: _module_problems says so
        for name, tensor in held.items():
            saved[name.removeprefix(STATE_PREFIX)] = (
                tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    if not saved and case.origin.get("incomplete"):
        return None
    return saved


def _dtype_kind(name: str) -> str:
    """bool, complex, integer or floating: what a cast of the whole model keeps."""
    if name == "bool" or name.startswith("complex"):
        return name.rstrip("0123456789")
    return "integer" if "int" in name and not name.startswith("float") else "floating"


def _state_mismatch(module: object, saved: _Saved, unsaved: set[str]) -> dict[str, list[str]]:
    """The lines of ``rebuild_check``: ``module`` (a torch module) against ``saved``."""
    import torch
    from torch.nn.parameter import is_lazy

    assert isinstance(module, torch.nn.Module)
    held = {name: value for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)}
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    lines = _names_problems(held, params, saved, unsaved)
    notes: list[str] = []
    shapes: list[str] = []
    for name, (shape, dtype) in saved.items():
        value = held.get(name)
        if value is None or is_lazy(value):  # a lazy entry is shaped by the state
            continue
        found = str(value.dtype).removeprefix("torch.")
        if tuple(value.shape) != tuple(shape):
            shapes.append(f"{name} is {list(shape)} in the saved state but "
                          f"{list(value.shape)}")
        elif (dtype is not None and not value.is_quantized and not value.is_sparse
              and _dtype_kind(dtype) != _dtype_kind(found)):
            notes.append(f"{name} is {dtype} in the saved state but {found} in the model "
                         "built as its replay builds it: the replay takes the saved tensor as "
                         "it is, but the code that made it changed since the capture")
    if shapes:
        lines.append(f"{_listed(shapes, 4)} in the model built as its replay builds it: its "
                     "code or its arguments changed since the capture, so every run of the "
                     "case fails to load the state")
    return {"problems": lines, "notes": notes}


def _names_problems(held: Mapping[str, torch.Tensor], params: set[str], saved: _Saved,
                    unsaved: set[str]) -> list[str]:
    """What the model has and the state lacks, and what the state holds the model does not
    take (entries the capture marked unstorable left out)."""
    lines: list[str] = []
    missing = [n for n in held if n not in saved and n not in unsaved]
    if missing:
        what = [f"{n} ({'parameter' if n in params else 'buffer'} "
                f"{list(held[n].shape)} {str(held[n].dtype).removeprefix('torch.')})"
                for n in missing]
        lines.append(f"the model built as its replay builds it has {_listed(what)}, which "
                     "the saved state lacks: its code changed since the capture, so every "
                     "run of the case fails to load the state; capture the case again with "
                     "this code, or restore the code the case was captured with")
    extra = [n for n in saved if n not in held and n not in unsaved]
    if extra:
        lines.append(f"the saved state holds {_listed(extra)}, which the model built as its "
                     "replay builds it does not take: its code changed since the capture; "
                     "capture the case again, or restore the code it was captured with")
    return lines


def _listed(names: Sequence[str], most: int = 8) -> str:
    more = len(names) - most
    return ", ".join(names[:most]) + (f" and {more} more" if more > 0 else "")

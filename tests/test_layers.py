"""The package's shape, held: layers that no import breaks, no import cycle, and the public
boundary (what users import, and what the plugin costs a plain pytest run).

Imports are read from the source (``ast``), wherever they stand: at module level, inside a
function, under ``TYPE_CHECKING``. Each failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import pytest_gpucase

PACKAGE = Path(pytest_gpucase.__file__).parent
BUNDLED = Path(__file__).parent.parent / "cases"
NAME = "pytest_gpucase"
# Each subpackage imports only those before it (and itself); the top-level modules (entry
# points and public facades) come last, and nothing inside a subpackage imports them.
LAYERS = ("base", "case", "verdict", "plan", "run", "report", "tools", "plugin")
TOP = len(LAYERS)
# Subpackages where torch may be imported at module level: the child's side of a run and
# the tools that work on tensors. Loading a case, planning, reporting and the plugin never.
TORCH_FREE = ("base", "case", "plan", "report", "plugin")


@dataclass(frozen=True)
class Import:
    importer: str     # dotted module name
    target: str       # dotted module name (a name imported from a module counts as the module)
    names: tuple[str, ...]
    line: int
    where: str        # "module", "function" or "TYPE_CHECKING"

    def shown(self) -> str:
        file = self.importer.replace(".", "/")
        file = file + ("/__init__.py" if (PACKAGE.parent / file).is_dir() else ".py")
        return f"{file}:{self.line} imports {self.target} ({self.where})"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "TYPE_CHECKING" if where == "module" else where
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == NAME:
                        found.append(Import(name, alias.name, (), child.lineno, inner))
            elif isinstance(child, ast.ImportFrom):
                module = _resolve(name, child, path.name == "__init__.py")
                if module.split(".")[0] == NAME:
                    for alias in child.names:
                        # ``from pytest_gpucase.run import isolation`` imports a module.
                        sub = f"{module}.{alias.name}"
                        target = sub if sub in known else module
                        found.append(Import(name, target, (alias.name,), child.lineno, inner))
            visit(child, inner)

    visit(tree, "module")
    return found


def all_imports() -> list[Import]:
    found = modules()
    known = set(found)
    return [imp for name, path in found.items() for imp in imports_of(name, path, known)]


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return TOP


def layer_problems(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        mine, theirs = layer(imp.importer), layer(imp.target)
        if theirs > mine or (mine < TOP and theirs == TOP):
            what = LAYERS[theirs] if theirs < TOP else "a top-level module"
            problems.append(f"{imp.shown()}: {what} is above "
                            f"{LAYERS[mine] if mine < TOP else 'the top level'}")
    return problems


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_every_import_points_down_the_layers() -> None:
    problems = layer_problems(all_imports())
    assert not problems, "imports that point up:\n" + "\n".join(problems)


def test_no_import_cycle_even_through_functions_and_type_checking() -> None:
    imports = all_imports()
    found = cycles(imports)
    lines = []
    for component in found:
        lines.append(" <-> ".join(component))
        lines += [f"  {imp.shown()}" for imp in imports
                  if imp.importer in component and imp.target in component]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_the_checker_names_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    # The guard itself: a stage importing a tool, and two modules importing each other.
    upward = Import(f"{NAME}.case.variants", f"{NAME}.tools.record", ("MODULE_KEY",), 59, "module")
    assert layer_problems([upward]) == [
        "pytest_gpucase/case/variants.py:59 imports pytest_gpucase.tools.record (module): "
        "tools is above case"]
    facade = Import(f"{NAME}.run.child", f"{NAME}.capture", ("REPLAY_ENV",), 3, "function")
    assert layer_problems([facade])[0].endswith("a top-level module is above run")
    loop = [Import(f"{NAME}.run.child", f"{NAME}.run.parent", (), 1, "function"),
            Import(f"{NAME}.run.parent", f"{NAME}.run.child", (), 1, "module")]
    assert cycles(loop) == [[f"{NAME}.run.child", f"{NAME}.run.parent"]]


def test_no_private_name_crosses_a_module_boundary_outside_its_subpackage() -> None:
    problems = []
    for imp in all_imports():
        crossing = imp.importer.split(".")[:2] != imp.target.split(".")[:2]
        private = [name for name in imp.names
                   if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))]
        if crossing and private:
            problems.append(f"{imp.shown()}: private {', '.join(private)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_layers_import_no_torch_at_module_level(package: str) -> None:
    problems = []
    for name, path in modules().items():
        if name.split(".")[1:2] != [package]:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            heavy = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(module.split(".")[0] in ("torch", "safetensors") for module in heavy):
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not problems, "torch imported at module level:\n" + "\n".join(problems)


def test_no_module_is_over_900_lines() -> None:
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 900}
    assert not long, f"split these by responsibility: {long}"


def test_every_module_says_what_it_exports() -> None:
    missing = []
    for name, path in modules().items():
        parts = name.split(".")
        if path.name == "__init__.py" and len(parts) > 1:
            continue   # a subpackage's __init__ only describes its stage
        if any(part.startswith("_") for part in parts[1:]) or parts[-1] == "cli":
            continue
        if "__all__" not in path.read_text(encoding="utf-8"):
            missing.append(str(path.relative_to(PACKAGE.parent)))
    assert not missing, "no __all__ in:\n" + "\n".join(missing)


PUBLIC = ["Case", "Cell", "Column", "Comparison", "DeviceCell", "GpuCaseHandle", "Matrix",
          "Outcome", "Recorder", "Row", "RunContext", "RunSpec", "Step", "Tolerance", "Verdict",
          "__version__", "build_matrix", "check_batch", "compare", "load_case", "load_report",
          "run_spec"]


def test_public_names_resolve_to_their_homes() -> None:
    """Each public name is taken from the module that defines it, never from a re-export."""
    import importlib

    for name, module in pytest_gpucase._PUBLIC.items():
        value = getattr(importlib.import_module(module), name)
        assert getattr(value, "__module__", module) == module, (name, module)


def test_no_string_edge_hides_an_import_or_renames_a_module() -> None:
    """Imports the layer test cannot see: ``importlib.import_module("pytest_gpucase...")``
    with a literal, and ``X.__module__ = ...`` rewrites that keep such a string true."""
    problems = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Attribute) and t.attr == "__module__"
                       for t in targets):
                    problems.append(f"{where}:{node.lineno} assigns __module__")
            if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                    and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                        "import_module", "__import__")
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith(NAME + ".")):
                problems.append(f"{where}:{node.lineno} imports {node.args[0].value} by string")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_public_names_load_lazily_and_without_torch() -> None:
    assert sorted(pytest_gpucase.__all__) == sorted(PUBLIC)
    code = ("import sys, pytest_gpucase; assert 'torch' not in sys.modules; "
            "import pytest_gpucase.plugin, pytest_gpucase.hookspecs; "
            "assert 'torch' not in sys.modules, 'the plugin imported torch'; "
            f"names = {PUBLIC!r}; "
            "assert all(getattr(pytest_gpucase, n) is not None for n in names); print('ok')")
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr


def test_old_public_paths_keep_working() -> None:
    from pytest_gpucase import capture, checkpoint, checks, hookspecs, payload, plugin
    from pytest_gpucase.cli import main
    from pytest_gpucase.run.replay import replay_module, replay_op

    assert capture.replay_module is replay_module and capture.replay_op is replay_op
    assert capture.Recorder is pytest_gpucase.Recorder
    assert {"save", "load", "describe", "content_hash", "TensorInfo"} <= set(payload.__all__)
    assert {"class_indices", "index_within", "same_device", "finite"} <= set(checks.__all__)
    assert {"save", "validate", "scan", "survey"} <= set(checkpoint.__all__)
    assert callable(main) and callable(hookspecs.pytest_gpucase_run_env)
    assert callable(plugin.pytest_configure)
    assert (PACKAGE / "report_schema.json").is_file()


def test_saved_cases_resolve_their_generated_calls_as_the_child_does() -> None:
    # Every "pytest_gpucase.…" call a saved case names, and the strings the Recorder writes,
    # resolve through the resolver a run's child uses.
    from pytest_gpucase.capture import replay_module, replay_op
    from pytest_gpucase.case.keys import REPLAY_MODULE, REPLAY_OP
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.child import resolve

    cases = [load_case(path) for path in sorted(BUNDLED.iterdir())
             if (path / "case.toml").is_file()]
    saved = [case for case in cases if case.call.startswith(NAME)]
    assert saved, "a bundled case names a generated call"
    for case in saved:
        assert resolve(case, case.call, "call") in (replay_module, replay_op), case.name
    assert {resolve(saved[0], call, "call") for call in (REPLAY_MODULE, REPLAY_OP)} == {
        replay_module, replay_op}


def test_test_modules_share_helpers_only_through_tests_helpers() -> None:
    """A test module imports what it shares with others from ``tests/helpers.py`` (or a
    ``*_targets`` module a child imports), never from another test module: running one
    test file must not collect or depend on another's."""
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name.rpartition(".")[2].startswith("test_") for name in names):
                offenders.append(f"{path.name}:{node.lineno} imports {names[0] or '.'}"
                                 f" {[alias.name for alias in node.names]}")
    assert not offenders, "move the shared names to tests/helpers.py:\n" + "\n".join(offenders)


def test_branching_stays_within_the_bar() -> None:
    """No function over cyclomatic complexity 25, at most 10 over 20 (radon's count, the
    command docs/architecture.md gives): a branch added to a large function is split by kind
    first, as the layer test holds imports."""
    cc_visit = pytest.importorskip("radon.complexity").cc_visit

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for block in cc_visit(path.read_text(encoding="utf-8")):
            # Functions and methods (a class's own block sums its methods: left out).
            if type(block).__name__ == "Function" and block.complexity > 20:
                found.append((block.complexity, f"{path.relative_to(PACKAGE.parent)}:"
                                                f"{block.lineno} {block.fullname}"))
    found.sort(reverse=True)
    over_25 = [where for complexity, where in found if complexity > 25]
    assert not over_25, f"split these by kind (complexity over 25): {over_25}"
    assert len(found) <= 10, f"{len(found)} functions over 20 (at most 10): {found}"

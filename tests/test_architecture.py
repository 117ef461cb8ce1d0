"""One home for each fact: the backend tables, the markers read off them, and the hooks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_gpucase.base import backends
from pytest_gpucase.case.model import FLOAT_DTYPES
from pytest_gpucase.cli import main
from pytest_gpucase.plugin.items import run_markers
from pytest_gpucase.report.render import RENDERERS
from pytest_gpucase.case.variants import VARIANT_KINDS
from tests.helpers import A100, report_file, result, write_case

# ----------------------------------------------------------------------------- the tables


def fake_torch(*, cuda: str | None = None, hip: str | None = None, xpu: str | None = None,
               mps_built: bool = False) -> Any:
    """A torch build as backends.detect reads it: torch.version and torch.backends.mps."""
    mps = SimpleNamespace(is_built=lambda: mps_built)
    return SimpleNamespace(version=SimpleNamespace(cuda=cuda, hip=hip, xpu=xpu),
                           backends=SimpleNamespace(mps=mps))


@pytest.mark.parametrize(("build", "backend"), [
    (fake_torch(cuda="12.4"), "cuda"),
    (fake_torch(hip="6.0.32830-d62f6a171"), "rocm"),
    (fake_torch(xpu="20240701"), "xpu"),
    (fake_torch(mps_built=True), "mps"),
    (fake_torch(), "cpu"),
])
def test_the_backend_is_read_off_the_build(build: Any, backend: str) -> None:
    assert backends.detect(build) == backend


def test_every_backend_drives_a_known_device_type() -> None:
    assert backends.BACKENDS == ("cuda", "rocm", "cpu", "mps", "xpu")
    assert backends.DEVICE_TYPES == ("cuda", "cpu", "mps", "xpu")
    for row in backends.BACKEND_TABLE:
        assert row.device_type in backends.DEVICE_TYPES, row.name
        assert backends.run_backend(row.device_type, row.name) == row.name


@pytest.mark.parametrize(("device", "build", "backend"), [
    ("cuda", "rocm", "rocm"), ("cuda", "cuda", "cuda"), ("cuda", "cpu", "cuda"),
    ("cpu", "rocm", "cpu"), ("mps", "cpu", "mps"), ("xpu", "cuda", "xpu"),
])
def test_the_backend_of_a_run(device: str, build: str, backend: str) -> None:
    assert backends.run_backend(device, build) == backend


def test_launch_blocking_is_told_per_backend_and_for_all() -> None:
    assert backends.launch_blocking_env("cuda") == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert backends.launch_blocking_env("rocm") == {"AMD_SERIALIZE_KERNEL": "3"}
    assert backends.launch_blocking_env("mps") == {}
    assert backends.launch_blocking_words("rocm") == "AMD_SERIALIZE_KERNEL=3"
    assert backends.launch_blocking_words(None) == (
        "CUDA_LAUNCH_BLOCKING=1 (ROCm: AMD_SERIALIZE_KERNEL=3)")


def test_synchronize_passes_the_device_where_the_runtime_takes_one() -> None:
    calls: list[tuple[Any, ...]] = []
    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda *a: calls.append(("cuda", *a))),
                           mps=SimpleNamespace(synchronize=lambda *a: calls.append(("mps", *a))))
    backends.synchronize(fake, "cuda:1")
    backends.synchronize(fake, "cuda")
    backends.synchronize(fake, "mps:0")
    backends.synchronize(fake, "cpu")
    backends.synchronize(fake, "xpu:0")   # no torch.xpu here: nothing to wait for
    assert calls == [("cuda", "cuda:1"), ("cuda",), ("mps",)]


def test_float64_and_the_cuda_switches() -> None:
    assert not backends.float64_on("mps") and backends.float64_on("cuda")
    assert [row.name for row in backends.BACKEND_TABLE if row.cuda_switches] == ["cuda", "rocm"]


def test_triage_reads_the_backend_and_its_notes_off_the_table_alone() -> None:
    # Which texts mark a backend, and what its builds do with kernel asserts, are the table's:
    # triage names no backend itself, so that adding one is one row.
    import ast

    from pytest_gpucase.verdict import triage

    tree = ast.parse(Path(triage.__file__).read_text(encoding="utf-8"))
    named = {node.value for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in backends.BACKENDS}
    assert not named, f"triage names backends itself: {sorted(named)}"
    rocm = triage.triage("RuntimeError", "HIP error: device-side assert triggered", "")
    cuda = triage.triage("RuntimeError", "CUDA error: device-side assert triggered", "")
    assert rocm is not None and cuda is not None
    assert (rocm.backend, cuda.backend) == ("rocm", "cuda")
    assert rocm.notes[-1] == backends.asserts_note("rocm")
    assert backends.asserts_note("rocm") not in cuda.notes
    # A log that names both is ROCm's: its builds keep CUDA spellings (the detection order).
    assert backends.backend_of_text("hipErrorAssert (PYTORCH_CUDA_ALLOC_CONF)") == "rocm"
    assert backends.backend_of_text("nothing of either") is None


# ----------------------------------------------------------------------------- the markers


def test_every_table_row_has_a_marker() -> None:
    names = {name for name, _ in run_markers()}
    wanted = ({f"device_{d}" for d in backends.DEVICE_TYPES}
              | {f"backend_{b}" for b in backends.BACKENDS}
              | {f"dtype_{d}" for d in FLOAT_DTYPES}
              | {f"variant_{k}" for k in VARIANT_KINDS})
    assert names == wanted


def test_every_marker_is_registered_under_strict_markers(pytester: pytest.Pytester) -> None:
    marks = "\n".join(f"@pytest.mark.{name}" for name, _ in run_markers())
    pytester.makepyfile(f"import pytest\n\n{marks}\ndef test_marked():\n    pass\n")
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:randomly")
    result.assert_outcomes(passed=1)


# ----------------------------------------------------------------------------- the hooks

RUN_ENV_CONFTEST = """
import pytest

def pytest_gpucase_run_env(item, spec):
    if "hooked" in item.name:
        return {"GPUCASE_ARCH_TEST": "from the hook"}
    return None
"""

READS_ENV = """
import os

def run():
    raise LookupError(os.environ.get("GPUCASE_ARCH_TEST", "unset"))
"""


# Passes only where the hook set the variable.
RAISES_FROM_THE_HOOK = """
    format = 1
    call = "case.py:run"
    [expect]
    outcome = "raises"
    exception = "LookupError"
    match = "from the hook"
"""


def test_run_env_hook_changes_the_child_environment(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(RUN_ENV_CONFTEST)
    write_case(pytester.path, "hooked", RAISES_FROM_THE_HOOK, READS_ENV)
    write_case(pytester.path, "plain", RAISES_FROM_THE_HOOK, READS_ENV)
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the call raised LookupError: unset"])


def test_conftests_apply_where_pytest_would_put_them(pytester: pytest.Pytester) -> None:
    """Case directories share their parent's conftest modules (a collection shortcut): a
    conftest above the cases still reaches every item. One inside a case directory is never
    imported (a case's files run no code in the pytest process): that case is broken, naming
    the file."""
    for name in ("hooked_a", "plain_b", "own_c"):
        write_case(pytester.path, name, RAISES_FROM_THE_HOOK, READS_ENV)
    (pytester.path / "cases" / "conftest.py").write_text(RUN_ENV_CONFTEST)
    (pytester.path / "cases" / "own_c" / "conftest.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('imported').write_text('yes')\n"
        "def pytest_gpucase_run_env(item, spec):\n"
        "    return {'GPUCASE_ARCH_TEST': 'from the hook in own_c'}\n")
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-p", "no:randomly", "-rA")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["PASSED cases/hooked_a/*", "FAILED cases/plain_b/*"])
    result.stdout.fnmatch_lines(["FAILED cases/own_c/*conftest.py*"])
    assert not (pytester.path / "cases" / "own_c" / "imported").exists()


def test_the_spec_property_is_made_once_when_read(pytester: pytest.Pytester) -> None:
    """Made lazily (collection does not pay for it): once per item, again after a plugin
    replaces the list, never twice."""
    write_case(pytester.path, "plain", 'format = 1\ncall = "case.py:run"\n',
               "def run():\n    return 1\n")
    items, _ = pytester.inline_genitems("--gpu-cases", "--gpu-devices", "cpu",
                                        "--gpu-start-method", "fork", "-p", "no:randomly",
                                        "cases")
    (item,) = items
    assert item._user_properties == []  # nothing made at collection
    first = list(item.user_properties)
    assert [name for name, _ in first] == ["gpucase"]
    assert json.loads(first[0][1])["case"] == "plain"
    assert item.user_properties == first  # read again: not added twice
    item.user_properties = [("other", "1")]
    assert [name for name, _ in item.user_properties] == ["gpucase", "other"]
    item.user_properties = list(first)
    assert item.user_properties == first


FORMATS_PLUGIN = """
def render_lines(matrix):
    return "".join(f"{row.label}\\n" for row in matrix.rows) or "no rows\\n"

def pytest_gpucase_report_formats():
    return {"lines": render_lines}
"""


def test_report_formats_hook_adds_a_renderer_in_a_session(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FORMATS_PLUGIN)
    pytester.makepyfile("""
        from pytest_gpucase.report.render import RENDERERS

        def test_the_format_is_offered():
            assert RENDERERS["lines"].__name__ == "render_lines"
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert "lines" not in RENDERERS   # this process never loaded that conftest


def test_report_formats_hook_reaches_gpucase_matrix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gpucase_lines_format.py").write_text(textwrap.dedent(FORMATS_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("pytest_gpucase.report.render.RENDERERS", dict(RENDERERS))
    report = report_file(tmp_path / "a.json", A100,
                         [result("ce_class4", "cpu", "float32", "passed")])
    assert main(["matrix", str(report), "--format", "lines",
                 "--plugin", "gpucase_lines_format"]) == 0
    assert "ce_class4" in capsys.readouterr().out
    monkeypatch.setattr("pytest_gpucase.report.render.RENDERERS", dict(RENDERERS))
    with pytest.raises(SystemExit):   # not offered without the plugin
        main(["matrix", str(report), "--format", "lines"])


# ----------------------------------------------------------------------------- variant text


def test_a_failing_variant_says_which_inputs_it_resized(pytester: pytest.Pytester) -> None:
    write_case(pytester.path, "weighted", """
        format = 1
        call = "case.py:run"
        [variants.batch]
        sizes = [1]
    """, "def run(logits, weight, target):\n    raise ValueError(tuple(logits.shape))\n",
        {"logits": torch.zeros(4, 4), "weight": torch.ones(4),
         "target": torch.zeros(4, dtype=torch.long)})
    result = pytester.runpytest_subprocess("--gpu-cases", "--gpu-devices", "cpu", "cases",
                                           "-p", "no:randomly")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["batch[[]1]: resized logits (4, 4) -> (1, 4), target (4,) -> (1,)"])


def test_the_layout_tree_names_every_module() -> None:
    """docs/architecture.md's layout tree is what a newcomer reads first: every module and
    subpackage of the package is in it, and it names none that is gone."""
    import re

    package = Path(__file__).resolve().parent.parent / "pytest_gpucase"
    doc = (package.parent / "docs" / "architecture.md").read_text()
    tree = doc[doc.index("```\npytest_gpucase/"):]
    tree = tree[:tree.index("```", 4)]
    files = {path.name for path in package.rglob("*.py")} | {"report_schema.json"}
    missing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if path.name != "__init__.py" and path.name not in tree)
    missing += sorted(f"{path.parent.relative_to(package)}/" for path in package.rglob(
        "__init__.py") if path.parent != package and f"{path.parent.name}/" not in tree)
    named = set(re.findall(r"\b([a-z_]+\.(?:py|json))\b", tree)) - {"case.py"}  # a case's file
    assert not missing, f"add to the layout tree: {missing}"
    assert named <= files, f"gone, still in the tree: {sorted(named - files)}"


def test_every_per_dtype_table_is_made_from_the_one_dtype_table() -> None:
    """A dtype's facts have one home (base/dtypes.py); the verdict's torch.dtype tables, the
    dtypes a run may use and the half-precision ones are made from its rows."""
    from pytest_gpucase.base.dtypes import DTYPE_TABLE, FLOAT_DTYPES, LOW_PRECISION
    from pytest_gpucase.case import model
    from pytest_gpucase.tools import ablate
    from pytest_gpucase.verdict import _kernel, messages, rounding, tolerance

    assert model.FLOAT_DTYPES == FLOAT_DTYPES == ("float16", "bfloat16", "float32", "float64")
    assert ablate.LOW_PRECISION == LOW_PRECISION == ("float16", "bfloat16")
    for row in DTYPE_TABLE:
        dtype = getattr(torch, row.name)
        found = tolerance.DEFAULT_TOLERANCES[dtype]
        assert (found.rtol, found.atol) == (row.rtol, row.atol)
        assert rounding.MULTIPLIER.get(dtype) == row.budget_multiplier
        assert messages._MOST_DIGITS.get(dtype) == row.digits
        assert (dtype in _kernel._SCREENED_DTYPES) == row.screened

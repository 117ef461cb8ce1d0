"""gpucase validate: the dry run finds what a run would, without running any case code."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_gpucase.run import child as execute
from pytest_gpucase.case import payload
from pytest_gpucase.case.load import load_case
from pytest_gpucase.cli import main
from pytest_gpucase.base.errors import CaseFormatError
from pytest_gpucase.tools.validate import validate

RUN = "def run(logits, target, mask):\n    return logits\n"
TENSORS = {"logits": torch.zeros(2, 4), "target": torch.zeros(2, dtype=torch.long),
           "mask": torch.ones(2, dtype=torch.bool)}


@pytest.fixture(autouse=True)
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def case(name: str, toml: str = "", code: str | None = RUN,
         tensors: dict[str, torch.Tensor] | None = TENSORS,
         call: str = "case.py:run") -> Path:
    path = Path("cases") / name
    path.mkdir(parents=True)
    (path / "case.toml").write_text(f'format = 1\ncall = "{call}"\n' + textwrap.dedent(toml))
    if code is not None:
        (path / "case.py").write_text(code)
    if tensors is not None:
        payload.save(path / "inputs.safetensors", tensors)
    return path


def test_a_good_case_has_no_problem() -> None:
    case("good", "[variants]\nbatch = { axis = 0, sizes = [1] }\n")
    assert validate([Path("cases")]) == []


def test_the_case_code_is_never_run(here: Path) -> None:
    marker = here / "ran"
    case("side_effect", code=f"open({str(marker)!r}, 'w').close()\n" + RUN)
    assert validate([Path("cases")]) == []
    assert not marker.exists()


def test_a_missing_payload() -> None:
    case("no_payload", tensors=None)
    assert validate([Path("cases")]) == [
        f"cases/no_payload/case.toml: parameter '{name}' of case.py:run has no value: add it to "
        "[inputs] or as a tensor in inputs.safetensors (there is no inputs.safetensors)"
        for name in ("logits", "target", "mask")]


def test_a_payload_named_by_hash_but_missing() -> None:
    case("hash_only", 'inputs_sha256 = "sha256:' + "0" * 64 + '"\n', tensors=None,
         code="def run():\n    return 1\n")
    assert validate([Path("cases")]) == [
        "cases/hash_only/case.toml: inputs_sha256: names a hash but inputs.safetensors is "
        "missing; restore the file or remove the key"]


def test_a_payload_whose_hash_differs() -> None:
    case("hash_wrong", 'inputs_sha256 = "sha256:' + "0" * 64 + '"\n')
    [problem] = validate([Path("cases")])
    assert problem.startswith("cases/hash_wrong/inputs.safetensors: content hash sha256:")


def test_an_rng_state_the_payload_does_not_hold() -> None:
    """The run refuses a case whose [context] rng names a tensor that is not saved; the dry run
    says so too, in the run's words."""
    rng = '[context]\nrng = { cpu = "context.rng_cpu", cuda = "context.rng_cuda" }\n'
    case("held", rng, tensors={**TENSORS, "context.rng_cpu": torch.get_rng_state(),
                               "context.rng_cuda": torch.zeros(16, dtype=torch.uint8)})
    case("not_held", rng, tensors={**TENSORS, "context.rng_cpu": torch.get_rng_state()})
    case("no_payload", rng, tensors=None, code="def run():\n    return 1\n")
    message = ("cases/{}/case.toml: [context] rng.{}: names 'context.rng_{}', which "
               "inputs.safetensors does not hold; save the state there or remove the key")
    assert validate([Path("cases")]) == [
        message.format("no_payload", "cpu", "cpu"), message.format("no_payload", "cuda", "cuda"),
        message.format("not_held", "cuda", "cuda")]
    with pytest.raises(CaseFormatError) as run:
        execute.load_inputs(load_case(Path("cases/not_held")))
    assert str(run.value) == message.format("not_held", "cuda", "cuda")


def test_a_missing_function() -> None:
    case("no_function", call="case.py:nope")
    assert validate([Path("cases")]) == [
        "cases/no_function/case.toml: call: 'case.py' has no 'nope'; check the name after the "
        "colon"]


def test_a_syntax_error_in_the_case_code() -> None:
    case("syntax", code="def run(:\n")
    [problem] = validate([Path("cases")])
    assert problem.startswith("cases/syntax/case.py: line 1: ")
    assert problem.endswith("the call cannot be imported until the syntax is fixed")


@pytest.mark.parametrize("code", [
    "from helpers import *\n",
    "import functools\nrun = functools.partial(print)\n",
    "import functools\n\n@functools.lru_cache\ndef run(x):\n    return x\n",
    "try:\n    from fast import run\nexcept ImportError:\n    def run(y):\n        return y\n",
], ids=["star_import", "assigned", "decorated", "imported"])
def test_what_the_source_cannot_tell_is_not_a_problem(code: str) -> None:
    case("unknowable", code=code)
    assert validate([Path("cases")]) == []


def test_a_module_call_is_found_without_importing_it(here: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    package = here / "mypkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(here / 'imported')!r}, 'w').close()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "ops.py").write_text(RUN)
    monkeypatch.syspath_prepend(str(here))
    case("module_ok", code=None, call="mypkg.sub.ops:run")
    case("module_missing", code=None, call="mypkg.sub.nope:run")
    case("module_no_function", code=None, call="mypkg.sub.ops:walk")
    assert validate([Path("cases")]) == [
        "cases/module_missing/case.toml: call: module 'mypkg.sub.nope' is not importable here; "
        "install it, or correct the name",
        "cases/module_no_function/case.toml: call: 'mypkg.sub.ops' has no 'walk'; check the "
        "name after the colon",
    ]
    assert not (here / "imported").exists()
    assert "mypkg" not in sys.modules


def test_inputs_that_do_not_bind() -> None:
    case("extra_literal", "[inputs]\ntemperature = 1.0\n")
    case("extra_tensor", tensors={**TENSORS, "bias": torch.zeros(4)})
    case("missing", tensors={"logits": torch.zeros(2, 4), "target": torch.zeros(2)})
    case("positional_only", code="def run(logits, /, target, mask):\n    return logits\n")
    case("var_keyword", "[inputs]\ntemperature = 1.0\n",
         code="def run(logits, target, mask, **options):\n    return logits\n")
    case("defaults", tensors={"logits": torch.zeros(2, 4)},
         code="def run(logits, target=None, *, mask=None):\n    return logits\n")
    assert validate([Path("cases")]) == [
        "cases/extra_literal/case.toml: [inputs] 'temperature' is not a parameter of "
        "case.py:run(logits, target, mask); remove it or add the parameter",
        "cases/extra_tensor/inputs.safetensors: tensor 'bias' is not a parameter of "
        "case.py:run(logits, target, mask); save the tensor under a parameter's name, or add "
        "the parameter",
        "cases/missing/case.toml: parameter 'mask' of case.py:run has no value: add it to "
        "[inputs] or as a tensor in inputs.safetensors (holds: logits, target)",
        "cases/positional_only/inputs.safetensors: tensor 'logits' is not a parameter of "
        "case.py:run(logits, target, mask); save the tensor under a parameter's name, or add "
        "the parameter",
        "cases/positional_only/case.toml: parameter 'logits' of case.py:run is positional-only, "
        "and a case passes its inputs by name; make it a regular parameter",
    ]


def test_the_reference_is_checked_too() -> None:
    case("reference", 'reference = "case.py:ref"\n',
         code=RUN + "\ndef ref(logits, target):\n    return logits\n")
    assert validate([Path("cases")]) == [
        "cases/reference/inputs.safetensors: tensor 'mask' is not a parameter of "
        "case.py:ref(logits, target); save the tensor under a parameter's name, or add the "
        "parameter"]


def test_a_variant_axis_beyond_the_rank_of_the_inputs() -> None:
    case("axis", "[variants]\nlength = { axis = 2, sizes = [1] }\n")
    assert validate([Path("cases")]) == [
        "cases/axis/case.toml: [variants] length: axis 2 is beyond the rank of every tensor "
        "input (ranks: logits 2, mask 1, target 1); give an axis the inputs have"]


def test_a_variant_too_large() -> None:
    case("large", "[variants]\nlength = { axis = 1, sizes = [1048576] }\n",
         tensors={"logits": torch.zeros(300, 4), "target": torch.zeros(300, 4),
                  "mask": torch.zeros(300)})
    assert validate([Path("cases")]) == [
        "cases/large/case.toml: [variants] length: length=1048576: the resized inputs would "
        "hold 629145600 elements, over the limit of 268435456; try a smaller size"]


def test_unsane_tolerances_are_problems() -> None:
    case("ulps", "[expect.tolerance.float32]\nulps = 0.5\n")
    assert validate([Path("cases")]) == [
        "cases/ulps/case.toml: [expect.tolerance.float32] ulps: expected a whole number of units "
        "in the last place, got 0.5"]


def test_special_files_are_problems_not_hangs() -> None:
    path = case("fifo")
    (path / "inputs.safetensors").unlink()
    os.mkfifo(path / "inputs.safetensors")
    os.mkfifo(path / "expected.safetensors")
    dangling = case("dangling", tensors=None)
    (dangling / "case.toml").unlink()
    (dangling / "case.toml").symlink_to("gone.toml")
    assert validate([Path("cases")]) == [
        "cases/dangling/case.toml: is a symlink to gone.toml, which does not exist; replace it "
        "with the file itself",
        "cases/fifo/inputs.safetensors: is a FIFO (named pipe), not a regular file; replace it "
        "with the safetensors file; save the tensors again with pytest_gpucase.payload.save",
        "cases/fifo/expected.safetensors: is a FIFO (named pipe), not a regular file; replace "
        "it with the safetensors file; save the tensors again with pytest_gpucase.payload.save",
    ]


def test_a_directory_without_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    Path("empty/deeper").mkdir(parents=True)
    assert validate([Path("empty")]) == [
        "empty: no case directory (with a case.toml) under empty"]
    assert main(["validate", "empty"]) == 1
    assert capsys.readouterr().out == "empty: no case directory (with a case.toml) under empty\n"


def test_a_batch_larger_than_the_saved_one_is_a_problem(
        capsys: pytest.CaptureFixture[str]) -> None:
    """validate said 'no problems' and show 'resized (2, 4) -> (8, 4)' where the run skipped:
    the three read one rule (variants.applicable)."""
    from pytest_gpucase.tools.show import show

    path = case("big_batch", "[variants]\nbatch = { axis = 0, sizes = [8, 1] }\n")
    assert validate([Path("cases")]) == [
        "cases/big_batch/case.toml: [variants] batch: batch=8: the saved batch holds 2 entries on "
        "axis 0, so its item is always skipped; remove 8 from sizes"]
    shown = show(path)
    assert "  batch[8]: not applicable: the saved batch holds 2 entries on axis 0\n" in shown
    assert "  batch[1]: resized logits (2, 4) -> (1, 4)" in shown


def test_boundaries_on_a_non_integer_input_are_a_problem_in_the_runs_words() -> None:
    from pytest_gpucase.case.variants import NotClassIndices, Variant, apply

    reject = '[variants.reject]\nexception = "ValueError"\n'
    case("on_logits", f'[variants]\nboundaries = {{ input = "logits", classes = 4 }}\n{reject}')
    case("on_mask", f'[variants]\nboundaries = {{ input = "mask", classes = 4 }}\n{reject}')
    case("on_target", f'[variants]\nboundaries = {{ input = "target", classes = 4 }}\n{reject}')
    fix = "name the integer class-index input, e.g. input = \"target\""
    assert validate([Path("cases")]) == [
        f"cases/{name}/case.toml: [variants] boundaries: input '{name[3:]}' holds {dtype}, not "
        "class indices: a boundary variant writes class indices (0, classes - 1, -1, classes) "
        f"into it; {fix}" for name, dtype in (("on_logits", "float32"), ("on_mask", "bool"))]
    with pytest.raises(NotClassIndices) as run:
        apply(Variant("boundary", 4, input="logits"), TENSORS)
    assert validate([Path("cases/on_logits")])[0].endswith(str(run.value))


def test_a_call_into_a_required_package_missing_here_is_a_note_not_a_problem(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The run skips such a case ('requires tinyext>=2.0; not installed'); validate failed it
    (exit 1) for the import it could not check."""
    needs = '[matrix.packages]\ngpucase-absent-ext = ">=2.0"\n'
    case("absent", needs, code=None, call="gpucase_absent_ext:newfeature")
    case("absent_reference", 'reference = "gpucase_absent_ext.ref:ref"\n' + needs)
    # Met requirements leave every check in place: a wrong name in an installed package.
    case("met", '[matrix.packages]\npackaging = ">=1"\n', code=None, call="packaging.nope:run")
    notes: list[str] = []
    assert validate([Path("cases")], notes) == [
        "cases/met/case.toml: call: module 'packaging.nope' is not importable here; install it, "
        "or correct the name"]
    assert notes == [
        "cases/absent/case.toml: call and reference not checked here: requires "
        "gpucase-absent-ext>=2.0; not installed",
        "cases/absent_reference/case.toml: call and reference not checked here: requires "
        "gpucase-absent-ext>=2.0; not installed"]
    capsys.readouterr()
    assert main(["validate", "cases/absent"]) == 0
    assert capsys.readouterr().out == (
        "cases/absent/case.toml: call and reference not checked here: requires "
        "gpucase-absent-ext>=2.0; not installed\ngpucase validate: no problems in cases/absent\n")


def test_a_required_package_below_the_version_is_not_checked_either(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tinyext 1.0 installed, the case needs >=2.0 for a function 1.0 lacks: the run skips."""
    from importlib import metadata

    monkeypatch.setattr(metadata, "version",
                        lambda name: "1.0" if name == "packaging" else metadata.version(name))
    case("old", '[matrix.packages]\npackaging = ">=900"\n', code=None, call="packaging:newfeature")
    notes: list[str] = []
    assert validate([Path("cases")], notes) == []
    assert notes == ["cases/old/case.toml: call and reference not checked here: requires "
                     "packaging>=900; found 1.0"]


def test_a_module_named_unlike_its_package_is_not_checked_either() -> None:
    """``_pytest`` belongs to the distribution ``pytest``; flash-attn-3, not installed, provides
    flash_attn_interface: an unmet requirement skips the whole case, whatever it imports."""
    case("renamed", '[matrix.packages]\npytest = ">=900"\n', code=None, call="_pytest.nope:run")
    case("uninstalled", '[matrix.packages]\nflash-attn-3 = ">=3.0"\n', code=None,
         call="flash_attn_interface:flash_attn_func")
    notes: list[str] = []
    assert validate([Path("cases")], notes) == []
    assert notes == [f"cases/renamed/case.toml: call and reference not checked here: requires "
                     f"pytest>=900; found {pytest.__version__}",
                     "cases/uninstalled/case.toml: call and reference not checked here: requires "
                     "flash-attn-3>=3.0; not installed"]


def test_a_minimized_case_that_keeps_another_failure() -> None:
    """An older minimize compared exception types only: a case it shrank to another
    RuntimeError documents a bug it no longer reproduces."""
    origin = ('[origin]\nerror = "RuntimeError: The size of tensor a (5) must match the size '
              'of tensor b (7) at non-singleton dimension 0"\nbackend = "cpu"\n')
    case("same", origin + '[origin.minimized_from]\ncase = "../x"\ndevice = "cpu"\n'
         'error = "RuntimeError: The size of tensor a (2) must match the size of tensor b (3) '
         'at non-singleton dimension 0"\n')
    case("other", origin + '[origin.minimized_from]\ncase = "../x"\ndevice = "cpu"\n'
         'error = "RuntimeError: cannot reshape tensor of 0 elements into shape [0, -1]"\n')
    case("old", origin + '[origin.minimized_from]\ncase = "../x"\nfailure = "RuntimeError"\n')
    problems = validate([Path("cases")])
    assert problems == [
        "cases/other/case.toml: [origin.minimized_from] error: the minimized case fails with "
        "'RuntimeError: cannot reshape tensor of 0 elements into shape [0, -1]', not the "
        "captured failure 'RuntimeError: The size of tensor a (5) must match the size of "
        "tensor b (7) at non-singleton dimension 0' ([origin] error): it reproduces another "
        "bug; minimize the original again with this gpucase"]

"""Golden files (expected.safetensors) read back as values the comparison finds equal to
what was written: a regenerated golden passes the next run, or regen refuses it."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

from pytest_gpucase.case import golden
from pytest_gpucase.case import payload
from pytest_gpucase.verdict.compare import compare
from pytest_gpucase.base.errors import CaseFormatError
from tests.helpers import write_case


class Pair(typing.NamedTuple):
    first: typing.Any
    second: typing.Any


Point = collections.namedtuple("Point", "x y")


def round_trip(tmp_path: Path, out: object) -> object:
    path = tmp_path / "expected.safetensors"
    golden.save(path, {"out": out})
    return golden.load(path)["out"]


def test_named_tuples_read_back_as_their_own_class_nested_too(tmp_path: Path) -> None:
    out = Pair(torch.arange(3.0), [Point(1, torch.ones(2)), Pair(None, Point("a", 2.5))])
    back = round_trip(tmp_path, out)
    assert type(back) is Pair
    assert type(back.second[0]) is Point and type(back.second[1].second) is Point
    assert back.second[1].second == Point("a", 2.5)
    assert torch.equal(back.second[0].y, torch.ones(2))
    assert compare(out, back).ok


def test_tuple_keys_and_other_keys_read_back_as_themselves(tmp_path: Path) -> None:
    out = {(1, 2): torch.arange(4.0) / 3, (1, ("a", None)): 5, Point(0, 1): "p",
           frozenset({3}): 1.5, b"raw": 2, "s": 3, 4: 4, 2.5: 5, True: 6, None: 7,
           float("inf"): 8}
    back = round_trip(tmp_path, out)
    assert isinstance(back, dict)
    assert list(back) == list(out)
    assert type(next(iter(back))) is tuple and type(list(back)[2]) is Point
    assert compare(out, back).ok


def test_a_mix_of_every_kind_reads_back_equal(tmp_path: Path) -> None:
    out = [Pair({(0, 1): Point(torch.zeros(2, dtype=torch.float16), 1j)},
                (b"\x00\xff", {1, (2, 3)}, frozenset({"a"}))),
           {"nan": float("nan"), "t": torch.tensor([1, 2]), "size": torch.Size([2, 3])}]
    back = round_trip(tmp_path, out)
    assert compare(out, back, equal_nan=True).ok
    assert back[0].second[0] == b"\x00\xff" and back[0].second[1] == {1, (2, 3)}


def test_dtypes_and_devices_read_back_as_themselves(tmp_path: Path) -> None:
    out = {"dtype": torch.bfloat16, "devices": [torch.device("cpu"), torch.device("cuda", 1)]}
    back = round_trip(tmp_path, out)
    assert back == out and back["dtype"] is torch.bfloat16


def test_a_dtype_node_names_a_torch_dtype_or_the_file_is_malformed(tmp_path: Path) -> None:
    path = tmp_path / "expected.safetensors"
    for node, problem in (({"dtype": "nn"}, "'nn' is no torch dtype"),  # torch.nn: no dtype
                          ({"device": "gpu:x"}, "'gpu:x' is no torch device")):
        payload.save(path, {}, metadata={golden.STRUCTURE_KEY: json.dumps({"out": node})})
        with pytest.raises(CaseFormatError, match=problem):
            golden.load(path)


def test_a_golden_of_earlier_versions_still_loads(tmp_path: Path) -> None:
    """Keys JSON spells are stored as themselves, as before; only other keys are nodes."""
    path = tmp_path / "expected.safetensors"
    structure = {"out": {"dict": [["a", {"tensor": "out['a']"}], [1, {"value": 2}],
                                  [2.5, {"tuple": [{"value": None}]}]]}}
    payload.save(path, {"out['a']": torch.ones(2)},
                 metadata={golden.STRUCTURE_KEY: json.dumps(structure)})
    back = golden.load(path)["out"]
    assert list(back) == ["a", 1, 2.5] and back[1] == 2 and back[2.5] == (None,)
    assert torch.equal(back["a"], torch.ones(2))


def test_a_named_tuple_whose_class_is_not_loaded_reads_back_as_a_stand_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The class is never imported to read a golden: if its module is not loaded (or the
    fields changed), a named tuple of the same name and fields says where it came from."""
    module = types.ModuleType("gpucase_golden_test_gone")
    cls = collections.namedtuple("Gone", "a b", module=module.__name__)  # type: ignore[misc]
    module.Gone = cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    path = tmp_path / "expected.safetensors"
    golden.save(path, {"out": cls(1, torch.ones(1))})
    monkeypatch.delitem(sys.modules, module.__name__)
    back = golden.load(path)["out"]
    assert type(back) is not cls and type(back).__name__ == "Gone"
    assert back._fields == ("a", "b") and back.a == 1
    assert type(back).__qualname__ == "gpucase_golden_test_gone.Gone (as the golden recorded it)"


def test_malformed_structure_is_still_a_case_format_error(tmp_path: Path) -> None:
    path = tmp_path / "expected.safetensors"
    structure = {"out": {"dict": [[[1, 2], {"value": 1}]]}}  # a tuple key as written before
    payload.save(path, {}, metadata={golden.STRUCTURE_KEY: json.dumps(structure)})
    with pytest.raises(CaseFormatError, match=r"malformed 'gpucase\.structure' metadata.*"
                       "--gpu-cases-regen"):
        golden.load(path)


def _local_named_tuple() -> object:
    class Local(typing.NamedTuple):
        a: int

    return Local(1)


class Tag(str):
    pass


@pytest.mark.parametrize(("out", "message"), [
    ({"k": {float("nan"): 1}}, r"out\['k'\]: the dict key nan does not equal itself read back "
                               r"\(a NaN never equals a NaN\)"),
    ([{(1, float("nan")): 1}], r"out\[0\]: the dict key \(1, nan\) does not equal itself"),
    ({torch.ones(1): 1}, r"out: the dict key tensor\(\[1\.\]\) is or holds a tensor, hashed "
                         r"by identity"),
    ([{1, (2, torch.ones(1))}], r"out\[0\]: the element .* is or holds a tensor"),
    (Pair(1, _local_named_tuple()), r"out\.second: the named tuple class "
                                    r"_local_named_tuple\.<locals>\.Local cannot be found again"),
    ([collections.namedtuple("Renamed", "a")(1)],  # not reachable as module.Renamed
     r"out\[0\]: the named tuple class Renamed cannot be found again as "
     r"tests\.test_golden\.Renamed .*; define it at module level under its own name"),
    ({"t": Tag("x")}, r"out\['t'\]: a Tag string \(a str subclass\) would read back as a plain "
                      r"str"),
    ([object()], r"out\[0\]: a value of type object cannot be stored in a golden"),
])
def test_what_cannot_read_back_equal_is_refused_and_nothing_is_written(
        tmp_path: Path, out: object, message: str) -> None:
    path = tmp_path / "expected.safetensors"
    with pytest.raises(golden.Unstorable, match=f"expected.safetensors not written: {message}"):
        golden.save(path, {"out": out})
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


CASES = {
    "named": """
        import typing
        import torch

        class Stats(typing.NamedTuple):
            mean: torch.Tensor
            spread: typing.Any

        class Spread(typing.NamedTuple):
            low: torch.Tensor
            high: float

        def run(x):
            return Stats(x.mean(), Spread(x.min(), float(x.max())))
        """,
    "tuple_keys": """
        def run(x):
            return {(1, 2): x / 3, (0, ('a', None)): x.sum(), 'plain': 1}
        """,
    "mix": """
        import collections

        Cell = collections.namedtuple('Cell', 'value where')

        def run(x):
            return [{(i, i + 1): Cell(x * i, (b'tag', {i, 'k'})) for i in range(2)},
                    (None, 2.5, 'text', frozenset({(1, 2)}))]
        """,
}


@pytest.mark.slow
def test_a_regenerated_golden_passes_the_next_run(pytester: pytest.Pytester) -> None:
    for name, source in CASES.items():
        write_case(pytester.path, name, 'format = 1\ncall = "case.py:run"\n[matrix]\n'
                   'devices = ["cpu"]\n', source, {"x": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    regen = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases")
    regen.assert_outcomes(passed=len(CASES))
    for name in CASES:
        assert (pytester.path / "cases" / name / "expected.safetensors").exists()
    again = pytester.runpytest_subprocess("--gpu-cases", "-v", "cases")
    again.assert_outcomes(passed=len(CASES))
    again.stdout.no_fnmatch_line("*differ from the golden*")


@pytest.mark.slow
def test_regen_refuses_an_output_it_cannot_store(pytester: pytest.Pytester) -> None:
    """The call and the reference return the same class, so the run passes; its golden
    could never be read back as that class, so none is written and regen says why."""
    path = write_case(pytester.path, "renamed", 'format = 1\ncall = "case.py:run"\n[matrix]\n'
                      'devices = ["cpu"]\n', """
        import collections

        Alias = collections.namedtuple('Pair', 'a b')

        def run(x):
            return {'y': Alias(x, x * 2)}
        """, {"x": torch.tensor([1.0, 2.0])})
    pytester.runpytest_subprocess("--gpu-cases", "cases").assert_outcomes(passed=1)
    regen = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases")
    regen.assert_outcomes(failed=1)
    regen.stdout.fnmatch_lines([
        "cases/renamed/case.toml: cases/renamed/expected.safetensors not written: "
        "out[[]'y'[]]: the named tuple class Pair cannot be found again as *.Pair when the "
        "golden is read, and the comparison needs the very same class; define it at module "
        "level under its own name",
    ])
    regen.stdout.no_fnmatch_line("*Traceback*")  # the output's problem, not the code's
    regen.stdout.no_fnmatch_line("*golden files written*")
    assert not (path / "expected.safetensors").exists()


@pytest.mark.parametrize("structure", [
    [1], {"out": [1]}, {"out": {"dict": [[{"list": [1]}, {"value": 1}]]}},
    {"out": {"namedtuple": {"module": "x", "qualname": 5, "fields": [], "items": []}}},
    {"out": {"namedtuple": [1]}}, {"out": {"value": 1, "list": []}},
])
def test_a_malformed_structure_of_any_shape_is_a_case_format_error(
        tmp_path: Path, structure: object) -> None:
    path = tmp_path / "expected.safetensors"
    payload.save(path, {}, metadata={golden.STRUCTURE_KEY: json.dumps(structure)})
    with pytest.raises(CaseFormatError, match=r"malformed 'gpucase\.structure' metadata"):
        golden.load(path)


def test_a_deeply_nested_structure_is_a_case_format_error(tmp_path: Path) -> None:
    path = tmp_path / "expected.safetensors"
    payload.save(path, {}, metadata={golden.STRUCTURE_KEY: "[" * 100_000 + "]" * 100_000})
    with pytest.raises(CaseFormatError, match="malformed"):
        golden.load(path)


LOADS_A_HOSTILE_GOLDEN = """
import json, sys
from pytest_gpucase.case import golden
from pytest_gpucase.case import payload
from pytest_gpucase.base.errors import CaseFormatError
path = sys.argv[1]
for node in ({"dtype": "_dynamo"},
             {"namedtuple": {"module": "torch", "qualname": "_inductor.config",
                             "fields": [], "items": []}}):
    payload.save(path, {}, metadata={golden.STRUCTURE_KEY: json.dumps({"out": node})})
    try:
        golden.load(path)
    except CaseFormatError:
        pass
print(sorted(name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules))
"""


@pytest.mark.slow
def test_reading_a_golden_imports_nothing(tmp_path: Path) -> None:
    """A golden from a pull request names a dtype or a class: torch's module __getattr__
    would import the submodule it names (torch._dynamo, torch._inductor.config)."""
    done = subprocess.run([sys.executable, "-c", LOADS_A_HOSTILE_GOLDEN,
                           str(tmp_path / "expected.safetensors")],
                          capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr



def test_complex_tensors_round_trip_and_other_layouts_are_refused(tmp_path: Path) -> None:
    z = torch.randn(4, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    out = [z, z.conj(), z.to(torch.complex64)]  # safetensors holds no complex dtype
    back = round_trip(tmp_path, out)
    assert compare(out, back).ok and [t.dtype for t in back] == [t.dtype for t in out]
    path = tmp_path / "refused.safetensors"
    for value, what in ((torch.ones(3).to_sparse(), "a sparse_coo tensor"),
                        (torch.ones(2, dtype=torch.int16).view(torch.bits16),
                         "safetensors cannot store torch.bits16")):
        with pytest.raises(golden.Unstorable, match=f"refused.safetensors not written: .*{what}"):
            golden.save(path, {"out": value})
        assert not path.exists()

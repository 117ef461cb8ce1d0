"""What a child makes of the call's outputs before judging them (execute.py)."""

from __future__ import annotations

import pytest
import torch

from pytest_gpucase.run.calls import MAX_OUTPUT_DEPTH
from tests.helpers import write_case

TOML = 'format = 1\ncall = "case.py:run"\n[matrix]\ndevices = ["cpu"]\n'


def nested(depth: int) -> str:
    """A case whose run returns ``depth`` lists, one in the other, around a tensor."""
    return f"""
        def run(x):
            out = x
            for _ in range({depth}):
                out = [out]
            return out
        """


def test_an_output_too_deep_or_holding_itself_is_an_output_problem_not_a_raise(
        pytester: pytest.Pytester) -> None:
    """The call returned normally: the failure names the output's path, not a RecursionError
    the walks over the output would raise (depth 500 and a list in itself did)."""
    x = {"x": torch.tensor([1.0, 2.0])}
    write_case(pytester.path, "at_limit", TOML, nested(MAX_OUTPUT_DEPTH), x)
    write_case(pytester.path, "too_deep", TOML, nested(MAX_OUTPUT_DEPTH + 1), x)
    write_case(pytester.path, "very_deep", TOML, nested(500), x)
    write_case(pytester.path, "itself", TOML, """
        def run(x):
            a = [x]
            a.append(a)
            return a
        """, x)
    write_case(pytester.path, "itself_deeper", TOML + "[expect]\ngradients = true\n", """
        def run(x):
            inner = {'y': x * 2}
            inner['loop'] = [inner]
            return (x, {'z': inner})
        """, x)
    write_case(pytester.path, "shared", TOML, """
        def run(x):
            part = [x, x * 2]
            return [part, part, {'again': part}]
        """, x)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(passed=2, failed=4)
    path = "out" + "[[]0[]]" * 8 + "..." + "[[]0[]]" * 2
    result.stdout.fnmatch_lines([  # the failures in the order of the items
        "*_ itself[[]cpu-float32[]] _*",
        "the call's output holds itself: out[[]1[]] is out again; its outputs are compared by "
        "value and a cycle has no end, so return one without it",
        "*_ itself_deeper[[]cpu-float32[]] _*",
        "the call's output holds itself: out[[]1[]][[]'z'[]][[]'loop'[]][[]0[]] is "
        "out[[]1[]][[]'z'[]] again; *",
        "*_ too_deep[[]cpu-float32[]] _*",
        f"the call's output nests deeper than {MAX_OUTPUT_DEPTH} levels at {path}; its outputs "
        "are walked level by level, so return a flatter value (a tensor, or a list of them)",
        "*_ very_deep[[]cpu-float32[]] _*",
        f"the call's output nests deeper than {MAX_OUTPUT_DEPTH} levels at {path}; *",
    ])
    text = result.stdout.str()
    assert "RecursionError" not in text
    assert "raised" not in text


def test_the_references_output_is_judged_the_same_way(pytester: pytest.Pytester) -> None:
    """Its run fails naming the reference, and regen writes no golden from it."""
    path = write_case(pytester.path, "ref_loop", TOML.replace(
        '[matrix]', 'reference = "case.py:reference"\n[matrix]'), """
        def run(x):
            return [x]

        def reference(x):
            a = [x]
            a.append(a)
            return a
        """, {"x": torch.tensor([1.0, 2.0])})
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["the reference's output holds itself: out[[]1[]] is out "
                                 "again; *"])
    regen = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases")
    regen.assert_outcomes(failed=1)
    regen.stdout.fnmatch_lines(["cases/ref_loop/case.toml: cases/ref_loop/expected.safetensors "
                                "not written: the reference's output holds itself: out[[]1[]] is "
                                "out again*"])
    assert not (path / "expected.safetensors").exists()


def test_dataclasses_and_other_sequences_are_checked_as_the_comparison_walks_them(
        pytester: pytest.Pytester) -> None:
    """The comparison walks dataclass fields and any sequence: a cycle through them ended in
    a RecursionError reported as a crash."""
    x = {"x": torch.tensor([1.0, 2.0])}
    write_case(pytester.path, "dataclass_cycle", TOML, """
        import dataclasses

        @dataclasses.dataclass
        class Node:
            value: object
            parent: object = None
            children: list = dataclasses.field(default_factory=list)

        def run(x):
            root = Node(x)
            root.children.append(Node(x * 2, parent=root))
            return root
        """, x)
    write_case(pytester.path, "userlist_cycle", TOML, """
        from collections import UserList

        def run(x):
            u = UserList([x])
            u.append(u)
            return u
        """, x)
    write_case(pytester.path, "dataclass_tree", TOML, """
        import dataclasses

        @dataclasses.dataclass
        class Pair:
            left: object
            right: object

        def run(x):
            return Pair(x, Pair(x * 2, [x, x]))
        """, x)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*_ dataclass_cycle[[]cpu-float32[]] _*",
        "the call's output holds itself: out.children[[]0[]].parent is out again; *",
        "*_ userlist_cycle[[]cpu-float32[]] _*",
        "the call's output holds itself: out[[]1[]] is out again; *",
    ])
    assert "RecursionError" not in result.stdout.str()


STEP = """
    import torch

    def run(x, w):
        # a hand-written training step: forward, backward, and the gradient it made
        w = w.clone().requires_grad_()
        loss = (x @ w).pow(2).mean()
        loss.backward()
        return w.grad
    """


def test_a_call_that_runs_its_own_backward_pass_passes_and_so_does_its_reference(
        pytester: pytest.Pytester) -> None:
    """Grad mode is torch's default unless [context] grad says otherwise, for the call and
    the float64 reference alike: the call ran under no_grad without the table, and the
    reference always did, so no case.toml made such a case pass."""
    tensors = {"x": torch.arange(6.0).reshape(3, 2) / 5, "w": torch.ones(2, 1)}
    write_case(pytester.path, "step", TOML, STEP, tensors)
    write_case(pytester.path, "step_grad", TOML + "[context]\ngrad = true\n", STEP, tensors)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*step[[]cpu-float32[]] PASSED*",
                                 "*step_grad[[]cpu-float32[]] PASSED*"])


def test_grad_false_runs_the_call_and_the_reference_under_no_grad(
        pytester: pytest.Pytester) -> None:
    """The call returns its grad mode, compared with the reference's constant 0 (off); the
    reference refuses to run with it on."""
    write_case(pytester.path, "no_grad", TOML.replace(
        "[matrix]", 'reference = "case.py:reference"\n[matrix]') + "[context]\ngrad = false\n", """
        import torch

        def run(x):
            return x * 0 + float(torch.is_grad_enabled())

        def reference(x):
            if torch.is_grad_enabled():
                raise RuntimeError("the reference runs with grad mode on")
            return x * 0
        """, {"x": torch.tensor([1.0, 2.0])})
    write_case(pytester.path, "default", TOML.replace(
        "[matrix]", 'reference = "case.py:reference"\n[matrix]'), """
        import torch

        def run(x):
            return x * 0 + float(torch.is_grad_enabled())

        def reference(x):
            return x * 0  # off: the call's grad mode (on) must show as a mismatch
        """, {"x": torch.tensor([1.0, 2.0])})
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*default[[]cpu-float32[]] FAILED*",
                                 "*no_grad[[]cpu-float32[]] PASSED*"])
    result.stdout.fnmatch_lines(["*outputs differ from the reference*"])


GRADIENTS = TOML + "[expect]\ngradients = true\n"


def test_gradients_true_with_nothing_to_differentiate_is_a_broken_case(
        pytester: pytest.Pytester) -> None:
    """An integer output, or float outputs that depend on no float input, gave no gradient at
    all: the run compared the outputs alone and passed as if the gradients were checked. A
    case where only some inputs get no gradient still passes."""
    xy = {"x": torch.tensor([1.0, -2.0]), "y": torch.tensor([3.0, 4.0])}
    write_case(pytester.path, "int_out", GRADIENTS, """
        def run(x, y):
            return (x > 0).sum()
        """, xy)
    write_case(pytester.path, "detached", GRADIENTS, """
        def run(x, y):
            return [x.detach() * 2, (y > 0).long()]
        """, xy)
    write_case(pytester.path, "grad_off", GRADIENTS + "[context]\ngrad = false\n", """
        def run(x, y):
            return x * y
        """, xy)
    write_case(pytester.path, "some_unused", GRADIENTS, """
        def run(x, y):
            return x * 2, (y > 0).sum()
        """, xy)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines([
        "*some_unused[[]cpu-float32[]] PASSED*",
        "*_ detached[[]cpu-float32[]] _*",
        "cases/detached/case.toml: [[]expect[]] gradients: true, but no float output of the "
        "call depends on a float tensor input (a top-level argument), so there is no gradient "
        "to compare; return a float tensor computed from the inputs, or remove gradients = true",
        "*_ grad_off[[]cpu-float32[]] _*",
        "cases/grad_off/case.toml: [[]expect[]] gradients: true, but the call runs with grad "
        "mode off ([[]context[]] grad = false or inference = true), so nothing is "
        "differentiated; turn grad mode on, or remove gradients = true",
        "*_ int_out[[]cpu-float32[]] _*",
        "cases/int_out/case.toml: [[]expect[]] gradients: true, but no float output of the "
        "call depends on a float tensor input*",
    ])
    regen = pytester.runpytest_subprocess("--gpu-cases", "--gpu-cases-regen", "cases/int_out")
    regen.assert_outcomes(failed=1)
    regen.stdout.fnmatch_lines(["*expected.safetensors not written: [[]expect[]] gradients: "
                                "true, but no float output of the call depends*"])


def test_a_bad_output_path_names_named_tuple_fields(pytester: pytest.Pytester) -> None:
    """As the comparison spells them: a named tuple's field and a torch.return_types
    structseq's (which has no _fields) were shown as out[1] and out[0]."""
    x = {"x": torch.tensor([[1.0, 2.0], [3.0, 0.0]])}
    write_case(pytester.path, "named", TOML, """
        import collections

        Pair = collections.namedtuple("Pair", "first rest")

        def run(x):
            rest = [x]
            rest.append(rest)
            return Pair(x, rest)
        """, x)
    write_case(pytester.path, "structseq", TOML, """
        import torch

        def run(x):
            found = torch.max(x, dim=0)
            return {"m": [found, found.indices.tolist()], "again": found}
        """, x)
    write_case(pytester.path, "structseq_cycle", TOML, """
        import torch

        def run(x):
            box = []
            found = torch.return_types.max([x, box])
            box.append(found)
            return found
        """, x)
    result = pytester.runpytest_subprocess("--gpu-cases", "cases", "-v")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*structseq[[]cpu-float32[]] PASSED*",
        "*_ named[[]cpu-float32[]] _*",
        "the call's output holds itself: out.rest[[]1[]] is out.rest again; *",
        "*_ structseq_cycle[[]cpu-float32[]] _*",
        "the call's output holds itself: out.indices[[]0[]] is out again; *",
    ])


def test_the_quick_binding_check_agrees_with_inspect() -> None:
    """``check_binding`` tells a plain function's binding from its code object (no signature
    built in the child); wherever it says "binds", ``inspect`` binds too, and for every plain
    function without positional-only parameters they agree."""
    import functools
    import inspect
    import itertools

    from pytest_gpucase.run.child import _binds

    shapes = ["", "a", "a, b", "a, b=1", "a=1, b=2", "a, *, k", "a, *, k=1", "*, k",
              "a, **kw", "*args", "a, *args, k=1, **kw", "a, /, b", "a=1, /, b=2"]
    names = ["a", "b", "k", "x"]
    inputs = [dict.fromkeys(chosen, 0) for size in range(4)
              for chosen in itertools.combinations(names, size)]
    checked = 0
    for shape in shapes:
        scope: dict[str, object] = {}
        exec(f"def f({shape}):\n    return 0\n", scope)
        func = scope["f"]
        assert callable(func)
        for given in inputs:
            try:
                inspect.signature(func).bind(**given)
                binds = True
            except TypeError:
                binds = False
            quick = _binds(func, given)
            assert binds or not quick, (shape, given)
            if "/" not in shape:
                assert quick == binds, (shape, given)
                checked += 1
        wrapped = functools.wraps(func)(lambda **kw: 0)
        assert not _binds(wrapped, {}) and not _binds(functools.partial(func), {})
    assert checked == 11 * len(inputs)


def test_two_cases_of_one_name_each_run_their_own_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """cases/a/GPT and cases/b/GPT in one process (a reused worker, a tool that runs
    cases in-process): the second must not find the first's case.py under the same module
    name and call its function."""
    from pytest_gpucase.case.load import load_case
    from pytest_gpucase.run.child import resolve

    paths = []
    for folder, body in (("a", "def run(x):\n    return x + 1\n"),
                         ("b", "def run(logits, target):\n    return logits\n")):
        case_dir = tmp_path / folder / "same"
        case_dir.mkdir(parents=True)
        (case_dir / "case.toml").write_text('format = 1\ncall = "case.py:run"\n')
        (case_dir / "case.py").write_text(body)
        paths.append(case_dir)
    first = resolve(load_case(paths[0]), "case.py:run", "call")
    second = resolve(load_case(paths[1]), "case.py:run", "call")
    assert first.__code__.co_varnames[:1] == ("x",)
    assert second.__code__.co_varnames[:2] == ("logits", "target")

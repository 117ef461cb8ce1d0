"""Any output object is comparable: registered with torch.utils._pytree, or holding tensors in
its attributes (a transformers cache), by its tensors and with the paths a user writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from pytest_gpucase.verdict.compare import compare
from pytest_gpucase.verdict.structure import named_leaves, parts


class Layer:
    """A cache layer as transformers writes one: tensors and flags, no == of its own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.device = keys.device
        self.dtype = keys.dtype


class Cache:
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.offloading = False


class Registered:
    """A result class registered with pytree, as a library registers its outputs."""

    def __init__(self, hidden: torch.Tensor, scale: float) -> None:
        self.hidden, self.scale = hidden, scale


pytree.register_pytree_node(
    Registered,
    lambda r: ([r.hidden, r.scale], None),
    lambda children, _: Registered(*children),
    flatten_with_keys_fn=lambda r: ([(pytree.GetAttrKey("hidden"), r.hidden),
                                     (pytree.GetAttrKey("scale"), r.scale)], None),
)


def cache(scale: float = 1.0, dtype: torch.dtype = torch.float32) -> Cache:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2):
        keys = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) * scale
        values = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
        layers.append(Layer(keys.to(dtype), values.to(dtype)))
    return Cache(layers)


def test_an_object_holding_tensors_compares_by_its_attributes() -> None:
    expected = {"cache": cache(dtype=torch.float64)}
    assert compare({"cache": cache()}, expected, check_dtype=False).ok
    wrong = cache()
    wrong.layers[1].values = wrong.layers[1].values * 1.01
    result = compare({"cache": wrong}, expected, check_dtype=False)
    assert [m.path for m in result.mismatches] == ["out['cache'].layers[1].values"]
    # Where a value lives and the dtype it was cast to are the run's, not values to compare.
    assert compare({"cache": cache()}, {"cache": cache(dtype=torch.float64)},
                   check_dtype=False).ok


def test_a_pytree_registered_type_compares_by_its_children() -> None:
    expected = Registered(torch.ones(3, dtype=torch.float64), 0.5)
    assert compare(Registered(torch.ones(3), 0.5), expected, check_dtype=False).ok
    result = compare(Registered(torch.ones(3), 0.75), expected, check_dtype=False)
    assert [m.path for m in result.mismatches] == ["out.scale"]
    assert parts(expected) == [(".hidden", expected.hidden), (".scale", 0.5)]


def test_named_leaves_spell_the_paths_the_comparison_reports() -> None:
    value = {"logits": torch.zeros(2), "cache": cache(), "loss": 0.5,
             "steps": [torch.ones(1), 3]}
    paths = [path for path, _ in named_leaves(value)]
    assert paths == ["out['logits']", "out['cache'].layers[0].keys",
                     "out['cache'].layers[0].values", "out['cache'].layers[1].keys",
                     "out['cache'].layers[1].values", "out['loss']", "out['steps'][0]"]


def test_a_type_still_not_comparable_names_the_type_and_what_to_return() -> None:
    class Handle:  # no ==, no tensor: nothing to compare by
        def __init__(self) -> None:
            self.name = "x"

    (mismatch,) = compare({"h": Handle()}, {"h": Handle()}).mismatches
    assert mismatch.path == "out['h']"
    assert "type test_a_type_still_not_comparable_names_the_type_and_what_to_return.<locals>" \
           ".Handle defines no ==, so only the same object is equal" in mismatch.message
    assert "objects holding tensors in their attributes; return one of those" in mismatch.message


def test_a_back_reference_is_walked_once() -> None:
    parent_a, parent_e = cache(), cache(dtype=torch.float64)
    for parent in (parent_a, parent_e):
        parent.layers[0].owner = parent  # type: ignore[attr-defined]
    assert compare(parent_a, parent_e, check_dtype=False).ok


def test_a_dataclass_is_still_compared_field_by_field() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        step: int

    result = compare(Out(torch.ones(2), 1), Out(torch.zeros(2), 1))
    assert [m.path for m in result.mismatches] == ["out.logits"]


def test_a_transformers_cache_from_a_real_model() -> None:
    """A causal LM built from a config (random weights, no hub) returns a DynamicCache: not
    registered with pytree in transformers 5, compared by its layers' tensors."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        run = model(input_ids=ids, use_cache=True)
        reference = model.double()(input_ids=ids, use_cache=True)
    actual = {"logits": run.logits, "cache": run.past_key_values}
    expected = {"logits": reference.logits, "cache": reference.past_key_values}
    assert compare(actual, expected, check_dtype=False).ok
    actual["cache"].layers[0].keys = actual["cache"].layers[0].keys + 1e-2
    result = compare(actual, expected, check_dtype=False)
    assert [m.path for m in result.mismatches] == ["out['cache'].layers[0].keys"]


@pytest.mark.slow   # a child
def test_a_sparse_output_that_differs_is_a_mismatch_not_a_crash_of_the_verdict(
        tmp_path: Path) -> None:
    """A sparse output off its reference crashed gpucase's own range check and budget
    (NotImplementedError for the sparse backend): the item said "the run failed inside the
    child". It is compared by its dense values, as the docs say, budget included."""
    from tests.helpers import replay_cpu, write_case

    toml = 'format = 1\ncall = "case.py:run"\nreference = "case.py:expected"\n'
    code = ("def run(x):\n    return (x * 2).to_sparse()\n\n"
            "def expected(x):\n    return (x * {factor}).to_sparse()\n")
    same = write_case(tmp_path, "same", toml, code.format(factor=2), {"x": torch.ones(3)})
    differs = write_case(tmp_path, "differs", toml, code.format(factor=3), {"x": torch.ones(3)})
    assert replay_cpu(same).outcome.status == "passed"
    outcome = replay_cpu(differs).outcome
    assert outcome.status == "failed" and outcome.kind == "mismatch", outcome.summary
    assert not any("could not be computed" in note for note in outcome.notes), outcome.notes

"""State the code owns is replayed from the code, and a case whose state no longer fits the
model is a stale case: a causal mask planted broken in ``__init__``, recorded with the
Recorder, turns XPASS(strict) once ``model.py`` is fixed (also when the fix makes the buffer
non-persistent); a renamed layer is told as a stale case, naming the keys, with no advice to
expect the exception."""

from __future__ import annotations

import re
import shutil
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gpucase.run.outcome import CaseSetupError, StaleCaseError, raised
from pytest_gpucase.run.replay import replay_module
from pytest_gpucase.tools.record.owned import code_owned
from pytest_gpucase.tools.record.rebuild import module_state, rebuild_of
from tests.helpers import python_in


MODEL = '''
import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=8, n_head=2, block_size=6):
        super().__init__()
        self.n_embd = n_embd
        self.n_head = n_head
        self.block_size = block_size
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size), MASK)
                             .view(1, 1, block_size, block_size)PERSISTENT)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT(nn.Module):
    def __init__(self, vocab=11, n_embd=8, n_head=2, block_size=6):
        super().__init__()
        self.vocab = vocab
        self.n_embd = n_embd
        self.n_head = n_head
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.ln = nn.LayerNorm(n_embd)
        self.ATTN = CausalSelfAttention(n_embd, n_head, block_size)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.ATTN(self.ln(x))
        return self.head(x)
'''

TRAIN = '''
import torch
from model import GPT
from pytest_gpucase import Recorder

torch.manual_seed(0)
model = GPT()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
rec = Recorder("cases", nonfinite=True)
rec.watch(model)
for step in range(3):
    with rec.step(step):
        logits = model(torch.randint(0, 11, (2, 5)))
        logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
'''

BROKEN = "diagonal=-1"   # the planted bug: the mask hides each token from itself
FIXED = "diagonal=0"


def model_source(mask: str = BROKEN, persistent: bool = True, attn: str = "attn") -> str:
    return (textwrap.dedent(MODEL).replace("MASK", mask).replace("ATTN", attn)
            .replace("PERSISTENT", "" if persistent else ", persistent=False"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project as the user left it after training: the broken model and its case."""
    project = tmp_path_factory.mktemp("nanogpt")
    (project / "model.py").write_text(model_source())
    (project / "train.py").write_text(textwrap.dedent(TRAIN))
    done = python_in(project, "train.py")
    assert "FloatingPointError" in done.stderr, done.stderr
    return project


def project_copy(recorded: Path, pytester: pytest.Pytester) -> Path:
    shutil.copytree(recorded, pytester.path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return pytester.path


def replay(pytester: pytest.Pytester, cases: str = "cases") -> pytest.RunResult:
    """Run the cases (the model's, GPT, and its attention's, narrowed from the NaN it made:
    GPT.attn), or those under ``cases``."""
    return pytester.runpytest_subprocess("--gpu-cases", cases, "--gpu-devices", "cpu",
                                         "-rxX", "-p", "no:cacheprovider", "-p", "no:randomly")


def module_table(project: Path) -> dict[str, Any]:
    doc = tomllib.loads((project / "cases" / "GPT" / "case.toml").read_text())
    table: dict[str, Any] = doc["inputs"]["gpucase_module"]
    return table


@pytest.mark.slow
def test_a_fixed_mask_in_init_reaches_the_replay(recorded: Path,
                                                 pytester: pytest.Pytester) -> None:
    project = project_copy(recorded, pytester)
    table = module_table(project)
    # The mask is the code's; the weights that train are not, even at step 0.
    assert table["code_owned"] == ["attn.bias"], table
    assert sorted(p.name for p in (project / "cases").iterdir()) == ["GPT", "GPT.attn"]
    replay(pytester).assert_outcomes(xfailed=2)
    (project / "model.py").write_text(model_source(FIXED))
    after = replay(pytester)
    after.assert_outcomes(failed=2)   # both XPASS(strict): the fix reaches both
    after.stdout.fnmatch_lines(["*[[]XPASS(strict)[]]*"])


@pytest.mark.slow
def test_a_fix_that_makes_the_mask_non_persistent_reaches_the_replay(
        recorded: Path, pytester: pytest.Pytester) -> None:
    project = project_copy(recorded, pytester)
    (project / "model.py").write_text(model_source(FIXED, persistent=False))
    after = replay(pytester, "cases/GPT")
    after.assert_outcomes(failed=1)
    after.stdout.fnmatch_lines(["*[[]XPASS(strict)[]]*"])
    assert "Unexpected key" not in after.stdout.str()


def assert_stale(result: pytest.RunResult, *words: str) -> None:
    """The item fails as a stale case naming ``words``, never advising to expect it."""
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "stale case: the state it saved no longer fits the GPT" in text, text
    for word in words:
        assert word in text, text
    assert "record the case again" in text
    assert "outcome = \"raises\"" not in text and "XPASS" not in text
    assert "not the captured failure" not in text


@pytest.mark.slow
def test_a_renamed_layer_is_a_stale_case(recorded: Path, pytester: pytest.Pytester) -> None:
    project = project_copy(recorded, pytester)
    (project / "model.py").write_text(model_source(FIXED, attn="attention"))
    assert_stale(replay(pytester, "cases/GPT"), "the model has no attn.", "attn.c_attn.weight",
                 "(a layer renamed or removed?)", "the case holds no attention.",
                 "attention.c_attn.weight")
    # Nor does a case that expects an exception take the stale state's for it.
    case_toml = project / "cases" / "GPT" / "case.toml"
    text = re.sub(r'(?m)^xfail = .*\n', "", case_toml.read_text())
    case_toml.write_text(text.replace('[expect]\noutcome = "matches"',
                                      '[expect]\noutcome = "raises"\n'
                                      'exception = "RuntimeError"'))
    expecting = replay(pytester, "cases/GPT")
    expecting.assert_outcomes(failed=1)
    assert "stale case" in expecting.stdout.str()


@pytest.mark.slow
def test_a_case_without_code_owned_made_non_persistent_is_stale(
        recorded: Path, pytester: pytest.Pytester) -> None:
    """A case recorded before code_owned existed loads every entry as saved: a buffer the
    model no longer saves is a stale case naming it, not 'Unexpected key(s)' to expect."""
    project = project_copy(recorded, pytester)
    case_toml = project / "cases" / "GPT" / "case.toml"
    case_toml.write_text(re.sub(r'code_owned = \[[^\]]*\]\n', "", case_toml.read_text()))
    (project / "model.py").write_text(model_source(FIXED, persistent=False))
    assert_stale(replay(pytester, "cases/GPT"), "attn.bias is a buffer the model no longer saves "
                 "(persistent=False)")


# -- which entries the code owns, in-process ----------------------------------------------


class Mixed(torch.nn.Module):
    """An entry of each kind: trained, drawn, frozen constant, constant buffer, running."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self.proj = torch.nn.Linear(dim, dim)                                  # drawn
        self.scale = torch.nn.Parameter(torch.ones(dim), requires_grad=False)  # frozen const
        self.noise = torch.nn.Parameter(torch.randn(dim), requires_grad=False)  # frozen drawn
        self.gain = torch.nn.Parameter(torch.ones(dim))                        # trains
        self.register_buffer("pos", torch.arange(dim, dtype=torch.float32))    # constant
        self.register_buffer("running", torch.zeros(dim))                      # changes


def test_only_entries_equal_to_the_constructors_whatever_the_seed_are_the_codes() -> None:
    torch.manual_seed(3)
    model = Mixed()
    model.get_buffer("running").add_(1.0)  # what training did to a buffer
    rebuild = rebuild_of(model, None, None)
    assert rebuild.factory is not None, rebuild.why_not
    before = torch.random.get_rng_state()
    owned = code_owned(model, rebuild, module_state(model).tensors)
    assert owned == ("pos", "scale")
    assert torch.equal(torch.random.get_rng_state(), before)  # the user's RNG untouched


def test_a_model_cast_after_construction_is_compared_in_its_dtype() -> None:
    model = Mixed().half()   # running is untouched, so still the constructor's
    owned = code_owned(model, rebuild_of(model, None, None), module_state(model).tensors)
    assert owned == ("pos", "running", "scale")


def make_from_file(path: str) -> torch.nn.Module:
    """A factory that loads its weights from a file, which may change after the capture."""
    model = Mixed()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def test_a_factory_that_reads_a_data_file_owns_nothing(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(Mixed().state_dict(), weights)
    model = make_from_file(str(weights))
    rebuild = rebuild_of(model, f"{__name__}:make_from_file", {"path": str(weights)})
    assert rebuild.factory is not None, rebuild.why_not
    assert code_owned(model, rebuild, module_state(model).tensors) == ()


# -- stale state and a setup that fails, in-process ---------------------------------------


def linear_state() -> dict[str, torch.Tensor]:
    return {f"state.{k}": v for k, v in torch.nn.Linear(4, 3).state_dict().items()}


def test_a_changed_shape_is_a_stale_case_naming_the_key() -> None:
    with pytest.raises(StaleCaseError) as stale:
        replay_module(gpucase_module={"factory": "torch.nn:Linear",
                                      "kwargs": {"in_features": 4, "out_features": 2}},
                      input=torch.ones(1, 4), **linear_state())
    assert "weight is [3, 4] in the case, [2, 4] in the model" in str(stale.value)
    outcome = raised("the call", stale.value)
    assert outcome.kind == "broken case" and outcome.summary.startswith(
        "the call could not be set up: stale case:"), outcome


def test_a_model_that_cannot_be_built_is_a_setup_failure_not_the_calls() -> None:
    with pytest.raises(CaseSetupError) as failed:
        replay_module(gpucase_module={"factory": "torch.nn:Linear",
                                      "kwargs": {"in_features": 4}},
                      input=torch.ones(1, 4), **linear_state())
    assert "building the model to replay failed (TypeError" in str(failed.value)
    outcome = raised("the call", failed.value)
    assert outcome.kind == "broken case" and "TypeError" in outcome.details, outcome


def test_gradients_of_a_batch_norm_model_leave_its_running_stats_alone() -> None:
    """With ``[expect] gradients = true`` every float input requires grad, the saved state
    included; a batch norm in training refuses a running_mean that does. Buffers are loaded
    detached: the parameters and the inputs are what is differentiated."""
    from pytest_gpucase.run.calls import call

    norm = torch.nn.BatchNorm1d(4)
    state = {f"state.{k}": v for k, v in norm.state_dict().items()}
    inputs = {"gpucase_module": {"factory": "torch.nn:BatchNorm1d",
                                 "kwargs": {"num_features": 4}, "training": True},
              "input": torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), **state}
    found = call(replay_module, inputs, True, "cpu")
    assert found["grad"]["input"] is not None
    assert found["grad"]["state.running_mean"] is None

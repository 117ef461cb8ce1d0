"""Models built from a config object of each kind, for tests/test_record_configs.py (a replay
imports them): nanoGPT's ``GPT(GPTConfig(...))`` shape, its config a dataclass (nested
too), a namespace, a named tuple, a typed dict, a pydantic model or a Hugging Face config."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, TypedDict

import torch


@dataclasses.dataclass
class Sizes:
    vocab: int = 8
    dim: int = 4


class Act(enum.Enum):
    GELU = "gelu"
    RELU = "relu"


@dataclasses.dataclass
class GPTConfig:
    sizes: Sizes = dataclasses.field(default_factory=Sizes)
    dropout: float = 0.0
    name: str = "tiny"
    api_key: str = ""      # read by no constructor: a secret the case never holds
    extra: Any = None      # plain data, or not (a tensor, a function)
    act: Act = Act.GELU


class TupleConfig(NamedTuple):
    vocab: int
    dim: int


class DictConfig(TypedDict):
    vocab: int
    dim: int


def _sizes(config: Any) -> tuple[int, int]:
    """(vocab, dim) of any config kind."""
    if isinstance(config, dict):
        return config["vocab"], config["dim"]
    if hasattr(config, "sizes"):
        return config.sizes.vocab, config.sizes.dim
    if hasattr(config, "vocab_size"):  # a Hugging Face config
        return config.vocab_size, config.n_embd
    return config.vocab, config.dim


class GPT(torch.nn.Module):
    """An embedding and a head tied to it, built from ``config`` and keeping it as
    ``self.config`` (as nanoGPT does): a token id >= vocab raises in the embedding."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        vocab, dim = _sizes(config)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(tokens))
        return out


class RenamedGPT(GPT):
    """``GPT(config)`` that keeps its config under another name (``self.cfg``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        del self.config
        self.cfg = config


def pydantic_config() -> Any:
    """A pydantic model of the sizes (None where pydantic is not installed)."""
    try:
        return PydanticConfig(vocab=8, dim=6)
    except NameError:
        return None


try:
    import pydantic

    class PydanticConfig(pydantic.BaseModel):
        vocab: int
        dim: int
except ImportError:  # pragma: no cover - pydantic comes with the test dependencies
    pass


class Lookup(torch.nn.Module):
    """Indexes a table in its own forward (no submodule): a token id >= vocab raises there."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.table = torch.nn.Parameter(torch.zeros(config.sizes.vocab, config.sizes.dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]

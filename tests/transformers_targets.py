"""Datasets and configs for tests/test_integration_transformers.py: tiny models built from
configs with random weights (no hub)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, GPT2Config


def bert_config(**changes: Any) -> BertConfig:
    return BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=32, num_labels=3,
                      max_position_embeddings=16, hidden_dropout_prob=0.2, **changes)


def gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                      tie_word_embeddings=True)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """16 sequences of 6 tokens with labels; item 9's label (or token) is out of range."""

    def __init__(self, bad_label: bool = False, bad_token: bool = False,
                 causal: bool = False) -> None:
        self.bad_label, self.bad_token, self.causal = bad_label, bad_token, causal

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.tensor([(i + k) % 50 for k in range(6)])
        labels = tokens.clone() if self.causal else torch.tensor([i % 3] * 6)
        if i == 9 and self.bad_label:
            labels[2] = 7
        if i == 9 and self.bad_token:
            tokens[2] = 77
        return {"input_ids": tokens, "labels": labels}

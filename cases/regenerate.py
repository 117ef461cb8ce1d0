"""Write the payloads of the bundled cases (deterministic; run from the repository root).

    python cases/regenerate.py

Each payload holds a real batch of the failure it reproduces, small enough to
read: the layout (strides, offset) is saved exactly by pytest_gpucase.payload.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pytest_gpucase import payload

HERE = Path(__file__).parent


def main() -> None:
    gen = torch.Generator().manual_seed(1834)
    # A 4-class head; the annotation file numbered classes 1..4, so one label reads 4.
    logits = torch.randn(3, 4, generator=gen)
    payload.save(HERE / "ce_class4" / "inputs.safetensors",
                 {"logits": logits, "target": torch.tensor([0, 2, 4])})
    payload.save(HERE / "ce_valid" / "inputs.safetensors",
                 {"logits": logits, "target": torch.tensor([0, 2, 3])})
    # Token ids from a 1024-entry tokenizer against a 1000-row embedding table.
    tokens = torch.randint(0, 1000, (2, 5), generator=gen)
    tokens[1, 2] = 1000
    payload.save(HERE / "embedding_oob" / "inputs.safetensors",
                 {"tokens": tokens, "table": torch.randn(1000, 8, generator=gen)})
    # An activation that reaches row_sums transposed: a non-contiguous view with offset.
    storage = torch.randn(1 + 6 * 5, generator=gen)
    x = storage[1:].view(6, 5).t()
    payload.save(HERE / "rowsum_transposed" / "inputs.safetensors", {"x": x})
    # Post-residual activations; bfloat16 keeps 8 bits of mantissa (spacing 0.03 near 5).
    acts = 5.0 + 2.0 * torch.randn(4, 64, generator=gen)
    payload.save(HERE / "layernorm_bf16" / "inputs.safetensors",
                 {"x": acts, "weight": 1 + 0.1 * torch.randn(64, generator=gen),
                  "bias": 0.1 * torch.randn(64, generator=gen)})

    # Token embeddings of three sentences; the second is left-padded, so its
    # first tokens are padding and a length=1 cut leaves it nothing to average.
    x = torch.randn(3, 16, 8, generator=gen)
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, 12:] = False
    payload.save(HERE / "masked_mean" / "inputs.safetensors", {"x": x, "mask": mask})

    # A tiny LM's state (16-token vocabulary, width 8) as capture saves it (state.<name>),
    # and an eval batch whose tokenizer has since gained <pad> = 16: one id equals the vocab.
    vocab, dim = 16, 8
    tokens = torch.randint(0, vocab, (2, 6), generator=gen)
    tokens[1, 4:] = vocab
    payload.save(HERE / "embedding_oob_model" / "inputs.safetensors", {
        "tokens": tokens,
        "state.emb.weight": torch.randn(vocab, dim, generator=gen),
        "state.head.weight": torch.randn(vocab, dim, generator=gen) / dim**0.5,
        "state.head.bias": torch.zeros(vocab)})

    # One attention head over two sequences of 5; the second is left-padded by 2, so
    # under the causal mask its queries 0 and 1 see only padding keys: fully masked rows.
    q, k, v = (torch.randn(2, 5, 8, generator=gen) for _ in range(3))
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 1, 5, dtype=torch.bool)
    padding[1, :, :2] = True
    payload.save(HERE / "attention_masked_row" / "inputs.safetensors",
                 {"q": q, "k": k, "v": v, "mask": causal | padding})


if __name__ == "__main__":
    main()

"""Fine-tune a tiny tagger with the Hugging Face Trainer; the gpucase callback saves the first
failure as a case.

    python train.py                 # fails at its sixth step and writes cases/Tagger (+ op)
    pytest --gpu-cases cases -rxX   # replays them (see README.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel, BertPreTrainedModel, Trainer, TrainingArguments
from transformers.modeling_outputs import TokenClassifierOutput

from pytest_gpucase.integrations.transformers import GpuCaseCallback

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
PAD = -1  # what the collator pads the tags of short sentences with


class Tagger(BertPreTrainedModel):
    """A BERT encoder and a per-token head over TAGS, with its own loss."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> TokenClassifierOutput:
        logits = self.head(self.bert(input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            # The bug: padded tags are PAD (-1), but cross_entropy ignores -100 by default.
            loss = F.cross_entropy(logits.reshape(-1, self.config.num_labels).float(),
                                   labels.reshape(-1))
        return TokenClassifierOutput(loss=loss, logits=logits)


class Sentences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """32 sentences of 6 tokens; sentence 9 is 4 tokens long, its last 2 tags padded."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        tokens = torch.randint(1, 64, (6,), generator=generator)
        tags = torch.randint(0, len(TAGS), (6,), generator=generator)
        if i == 9:
            tokens[4:], tags[4:] = 0, PAD
        return {"input_ids": tokens, "labels": tags}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=Path("cases"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=len(TAGS),
                        max_position_embeddings=32)
    training = TrainingArguments(output_dir="out", per_device_train_batch_size=4,
                                 num_train_epochs=1, use_cpu=True, bf16=True, report_to=[],
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Tagger(config), args=training, train_dataset=Sentences(),
                      callbacks=[GpuCaseCallback(args.cases)])
    trainer.train()


if __name__ == "__main__":
    main()

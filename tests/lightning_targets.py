"""Importable LightningModules for tests/test_integration_lightning.py (a replay imports them)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a custom backward rejected its gradient")


class TinyLit(pl.LightningModule):
    """An embedding, dropout and a head, trained on next-token classes; ``blow`` makes the
    loss NaN at that step, ``boom_backward`` raises in the backward pass."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.1,
                 blow: int = -1, boom_backward: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(tokens)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))
        if batch_idx == self.hparams.blow:
            loss = loss * torch.tensor(float("nan"))
        if batch_idx == self.hparams.boom_backward:
            loss = _RaiseInBackward.apply(loss)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(bad_target: bool = False, bad_token: bool = False, batches: int = 4) -> DataLoader:
    """``batches`` batches of 4 sequences of 3 tokens; batch 2 holds the bad value asked for."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4 * batches, 3), generator=generator)
    target = torch.randint(0, 16, (4 * batches, 3), generator=generator)
    if bad_target:
        target[9, 1] = 99
    if bad_token:
        tokens[9, 1] = 99
    return DataLoader(TensorDataset(tokens, target), batch_size=4)


class SecretLit(TinyLit):
    """TinyLit that keeps a logger key and a database URL among its hyperparameters, as
    ``save_hyperparameters()`` of a real script does."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.1, blow: int = -1,
                 boom_backward: int = -1, wandb_api_key: str = "",
                 db_url: str = "") -> None:
        super().__init__(vocab, dim, dropout, blow, boom_backward)
        self.save_hyperparameters()


class KeyedLit(TinyLit):
    """A LightningModule whose construction reads a secret-looking hyperparameter (the
    number of heads hidden in ``api_key``'s text, as a contrived stand-in for a constructor
    that fetches something with it)."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.1, blow: int = -1,
                 boom_backward: int = -1, api_key: str = "k-4") -> None:
        super().__init__(vocab, dim, dropout, blow, boom_backward)
        self.save_hyperparameters()
        self.extra = torch.nn.Linear(dim, int(api_key.rsplit("-", 1)[-1]))


class SparseAdamLit(TinyLit):
    """A sparse embedding trained with Adam: Adam's step raises, after training_step
    returned (outside any call a case can replay)."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.1, blow: int = -1,
                 boom_backward: int = -1) -> None:
        super().__init__(vocab, dim, dropout, blow, boom_backward)
        self.emb = torch.nn.Embedding(vocab, dim, sparse=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)


class CriterionLit(TinyLit):
    """The loss is a criterion module called in training_step, outside the forward."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.1, blow: int = -1,
                 boom_backward: int = -1) -> None:
        super().__init__(vocab, dim, dropout, blow, boom_backward)
        self.criterion = torch.nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        logits = self(tokens)
        return self.criterion(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class GptLit(pl.LightningModule):
    """A LightningModule holding a tiny Hugging Face GPT-2 (its LM head tied to its token
    embedding), trained on ``{"input_ids": ids, "labels": ids}``: the HF convention."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16,
                                         n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lm_loader(bad_token: bool = False) -> DataLoader:
    """4 batches of 2 sequences of 6 tokens below 32 (batch 2 holds token 40 when asked),
    each batch ``{"input_ids": ids, "labels": ids}``: one tensor under both names."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (8, 6), generator=generator)
    if bad_token:
        tokens[5, 2] = 40

    def collate(rows: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([row[0] for row in rows])
        return {"input_ids": ids, "labels": ids}

    return DataLoader(TensorDataset(tokens), batch_size=2, collate_fn=collate)


class ManualLit(TinyLit):
    """TinyLit stepping its own optimizer (``automatic_optimization = False``): what it asks
    of the Trainer (optimizers, schedulers, manual_backward, clipping) the replay gives."""

    def __init__(self, vocab: int = 16, dim: int = 8, dropout: float = 0.0, blow: int = -1,
                 boom_backward: int = -1) -> None:
        super().__init__(vocab, dim, dropout, blow, boom_backward)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0)
        optimizer.step()
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]


class TwoValLit(TinyLit):
    """Validated on two dataloaders: the second one's targets are checked against a class
    count of its own (``dataloader_idx`` changes what the step does)."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0,
                        ) -> torch.Tensor:
        tokens, target = batch
        if dataloader_idx == 1 and int(target.max()) >= 8:
            raise ValueError(f"loader 1 holds class {int(target.max())}, above its 8")
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class NoIndexLit(TinyLit):
    """Its steps take the batch alone: Lightning then passes no batch_idx."""

    def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)

    def validation_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)


class DictLit(TinyLit):
    """Trained on the dicts a Dataset of samples yields: ``idx``, ``targets``, ``mask`` and
    the samples' string ``id`` (collated to a list, so the case nests the batch)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["idx"], batch["targets"]), batch_idx)


class DictSamples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """12 samples ``s0000``..``s0011`` of 3 tokens; sample ``s0005`` holds target 16 of 16."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.idx = torch.randint(0, 16, (12, 3), generator=generator)
        self.targets = torch.randint(0, 16, (12, 3), generator=generator)
        self.targets[5, 2] = 16

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": self.idx[i], "targets": self.targets[i], "mask": torch.ones(3),
                "id": f"s{i:04d}"}

"""Importable models and functions for tests/test_model_capture.py (a replay imports them)."""

from __future__ import annotations

from typing import Any

import torch


class TinyLM(torch.nn.Module):
    """An embedding and a linear head: a token id >= vocab raises inside the embedding."""

    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


class DropLM(TinyLM):
    """TinyLM with dropout, whose rate it keeps only inside its nn.Dropout."""

    def __init__(self, vocab: int = 8, dim: int = 4, dropout: float = 0.1) -> None:
        super().__init__(vocab, dim)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(tokens)))


class TiedLM(TinyLM):
    """TinyLM whose head shares the embedding's weight (an LM head tied to its input)."""

    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


class BagLM(torch.nn.Module):
    """An EmbeddingBag of 64 rows: a token 64 raises an error no triage class names."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(64, 4, mode="sum")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.bag(tokens)


class ShapeLM(torch.nn.Module):
    """A projection from 4 features: 5 raise a shape error."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


class NaNLM(TinyLM):
    """Its output is infinite where the token is 7: a NaN loss follows."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out * torch.where(tokens == 7, float("inf"), 1.0).unsqueeze(-1)


class SqrtLM(torch.nn.Module):
    """Scales by the square root of a parameter: its gradient is infinite where it is 0."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim
        self.scale = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.sqrt()


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.limit = limit
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if not torch.isfinite(grad).all():
            raise FloatingPointError("non-finite gradient reached Boom.backward")
        if grad.abs().max() > ctx.limit:
            raise FloatingPointError(f"gradient above {ctx.limit} reached Boom.backward")
        return grad * 2, None


class BackwardBoom(torch.nn.Module):
    """Raises in backward when the gradient that reaches it is not finite (or above
    ``limit``)."""

    def __init__(self, dim: int = 3, limit: float = float("inf")) -> None:
        super().__init__()
        self.dim = dim
        self.limit = limit
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(self.lin(x), self.limit)  # type: ignore[no-any-return]


def scaled_sum(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A loss: the sum of ``x`` times ``scale`` (a NaN scale sends NaN gradients back)."""
    return (x * scale).sum()


def mixed_matmul(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bf16 activations times fp32 weights: fine under autocast, a dtype error without it."""
    return torch.mm(x, w)[rows]


class InplaceSigmoid(torch.nn.Module):
    """Scales sigmoid's output in place, which sigmoid's backward needs: backward raises
    autograd's long "modified by an inplace operation" message."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).sigmoid()
        y.mul_(2)
        return y.sum()


class KindsModel(torch.nn.Module):
    """State of the kinds a safetensors file cannot hold as they are: a complex128 parameter,
    a sparse COO and a sparse CSR buffer, a quantized buffer. Its forward raises while any
    of them holds more than ``limit`` (what training put there, not the constructor)."""

    def __init__(self, n: int = 4, limit: float = 10.0) -> None:
        super().__init__()
        self.n = n
        self.limit = limit
        self.spectrum = torch.nn.Parameter(torch.ones(n, dtype=torch.complex128))
        self.register_buffer("mask", torch.eye(n).to_sparse())
        self.register_buffer("graph", torch.eye(n).to_sparse_csr())
        self.register_buffer("codes", torch.quantize_per_tensor(torch.zeros(n), 0.5, 0,
                                                                torch.qint8))
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = {"spectrum": float(self.spectrum.abs().max()),
                 "mask": float(self.mask.to_dense().abs().max()),
                 "graph": float(self.graph.to_dense().abs().max()),
                 "codes": float(self.codes.dequantize().abs().max())}
        for name, size in sizes.items():
            if size > self.limit:
                raise ValueError(f"{name} grew to {size}, above {self.limit}")
        spectrum = torch.fft.fft(self.lin(x).double()) * self.spectrum
        return torch.fft.ifft(spectrum).real.float() @ self.mask.to_dense()


class ExtraStateModel(torch.nn.Module):
    """Keeps a count in its extra state (``get_extra_state``), which no payload holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0

    def get_extra_state(self) -> dict[str, int]:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls > 2:
            raise ValueError(f"called {self.calls} times")
        return self.lin(x)


# Issue 30: secrets a user's exception carries (a URL's password, a GitHub token).
DB_URL = "postgres://alice:hunter2pw@db.example.com:5432/prod"
GH_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


def load_shard(x: torch.Tensor) -> torch.Tensor:
    """Fails as a data loader does when its database refuses it: the message holds secrets."""
    if float(x.sum()) > 0:
        raise ConnectionError(f"cannot reach {DB_URL} with token {GH_TOKEN}: refused")
    return x


def clamp_check(x: torch.Tensor) -> torch.Tensor:
    """Raises with prose that holds "pass:" and "key:", no secret."""
    if float(x.max()) > 1:
        raise ValueError("logits above 1: do not clamp them to make it pass: mask the "
                         "padding instead; the sort key: length")
    return x


class MetaPart(torch.nn.Module):
    """A model one of whose submodules is on the meta device (offloaded, or lazily
    initialized); its forward fails before it reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.offloaded = torch.nn.Linear(3, 3, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.max()) > 1:
            raise ValueError("input above 1")
        return self.lin(x)


class Wide(torch.nn.Module):
    """A model of 2 MiB of weights (above the store's 1 MiB) that fails on a negative input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(512, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.min()) < 0:
            raise ValueError("negative input")
        return self.lin(x)


class Float32Attention(torch.nn.Module):
    """Scores in float32 with autocast off (as attention code keeps its softmax exact), but
    the values stay in the bfloat16 autocast made them: bmm of float32 and bfloat16 raises."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.q = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, v = self.q(x), self.v(x)     # bfloat16 under autocast
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.bmm(q.float(), q.float().transpose(1, 2)).softmax(-1)
            return torch.bmm(scores, v)


def batch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss over a dict batch: its inputs and its targets share the batch axis."""
    logits = batch["x"] @ torch.ones(batch["x"].shape[-1], 3)
    return torch.nn.functional.cross_entropy(logits, batch["y"])


class PadAttention(torch.nn.Module):
    """Self-attention that masks padded keys with -inf: a sequence that is all padding
    leaves every row of its scores -inf, and softmax makes NaN of them (the mask bug)."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (part.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for part in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.dim)
        return self.proj(out)


class PadBlock(torch.nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.ln = torch.nn.LayerNorm(dim)
        self.attn = PadAttention(dim, heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x), pad)
        return x + self.mlp(x)


class PadLM(torch.nn.Module):
    """A small transformer LM whose attention's mask bug makes NaN of an all-padding row."""

    def __init__(self, vocab: int = 16, dim: int = 8, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.vocab, self.dim, self.heads, self.layers = vocab, dim, heads, layers
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(PadBlock(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, pad)
        return self.head(self.ln_f(x))


class Rotary(torch.nn.Module):
    """Keeps no attribute named like its constructor's ``head_dim``: it cannot be rebuilt
    alone from what it keeps."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(head_dim) / head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.cos()


class RopeLM(torch.nn.Module):
    """Its rotary embedding is built for a head size the projection does not give."""

    def __init__(self, vocab: int = 8, dim: int = 6) -> None:
        super().__init__()
        self.vocab, self.dim = vocab, dim
        self.emb = torch.nn.Embedding(vocab, dim)
        self.rope = Rotary(dim // 2 + 1)   # the bug: 4 where the embedding gives 6

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rope(self.emb(tokens))


class StepTable(torch.nn.Module):
    """Looks up a position row at a counter kept in a non-persistent buffer that its forward
    advances: the counter is not in the state dict, so a model rebuilt from the constructor
    and the state dict starts it at 0 again (the bug: it never wraps around)."""

    def __init__(self, positions: int = 2, dim: int = 3) -> None:
        super().__init__()
        self.positions, self.dim = positions, dim
        self.table = torch.nn.Embedding(positions, dim)
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = self.table(self.step.view(1))
        with torch.no_grad():
            self.step += 1
        return x + row


class Annealed(torch.nn.Module):
    """Divides by a temperature the training loop sets after construction (not in the
    constructor's arguments, nor in the state dict)."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.dim = dim
        self.lin = torch.nn.Linear(dim, dim)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.temperature

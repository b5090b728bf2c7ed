"""Language modelling on Shakespeare with a small nanoGPT-style transformer, on characters (here) or
words (:mod:`lowband.bench.workloads.wordgpt`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads.base import (
    Batch,
    DatasetWorkload,
    count_params,
    resolve_lr,
    seeded_init,
    to_device,
)
from lowband.bench.workloads.shakespeare import TokenData, char_data


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    tied: bool = True  # the output head shares the token table's weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each with a residual connection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """nanoGPT in miniature: token + position embeddings, pre-norm blocks, a linear head (tied to the token
    table unless ``cfg.tied`` is False)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``(B, T)``, T <= block_size."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        logits: torch.Tensor = self.head(self.ln_f(self.blocks(x)))
        return logits


class CharLMWorkload(DatasetWorkload):
    """Next-character prediction on Shakespeare; samples are non-overlapping windows of ``block_size + 1``.

    AdamW optimizer; accuracy is next-character top-1; :attr:`unit` is tokens (predicted characters).
    """

    unit = "tokens"
    default_batch_size = 16
    default_lr = 1e-3

    def __init__(
        self,
        *,
        block_size: int = 64,
        n_layer: int = 3,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 1e-3,
    ) -> None:
        self._setup("shakespeare-gpt", char_data, block_size, n_layer, n_head, n_embd, lr, tied=True)

    def _setup(
        self,
        name: str,
        load: Callable[[], TokenData],
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        lr: float,
        tied: bool,
    ) -> None:
        """Loads the tokens with ``load`` (the shape was checked by the workload's schema, get_workload)."""
        self.name = name
        self.default_lr = float(lr)
        self.data: TokenData = load()
        self.cfg = GPTConfig(len(self.data.vocab), block_size, n_layer, n_head, n_embd, tied)
        self.eval_items_per_sample = block_size
        self._stride = block_size + 1

    def describe(self) -> str:
        params = count_params(seeded_init(self.name, lambda: GPT(self.cfg), 0))
        c = self.cfg
        return (
            f"Shakespeare {self.data.kind} ({len(self.data.train) / 1e6:.2f} M train / "
            f"{len(self.data.test) / 1e6:.2f} M test, vocab {c.vocab_size}), "
            f"GPT {c.n_layer}x{c.n_embd} block {c.block_size}{'' if c.tied else ' untied'} "
            f"{params / 1e6:.2f} M params"
        )

    def build_model(self, seed: int) -> nn.Module:
        return seeded_init(f"{self.name}.build_model", lambda: GPT(self.cfg), seed)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        lr = resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr)
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = to_device(model, batch)
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def items(self, batch: Batch) -> int:
        return int(batch[1].numel())

    def _windows(self, ids: torch.Tensor, idx: torch.Tensor) -> Batch:
        w = ids[idx.unsqueeze(1) * self._stride + torch.arange(self._stride)]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def _num_train(self) -> int:
        return len(self.data.train) // self._stride

    def _num_test(self) -> int:
        return len(self.data.test) // self._stride

    def _train_batch(self, idx: torch.Tensor) -> Batch:
        return self._windows(self.data.train, idx)

    def _test_batch(self, idx: torch.Tensor) -> Batch:
        return self._windows(self.data.test, idx)

    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        x, y = to_device(model, batch)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        return float(loss), int((logits.argmax(dim=-1) == y).sum())

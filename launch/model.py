"""The model and data of ``launch/train.py``: a small GPT and a synthetic token dataset.

Both are deterministic functions of their seeds. The dataset is a Markov chain over ``vocab``
tokens whose transition table is drawn from the seed, so the loss falls from ``ln(vocab)``
towards the chain's entropy; sample ``i`` is the same tensor at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        # Explicit attention (not a fused kernel): deterministic on every backend.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean token loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)  # untied: simpler to shard
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class MarkovTokens:
    """``num_samples`` sequences of ``seq_len + 1`` tokens from a seeded Markov chain.

    Generated once, on the CPU, identically on every rank; ``batch(indices)`` returns
    ``(inputs, targets)`` for those global sample indices.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab: int, seed: int = 0, sharpness: float = 4.0) -> None:
        g = torch.Generator().manual_seed(seed)
        # Each row puts most of its mass on a few successors: a learnable, non-trivial chain.
        self.transitions = (torch.randn(vocab, vocab, generator=g) * sharpness).softmax(dim=-1)
        tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (num_samples,), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.size(0)

    def entropy(self) -> float:
        """The chain's mean per-token entropy (nats), the loss floor (stationary mix approximated uniformly)."""
        p = self.transitions
        return float(-(p * p.clamp_min(1e-12).log()).sum(dim=-1).mean())

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[torch.tensor(indices, dtype=torch.long)]
        return rows[:, :-1], rows[:, 1:]

"""A small GPT: token + position embedding, causal self-attention (SDPA or explicit
softmax), GELU MLP, pre-LayerNorm, and an output head tied to the token embedding.

Packed rows (several documents per row, ``data/packing.py``) pass ``position_ids``: the
position embedding reads them and attention stays inside each document
(``document_mask``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    sdpa: bool = True       # F.scaled_dot_product_attention, else an explicit masked softmax
    tie_weights: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.sdpa, self.p = cfg.n_head, cfg.sdpa, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``doc_mask``: None for plain causal attention, else the [B, 1, T, T] boolean mask
        of which keys each query may read (``document_mask``)."""
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if doc_mask is not None:
            y = self._masked(q, k, v, doc_mask)
        elif self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.p if self.training else 0.0)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
            y = att @ v
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def _masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Attention under an explicit boolean mask (True: may read), SDPA or plain ops."""
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=self.p if self.training else 0.0)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        return self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1)) @ v


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), doc_mask)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        self.init_weights()

    def init_weights(self) -> None:
        """Every parameter's starting value (also the init path of a GPT built on the meta
        device: ``Engine`` calls it to materialize each process's pieces)."""
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: small normal weights, zero biases, unit LayerNorms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits [B, T, vocab] of token ids ``idx`` [B, T]. With ``position_ids`` [B, T]
        (packed rows: several documents per row, each counting its positions from 0), the
        position embedding reads them and a token attends only to the earlier tokens of its
        own document, so each document's logits are those of running it alone."""
        if position_ids is not None:
            return self._packed(idx, position_ids)
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _packed(self, idx: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # its own path: the plain one above, and the program captured from it, stay as
        # they were
        mask = document_mask(position_ids)
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The [B, 1, T, T] boolean mask (True: may read) of causal attention kept inside each
    document of packed rows, from their ``position_ids`` [B, T] (Hugging Face's
    DataCollatorWithFlattening convention): a document starts where a position is 0 or does
    not follow the previous one by exactly 1; ``cumsum`` over those starts numbers the
    documents, and a query reads a key of the same number at or before it. Padding whose
    positions continue the last document's joins it: it comes after every real token, so
    causality keeps real tokens from reading it. Every query reads at least itself, so no
    softmax row is empty."""
    T = position_ids.size(1)
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    first = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, steps != 1], dim=1) | (position_ids == 0)
    doc = starts.cumsum(dim=1)
    same = doc.unsqueeze(2) == doc.unsqueeze(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

"""Small models that each exercise one capture feature; the capture tests train them
through the Engine and compare with eager torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 61


class MaskBufferAttention(nn.Module):
    """Causal attention whose mask is a registered (non-persistent) buffer."""

    def __init__(self, d: int = 16, max_len: int = 16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
        return att @ v


class RotaryAttention(nn.Module):
    """Rotary position embedding with ``inv_freq`` as a plain tensor attribute (no buffer)."""

    def __init__(self, d: int = 16, n_head: int = 2):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        hd = d // n_head
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        T = t.size(-2)
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        a, b = t[..., ::2], t[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(nn.Module):
    """Embedding -> one attention layer -> head; ``attn`` picks the attention flavour."""

    def __init__(self, attn: nn.Module, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.attn = attn
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        x = x + self.attn(self.ln(x))
        return self.head(x)


class DictLossLM(nn.Module):
    """Computes its own loss and returns ``{"loss": ..., "logits": ...}`` (loss=None)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(torch.tanh(self.fc(self.wte(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


@dataclass
class RegressionOutput:
    loss: torch.Tensor | None
    prediction: torch.Tensor


class DataclassLossNet(nn.Module):
    """Returns a dataclass with the loss inside (loss=None, positional labels)."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> RegressionOutput:
        pred = self.fc2(F.silu(self.fc1(x))).squeeze(-1)
        loss = F.mse_loss(pred, y) if y is not None else None
        return RegressionOutput(loss, pred)


class FrozenUnusedNet(nn.Module):
    """``frozen`` has requires_grad=False; ``unused`` never enters the forward."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(d, 4)
        self.unused = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.frozen(x)))


class BatchNormNet(nn.Module):
    """BatchNorm1d: running_mean/var and num_batches_tracked are updated in place."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class DropoutNet(nn.Module):
    def __init__(self, d: int = 8, p: float = 0.1):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(d, 32), nn.Dropout(p), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Gate(nn.Module):
    """Python control flow on a tensor value: not capturable as one static graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class GatedBlock(nn.Module):
    def __init__(self, d: int, gated: bool):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.gate = Gate() if gated else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.relu(self.fc1(x)))


class GatedNet(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock(d, gated=False), GatedBlock(d, gated=True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class ModeConstantsNet(nn.Module):
    """Tensors built in forward become traced constants; train mode has one more than eval,
    so fx numbers the shared one differently in the two programs."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x * torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 1.0, 0.75])
        return self.fc(x + torch.tensor([1.0, -1.0, 2.0, 0.0, 0.5, -0.5, 0.0, 1.0]))


class OpaqueOutputNet(nn.Module):
    """Returns an object that is neither a tensor nor a container of tensors."""

    class Cache:
        pass

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.fc(x), "cache": self.Cache()}


class MegatronMLP(nn.Module):
    """Two linears around a GELU: the Megatron column-then-row pair of the TP tests."""

    def __init__(self, d: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def mse(out, y):
    return F.mse_loss(out, y)


def hf_gpt2(attn: str, vocab: int, **config) -> nn.Module:
    """A tiny Hugging Face GPT-2 built locally (no download); ``config`` overrides sizes."""
    import transformers
    sizes = dict(n_layer=2, n_embd=32, n_head=4, n_positions=32) | config
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, bos_token_id=0, eos_token_id=0, attn_implementation=attn, **sizes))


def hf_llama(attn: str, vocab: int, **config) -> nn.Module:
    """A tiny Hugging Face Llama (RMSNorm, rotary, SwiGLU, grouped-query attention)."""
    import transformers
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64) | config
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, attn_implementation=attn, **sizes))

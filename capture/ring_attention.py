"""Ring attention, substituted for ``scaled_dot_product_attention`` while capturing
(``context_parallel: {method: ring}``).

With the sequence cut in ``n`` chunks over the cp ranks, no rank gathers the whole keys and
values: at ring step ``j`` every rank attends its query chunk to the key/value chunk the
ring has passed ``j`` times (``ir/kernels/ring.py``: ``ring_shift``, ``ring_block``), and
the block results are merged by their log-sum-exp, in float32: with ``m = logaddexp(l_a,
l_b)``, ``out = out_a * exp(l_a - m) + out_b * exp(l_b - m)``. The backward passes the keys
and values around again with their gradients travelling beside them (one last pass takes
the gradients home), each block giving its share of the whole attention's gradient
(``ring_block_backward``). A rank keeps only its own chunks of q, k, v, the output and the
log-sum-exp for the backward.

The global program this makes is the same math as the model's attention, in a different
order of the additions: an fp32 step agrees with eager to rounding (about 1e-7 relative).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..ir.kernels.ring import ring_block, ring_block_backward, ring_shift

__all__ = ["ring_attention", "ring_attention_mode", "RingAttentionError"]

SEQ = 2     # the sequence dim of attention's [batch, heads, seq, dim] tensors


class RingAttentionError(ValueError):
    pass


def _pass(x: torch.Tensor, n: int) -> torch.Tensor:
    return ring_shift(x, SEQ, n, 1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n: int, causal: bool, scale: float | None):
        chunk, own = q.shape[SEQ] // n, (k, v)
        out, lse = ring_block(q, k, v, chunk, 0, causal, scale)
        acc = out.float()
        for j in range(1, n):
            k, v = _pass(k, n), _pass(v, n)
            block, block_lse = ring_block(q, k, v, chunk, j, causal, scale)
            merged = torch.logaddexp(lse, block_lse)
            acc = (acc * torch.exp(lse - merged).unsqueeze(-1)
                   + block.float() * torch.exp(block_lse - merged).unsqueeze(-1))
            lse = merged
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, *own, out, lse)     # the rank's own chunks only
        ctx.n, ctx.causal, ctx.scale = n, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # detached: the ops are not differentiated again, and the dispatcher's autograd
        # fallback for a custom op then has nothing to check
        q, k, v, out, lse = (t.detach() for t in ctx.saved_tensors)
        n, chunk = ctx.n, q.shape[SEQ] // ctx.n
        dq = dk = dv = None
        for j in range(n):
            if j:
                k, v, dk, dv = (_pass(t, n) for t in (k, v, dk, dv))
            a, b, c = ring_block_backward(grad_out, q, k, v, out, lse, chunk, j, ctx.causal,
                                          ctx.scale)
            dq = a.float() if dq is None else dq + a.float()
            dk = b.float() if dk is None else dk + b.float()
            dv = c.float() if dv is None else dv + c.float()
        # the gradients travelled with the keys: one more pass takes them home
        dk, dv = _pass(dk, n), _pass(dv, n)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int,
                   is_causal: bool = False, scale: float | None = None,
                   where: str = "attention") -> torch.Tensor:
    """``scaled_dot_product_attention(query, key, value, is_causal=..., scale=...)`` as ring
    attention over ``n`` chunks of the sequence."""
    if query.dim() != 4:
        raise RingAttentionError(f"{where}: ring attention takes [batch, heads, seq, dim] "
                                 f"tensors, got a query of shape {list(query.shape)}")
    length, keys = query.shape[SEQ], key.shape[SEQ]
    if keys != length or length % n:
        raise RingAttentionError(
            f"{where}: ring attention over {n} ranks needs the query's and the keys' "
            f"sequence of one length divisible by {n}; got {length} and {keys}")
    if query.shape[1] % key.shape[1]:
        raise RingAttentionError(f"{where}: {query.shape[1]} query heads do not group over "
                                 f"{key.shape[1]} key/value heads")
    return _RingAttention.apply(query, key, value, n, is_causal, scale)


class _Substitute(TorchFunctionMode):
    def __init__(self, n: int, where):
        super().__init__()
        self.n, self.where, self.calls = n, where, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self._ring(*args, **kwargs)

    def _ring(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
        where = f"scaled_dot_product_attention in module '{self.where() or 'top level'}'"
        if attn_mask is not None:
            raise RingAttentionError(
                f"{where}: ring attention (context_parallel method ring) takes no attn_mask: "
                "its blocks apply is_causal only. A causal model should pass is_causal=True; "
                "a masked one (packed rows' document mask from position_ids, an "
                "attention_mask) can use context_parallel: {method: allgather}, which takes "
                "a mask")
        if dropout_p:
            raise RingAttentionError(f"{where}: ring attention has no attention dropout "
                                     f"(dropout_p={dropout_p})")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise RingAttentionError(f"{where}: {query.shape[1]} query heads against "
                                     f"{key.shape[1]} key heads without enable_gqa")
        return ring_attention(query, key, value, self.n, is_causal, scale, where)


@contextlib.contextmanager
def ring_attention_mode(n: int, where=lambda: "") -> Iterator[_Substitute]:
    """Within it, every ``F.scaled_dot_product_attention`` call is ring attention over
    ``n`` chunks (``where()``: the module path, for errors); yields the mode, whose
    ``calls`` counts them. ``n`` 1: attention as the model calls it."""
    mode = _Substitute(n, where)
    if n <= 1:
        yield mode
        return
    with mode:
        yield mode

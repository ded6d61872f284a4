"""Ring attention's pieces as torch operators (``context_parallel: {method: ring}``), so a
captured step names them and the SPMD rules shard them like any op.

The sequence (dim 2 of ``[batch, heads, seq, dim]``) is cut into ``n`` equal chunks, chunk
``i`` on cp rank ``i``. Ring step ``j`` pairs query chunk ``i`` with key/value chunk
``(i - j) mod n``, which the keys reach by ``j`` passes around the ring:

* ``autopar::ring_shift(x, dim, pieces, shift)``: ``x`` with ``dim`` cut in ``pieces``, piece
  ``i`` of the result is piece ``(i - shift) mod pieces`` (a roll by whole pieces). With that
  dim split over a ring of ``pieces`` ranks it is one p2p pass (the ``comm.shift`` op,
  ``passes/ring_shifts.py``); whole, it is the roll;
* ``autopar::ring_block(q, k, v, chunk, step, causal, scale, first)``: every query chunk
  against the key chunk beside it (rows ``i*chunk ..`` of ``q`` and of ``k``), as ring step
  ``step`` sees it: ``(out, lse)``, the block's attention and its log-sum-exp per row. Causal:
  step 0 is the chunk's own causal block, a later step is wholly seen by chunk ``i >= step``
  (its keys come before) and wholly hidden from the others (out 0, lse -inf). ``first``: the
  global index of the first chunk ``q`` holds (a rank's piece);
* ``autopar::ring_block_backward(grad_out, q, k, v, out, lse, ...)``: the block's share of
  the gradients of the *whole* attention, given the whole attention's ``out`` and ``lse``
  (``exp(s - lse)`` is then the block's slice of the global softmax, and ``rowsum(grad_out *
  out)`` its global term): the sum over the blocks is the attention's gradient, as in
  ring/flash attention's backward.

Key/value heads may be fewer than the query's (grouped-query attention): a block widens them
for the kernel and its key/value gradients sum the widened heads back. The blocks run the
CPU flash kernel (the one that returns the log-sum-exp and takes it back in its backward);
elsewhere the same math in plain ops (``_math_block``), whose score block lasts one call.
Every result is contiguous, as the fake kernels say (the compiler checks the strides).
"""
from __future__ import annotations

import math

import torch

__all__ = ["ring_shift", "ring_block", "ring_block_backward"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _shift(x: torch.Tensor, dim: int, pieces: int, shift: int) -> torch.Tensor:
    """Piece ``i`` of the result is piece ``(i - shift) mod pieces`` of ``x`` along ``dim``."""
    return torch.roll(x, shift * (x.shape[dim] // pieces), dim).contiguous()


def _shift_fake(x: torch.Tensor, dim: int, pieces: int, shift: int) -> torch.Tensor:
    return x.new_empty(x.shape)


def _seen(i: int, step: int, causal: bool) -> bool:
    """Whether global query chunk ``i`` sees the key chunk ring step ``step`` brings it."""
    return not causal or i >= step


def _widen(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped key/value heads repeated to the query's ``heads`` (head i reads i // (H/G))."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _narrow(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The widened heads' gradients summed back onto their ``groups`` key/value heads."""
    if grad.shape[1] == groups:
        return grad
    return grad.unflatten(1, (groups, grad.shape[1] // groups)).sum(2)


def _chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return list(x.split(chunk, dim=2)) if x.shape[2] != chunk else [x]


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _math_block(q, k, v, diagonal: bool, scale: float):
    """(out, lse) in plain ops, in float32, for devices without the CPU flash kernel."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return out.to(q.dtype), lse


def _math_block_backward(g, q, k, v, out, lse, diagonal: bool, scale: float):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    g32 = g.float()
    dv = p.transpose(-1, -2) @ g32
    ds = p * (g32 @ v.float().transpose(-1, -2) - (g32 * out.float()).sum(-1, keepdim=True))
    dq, dk = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block(q, k, v, diagonal: bool, scale: float):
    if q.device.type == "cpu":
        return _FLASH(q, k, v, 0.0, diagonal, scale=scale)
    return _math_block(q, k, v, diagonal, scale)


def _block_backward(g, q, k, v, out, lse, diagonal: bool, scale: float):
    if q.device.type == "cpu":
        return _FLASH_BACKWARD(g.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
                               0.0, diagonal, scale=scale)
    return _math_block_backward(g, q, k, v, out, lse, diagonal, scale)


def _ring_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, step: int,
               causal: bool, scale: float | None = None, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query chunk against the key/value chunk beside it, at ring step ``step``."""
    heads, scale = q.shape[1], _scale(q, scale)
    outs, lses = [], []
    for a, (qi, ki, vi) in enumerate(zip(*(_chunks(t, chunk) for t in (q, k, v)))):
        if not _seen(first + a, step, causal):
            outs.append(q.new_zeros((*qi.shape[:3], v.shape[-1])))
            lses.append(torch.full(qi.shape[:3], float("-inf"), device=q.device))
            continue
        out, lse = _block(qi, _widen(ki, heads), _widen(vi, heads), causal and step == 0,
                          scale)
        outs.append(out)
        lses.append(lse.float())
    return torch.cat(outs, dim=2).contiguous(), torch.cat(lses, dim=2).contiguous()


def _ring_block_fake(q, k, v, chunk, step, causal, scale=None, first=0):
    return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3],
                                                                 dtype=torch.float32)


def _ring_block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, chunk: int,
                        step: int, causal: bool, scale: float | None = None, first: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of the whole attention's (dq, dk, dv); ``out``/``lse`` are the whole
    attention's, not the block's."""
    heads, groups, scale = q.shape[1], k.shape[1], _scale(q, scale)
    dqs, dks, dvs = [], [], []
    pieces = zip(*(_chunks(t, chunk) for t in (grad_out, q, k, v, out, lse)))
    for a, (gi, qi, ki, vi, oi, li) in enumerate(pieces):
        if not _seen(first + a, step, causal):
            dqs.append(torch.zeros_like(qi))
            dks.append(torch.zeros_like(ki))
            dvs.append(torch.zeros_like(vi))
            continue
        dq, dk, dv = _block_backward(gi, qi, _widen(ki, heads), _widen(vi, heads), oi,
                                     li, causal and step == 0, scale)
        dqs.append(dq)
        dks.append(_narrow(dk, groups))
        dvs.append(_narrow(dv, groups))
    return tuple(torch.cat(parts, dim=2).contiguous() for parts in (dqs, dks, dvs))


def _ring_block_backward_fake(grad_out, q, k, v, out, lse, chunk, step, causal, scale=None,
                              first=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _operator(name: str, kernel, fake) -> torch._ops.OpOverload:
    """``autopar::name``, defined once per process: the dispatcher's table is global, and
    this module may be imported under a second name (pytest's importlib mode), whose second
    definition would replace the first one's kernels under the ops already made."""
    try:
        return getattr(torch.ops.autopar, name).default
    except AttributeError:
        pass
    op = torch.library.custom_op(f"autopar::{name}", kernel, mutates_args=())
    op.register_fake(fake)
    return getattr(torch.ops.autopar, name).default


ring_shift = _operator("ring_shift", _shift, _shift_fake)
ring_block = _operator("ring_block", _ring_block, _ring_block_fake)
ring_block_backward = _operator("ring_block_backward", _ring_block_backward,
                                _ring_block_backward_fake)

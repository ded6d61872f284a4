"""A static dispatch for mixture-of-experts layers, substituted while capturing.

Hugging Face's experts modules (every class decorated with transformers'
``use_experts_implementation``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek, GPT-OSS...)
route tokens with data-dependent shapes: the ``eager`` loop runs only the experts that were
hit (``nonzero`` + a Python loop), ``grouped_mm`` sorts tokens by expert and multiplies
groups whose sizes are values (and torch's fake kernel for ``_grouped_mm`` accepts bf16
only), ``batched_mm`` gathers one weight matrix per (token, slot). None of them is one
static graph that SPMD rules can shard by expert.

While autopar traces, each such module runs :func:`dense_experts_forward` instead: every
expert is applied to every token (one ``bmm`` over the expert dim), and each token's
result is the sum over experts of ``combine[t, e] * expert_e(x_t)``, where ``combine`` holds
the router's weight of expert ``e`` for token ``t`` (zero when ``e`` is not among its top
k). That is the same math as every implementation above: the same products
``expert_e(x_t) * w``, summed over the token's experts; the other terms are exact zeros, so
with two experts per token the sum is bitwise the one eager makes (with more, the order of
the additions may differ in the last bit). It costs ``experts / top_k`` times the expert
FLOPs of a sparse dispatch, and in exchange the experts are a plain tensor dim: expert
parallelism shards it (``expert_parallel: {axis: ep}``) and data parallelism shards the
tokens, with the ordinary einsum rules.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

__all__ = ["dense_experts", "dense_experts_forward", "is_hf_experts"]


def is_hf_experts(module: torch.nn.Module) -> bool:
    """A module whose class went through transformers' ``use_experts_implementation``: its
    forward dispatches on ``config._experts_implementation`` and it carries the layout flags
    the decorator sets."""
    forward = getattr(type(module), "forward", None)
    return (getattr(forward, "__wrapped__", None) is not None
            and all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed",
                                                 "_is_expert_parallel", "num_experts")))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    """Every expert on every token: ``x`` [experts, tokens, in] -> [experts, tokens, out];
    weights are [experts, out, in] (or [experts, in, out] when ``transposed``)."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                          ) -> torch.Tensor:
    """The transformers experts interface (``hidden_states`` [tokens, hidden], the router's
    ``top_k_index`` / ``top_k_weights`` [tokens, k]) with static shapes; see the module
    docstring for why it equals eager's math."""
    experts, (tokens, hidden) = self.num_experts, hidden_states.shape
    # combine[t, e]: the weight of expert e for token t, 0 where it was not routed. A
    # comparison with arange, not one_hot: one_hot checks the index range on values.
    routed = top_k_index.unsqueeze(-1) == torch.arange(experts, device=top_k_index.device)
    combine = (routed.to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(1)
    x = hidden_states.unsqueeze(0).expand(experts, tokens, hidden)
    # The gate and the post-expert norm are written for [rows, features] but act on the last
    # dim (every transformers experts class's do), so they take [experts, tokens, features]
    # as it is: flattening it would merge the expert dim with the token dim and undo the
    # sharding of both (expert parallelism, data parallelism).
    if self.has_gate:
        h = _linear(x, self.gate_up_proj, self.gate_up_proj_bias if self.has_bias else None,
                    self.is_transposed)
        h = self._apply_gate(h)
    else:
        h = _linear(x, self.up_proj, self.up_proj_bias if self.has_bias else None,
                    self.is_transposed)
        h = self.act_fn(h)
    out = _linear(h, self.down_proj, self.down_proj_bias if self.has_bias else None,
                  self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    # eager multiplies each expert's output by its routing weight, then sums a token's
    # experts: the same products, the other experts' terms exact zeros
    weighted = out * combine.t().unsqueeze(-1)
    return weighted.sum(0).to(hidden_states.dtype)


@contextlib.contextmanager
def dense_experts(model: torch.nn.Module) -> Iterator[list[str]]:
    """While inside, every transformers experts module of ``model`` runs
    :func:`dense_experts_forward`; yields their module paths (the capture notes them)."""
    swapped: list[tuple[torch.nn.Module, object]] = []
    paths: list[str] = []
    try:
        for name, module in model.named_modules():
            if not is_hf_experts(module):
                continue
            if module._is_expert_parallel:
                raise ValueError(
                    f"experts module '{name}' ({type(module).__name__}) is already split by "
                    "transformers' own expert parallelism; autopar shards experts itself: "
                    "load the model without a tp_plan/distributed_config and use the "
                    "strategy's expert_parallel section")
            swapped.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(dense_experts_forward, module)
            paths.append(name)
        yield paths
    finally:
        for module, previous in swapped:
            if previous is None:
                del module.forward
            else:
                module.forward = previous

"""Kernels of the IR optimizer ops (``optim.*``).

They call torch.optim's own functional implementations, reading the live ``param_group``
dict, so the update math is torch's exactly and any LR scheduler (or any scheduler of other
hyper-parameters) acts on the next step. Kernels update in place, as torch does, and return
the new state values for the runtime to write back. Each has a batched form that updates a
whole param group in one call, like ``optimizer.step()``.

Which torch.optim class each kernel serves, with the state it keeps and how that state
starts, is ``OPTIMIZER_RULES`` (below): the ``optimizer_updates`` pass declares the state from
it, and the training state (``autopar.state``) makes its starting values and checkpoint keys.

``found_inf`` (loss scaling, ``passes/skip_nonfinite_steps.py``): when it is set, the step
is skipped and the state returned as it was, as torch's fused optimizers do with the
``found_inf`` GradScaler passes them (eager GradScaler skips ``optimizer.step()``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.adam import adam as _adam
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd as _sgd

from ..ops import kernel


def _skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf)    # a sync, as GradScaler.step's


def _guarded(found_inf: torch.Tensor | None, tensors: list, update) -> bool:
    """Run ``update`` (which writes ``tensors`` in place) unless ``found_inf`` is set; True
    when it ran. Eagerly the flag is read on the host, as GradScaler.step reads it. While
    ``torch.compile`` traces, reading it would be a data-dependent branch (refused by a full
    graph): there the update always runs and each tensor keeps its old value where the
    flag is set, ``torch.where`` on the functional graph, which Inductor fuses into the
    update (no copy survives)."""
    if found_inf is None or not torch.compiler.is_compiling():
        if _skipped(found_inf):
            return False
        update()
        return True
    old = [t.clone() for t in tensors]
    update()
    skip = found_inf.bool()
    for t, before in zip(tensors, old):
        t.copy_(torch.where(skip, before, t))
    return True


def sgd_group(params, grads, group, momentum_buffers, found_inf=None):
    buffers = list(momentum_buffers)
    if found_inf is not None and torch.compiler.is_compiling() and group["momentum"] != 0 \
            and any(b is None for b in buffers):
        # the first step makes the buffers from the gradients; a skipped one must leave
        # them absent, which no tensor op can say: the runtime runs such a step uncompiled
        # (runtime/compiled.py), so only a caller that compiles it itself gets here
        raise NotImplementedError(
            "SGD with momentum under loss scaling traced before its momentum buffers "
            "exist: run that step uncompiled (the runtime does)")

    def update() -> None:
        _sgd(list(params), list(grads), buffers, weight_decay=group["weight_decay"],
             momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
             nesterov=group["nesterov"], maximize=group["maximize"], has_sparse_grad=False,
             foreach=group.get("foreach"), fused=group.get("fused"))
    written = list(params) + ([b for b in buffers if b is not None]
                              if group["momentum"] != 0 else [])
    _guarded(found_inf, written, update)
    return list(zip(params, buffers))


@kernel("optim.sgd", mutates=True, batched=sgd_group, shared=[2])
def sgd_update(param, grad, group, momentum_buffer, found_inf=None):
    return sgd_group([param], [grad], group, [momentum_buffer], found_inf)[0]


def adam_group(params, grads, group, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs=(),
               found_inf=None):
    beta1, beta2 = group["betas"]
    params, grads = list(params), list(grads)
    maxima = list(max_exp_avg_sqs) if group["amsgrad"] else []

    def update() -> None:
        _adam(params, grads, list(exp_avgs), list(exp_avg_sqs), maxima, list(steps),
              amsgrad=group["amsgrad"], has_complex=any(torch.is_complex(p) for p in params),
              beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=group["maximize"], foreach=group.get("foreach"),
              capturable=group.get("capturable", False),
              differentiable=group.get("differentiable", False), fused=group.get("fused"),
              decoupled_weight_decay=group.get("decoupled_weight_decay", False))
    _guarded(found_inf, [*params, *exp_avgs, *exp_avg_sqs, *steps, *maxima], update)
    return _per_param(params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, group)


def _per_param(params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, group):
    if group["amsgrad"]:
        return list(zip(params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs))
    return list(zip(params, exp_avgs, exp_avg_sqs, steps))


@kernel("optim.adam", mutates=True, batched=adam_group, shared=[2])
def adam_update(param, grad, group, exp_avg, exp_avg_sq, step, max_exp_avg_sq=None,
                found_inf=None):
    extra = [max_exp_avg_sq] if max_exp_avg_sq is not None else []
    return adam_group([param], [grad], group, [exp_avg], [exp_avg_sq], [step], extra,
                      found_inf)[0]


# -- which optimizer each kernel serves, and its state --------------------------------------

def _zeros(param: torch.Tensor, group: dict) -> torch.Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _step(param: torch.Tensor, group: dict) -> torch.Tensor:
    on_device = group.get("capturable", False) or group.get("fused", False)
    dtype = _get_scalar_dtype(is_fused=group.get("fused", False))
    return torch.zeros((), dtype=dtype, device=param.device if on_device else None)


def _absent(param: torch.Tensor, group: dict) -> None:
    return None   # torch.optim.SGD makes the momentum buffer from the first gradient


@dataclass(frozen=True)
class OptimizerRule:
    target: str
    states: Callable[[dict], tuple[tuple[str, Callable], ...]]


def _adam_states(group: dict) -> tuple:
    states = (("exp_avg", _zeros), ("exp_avg_sq", _zeros), ("step", _step))
    return states + ((("max_exp_avg_sq", _zeros),) if group["amsgrad"] else ())


OPTIMIZER_RULES: dict[type, OptimizerRule] = {
    torch.optim.SGD: OptimizerRule("optim.sgd", lambda g: (("momentum_buffer", _absent),)),
    torch.optim.Adam: OptimizerRule("optim.adam", _adam_states),
    torch.optim.AdamW: OptimizerRule("optim.adam", _adam_states),
}


def rule_for(optimizer: torch.optim.Optimizer) -> OptimizerRule:
    try:
        return OPTIMIZER_RULES[type(optimizer)]
    except KeyError:
        known = ", ".join(sorted(c.__name__ for c in OPTIMIZER_RULES))
        raise NotImplementedError(
            f"autopar cannot lower optimizer {type(optimizer).__qualname__}: supported are "
            f"{known} (subclasses too can override step(), so they are refused)") from None


def initial_state(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
                  like: torch.Tensor | None = None) -> dict:
    """The optimizer state of ``param``: the optimizer's own if it has one (a resumed run),
    else what torch would create on the first step, made like ``like`` (planning passes a
    meta tensor: it needs the state's types, not its memory)."""
    existing = optimizer.state.get(param, {})
    template = param if like is None else like
    return {name: existing[name] if name in existing else make(template, group)
            for name, make in rule_for(optimizer).states(group)}

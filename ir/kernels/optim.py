"""Kernels of the IR optimizer ops (``optim.*``).

They call torch.optim's own functional implementations, reading the live ``param_group``
dict, so the update math is torch's exactly and any LR scheduler (or any scheduler of other
hyper-parameters) acts on the next step. Kernels update in place, as torch does, and return
the new state values for the runtime to write back. Each has a batched form that updates a
whole param group in one call, like ``optimizer.step()``.

``found_inf`` (loss scaling, ``passes/skip_nonfinite_steps.py``): when it is set, the step
is skipped and the state returned as it was, as torch's fused optimizers do with the
``found_inf`` GradScaler passes them (eager GradScaler skips ``optimizer.step()``).
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from ..ops import kernel


def _skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and bool(found_inf)    # a sync, as GradScaler.step's


def sgd_group(params, grads, group, momentum_buffers, found_inf=None):
    buffers = list(momentum_buffers)
    if _skipped(found_inf):
        return list(zip(params, buffers))
    _sgd(list(params), list(grads), buffers, weight_decay=group["weight_decay"],
         momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
         nesterov=group["nesterov"], maximize=group["maximize"], has_sparse_grad=False,
         foreach=group.get("foreach"), fused=group.get("fused"))
    return list(zip(params, buffers))


@kernel("optim.sgd", mutates=True, batched=sgd_group, shared=[2])
def sgd_update(param, grad, group, momentum_buffer, found_inf=None):
    return sgd_group([param], [grad], group, [momentum_buffer], found_inf)[0]


def adam_group(params, grads, group, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs=(),
               found_inf=None):
    if _skipped(found_inf):
        return _per_param(params, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, group)
    beta1, beta2 = group["betas"]
    params, grads = list(params), list(grads)
    _adam(params, grads, list(exp_avgs), list(exp_avg_sqs),
          list(max_exp_avg_sqs) if group["amsgrad"] else [], list(steps),
          amsgrad=group["amsgrad"], has_complex=any(torch.is_complex(p) for p in params),
          beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
          eps=group["eps"], maximize=group["maximize"], foreach=group.get("foreach"),
          capturable=group.get("capturable", False),
          differentiable=group.get("differentiable", False), fused=group.get("fused"),
          decoupled_weight_decay=group.get("decoupled_weight_decay", False))
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

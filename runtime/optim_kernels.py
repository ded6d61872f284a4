"""Kernels of the IR optimizer ops.

They call torch.optim's own functional implementations on one parameter, reading the live
``param_group`` dict, so the update math is torch's exactly and any LR scheduler (or any
scheduler of other hyper-parameters) acts on the next step. Kernels update in place, as
torch does, and return the new state values for the runtime to write back.
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from .kernels import kernel


@kernel("optim.sgd")
def sgd_update(param, grad, group, momentum_buffer):
    buffers = [momentum_buffer]
    _sgd([param], [grad], buffers, weight_decay=group["weight_decay"],
         momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
         nesterov=group["nesterov"], maximize=group["maximize"], has_sparse_grad=False,
         foreach=group.get("foreach"), fused=group.get("fused"))
    return param, buffers[0]


@kernel("optim.adam")
def adam_update(param, grad, group, exp_avg, exp_avg_sq, step, max_exp_avg_sq=None):
    beta1, beta2 = group["betas"]
    _adam([param], [grad], [exp_avg], [exp_avg_sq],
          [max_exp_avg_sq] if group["amsgrad"] else [], [step],
          amsgrad=group["amsgrad"], has_complex=torch.is_complex(param), beta1=beta1,
          beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
          maximize=group["maximize"], foreach=group.get("foreach"),
          capturable=group.get("capturable", False),
          differentiable=group.get("differentiable", False), fused=group.get("fused"),
          decoupled_weight_decay=group.get("decoupled_weight_decay", False))
    if group["amsgrad"]:
        return param, exp_avg, exp_avg_sq, step, max_exp_avg_sq
    return param, exp_avg, exp_avg_sq, step

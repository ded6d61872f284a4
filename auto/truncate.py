"""A model's repeated layers, and the same model with fewer of them: the auto search's way of
solving the repeated layers once.

Planning a candidate strategy costs time proportional to the model's depth (a 24-layer GPT
on 8 ranks: 3-9 s). The planner instead plans each candidate on the model cut to ``k1`` and
``k2`` layers of its repeated stack and extends the predicted time and memory linearly to
the full depth (``auto.evaluate``): every repeated layer adds the same ops, the same
parameters and the same collectives, so each rank's time and bytes are affine in the layer
count (a pipeline stage's in its layers per stage).

The stack is the ``nn.ModuleList`` / ``nn.Sequential`` whose children are at least two
modules of one class with the same parameter names and shapes, the one holding the most
parameters (a GPT's ``blocks``, Hugging Face's ``model.layers``, timm's ``blocks``). The cut
copy shares every parameter with the model (no memory), copies only the modules on the path
to the stack, and gets an optimizer of the same class over the parameters it keeps, each in
its original param group.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RepeatedStack", "find_repeated_stack", "cut_model", "cut_optimizer"]


@dataclass(frozen=True)
class RepeatedStack:
    """``path``: the container's module path; ``layers``: how many children it has."""

    path: str
    layers: int


def _signature(module: nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape), p.dtype)
                                for n, p in module.named_parameters()))


def find_repeated_stack(model: nn.Module) -> RepeatedStack | None:
    """The largest container of identical layers (None: the model has none)."""
    best, best_params = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module)
        if len({_signature(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = RepeatedStack(path, len(children)), params
    return best


def cut_model(model: nn.Module, stack: RepeatedStack, layers: int) -> nn.Module:
    """``model`` with only the first ``layers`` children of its stack; parameters shared."""
    if not 1 <= layers <= stack.layers:
        raise ValueError(f"cut {stack.path} to {layers} layers: it has {stack.layers}")
    root = _shallow(model)
    parent, names = root, stack.path.split(".") if stack.path else []
    for name in names[:-1]:
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    container = parent._modules[names[-1]] if names else root
    kept = type(container)(*list(container)[:layers]) if isinstance(container, nn.Sequential) \
        else nn.ModuleList(list(container)[:layers])
    if names:
        parent._modules[names[-1]] = kept
        return root
    return kept


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose own dicts can be changed without touching the original
    (parameters, buffers and children still shared)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    return twin


def cut_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``model``'s parameters, each in the param
    group (hyperparameters) it had; groups left empty are dropped."""
    kept = {id(p) for p in model.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in kept]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": params})
    # each group carries every hyperparameter; the constructor's own keywords only fill in
    # (``defaults`` may hold keys it does not take, e.g. AdamW's decoupled_weight_decay)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)

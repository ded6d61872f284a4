"""Loss scaling, its second half (after ``optimizer_updates``): a step whose gradients held an
inf or nan on any rank changes no parameter and no optimizer state, and a dynamic loss scale
moves as ``torch.amp.GradScaler.update`` moves it.

* Skip: every optimizer update op reads ``amp[found_inf]`` (made by ``scale_loss``) and its
  kernel leaves the parameter and its state as they are when it is set: what eager
  ``GradScaler.step`` does by not calling ``optimizer.step()``, and what torch's fused
  optimizers do with the ``found_inf`` GradScaler hands them. Not ``where(found_inf, old,
  new)`` after the update: the update kernels (torch.optim's own functions) write the
  parameter and its state in place, so keeping the old values would copy every parameter and
  optimizer state each step. Under ``compile:`` the kernel cannot read the flag on the
  host inside one graph; there it does select the old values where the flag is set, on
  the functional graph, where Inductor fuses the select into the update
  (``ir/kernels/optim.py``).
* ``loss_scale: dynamic``: ``torch._amp_update_scale_``'s rule, traced as ATen ops (placed
  replicated like the scalars they are): an inf/nan multiplies the scale by
  ``backoff_factor`` and restarts the count of clean steps; ``growth_interval`` clean steps
  in a row multiply it by ``growth_factor`` (unless that overflows). The products are taken
  in double and rounded to float, as that kernel does, so the scale history is GradScaler's
  to the bit.
* A fixed ``loss_scale`` never changes (Megatron's constant scaler); its non-finite steps
  are skipped all the same. GradScaler has no fixed mode (it requires growth > 1 and backoff
  < 1); eager reproduces it with ``scaler.update(new_scale=scale)`` after every step.
"""
from __future__ import annotations

import functools

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir import OpKind, Program, Role, Slot, Value
from ..ir.from_fx import append_graph
from ..ir.kernels.optim import OPTIMIZER_RULES
from ..pass_infra.context import PassContext
from .scale_loss import (
    FOUND_INF,
    GROWTH_TRACKER,
    LOSS_SCALE,
    LOSS_SCALING,
    SCALE_USED,
    declare_scaler_state,
    scales_loss,
)


def skip_nonfinite_steps(program: Program, ctx: PassContext) -> Program:
    amp = ctx.strategy.amp
    slots = dict(program.results())
    if not scales_loss(amp, ctx.mode) or FOUND_INF not in slots:
        return program
    found_inf = slots[FOUND_INF]
    _guard_updates(program, found_inf)
    if amp.loss_scale == "dynamic":
        scale = slots[SCALE_USED]
        tracker = declare_scaler_state(program, GROWTH_TRACKER, torch.int32, 0)
        new_scale, new_tracker = _update_scale(program, scale, tracker, found_inf,
                                               amp.growth_factor, amp.backoff_factor,
                                               amp.growth_interval)
        program.set_results(program.results()
                            + [(Slot("update", LOSS_SCALE.name), new_scale),
                               (Slot("update", GROWTH_TRACKER.name), new_tracker)])
    return program


def _guard_updates(program: Program, found_inf: Value) -> None:
    targets = {rule.target for rule in OPTIMIZER_RULES.values()}
    for op in program.ops:
        if op.kind is OpKind.CALL and op.target in targets:
            op.kwargs = {**op.kwargs, "found_inf": found_inf}
            op.attrs[LOSS_SCALING] = "skipped when found_inf"


def _next_scale(scale: torch.Tensor, tracker: torch.Tensor, found_inf: torch.Tensor,
                growth_factor: float, backoff_factor: float, growth_interval: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    found = found_inf != 0
    successful = tracker + 1
    grow = successful == growth_interval
    grown = (scale.double() * growth_factor).float()
    backed_off = (scale.double() * backoff_factor).float()
    kept = torch.where(grow & torch.isfinite(grown), grown, scale)
    new_scale = torch.where(found, backed_off, kept)
    new_tracker = torch.where(found | grow, torch.zeros_like(successful), successful)
    return new_scale, new_tracker


def _update_scale(program: Program, scale: Value, tracker: Value, found_inf: Value,
                  growth_factor: float, backoff_factor: float, growth_interval: int
                  ) -> tuple[Value, Value]:
    rule = functools.partial(_next_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval)
    examples = [torch.empty((), dtype=v.type.dtype) for v in (scale, tracker, found_inf)]
    gm = make_fx(rule, tracing_mode="fake")(*examples)
    first = len(program.ops) - 1      # the traced ops go in before the output op
    new_scale, new_tracker = append_graph(program, gm, [scale, tracker, found_inf],
                                         Role.OPTIMIZER)
    for op in program.ops[first:]:
        if op.kind is OpKind.CALL:
            op.attrs[LOSS_SCALING] = "dynamic scale update"
    return new_scale, new_tracker

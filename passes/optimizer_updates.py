"""Append the optimizer's update as IR ops (role=opt), one op per parameter.

Each torch.optim class maps to an entry saying which IR op updates a parameter, which state
it carries and how that state starts (as torch's ``_init_group`` would make it). Adding an
optimizer is adding an entry. Gradient results are consumed; each updated parameter and
state becomes an ``update`` result that the runtime writes back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.optimizer import _get_scalar_dtype

from ..ir import Op, OpaqueType, OpKind, Program, Role, Slot, StateKind, TensorType, Value
from ..ir.attrs import NAME, STATE
from ..planning.context import PassContext


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


def _state_type(param_value: Value, state: torch.Tensor | None) -> TensorType:
    if state is None:   # SGD's momentum buffer before the first step: shaped like the param
        return param_value.type
    return TensorType(tuple(state.shape), state.dtype)


def optimizer_updates(program: Program, ctx: PassContext) -> Program:
    optimizer = ctx.inputs.optimizer
    if optimizer is None or ctx.mode != "train":
        return program
    rule = rule_for(optimizer)
    grads = {slot.name: v for slot, v in program.results() if slot.kind == "grad"}
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    results = [(s, v) for s, v in program.results() if s.kind != "grad"]
    for index, group in enumerate(optimizer.param_groups):
        hparams = program.add(Op(OpKind.INPUT, "input", outputs=[Value(OpaqueType("hparams"))],
                                 role=Role.OPTIMIZER, attrs={NAME: f"param_groups/{index}"}))
        # torch skips parameters without a gradient
        names = [n for n in (ctx.inputs.name_of(p) for p in group["params"]) if n in grads]
        tensors = {ctx.inputs.name_of(p): p for p in group["params"]}
        states = {n: _declare_states(program, n, params[n],
                                     initial_state(optimizer, group, tensors[n],
                                                   like=tensors[n].detach().to("meta")))
                  for n in names}
        for n in names:   # one run of updates per group: the runtime batches it in one call
            results += _update(program, rule, n, params[n], grads[n], hparams.result, states[n])
    program.set_results(results)
    return program


def _declare_states(program: Program, name: str, param: Value, state: dict) -> dict[str, Value]:
    declared = {}
    for key, tensor in state.items():
        op = Op(OpKind.STATE, "state", outputs=[Value(_state_type(param, tensor))],
                role=Role.OPTIMIZER, attrs={STATE: StateKind.OPTIM, NAME: f"{name}/{key}"})
        declared[key] = program.add(op).result
    return declared


def _update(program: Program, rule: OptimizerRule, name: str, param: Value, grad: Value,
            hparams: Value, states: dict[str, Value]) -> list[tuple[Slot, Value]]:
    out_types = [param.type] + [v.type for v in states.values()]
    update = program.add_call(rule.target, (param, grad, hparams, *states.values()), out_types,
                              role=Role.OPTIMIZER, module=name.rpartition(".")[0])
    names = [name] + [f"{name}/{key}" for key in states]
    return [(Slot("update", n), v) for n, v in zip(names, update.outputs)]

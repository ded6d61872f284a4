"""Append the optimizer's update as IR ops (role=opt), one op per parameter.

Each torch.optim class maps to an entry of ``ir.kernels.optim.OPTIMIZER_RULES`` saying
which IR op updates a parameter, which state it carries and how that state starts (as
torch's ``_init_group`` would make it). Adding an optimizer is adding an entry. Gradient
results are consumed; each updated parameter and state becomes an ``update`` result that the runtime
writes back; each state is declared with its typed key (``StateKey.optimizer``).
"""
from __future__ import annotations

import torch

from ..ir import (
    Op,
    OpaqueType,
    OpKind,
    Program,
    Role,
    Slot,
    StateKey,
    StateKind,
    TensorType,
    Value,
    state_op,
)
from ..ir.attrs import NAME
from ..ir.kernels.optim import OptimizerRule, initial_state, rule_for
from ..pass_infra.context import PassContext


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
        op = state_op(StateKey.optimizer(name, key), _state_type(param, tensor), Role.OPTIMIZER)
        declared[key] = program.add(op).result
    return declared


def _update(program: Program, rule: OptimizerRule, name: str, param: Value, grad: Value,
            hparams: Value, states: dict[str, Value]) -> list[tuple[Slot, Value]]:
    out_types = [param.type] + [v.type for v in states.values()]
    update = program.add_call(rule.target, (param, grad, hparams, *states.values()), out_types,
                              role=Role.OPTIMIZER, module=name.rpartition(".")[0])
    names = [name] + [f"{name}/{key}" for key in states]
    return [(Slot("update", n), v) for n, v in zip(names, update.outputs)]

"""Reshard: the catalogue of 1-D steps, the (pure) planner, and the reference executor.

    steps      one frozen class per 1-D step (all-reduce, reduce-scatter, all-gather, ...)
    cost       bytes one rank moves to change a placement along one mesh dim
    planner    ``plan_reshard(shape, src, dst)``: which steps turn one DistAttr into another
    simulate   ``apply_steps``: the steps on every rank's piece, exact collective semantics
    comm       how a comm op records its steps in the IR (typed op attributes)

Writing the steps into a program is the reshard pass (``passes/reshard.py``); running them
on processes is the runtime's (``runtime/collectives.py``).
"""
from .paths import naive_plan, plan_cost, plan_reshard, step_is_valid
from .simulate import apply_step, apply_steps
from .steps import (
    STEP_KINDS,
    AllGather,
    AllReduce,
    AllToAll,
    MakePartial,
    ReduceScatter,
    Shift,
    Slice,
    Step,
    transition,
)

__all__ = ["plan_reshard", "naive_plan", "plan_cost", "step_is_valid", "apply_steps",
           "apply_step", "Step", "AllReduce", "ReduceScatter", "AllGather", "Slice",
           "AllToAll", "MakePartial", "Shift", "STEP_KINDS", "transition"]

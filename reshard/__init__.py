"""Reshard: the catalogue of 1-D steps, the (pure) planner, and the reference executor.

``plan_reshard(shape, src, dst)`` says which steps turn one DistAttr into another;
``apply_steps`` runs them on every rank's piece with exact collective semantics. Writing
the steps into a program (the reshard pass) is a separate, later piece.
"""
from .planner import naive_plan, plan_cost, plan_reshard, step_is_valid
from .simulate import apply_step, apply_steps
from .steps import (STEP_KINDS, AllGather, AllReduce, AllToAll, MakePartial, ReduceScatter,
                    Slice, Step, transition)

__all__ = ["plan_reshard", "naive_plan", "plan_cost", "step_is_valid", "apply_steps",
           "apply_step", "Step", "AllReduce", "ReduceScatter", "AllGather", "Slice",
           "AllToAll", "MakePartial", "STEP_KINDS", "transition"]

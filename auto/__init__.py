"""Automatic parallelization: candidate strategies per op from the SPMD rules, the integer
program that picks one per op for a whole captured step (identical layers tied), and the
auto search over parallel layouts that picks the strategy (``search``; ``plan_auto``, the
entry the engine calls on the first batch). Every candidate is planned by the step planner
(``autopar.planner``), below this package."""
from ..pass_infra.layers import LayerClass, RepeatedLayers, layer_of, repeated_layers
from .apply import AutoPlacements, auto_placements, pin_placements, placed_program
from .candidates import Candidate, fused_shards, op_candidates, start_candidates
from .evaluate import Measured
from .placement_ilp import PlacementChoice, solve_placements
from .plan import auto_profile, plan_auto, with_auto
from .report import compact_yaml, format_auto_plan
from .search import AutoPlan, NoPlanFits, Problem, search_strategy

__all__ = ["Candidate", "op_candidates", "start_candidates", "fused_shards", "PlacementChoice",
           "solve_placements", "AutoPlacements", "auto_placements", "pin_placements",
           "placed_program", "LayerClass", "RepeatedLayers", "layer_of", "repeated_layers",
           "AutoPlan", "NoPlanFits", "Problem", "search_strategy", "Measured",
           "compact_yaml", "format_auto_plan", "auto_profile", "plan_auto", "with_auto"]

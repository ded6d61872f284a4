"""The step planner: a model's step captured, run through the passes and lowered, once per
mode and batch signature, and what that plan costs. Below the engine and the auto search
(both plan with ``StepPlanner``, so the search costs the program that runs); planning never
executes.

    step_planner  StepPlanner: capture -> passes -> lowering; the memory and time reports
    options       the strategy turned into capture's, the passes' and lowering's options
                  (amp precision, ring attention, the micro-batch count, the compile spec)
    plan_cache    planned programs kept on disk (``plan_cache_dir``)
"""
from ..passes import pass_manager
from .plan_cache import PlanCache, plan_key, source_version
from .step_planner import PlanMade, PlannedStep, StepCost, StepPlanner

# Sections the planner's options read themselves (the passes implement the others):
# ``compile`` is handed to lowering as its compile spec, and run by the runtime.
OPTION_SECTIONS: frozenset[str] = frozenset({"compile"})


def planned_sections() -> frozenset[str]:
    """The strategy sections a plan honours: the passes' and the planner's options'."""
    return pass_manager().sections | OPTION_SECTIONS


__all__ = ["OPTION_SECTIONS", "PlanCache", "PlanMade", "PlannedStep", "StepCost",
           "StepPlanner", "plan_key", "planned_sections", "source_version"]

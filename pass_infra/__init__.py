"""The pass infrastructure: what the passes share, the loop that runs them, and the views
of what they made (explanations, dumps).

    context          what a pass reads (``PlanInputs``) and the typed facts passes hand on
                     (``PlanState``, ``Fact``)
    manager          ``Pass`` and ``PassManager``: needs and makes checked, timing,
                     verification and dumps between passes, the sections passes implement
    parallel_layout  the strategy interpreted: its mesh and pipeline layout, with their checks
    pinning          how the annotation passes place values
    explain          why a value has its placement; a plan at a glance

The passes themselves, in order, are ``autopar.passes``.
"""
from .context import Fact, FactError, PassContext, PlanInputs, PlanState
from .explain import explain_value, summarize
from .manager import Pass, PassManager, make_pass
from .parallel_layout import ParallelLayout

__all__ = ["Fact", "FactError", "PassContext", "PlanInputs", "PlanState", "explain_value",
           "summarize", "Pass", "PassManager", "make_pass", "ParallelLayout"]

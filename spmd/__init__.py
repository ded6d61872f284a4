"""SPMD sharding rules: specs, the inference engine, the cost model and the rule registry."""
from . import rules  # noqa: F401  (fills the registry)
from .einsum import Decision, MeshDimChoice, Option, SpecError, infer_forward, infer_reverse
from .rule_registry import RULES, EinsumRule, Rule, lookup, register
from .spec import Spec

__all__ = ["Spec", "Decision", "MeshDimChoice", "Option", "SpecError", "infer_forward",
           "infer_reverse", "RULES", "EinsumRule", "Rule", "lookup", "register"]

"""Automatic placement: candidate strategies per op from the SPMD rules, and the integer
program that picks one per op for a whole captured step (issue 16)."""
from .apply import AutoPlacements, auto_placements, pin_placements, placed_program
from .candidates import Candidate, op_candidates, start_candidates
from .placement_ilp import PlacementChoice, solve_placements

__all__ = ["Candidate", "op_candidates", "start_candidates", "PlacementChoice",
           "solve_placements", "AutoPlacements", "auto_placements", "pin_placements",
           "placed_program"]

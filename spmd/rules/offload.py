"""Copies between the device and host memory (``passes/offload_states.py``): each value
keeps its placement on every mesh dim (a partial value stays partial: copying is linear)."""
from __future__ import annotations

from ...ir.dist import DistAttr
from ..einsum import Decision, MeshDimChoice, Option
from ..rule_registry import register


class KeepsPlacements:
    """Each output is its input, moved: placed as the input is (unplaced: replicated)."""

    def forward(self, op, in_dists, mesh, available=None) -> Decision:
        dists = tuple(d if d is not None else DistAttr.replicated(mesh) for d in in_dists)
        choices = tuple(MeshDimChoice(m, Option("keep", "a copy keeps its placement"), 0.0, ())
                        for m in range(mesh.ndim))
        return Decision(dists, dists, choices)

    def reverse(self, op, out_hints, mesh):
        return tuple(out_hints)


register("autopar.to_host", "autopar.to_device", "autopar.host_ready")(KeepsPlacements())

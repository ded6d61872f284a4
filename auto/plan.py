"""``auto:`` in a strategy: the engine asks the auto search (``auto.search``) for the
strategy to run, on the first batch it sees (the search needs its shapes), and from then on
plans and runs that strategy as if the user had written it.

The search plans each candidate with the step planner the engine plans with
(``auto.evaluate.plan_and_predict``: a ``StepPlanner``, ``cost.predict`` and the memory
estimate), so what it costs is what runs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..capture import batch_size_of
from ..cost import Profile, ProfileNotFound, default_profile, default_profile_path
from ..ir.annotation import param_annotations
from ..strategy import Strategy
from .search import AutoPlan, Problem, search_strategy

__all__ = ["plan_auto", "auto_profile", "with_auto"]

# the sections that fix a parallel layout: the auto search's to choose under ``--auto``
LAYOUT_SECTIONS = ("mesh", "data_parallel", "tensor_parallel", "pipeline", "sharding",
                   "recompute")


def with_auto(strategy: Strategy, auto: dict[str, Any], keep_layout: bool) -> Strategy:
    """``strategy`` with the ``auto`` section ``python -m autopar plan --auto`` asked for.
    The script's own layout (mesh, degrees, ZeRO, recompute) is dropped unless
    ``keep_layout`` (the user passed ``--strategy``: a partial strategy, kept as
    constraints); its other settings (amp, gradient merge, seed, ...) stay."""
    exclude = {"auto"} | (set() if keep_layout else set(LAYOUT_SECTIONS))
    data = strategy.model_dump(exclude_defaults=True, exclude=exclude)
    given = strategy.auto.model_dump(exclude_defaults=True) if strategy.auto else {}
    return Strategy.model_validate({**data, "auto": {**given, **auto}})


def auto_profile(strategy: Strategy) -> tuple[Profile, str]:
    """The machine profile the auto search costs with, and a note when it is not this machine's
    own: ``auto.profile`` when given, else the calibrated one, else the shipped reference."""
    auto = strategy.auto
    if auto is not None and auto.profile is not None:
        return Profile.load(auto.profile), ""
    try:
        return default_profile(), ""
    except ProfileNotFound:
        return Profile.reference(), (
            f"no calibrated profile at {default_profile_path()}: costs are the shipped "
            "reference machine's (2 cores, gloo); run python -m autopar calibrate for this "
            "machine's")


def _on_nodes(profile: Profile, nodes: int, devices: int) -> tuple[Profile, str]:
    """The profile for a launch over ``nodes`` machines (``auto.nodes``): its collectives
    across a machine priced on its inter-node fits, when it has them."""
    if nodes == 1:
        return profile, ""
    profile = profile.model_copy(update={"devices_per_node": devices // nodes})
    if profile.inter_node:
        return profile, ""
    return profile, (f"the profile measured no collective across machines: those of the "
                     f"{nodes} nodes are priced as within one (calibrate under a multi-node "
                     "launch for their own fits)")


def plan_auto(model: torch.nn.Module, loss: Callable | None,
              optimizer: torch.optim.Optimizer | None, strategy: Strategy, inputs: Any,
              labels: Any) -> AutoPlan:
    """Search ``strategy.auto`` for this model and sample batch."""
    if optimizer is None:
        raise ValueError("auto: the search plans a training step and needs the optimizer: "
                         "Engine(model, loss, optimizer, strategy=...)")
    profile, note = auto_profile(strategy)
    profile, nodes_note = _on_nodes(profile, strategy.auto.nodes, strategy.auto.devices)
    note = "; ".join(n for n in (note, nodes_note) if n)
    problem = Problem(model, loss, optimizer, inputs, labels,
                      batch_size_of(inputs, strategy.batch_dim), param_annotations(model))
    return search_strategy(problem, strategy, profile, note)

"""``auto:`` in a strategy: the engine asks the planner (``autopar.auto.search``) for the
strategy to run, on the first batch it sees (the planner needs its shapes), and from then on
plans and runs that strategy as if the user had written it.

The planner plans each candidate the way the engine does (``plan_and_predict``: a
``Planner`` lowering every rank, ``cost.predict`` and the memory estimate), which is why the
search is handed that function rather than importing the engine.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..annotations import param_annotation
from ..auto import AutoPlan, Measured, Problem, search_strategy
from ..cost import Profile, ProfileNotFound, default_profile, default_profile_path
from ..pass_infra import ParallelLayout
from ..strategy import Strategy
from .data import batch_size_of
from .planner import Planner

__all__ = ["plan_auto", "auto_profile", "plan_and_predict", "with_auto"]

# the sections that fix a parallel layout: the planner's to choose under ``--auto``
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
    """The machine profile the planner costs with, and a note when it is not this machine's
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


def plan_and_predict(loss: Callable | None, inputs: Any, labels: Any, profile: Profile
                     ) -> Callable[[torch.nn.Module, torch.optim.Optimizer, Strategy], Measured]:
    """The planning of one candidate: a training step, predicted for every rank (lowering
    one per class of identical ranks)."""
    def plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             strategy: Strategy) -> Measured:
        planner = Planner(model, loss, optimizer, strategy, ParallelLayout.of(strategy))
        step = planner.plan("train", inputs, labels)
        timed = planner.time(step, profile)
        slowest = max(timed.processes.values(), key=lambda t: t.finish_s)
        memory = planner.memory(step)
        return Measured(timed.step_s, slowest.compute_s, slowest.comm_s, timed.bubble,
                        {r: float(m.peak) for r, m in memory.items()})
    return plan


def plan_auto(model: torch.nn.Module, loss: Callable | None,
              optimizer: torch.optim.Optimizer | None, strategy: Strategy, inputs: Any,
              labels: Any) -> AutoPlan:
    """Search ``strategy.auto`` for this model and sample batch."""
    if optimizer is None:
        raise ValueError("auto: the planner plans a training step and needs the optimizer: "
                         "Engine(model, loss, optimizer, strategy=...)")
    profile, note = auto_profile(strategy)
    profile, nodes_note = _on_nodes(profile, strategy.auto.nodes, strategy.auto.devices)
    note = "; ".join(n for n in (note, nodes_note) if n)
    annotations = {name: dist for name, p in model.named_parameters()
                   if (dist := param_annotation(p)) is not None}
    batch_dim = strategy.batch_dim
    problem = Problem(model, loss, optimizer, inputs, labels,
                      batch_size_of(inputs, batch_dim), annotations,
                      plan_and_predict(loss, inputs, labels, profile))
    return search_strategy(problem, strategy, profile, note)

"""A launch of another world size than the strategy's: the strategy for the world launched.

torchrun's elastic agent (``--nnodes MIN:MAX``, ``--max-restarts``) restarts a job that
lost (or gained) a node with the processes it has; the script runs again from the top and
``fit(resume=True)`` loads the last checkpoint, which DCP reshards to whatever layout the
new strategy has. What that strategy is, ``elastic.on_resize`` says (``ElasticConfig``);
an ``auto:`` strategy plans for the devices it has whenever the launch is a restart. The
global batch is the one ``fit`` is given, whatever the layout: only each rank's share of it
changes, and the note says so.
"""
from __future__ import annotations

import math

from ..auto import with_auto
from ..strategy import Strategy

__all__ = ["resized", "ResizeError"]


class ResizeError(ValueError):
    """A strategy that cannot take the launched world size."""


def resized(strategy: Strategy, world: int, restarted: bool = False
            ) -> tuple[Strategy, str | None]:
    """(the strategy to run on ``world`` processes, a note for the log or None). ``restarted``:
    the launch is an elastic agent's restart (TORCHELASTIC_RESTART_COUNT > 0)."""
    if strategy.world_size == world or world < 1:
        return strategy, None
    how = strategy.elastic.on_resize
    was = strategy.world_size
    if strategy.auto is not None and strategy.mesh is None and (how != "error" or restarted):
        data = strategy.model_dump(exclude_defaults=True)
        data["auto"] = {**data["auto"], "devices": world}
        return Strategy.model_validate(data), (
            f"elastic: {world} processes where the strategy planned {was}: auto plans for "
            f"{world} (the global batch is kept)")
    if how == "data_parallel":
        return _data_parallel(strategy, world)
    if how == "auto":
        new = with_auto(strategy, {"devices": world}, keep_layout=False)
        return new, (f"elastic: {world} processes where the strategy had {was}: its layout "
                     f"is dropped and auto plans for {world} (the global batch is kept)")
    return strategy, None


def _data_parallel(strategy: Strategy, world: int) -> tuple[Strategy, str]:
    """The data-parallel axis (the first listed) takes the new world; the other dims stay."""
    dp, mesh = strategy.data_parallel, strategy.mesh
    if dp is None or mesh is None:
        raise ResizeError(f"elastic: {{on_resize: data_parallel}} but the strategy has no "
                          f"data_parallel axis to resize ({strategy.describe_mesh()}); the "
                          f"launch has {world} processes: use on_resize: auto")
    axis = dp.mesh_axes[0]
    others = math.prod(n for n, name in zip(mesh.shape, mesh.dim_names) if name != axis)
    if world % others:
        raise ResizeError(
            f"elastic: {world} processes cannot keep the mesh's other dims "
            f"({strategy.describe_mesh()}: {others} processes per data-parallel replica); "
            f"launch a multiple of {others}, or use on_resize: auto")
    old = mesh.axis_size(axis)
    shape = [world // others if name == axis else n
             for n, name in zip(mesh.shape, mesh.dim_names)]
    data = strategy.model_dump(exclude_defaults=True)
    data["mesh"] = {**data["mesh"], "shape": shape}
    new = Strategy.model_validate(data)
    share = world // others / old
    return new, (f"elastic: {world} processes where the strategy had {strategy.world_size}: "
                 f"data_parallel axis {axis!r} {old} -> {world // others} (mesh {shape}); "
                 f"the global batch is kept, each rank's share of it x{1 / share:g}")

"""The strategy interpreted (torchtitan's ``ParallelDims``): its mesh as a ``ProcessMesh`` of
ranks 0..n-1 and its pipeline's stage layout, with the checks that need them.

``Strategy`` is pure data and checks only what its own fields say; what needs the mesh (a
reserved dim name) is checked here, when the engine takes the strategy, before anything is
planned or launched.

The micro-batch count a program uses is not the layout's: the step planner checks the
strategy's against its schedule's rules and decides each program's (``planner.options``:
the strategy's for training, as many as divide an eval batch), and hands it to the passes in
``PlanInputs.micro_batches``; ``settle_mesh`` lays the stages out with it
(``pipeline_layout``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.dist import MICRO_BATCH_DIM, ProcessMesh
from ..pipeline.layout import PipelineLayout
from ..strategy import Strategy

__all__ = ["ParallelLayout", "pipeline_layout"]


@dataclass(frozen=True)
class ParallelLayout:
    mesh: ProcessMesh | None            # None: serial (no mesh, or a mesh of one)

    @classmethod
    def of(cls, strategy: Strategy) -> "ParallelLayout":
        problems = _problems(strategy)
        if problems:
            raise ValueError(f"strategy does not fit its mesh ({strategy.describe_mesh()}):\n"
                             "  - " + "\n  - ".join(problems))
        return cls(_process_mesh(strategy))


def _problems(strategy: Strategy) -> list[str]:
    problems = []
    mesh = strategy.mesh
    if mesh is not None and MICRO_BATCH_DIM in mesh.dim_names:
        problems.append(f"mesh dim name {MICRO_BATCH_DIM!r} is reserved for a pipeline's "
                        f"micro-batches (dim_names {list(mesh.dim_names)}); rename it")
    return problems


def _process_mesh(strategy: Strategy) -> ProcessMesh | None:
    """The mesh over ranks 0..n-1 in row-major order; None when serial."""
    if strategy.mesh is None or not strategy.mesh.is_enabled:
        return None
    ids = np.arange(strategy.mesh.size).reshape(strategy.mesh.shape)
    return ProcessMesh(ids, strategy.mesh.dim_names)


def pipeline_layout(strategy: Strategy, micro_batches: int) -> PipelineLayout | None:
    """The pipeline's stages on the strategy mesh, for a program of ``micro_batches``; None
    without a pipeline section or when its stages come from annotated meshes (no mesh)."""
    if strategy.pipeline is None or strategy.mesh is None:
        return None
    ids = np.arange(strategy.mesh.size).reshape(strategy.mesh.shape)
    mesh = ProcessMesh(ids, strategy.mesh.dim_names)
    pipe = strategy.pipeline
    return PipelineLayout.from_mesh(mesh, pipe.axis, micro_batches, pipe.schedule,
                                    pipe.vpp_chunks, pipe.split)

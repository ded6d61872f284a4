"""The strategy interpreted (torchtitan's ``ParallelDims``): its mesh as a ``ProcessMesh`` of
ranks 0..n-1 and its pipeline's stage layout, with the checks that need them.

``Strategy`` is pure data and checks only what its own fields say; what needs the mesh or a
schedule's rules (a reserved dim name, enough micro-batches for 1F1B) is checked here, when
the engine takes the strategy, before anything is planned or launched.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.dist import MICRO_BATCH_DIM, ProcessMesh
from ..pipeline.layout import PipelineLayout
from ..pipeline.schedules import check_schedule_args
from ..strategy import Strategy

__all__ = ["ParallelLayout"]


@dataclass(frozen=True)
class ParallelLayout:
    mesh: ProcessMesh | None            # None: serial (no mesh, or a mesh of one)
    pipeline: PipelineLayout | None     # None: no pipeline, or stages from annotated meshes

    @classmethod
    def of(cls, strategy: Strategy) -> "ParallelLayout":
        problems = _problems(strategy)
        if problems:
            raise ValueError(f"strategy does not fit its mesh ({strategy.describe_mesh()}):\n"
                             "  - " + "\n  - ".join(problems))
        return cls(_process_mesh(strategy), _pipeline_layout(strategy))


def _problems(strategy: Strategy) -> list[str]:
    problems = []
    mesh, pipe = strategy.mesh, strategy.pipeline
    if mesh is not None and MICRO_BATCH_DIM in mesh.dim_names:
        problems.append(f"mesh dim name {MICRO_BATCH_DIM!r} is reserved for a pipeline's "
                        f"micro-batches (dim_names {list(mesh.dim_names)}); rename it")
    if pipe is not None and mesh is not None and pipe.axis in mesh.dim_names:
        try:
            check_schedule_args(pipe.schedule, mesh.axis_size(pipe.axis), pipe.micro_batches,
                                pipe.vpp_chunks)
        except ValueError as err:
            problems.append(f"pipeline: {err}")
    return problems


def _process_mesh(strategy: Strategy) -> ProcessMesh | None:
    """The mesh over ranks 0..n-1 in row-major order; None when serial."""
    if strategy.mesh is None or not strategy.mesh.is_enabled:
        return None
    ids = np.arange(strategy.mesh.size).reshape(strategy.mesh.shape)
    return ProcessMesh(ids, strategy.mesh.dim_names)


def _pipeline_layout(strategy: Strategy) -> PipelineLayout | None:
    """The pipeline's stages on the strategy mesh; None without a pipeline section or when
    its stages come from annotated meshes (no mesh)."""
    if strategy.pipeline is None or strategy.mesh is None:
        return None
    ids = np.arange(strategy.mesh.size).reshape(strategy.mesh.shape)
    mesh = ProcessMesh(ids, strategy.mesh.dim_names)
    pipe = strategy.pipeline
    return PipelineLayout.from_mesh(mesh, pipe.axis, pipe.micro_batches, pipe.schedule,
                                    pipe.vpp_chunks, pipe.split)

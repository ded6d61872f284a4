"""The strategy turned into what capture, the passes and lowering take, in one place.

Each builder reads one section of the strategy (and, for the micro-batch count, the batch)
and returns the option its consumer takes: ``capture``'s precision and ring attention,
the passes' micro-batch count, lowering's compile spec. A new capture, lowering or runtime
option is one builder here and one argument where the step planner calls its consumer; the
engine hands the strategy through and never reads these sections itself.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..capture import Precision
from ..ir import ProcessMesh
from ..lower import CompileSpec, Dump
from ..pipeline.schedules import check_schedule_args
from ..strategy import Strategy

__all__ = ["check_micro_batches", "compile_spec", "micro_batches", "precision", "ring_pieces",
           "sharding_text"]


def precision(strategy: Strategy) -> Precision | None:
    """The ``amp`` section as capture computes it (None: off)."""
    amp = strategy.amp
    if not amp.is_enabled:
        return None
    return Precision(getattr(torch, amp.dtype), amp.level)


def ring_pieces(strategy: Strategy, mesh: ProcessMesh | None) -> int:
    """The chunks ring attention passes around (1: attention as the model calls it)."""
    cp = strategy.context_parallel
    if cp is None or cp.method != "ring" or mesh is None:
        return 1
    return mesh.shape[mesh.dim_names.index(cp.axis)]


def check_micro_batches(strategy: Strategy) -> None:
    """The pipeline's micro-batch count against its schedule's rules (enough for 1F1B, a
    multiple of the ranks for VPP), when the engine takes the strategy: before any batch
    is planned or any process launched. Stages from annotated meshes are checked when
    ``settle_mesh`` finds them."""
    pipe, mesh = strategy.pipeline, strategy.mesh
    if pipe is None or mesh is None or pipe.axis not in mesh.dim_names:
        return
    try:
        check_schedule_args(pipe.schedule, mesh.axis_size(pipe.axis), pipe.micro_batches,
                            pipe.vpp_chunks)
    except ValueError as err:
        raise ValueError(f"strategy does not fit its mesh ({strategy.describe_mesh()}):\n"
                         f"  - pipeline: {err}") from None


def micro_batches(strategy: Strategy, mode: str, rows: int) -> int:
    """How many micro-batches a program of ``rows`` batch rows cuts its batch into: 1
    without a pipeline; the strategy's for training (the batch must divide into dp x
    micro_batches, or the gradient would not be the full batch's); eval and predict use as
    many as split their batch evenly. Decided here only, and handed to the passes in
    ``PlanInputs.micro_batches``."""
    pipe = strategy.pipeline
    if pipe is None:
        return 1
    dp = strategy.degree("data_parallel")
    if mode == "train":
        if rows % (dp * pipe.micro_batches):
            raise ValueError(
                f"batch of {rows} rows does not split into data_parallel={dp} x "
                f"pipeline.micro_batches={pipe.micro_batches} equal micro-batches "
                f"({dp * pipe.micro_batches} must divide the global batch size); "
                f"use a batch size that is a multiple of {dp * pipe.micro_batches}")
        return pipe.micro_batches
    return max((k for k in range(1, pipe.micro_batches + 1) if rows % (dp * k) == 0),
               default=1)


def compile_spec(strategy: Strategy, dump: Dump | None) -> CompileSpec | None:
    """The ``compile`` section as the runtime reads it (None: off); with a dump, Inductor's
    code of each program goes next to the program's dump."""
    config = strategy.compile
    if not config.is_enabled:
        return None
    code = None
    if dump is not None:       # braces of the directory's name kept out of the template
        where = str(dump.dir).replace("{", "{{").replace("}", "}}")
        code = str(Path(where) / "rank{process}"
                   / f"{dump.prefix}{dump.number:02d}_compiled_{{name}}.py")
    return CompileSpec(config.backend, config.mode, config.fallback, config.cache_dir, code)


def sharding_text(strategy: Strategy) -> str:
    """The ZeRO setting, as a memory-limit refusal names it."""
    sharding = strategy.sharding
    if sharding is None or not sharding.is_enabled:
        return "no ZeRO sharding: sharding: {stage: 1|2|3, axis: dp} cuts the state"
    return f"ZeRO stage {sharding.stage} over {sharding.axis!r}"

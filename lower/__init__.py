"""Lowering: from the planned global program (the passes' result) to what each process runs.

    lowering       lower_program(): every process's executable plan, verified and dumped
    memory_estimate  what each lowered process holds, per category, and its peak
    partition      a rank's local program (local shapes, local calls): made here only
    comms          what each comm op runs on a process; the way from a piece to the whole
    job_programs   one pipeline job as a program (the jobs: ``pipeline.jobs``), with its
                   receives, sends and carries
    rank_classes   which processes lower alike (one lowered per class for the reports)
    executable     the plain data the runtime consumes (RankProgram, PipelineProcess, ...)

The runtime imports only ``executable`` and ``pipeline.jobs`` (types): it never plans.
"""
from ..ir.dist import format_ranks
from .executable import CompileSpec, Lowered, PipelineProcess, RankProgram, StatePiece
from .lowering import Dump, LoweringError, lower_program, lower_representatives
from .memory_estimate import (
    MemoryEstimate,
    MemoryLimitError,
    check_memory_limit,
    estimate_memory,
    format_estimates,
)
from .rank_classes import RankClasses, classify_ranks

__all__ = ["CompileSpec", "Lowered", "PipelineProcess", "RankProgram", "StatePiece", "Dump",
           "LoweringError", "lower_program", "lower_representatives", "RankClasses",
           "classify_ranks", "format_ranks", "MemoryEstimate", "MemoryLimitError",
           "check_memory_limit", "estimate_memory", "format_estimates"]

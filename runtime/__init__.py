"""The runtime: runs lowered plans (``autopar.lower``), never plans.

    runtimes            LocalRuntime (this process) / DistributedRuntime (torchrun ranks):
                        where state lives, and which executor runs a lowered plan
    executor            the Executor interface; ProgramExecutor (serial, or one real rank)
    compiled            a program's generated function through torch.compile (``compile:``)
    cycle               CycleExecutor: gradient merge's pair of programs, stepped by batch
    simulator           SimulatedExecutor: every rank of a plan in this process, exact
    pipeline_process    PipelineExecutor: one pipeline process's jobs on real processes
    pipeline_simulator  PipelineSimulator: every pipeline process in this one
    codegen             a program -> one generated Python function
    collectives         comm specs -> c10d collectives (reshard steps, buckets)
    p2p                 a pipeline's point-to-point messages, posted in one planned order
    process_groups      c10d groups per mesh dim, the launch check
    rank_state          a process's pieces of the state, gathered back whole
    job_store, seeding  what a pipeline process keeps between jobs; each step's random stream
    memory_meter        measured live bytes of a step (to check the plan-time estimate)
    spawn               start local ranks without torchrun (tests, benchmarks)
"""
from .compiled import CompileError, CompileNote
from .executor import Executor, compile_seconds
from .job_store import FedRows
from .process_groups import resolve_device
from .rank_state import cut_piece
from .runtimes import DistributedRuntime, Initial, LocalRuntime

__all__ = ["CompileError", "CompileNote", "compile_seconds", "Executor", "FedRows", "cut_piece",
           "DistributedRuntime", "Initial", "LocalRuntime", "resolve_device"]

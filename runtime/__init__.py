"""The runtime: runs lowered plans (``autopar.lower``), never plans.

    runtimes            LocalRuntime (this process) / DistributedRuntime (torchrun ranks):
                        where state lives, and which executor runs a lowered plan
    executor            the Executor interface; ProgramExecutor (serial, or one real rank)
    simulator           SimulatedExecutor: every rank of a plan in this process, exact
    pipeline_process    PipelineExecutor: one pipeline process's jobs on real processes
    pipeline_simulator  PipelineSimulator: every pipeline process in this one
    codegen             a program -> one generated Python function
    collectives         comm specs -> c10d collectives (reshard steps, buckets)
    p2p                 a pipeline's point-to-point messages, posted in one planned order
    process_groups      c10d groups per mesh dim, the launch check
    state               a process's pieces of the state, gathered back whole
    job_store, rng      what a pipeline process keeps between jobs; eager's random states
    launch              start local ranks without torchrun (tests, benchmarks)
"""

"""Pipeline parallelism's one home: the model of a pipeline that the passes, lowering, the
cost model and the runtimes share.

* ``layout`` — which processes hold which stage, and the logical mesh (stage dims + ``mb``)
  placements are made on;
* ``schedules`` — per-rank job lists (F, B, W over stages and micro-batches): FThenB, 1F1B,
  interleaved VPP, ZB-H1; and ``PipelineSchedule``, a program's chosen order with its costs;
* ``timeline`` — the one player of a schedule in time (``play``: fixed job costs, or ranks
  sharing the machine's cores, as the cost model plays them), dependency checks, bubble,
  in-flight micro-batches, a text picture and a Chrome/Perfetto trace;
* ``jobs`` — the schedule made into each rank's jobs: which ops each runs, what it keeps,
  sends, receives and sums over micro-batches (``plan_jobs``);
* ``phases`` — when in a step an op runs (pre_mb, pre, F, B, W, post), and the pipeline's
  op attributes (stage, homes, boundaries);
* ``flops`` — FLOPs per op, to balance stages and weigh jobs.

The passes split the stages, assign the phases and pick the schedule (``split_stages``,
``assign_phases``, ``schedule_pipeline``); lowering makes each job a program
(``lower.job_programs``); the runtimes run them (``runtime.pipeline_process``,
``runtime.pipeline_simulator``).
"""
from .layout import PipelineLayout
from .schedules import PipelineSchedule, build_schedule
from .timeline import CoreSharing, Timeline, chrome_trace, play, render

__all__ = ["PipelineLayout", "PipelineSchedule", "build_schedule", "CoreSharing", "Timeline",
           "chrome_trace", "play", "render"]

"""Pipeline parallelism's model, shared by the passes, lowering and the runtimes.

* ``layout`` — which processes hold which stage, and the logical mesh (stage dims + ``mb``)
  placements are made on;
* ``cost`` — FLOPs per op, to balance stages and weigh jobs;
* ``schedules`` — per-rank job lists (F, B, W over stages and micro-batches): FThenB, 1F1B,
  interleaved VPP, ZB-H1;
* ``timeline`` — a schedule played out in (simulated or measured) time: dependency checks,
  bubble, in-flight micro-batches, a text picture and a Chrome/Perfetto trace; the
  ``PipelineSchedule`` the ``schedule_pipeline`` pass makes;
* ``phases`` — when in a step an op runs (pre_mb, pre, F, B, W, post), and the pipeline's
  op attributes (stage, homes, boundaries).

Every rank's jobs, their messages and job programs are made by lowering
(``lower.pipeline_jobs``, ``lower.job_programs``); the runtimes run them.
"""

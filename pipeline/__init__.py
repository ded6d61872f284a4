"""Pipeline parallelism: what the passes and runtimes share.

* ``layout`` — which processes hold which stage, and the logical mesh (stage dims + ``mb``)
  placements are made on;
* ``cost`` — FLOPs per op, to balance stages and weigh jobs;
* ``schedules`` — per-rank job lists (F, B, W over stages and micro-batches): FThenB, 1F1B,
  interleaved VPP, ZB-H1;
* ``timeline`` — a schedule played out in (simulated or measured) time: dependency checks,
  bubble, in-flight micro-batches, a text picture and a Chrome/Perfetto trace;
* ``phases`` — when in a step an op runs (pre_mb, pre, F, B, W, post);
* ``jobs`` — every rank's jobs and the messages between ranks, in one order for both ends;
* ``job_programs`` — one job as an IR program, with its receives, sends and carried values.
"""

"""Pipeline parallelism: the pure parts every pass and runtime shares.

* ``layout`` — which ranks hold which stage, the logical mesh placements are made on, the
  micro-batch mesh dim.
* ``schedules`` — per-rank job lists (F, B, W over stages and micro-batches): FThenB, 1F1B,
  interleaved VPP, ZB-H1.
* ``timeline`` — a schedule played out in (simulated or measured) time: dependency checks,
  bubble, in-flight micro-batches, a text picture and a Chrome/Perfetto trace.
"""

"""Calibration: ``python -m autopar calibrate`` measures this machine and writes its cost
profile (``cost.Profile``), which the cost model reads.

It sits above the runtime and the cost model: it measures with the runtime's own codegen,
collectives, process groups and pipeline transport, and writes the cost model's profile;
neither imports it. One module per thing measured:

* ``timing.py``: the probes every measurement is made of (the timer, windows, sweeps);
* ``compute.py``: the matmul and pointwise class curves (with ``executor.py``, the
  executor's per-op overhead);
* ``ops.py``: the ops the class curves get badly wrong, timed one by one (``op_probes.py``:
  the cases) and one view op's cost;
* ``slowdown.py``: how much slower several processes computing at once run;
* ``collectives.py``: the collectives' points per kind and group size, and whether a group
  size's groups cross a node;
* ``pipeline_probe.py``: the pipeline runtime's send call and prefetch;
* ``fits.py``: the points made into curves, alpha-beta lines and the profile;
* ``driver.py``: one process's run of all of them, gathered on rank 0;
* ``report.py``: the summary a user reads; ``cli.py``: the command's entry and launch;
* ``settings.py``: what to measure and for how long.
"""
from .cli import default_processes, launch, run
from .collectives import group_sizes, link_kind, measure_collectives
from .compute import measure_compute
from .driver import calibrate, calibration_device
from .fits import fit_alpha_beta, monotone_curve
from .ops import measure_ops
from .report import summary
from .settings import Settings
from .slowdown import measure_slowdown

__all__ = ["Settings", "calibrate", "run", "launch", "summary", "fit_alpha_beta",
           "calibration_device", "link_kind", "default_processes", "group_sizes",
           "monotone_curve", "measure_compute", "measure_ops", "measure_slowdown",
           "measure_collectives"]

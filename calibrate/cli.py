"""``python -m autopar calibrate``'s entry: one process of the run (under torchrun, or
alone for one), the processes it launches by default, and the torchrun launch."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from ..runtime.process_groups import init_distributed, shutdown
from .driver import calibrate, calibration_device
from .report import summary
from .settings import Settings

__all__ = ["run", "default_processes", "launch"]


def run(processes: int | None, out: str | None, quick: bool, device: str | None = None
        ) -> None:
    """One process of ``python -m autopar calibrate`` (under torchrun, or alone for one), on
    ``device`` (``auto | cpu | cuda``; None: ``$AUTOPAR_CALIBRATE_DEVICE``, else auto)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    processes = processes or world
    if processes != world:
        raise ValueError(f"calibrate --processes {processes} under a launch of WORLD_SIZE "
                         f"{world}: run it without torchrun, it launches its own processes")
    where = calibration_device(device or os.environ.get("AUTOPAR_CALIBRATE_DEVICE", "auto"))
    if world > 1:
        init_distributed(where, world, world)
    settings = Settings.quick() if quick else Settings.default()
    start = time.perf_counter()
    result = calibrate(settings, processes, where)
    if world > 1:
        shutdown(barrier=True)
    if result is not None:
        profile, measured = result
        path = profile.save(out)
        print(summary(profile, measured, str(path)))
        if os.environ.get("AUTOPAR_CALIBRATE_POINTS"):      # the raw points, for a look
            print(measured)
        print(f"calibration took {time.perf_counter() - start:.1f} s")


def default_processes(device: str | None = None) -> int:
    """Processes a calibration launches by default: one per GPU where it measures CUDA
    (a process per device, as training launches), else 4."""
    choice = device or os.environ.get("AUTOPAR_CALIBRATE_DEVICE", "auto")
    if choice != "cpu" and torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 4


def launch(argv: list[str], processes: int) -> int:
    """Run ``python -m autopar calibrate argv`` on ``processes`` local ranks through
    torchrun, one thread each unless OMP_NUM_THREADS says otherwise (as the demo trains)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", "-m", "autopar", "calibrate", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(command, env=env).returncode

"""One calibration run on one process: every measurement in turn, gathered on rank 0 and
made into the profile.

Everything is measured on the device the launch trains on, picked as the engine picks it
(``runtime.process_groups.resolve_device``: ``auto`` is ``cuda:LOCAL_RANK`` where CUDA
exists; ``$AUTOPAR_CALIBRATE_DEVICE`` = ``auto | cpu | cuda`` overrides), with the backend
the engine would use (gloo or NCCL). Compute (``compute.py``, ``ops.py``) is measured by
rank 0 alone; the slowdown (``slowdown.py``), collectives (``collectives.py``) and the
pipeline exchange (``pipeline_probe.py``) by every process together.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..cost.profile import Profile
from ..runtime.process_groups import resolve_device
from .collectives import links, measure_collectives, median_comm
from .compute import measure_compute
from .fits import make_profile
from .ops import measure_ops
from .pipeline_probe import mean_times, measure_pipeline_on
from .settings import Settings
from .slowdown import measure_slowdown, relative_slowdown
from .timing import barrier

__all__ = ["calibrate", "calibration_device"]


def calibration_device(choice: str = "auto") -> torch.device:
    """The device this process calibrates, picked as the engine picks the one it trains on
    (``resolve_device``: ``auto`` is ``cuda:LOCAL_RANK`` where CUDA exists)."""
    try:
        return resolve_device(choice, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as err:
        raise ValueError(f"calibrate on device {choice}: {err}; AUTOPAR_CALIBRATE_DEVICE=cpu "
                         "calibrates the CPU") from None


def _measure(settings: Settings, world: int, rank: int, device: torch.device
             ) -> tuple[dict, dict[str, float]]:
    """This process's measurements, and the clock when each phase ended."""
    phases = {"start": time.perf_counter()}
    compute: dict[str, list[float]] = {}
    if rank == 0:              # alone: the others wait at the barrier (it does not spin)
        compute = measure_compute(settings, device)
        phases["compute"] = time.perf_counter()
        with torch.no_grad():
            compute.update(measure_ops(settings, device))
        phases["ops"] = time.perf_counter()
    barrier()
    with torch.no_grad():
        slowdown = measure_slowdown(settings, world, rank, device)
    phases["slowdown"] = time.perf_counter()
    collectives = measure_collectives(settings, world, device) if world > 1 else {}
    phases["collectives"] = time.perf_counter()
    pipeline = measure_pipeline_on(settings, device) if world > 1 else {}
    phases["pipeline"] = time.perf_counter()
    return ({"compute": compute, "collectives": collectives, "slowdown": slowdown,
             "pipeline": pipeline}, phases)


def _combine(everyone: list[dict], phases: dict[str, float], device: torch.device) -> dict:
    """Rank 0's measurements of the launch from every process's (``_measure``)."""
    world, names = len(everyone), list(phases)
    return {"compute": everyone[0]["compute"], "collectives": median_comm(everyone),
            "slowdown": relative_slowdown(everyone),
            "pipeline": mean_times([p["pipeline"] for p in everyone]) if world > 1 else {},
            "phases": {b: phases[b] - phases[a] for a, b in zip(names, names[1:])},
            "links": links(world), "device": str(device),
            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world))}


def calibrate(settings: Settings, processes: int, device: torch.device | None = None
              ) -> tuple[Profile, dict] | None:
    """Measure on this process (one of ``processes``) on ``device`` (None:
    ``calibration_device()``); rank 0 returns the profile and the measurements it was made
    from (``"compute"``: medians over processes; ``"collectives"``: kind -> group size ->
    [(bytes sent, median seconds)]; ``"links"``: group size -> intra-node or inter-node;
    ``"device"``), the others None."""
    device = calibration_device() if device is None else device
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine, phases = _measure(settings, world, rank, device)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    measured = _combine(everyone, phases, device)
    return make_profile(settings, processes, measured, device), measured

"""From measured points to the profile: curves made monotone, alpha-beta lines, and the
``cost.Profile`` a calibration writes.

alpha and beta are a least-squares line through the median times over the bytes one rank
sends, weighted by 1/time so small messages count as much as big ones. Fits of group sizes
whose groups crossed a node are kept apart (``inter_node``).
"""
from __future__ import annotations

import os
import platform

import numpy as np
import torch

from ..cost.profile import AlphaBeta, Curve, Profile
from ..runtime.process_groups import backend_for
from .settings import HALF, Settings, dtype_name
from .timing import CPU

__all__ = ["monotone_curve", "fit_alpha_beta", "collective_fits", "pipeline_costs",
           "op_curves", "make_profile"]


def monotone_curve(sizes: tuple[float, ...], seconds: list[float]) -> Curve:
    """A curve through the points, each time raised to the largest before it: a bigger op
    is never predicted faster than a smaller one (noise at the latency-bound end would make
    cutting an op look like a loss)."""
    points, floor = [], 0.0
    for size, t in zip(sizes, seconds):
        floor = max(floor, t)
        points.append((float(size), floor))
    return Curve(points=points)


def fit_alpha_beta(points: list[tuple[float, float]]) -> AlphaBeta:
    """Least-squares ``seconds = alpha + beta * bytes``, weighted by 1/seconds (relative
    errors: a small message counts as much as a big one). A negative intercept (the line
    bending under the small points) refits through the origin. ``r2`` on the plain times."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    beta, alpha = np.polyfit(x, y, 1, w=1 / y) if len(points) > 1 else (0.0, y[0])
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(x / y) / np.sum(x * x / (y * y)))
    predicted = alpha + beta * x
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0
    return AlphaBeta(alpha_s=float(alpha), beta_s_per_byte=max(float(beta), 0.0), r2=r2)


def collective_fits(measured: dict) -> dict:
    """The profile's collective fits: of group sizes whose groups stayed on a machine in
    ``collectives``, of those that crossed one in ``inter_node`` (with the machine's
    processes, ``devices_per_node``). A size crossing machines is also kept in
    ``collectives`` when no size stayed on one (a launch of one process per machine)."""
    links, local = measured.get("links", {}), measured.get("local_world")
    fits = {kind: {n: fit_alpha_beta(points) for n, points in by_n.items()}
            for kind, by_n in measured["collectives"].items()}
    if "inter-node" not in links.values():
        return {"collectives": fits}
    intra = {kind: {n: f for n, f in by_n.items() if links.get(n) != "inter-node"}
             for kind, by_n in fits.items()}
    inter = {kind: {n: f for n, f in by_n.items() if links.get(n) == "inter-node"}
             for kind, by_n in fits.items()}
    return {"collectives": {kind: intra[kind] or fits[kind] for kind in fits},
            "inter_node": {kind: by_n for kind, by_n in inter.items() if by_n},
            "devices_per_node": local}


def pipeline_costs(pipeline: dict[str, float]) -> dict:
    """The profile's pipeline runtime fields from the exchange's medians (none without
    one: a single process has no messages)."""
    sends = sorted((float(k.split(":")[1]), t) for k, t in pipeline.items()
                   if k.startswith("send:") and t > 0)
    if not sends:
        return {}
    return {"p2p_send": fit_alpha_beta(sends), "pipeline_job_s": pipeline["prefetch"]}


def op_curves(compute: dict[str, list[float]]) -> dict[str, dict[str, Curve]]:
    """target -> dtype -> the probed op's curve (``ops.measure_ops``' points, median over
    processes), made monotone as the class curves are."""
    out: dict[str, dict[str, Curve]] = {}
    for key, seconds in compute.items():
        if key.startswith("op:"):
            target, dtype = key[3:].rsplit(":", 1)
            sizes = tuple(compute["opsize:" + key[3:]])
            out.setdefault(target, {})[dtype] = monotone_curve(sizes, seconds)
    return out


def _machine(processes: int, device: torch.device) -> str:
    """The profile's machine: host, the GPU on CUDA, cores, torch, the backend."""
    gpu = f"{torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
    return (f"{platform.node()}, {gpu}{os.cpu_count()} cpus, torch {torch.__version__}, "
            f"{backend_for(device) if processes > 1 else 'no backend'}")


def make_profile(settings: Settings, processes: int, measured: dict,
                 device: torch.device = CPU) -> Profile:
    """The profile of a calibration's measurements (``driver.calibrate``'s)."""
    compute = measured["compute"]
    return Profile(
        machine=_machine(processes, device),
        processes=processes, threads=torch.get_num_threads(),
        matmul=monotone_curve(settings.matmul_flops, compute["matmul"]),
        pointwise=monotone_curve(settings.pointwise_bytes, compute["pointwise"]),
        op_overhead_s=max(0.0, compute["executor"][0] - compute["direct"][0]),
        matmul_dtypes={dtype_name(d): monotone_curve(settings.half_matmul_flops,
                                                     compute["matmul:" + dtype_name(d)])
                       for d in HALF},
        pointwise_dtypes={dtype_name(d): monotone_curve(
            settings.half_pointwise_bytes, compute["pointwise:" + dtype_name(d)])
            for d in HALF},
        slowdown=measured["slowdown"],
        op_curves=op_curves(compute), view_s=compute["view"][0],
        **collective_fits(measured),
        **pipeline_costs(measured.get("pipeline") or {}))

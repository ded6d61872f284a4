"""What a user reads after calibrating: the profile's curves, fits and costs in a few
lines each, and how well each collective's line fits its points."""
from __future__ import annotations

import math

from ..cost.profile import AlphaBeta, Profile

__all__ = ["summary"]


def _fit_error(fit: AlphaBeta, points: list[tuple[float, float]]) -> float:
    """The largest relative error of the fit over the measured points."""
    return max(abs(fit.seconds(sent) - t) / t for sent, t in points)


def _rows_to_show(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return points[::2] if (len(points) - 1) % 2 == 0 else points[::2] + points[-1:]


def _compute_lines(profile: Profile, measured: dict) -> list[str]:
    """The class curves, half precision, the slowdown, the probed ops, views, executor."""
    compute = measured["compute"]
    lines = ["matmul (fp32 mm):"]
    for size, t in _rows_to_show(profile.matmul.points):
        lines.append(f"  {size:10.3g} FLOP {t * 1e6:10.1f} us  {size / t / 1e9:7.2f} GFLOP/s")
    lines.append("pointwise (add/mul/gelu; bytes read + written):")
    for size, t in _rows_to_show(profile.pointwise.points):
        lines.append(f"  {size:10.3g} B    {t * 1e6:10.1f} us  {size / t / 1e9:7.2f} GB/s")
    for name, curve in profile.matmul_dtypes.items():
        size, t = curve.points[-1]
        lines.append(f"matmul {name}: {size:.3g} FLOP {size / t / 1e9:.2f} GFLOP/s; pointwise "
                     f"{name}: {profile.pointwise_dtypes[name].throughput(4e6) / 1e9:.2f} "
                     "GB/s at 4 MB")
    lines.append("slowdown (processes computing at once: time relative to one "
                 "alone): " + ", ".join(
                     f"{p}: {s:.2f}" for p, s in sorted(profile.slowdown.items())))
    lines.append("probed ops (size: FLOPs for attention, parameter bytes for AdamW, bytes "
                 "read + written otherwise; smallest and largest point):")
    for target, by_dtype in profile.op_curves.items():
        for dtype, curve in by_dtype.items():
            (s0, t0), (s1, t1) = curve.points[0], curve.points[-1]
            lines.append(f"  {target.removeprefix('aten.'):48s} {dtype:9s} {s0:9.3g}: "
                         f"{t0 * 1e6:8.1f} us  {s1:9.3g}: {t1 * 1e6:9.1f} us")
    lines.append(f"view ops: {profile.view_s * 1e6:.2f} us each")
    lines.append(f"executor: {compute['executor'][0] * 1e6:.2f} us per tiny op in generated "
                 f"code, {compute['direct'][0] * 1e6:.2f} us called directly: overhead "
                 f"{profile.op_overhead_s * 1e6:.2f} us per op")
    return lines


def _comm_lines(profile: Profile, measured: dict) -> list[str]:
    """The collectives' fits and the pipeline runtime's costs."""
    lines = ["collectives (bytes = what one rank sends; R^2 and worst relative error of "
             "the line over the measured sizes):"]
    links = measured.get("links", {})
    several_nodes = "inter-node" in links.values()       # else every group is within a node
    for kind, by_n in profile.collectives.items():
        for n, fit in sorted(by_n.items()):
            rate = 1 / fit.beta_s_per_byte / 1e9 if fit.beta_s_per_byte > 0 else math.inf
            error = _fit_error(fit, measured["collectives"][kind][n])
            where = f" ({links[n]})" if several_nodes else ""
            lines.append(f"  {kind:15s} {n} ranks{where}: alpha {fit.alpha_s * 1e6:8.1f} us  "
                         f"1/beta {rate:6.2f} GB/s  R^2 {fit.r2:6.3f}  worst {error:4.0%}")
    if profile.p2p_send is not None:
        fit = profile.p2p_send
        sends = ", ".join(f"{k.split(':')[1]} B {t * 1e6:.0f} us"
                          for k, t in measured["pipeline"].items() if k.startswith("send:"))
        lines.append(f"pipeline runtime (all processes exchanging): send call {sends} "
                     f"(alpha {fit.alpha_s * 1e6:.1f} us, 1/beta "
                     f"{1 / max(fit.beta_s_per_byte, 1e-30) / 1e9:.2f} GB/s); per job "
                     f"{profile.pipeline_job_s * 1e6:.1f} us")
    return lines


def summary(profile: Profile, measured: dict, out: str) -> str:
    """What a user reads after calibrating."""
    lines = [f"autopar calibrate: {profile.machine}; {profile.processes} process(es) x "
             f"{profile.threads} thread(s); compute curves: process 0 alone, the others "
             "idle"]
    lines += _compute_lines(profile, measured)
    lines += _comm_lines(profile, measured)
    lines.append("rank 0's time per phase: " + ", ".join(
        f"{name} {seconds:.1f} s" for name, seconds in measured.get("phases", {}).items()))
    lines.append(f"profile written to {out}")
    return "\n".join(lines)

"""The machine profile: measured compute curves and collective alpha-beta fits.

Written by ``python -m autopar calibrate`` (calibrate/), read by the predictor and
the planner, which evaluate it thousands of times: every lookup here is a bisect and a few
float operations, nothing allocates.

Units: sizes in FLOPs (matmul) or bytes (pointwise, collectives), times in seconds.

How the pieces add up for one op: ``curve.seconds(size)`` is the time of the aten call
itself as a tight loop of direct calls measures it (kernel + aten dispatch), and
``op_overhead_s`` is what autopar's executor adds on top per op (generated-code Python, the
kernel lookup, freeing); so an op costs ``curve.seconds(size) + op_overhead_s``.
A collective costs ``AlphaBeta.seconds(bytes one rank sends)`` with the byte counts of
``reshard/traffic.py``'s ring formulas.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, field_validator

__all__ = ["AlphaBeta", "Curve", "Profile", "ProfileNotFound", "COLLECTIVE_KINDS",
           "default_profile", "default_profile_path", "REFERENCE_PROFILE", "PROFILE_VERSION"]

# the collectives a plan may insert (send_recv: one pipeline message, bytes of the tensor)
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "send_recv")

REFERENCE_PROFILE = Path(__file__).with_name("reference_profile.json")


class Curve(BaseModel):
    """Measured ``(size, seconds)`` points, interpolated piecewise-linearly in log-log.

    Above the largest point the throughput of the largest is kept (time grows linearly with
    size). Below the smallest point the time stays that of the smallest: the smallest
    measured op is already latency-bound, and a smaller one is not faster.
    """

    points: list[tuple[float, float]]

    @field_validator("points")
    @classmethod
    def _check(cls, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if not points:
            raise ValueError("a curve needs at least one measured (size, seconds) point")
        for size, seconds in points:
            if not (size > 0 and seconds > 0 and math.isfinite(size) and math.isfinite(seconds)):
                raise ValueError(f"curve point ({size}, {seconds}): size and seconds must be "
                                 "positive and finite")
        sizes = [s for s, _ in points]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"curve points must be sorted by strictly increasing size: {sizes}")
        return points

    @functools.cached_property
    def _table(self) -> tuple[float, float, float, float, list[float], list[float]]:
        """(first size, its time, last size, its time, log sizes, log times): computed once
        and kept in the instance dict (a pydantic private attribute costs a microsecond a
        read; a planner reads the curve thousands of times)."""
        (s0, t0), (s1, t1) = self.points[0], self.points[-1]
        return (s0, t0, s1, t1, [math.log(s) for s, _ in self.points],
                [math.log(t) for _, t in self.points])

    def seconds(self, size: float) -> float:
        """Predicted time of one call of ``size`` (FLOPs or bytes)."""
        s0, t0, s1, t1, log_sizes, log_times = self._table
        if size <= s0:
            return t0
        if size >= s1:
            return t1 * size / s1
        x = math.log(size)
        i = bisect.bisect_right(log_sizes, x)           # 1 <= i < len(points)
        x0, x1 = log_sizes[i - 1], log_sizes[i]
        y0, y1 = log_times[i - 1], log_times[i]
        return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def throughput(self, size: float) -> float:
        """Size per second at ``size`` (FLOP/s or bytes/s), for summaries."""
        return size / self.seconds(size)


class AlphaBeta(BaseModel):
    """A collective's time as latency plus bytes over bandwidth, fitted by least squares."""

    alpha_s: float               # latency per call
    beta_s_per_byte: float       # per byte one rank sends (reshard/traffic.py's byte counts)
    r2: float | None = None      # fit quality of the measured points, for the summary

    def seconds(self, nbytes: float) -> float:
        """Time of one call in which a rank sends ``nbytes``; no bytes means no call."""
        if nbytes <= 0:
            return 0.0
        return self.alpha_s + self.beta_s_per_byte * nbytes


class ProfileNotFound(FileNotFoundError):
    """No calibrated profile where one was looked for."""


def default_profile_path() -> Path:
    """``$AUTOPAR_PROFILE``, else ``~/.cache/autopar/profile.json``."""
    env = os.environ.get("AUTOPAR_PROFILE")
    return Path(env) if env else Path.home() / ".cache" / "autopar" / "profile.json"


PROFILE_VERSION = 3


class Profile(BaseModel):
    """What ``python -m autopar calibrate`` measured on one machine.

    The compute curves are one process's, measured alone (``processes``: the launch the
    collectives and the slowdown were measured on). ``matmul``/``pointwise`` are fp32;
    ``matmul_dtypes``/``pointwise_dtypes`` hold the half-precision curves by dtype name
    (``"float16"``, ``"bfloat16"``): CPU half matmuls run at a small fraction of fp32's
    rate. ``slowdown``: processes computing at once -> their time relative to one alone
    (1 -> 1.0), measured with the others idle at a barrier: time-sharing cores is not
    linear in the processes.
    ``op_curves``: target -> dtype name -> the curve of that op alone (``calibrate/op_probes.py``:
    gelu, layer norm, softmax, SDPA, AdamW per parameter...), over ``cost.predict.op_size``;
    ``view_s``: one view op (no data moves: aten's dispatch and the view's metadata).
    Format 3 added ``op_curves`` and ``view_s`` and measures the curves alone.
    The pipeline runtime's own costs (``calibrate/pipeline_probe.py``, measured with all the
    processes running): ``p2p_send``, a pipeline message's send call over its bytes, in the
    job that posts it (its mean: the calls are heavy-tailed); ``pipeline_job_s``, the
    runtime's work after every job (the transport's prefetch).
    A profile without them (measured before) charges none of them.
    """

    version: int = PROFILE_VERSION
    machine: str                 # platform.node(), cpu count, torch version, backend
    processes: int               # the calibration's processes (collectives, slowdown)
    threads: int                 # torch threads per process during measurement
    matmul: Curve                # size = FLOPs (2*m*n*k) of one mm/bmm/addmm call
    pointwise: Curve             # size = bytes read + written by one memory-bound op
    op_overhead_s: float         # what the executor adds per op on top of the aten call
    collectives: dict[str, dict[int, AlphaBeta]]   # kind -> group size -> alpha/beta
    matmul_dtypes: dict[str, Curve] = {}
    pointwise_dtypes: dict[str, Curve] = {}
    slowdown: dict[int, float] = {}
    op_curves: dict[str, dict[str, Curve]] = {}
    view_s: float = 0.0
    p2p_send: AlphaBeta | None = None
    pipeline_job_s: float = 0.0
    # a launch over several machines: the processes per machine (torchrun puts that many
    # consecutive ranks on each), and the fits of the group sizes whose groups crossed a
    # machine (kind -> group size -> alpha/beta); a mesh dim whose groups cross one is
    # priced on these. Absent: one machine, every collective on ``collectives``.
    devices_per_node: int | None = None
    inter_node: dict[str, dict[int, AlphaBeta]] = {}

    @field_validator("version")
    @classmethod
    def _check_version(cls, version: int) -> int:
        if version != PROFILE_VERSION:
            raise ValueError(f"cost profile format version {version}, this autopar reads "
                             f"version {PROFILE_VERSION}: re-run `python -m autopar calibrate`"
                             " to measure a new profile")
        return version

    def matmul_curve(self, dtype: str) -> Curve:
        """The matmul curve for ops of ``dtype`` (a name: "float16"); fp32's otherwise."""
        return self.matmul_dtypes.get(dtype, self.matmul)

    def pointwise_curve(self, dtype: str) -> Curve:
        """The pointwise curve for ops of ``dtype``; fp32's otherwise."""
        return self.pointwise_dtypes.get(dtype, self.pointwise)

    def op_curve(self, target: str, dtype: str) -> Curve | None:
        """The measured curve of ``target`` in ``dtype`` (its fp32 one when that dtype was
        not measured: torch runs some ops in fp32 under autocast); None when the target was
        not probed."""
        by_dtype = self.op_curves.get(target)
        if not by_dtype:
            return None
        return by_dtype.get(dtype, by_dtype.get("float32"))

    def contention(self, processes: int) -> float:
        """Compute time of ``processes`` processes running at once relative to the curves'
        measurement: the measured slowdown, interpolated linearly between measured counts;
        beyond the largest, time grows with processes per the largest's rate (the cores
        are all busy); below the smallest, the smallest's. 1 when nothing was measured."""
        if not self.slowdown:
            return 1.0
        counts = sorted(self.slowdown)
        if processes in self.slowdown:
            return self.slowdown[processes]
        if processes < counts[0]:
            return self.slowdown[counts[0]]
        if processes > counts[-1]:
            return self.slowdown[counts[-1]] * processes / counts[-1]
        i = bisect.bisect_right(counts, processes)
        lo, hi = counts[i - 1], counts[i]
        f = (processes - lo) / (hi - lo)
        return self.slowdown[lo] + f * (self.slowdown[hi] - self.slowdown[lo])

    @field_validator("collectives")
    @classmethod
    def _check_kinds(cls, collectives: dict[str, dict[int, AlphaBeta]]
                     ) -> dict[str, dict[int, AlphaBeta]]:
        unknown = sorted(set(collectives) - set(COLLECTIVE_KINDS))
        if unknown:
            raise ValueError(f"unknown collective kinds {unknown}; known: {COLLECTIVE_KINDS}")
        for kind, by_size in collectives.items():
            bad = [n for n in by_size if n < 2]
            if bad:
                raise ValueError(f"{kind}: group sizes {bad} (a collective needs 2+ ranks)")
        return collectives

    def alpha_beta(self, kind: str, group_size: int) -> AlphaBeta:
        """The fit for ``kind`` over ``group_size`` ranks. A size that was not measured (a
        planner sizing 8 devices from a 4-process machine) is estimated from the nearest
        measured one: beta (per byte a rank sends) kept, alpha scaled by the ring's steps
        ``(n-1)/(m-1)``."""
        by_size = self.collectives.get(kind)
        if not by_size:
            raise KeyError(f"the profile has no '{kind}' collective (it has "
                           f"{sorted(self.collectives)}); recalibrate with "
                           "`python -m autopar calibrate`")
        if group_size in by_size:
            return by_size[group_size]
        estimated = self._estimates.get((kind, group_size))
        if estimated is None:
            estimated = self._estimates[kind, group_size] = self._estimate(kind, group_size)
        return estimated

    @functools.cached_property
    def _estimates(self) -> dict[tuple[str, int], AlphaBeta]:
        return {}

    def _estimate(self, kind: str, group_size: int) -> AlphaBeta:
        return _nearest(self.collectives[kind], kind, group_size)

    def collective_seconds(self, kind: str, group_size: int, nbytes: float,
                           across_nodes: bool = False) -> float:
        """Time of one ``kind`` over ``group_size`` ranks in which a rank sends ``nbytes``;
        ``across_nodes``: its groups span machines (priced on ``inter_node`` when measured)."""
        if group_size < 2 or nbytes <= 0:
            return 0.0
        fits = self.inter_node.get(kind) if across_nodes else None
        if fits:
            return _nearest(fits, kind, group_size).seconds(nbytes)
        return self.alpha_beta(kind, group_size).seconds(nbytes)

    def crosses_node(self, process_ids: Any, dim: int) -> bool:
        """Whether the groups along mesh dim ``dim`` of a mesh of ``process_ids`` (its
        n-d array of ranks) span machines of ``devices_per_node`` ranks each."""
        if self.devices_per_node is None:
            return False
        ranks = np.moveaxis(np.asarray(process_ids), dim, -1).reshape(
            -1, np.asarray(process_ids).shape[dim])
        nodes = ranks // self.devices_per_node
        return bool((nodes != nodes[:, :1]).any())

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write as JSON (default: ``default_profile_path()``); returns the path."""
        target = Path(path) if path is not None else default_profile_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(self.model_dump_json(indent=1) + "\n")
        partial.replace(target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> Profile:
        """Read a profile (default: ``default_profile_path()``)."""
        source = Path(path) if path is not None else default_profile_path()
        if not source.is_file():
            raise ProfileNotFound(
                f"no autopar cost profile at {source}: run `python -m autopar calibrate` on "
                "this machine to measure one (or set $AUTOPAR_PROFILE to a profile file; "
                "Profile.reference() is the one measured on the development machine)")
        return cls.model_validate_json(source.read_text())

    @classmethod
    def reference(cls) -> Profile:
        """The profile measured on autopar's development machine (2 cores, gloo, 4
        processes), shipped with the package: for tests and as an explicitly labelled
        fallback, never a measurement of the machine at hand."""
        return cls.load(REFERENCE_PROFILE)


def default_profile() -> Profile:
    """The calibrated profile of this machine; raises ``ProfileNotFound`` telling the user to
    run ``python -m autopar calibrate`` when there is none."""
    return Profile.load(default_profile_path())


def _nearest(by_size: dict[int, AlphaBeta], kind: str, group_size: int) -> AlphaBeta:
    """The fit of ``group_size``, else the nearest size's with its latency scaled by the
    steps of a ring (n - 1)."""
    if group_size in by_size:
        return by_size[group_size]
    if group_size < 2:
        raise ValueError(f"{kind} over {group_size} rank(s): no collective is needed")
    nearest = min(by_size, key=lambda m: (abs(m - group_size), -m))
    fit = by_size[nearest]
    scale = (group_size - 1) / (nearest - 1)
    return AlphaBeta(alpha_s=fit.alpha_s * scale, beta_s_per_byte=fit.beta_s_per_byte)

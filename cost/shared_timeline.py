"""A pipeline schedule played out on processes that share the machine's cores.

``pipeline.timeline.play`` gives every job a fixed duration. On a machine with fewer
cores than processes that is wrong in a way that decides between schedules: a job's
duration depends on how many processes compute at the same moment, and a pipeline's
bubble is exactly when some of them do not (a rank waiting for a message sleeps in
gloo's wait). Predicted at the full plan's ``contention`` throughout, GPT 8x256 on pp4
1F1B was 228 ms with 8 micro-batches and 251 ms with 4 (less bubble), measured 255 and
199 ms: during the longer bubble of 4 micro-batches the working ranks have the cores to
themselves.

Here each job's duration is its work at the full plan's contention (what the job clocks
of ``cost.predict`` give), and it progresses at ``contention(P) / contention(n)`` seconds
of that work per second while ``n`` of the plan's ``P`` processes run jobs
(``Profile.contention``, the calibration's measured slowdown of n processes computing at
once). The order rules are ``play``'s: a rank runs its jobs in order, each after its
dependencies ended (plus ``latency`` from another rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..pipeline.schedules import WEIGHT, Job
from ..pipeline.timeline import DeadlockError, dependencies

__all__ = ["SharedTimeline", "play_shared"]

_EPS = 1e-12


@dataclass(frozen=True)
class SharedTimeline:
    """When each job ran, each rank's end (``finish``), and the idle fraction of the ranks'
    time up to the makespan (``bubble``)."""
    start: dict[Job, float]
    end: dict[Job, float]
    finish: list[float]
    bubble: float


def _shape(jobs: list[list[Job]]) -> tuple[int, int, bool]:
    every = [j for rank_jobs in jobs for j in rank_jobs]
    stages = max((j.stage for j in every), default=-1) + 1
    return len(jobs), stages, any(j.kind == WEIGHT for j in every)


def play_shared(jobs: list[list[Job]], cost: Callable[[Job], float], latency: float,
                processes: list[int], contention: Callable[[int], float],
                tail: list[float] | None = None) -> SharedTimeline:
    """Play ``jobs`` (one list per pp rank) with durations ``cost(job)`` at full
    contention, rank r standing for ``processes[r]`` processes; ``tail[r]``: work rank r
    does after its last job (its once-a-step ``post``), at the same shared rate."""
    ranks, stages, split = _shape(jobs)
    where = {job: r for r, rank_jobs in enumerate(jobs) for job in rank_jobs}
    items = [[(job, cost(job)) for job in rank_jobs] + ([(None, tail[r])] if tail else [])
             for r, rank_jobs in enumerate(jobs)]
    full = contention(sum(processes))
    start: dict[Job, float] = {}
    end: dict[Job, float] = {}
    pos, left = [0] * ranks, [None] * ranks        # left: work remaining of a running item
    finish, busy, now = [0.0] * ranks, 0.0, 0.0

    def ready(r: int) -> float | None:
        """When rank r's next item may start (None: a dependency has not ended)."""
        job = items[r][pos[r]][0]
        if job is None:
            return finish[r]
        times = [finish[r]]
        for dep in dependencies(job, ranks, stages, split):
            if dep not in end:
                return None
            times.append(end[dep] + (latency if where[dep] != r else 0.0))
        return max(times)

    while any(pos[r] < len(items[r]) for r in range(ranks)):
        for r in range(ranks):                      # start what may start now
            if left[r] is None and pos[r] < len(items[r]):
                when = ready(r)
                if when is not None and when <= now + _EPS:
                    left[r] = items[r][pos[r]][1]
                    if items[r][pos[r]][0] is not None:
                        start[items[r][pos[r]][0]] = now
        running = [r for r in range(ranks) if left[r] is not None]
        waits = [w for r in range(ranks) if left[r] is None and pos[r] < len(items[r])
                 for w in (ready(r),) if w is not None and w > now + _EPS]
        if not running and not waits:
            stuck = {r: items[r][pos[r]][0] for r in range(ranks) if pos[r] < len(items[r])}
            raise DeadlockError(f"shared-core timeline: no rank can progress at "
                                f"{now:.6f} s (waiting: {stuck})", stuck)
        rate = full / contention(sum(processes[r] for r in running)) if running else 1.0
        step = min([left[r] / rate for r in running] + [w - now for w in waits])
        now += step
        busy += step * len(running)
        for r in running:
            left[r] -= step * rate
            if left[r] <= _EPS:
                job = items[r][pos[r]][0]
                if job is not None:
                    end[job] = now
                finish[r], left[r] = now, None
                pos[r] += 1
    makespan = max(finish, default=0.0)
    bubble = 1.0 - busy / (ranks * makespan) if makespan > 0 else 0.0
    return SharedTimeline(start, end, finish, bubble)

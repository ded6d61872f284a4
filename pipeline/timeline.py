"""A pipeline schedule played out in time: dependency checks, bubble, in-flight micro-batches,
a text picture and a Chrome/Perfetto trace.

The same rules serve three readers: tests (is a schedule valid, how big is its bubble), the
pipeline passes and lowering (which jobs exchange tensors across ranks) and people
debugging a run (what did each rank wait for). Times are in abstract units;
``timeline_events`` maps 1 unit to 1 ms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .schedules import BACKWARD, FORWARD, WEIGHT, Job


class DeadlockError(RuntimeError):
    """No rank can start its next job. ``stuck`` maps each unfinished rank to that job."""

    def __init__(self, message: str, stuck: dict[int, Job]):
        super().__init__(message)
        self.stuck = stuck


# --------------------------------------------------------------------------------------
# dependencies and validation
# --------------------------------------------------------------------------------------
def dependencies(job: Job, ranks: int, stages: int, split_backward: bool) -> list[Job]:
    """The jobs whose results ``job`` consumes: F(s,k) needs F(s-1,k); B(s,k) needs F(s,k)
    (its saved activations) and B(s+1,k) (the output gradient); W(s,k) needs B(s,k)."""
    if stages % ranks or job.stage >= stages:
        raise ValueError(f"job {job} does not fit a pipeline of {stages} stages on {ranks} "
                         "ranks (stages must be a multiple of ranks, stage < stages)")
    if job.kind == WEIGHT and not split_backward:
        raise ValueError(f"job {job} is a weight-grad job but the backward is not split")
    s, k = job.stage, job.micro_batch
    if job.kind == FORWARD:
        return [Job(FORWARD, s - 1, k)] if s > 0 else []
    if job.kind == BACKWARD:
        return [Job(FORWARD, s, k)] + ([Job(BACKWARD, s + 1, k)] if s < stages - 1 else [])
    return [Job(BACKWARD, s, k)]


def _expected_jobs(stages: int, micro_batches: int, split_backward: bool,
                   forward_only: bool) -> set[Job]:
    kinds = [FORWARD]
    if not forward_only:
        kinds += [BACKWARD, WEIGHT] if split_backward else [BACKWARD]
    return {Job(kind, s, k) for kind in kinds for s in range(stages)
            for k in range(micro_batches)}


def _names(jobs: Iterable[Job], limit: int = 8) -> str:
    jobs = sorted(jobs, key=lambda j: (j.micro_batch, j.stage, j.kind))
    text = ", ".join(str(j) for j in jobs[:limit])
    return text + (f", ... ({len(jobs)} in all)" if len(jobs) > limit else "")


def check_jobs(jobs: list[list[Job]], ranks: int, micro_batches: int, chunks: int,
               split_backward: bool, forward_only: bool = False) -> None:
    """Every expected job exactly once, on the rank that holds its stage, after its
    same-rank dependencies. Raises ``ValueError`` naming the first offending job.

    Cross-rank order is not checked here: ``play`` finds deadlocks."""
    if len(jobs) != ranks:
        raise ValueError(f"expected job lists for {ranks} ranks, got {len(jobs)}")
    stages = ranks * chunks
    expected = _expected_jobs(stages, micro_batches, split_backward, forward_only)
    seen: dict[Job, int] = {}
    for rank, rank_jobs in enumerate(jobs):
        for pos, job in enumerate(rank_jobs):
            if job in seen:
                raise ValueError(f"job {job} runs twice: on rank {seen[job]} and again on rank "
                                 f"{rank} (position {pos})")
            if job not in expected:
                raise ValueError(f"unexpected job {job} on rank {rank} (position {pos}) in a "
                                 f"pipeline of {stages} stages and {micro_batches} micro-batches"
                                 f" (split_backward={split_backward}, forward_only={forward_only})")
            if job.rank(ranks) != rank:
                raise ValueError(f"job {job} is on rank {rank} but stage {job.stage} belongs to "
                                 f"rank {job.rank(ranks)} ({ranks} ranks)")
            for dep in dependencies(job, ranks, stages, split_backward):
                if dep.rank(ranks) == rank and dep not in seen:
                    raise ValueError(f"job {job} on rank {rank} (position {pos}) comes before "
                                     f"its same-rank dependency {dep}")
            seen[job] = rank
    missing = expected - seen.keys()
    if missing:
        raise ValueError(f"{len(missing)} jobs never run: {_names(missing)}")


@dataclass(frozen=True)
class Transfer:
    """A tensor crossing ranks: ``producer`` on ``src`` sends what ``consumer`` on ``dst``
    needs (activations forward, activation grads backward)."""

    producer: Job
    consumer: Job
    src: int
    dst: int


def _shape(jobs: list[list[Job]]) -> tuple[int, int, bool]:
    """(ranks, stages, split_backward) read off the job lists themselves."""
    ranks = len(jobs)
    top = max((job.stage for rank_jobs in jobs for job in rank_jobs), default=0)
    stages = (top // ranks + 1) * ranks if ranks else 0
    split = any(job.kind == WEIGHT for rank_jobs in jobs for job in rank_jobs)
    return ranks, stages, split


def transfers(jobs: list[list[Job]]) -> list[Transfer]:
    """Every cross-rank dependency, in the consumers' order (rank by rank): what the
    lowering turns into send/recv pairs."""
    ranks, stages, split = _shape(jobs)
    where = {job: rank for rank, rank_jobs in enumerate(jobs) for job in rank_jobs}
    out = []
    for rank, rank_jobs in enumerate(jobs):
        for job in rank_jobs:
            for dep in dependencies(job, ranks, stages, split):
                src = where.get(dep, dep.rank(ranks))
                if src != rank:
                    out.append(Transfer(dep, job, src, rank))
    return out


# --------------------------------------------------------------------------------------
# playing a schedule out in time
# --------------------------------------------------------------------------------------
@dataclass
class Timeline:
    """When each job ran. ``stages`` is ranks x chunks (read off the jobs by ``play``);
    ``finish`` is each rank's end, its ``tail`` included (the work after its last job)."""

    jobs: list[list[Job]]
    start: dict[Job, float]
    end: dict[Job, float]
    makespan: float
    stages: int
    finish: list[float] = field(default_factory=list)
    tail_time: list[float] = field(default_factory=list)    # wall time of each rank's tail

    @property
    def ranks(self) -> int:
        return len(self.jobs)

    @property
    def chunks(self) -> int:
        return self.stages // self.ranks if self.ranks else 0

    @property
    def micro_batches(self) -> int:
        return 1 + max((j.micro_batch for rank_jobs in self.jobs for j in rank_jobs), default=-1)

    def busy(self, rank: int) -> float:
        """Time ``rank`` spends running jobs (and its tail)."""
        tail = self.tail_time[rank] if self.tail_time else 0.0
        return sum(self.end[job] - self.start[job] for job in self.jobs[rank]) + tail

    def idle(self, rank: int) -> float:
        """Time ``rank`` waits within the makespan (same units as the costs)."""
        return self.makespan - self.busy(rank)

    def bubble(self) -> float:
        """Fraction of all ranks' time spent idle: 1 - busy / (ranks * makespan)."""
        if self.makespan <= 0:
            return 0.0
        busy = sum(self.busy(rank) for rank in range(self.ranks))
        return 1.0 - busy / (self.ranks * self.makespan)


@dataclass(frozen=True)
class CoreSharing:
    """Ranks that share the machine's cores. Rank r stands for ``processes[r]`` processes,
    and a job's cost is its duration with every process computing: while only ``n`` of the
    ``P`` processes run jobs it progresses at ``slowdown(P) / slowdown(n)`` of its work per
    unit of time (``slowdown``: how much slower ``n`` processes compute together than one
    alone, the cost model's measured contention). On a machine with fewer cores than
    processes this decides between schedules: a pipeline's bubble is exactly when some
    processes sleep in a wait and leave their cores to the others."""

    processes: tuple[int, ...]
    slowdown: Callable[[int], float]

    def rate(self, running: Iterable[int]) -> float:
        """Work per unit of time while the ranks ``running`` run."""
        return self.slowdown(sum(self.processes)) / self.slowdown(
            sum(self.processes[r] for r in running))


def unit_cost(job: Job) -> float:
    """F = B = W = 1."""
    return 1.0


def _where(jobs: list[list[Job]]) -> dict[Job, int]:
    where: dict[Job, int] = {}
    for rank, rank_jobs in enumerate(jobs):
        for job in rank_jobs:
            if job in where:
                raise ValueError(f"job {job} is listed twice (ranks {where[job]} and {rank})")
            where[job] = rank
    return where


def _deadlock(jobs: list[list[Job]], pos: list[int], where: dict[Job, int], stages: int,
              split: bool, end: dict[Job, float]) -> DeadlockError:
    ranks = len(jobs)
    stuck, lines = {}, []
    for rank, rank_jobs in enumerate(jobs):
        if pos[rank] >= len(rank_jobs):
            lines.append(f"rank {rank} finished")
            continue
        job = stuck[rank] = rank_jobs[pos[rank]]
        waits = []
        for dep in dependencies(job, ranks, stages, split):
            if dep in end:
                continue
            if dep not in where:
                waits.append(f"{dep} (no rank runs it)")
            else:
                waits.append(f"{dep} (rank {where[dep]}, position "
                             f"{jobs[where[dep]].index(dep)})")
        lines.append(f"rank {rank} stuck at {job} (position {pos[rank]}) waiting for "
                     + ", ".join(waits))
    return DeadlockError("pipeline deadlock, no rank can progress:\n  " + "\n  ".join(lines),
                         stuck)


class _Player:
    """``play``'s state: each rank's position in its list (its tail last), when what it runs
    now began and how much of its work is left, and the clock, which moves from one start
    or end to the next."""

    def __init__(self, jobs: list[list[Job]], cost: Callable[[Job], float], latency: float,
                 sharing: CoreSharing | None, tail: Sequence[float] | None):
        self.jobs, self.latency, self.sharing = jobs, latency, sharing
        self.ranks, self.stages, self.split = _shape(jobs)
        self.where = _where(jobs)
        self.work = [[_checked(cost, job) for job in rank_jobs] + ([tail[r]] if tail else [])
                     for r, rank_jobs in enumerate(jobs)]
        self.start: dict[Job, float] = {}
        self.end: dict[Job, float] = {}
        self.pos = [0] * self.ranks
        self.left: list[float | None] = [None] * self.ranks     # None: nothing running
        self.began = [0.0] * self.ranks
        self.finish, self.tail_time, self.now = [0.0] * self.ranks, [0.0] * self.ranks, 0.0

    def run(self) -> Timeline:
        while any(self._pending(r) for r in range(self.ranks)):
            self._start_what_may()
            running = [r for r in range(self.ranks) if self.left[r] is not None]
            waits = [w for r in range(self.ranks) if self.left[r] is None and self._pending(r)
                     for w in (self._ready(r),) if w is not None and w > self.now]
            if not running and not waits:
                raise _deadlock(self.jobs, self.pos, self.where, self.stages, self.split,
                                self.end)
            rate = self.sharing.rate(running) if self.sharing is not None and running else 1.0
            due = {r: self._due(r, rate) for r in running}
            until = min([*due.values(), *waits])
            for r in running:
                self.left[r] -= (until - self.now) * rate
            self.now = until
            for r in running:
                if due[r] <= until:
                    self._end(r)
        return Timeline(self.jobs, self.start, self.end, max(self.finish, default=0.0),
                        self.stages, self.finish, self.tail_time)

    def _pending(self, r: int) -> bool:
        return self.pos[r] < len(self.work[r])

    def _job(self, r: int) -> Job | None:
        """Rank r's current item: a job, or None for its tail."""
        return self.jobs[r][self.pos[r]] if self.pos[r] < len(self.jobs[r]) else None

    def _ready(self, r: int) -> float | None:
        """When rank r's next item may start (None: a dependency has not ended)."""
        job, times = self._job(r), [self.finish[r]]
        for dep in dependencies(job, self.ranks, self.stages, self.split) if job else ():
            if dep not in self.end:
                return None
            times.append(self.end[dep] + (self.latency if self.where[dep] != r else 0.0))
        return max(times)

    def _due(self, r: int, rate: float) -> float:
        """When rank r's item ends at the present rate (without sharing it lasts its cost
        exactly, whatever else happens meanwhile)."""
        if self.sharing is None:
            return self.began[r] + self.work[r][self.pos[r]]
        return self.now + self.left[r] / rate

    def _start_what_may(self) -> None:
        for r in range(self.ranks):
            if self.left[r] is None and self._pending(r) and self._ready(r) is not None \
                    and self._ready(r) <= self.now:
                self.left[r], self.began[r] = self.work[r][self.pos[r]], self.now
                if self._job(r) is not None:
                    self.start[self._job(r)] = self.now

    def _end(self, r: int) -> None:
        job = self._job(r)
        if job is not None:
            self.end[job] = self.now
        else:
            self.tail_time[r] = self.now - self.began[r]
        self.finish[r], self.left[r] = self.now, None
        self.pos[r] += 1


def _checked(cost: Callable[[Job], float], job: Job) -> float:
    duration = cost(job)
    if duration < 0:
        raise ValueError(f"cost of job {job} is negative: {duration}")
    return duration


def play(jobs: list[list[Job]], cost: Callable[[Job], float] = unit_cost,
         latency: float = 0.0, sharing: CoreSharing | None = None,
         tail: Sequence[float] | None = None) -> Timeline:
    """Run every rank's list strictly in order: a job starts when the previous job on its
    rank has ended and every dependency has ended (plus ``latency`` when it ran on another
    rank), and lasts ``cost(job)``; with ``sharing``, ranks share the machine's cores and a
    job lasts less while others wait (``CoreSharing``). ``tail[r]``: work rank r does after
    its last job (its once-a-step ``post``). The one player of a schedule: the
    ``schedule_pipeline`` pass, the cost model and the pictures all use it.

    The pipeline shape (stages, whether the backward is split) is read off the jobs; use
    ``check_jobs`` to validate them against the intended sizes. Raises ``DeadlockError``
    naming what each rank waits for when no rank can progress.
    """
    return _Player(jobs, cost, latency, sharing, tail).run()


def peak_in_flight(rank_jobs: list[Job]) -> int:
    """Most (stage, micro-batch) pairs whose forward has run and whose last backward job has
    not: the activations a rank must hold at once. The last backward job is W when the list
    has W jobs (a split backward), else B; forward-only lists never release."""
    last = WEIGHT if any(job.kind == WEIGHT for job in rank_jobs) else BACKWARD
    live: set[tuple[int, int]] = set()
    peak = 0
    for job in rank_jobs:
        key = (job.stage, job.micro_batch)
        if job.kind == FORWARD:
            live.add(key)
            peak = max(peak, len(live))
        elif job.kind == last:
            live.discard(key)
    return peak


# --------------------------------------------------------------------------------------
# pictures
# --------------------------------------------------------------------------------------
def _auto_width(timeline: Timeline, label_width: int) -> int:
    """Columns per time unit so that the shortest job still shows its whole label."""
    costs = [timeline.end[j] - timeline.start[j] for rank_jobs in timeline.jobs
             for j in rank_jobs if timeline.end[j] > timeline.start[j]]
    if not costs:
        return label_width + 1
    return max(1, math.ceil((label_width + 1) / min(costs) - 1e-9))


def _row(timeline: Timeline, rank: int, scale: float, length: int) -> str:
    cells = ["."] * length
    for job in timeline.jobs[rank]:
        a = round(timeline.start[job] * scale)
        b = round(timeline.end[job] * scale)
        if b <= a:
            continue
        text = job.label(timeline.ranks, timeline.chunks)[: b - a - 1]
        cells[a] = "|"
        cells[a + 1:b] = list(text.ljust(b - a - 1))
        cells[b] = "|"
    return "".join(cells)


def render(timeline: Timeline, width_per_unit: int | None = None, title: str = "pipeline") -> str:
    """A text picture, one row per rank, idle time as ``.``::

        1F1B: ranks=2 stages=2 micro_batches=3 makespan=8 bubble=25.0%
        rank 0 |F0|F1|B0|F2|B1|..|B2|
        rank 1 ...|F0|B0|F1|B1|F2|B2|

    ``width_per_unit`` columns per time unit; by default the shortest job fits its label.
    """
    labels = [j.label(timeline.ranks, timeline.chunks) for rank_jobs in timeline.jobs
              for j in rank_jobs]
    scale = width_per_unit or _auto_width(timeline, max(map(len, labels), default=2))
    length = round(timeline.makespan * scale) + 1
    header = (f"{title}: ranks={timeline.ranks} stages={timeline.stages} "
              f"micro_batches={timeline.micro_batches} makespan={timeline.makespan:g} "
              f"bubble={100 * timeline.bubble():.1f}%")
    name = len(str(max(timeline.ranks - 1, 0)))
    rows = [f"rank {rank:>{name}} {_row(timeline, rank, scale, length)}"
            for rank in range(timeline.ranks)]
    return "\n".join([header] + rows)


def timeline_events(timeline: Timeline) -> list[tuple[int, str, float, float]]:
    """(rank, label, start_seconds, end_seconds) of every job, 1 time unit = 1 ms."""
    return [(rank, job.label(timeline.ranks, timeline.chunks), timeline.start[job] / 1e3,
             timeline.end[job] / 1e3)
            for rank, rank_jobs in enumerate(timeline.jobs) for job in rank_jobs]


def chrome_trace(events: Iterable[tuple[int, str, float, float]],
                 process_name: str = "autopar pipeline") -> dict:
    """A Chrome/Perfetto trace (``json.dump`` it, open in ui.perfetto.dev or
    chrome://tracing): one track per rank, one complete ("X") event per job, in µs.

    Works for simulated timelines (``timeline_events``) and measured runs alike."""
    spans, ranks = [], set()
    for rank, label, begin, finish in events:
        if finish < begin:
            raise ValueError(f"event {label!r} on rank {rank} ends before it starts: "
                             f"start={begin} s, end={finish} s")
        ranks.add(rank)
        spans.append({"name": label, "cat": "pipeline", "ph": "X", "pid": 0, "tid": rank,
                      "ts": begin * 1e6, "dur": (finish - begin) * 1e6})
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
             "args": {"name": process_name}}]
    for rank in sorted(ranks):
        meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                     "args": {"name": f"rank {rank}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                     "args": {"sort_index": rank}})
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}

"""Pipeline schedules as data: the ordered job list every pipeline rank runs.

A schedule is only an order. What a job computes, which tensors it sends and when it may
start are decided elsewhere (the passes, lowering, the runtime, ``timeline.play``); keeping
the order pure lets tests check every schedule against the dependency rules without torch.

Vocabulary (p = ranks along the pp axis, m = micro-batches, v = chunks per rank):

* a *stage* is one contiguous slice of the model, ``0 .. p*v - 1``. Stage ``s`` lives on rank
  ``s % p`` as that rank's chunk ``s // p`` (Megatron's interleaved placement; with v = 1 the
  stage is the rank).
* job kinds: ``F`` forward; ``B`` backward (the whole backward, or only the input gradients
  when the schedule splits the backward); ``W`` the weight gradients of a split backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .timeline import Timeline

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
SCHEDULES = ("FThenB", "1F1B", "VPP", "ZBH1")


@dataclass(frozen=True, order=True)
class Job:
    """One unit of pipeline work: ``kind`` of ``micro_batch`` on global ``stage``.

    ``str(job)`` is ``"F3@s5"`` (forward of micro-batch 3 on stage 5): a job alone does not
    know the rank count, so it names the stage to stay unambiguous in error messages. Pictures
    of one rank use ``label``: ``"F3"`` with one chunk per rank, ``"F3.1"`` (micro-batch 3,
    chunk 1) with several.
    """

    kind: str
    stage: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"job kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.stage < 0 or self.micro_batch < 0:
            raise ValueError(f"job stage and micro_batch must be >= 0, got stage={self.stage}, "
                             f"micro_batch={self.micro_batch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"

    def rank(self, ranks: int) -> int:
        """The pipeline rank that runs this job."""
        return self.stage % ranks

    def chunk(self, ranks: int) -> int:
        """Which of its rank's model chunks this job runs."""
        return self.stage // ranks

    def label(self, ranks: int, chunks: int = 1) -> str:
        """Short name inside one rank's row: ``F3``, or ``F3.1`` when ranks hold chunks."""
        if chunks == 1:
            return f"{self.kind}{self.micro_batch}"
        return f"{self.kind}{self.micro_batch}.{self.chunk(ranks)}"


# --------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------
def _check_count(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"pipeline {what} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"pipeline {what} must be >= 1, got {value}")


def _one_chunk(name: str, chunks: int) -> None:
    if chunks != 1:
        raise ValueError(f"schedule {name} runs one chunk per rank, got chunks={chunks}; "
                         "use VPP for several chunks per rank")


def _enough_micro_batches(name: str, ranks: int, micro_batches: int) -> None:
    """Fewer micro-batches than ranks leave a rank with nothing to overlap its warm-up with;
    Megatron's 1F1B (and ZB-H1 built on it) assume at least one per rank."""
    if micro_batches < ranks:
        raise ValueError(f"{name} needs micro_batches >= pipeline ranks, got "
                         f"micro_batches={micro_batches} < ranks={ranks}")


def _check_f_then_b(ranks: int, micro_batches: int, chunks: int) -> None:
    _one_chunk("FThenB", chunks)


def _check_1f1b(ranks: int, micro_batches: int, chunks: int) -> None:
    _one_chunk("1F1B", chunks)
    _enough_micro_batches("1F1B", ranks, micro_batches)


def _check_vpp(ranks: int, micro_batches: int, chunks: int) -> None:
    if chunks < 2:
        raise ValueError(f"VPP needs chunks >= 2 per rank, got chunks={chunks}; "
                         "with one chunk use 1F1B")
    if micro_batches % ranks:
        raise ValueError(f"VPP needs micro_batches divisible by pipeline ranks (Megatron's "
                         f"interleaved order walks micro-batches in groups of ranks), got "
                         f"micro_batches={micro_batches}, ranks={ranks}, remainder "
                         f"{micro_batches % ranks}")


def _check_zbh1(ranks: int, micro_batches: int, chunks: int) -> None:
    _one_chunk("ZBH1", chunks)
    _enough_micro_batches("ZBH1", ranks, micro_batches)


# --------------------------------------------------------------------------------------
# one rank's job list per schedule
# --------------------------------------------------------------------------------------
def _warmup_steady_cooldown(count: int, warmup: int, forward: Callable[[int], Job],
                            backward: Callable[[int], Job]) -> list[Job]:
    """The 1F1B shape shared by 1F1B and VPP: ``warmup`` forwards, then a forward of the next
    and a backward of the oldest item in turn, then the remaining backwards."""
    jobs = [forward(i) for i in range(warmup)]
    for i in range(count - warmup):
        jobs += [forward(warmup + i), backward(i)]
    jobs += [backward(i) for i in range(count - warmup, count)]
    return jobs


def _f_then_b(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Job]:
    """GPipe: every forward, then every backward; activations of all m micro-batches live."""
    return ([Job(FORWARD, rank, k) for k in range(micro_batches)]
            + [Job(BACKWARD, rank, k) for k in range(micro_batches)])


def _1f1b(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Job]:
    """Megatron 1F1B: p - r - 1 warm-up forwards, so rank r holds at most p - r micro-batches."""
    return _warmup_steady_cooldown(micro_batches, min(ranks - rank - 1, micro_batches),
                                   lambda k: Job(FORWARD, rank, k),
                                   lambda k: Job(BACKWARD, rank, k))


def _vpp_job(kind: str, virtual: int, rank: int, ranks: int, chunks: int) -> Job:
    """Megatron's interleaved numbering: virtual ids walk p micro-batches through chunk 0,
    the same p through chunk 1, ... (backward: last chunk first), then the next p."""
    group = ranks * chunks
    chunk = (virtual % group) // ranks
    if kind == BACKWARD:
        chunk = chunks - 1 - chunk
    micro_batch = (virtual // group) * ranks + virtual % ranks
    return Job(kind, chunk * ranks + rank, micro_batch)


def _vpp(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Job]:
    """Megatron interleaved 1F1B. The warm-up is longer than 1F1B's so that, by the time
    the first backward can come back to this rank, every chunk has forwards queued."""
    total = micro_batches * chunks
    if micro_batches == ranks:
        warmup = total
    else:
        warmup = min(total, (ranks - rank - 1) * 2 + (chunks - 1) * ranks)
    return _warmup_steady_cooldown(total, warmup,
                                   lambda i: _vpp_job(FORWARD, i, rank, ranks, chunks),
                                   lambda i: _vpp_job(BACKWARD, i, rank, ranks, chunks))


def _zbh1(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Job]:
    """Zero-bubble H1 (PaddlePaddle's ZBH1 layout): one more warm-up forward than 1F1B; the
    weight grads of the first ``rank`` micro-batches wait until the end, where 1F1B's
    cool-down bubble was, and every other W follows its B at once."""
    next_forward = iter(range(micro_batches))
    next_backward = iter(range(micro_batches))

    def forward() -> Job:
        return Job(FORWARD, rank, next(next_forward))

    def backward_then_weight() -> list[Job]:
        k = next(next_backward)
        return [Job(BACKWARD, rank, k), Job(WEIGHT, rank, k)]

    jobs = [forward() for _ in range(ranks - rank)]
    for _ in range(rank):                       # B now, its W deferred to the end
        jobs += [Job(BACKWARD, rank, next(next_backward)), forward()]
    for _ in range(micro_batches - ranks):      # steady state
        jobs += backward_then_weight() + [forward()]
    for _ in range(ranks - rank):               # cool-down, the last micro-batch included
        jobs += backward_then_weight()
    jobs += [Job(WEIGHT, rank, k) for k in range(rank)]
    return jobs


def _forward_only(rank: int, ranks: int, micro_batches: int, chunks: int) -> list[Job]:
    """Eval/predict: chunk-major forwards. Sorted by stage, so no rank waits on a later job."""
    return [Job(FORWARD, chunk * ranks + rank, k)
            for chunk in range(chunks) for k in range(micro_batches)]


@dataclass(frozen=True)
class _Rule:
    check: Callable[[int, int, int], None]
    build: Callable[[int, int, int, int], list[Job]]
    splits_backward: bool = False


_RULES: dict[str, _Rule] = {
    "FThenB": _Rule(_check_f_then_b, _f_then_b),
    "1F1B": _Rule(_check_1f1b, _1f1b),
    "VPP": _Rule(_check_vpp, _vpp),
    "ZBH1": _Rule(_check_zbh1, _zbh1, splits_backward=True),
}
assert tuple(_RULES) == SCHEDULES


def _rule(name: str) -> _Rule:
    if name not in _RULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return _RULES[name]


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------
def check_schedule_args(name: str, ranks: int, micro_batches: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` naming the numbers when ``name`` cannot run with these sizes."""
    rule = _rule(name)
    _check_count("ranks", ranks)
    _check_count("micro_batches", micro_batches)
    _check_count("chunks", chunks)
    rule.check(ranks, micro_batches, chunks)


def splits_backward(name: str) -> bool:
    """Whether ``name``'s B jobs compute only input grads and separate W jobs the weight
    grads (ZBH1); otherwise B is the whole backward and there are no W jobs."""
    return _rule(name).splits_backward


def build_schedule(name: str, ranks: int, micro_batches: int, chunks: int = 1,
                   forward_only: bool = False) -> list[list[Job]]:
    """The ordered job list of every pipeline rank (index = rank along the pp axis).

    ``forward_only`` (eval/predict) gives every rank only its forwards, chunk by chunk. Its
    order needs nothing of the micro-batch count, so only the counts are checked: an eval
    batch smaller than a training batch runs with fewer micro-batches.
    """
    rule = _rule(name)
    if forward_only:
        for what, value in (("ranks", ranks), ("micro_batches", micro_batches),
                            ("chunks", chunks)):
            _check_count(what, value)
        return [_forward_only(rank, ranks, micro_batches, chunks) for rank in range(ranks)]
    check_schedule_args(name, ranks, micro_batches, chunks)
    return [rule.build(rank, ranks, micro_batches, chunks) for rank in range(ranks)]


@dataclass
class PipelineSchedule:
    """A pipeline's job order for one program (the ``schedule_pipeline`` pass's result):
    every rank's jobs, each (stage, job kind)'s FLOPs per micro-batch, and the timeline
    they play out on with those costs (``timeline.play``)."""

    name: str
    jobs: list[list[Job]]                     # per pipeline rank, in order
    costs: dict[tuple[int, str], float]       # (stage, job kind) -> FLOPs per micro-batch
    timeline: Timeline
    forward_only: bool

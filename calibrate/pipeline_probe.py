"""The pipeline runtime's costs: what its messages cost the jobs that post them,
measured on a small real pipeline among the calibration processes.

A pipelined step on P processes sharing the cores pays, per job and per message, for more
than the timeline's latency: the send call (``runtime.p2p.P2PTransport.send``: c10d's
gloo isend, run in the job's own thread) and the transport's ``prefetch`` after every job.
On 4 gloo processes on 2 cores a 32-64 KB send took 1-5 ms inside the job that posted it
(GPT 4x128, pp4 1F1B), while the job's compute was predicted 1-2 ms: with 8 micro-batches
instead of 4 a middle rank posts 16 more messages.

The exchange: the launch's processes in a line (process r is pp position r), each running
its jobs of a 1F1B schedule of ``micro_batches`` (a forward receives from r - 1, computes,
sends to r + 1; a backward the other way; messages in both directions at once), through
the runtime's own ``P2PTransport`` with its posting order and a prefetch after every job.
Every job computes ``timing.lead`` (ten 128^3 matmuls, ~1 ms alone) so the processes compete
for the cores as training's do. Timed: every send call and every prefetch, one exchange
per message size; their means over calls and processes (``mean_times``) are the profile's
``p2p_send`` (an alpha-beta line over the bytes) and ``pipeline_job_s``. Not measured: a
receive's own cost (c10d's gloo work reports no completion before its wait, so a wait
for a late message and the call's cost cannot be told apart).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..pipeline.jobs import JobId, Message
from ..pipeline.phases import Phase
from ..pipeline.schedules import BACKWARD, FORWARD, Job, build_schedule
from ..pipeline.timeline import play
from ..runtime.p2p import P2PTransport
from .settings import Settings
from .timing import lead

__all__ = ["measure_pipeline", "measure_pipeline_on", "mean_times", "pipeline_messages"]


def pipeline_messages(world: int, micro_batches: int) -> tuple[list[list[Job]], list[Message]]:
    """A 1F1B pipeline along a line of ``world`` pp positions (one stage each): every
    position's jobs, and the messages, activation ``a`` r -> r + 1 and gradient ``g``
    r + 1 -> r of every micro-batch, in the order lowering gives them (when the sending job
    ends on the schedule's timeline, here of unit jobs)."""
    jobs = build_schedule("1F1B", world, micro_batches)
    end = play(jobs).end
    out = []
    for r in range(world - 1):
        for k in range(micro_batches):
            f, b = Job(FORWARD, r, k), Job(BACKWARD, r + 1, k)
            out.append(Message("a", k, r, r + 1, JobId(Phase.F, r, k), JobId(Phase.F, r + 1, k),
                               (end[f], 0)))
            out.append(Message("g", k, r + 1, r, JobId(Phase.B, r + 1, k), JobId(Phase.B, r, k),
                               (end[b], 1)))
    return jobs, out


def _exchange(transport: Any, jobs: list[Job], messages: list[Message], me: int,
              x: torch.Tensor, lead: Callable[[], object], times: dict[str, list[float]]
              ) -> None:
    """One step of the exchange on pp position ``me``, appending call times to ``times``."""
    incoming = {(m.key, m.micro_batch): m for m in messages if m.dst == me}
    outgoing = {(m.key, m.micro_batch): m for m in messages if m.src == me}
    transport.start_step()
    transport.prefetch()
    for job in jobs:
        key = "a" if job.kind == FORWARD else "g"
        m = incoming.get((key, job.micro_batch))
        if m is not None:
            transport.recv(m)
        lead()
        m = outgoing.get((key, job.micro_batch))
        if m is not None:
            start = time.perf_counter()
            transport.send(m, x)
            times[f"send:{x.nbytes}"].append(time.perf_counter() - start)
        start = time.perf_counter()
        transport.prefetch()
        times["prefetch"].append(time.perf_counter() - start)
    transport.finish()


def measure_pipeline(message_bytes: tuple[int, ...], micro_batches: int, repeats: int,
                     lead: Callable[[], object], transport: Callable[..., Any]
                     ) -> dict[str, list[float]]:
    """This process's call times of the exchange (module docstring): ``send:<bytes>`` per
    size and ``prefetch``; each a list of seconds. ``transport``: makes the runtime's
    ``P2PTransport`` (``_transport_on``), a CPU one asked for."""
    world, me = dist.get_world_size(), dist.get_rank()
    schedule, messages = pipeline_messages(world, micro_batches)
    times: dict[str, list[float]] = {"prefetch": []}
    for nbytes in message_bytes:
        x = torch.randn(max(1, nbytes // 4))
        shapes = {m: (tuple(x.shape), x.dtype) for m in messages}
        line = transport(tuple(messages), me, {r: r for r in range(world)}, shapes,
                         torch.device("cpu"))
        times[f"send:{x.nbytes}"] = []
        _exchange(line, schedule[me], messages, me, x, lead,
                  {k: [] for k in times})                                      # warm-up
        for _ in range(repeats):
            dist.barrier()
            _exchange(line, schedule[me], messages, me, x, lead, times)
    return times


def mean_times(everyone: list[dict[str, list[float]]]) -> dict[str, float]:
    """Each timed call's mean over every process's calls. The mean, not the median: the
    calls' times are heavy-tailed (on 2 cores, 4 processes: a 64 KB send's median 80 us,
    its mean 0.4-1.2 ms, its worst 7 ms, when the process loses the core inside the call),
    and a step pays for every call, the slow ones included."""
    keys = everyone[0].keys()
    return {k: statistics.fmean([t for p in everyone for t in p[k]] or [0.0]) for k in keys}


def _transport_on(device: torch.device) -> Callable[..., P2PTransport]:
    """The runtime's transport, made for ``device`` (``measure_pipeline`` asks for a CPU one)."""
    if device.type == "cpu":
        return P2PTransport

    def make(messages, me, peers, shapes, _cpu, **options) -> P2PTransport:
        return P2PTransport(messages, me, peers, shapes, device, **options)
    return make


def measure_pipeline_on(settings: Settings, device: torch.device) -> dict[str, list[float]]:
    """``measure_pipeline`` on ``device``: its messages made there (it makes them without a
    device, so ``device`` is the default of new tensors while it runs, off the CPU)."""
    with torch.no_grad(), (device if device.type != "cpu" else contextlib.nullcontext()):
        return measure_pipeline(settings.pipeline_bytes, settings.pipeline_micro_batches,
                                settings.pipeline_repeats, lead(device), _transport_on(device))

"""The collectives' costs: an alpha-beta line per kind and group size.

The runtime's own collectives (``runtime.collectives.bind_step``: the clone, padding and
ordering they do included) on the groups ``runtime.process_groups`` makes for a mesh dim of
each group size the launch allows, all groups at once, from ~1 KB to ~16 MB; broadcast and
send/recv (a ping-pong between pairs, as pipeline messages travel) with c10d directly. A
sample is a short compute (``timing.lead``: ten 128^3 matmuls) and then one call, behind a
barrier, and the point is what the call adds to that compute: what a step pays for a
collective is more than the call's own time (on 2 cores, 2 gloo ranks, a 4 KB all-reduce:
0.5 ms timed alone, back to back or behind a barrier; 1.2 ms timed right after compute;
3.4 ms added to a compute loop: waking, skew, gloo's threads). The points are over the
bytes one rank sends (``reshard.traffic.reshard_bytes``; broadcast and send/recv: the
tensor's bytes); ``fits.fit_alpha_beta`` draws the line.

On a launch over several nodes each group size is labelled intra-node or inter-node
(``link_kind``): the profile keys a fit by group size alone.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..cost.profile import COLLECTIVE_KINDS
from ..ir.mesh import ProcessMesh
from ..ir.placements import Partial, Replicate, Shard
from ..lower.executable import StepComm
from ..reshard.steps import AllGather, AllReduce, AllToAll, ReduceScatter
from ..reshard.traffic import reshard_bytes
from ..runtime.collectives import bind_step
from ..runtime.process_groups import MeshGroups, mesh_groups
from .settings import Settings
from .timing import CPU, Probe, barrier, batch_probe, call_probe, lead, sweep

__all__ = ["measure_collectives", "median_comm", "group_sizes", "link_kind", "links"]


def group_sizes(world: int) -> list[int]:
    """Every group size a mesh dim of this launch can have: the divisors of ``world`` > 1."""
    return [n for n in range(2, world + 1) if world % n == 0]


def link_kind(n: int, world: int, local_world: int) -> str:
    """Whether the groups of a mesh dim of ``n`` ranks (``_mesh_dim``'s: ``n`` consecutive
    ranks each) all lie within a node (torchrun puts ``local_world`` consecutive ranks on
    a node): ``"intra-node"``; else ``"inter-node"`` (the groups run at once, and the one
    crossing a node paces the collective)."""
    if n < 2 or world % n or local_world < 1:
        raise ValueError(f"a mesh dim of {n} ranks in a launch of {world} ({local_world} "
                         "per node)")
    within = all(start // local_world == (start + n - 1) // local_world
                 for start in range(0, world, n))
    return "intra-node" if within else "inter-node"


def links(world: int) -> dict[int, str]:
    """Each group size's ``link_kind`` on this launch (``LOCAL_WORLD_SIZE``: torchrun's
    ranks per node; absent, one node)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {n: link_kind(n, world, local_world) for n in group_sizes(world)}


def _mesh_dim(world: int, n: int) -> tuple[MeshGroups, int]:
    """This process's groups on a mesh with a dim of ``n`` ranks (made as the runtime makes
    them), and that dim: every group along it runs at once, as in training."""
    if n == world:
        return mesh_groups(ProcessMesh(list(range(world)))), 0
    return mesh_groups(ProcessMesh(np.arange(world).reshape(world // n, n).tolist())), 1


def _rows(nbytes: int, n: int, cols: int = 64) -> int:
    """Rows of a (rows, 64) fp32 tensor of about ``nbytes`` that ``n`` ranks cut evenly."""
    return max(n, round(nbytes / (4 * cols) / n) * n)


def _runtime_collective(kind: str, full: tuple[int, int], n: int, dim: int,
                        groups: MeshGroups, device: torch.device = CPU):
    """(the runtime's callable, this rank's input, bytes a rank sends) for one ``kind``."""
    rows, cols = full
    full_bytes = rows * cols * 4
    piece = (rows // n, cols)
    if kind == "all_reduce":
        step, shape, src, dst = AllReduce(dim), full, Partial(), Replicate()
    elif kind == "reduce_scatter":
        step, shape, src, dst = ReduceScatter(dim, tensor_dim=0), full, Partial(), Shard(0)
    elif kind == "all_gather":
        step, shape, src, dst = AllGather(dim, tensor_dim=0), piece, Shard(0), Replicate()
    else:
        step, shape, src, dst = AllToAll(dim, from_dim=0, to_dim=1), piece, Shard(0), Shard(1)
    fn = bind_step(StepComm(step, (shape,) * n), groups)
    return fn, torch.randn(shape, device=device), reshard_bytes(src, dst, full_bytes, n)


def _broadcast(full: tuple[int, int], axis, device: torch.device = CPU):
    x = torch.randn(full, device=device)
    root = axis.ranks[0]
    return (lambda t: dist.broadcast(t, src=root, group=axis.group)), x, float(x.nbytes)


def _ping_pong(full: tuple[int, int], axis, device: torch.device = CPU):
    """Two messages per call between the pair's two ranks: first to second, and back."""
    x = torch.randn(full, device=device)
    first, second = axis.ranks[0], axis.ranks[1]
    me = dist.get_rank()

    def ping_pong(t: torch.Tensor) -> None:
        if me == first:
            dist.isend(t, second).wait()
            dist.irecv(t, second).wait()
        else:
            dist.irecv(t, first).wait()
            dist.isend(t, first).wait()
    return ping_pong, x, float(x.nbytes)


def _collective_probe(kind: str, nbytes: int, n: int, groups: MeshGroups, dim: int,
                      lead: Callable[[], object], device: torch.device = CPU
                      ) -> tuple[Probe, float]:
    """(a probe of one ``kind`` call on a tensor of about ``nbytes``, bytes a rank sends)."""
    full = (_rows(nbytes, n), 64)
    if kind == "broadcast":
        fn, x, sent = _broadcast(full, groups[dim], device)
    elif kind == "send_recv":
        fn, x, sent = _ping_pong(full, groups[dim], device)
    else:
        fn, x, sent = _runtime_collective(kind, full, n, dim, groups, device)
    return call_probe(fn, x, lead), sent


def measure_collectives(settings: Settings, world: int, device: torch.device = CPU
                        ) -> dict[str, dict[int, list]]:
    """kind -> group size -> [(bytes a rank sends, this process's median seconds)]; each
    kind and group size one sweep over the sizes and the lead compute alone. A point is
    what the collective adds to the lead: the median of lead + call less the lead's."""
    out: dict[str, dict[int, list]] = {}
    lead_fn = lead(device)
    lead_probe = batch_probe(lead_fn, 0.0, device)
    for n in group_sizes(world):
        groups, dim = _mesh_dim(world, n)
        for kind in COLLECTIVE_KINDS:
            if kind == "send_recv" and n != 2:
                continue                                  # a message has two ends
            barrier()
            probes, sent = zip(*(_collective_probe(kind, b, n, groups, dim, lead_fn, device)
                                 for b in settings.collective_bytes))
            *both, alone = sweep([*probes, lead_probe], settings.comm_repeats)
            seconds = [max(t - alone, 1e-7) for t in both]
            if kind == "send_recv":                       # a ping-pong is two messages
                seconds = [t / 2 for t in seconds]
            out.setdefault(kind, {})[n] = list(zip(sent, seconds))
    return out


def median_comm(everyone: list[dict]) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """Each collective's (bytes sent, seconds) points, the median over processes."""
    return {kind: {n: [(sent, statistics.median(p["collectives"][kind][n][i][1]
                                                for p in everyone))
                       for i, (sent, _) in enumerate(points)]
                   for n, points in by_n.items()}
            for kind, by_n in everyone[0]["collectives"].items()}

"""Run on every real rank (``rank_main.py collectives``): each reshard step of the planner's
paths as a c10d collective, compared with ``reshard.simulate`` over every rank's piece.

Every rank builds the same pieces for all coordinates (seeded), computes the reference for
all of them, runs the real collective on its own piece and compares. Cases: the catalogue
of ``test_reshard_plan`` on each mesh dim, nested n-D changes, even and uneven shapes, on
meshes with row-major and with shuffled process ids (group order != rank order).
"""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# the reshard tests' cases, by name: this file runs as a script on every rank
sys.path.insert(0, str(Path(__file__).parent / "reshard"))
from test_reshard_plan import CATALOGUE, EVEN, NESTED, UNEVEN, make_pieces  # noqa: E402

from autopar.ir.dist import DistAttr, ProcessMesh, parse_placements  # noqa: E402
from autopar.lower.comms import step_comm
from autopar.reshard import apply_step, plan_reshard
from autopar.runtime.collectives import bind_step
from autopar.runtime.process_groups import init_distributed, mesh_groups

R = parse_placements("R")[0]


def meshes(world: int) -> list[ProcessMesh]:
    found = [ProcessMesh(list(range(world)))]
    if world == 4:
        found += [ProcessMesh(np.arange(4).reshape(2, 2)),
                  ProcessMesh([[3, 1], [0, 2]]),     # group order differs from rank order
                  ProcessMesh([2, 0, 3, 1])]
    return found


def cases(mesh: ProcessMesh):
    """(shape, src placements, dst placements)."""
    for (src, dst, *_), shape in itertools.product(CATALOGUE, (EVEN, UNEVEN)):
        for d in range(mesh.ndim):
            for other in (R, *parse_placements("S(2),P(sum)")):
                if mesh.ndim == 1 and other is not R:
                    continue
                place = lambda p: tuple(p if i == d else other for i in range(mesh.ndim))  # noqa
                yield shape, place(src), place(dst)
    if mesh.ndim == 2:
        for src, dst, shape, _ in NESTED:
            yield shape, parse_placements(src), parse_placements(dst)
    for src, dst, shape in GROUPED.get(mesh.ndim, ()):
        yield shape, parse_placements(src), parse_placements(dst)
    for src, dst, shape in NORMS.get(mesh.ndim, ()):
        yield shape, parse_placements(src), parse_placements(dst)


# grouped shards (a fused qkv's interleaved layout): to and from R, P and plain shards;
# (15, 6) over 4 ranks cuts groups of 5 rows into 2, 2, 1 and 0
GROUPED = {
    1: [(s, d, shape) for s, d in [("S(0)x3", "R"), ("R", "S(0)x3"), ("P(sum)", "S(0)x3"),
                                   ("S(0)x3", "S(1)"), ("P(max)", "S(0)x3")]
        for shape in [(12, 8), (15, 6)]] +
    # unequal groups (grouped-query attention's [q | k | v]): 4 + 2 + 2 units of rows
    [(s, d, shape) for s, d in [("S(0)x2:1:1", "R"), ("R", "S(0)x2:1:1"),
                                ("P(sum)", "S(0)x2:1:1"), ("S(0)x2:1:1", "S(1)")]
     for shape in [(16, 4), (24, 3)]],
    2: [("R,S(0)x3", "R,R", (12, 4)), ("P(sum),S(0)x3", "S(1),S(0)x3", (12, 4)),
        ("S(0),S(0)x3", "R,R", (12, 4)), ("R,P(sum)", "S(0),S(0)x3", (18, 4)),
        ("S(0)x3,S(0)", "R,R", (18, 4)), ("R,S(0)x2:1:1", "R,R", (16, 4)),
        ("P(sum),S(0)x2:1:1", "S(1),S(0)x2:1:1", (24, 4))],
}


# norm partials (gradient clipping's P(norm2)): all-reduce and reduce-scatter of p-norm terms,
# nested over two mesh dims, and a replicated norm joining norm terms (make_partial)
NORMS = {
    1: [(s, d, shape) for s in ("P(norm2)", "P(norm1)", "P(norminf)", "P(norm3)")
        for d in ("R", "S(0)") for shape in [(8, 3), (6, 5)]] + [("R", "P(norm2)", (5,))],
    2: [("P(norm2),P(norm2)", "R,R", ()), ("P(norminf),P(norminf)", "R,R", (5,)),
        ("P(norm2),R", "P(norm2),P(norm2)", ()), ("S(0),P(norm1)", "R,R", (6, 3))],
}


def _is_norm(p) -> bool:
    return p.is_partial() and p.norm_order is not None


def check_case(mesh, groups, shape, src, dst, seed) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    glob = torch.randn(shape, generator=gen, dtype=torch.float64)
    if any(_is_norm(p) for p in (*src, *dst)):
        glob = glob.abs()       # the value of a norm partial is a norm
    pieces = make_pieces(glob, mesh, src, gen)
    placements, errors = tuple(src), []
    for step in plan_reshard(shape, DistAttr(mesh, tuple(src)), DistAttr(mesh, tuple(dst))):
        want = apply_step(pieces, mesh, step)
        comm = step_comm(step, shape, DistAttr(mesh, placements), groups.coordinate)
        got = bind_step(comm, groups)(pieces[groups.coordinate])
        mine = want[groups.coordinate]
        if got.shape != mine.shape or not torch.allclose(got, mine, rtol=1e-12, atol=1e-12):
            errors.append(f"{step} on {mesh} shape {list(shape)} from {placements}: got "
                          f"{list(got.shape)}, want {list(mine.shape)}")
        pieces, placements = want, step.advance(placements)
    return errors


def check_norm_bucket(mesh, groups, seed) -> list[str]:
    """An asynchronous bucket of norm all-reduces (an early reduction the bucketing pass
    starts where its value is made) against the reference."""
    from autopar.lower.executable import BucketStart
    from autopar.reshard import AllReduce
    from autopar.runtime.collectives import bind, wait_bucket
    errors = []
    for op in ("norm2", "norminf", "norm1"):
        gen = torch.Generator().manual_seed(seed)
        shapes = [(3, 2), ()]
        steps = [AllReduce(0, op) for _ in shapes]
        pieces = [make_pieces(torch.rand(s, generator=gen, dtype=torch.float64), mesh,
                              parse_placements(f"P({op})"), gen) for s in shapes]
        got = wait_bucket(bind(BucketStart(tuple(steps), tuple(shapes)), groups)(
            *[p[groups.coordinate] for p in pieces]))
        for step, p, g in zip(steps, pieces, got):
            want = apply_step(p, mesh, step)[groups.coordinate]
            if not torch.allclose(g, want, rtol=1e-12, atol=1e-12):
                errors.append(f"bucket {step} on {mesh}: got {g}, want {want}")
    return errors


def check_all() -> dict:
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(torch.device("cpu"), world, world)
    checked, errors, kinds = 0, [], set()
    for mesh in meshes(world):
        groups = mesh_groups(mesh)
        for seed, (shape, src, dst) in enumerate(cases(mesh)):
            steps = plan_reshard(shape, DistAttr(mesh, tuple(src)), DistAttr(mesh, tuple(dst)))
            kinds.update(s.kind for s in steps)
            errors += check_case(mesh, groups, shape, src, dst, seed)
            checked += 1
        if mesh.ndim == 1:
            errors += check_norm_bucket(mesh, groups, checked)
    dist.barrier()
    return {"checked": checked, "errors": errors, "kinds": sorted(kinds)}

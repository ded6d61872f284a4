"""The ``Shift`` step (a ring pass of S(t) pieces, ring attention's k/v chunks) everywhere a
step runs or is priced: the reference semantics (``reshard.simulate``) against a roll of the
whole tensor, the real collective on gloo processes (eager and under ``torch.compile``)
against the reference, and its bytes and predicted seconds.

Run as a script (``python tests/spmd/test_shift_step.py``) it is one rank of the real-process
test: every rank checks its own piece and saves what it found."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from autopar.cost import AlphaBeta, Curve, Profile
from autopar.cost.predict import comm_seconds
from autopar.ir import Op, OpKind, TensorType, Value
from autopar.ir.dist import (
    DistAttr,
    ProcessMesh,
    Shard,
    assemble,
    local_shape,
    parse_placements,
    shard_tensor_local,
)
from autopar.lower.comms import step_comm
from autopar.reshard import STEP_KINDS, Shift, apply_step, plan_reshard
from autopar.reshard.paths import step_is_valid


def _mesh(*shape: int) -> ProcessMesh:
    return ProcessMesh(np.arange(math.prod(shape)).reshape(shape).tolist())


def _placements(mesh: ProcessMesh, mesh_dim: int, tensor_dim: int) -> tuple:
    """S(tensor_dim) on ``mesh_dim``, the other mesh dims shard the other tensor dim (so a
    2-D mesh's pieces differ along both and a shift over one dim keeps the other's cut)."""
    other = 1 - tensor_dim
    return tuple(Shard(tensor_dim) if d == mesh_dim else Shard(other) for d in range(mesh.ndim))


# both dims divide by 2, 3 and 4: every mesh dim of the cases cuts equal pieces
GLOBAL = torch.arange(24 * 12, dtype=torch.float64).reshape(24, 12)


def _rolled(glob: torch.Tensor, n: int, tensor_dim: int, k: int) -> torch.Tensor:
    """What a shift by ``k`` over a mesh dim of ``n`` makes of the whole tensor when no
    other mesh dim cuts ``tensor_dim``: that dim rolled by ``k`` pieces."""
    return torch.roll(glob, k * glob.shape[tensor_dim] // n, dims=tensor_dim)


CASES = [((2,), 0, 0), ((4,), 0, 0), ((4,), 0, 1), ((2, 3), 0, 0), ((2, 3), 1, 0),
         ((2, 3), 1, 1), ((2, 3), 0, 1)]


@pytest.mark.parametrize("mesh_shape,mesh_dim,tensor_dim", CASES)
@pytest.mark.parametrize("k", [1, -1, 2, 0, 5])
def test_simulated_shift_rolls_the_whole_tensor(mesh_shape, mesh_dim, tensor_dim, k):
    mesh = _mesh(*mesh_shape)
    placements = _placements(mesh, mesh_dim, tensor_dim)
    glob = GLOBAL
    pieces = {c: shard_tensor_local(glob, mesh, placements, c) for c in mesh.coordinates()}
    step = Shift(mesh_dim, tensor_dim=tensor_dim, shift=k)
    assert step.advance(placements) == placements
    out = apply_step(pieces, mesh, step)
    want = _rolled(glob, mesh.shape[mesh_dim], tensor_dim, k)
    assert torch.equal(assemble(out, glob.shape, mesh, placements), want)
    n = mesh.shape[mesh_dim]
    for c, piece in out.items():       # member i holds member (i - k)'s piece, a copy
        source = c[:mesh_dim] + ((c[mesh_dim] - k) % n,) + c[mesh_dim + 1:]
        assert torch.equal(piece, pieces[source])
        assert piece.data_ptr() != pieces[source].data_ptr()


def test_simulated_shift_of_uneven_pieces_names_the_step_and_shapes():
    mesh = _mesh(3)
    pieces = {c: shard_tensor_local(torch.ones(7, 2), mesh, (Shard(0),), c)
              for c in mesh.coordinates()}
    with pytest.raises(ValueError, match=r"shift\(dim 0, by 1\).*differ in shape"):
        apply_step(pieces, mesh, Shift(0, tensor_dim=0, shift=1))


def test_the_planner_never_plans_a_shift():
    mesh = _mesh(2, 2)
    assert STEP_KINDS["shift"] is Shift
    for src, dst in [("S(0),S(1)", "S(0),S(1)"), ("S(0),R", "S(1),S(0)"),
                     ("S(1),S(0)", "R,R"), ("P(sum),S(0)", "S(0),S(1)")]:
        steps = plan_reshard((8, 8), DistAttr(mesh, parse_placements(src)),
                             DistAttr(mesh, parse_placements(dst)))
        assert not any(isinstance(s, Shift) for s in steps), (src, dst, steps)


def test_a_shift_over_a_pipelines_micro_batch_dim_is_not_valid():
    mesh = ProcessMesh([[0, 1]], ["mb", "dp"])
    assert not step_is_valid(Shift(0, tensor_dim=0), (4, 4), mesh, (Shard(0), Shard(1)))


# -- cost -----------------------------------------------------------------------------------

ALPHA, BETA = 1e-4, 1e-8
A2A_ALPHA, A2A_BETA = 3e-4, 2e-8
PW_S_PER_BYTE = 1e-10
PROFILE = Profile(
    machine="synthetic", processes=4, threads=1, matmul=Curve(points=[(1.0, 1e-9)]),
    pointwise=Curve(points=[(1.0, PW_S_PER_BYTE)]), op_overhead_s=2e-5,
    collectives={**{k: {2: AlphaBeta(alpha_s=ALPHA, beta_s_per_byte=BETA),
                        4: AlphaBeta(alpha_s=ALPHA, beta_s_per_byte=BETA)}
                    for k in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")},
                 "all_to_all": {n: AlphaBeta(alpha_s=n * A2A_ALPHA, beta_s_per_byte=A2A_BETA)
                                for n in (2, 4)}})


def _shift_op(shape: tuple[int, ...], dist: DistAttr, step: Shift, dtype=torch.float32) -> Op:
    """The comm op of a rank's local program (local shapes: coordinate 0's piece)."""
    piece = local_shape(shape, dist.mesh, dist.placements, (0,) * dist.mesh.ndim)
    x = Value(TensorType(piece, dtype))
    return Op(OpKind.COMM, f"comm.{step.kind}", (x,), outputs=[Value(TensorType(piece, dtype))])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shift_costs_one_piece_on_the_all_to_all_fit_of_its_group(n, dtype):
    mesh, shape = _mesh(n), (8 * n, 5)
    dist = DistAttr(mesh, (Shard(0),))
    step = Shift(0, tensor_dim=0, shift=1)
    piece = math.prod(local_shape(shape, mesh, (Shard(0),), (0,))) * dtype.itemsize
    assert step.cost(shape, mesh, (Shard(0),), dtype.itemsize) == piece == 8 * 5 * dtype.itemsize
    spec = step_comm(step, shape, dist, (0,))
    cost = comm_seconds(spec, _shift_op(shape, dist, step, dtype), PROFILE, mesh)
    assert cost.seconds == pytest.approx(n * A2A_ALPHA + A2A_BETA * piece, rel=1e-12)
    assert cost.seconds > 0 and cost.mesh_dim == 0 and not cost.started and cost.local == 0


def test_a_whole_turn_costs_no_message_only_a_local_copy():
    mesh, shape = _mesh(4), (16, 5)
    dist = DistAttr(mesh, (Shard(0),))
    for k in (0, 4, -8):
        step = Shift(0, tensor_dim=0, shift=k)
        assert step.cost(shape, mesh, (Shard(0),)) == 0
        cost = comm_seconds(step_comm(step, shape, dist, (1,)), _shift_op(shape, dist, step),
                            PROFILE, mesh)
        assert cost.seconds == 0
        assert cost.local == pytest.approx(2 * 4 * 5 * 4 * PW_S_PER_BYTE, rel=1e-12)


def test_shift_over_the_second_dim_of_a_2d_mesh_prices_its_own_group():
    mesh, shape = _mesh(2, 4), (8, 16)
    placements = (Shard(0), Shard(1))
    dist = DistAttr(mesh, placements)
    step = Shift(1, tensor_dim=1, shift=-1)
    piece = 4 * 4 * 4
    assert step.cost(shape, mesh, placements) == piece
    cost = comm_seconds(step_comm(step, shape, dist, (1, 2)), _shift_op(shape, dist, step),
                        PROFILE, mesh)
    assert cost.seconds == pytest.approx(4 * A2A_ALPHA + A2A_BETA * piece, rel=1e-12)
    assert cost.mesh_dim == 1


# -- the real collective ------------------------------------------------------------------------

def test_binding_a_shift_of_uneven_pieces_names_the_step_and_shapes():
    from autopar.lower.executable import StepComm
    from autopar.runtime.collectives import bind_step
    from autopar.runtime.process_groups import MeshAxisGroup, MeshGroups
    mesh = _mesh(3)
    groups = MeshGroups(mesh, 0, (0,), (MeshAxisGroup(None, (0, 1, 2), 0, (0, 1, 2)),))
    with pytest.raises(ValueError, match=r"shift\(dim 0, by 1\).*differ in shape"):
        bind_step(StepComm(Shift(0, tensor_dim=0), ((3, 2), (2, 2), (2, 2))), groups)


# the real ranks' tensor: both dims divide by 2 and 4 (equal pieces)
RANK_SHAPE = (16, 12)


def _rank_meshes(world: int) -> list[ProcessMesh]:
    found = [ProcessMesh(list(range(world)))]
    if world == 4:
        found += [_mesh(2, 2), ProcessMesh([[3, 1], [0, 2]]),   # group order != rank order
                  ProcessMesh([2, 0, 3, 1])]
    return found


def _rank_cases(mesh: ProcessMesh):
    """(mesh dim, tensor dim, k) of every shift a rank checks on ``mesh``."""
    for mesh_dim in range(mesh.ndim):
        for tensor_dim, k in [(0, 1), (0, -1), (1, 1), (1, 2), (0, 0), (1, -3)]:
            yield mesh_dim, tensor_dim, k


def _check_rank(mesh: ProcessMesh, groups, compiled: bool) -> tuple[int, list[str]]:
    """Every shift of ``_rank_cases`` run on this rank's piece, against the reference."""
    from autopar.runtime.collectives import bind_step
    checked, errors = 0, []
    for seed, (mesh_dim, tensor_dim, k) in enumerate(_rank_cases(mesh)):
        if compiled and (tensor_dim, k) not in ((0, 1), (0, -1)):
            continue                 # compiling is slow: the two directions of a ring
        placements = _placements(mesh, mesh_dim, tensor_dim)
        glob = torch.randn(RANK_SHAPE, generator=torch.Generator().manual_seed(seed))
        pieces = {c: shard_tensor_local(glob, mesh, placements, c) for c in mesh.coordinates()}
        step = Shift(mesh_dim, tensor_dim=tensor_dim, shift=k)
        run = bind_step(step_comm(step, glob.shape, DistAttr(mesh, placements),
                                  groups.coordinate), groups)
        if compiled:
            run = torch.compile(run, fullgraph=True)
        mine = pieces[groups.coordinate]
        got = run(mine)
        want = apply_step(pieces, mesh, step)[groups.coordinate]
        checked += 1
        if not torch.equal(got, want) or not torch.equal(mine, pieces[groups.coordinate]):
            errors.append(f"{step} on {mesh}{' compiled' if compiled else ''}: got "
                          f"{got.flatten()[:4].tolist()}, want {want.flatten()[:4].tolist()}")
    return checked, errors


def rank_main() -> None:
    """One rank of ``test_real_shift_equals_the_reference``."""
    import torch.distributed as dist

    from autopar.runtime.process_groups import init_distributed, mesh_groups, shutdown
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(torch.device("cpu"), world, world)
    result = {"checked": 0, "compiled": 0, "errors": []}
    for mesh in _rank_meshes(world):
        checked, errors = _check_rank(mesh, mesh_groups(mesh), compiled=False)
        result["checked"] += checked
        result["errors"] += errors
    compiled, errors = _check_rank(_rank_meshes(world)[-1], mesh_groups(_rank_meshes(world)[-1]),
                                   compiled=True)
    result["compiled"], result["errors"] = compiled, result["errors"] + errors
    dist.barrier()
    torch.save(result, Path(os.environ["AUTOPAR_TEST_RESULT_DIR"]) / f"rank{dist.get_rank()}.pt")
    shutdown(barrier=True)


@pytest.mark.parametrize("world", [2, 4])
def test_real_shift_equals_the_reference(world):
    from ..multiproc import finish, launch, logs
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        proc = launch(world, out, __file__, env={"AUTOPAR_TEST_RESULT_DIR": str(out)})
        failure = finish(proc, 300)
        if failure:
            raise AssertionError(f"shift on {world} ranks: {failure}\n" + logs(out))
        results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, result in enumerate(results):
        assert result["errors"] == [], f"rank {rank}: {result['errors'][:5]}"
        assert result["checked"] == sum(len(list(_rank_cases(m))) for m in _rank_meshes(world))
        assert result["compiled"] == 2 * _rank_meshes(world)[-1].ndim


if __name__ == "__main__":
    rank_main()

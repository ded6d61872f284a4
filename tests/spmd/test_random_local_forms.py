"""Random ops under any placement draw exactly the numbers single-device torch draws.

CPU random kernels draw in the order they walk memory (and ``normal_`` switches algorithm
for contiguous tensors), so a rank must draw the global tensor in the strides the trace
saw, whatever layout its own piece has (pieces from collectives are contiguous, size-1 and
empty pieces have no stride order). The simulator must also give every rank the same
generator state before a random op, although the rank's call is a local form, not the
ATen op.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.ir import Op, OpKind, TensorType, Value
from autopar.ir.attrs import MULTI, STRIDES
from autopar.ir.dist import DistAttr, ProcessMesh, Replicate, Shard, assemble, shard_tensor_local
from autopar.ir.ops import resolve
from autopar.spmd.local_forms import LocalContext, UnsupportedLocalForm, local_call, run_local

from ..parity import ATOL, RTOL

SHAPE = (4, 3, 5)


def _layout(kind: str) -> torch.Tensor:
    """An empty global tensor of SHAPE laid out as ``kind``."""
    if kind == "contiguous":
        return torch.empty(SHAPE)
    if kind == "permuted":        # dense, dims in memory order (2, 0, 1)
        return torch.empty(SHAPE[2], SHAPE[0], SHAPE[1]).permute(1, 2, 0)
    assert kind == "strided"      # not dense: every other element of a wider tensor
    return torch.empty(*SHAPE[:2], 2 * SHAPE[2])[..., ::2]


def _eager(target: str, template: torch.Tensor, *args):
    """The single-device draw from seed 0, and the generator state after it."""
    torch.manual_seed(0)
    out = resolve(target)(template, *args)
    return out, torch.default_generator.get_state()


def _op(target: str, template: torch.Tensor, outs, *args) -> Op:
    """The op as capture records it: global types and the traced output strides."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    op = Op(OpKind.CALL, target, (Value(TensorType(SHAPE, template.dtype)), *args), {},
            [Value(TensorType(tuple(o.shape), o.dtype)) for o in outs])
    op.attrs[STRIDES] = tuple(tuple(o.stride()) for o in outs)
    if len(outs) > 1:
        op.attrs[MULTI] = True
    return op


def _piece_like(piece: torch.Tensor, how: str) -> torch.Tensor:
    """A rank's piece as some producer left it: contiguous (a collective) or transposed."""
    if how == "contiguous" or piece.dim() < 2:
        return piece.contiguous()
    return piece.transpose(0, 1).contiguous().transpose(0, 1)


PLACEMENTS = [
    ((2,), ["S(0)"]),                  # even
    ((3,), ["S(1)"]),                  # 3 over 3
    ((3,), ["S(0)"]),                  # 4 over 3: pieces 2, 2, 0 (an empty piece)
    ((2, 2), ["S(0)", "S(0)"]),        # nested: size-1 pieces
    ((2, 3), ["S(2)", "S(0)"]),        # 5 over 2 then 4 over 3: uneven on two dims
    ((2,), ["R"]),                     # replicated, piece laid out unlike the trace
]


def _dist(mesh: ProcessMesh, text: list[str]) -> DistAttr:
    return DistAttr(mesh, tuple(Replicate() if t == "R" else Shard(int(t[2:-1])) for t in text))


def _run_ranks(op: Op, mesh: ProcessMesh, dist: DistAttr, pieces_of, n_out: int):
    """Every rank's local call from seed 0 (as the simulator runs it): its results, and
    the generator state each rank ends in."""
    results, states = {}, set()
    for coord in mesh.coordinates():
        ctx = LocalContext(mesh, coord, (dist,), (dist,) * n_out)
        torch.manual_seed(0)
        out = run_local(op, ctx, {op.inputs[0]: pieces_of(coord)})
        results[coord] = out if n_out > 1 else (out,)
        states.add(bytes(torch.default_generator.get_state().numpy()))
    return results, states


@pytest.mark.parametrize("piece_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("mesh_shape,placements", PLACEMENTS,
                         ids=[f"{s}-{','.join(p)}" for s, p in PLACEMENTS])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "strided"])
@pytest.mark.parametrize("target,args", [("aten.bernoulli_.float", (0.3,)),
                                         ("aten.normal_.default", ()),
                                         ("aten.uniform_.default", ()),
                                         ("aten.rand_like.default", ())],
                         ids=["bernoulli_", "normal_", "uniform_", "rand_like"])
def test_sharded_random_fill_draws_the_eager_numbers(target, args, layout, mesh_shape,
                                                     placements, piece_layout):
    template = _layout(layout)
    want, state_after = _eager(target, template, *args)
    mesh = ProcessMesh(torch.arange(torch.tensor(mesh_shape).prod()).reshape(mesh_shape).tolist())
    dist = _dist(mesh, placements)
    op = _op(target, template, want, *args)
    global_template = torch.zeros(SHAPE)     # values are ignored: any will do

    def piece(coord):
        return _piece_like(shard_tensor_local(global_template, mesh, dist.placements, coord),
                           piece_layout)

    results, states = _run_ranks(op, mesh, dist, piece, 1)
    got = assemble({c: r[0] for c, r in results.items()}, SHAPE, mesh, dist.placements)
    assert torch.equal(got, want), f"{target} on a {layout} tensor under {placements}"
    # every rank's generator advanced exactly as eager's: later draws stay in step
    assert states == {bytes(state_after.numpy())}


@pytest.mark.parametrize("mesh_shape,placements", PLACEMENTS,
                         ids=[f"{s}-{','.join(p)}" for s, p in PLACEMENTS])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_sharded_native_dropout_draws_the_eager_mask(layout, mesh_shape, placements):
    x = _layout(layout).copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
    torch.manual_seed(0)
    want_out, want_mask = torch.ops.aten.native_dropout.default(x, 0.4, True)
    state_after = torch.default_generator.get_state()
    mesh = ProcessMesh(torch.arange(torch.tensor(mesh_shape).prod()).reshape(mesh_shape).tolist())
    dist = _dist(mesh, placements)
    op = _op("aten.native_dropout.default", x, (want_out, want_mask), 0.4, True)
    results, states = _run_ranks(
        op, mesh, dist,
        lambda c: shard_tensor_local(x, mesh, dist.placements, c).contiguous(), 2)
    for k, want in enumerate((want_out, want_mask)):
        got = assemble({c: r[k] for c, r in results.items()}, SHAPE, mesh, dist.placements)
        assert torch.equal(got, want), f"native_dropout output {k}, {layout}, {placements}"
    assert states == {bytes(state_after.numpy())}


def test_random_op_without_traced_layout_is_refused():
    op = _op("aten.bernoulli_.float", torch.empty(SHAPE), torch.empty(SHAPE), 0.5)
    del op.attrs[STRIDES]
    mesh = ProcessMesh([0, 1])
    ctx = LocalContext(mesh, (0,), (DistAttr(mesh, (Shard(0),)),), (DistAttr(mesh, (Shard(0),)),))
    with pytest.raises(UnsupportedLocalForm, match="bernoulli_.*traced layout"):
        local_call(op, ctx)


# ----------------------------------------------------------------------------------------
# end to end: the simulator trains with dropout under data parallelism as eager does
# ----------------------------------------------------------------------------------------
class DropoutLayouts(nn.Module):
    """Dropout on a contiguous activation and on a transposed (permuted-layout) one."""

    def __init__(self, d: int = 8, hidden: int = 24, p: float = 0.3):
        super().__init__()
        self.fc1, self.fc2, self.p = nn.Linear(d, hidden), nn.Linear(hidden, 4), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))                                       # [B, T, hidden]
        h = F.dropout(h, self.p, self.training)
        h = F.dropout(h.transpose(0, 1), self.p, self.training).transpose(0, 1)
        return self.fc2(h)


def _mse(out, y):
    return F.mse_loss(out, y)


@pytest.mark.parametrize("mesh,batch", [([2], 4), ([2], 3), ([4], 3)],
                         ids=["dp2", "dp2-uneven", "dp4-empty-piece"])
def test_simulated_dp_dropout_matches_eager(mesh, batch):
    torch.manual_seed(0)
    model = DropoutLayouts()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
            for _ in range(2 * batch)]
    strategy = ap.Strategy(mesh={"shape": mesh, "dim_names": ["dp"]},
                           data_parallel={"axis": "dp"}, debug={"simulate": True})
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    losses = engine.fit(data, batch_size=batch, verbose=0)["loss"]

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        xs, ys = zip(*data[step * batch:(step + 1) * batch])
        torch.manual_seed(step)          # the engine's random stream: seed + step
        ref_opt.zero_grad()
        loss = _mse(ref(torch.stack(xs)), torch.stack(ys))
        loss.backward()
        ref_opt.step()
        torch.testing.assert_close(torch.tensor(losses[step]), loss.detach(), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"step {step} loss: {m}")
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")

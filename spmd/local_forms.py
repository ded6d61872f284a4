"""Local forms: how one rank runs an op whose operands are sharded, when the call differs
from the global one.

Most ops run unchanged on local pieces (a matmul of shards is a shard of the matmul). The
exceptions carry something global in their non-tensor arguments or in what they compute:

* a shape argument (``view``, ``expand``, ``zeros`` ...) names the global shape;
* ``arange`` and ``tril``/``triu`` depend on where the piece sits in the global tensor;
* ``mean`` divides by the number of elements, which is global;
* a vocab-sharded ``embedding`` holds only some rows, so other ids give 0 (a *masked*
  ``Partial(sum)``), and its backward scatters only into the rows the rank holds;
* random ops must give every rank its slice of one global random tensor, or a sharded run
  would not equal the single-device run (a random op with a sharded output and no form
  raises ``UnsupportedLocalForm`` rather than run wrong);
* a few kernels crash on the empty pieces uneven shards leave (CPU flash attention).

A local form is a pure function ``(op, ctx) -> LocalCall | None`` that rewrites the call:
a target (an ATen overload, or a small ``autopar.*`` kernel registered here) and arguments
that still hold the op's input Values, which at run time are the rank's local tensors. The
partition pass applies it to every op of a rank's program; ``run_local`` executes it on
concrete local tensors (for tests and the simulator). ``None`` means "call unchanged".

Every form reads placements from ``ctx``: ``needs`` (what each tensor input holds, in
``op.inputs`` order, the rule's decision) and ``outputs`` (what each output holds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from ..ir.core import Op, Value
from ..ir.dist import DistAttr, Partial, ProcessMesh, Shard, local_offsets
from ..runtime.kernels import kernel, resolve

__all__ = ["LocalCall", "LocalContext", "LocalForm", "LOCAL_FORMS", "register_local_form",
           "local_call", "run_local", "UnsupportedLocalForm"]


class UnsupportedLocalForm(NotImplementedError):
    """The op cannot run on this rank's pieces under these placements (e.g. a random op
    with a sharded output and no local form): silently running it would be wrong."""


@dataclass(frozen=True)
class LocalCall:
    """The call one rank makes: ``target(*args, **kwargs)`` with the op's input Values
    standing for the rank's local tensors. ``note`` says why it differs (for dumps)."""

    target: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class LocalContext:
    """Where the rank sits and how the op's operands are placed."""

    mesh: ProcessMesh
    coordinate: tuple[int, ...]
    needs: tuple[DistAttr, ...]              # per tensor input, op.inputs order
    outputs: tuple[DistAttr | None, ...]     # per output (None: not a tensor)

    @classmethod
    def of(cls, op: Op, mesh: ProcessMesh, coordinate: Sequence[int]) -> "LocalContext":
        """The context completion left on ``op`` (its needs and its outputs' dists)."""
        return cls(mesh, tuple(coordinate), tuple(op.needs),
                   tuple(v.dist if v.is_tensor else None for v in op.outputs))

    # -- outputs --------------------------------------------------------------------------
    def out_placements(self, index: int = 0) -> tuple:
        dist = self.outputs[index]
        return dist.placements if dist is not None else ()

    def out_sharded(self, index: int = 0) -> bool:
        return any(isinstance(p, Shard) for p in self.out_placements(index))

    def out_offsets(self, op: Op, index: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local shape, global offset) of this rank's piece of output ``index``."""
        return local_offsets(op.outputs[index].type.shape, self.mesh,
                             self.out_placements(index), self.coordinate)

    def out_shape(self, op: Op, index: int = 0) -> tuple[int, ...]:
        return self.out_offsets(op, index)[0]

    def out_bounds(self, op: Op, index: int = 0) -> tuple[tuple[int, int], ...]:
        """(start, stop) per dim of this rank's piece of output ``index``."""
        size, start = self.out_offsets(op, index)
        return tuple((o, o + n) for o, n in zip(start, size))

    # -- inputs ---------------------------------------------------------------------------
    def in_offsets(self, op: Op, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local shape, global offset) of this rank's piece of tensor input ``index``."""
        value = [v for v in op.inputs if v.is_tensor][index]
        return local_offsets(value.type.shape, self.mesh, self.needs[index].placements,
                             self.coordinate)

    def in_shard_mesh_dims(self, index: int, tensor_dim: int) -> list[int]:
        return self.needs[index].shard_mesh_dims(tensor_dim)


LocalForm = Callable[[Op, LocalContext], "LocalCall | None"]
LOCAL_FORMS: dict[str, LocalForm] = {}


def register_local_form(*targets: str) -> Callable[[LocalForm], LocalForm]:
    def add(fn: LocalForm) -> LocalForm:
        for target in targets:
            if target in LOCAL_FORMS:
                raise ValueError(f"local form for {target!r} registered twice")
            LOCAL_FORMS[target] = fn
        return fn
    return add


def local_call(op: Op, ctx: LocalContext) -> LocalCall:
    """The call this rank makes for ``op`` (the op's own call when no form applies)."""
    form = LOCAL_FORMS.get(op.target)
    call = form(op, ctx) if form is not None else None
    if call is None:
        if form is None and _draws_random(op) and any(
                ctx.out_sharded(i) for i, v in enumerate(op.outputs) if v.is_tensor):
            raise UnsupportedLocalForm(
                f"random op {op.target} ({op.module or 'top level'}) has a sharded output "
                f"{[str(d) for d in ctx.outputs]} but no local form in "
                "autopar/spmd/local_forms.py: its ranks would draw unrelated numbers")
        return LocalCall(op.target, op.args, dict(op.kwargs))
    return call


def run_local(op: Op, ctx: LocalContext, values: Mapping[Value, Any]) -> Any:
    """Execute this rank's call of ``op``: ``values`` maps each input Value of ``op`` to the
    rank's runtime value (its local tensor, or a non-tensor input as it is)."""
    call = local_call(op, ctx)
    swap = lambda a: values[a] if isinstance(a, Value) else a  # noqa: E731
    args, kwargs = pytree.tree_map(swap, (call.args, call.kwargs))
    return resolve(call.target)(*args, **kwargs)


def _is_random(target: str) -> bool:
    if not target.startswith("aten."):
        return False
    try:
        return torch.Tag.nondeterministic_seeded in resolve(target).tags
    except KeyError:
        return False


def _draws_random(op: Op) -> bool:
    """Whether the op consumes the generator: tagged random, unless its only randomness is
    a dropout probability that is 0 (attention kernels with ``dropout_p=0``)."""
    if not _is_random(op.target):
        return False
    try:
        schema = resolve(op.target)._schema
    except AttributeError:
        return True
    given = dict(zip([a.name for a in schema.arguments if not a.kwarg_only], op.args))
    given.update(op.kwargs)
    return given.get("dropout_p", 1) != 0


def _replace(seq: tuple, index: int, value: Any) -> tuple:
    return seq[:index] + (value,) + seq[index + 1:]


# ----------------------------------------------------------------------------------------
# shape-carrying ops: the shape argument becomes the rank's local output shape
# ----------------------------------------------------------------------------------------
# target -> (position of the shape argument, its keyword name)
SHAPE_ARGS: dict[str, tuple[int, str]] = {
    "aten.view.default": (1, "size"),
    "aten._unsafe_view.default": (1, "size"),
    "aten.reshape.default": (1, "shape"),
    "aten._reshape_alias.default": (1, "size"),
    "aten.expand.default": (1, "size"),
    "aten.new_zeros.default": (1, "size"),
    "aten.new_ones.default": (1, "size"),
    "aten.new_empty.default": (1, "size"),
    "aten.new_full.default": (1, "size"),
    "aten.zeros.default": (0, "size"),
    "aten.ones.default": (0, "size"),
    "aten.empty.memory_format": (0, "size"),
    "aten.full.default": (0, "size"),
    "aten.slice_backward.default": (1, "input_sizes"),
    "aten.select_backward.default": (1, "input_sizes"),
}


@register_local_form(*SHAPE_ARGS)
def _shape_arg(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A shape argument is the global output shape; a rank makes its piece's shape. Only
    sharded outputs change (a Partial's terms have the global shape)."""
    if not ctx.out_sharded(0):
        return None
    pos, name = SHAPE_ARGS[op.target]
    local = list(ctx.out_shape(op, 0))
    if op.target == "aten._reshape_alias.default":
        # its stride argument is global too: a fresh local view is contiguous
        return LocalCall("aten.view.default", (op.args[0], local), {},
                         "reshape to the local shape")
    if name in op.kwargs:
        return LocalCall(op.target, op.args, {**op.kwargs, name: local}, "local shape")
    return LocalCall(op.target, _replace(tuple(op.args), pos, local), dict(op.kwargs),
                     "local shape")


# ----------------------------------------------------------------------------------------
# position-dependent ops
# ----------------------------------------------------------------------------------------
_ARANGE = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


@register_local_form(*_ARANGE)
def _arange(op: Op, ctx: LocalContext) -> LocalCall | None:
    """A sharded range is the range of the piece: ``start + offset*step`` on."""
    if not ctx.out_sharded(0):
        return None
    args = tuple(op.args)
    if op.target == "aten.arange.default":
        start, step = 0, 1
    else:
        start = args[0]
        step = args[2] if op.target == "aten.arange.start_step" and len(args) > 2 \
            else op.kwargs.get("step", 1)
    (size,), (offset,) = ctx.out_offsets(op, 0)
    kwargs = {k: v for k, v in op.kwargs.items() if k not in ("start", "end", "step")}
    if "dtype" not in kwargs:
        # the global call infers its dtype from all of start/end/step; keep it
        kwargs["dtype"] = op.outputs[0].type.dtype
    return LocalCall("aten.arange.start_step",
                     (start + offset * step, start + (offset + size) * step, step), kwargs,
                     f"local range from offset {offset}")


@register_local_form("aten.tril.default", "aten.triu.default")
def _tril(op: Op, ctx: LocalContext) -> LocalCall | None:
    """The diagonal is global: a piece at (row r0, col c0) keeps ``j - i <= k + r0 - c0``."""
    if not ctx.out_sharded(0):
        return None
    _, offset = ctx.out_offsets(op, 0)
    row, col = offset[-2], offset[-1]
    if row == col:
        return None
    diagonal = op.args[1] if len(op.args) > 1 else op.kwargs.get("diagonal", 0)
    return LocalCall(op.target, (op.args[0], diagonal + row - col), {},
                     f"diagonal shifted by {row - col}")


# ----------------------------------------------------------------------------------------
# means: divide the local sum by the global count, so the terms add up to the mean
# ----------------------------------------------------------------------------------------
@kernel("autopar.global_mean")
def _global_mean(target: str, count: int | float, *args, **kwargs) -> torch.Tensor:
    """``target`` is the sum-reduced form of a mean; dividing by the *global* count makes
    the local result an exact term of a Partial(sum)."""
    return resolve(target)(*args, **kwargs) / count


def _mean_count(op: Op, ctx: LocalContext, reduced: Sequence[int]) -> int | float | None:
    """The divisor each rank uses, or None when no reduced dim is sharded (the local mean
    is then the global one). ``Partial(avg)`` outputs already divide by the ranks of their
    mesh dim, so their share of the count is taken out again."""
    shape = [v for v in op.inputs if v.is_tensor][0].type.shape
    sharded = {m: p for m, p in enumerate(ctx.needs[0].placements)
               if isinstance(p, Shard) and p.dim in reduced}
    if not sharded:
        return None
    count = math.prod(shape[d] for d in reduced)
    out = ctx.out_placements(0)
    ranks = math.prod(ctx.mesh.shape[m] for m in sharded
                      if m < len(out) and out[m] == Partial("avg"))
    # an avg over ranks of s_r / (N / ranks) is sum(s_r) / N, even for uneven pieces
    return count // ranks if count % ranks == 0 else count / ranks


def _dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % ndim if ndim else 0 for d in dims]


@register_local_form("aten.mean.dim", "aten.mean.default")
def _mean(op: Op, ctx: LocalContext) -> LocalCall | None:
    x = op.args[0]
    ndim = len(x.type.shape)
    if op.target == "aten.mean.default":
        dims, keepdim = list(range(ndim)), False
        dtype = op.args[1] if len(op.args) > 1 else op.kwargs.get("dtype")
    else:
        dims = _dims(op.args[1] if len(op.args) > 1 else op.kwargs.get("dim"), ndim)
        keepdim = op.args[2] if len(op.args) > 2 else op.kwargs.get("keepdim", False)
        dtype = op.args[3] if len(op.args) > 3 else op.kwargs.get("dtype")
    count = _mean_count(op, ctx, dims)
    if count is None:
        return None
    return LocalCall("autopar.global_mean", ("aten.sum.dim_IntList", count, x, dims, keepdim),
                     {"dtype": dtype}, f"local sum / global count {count}")


_MSE_MEAN = 1   # at::Reduction::Mean
_MSE_SUM = 2


@register_local_form("aten.mse_loss.default")
def _mse_loss(op: Op, ctx: LocalContext) -> LocalCall | None:
    reduction = op.args[2] if len(op.args) > 2 else op.kwargs.get("reduction", _MSE_MEAN)
    if reduction != _MSE_MEAN:
        return None
    count = _mean_count(op, ctx, range(len(op.args[0].type.shape)))
    if count is None:
        return None
    return LocalCall("autopar.global_mean",
                     ("aten.mse_loss.default", count, op.args[0], op.args[1], _MSE_SUM), {},
                     f"local squared-error sum / global count {count}")


@register_local_form("aten.mse_loss_backward.default")
def _mse_loss_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    """mean reduction scales by 1/numel: the global numel, not the piece's."""
    grad, x, target = op.args[:3]
    reduction = op.args[3] if len(op.args) > 3 else op.kwargs.get("reduction", _MSE_MEAN)
    if reduction != _MSE_MEAN:
        return None
    tensors = [v for v in op.inputs if v.is_tensor]
    x_index = tensors.index(x)
    if not any(isinstance(p, Shard) for p in ctx.needs[x_index].placements):
        return None
    return LocalCall("autopar.global_mean",
                     ("aten.mse_loss_backward.default", x.type.numel, grad, x, target,
                      _MSE_SUM), {}, f"scale by the global count {x.type.numel}")


# ----------------------------------------------------------------------------------------
# vocab-parallel embedding: a rank holds rows [offset, offset + rows) of the table
# ----------------------------------------------------------------------------------------
@kernel("autopar.vocab_embedding")
def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int) -> torch.Tensor:
    """Rows this rank holds; zeros for ids outside them (the sum over ranks is the lookup)."""
    rows = weight.shape[0]
    outside = (indices < offset) | (indices >= offset + rows)
    if rows == 0:
        return weight.new_zeros((*indices.shape, *weight.shape[1:]))
    local = (indices - offset).masked_fill(outside, 0)
    out = torch.ops.aten.embedding.default(weight, local)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@kernel("autopar.vocab_embedding_backward")
def vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, rows: int, offset: int,
                             padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """The rows [offset, offset+rows) of the weight gradient: ids outside go to a dummy row
    that is dropped, so counts (scale_grad_by_freq) of the held ids stay exact."""
    outside = (indices < offset) | (indices >= offset + rows)
    local = (indices - offset).masked_fill(outside, rows)
    pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    full = torch.ops.aten.embedding_dense_backward.default(grad, local, rows + 1, pad,
                                                           scale_grad_by_freq)
    return full[:rows]


@register_local_form("aten.embedding.default")
def _embedding(op: Op, ctx: LocalContext) -> LocalCall | None:
    if not ctx.in_shard_mesh_dims(0, 0):
        return None
    offset = ctx.in_offsets(op, 0)[1][0]
    return LocalCall("autopar.vocab_embedding", (op.args[0], op.args[1], offset), {},
                     f"vocab rows from {offset}; other ids give 0 (masked partial)")


@register_local_form("aten.embedding_dense_backward.default")
def _embedding_backward(op: Op, ctx: LocalContext) -> LocalCall | None:
    placements = ctx.out_placements(0)
    if not any(p == Shard(0) for p in placements):
        return None
    (rows, *_), (offset, *_) = ctx.out_offsets(op, 0)
    grad, indices, _, padding_idx, scale = (tuple(op.args) + (None,) * 5)[:5]
    padding_idx = op.kwargs.get("padding_idx", padding_idx)
    scale = op.kwargs.get("scale_grad_by_freq", scale)
    return LocalCall("autopar.vocab_embedding_backward",
                     (grad, indices, rows, offset, -1 if padding_idx is None else padding_idx,
                      bool(scale)), {}, f"gradient of vocab rows [{offset}, {offset + rows})")


# ----------------------------------------------------------------------------------------
# random ops: every rank draws the global tensor from the same generator state and keeps
# its slice, so the generators stay in step and a sharded run equals the serial one
# ----------------------------------------------------------------------------------------
def _empty_in_order(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dims lie in memory in ``like``'s order."""
    if like.dim() != len(shape):
        return like.new_empty(tuple(shape))
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    permuted = like.new_empty(tuple(shape[d] for d in order))
    return permuted.permute([order.index(d) for d in range(like.dim())])


@kernel("autopar.sliced_random")
def sliced_random(target: str, global_shape: Sequence[int], bounds: Sequence[Sequence[int]],
                  inplace: bool, template: torch.Tensor | None, *args, **kwargs):
    """Run random ``target`` at the global shape and keep the piece at ``bounds``.

    ``template`` is the op's first (shape-giving) tensor argument, whose values the op
    ignores (``bernoulli_.float``, ``rand_like`` ...); None for factories, whose size
    arguments are global already. In-place ops fill ``template`` with the piece.
    """
    fn = resolve(target)
    if template is None:
        full = fn(*args, **kwargs)
    else:
        full = fn(_empty_in_order(template, global_shape), *args, **kwargs)
    piece = full[tuple(slice(a, b) for a, b in bounds)]
    if inplace:
        return template.copy_(piece)
    return piece.clone()


# ops that fill their first argument (or a tensor shaped like it) with fresh numbers,
# ignoring its values
_TEMPLATE_RANDOM = (
    "aten.bernoulli_.float", "aten.bernoulli.p", "aten.uniform_.default",
    "aten.normal_.default", "aten.exponential_.default", "aten.random_.default",
    "aten.random_.from", "aten.random_.to", "aten.geometric_.default",
    "aten.log_normal_.default", "aten.cauchy_.default", "aten.rand_like.default",
    "aten.randn_like.default", "aten.randint_like.default", "aten.randint_like.low_dtype",
)
# factories whose size arguments are global
_FACTORY_RANDOM = (
    "aten.rand.default", "aten.randn.default", "aten.randint.default", "aten.randint.low",
    "aten.randperm.default", "aten.normal.float_float",
)


@register_local_form(*_TEMPLATE_RANDOM, *_FACTORY_RANDOM)
def _random(op: Op, ctx: LocalContext) -> LocalCall | None:
    if not ctx.out_sharded(0):
        return None      # same generator state on every rank: the same whole tensor
    shape = op.outputs[0].type.shape
    bounds = ctx.out_bounds(op, 0)
    if op.target in _FACTORY_RANDOM:
        return LocalCall("autopar.sliced_random",
                         (op.target, shape, bounds, False, None, *op.args), dict(op.kwargs),
                         "slice of the global random tensor")
    inplace = op.target.split(".")[1].endswith("_")
    return LocalCall("autopar.sliced_random",
                     (op.target, shape, bounds, inplace, op.args[0], *op.args[1:]),
                     dict(op.kwargs), "slice of the global random tensor")


@kernel("autopar.sliced_native_dropout")
def sliced_native_dropout(x: torch.Tensor, p: float, train: bool | None,
                          global_shape: Sequence[int], bounds: Sequence[Sequence[int]]):
    """native_dropout's mask is drawn at the global shape (on ones: the mask does not
    depend on the values) and sliced; the output is the piece times the mask, scaled."""
    ones = _empty_in_order(x, global_shape).fill_(1)
    _, mask = torch.ops.aten.native_dropout.default(ones, p, train)
    mask = mask[tuple(slice(a, b) for a, b in bounds)]
    if train is False:
        return x.clone(), mask.clone()
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask.clone()


@register_local_form("aten.native_dropout.default")
def _native_dropout(op: Op, ctx: LocalContext) -> LocalCall | None:
    if not (ctx.out_sharded(0) or ctx.out_sharded(1)):
        return None
    if ctx.out_placements(0) != ctx.out_placements(1):
        raise UnsupportedLocalForm(f"native_dropout with output {ctx.outputs[0]} but mask "
                                   f"{ctx.outputs[1]}: the two must be placed alike")
    x, p = op.args[0], op.args[1]
    train = op.args[2] if len(op.args) > 2 else op.kwargs.get("train")
    return LocalCall("autopar.sliced_native_dropout",
                     (x, p, train, op.outputs[0].type.shape, ctx.out_bounds(op, 0)), {},
                     "mask sliced from the global mask")


# ----------------------------------------------------------------------------------------
# kernels that crash on empty pieces (uneven shards leave trailing ranks empty)
# ----------------------------------------------------------------------------------------
@kernel("autopar.empty_outputs")
def empty_outputs(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]):
    """The op's outputs when every one of them is empty on this rank."""
    return tuple(torch.empty(tuple(s), dtype=d) for s, d in zip(shapes, dtypes))


# The CPU flash-attention kernels divide by the head count: an empty piece kills the process.
_EMPTY_UNSAFE = (
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
)


@register_local_form(*_EMPTY_UNSAFE)
def _empty_guard(op: Op, ctx: LocalContext) -> LocalCall | None:
    if _draws_random(op) and any(ctx.out_sharded(i) for i in range(len(op.outputs))):
        raise UnsupportedLocalForm(f"{op.target} with dropout and sharded outputs: its "
                                   "dropout mask cannot be sliced from a global one")
    shapes = [ctx.out_shape(op, i) for i in range(len(op.outputs))]
    if not all(math.prod(s) == 0 for s in shapes):
        return None
    return LocalCall("autopar.empty_outputs", ([list(s) for s in shapes],
                                               [v.type.dtype for v in op.outputs]), {},
                     "every output is empty on this rank")

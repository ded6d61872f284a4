"""Models built on the meta device: each process materializes only its pieces.

The contract (README "Models too big for one process"): build the model under
``torch.device("meta")``; autopar plans from its shapes and runs the model's init path with
every meta parameter and buffer standing in as a ``Deferred`` tensor (full shape, no memory).
The init path is, first found: ``Engine(init_fn=...)`` called with the model; the model's
``init_weights()``; else ``reset_parameters()`` of every submodule that has one, in
``model.modules()`` order (what the constructors do on a real device, in construction order).
It runs on a fork of the CPU generator in the state it had when the ``Engine`` was made, so
the numbers are those of ``model.to_empty(device="cpu")`` followed by the same init path,
eagerly, at that point; the caller's generator is left as it was.

Each init runs twice. A dry run at ``Engine(...)`` (no memory, no numbers) records what the
path does to each tensor, and refuses a tensor it never writes, naming its module. A
tensor whose every write is one ``piece_init`` can do on a piece (random fills of the whole
tensor; ``fill_``, ``zero_``, pointwise in-place ops with scalar operands, ``copy_`` from a
given tensor, through select / slice views) is *streamed*: written straight into this
process's piece. Any other use (``orthogonal_``'s QR, reading the values) makes it *whole*:
materialized on its own, one at a time, from its first use to its last, then cut. The real
run (``pieces``) happens when the first plan says which pieces this process holds.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils import _pytree as pytree

from ..lower.executable import StatePiece
from .piece_init import PieceIndex, Region, draw_into, source_values, write_region

__all__ = ["MetaInit", "MetaInitError", "MetaInitNote", "is_deferred_model"]

InitFn = Callable[[torch.nn.Module], Any]

RANDOM_FILLS = {"aten.uniform_.default", "aten.normal_.default"}
VIEWS = {"aten.select.int", "aten.slice.Tensor", "aten.detach.default", "aten.alias.default"}
FILLS = {"aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default"}


class MetaInitError(ValueError):
    """A meta-device model whose init path cannot materialize it."""


class MetaInitNote(UserWarning):
    """A meta tensor the init path writes in a way a piece cannot follow: drawn whole."""


def is_deferred_model(model: torch.nn.Module) -> bool:
    return any(t.is_meta for _, t in _named_state(model))


@dataclasses.dataclass
class _Root:
    """One meta parameter or buffer during an init run."""

    name: str
    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: PieceIndex | None = None       # the piece to keep (None: dry run, or not held)
    whole: bool = False                   # a use a piece cannot follow (from the dry run)
    why: str = ""
    uses: int = 0                         # ops that touched it (the dry run's check)
    piece: torch.Tensor | None = None
    full: torch.Tensor | None = None      # a whole tensor's value while it is being written


class Deferred(torch.Tensor):
    """A meta tensor (or a basic-indexing view of one) as the init path sees it: its full
    shape on the CPU, no storage; each op on it goes to the running ``_InitRun``."""

    root: _Root
    region: Region
    run: "_InitRun"

    @staticmethod
    def __new__(cls, root: _Root, region: Region, run: "_InitRun"):
        t = torch.Tensor._make_wrapper_subclass(cls, region.shape(), dtype=root.dtype,
                                                device="cpu", requires_grad=False)
        t.root, t.region, t.run = root, region, run
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        deferred = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Deferred)]
        return deferred[0].run.dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:
        return f"Deferred({self.root.name}, {tuple(self.shape)})"


class _InitRun:
    """One run of the init path: ``dry`` records, else writes the pieces."""

    def __init__(self, roots: dict[int, _Root], dry: bool):
        self.roots, self.dry = roots, dry

    # -- dispatch -----------------------------------------------------------------------
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        name = str(func)
        target = args[0] if args and isinstance(args[0], Deferred) else None
        others = [a for a in pytree.tree_leaves((args[1:], kwargs)) if isinstance(a, Deferred)]
        if target is None or others or target.root.whole:
            return self._whole(func, args, kwargs)
        root = target.root
        if name in VIEWS:
            return self._view(name, target, args)
        if name in RANDOM_FILLS and target.region.is_identity(root.shape):
            return self._count(root, lambda: draw_into(
                root.piece, root.index, lambda t: func(t, *args[1:], **kwargs)), target)
        if name == "aten.copy_.default" and isinstance(args[1], torch.Tensor) \
                and not args[1].is_meta:
            src = args[1]
            return self._count(root, lambda: write_region(
                root.piece, root.index, target.region,
                lambda v: v.copy_(source_values(src, root.index, target.region))), target)
        if name in FILLS or _pointwise_in_place(func, args, kwargs):
            return self._count(root, lambda: write_region(
                root.piece, root.index, target.region,
                lambda v: func(v, *args[1:], **kwargs)), target)
        return self._whole(func, args, kwargs)

    def _count(self, root: _Root, write: Callable[[], None], result: Deferred) -> Deferred:
        if self.dry:
            root.uses += 1
        else:
            write()         # on an empty piece when not held: random fills still draw
        return result

    def _view(self, name: str, target: Deferred, args: tuple) -> Deferred:
        region = target.region
        if name == "aten.select.int":
            region = region.select(args[1] % max(target.dim(), 1), args[2])
        elif name == "aten.slice.Tensor":
            dim, start, stop, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
            region = region.slice(dim % target.dim(), start, stop, step)
        return Deferred(target.root, region, self)

    # -- whole tensors ------------------------------------------------------------------
    def _whole(self, func, args: tuple, kwargs: dict) -> Any:
        """An op a piece cannot follow runs on the whole values of its tensors (each cut
        to its piece when its module's init ends: ``cut_whole``). In the dry run a tensor
        streamed so far becomes whole from here on, starting from zeros (its values may
        steer the init, as ``trunc_normal_``'s rejection loop does; the real run has it
        whole from its first op)."""
        touched = [a.root for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Deferred)]
        streamed = [root for root in touched if not root.whole]
        if streamed and not self.dry:
            raise MetaInitError(
                f"the init path of {streamed[0].name!r} (module {streamed[0].module!r}) ran "
                f"{func} on it, which its dry run did not: an init path must do the same "
                "ops each time it runs")
        for root in streamed:
            root.whole, root.why = True, str(func)
            root.full = torch.zeros(root.shape, dtype=root.dtype)
        for root in touched:
            root.uses += 1
            if root.full is None:
                root.full = torch.empty(root.shape, dtype=root.dtype)
        real_args, real_kwargs = pytree.tree_map_only(Deferred, _as_real, (args, kwargs))
        return func(*real_args, **real_kwargs)

    def cut_whole(self) -> None:
        for root in self.roots.values():
            if root.full is not None:
                _cut(root)


def _as_real(t: Deferred) -> torch.Tensor:
    view = t.root.full
    for d, s in reversed(list(enumerate(t.region.dims))):
        view = view.select(d, s) if isinstance(s, int) else view[(slice(None),) * d + (slice(*s),)]
    return view


def _cut(root: _Root) -> None:
    """A whole tensor after its last write: keep the piece, free the rest."""
    if root.index is not None and root.full is not None:
        grid = [root.index.indices(d) for d in range(len(root.shape))]
        n = len(grid)
        root.piece = root.full[tuple(t.view([-1 if i == d else 1 for i in range(n)])
                                     for d, t in enumerate(grid))] if n else root.full.clone()
    root.full = None


def _pointwise_in_place(func, args: tuple, kwargs: dict) -> bool:
    """An elementwise in-place op whose other operands are scalars or 0-d tensors."""
    schema = func._schema
    if not (schema.arguments and schema.arguments[0].alias_info is not None
            and schema.arguments[0].alias_info.is_write):
        return False
    if torch.Tag.pointwise not in func.tags:
        return False
    return all(not isinstance(a, torch.Tensor) or a.dim() == 0
               for a in pytree.tree_leaves((args[1:], kwargs)))


class MetaInit:
    """A meta-device model's init path: checked by a dry run now, run for real by
    ``pieces`` (this process's pieces) or ``materialize`` (the whole model, in place)."""

    def __init__(self, model: torch.nn.Module, init_fn: InitFn | None = None):
        self.model, self.init_fn = model, init_fn
        self.describe = _describe_path(model, init_fn)
        self.rng_state = torch.default_generator.get_state()    # eager's init draws here
        roots = self._roots()
        replaced = self._run(roots, dry=True)
        self.whole = {name: r.why for name, r in roots.items() if r.whole}
        _check_written(model, [r for r in roots.values()
                               if r.uses == 0 and r.name not in replaced], self.describe)
        if self.whole:
            listed = ", ".join(f"{n} ({why})" for n, why in self.whole.items())
            warnings.warn(f"meta init: {len(self.whole)} tensor(s) are written in ways a "
                          f"piece cannot follow; each is drawn whole on its own: {listed}",
                          MetaInitNote, stacklevel=3)

    def materialize(self) -> None:
        """The whole model on the CPU, initialized eagerly (one process holds it all: a
        serial or simulated plan)."""
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)   # the optimizer's own
        try:                                                           # tensors materialize
            self.model.to_empty(device="cpu")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        with _Forked(self.rng_state), torch.no_grad():
            _call_path(self.model, self.init_fn, lambda: None)

    def pieces(self, wanted: Mapping[str, StatePiece]) -> dict[str, torch.Tensor]:
        """This process's pieces of the meta parameters and buffers in ``wanted``."""
        roots = self._roots()
        for name, root in roots.items():
            root.whole, root.why = name in self.whole, self.whole.get(name, "")
            root.index = _index_of(root.shape, wanted.get(name))
            if not root.whole:
                root.piece = torch.empty(root.index.local_shape, dtype=root.dtype)
        replaced = self._run(roots, dry=False)
        return {name: replaced[name] if name in replaced else roots[name].piece
                for name in wanted if name in roots}

    def _roots(self) -> dict[str, _Root]:
        return {name: _Root(name, name.rpartition(".")[0], tuple(t.shape), t.dtype)
                for name, t in _named_state(self.model) if t.is_meta}

    def _run(self, roots: dict[str, _Root], dry: bool) -> dict[str, torch.Tensor]:
        """Run the init path with the meta tensors swapped for ``Deferred`` ones; returns
        what the path assigned anew to buffer slots (cut to the pieces when real)."""
        run = _InitRun(roots, dry)
        saved = _module_attributes(self.model)
        swapped = _swap_in(self.model, roots, run)
        try:
            with _Forked(self.rng_state), torch.no_grad():
                _call_path(self.model, self.init_fn, run.cut_whole)
            return _replaced(swapped, roots)
        finally:
            _swap_out(swapped)
            _restore_attributes(saved)


def _module_attributes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]]:
    """Each module's plain attributes: an init path may mark what it has done (Hugging
    Face's ``_is_hf_initialized``), and every run of it must start as the first did."""
    return [(m, {k: v for k, v in vars(m).items() if k not in _MODULE_SLOTS})
            for m in model.modules()]


_MODULE_SLOTS = {"_parameters", "_buffers", "_modules"}


def _restore_attributes(saved: list[tuple[torch.nn.Module, dict]]) -> None:
    for module, attributes in saved:
        for key in [k for k in vars(module) if k not in _MODULE_SLOTS and k not in attributes]:
            delattr(module, key)
        vars(module).update(attributes)


def _index_of(shape: tuple[int, ...], piece: StatePiece | None) -> PieceIndex:
    """The positions this process keeps: none when it does not hold the tensor (its
    random fills still draw, so the generator moves as eager's does)."""
    if piece is None:
        return PieceIndex(shape, ((),) + tuple(((0, n),) for n in shape[1:])) if shape \
            else PieceIndex.whole(shape)
    if piece.dist is None:
        return PieceIndex.whole(shape)
    return PieceIndex.of(shape, piece.dist.mesh, piece.dist.placements, piece.coordinate)


def _named_state(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _check_written(model: torch.nn.Module, unwritten: list[_Root], describe: str) -> None:
    if not unwritten:
        return
    listed = ", ".join(f"{r.name!r} (module {r.module or '<root>'!r}: "
                       f"{type(model.get_submodule(r.module)).__name__})"
                       for r in unwritten[:8])
    raise MetaInitError(
        f"the model is on the meta device and its init path ({describe}) never writes "
        f"{len(unwritten)} of its tensors: {listed}. Give those modules a reset_parameters(), "
        "the model an init_weights(), or pass Engine(..., init_fn=fn) that initializes every "
        "parameter and buffer")


def _describe_path(model: torch.nn.Module, init_fn: InitFn | None) -> str:
    if init_fn is not None:
        return f"init_fn={getattr(init_fn, '__qualname__', repr(init_fn))}"
    if callable(getattr(model, "init_weights", None)):
        return f"{type(model).__name__}.init_weights()"
    return "reset_parameters() of each submodule"


def _call_path(model: torch.nn.Module, init_fn: InitFn | None,
               after_module: Callable[[], None]) -> None:
    """The init path; ``after_module`` runs after each module's ``reset_parameters`` (and
    once at the end), where whole tensors are cut to their pieces."""
    if init_fn is not None:
        init_fn(model)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights()
    else:
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                after_module()
    after_module()


class _Forked:
    """The CPU generator at ``state`` inside (unchanged when None), the caller's after."""

    def __init__(self, state: torch.Tensor | None):
        self.state = state

    def __enter__(self) -> None:
        self.saved = torch.default_generator.get_state()
        if self.state is not None:
            torch.default_generator.set_state(self.state)

    def __exit__(self, *exc) -> None:
        torch.default_generator.set_state(self.saved)


@dataclasses.dataclass
class _Slot:
    slots: dict
    key: str
    original: torch.Tensor
    deferred: Deferred
    name: str
    is_param: bool


def _swap_in(model: torch.nn.Module, roots: dict[str, _Root], run: _InitRun) -> list[_Slot]:
    """Every slot holding a meta tensor of ``roots`` now holds its ``Deferred`` (a tied
    tensor: the same one in each of its slots)."""
    canonical = {id(t): name for name, t in _named_state(model)}
    made: dict[int, Deferred] = {}
    swapped = []
    for module in model.modules():
        for slots, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, t in list(slots.items()):
                name = canonical.get(id(t)) if t is not None else None
                if name not in roots:
                    continue
                if id(t) not in made:
                    made[id(t)] = Deferred(roots[name], Region.identity(t.shape), run)
                slots[key] = made[id(t)]
                swapped.append(_Slot(slots, key, t, made[id(t)], name, is_param))
    return swapped


def _replaced(swapped: list[_Slot], roots: dict[str, _Root]) -> dict[str, torch.Tensor]:
    """Slots the init path re-assigned: a buffer made anew is kept (cut to the piece); a
    parameter replaced is refused (the optimizer holds the old one)."""
    out = {}
    for slot in swapped:
        now = slot.slots[slot.key]
        if now is slot.deferred or now is None or now.is_meta:
            continue
        if slot.is_param:
            raise MetaInitError(
                f"the init path replaced parameter {slot.name!r} with a new tensor; "
                "initialize it in place (nn.init.*_, .copy_) so the optimizer keeps "
                "training the parameter it holds")
        root = roots[slot.name]
        root.full, root.piece = now.detach(), None
        _cut(root)
        out[slot.name] = root.piece
    return out


def _swap_out(swapped: list[_Slot]) -> None:
    for slot in swapped:
        slot.slots[slot.key] = slot.original

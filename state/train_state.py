"""The training state: the user's model and optimizer seen as named, typed state, the LR
scheduler, and how far the run has trained; where each state value starts, and how trained
values go back into the model and the optimizer.

Every state value has a typed key (``ir.StateKey``: its kind, the parameter it belongs to,
its own key), made where the state is declared (capture, the passes) and carried by
lowering into each process's ``StatePiece``; its name is the program's (``<param FQN>``,
``<param FQN>/<key>`` for optimizer state, ``gradient_merge/<param FQN>``, ``amp/<key>``).
Nothing here splits a name to learn what a state is. A fresh value is made from what the
key says: the model's tensor, the optimizer's state (``ir.kernels.optim``'s rule for it),
or the constant the declaring pass gave (``StatePiece.fill``: a gradient-merge accumulator
starts at zeros, the loss scale at ``init_scale``).

``tensors`` holds whole tensors: the model's own parameters and buffers (so a serial or
simulated run trains the model in place) and any other state once a program made it. On
real processes the runtime holds the pieces; ``write_back`` copies gathered values into the
model's tensors and the optimizer.

A model built on the meta device (``meta_init``) is materialized whole, in place, before a
plan runs in this process (serial, simulated), and piece by piece on real processes
(``pieces``): there its own tensors stay on meta and gathered values live in ``tensors``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from ..ir import StateKey, StateKind
from ..ir.kernels.optim import initial_state
from ..lower.executable import StatePiece
from ..runtime import cut_piece
from .meta_init import InitFn, MetaInit, is_deferred_model

__all__ = ["TrainState", "Progress", "place_model"]


@dataclass
class Progress:
    """How far a run has trained: what exact resume needs besides tensors."""

    global_step: int = 0      # optimizer steps (gradient merge: one per k_steps batches)
    batches_trained: int = 0  # training batches run; batch i draws seed + i
    epoch: int = 0            # fit's current epoch (the next one between epochs)
    batch_in_epoch: int = 0   # batches of it trained: with ``epoch``, the data position
    resume_at: tuple[int, int] | None = None   # set by a load: where the next fit starts
    # where the data stands (``data.data_position``, serialized): noted by a save,
    # restored by a load, and read by the next fit when it resumes
    data: bytes | None = None


class TrainState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any = None, init_fn: InitFn | None = None):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.params = dict(model.named_parameters())
        self.param_names = {id(p): n for n, p in self.params.items()}
        self.tensors: dict[str, Any] = {}
        self.keys: dict[str, StateKey] = {}      # every state known, by name
        self._read_model()
        self.progress = Progress()
        self.deferred = MetaInit(model, init_fn) if is_deferred_model(model) else None
        # a checkpoint loaded on real processes before the state was placed (its pieces
        # are read as the first steps place them): ``checkpointing.PendingLoad``
        self.pending: Any = None
        if init_fn is not None and self.deferred is None:
            raise ValueError("Engine(init_fn=...) initializes a model built on the meta device "
                             "(torch.device('meta')); this model has no meta tensors")

    def _read_model(self) -> None:
        self.own: dict[str, torch.Tensor] = {}   # the model's own tensors, by state name
        for name, p in self.model.named_parameters():
            self.own[name], self.keys[name] = p.detach(), StateKey.of_param(name)
        for name, b in self.model.named_buffers():
            self.own[name], self.keys[name] = b, StateKey.of_buffer(name)
        self.tensors.update(self.own)

    def learn(self, pieces: Iterable[StatePiece]) -> None:
        """Know the typed keys of a plan's states (checkpoints save what they say)."""
        self.learn_keys(piece.key for piece in pieces)

    def learn_keys(self, keys: Iterable[StateKey]) -> None:
        self.keys.update({key.name: key for key in keys})

    def materialize(self) -> None:
        """A meta model, whole and initialized in place (a plan run in this process)."""
        if self.deferred is not None and any(t.is_meta for t in self.model.parameters()):
            self.deferred.materialize()
            self._read_model()

    # -- starting values -------------------------------------------------------------------
    def initial(self, piece: StatePiece) -> torch.Tensor | None:
        """The whole starting value of ``piece``'s state: the value held (the model's
        tensor, a loaded or trained one), else a fresh one as its key says (None for state
        the first update creates, such as SGD's momentum buffer)."""
        if piece.name in self.tensors:
            return self.tensors[piece.name]
        if piece.fill is not None:
            return torch.full(piece.shape, piece.fill, dtype=piece.dtype)
        if piece.key.kind is StateKind.OPTIM:
            return self._optimizer_state(piece.key)
        raise KeyError(f"no starting value for program state {piece.name!r} ({piece.key})")

    def _optimizer_state(self, key: StateKey, like: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
        """Optimizer state ``key`` as torch has it (a resumed optimizer's) or would make
        it on the first step (like ``like``, else like the parameter)."""
        param = self.params[key.param]
        group = next(g for g in self.optimizer.param_groups
                     if any(p is param for p in g["params"]))
        return initial_state(self.optimizer, group, param, like=like)[key.key]

    def pieces(self, wanted: Mapping[str, StatePiece]) -> dict[str, torch.Tensor | None]:
        """This process's starting pieces of the states in ``wanted`` (real processes):
        cut from the whole starting value, or, for a meta model, drawn piece by piece; read
        from a pending checkpoint for the states it holds."""
        loaded = self.pending.read(wanted) if self.pending is not None else {}
        if self.pending is not None and not self.pending.keys:
            self.pending = None
        wanted = {n: p for n, p in wanted.items() if n not in loaded}
        meta = {n: p for n, p in wanted.items()
                if self.deferred is not None and _is_meta(self.tensors.get(n))}
        out = self.deferred.pieces(meta) if meta else {}
        for name, piece in wanted.items():
            if name not in meta:
                out[name] = self._piece_of(piece)
        return {**out, **loaded}

    def _piece_of(self, piece: StatePiece) -> torch.Tensor | None:
        key = piece.key
        if key.kind is not StateKind.OPTIM or not self.params[key.param].is_meta:
            return cut_piece(self.initial(piece), piece)
        # fresh optimizer state of a meta parameter: made like its piece (torch makes it
        # elementwise: zeros, or a constant)
        local = piece.dist.local_shape(piece.shape, piece.coordinate) if piece.dist \
            else piece.shape
        value = self._optimizer_state(key, like=torch.empty(local, dtype=piece.dtype))
        if value is not None and tuple(value.shape) not in (tuple(local), ()):
            raise ValueError(f"optimizer state {piece.name!r} of a meta parameter is not "
                             f"shaped like the parameter ({tuple(value.shape)})")
        return value

    # -- back into the model and the optimizer ---------------------------------------------
    def module_state_names(self) -> list[str]:
        """The model's parameters and buffers, in ``state_dict`` order."""
        return [n for n, key in self.keys.items() if key.of_module]

    def write_back(self, names: Iterable[str], full: Callable[[str], torch.Tensor | None]
                   ) -> None:
        """Copy each state's whole value (``full(name)``, a collective on real processes:
        called for every name, in order) into the model's tensors and the optimizer."""
        gathered = {}
        for name in names:
            value = full(name)
            if value is not None:
                gathered[name] = value
        for name, value in gathered.items():
            own = self.own.get(name)     # the runtime may keep it elsewhere (offload, a device)
            if own is not None and not own.is_meta:
                if own is not value:
                    own.copy_(value)
            else:
                self.tensors[name] = value
        self.refresh_optimizer_state()

    def refresh_optimizer_state(self) -> None:
        """Optimizer state through ``optimizer.state`` (so ``state_dict`` works)."""
        if self.optimizer is None:
            return
        for name, key in self.keys.items():
            value = self.tensors.get(name)
            if key.kind is StateKind.OPTIM and value is not None:
                self.optimizer.state[self.params[key.param]][key.key] = value


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def place_model(model: torch.nn.Module, device: torch.device, params_on_host: bool = False
                ) -> None:
    """Move the model's parameters and buffers to ``device`` in place (the optimizer keeps
    the same parameter objects), unless already there; ``params_on_host``
    (``sharding.offload.params``): the parameters go to the host instead. A model on the
    meta device stays there: each process's pieces are drawn on the CPU, as
    ``model.to_empty(device="cpu")`` + its init path draws them, and then placed where
    they live (``runtime.at_home``)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[key] = buffer.to(device)
        home = torch.device("cpu") if params_on_host else device
        for param in module._parameters.values():
            if param is not None and param.device != home:
                param.data = param.data.to(home)

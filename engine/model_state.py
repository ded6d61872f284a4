"""The user's model and optimizer seen as named state: where each state value starts, and how
trained values go back into the model and the optimizer.

State names are the program's: ``<param FQN>``, ``<buffer FQN>``, ``<param FQN>/<key>`` for
optimizer state (``exp_avg``, ``momentum_buffer``...), ``gradient_merge/<param FQN>`` for a
gradient-merge accumulator (zeros at first; never in ``state_dict`` or the optimizer's
state). ``tensors`` holds whole tensors: the model's own parameters and buffers (so a serial
or simulated run trains the model in place) and optimizer state once a program made it. On
real processes the runtime holds the pieces; ``write_back`` copies gathered values into the
model's tensors and the optimizer.

A model built on the meta device (``meta_init``) is materialized whole, in place, before a
plan runs in this process (serial, simulated), and piece by piece on real processes
(``pieces``): there its own tensors stay on meta and gathered values live in ``tensors``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from ..lower.executable import StatePiece
from ..passes.merge_gradients import accumulated_param
from ..passes.optimizer_updates import initial_state
from ..runtime.rank_state import cut_piece
from .meta_init import InitFn, MetaInit, is_deferred_model

__all__ = ["ModelState"]


class ModelState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 init_fn: InitFn | None = None,
                 extra: Mapping[str, torch.Tensor] | None = None):
        """``extra``: state the plan keeps beside the model's and the optimizer's, with its
        starting value (the loss scaler's ``amp/loss_scale``, ``passes/scale_loss.py``)."""
        self.model, self.optimizer = model, optimizer
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.tensors: dict[str, Any] = dict(extra or {})
        self._read_model()
        self.deferred = MetaInit(model, init_fn) if is_deferred_model(model) else None
        # a checkpoint loaded on real processes before the state was placed (its pieces
        # are read as the first steps place them): ``checkpointing.PendingLoad``
        self.pending: Any = None
        if init_fn is not None and self.deferred is None:
            raise ValueError("Engine(init_fn=...) initializes a model built on the meta device "
                             "(torch.device('meta')); this model has no meta tensors")

    def _read_model(self) -> None:
        self.tensors.update({n: p.detach() for n, p in self.model.named_parameters()})
        self.tensors.update({n: b for n, b in self.model.named_buffers()})

    def materialize(self) -> None:
        """A meta model, whole and initialized in place (a plan run in this process)."""
        if self.deferred is not None and any(t.is_meta for t in self.model.parameters()):
            self.deferred.materialize()
            self._read_model()

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
                out[name] = self._piece_of(name, piece)
        return {**out, **loaded}

    def _piece_of(self, name: str, piece: StatePiece) -> torch.Tensor | None:
        param = self._param_of_state(name)
        if param is None or not param.is_meta:
            return cut_piece(self.initial(name), piece)
        # fresh optimizer state of a meta parameter: made like its piece (torch makes it
        # elementwise: zeros, or a constant)
        local = piece.dist.local_shape(piece.shape, piece.coordinate) if piece.dist \
            else piece.shape
        group = next(g for g in self.optimizer.param_groups
                     if any(p is param for p in g["params"]))
        state = initial_state(self.optimizer, group, param,
                              like=torch.empty(local, dtype=param.dtype))
        value = state[name.rpartition("/")[2]]
        if value is not None and tuple(value.shape) not in (tuple(local), ()):
            raise ValueError(f"optimizer state {name!r} of a meta parameter is not shaped like "
                             f"the parameter ({tuple(value.shape)})")
        return value

    def _param_of_state(self, name: str) -> torch.Tensor | None:
        param_name, _, key = name.rpartition("/")
        if not key or self.optimizer is None:
            return None
        return next((p for group in self.optimizer.param_groups for p in group["params"]
                     if self.param_names[id(p)] == param_name), None)

    def module_state_names(self) -> list[str]:
        """The model's parameters and buffers, in ``state_dict`` order."""
        return ([n for n, _ in self.model.named_parameters()]
                + [n for n, _ in self.model.named_buffers()])

    def initial(self, name: str) -> torch.Tensor | None:
        """The whole starting value of state ``name``: the model's tensor, zeros for a
        gradient-merge accumulator, or the optimizer state torch would have (its own, when
        it has some; None for state the first update creates, such as SGD's momentum
        buffer)."""
        if name in self.tensors:
            return self.tensors[name]
        merged = accumulated_param(name)
        if merged is not None:
            param = self.model.get_parameter(merged)
            return torch.zeros(param.shape, dtype=param.dtype,
                               device="cpu" if param.is_meta else param.device)
        param_name, _, key = name.rpartition("/")
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            for p in group["params"]:
                if self.param_names[id(p)] == param_name:
                    return initial_state(self.optimizer, group, p)[key]
        raise KeyError(f"no initial value for program state {name!r}")

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
            own = self.tensors.get(name)
            if isinstance(own, torch.Tensor) and name in self._module_names() \
                    and not own.is_meta:
                if own is not value:
                    own.copy_(value)
            else:
                self.tensors[name] = value
        self.refresh_optimizer_state()

    def _module_names(self) -> set[str]:
        return set(self.module_state_names())

    def refresh_optimizer_state(self) -> None:
        """Optimizer state through ``optimizer.state`` (so ``state_dict`` works)."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                prefix = f"{self.param_names[id(p)]}/"
                own = {k[len(prefix):]: v for k, v in self.tensors.items()
                       if k.startswith(prefix) and v is not None}
                if own:
                    self.optimizer.state[p].update(own)


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta

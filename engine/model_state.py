"""The user's model and optimizer seen as named state: where each state value starts, and how
trained values go back into the model and the optimizer.

State names are the program's: ``<param FQN>``, ``<buffer FQN>``, ``<param FQN>/<key>`` for
optimizer state (``exp_avg``, ``momentum_buffer``...). ``tensors`` holds whole tensors: the
model's own parameters and buffers (so a serial or simulated run trains the model in place)
and optimizer state once a program made it. On real processes the runtime holds the pieces;
``write_back`` copies gathered values into the model's tensors and the optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..passes.lower_optimizer import initial_state

__all__ = ["ModelState"]


class ModelState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.tensors: dict[str, Any] = {n: p.detach() for n, p in model.named_parameters()}
        self.tensors.update({n: b for n, b in model.named_buffers()})

    def module_state_names(self) -> list[str]:
        """The model's parameters and buffers, in ``state_dict`` order."""
        return ([n for n, _ in self.model.named_parameters()]
                + [n for n, _ in self.model.named_buffers()])

    def initial(self, name: str) -> torch.Tensor | None:
        """The whole starting value of state ``name``: the model's tensor, or the optimizer
        state torch would have (its own, when it has some; None for state the first update
        creates, such as SGD's momentum buffer)."""
        if name in self.tensors:
            return self.tensors[name]
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
            if isinstance(own, torch.Tensor) and name in self._module_names():
                if own is not value:
                    own.copy_(value)
            else:
                self.tensors[name] = value
        self._expose_optimizer_state()

    def _module_names(self) -> set[str]:
        return set(self.module_state_names())

    def _expose_optimizer_state(self) -> None:
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

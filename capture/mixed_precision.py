"""How capture computes a step in mixed precision (the strategy's ``amp`` section, as capture
needs it: capture imports no strategy).

* O1: the forward and the loss are traced under ``torch.autocast`` and the backward outside
  it, as eager code writes it (``with autocast: loss = loss_fn(model(x), y)``;
  ``loss.backward()``). make_fx records the casts autocast inserts, so the program holds
  eager autocast's casts and ops, and their backward the casts back.
* O2 (FSDP2's ``MixedPrecisionPolicy``): each floating parameter is cast to the half dtype at
  the top of the step and the model reads the cast (the fp32 parameters stay the master
  weights the optimizer updates); floating batch tensors are cast to the half dtype and
  floating model outputs back to fp32, so the loss is computed in fp32 (as Megatron does).
  The backward runs in half and each gradient reaches its fp32 parameter through the cast's
  backward. Buffers stay as they are.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

__all__ = ["Precision", "FULL_PRECISION", "device_type"]

LEVELS = ("off", "O1", "O2")


@dataclass(frozen=True)
class Precision:
    """Mixed precision for one captured step: the half ``dtype`` and the ``level`` (off:
    every op as the model writes it)."""

    dtype: torch.dtype
    level: str
    master: torch.dtype = torch.float32    # the dtype O2 casts model outputs back to

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"mixed precision level {self.level!r} is not one of {LEVELS}")
        narrow = self.dtype.is_floating_point and self.dtype.itemsize < self.master.itemsize
        if self.level != "off" and not narrow:
            raise ValueError(f"mixed precision dtype {self.dtype} is not a half dtype "
                             f"narrower than {self.master}")

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """O1: autocast to the half dtype on ``device_type`` (the batch's device)."""
        if self.level != "O1":
            yield
            return
        with torch.autocast(device_type, dtype=self.dtype):
            yield

    def params(self, values: dict[str, torch.Tensor],
               traced_in: Callable[[str], contextlib.AbstractContextManager]
               ) -> dict[str, torch.Tensor]:
        """O2: what the model reads for each parameter: its floating ones cast to the half
        dtype, each cast traced in ``traced_in(name)`` (so it is recorded under the
        parameter's module)."""
        if self.level != "O2":
            return values
        out = {}
        for name, value in values.items():
            with traced_in(name):
                out[name] = self._narrow(value)
        return out

    def inputs(self, leaves: list[Any]) -> list[Any]:
        """O2: floating batch tensors in the half dtype."""
        return [self._narrow(x) for x in leaves] if self.level == "O2" else leaves

    def outputs(self, out: Any) -> Any:
        """O2: floating model outputs back in the master dtype, before the loss."""
        if self.level != "O2":
            return out
        return pytree.tree_map_only(torch.Tensor, self._widen, out)

    def _narrow(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def _widen(self, x: torch.Tensor) -> torch.Tensor:
        narrower = x.is_floating_point() and x.dtype.itemsize < self.master.itemsize
        return x.to(self.master) if narrower else x


FULL_PRECISION = Precision(torch.float32, "off")


def device_type(tensors: list[Any]) -> str:
    """The device autocast applies to: the first tensor's (a batch's or a parameter's)."""
    return next((x.device.type for x in tensors if isinstance(x, torch.Tensor)), "cpu")

"""Numbers a step makes on the device, read on the host only when someone looks.

Reading a GPU tensor's value waits for every kernel queued before it; a loop that reads
each step's loss at once keeps the device idle while the host prepares the next step. A
``Reading`` starts a non-blocking copy of the scalar into pinned host memory as the step
ends and waits for that copy alone when its value is asked for. ``History`` is the
engine's ``history``: the per-step values join it when anyone reads it, and at the log
points ``fit`` flushes it (``log_freq``), as torchtitan reads its loss at log steps.
``StepLogs`` hands a step's readings to callbacks the same way: a callback that reads the
loss every step asks for a sync every step, and pays it; the others do not.
On the CPU a value is there at once, and nothing changes.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["Reading", "History", "StepLogs"]


class Reading:
    """One scalar tensor's value, copied to the host without blocking."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self._done = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tensor
        self._value: float | None = None

    def value(self) -> float:
        if self._value is None:
            if self._done is not None:
                self._done.synchronize()
            self._value = self._host.item()
        return self._value


class History(dict):
    """Lists of values by name; readings ``add``ed join their lists in order when the
    history is read (any read: an item, a key, a copy) or ``settle``d."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[str, Reading]] = []

    def add(self, name: str, reading: Reading) -> None:
        self._pending.append((name, reading))

    def settle(self) -> None:
        pending, self._pending = self._pending, []
        for name, reading in pending:
            super().setdefault(name, []).append(reading.value())

    def __getitem__(self, key: str) -> Any:
        self.settle()
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[str]:
        self.settle()
        return super().__iter__()

    def __contains__(self, key: object) -> bool:
        self.settle()
        return super().__contains__(key)

    def __len__(self) -> int:
        self.settle()
        return super().__len__()

    def __repr__(self) -> str:
        self.settle()
        return super().__repr__()

    def __eq__(self, other: object) -> bool:
        self.settle()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def get(self, key: str, default: Any = None) -> Any:
        self.settle()
        return super().get(key, default)

    def keys(self):
        self.settle()
        return super().keys()

    def values(self):
        self.settle()
        return super().values()

    def items(self):
        self.settle()
        return super().items()

    def copy(self) -> dict:
        self.settle()
        return dict(super().items())

    def setdefault(self, key: str, default: Any = None) -> Any:
        if any(name == key for name, _ in self._pending):   # another key's wait no read
            self.settle()
        return super().setdefault(key, default)


class StepLogs(MutableMapping):
    """A step's logs for callbacks (which may add to them); a reading's value is read when
    a callback reads it."""

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        return value.value() if isinstance(value, Reading) else value

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def copy(self) -> dict[str, Any]:
        return dict(self.items())

    def __repr__(self) -> str:
        return repr(self.copy())

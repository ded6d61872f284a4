"""Gradient merge's cycle, run: lowering made a training step of ``k_steps`` batches as a
pair of programs (``Lowered.accumulating`` for the first k-1 batches, the step itself for
the k-th); the runtime steps through them by the batch's index in the run, so the cycle
continues across batch shapes, ``fit`` calls and resumed runs alike."""
from __future__ import annotations

from typing import Any

from ..ir import Slot
from ..lower.executable import Lowered
from .executor import Executor

__all__ = ["CycleExecutor"]


class CycleExecutor:
    """Runs ``accumulate`` or ``apply`` (executors of the pair's programs) for each batch."""

    def __init__(self, lowered: Lowered, accumulate: Executor, apply: Executor):
        self.lowered, self.accumulate, self.apply = lowered, accumulate, apply
        self.last: Any = apply

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        self.last = self.apply if self.lowered.steps_optimizer(batch) else self.accumulate
        return self.last.run(feeds, seed, batch)

    # a pipeline's reports are the last run program's
    def peaks(self) -> list[int]:
        return self.last.peaks()

    def keep_trace(self) -> None:
        self.accumulate.keep_trace()
        self.apply.keep_trace()

    def trace_events(self) -> list[tuple[int, str, float, float]]:
        return self.last.trace_events()

"""The executor's overhead per op: what autopar adds per op on top of the aten call the
compute curves already include.

A generated program (``runtime.codegen.generate``, as every step runs) of many tiny adds,
per op, minus the same add called directly.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..ir import Op, OpKind, Program, Slot, StateKey, TensorType, Value
from ..ir.attrs import NAME, SLOTS, STATE
from ..runtime.codegen import generate
from .settings import Settings
from .timing import CPU, kernel

__all__ = ["executor_overhead"]


def _tiny_add_program(ops: int) -> Program:
    """``ops`` chained adds of a 16-element input and a state tensor, as capture makes them."""
    value = TensorType((16,), torch.float32)
    x = Op(OpKind.INPUT, "input", outputs=[Value(value)], attrs={NAME: "x"})
    w = Op(OpKind.STATE, "state", outputs=[Value(value)],
           attrs={STATE: StateKey.of_param("w"), NAME: "w"})
    program, last = Program(), x.outputs[0]
    program.add(x)
    program.add(w)
    for _ in range(ops):
        op = program.add(Op(OpKind.CALL, "aten.add.Tensor", args=(last, w.outputs[0]),
                            outputs=[Value(value)]))
        last = op.outputs[0]
    program.add(Op(OpKind.OUTPUT, "output", args=(last,),
                   attrs={SLOTS: (Slot("output", "0"),)}))
    return program


def executor_overhead(settings: Settings, device: torch.device = CPU) -> tuple[float, float]:
    """(executor seconds per tiny op, the same op called directly): batches of the two
    interleaved, so a load that comes and goes shifts both alike; medians. Host time on
    every device: what the executor adds is host work (on CUDA, the time to launch)."""
    ops = settings.overhead_ops
    fn, _ = generate(_tiny_add_program(ops))
    feeds = {"x": torch.randn(16, device=device)}
    state = {"w": torch.randn(16, device=device)}
    add, x, w = kernel("aten.add.Tensor"), feeds["x"], state["w"]
    fn(feeds, state)
    start = time.perf_counter()
    fn(feeds, state)
    calls = max(1, round(settings.batch_s / max(time.perf_counter() - start, 1e-7)))
    program, direct = [], []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(feeds, state)
        middle = time.perf_counter()
        for _ in range(calls * ops):
            add(x, w)
        program.append((middle - start) / (calls * ops))
        direct.append((time.perf_counter() - middle) / (calls * ops))
    return statistics.median(program), statistics.median(direct)

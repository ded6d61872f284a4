"""A program's generated function through ``torch.compile`` (``compile:`` in the strategy,
``lower.executable.CompileSpec``): the serial step, a rank's program, a pipeline job's (or
segment's, ``pipeline_process``).

The generated function (``codegen.generate(traceable=True)``) calls each op's ``OpOverload``
and the optimizer kernels' torch.optim functional code, so Dynamo captures the whole step,
forward, backward and update, as one graph. Compiling happens at the first call (and again
when a guard fails, e.g. a learning rate that moves: the second value makes it dynamic);
the time it takes is counted (``CompiledStep.compile_s``) for the engine to report.

Random ops keep drawing what they draw uncompiled: Inductor runs them as the ATen kernels
on the generator the runtime forked for the step (``fallback_random``), in program order
(where the program sets the generator, the draw takes the state: ``codegen``). A program
that communicates keeps its collectives where the passes put them (``in_program_order``).

With ``debug.dump_dir``, the code Inductor made for each program (every graph it compiled,
in order) is written next to the program's dump (``NN_compiled_program.py``, one per
pipeline job): where each collective starts and where it is waited for, among the
kernels.

A step whose optimizer may skip it (loss scaling's ``found_inf``) runs uncompiled while a
state its update reads is still absent (SGD's momentum buffers before their first step):
torch makes a buffer from the step's gradient, and a skipped step must leave it absent, which
a graph that cannot read the flag on the host has no tensor to say. Uncompiled, the kernel
reads the flag as eager ``GradScaler.step`` does; from the first step that made the buffers
the program runs compiled (one graph, not one more for the absent buffers).

A program the compiler refuses is an error naming the op of the failing line of the
generated code (its target, module and role) and where the dumps are, or with
``fallback: eager`` a warning saying why, and the program runs uncompiled from then on.
"""
from __future__ import annotations

import contextlib
import heapq
import os
import re
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch._inductor.graph import GraphLowering

from ..ir import Op, OpKind, Program
from ..ir.attrs import NAME
from ..lower.executable import CompileSpec

__all__ = ["CompiledStep", "CompileError", "CompileNote", "not_compiled"]


class CompileError(RuntimeError):
    """A program ``torch.compile`` could not compile (``compile: {fallback: error}``)."""


class CompileNote(UserWarning):
    """A program that runs uncompiled (``compile: {fallback: eager}``), and why."""


class CompiledStep:
    """``fn`` compiled on its first call; a drop-in for it."""

    def __init__(self, fn: Callable, source: str, program: Program, spec: CompileSpec,
                 where: str, name: str = "program", process: int = 0):
        self.eager, self.source, self.program = fn, source, program
        self.spec, self.where = spec, where
        self.dump = None if spec.dump is None else spec.dump.format(process=process, name=name)
        self.code: list[str] = []           # Inductor's code of each graph, when dumped
        self.compile_s = 0.0
        if spec.cache_dir is not None:      # where Inductor keeps compiled graphs on disk
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(spec.cache_dir)
        options = _inductor_options(program) if spec.backend == "inductor" else None
        self.fn = torch.compile(fn, backend=spec.backend, mode=_mode(spec),
                                options=options, fullgraph=True)
        self.skipped_states = _states_of_skippable_updates(program)

    def __call__(self, feeds: dict[str, Any], state: dict[str, Any], *carried: Any) -> tuple:
        if any(state.get(name, ()) is None for name in self.skipped_states):
            # a skippable update that would make a state (module docstring): uncompiled
            return self.eager(feeds, state, *carried)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            with self._keeping_code():
                out = self.fn(feeds, state, *carried)
        except torch._dynamo.exc.TorchDynamoException as err:
            # tracing or compiling failed, before the step ran (errors of the step itself
            # pass through as they would uncompiled)
            return self._refused(err, feeds, state, *carried)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames:
            self.compile_s += time.perf_counter() - start   # this call compiled a graph
        return out

    @contextlib.contextmanager
    def _keeping_code(self) -> Iterator[None]:
        """Collect the code of any graph Inductor compiles (or loads from its cache) in the
        body, and write it to the dump."""
        if self.dump is None:
            yield
            return
        made: list[str] = []
        with mock.patch.object(GraphLowering, "save_output_code", made.append):
            yield
        if made:
            self.code += made
            path = Path(self.dump)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"# ---- graph {i} of {self.where} ----\n{code}\n"
                                    for i, code in enumerate(self.code)))

    def _refused(self, err: Exception, feeds: dict[str, Any], state: dict[str, Any],
                 *carried: Any) -> tuple:
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        op = _failing_op(err, self.source, self.program)
        what = (f"op {op.target} ({op.module or 'top level'}, role {op.role.value})"
                if op is not None else "the program")
        text = (f"compile ({self.spec.backend}, mode {self.spec.mode}) of {self.where} "
                f"failed at {what}: {why}; the program is the rank's last dump "
                "(NN_partition.txt, or NN_jobs.txt, under debug.dump_dir)")
        if self.spec.fallback != "eager":
            raise CompileError(text + "; compile: {fallback: eager} runs it uncompiled "
                               "instead") from err
        warnings.warn(text + "; it runs uncompiled (compile: {fallback: eager})", CompileNote,
                      stacklevel=3)
        self.fn = self.eager
        return self.eager(feeds, state, *carried)


def not_compiled(spec: CompileSpec, where: str, why: str) -> None:
    """A program this version does not compile yet: an error, or with ``fallback: eager`` a
    warning (the caller runs it uncompiled)."""
    text = f"compile: {where} is not compiled: {why}"
    if spec.fallback != "eager":
        raise CompileError(text + "; compile: {fallback: eager} runs it uncompiled")
    warnings.warn(text + "; it runs uncompiled (compile: {fallback: eager})", CompileNote,
                  stacklevel=3)


def _states_of_skippable_updates(program: Program) -> frozenset[str]:
    """The states read by the optimizer updates that loss scaling may skip (the ops given a
    ``found_inf``); one of them absent (None) makes the step run uncompiled."""
    return frozenset(
        value.producer.attrs[NAME] for op in program.ops
        if op.kind is OpKind.CALL and op.kwargs.get("found_inf") is not None
        for value in op.inputs
        if value.producer is not None and value.producer.kind is OpKind.STATE)


def _inductor_options(program: Program) -> dict[str, Any]:
    """Random ops draw as they do uncompiled (the ATen kernels on the forked generator, in
    program order); a program that communicates keeps what our passes placed: each
    collective starts as soon as its input is ready and is waited for only where its result
    is first read, with the compute between them (Inductor's own order would start a
    bucket's all-reduce next to its wait)."""
    options: dict[str, Any] = {"fallback_random": True}
    if any(op.kind is OpKind.COMM for op in program.ops):
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = [in_program_order]
    return options


def in_program_order(nodes: list) -> list:
    """Inductor's scheduled nodes (kernels, collectives, waits) in the order of the program
    they came from, as far as their dependencies allow: each collective starts where our
    passes started it and is waited for where they waited (Inductor's own order moves
    them; its ``raise_comms`` would start every ZeRO-3 gather at the top, holding every
    parameter whole). A node fused from several ops goes where its first op was."""
    position = {node: _first_origin(node) for node in nodes}
    producer = {name: node for node in nodes for name in node.get_buffer_names()}
    waiting = {node: {d.name for d in node.unmet_dependencies if d.name in producer}
               for node in nodes}
    readers: dict[str, list] = {}
    for node, names in waiting.items():
        for name in names:
            readers.setdefault(name, []).append(node)
    ready = [(position[n], i, n) for i, n in enumerate(nodes) if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for name in node.get_buffer_names():
            for reader in readers.get(name, ()):
                waiting[reader].discard(name)
                if not waiting[reader]:
                    heapq.heappush(ready, (position[reader], nodes.index(reader), reader))
    if len(order) != len(nodes):      # a dependency we did not see: keep Inductor's order
        return nodes
    return order


def _first_origin(node) -> int:
    """The position in its graph of the first op ``node`` was made from."""
    origins = [o for part in node.get_nodes() if part.node is not None
               for o in part.node.origins]
    if not origins:
        return 1 << 62
    graph = origins[0].graph
    index = _GRAPH_ORDER.get(id(graph))
    if index is None or index[0] is not graph:
        index = _GRAPH_ORDER[id(graph)] = (graph, {n: i for i, n in enumerate(graph.nodes)})
    return min(index[1].get(o, 1 << 62) for o in origins)


_GRAPH_ORDER: dict[int, tuple[Any, dict]] = {}


def _mode(spec: CompileSpec) -> str | None:
    return None if spec.mode == "default" or spec.backend != "inductor" else spec.mode


def _failing_op(err: Exception, source: str, program: Program) -> Op | None:
    """The op whose line of the generated code the failure points at (the generated
    function's statements follow the program's ops, one per line, results named ``v<i>``)."""
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__)
             if frame.filename.startswith("<autopar")]
    text = " ".join(str(a) for a in (err, err.__cause__) if a is not None)
    lines += [int(n) for n in re.findall(r'"<autopar [^>]*>", line (\d+)', text)]
    code = source.splitlines()
    for line in reversed(lines):
        if 0 < line <= len(code):
            found = _op_defining(code[line - 1], program)
            if found is not None:
                return found
    return None


def _op_defining(line: str, program: Program) -> Op | None:
    made = re.match(r"\s*(v\d+)", line)
    if made is None:
        return None
    index = int(made.group(1)[1:])
    values = [v for op in program.ops for v in op.outputs]
    return values[index].producer if index < len(values) else None

"""A rank program's generated function through ``torch.compile`` (``compile:`` in the
strategy, ``lower.executable.CompileSpec``).

The generated function (``codegen.generate(traceable=True)``) calls each op's ``OpOverload``
and the optimizer kernels' torch.optim functional code, so Dynamo captures the whole step,
forward, backward and update, as one graph. Compiling happens at the first call (and again
when a guard fails, e.g. a learning rate that moves: the second value makes it dynamic);
the time it takes is counted (``CompiledStep.compile_s``) for the engine to report.

Random ops keep drawing what they draw uncompiled: Inductor runs them as the ATen kernels
on the generator the runtime forked for the step (``fallback_random``), in program order.

A program the compiler refuses is an error naming the op of the failing line of the
generated code (its target, module and role) and where the dumps are, or with
``fallback: eager`` a warning saying why, and the program runs uncompiled from then on.
"""
from __future__ import annotations

import os
import re
import time
import traceback
import warnings
from typing import Any, Callable

import torch

from ..ir import Op, Program
from ..lower.executable import CompileSpec

__all__ = ["CompiledStep", "CompileError", "CompileNote", "not_compiled"]


class CompileError(RuntimeError):
    """A program ``torch.compile`` could not compile (``compile: {fallback: error}``)."""


class CompileNote(UserWarning):
    """A program that runs uncompiled (``compile: {fallback: eager}``), and why."""


class CompiledStep:
    """``fn`` compiled on its first call; a drop-in for it."""

    def __init__(self, fn: Callable, source: str, program: Program, spec: CompileSpec,
                 where: str):
        self.eager, self.source, self.program = fn, source, program
        self.spec, self.where = spec, where
        self.compile_s = 0.0
        if spec.cache_dir is not None:      # where Inductor keeps compiled graphs on disk
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(spec.cache_dir)
        options = {"fallback_random": True} if spec.backend == "inductor" else None
        self.fn = torch.compile(fn, backend=spec.backend, mode=_mode(spec),
                                options=options, fullgraph=True)
        self._seen = 0

    def __call__(self, feeds: dict[str, Any], state: dict[str, Any], *carried: Any) -> tuple:
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            out = self.fn(feeds, state, *carried)
        except torch._dynamo.exc.TorchDynamoException as err:
            # tracing or compiling failed, before the step ran (errors of the step itself
            # pass through as they would uncompiled)
            return self._refused(err, feeds, state, *carried)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames:
            self.compile_s += time.perf_counter() - start   # this call compiled a graph
        return out

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

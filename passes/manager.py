"""The ordered list of passes and the loop that runs them: check each pass's declared needs,
time it, verify the program after it (debug), and dump each rank's program after it to
``<dump_dir>/rank<r>/<NN>_<pass>.txt``.

A pass is a plain function ``(program, ctx) -> program`` with a name, the facts it needs
(``Fact``: made by an earlier pass) and the facts it makes. A pass that needs a fact no
earlier pass made fails before it runs, naming the pass that makes it; so disabling a pass
(``PassManager(disabled=...)``) is refused where a later pass depends on it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..ir import Program, format_program, verify
from .assign_phases import assign_phases
from .bucket_collectives import bucket_collectives
from .clip_grad import clip_grad
from .completion import completion
from .context import Fact, FactError, PassContext
from .dead_code import dead_code
from .decompose_loss import decompose_loss
from .expert_parallel import expert_parallel
from .explain import format_explanations
from .fold_noops import fold_noops
from .functionalize_writes import functionalize_writes
from .gradient_reduce_dtype import format_casts, gradient_reduce_dtype
from .join_gradients import join_gradients
from .lower_optimizer import lower_optimizer
from .merge_gradients import merge_gradients
from .pin_annotations import pin_annotations
from .prefetch_gathers import prefetch_gathers
from .recompute import format_recompute, recompute
from .regather_for_backward import regather_for_backward
from .regroup_flattens import regroup_flattens
from .reshard import reshard
from .scale_loss import scale_loss
from .scatter_gradients_early import scatter_gradients_early
from .schedule_pipeline import format_schedule, schedule_pipeline
from .sequence_parallel import sequence_parallel
from .settle_mesh import settle_mesh
from .shard_batch import shard_batch
from .skip_nonfinite_steps import skip_nonfinite_steps
from .split_stages import split_stages
from .sync_batch_norm import sync_batch_norm
from .tensor_parallel_plan import tensor_parallel_plan
from .vocab_parallel_loss import vocab_parallel_loss
from .zero_sharding import zero_sharding

PassFn = Callable[[Program, PassContext], Program]
Report = Callable[[Program, PassContext], str]


def _explanations(program: Program, ctx: PassContext) -> str:
    return format_explanations(program) if ctx.state.mesh is not None else ""


@dataclass(frozen=True)
class Pass:
    name: str
    run: PassFn
    needs: frozenset[Fact] = frozenset()
    makes: frozenset[Fact] = frozenset()
    # extra dumps next to the program, ``NN_<name>.<suffix>.txt`` (skipped when empty)
    reports: tuple[tuple[str, Report], ...] = ()


def _pass(name: str, run: PassFn, needs: tuple[Fact, ...] = (), makes: tuple[Fact, ...] = (),
          reports: tuple[tuple[str, Report], ...] = ()) -> Pass:
    return Pass(name, run, frozenset(needs), frozenset(makes), reports)


F = Fact
# The passes, in order; lowering (``autopar.lower``) makes each rank's program from the result.
PIPELINE: tuple[Pass, ...] = (
    _pass("decompose_loss", decompose_loss),
    _pass("fold_noops", fold_noops),
    _pass("functionalize_writes", functionalize_writes),
    _pass("dead_code", dead_code),
    _pass("scale_loss", scale_loss),
    _pass("clip_grad", clip_grad),
    _pass("lower_optimizer", lower_optimizer, makes=(F.OPTIMIZER,)),
    _pass("skip_nonfinite_steps", skip_nonfinite_steps, needs=(F.OPTIMIZER,)),
    _pass("vocab_parallel_loss", vocab_parallel_loss),
    _pass("sync_batch_norm", sync_batch_norm),
    _pass("settle_mesh", settle_mesh, makes=(F.MESH,)),
    _pass("pin_annotations", pin_annotations, needs=(F.MESH,)),
    _pass("tensor_parallel_plan", tensor_parallel_plan, needs=(F.MESH,)),
    _pass("expert_parallel", expert_parallel, needs=(F.MESH,)),
    _pass("zero_sharding", zero_sharding, needs=(F.MESH,)),
    _pass("sequence_parallel", sequence_parallel, needs=(F.MESH,)),
    _pass("shard_batch", shard_batch, needs=(F.MESH,)),
    _pass("split_stages", split_stages, needs=(F.MESH,), makes=(F.STAGES,)),
    _pass("regroup_flattens", regroup_flattens, needs=(F.MESH,)),
    _pass("completion", completion, needs=(F.MESH,), makes=(F.PLACED,),
          reports=(("explain", _explanations),)),
    _pass("gradient_reduce_dtype", gradient_reduce_dtype, needs=(F.PLACED,),
          reports=(("amp", format_casts),)),
    _pass("merge_gradients", merge_gradients, needs=(F.OPTIMIZER, F.PLACED)),
    _pass("reshard", reshard, needs=(F.PLACED,), makes=(F.RESHARDED,)),
    _pass("recompute", recompute, needs=(F.RESHARDED,),
          reports=(("recompute", format_recompute),)),
    _pass("bucket_collectives", bucket_collectives, needs=(F.RESHARDED, F.STAGES)),
    _pass("regather_for_backward", regather_for_backward, needs=(F.RESHARDED,),
          reports=(("explain", _explanations),)),
    _pass("prefetch_gathers", prefetch_gathers, needs=(F.RESHARDED,)),
    _pass("scatter_gradients_early", scatter_gradients_early, needs=(F.RESHARDED,)),
    _pass("join_gradients", join_gradients, needs=(F.RESHARDED, F.STAGES)),
    _pass("assign_phases", assign_phases, needs=(F.RESHARDED, F.STAGES), makes=(F.PHASES,)),
    _pass("schedule_pipeline", schedule_pipeline, needs=(F.PHASES,), makes=(F.SCHEDULE,),
          reports=(("jobs", format_schedule),)),
)


@dataclass
class PassManager:
    passes: tuple[Pass, ...] = PIPELINE
    verify: bool = True
    dump_dir: str | None = None
    disabled: frozenset[str] = frozenset()
    timings: dict[str, float] = field(default_factory=dict)
    dumped: list[Path] = field(default_factory=list)

    def run(self, program: Program, ctx: PassContext) -> Program:
        unknown = self.disabled - {p.name for p in self.passes}
        if unknown:
            raise ValueError(f"cannot disable unknown passes {sorted(unknown)}; passes are "
                             f"{[p.name for p in self.passes]}")
        self._check(program, "capture", ctx, 0)
        for number, p in enumerate(self.passes, start=1):
            if p.name in self.disabled:
                continue
            self._check_needs(p, ctx)
            start = time.perf_counter()
            try:
                program = p.run(program, ctx)
            except Exception as exc:
                exc.add_note(f"autopar: while running pass '{p.name}' (rank {ctx.inputs.rank}, "
                             f"mode {ctx.mode})")
                raise
            self.timings[p.name] = time.perf_counter() - start
            ctx.state.check_made(p.makes, p.name)
            ctx.state.made |= p.makes
            self._check(program, p.name, ctx, number, p.reports)
        self._dump_timings(ctx)
        return program

    def _check_needs(self, p: Pass, ctx: PassContext) -> None:
        missing = p.needs - ctx.state.made
        if not missing:
            return
        makers = {f: [q.name for q in self.passes if f in q.makes] for f in missing}
        why = "; ".join(
            f"{f.value!r}, made by {' or '.join(makers[f]) or 'no pass'}"
            + (" (disabled)" if any(m in self.disabled for m in makers[f]) else "")
            for f in sorted(missing, key=lambda f: f.value))
        raise FactError(f"pass '{p.name}' needs {why}")

    def _prefix(self, ctx: PassContext) -> str:
        return ctx.inputs.dump_prefix

    def _dump_timings(self, ctx: PassContext) -> None:
        if self.dump_dir is None:
            return
        lines = [f"{name:<24} {seconds * 1e3:9.2f} ms" for name, seconds in self.timings.items()]
        path = Path(self.dump_dir) / f"rank{ctx.inputs.rank}" / f"{self._prefix(ctx)}timings.txt"
        path.write_text("\n".join(lines) + "\n")

    def _check(self, program: Program, name: str, ctx: PassContext, number: int,
               reports: tuple[tuple[str, Report], ...] = ()) -> None:
        if self.verify:
            try:
                verify(program)
            except Exception as exc:
                exc.add_note(f"autopar: the program is invalid after pass '{name}'")
                raise
        if self.dump_dir is not None:
            path = (Path(self.dump_dir) / f"rank{ctx.inputs.rank}"
                    / f"{self._prefix(ctx)}{number:02d}_{name}.txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(format_program(program))
            self.dumped.append(path)
            for suffix, report in reports:
                text = report(program, ctx)
                if text:
                    extra = path.with_name(f"{path.stem}.{suffix}.txt")
                    extra.write_text(text)
                    self.dumped.append(extra)

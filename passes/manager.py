"""The ordered list of passes and the loop that runs them: time each, verify between them
(debug), dump each rank's program after each to ``<dump_dir>/rank<r>/<NN>_<pass>.txt``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..ir import Program, format_program, verify
from .annotate import annotate
from .clip_grad import clip_grad
from .completion import completion
from .context import PassContext
from .dead_code import dead_code
from .decompose_loss import decompose_loss
from .explain import format_explanations
from .fold_noops import fold_noops
from .join_gradients import join_gradients
from .lower_optimizer import lower_optimizer
from .bucket_collectives import bucket_collectives
from .pipeline_jobs import pipeline_jobs
from .reshard import reshard
from .schedule import format_schedule, schedule
from .split_stages import split_stages
from .vocab_parallel_loss import vocab_parallel_loss

PassFn = Callable[[Program, PassContext], Program]
Report = Callable[[Program, PassContext], str]


def _explanations(program: Program, ctx: PassContext) -> str:
    return format_explanations(program) if ctx.mesh is not None else ""


@dataclass(frozen=True)
class Pass:
    name: str
    run: PassFn
    # extra dumps next to the program, ``NN_<name>.<suffix>.txt`` (skipped when empty)
    reports: tuple[tuple[str, Report], ...] = ()


# The passes, in order; each rank's local program (partition) and a pipeline's jobs are cut
# from the result.
PIPELINE: tuple[Pass, ...] = (
    Pass("decompose_loss", decompose_loss),
    Pass("fold_noops", fold_noops),
    Pass("dead_code", dead_code),
    Pass("clip_grad", clip_grad),
    Pass("lower_optimizer", lower_optimizer),
    Pass("vocab_parallel_loss", vocab_parallel_loss),
    Pass("annotate", annotate),
    Pass("split_stages", split_stages),
    Pass("completion", completion, reports=(("explain", _explanations),)),
    Pass("reshard", reshard),
    Pass("bucket_collectives", bucket_collectives),
    Pass("join_gradients", join_gradients),
    Pass("pipeline_jobs", pipeline_jobs),
    Pass("schedule", schedule, reports=(("jobs", format_schedule),)),
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
            start = time.perf_counter()
            try:
                program = p.run(program, ctx)
            except Exception as exc:
                exc.add_note(f"autopar: while running pass '{p.name}' (rank {ctx.rank}, "
                             f"mode {ctx.mode})")
                raise
            self.timings[p.name] = time.perf_counter() - start
            self._check(program, p.name, ctx, number, p.reports)
        self._dump_timings(ctx)
        return program

    def _dump_timings(self, ctx: PassContext) -> None:
        if self.dump_dir is None:
            return
        prefix = "" if ctx.mode == "train" else f"{ctx.mode}_"
        lines = [f"{name:<24} {seconds * 1e3:9.2f} ms" for name, seconds in self.timings.items()]
        path = Path(self.dump_dir) / f"rank{ctx.rank}" / f"{prefix}timings.txt"
        path.write_text("\n".join(lines) + "\n")

    def dump_rank_program(self, program: Program, name: str, rank: int,
                          ctx: PassContext) -> None:
        """Check and dump one rank's program made after the pipeline (its partition),
        numbered after the last pass."""
        self._check(program, name, ctx, len(self.passes) + 1, rank=rank)

    def dump_rank_text(self, text: str, name: str, rank: int, ctx: PassContext) -> None:
        """Dump what was made of one rank after the passes (a pipeline rank's jobs),
        numbered after the last pass."""
        if self.dump_dir is None:
            return
        prefix = "" if ctx.mode == "train" else f"{ctx.mode}_"
        number = len(self.passes) + 1
        path = Path(self.dump_dir) / f"rank{rank}" / f"{prefix}{number:02d}_{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.dumped.append(path)

    def _check(self, program: Program, name: str, ctx: PassContext, number: int,
               reports: tuple[tuple[str, Report], ...] = (), rank: int | None = None) -> None:
        if self.verify:
            try:
                verify(program)
            except Exception as exc:
                exc.add_note(f"autopar: the program is invalid after pass '{name}'")
                raise
        if self.dump_dir is not None:
            prefix = "" if ctx.mode == "train" else f"{ctx.mode}_"
            rank = ctx.rank if rank is None else rank
            path = Path(self.dump_dir) / f"rank{rank}" / f"{prefix}{number:02d}_{name}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(format_program(program))
            self.dumped.append(path)
            for suffix, report in reports:
                text = report(program, ctx)
                if text:
                    extra = path.with_name(f"{path.stem}.{suffix}.txt")
                    extra.write_text(text)
                    self.dumped.append(extra)

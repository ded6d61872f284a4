"""The loop that runs an ordered list of passes (``autopar.passes.PIPELINE``): check each
pass's declared needs, time it, verify the program after it (debug), and dump each rank's
program after it to ``<dump_dir>/rank<r>/<NN>_<pass>.txt``.

A pass is a plain function ``(program, ctx) -> program`` with a name, the facts it needs
(``Fact``: made by an earlier pass), the facts it makes and the strategy sections it
implements. A pass that needs a fact no earlier pass made fails before it runs, naming the
pass that makes it; so disabling a pass (``PassManager(disabled=...)``) is refused where a
later pass depends on it. The sections a plan can honour are those its passes implement
(``PassManager.sections``): a new strategy section comes with the pass that implements it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..ir import Program, format_program, verify
from .context import Fact, FactError, PassContext

PassFn = Callable[[Program, PassContext], Program]
Report = Callable[[Program, PassContext], str]


@dataclass(frozen=True)
class Pass:
    """A pass: its name, its function, the facts it needs and makes, the strategy sections
    it implements (the engine refuses an enabled section no pass implements), and extra
    dumps next to the program (``NN_<name>.<suffix>.txt``, skipped when empty)."""

    name: str
    run: PassFn
    needs: frozenset[Fact] = frozenset()
    makes: frozenset[Fact] = frozenset()
    implements: frozenset[str] = frozenset()
    reports: tuple[tuple[str, Report], ...] = ()


def make_pass(name: str, run: PassFn, needs: tuple[Fact, ...] = (),
              makes: tuple[Fact, ...] = (), implements: tuple[str, ...] = (),
              reports: tuple[tuple[str, Report], ...] = ()) -> Pass:
    return Pass(name, run, frozenset(needs), frozenset(makes), frozenset(implements), reports)


@dataclass
class PassManager:
    passes: tuple[Pass, ...]
    verify: bool = True
    dump_dir: str | None = None
    disabled: frozenset[str] = frozenset()
    timings: dict[str, float] = field(default_factory=dict)
    dumped: list[Path] = field(default_factory=list)

    @property
    def sections(self) -> frozenset[str]:
        """The strategy sections the enabled passes implement."""
        return frozenset(section for p in self.passes if p.name not in self.disabled
                         for section in p.implements)

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

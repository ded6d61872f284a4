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

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..ir import Program, format_program, verify
from .context import Fact, FactError, PassContext
from .dump_dot import program_dot
from .dump_html import PassView, StableNames, plan_html, snapshot

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
    dump_formats: tuple[str, ...] = ("text",)     # of ``debug.dump_format``
    timings: dict[str, float] = field(default_factory=dict)
    dumped: list[Path] = field(default_factory=list)
    views: list[PassView] = field(default_factory=list)   # for the html page
    stable_names: StableNames = field(default_factory=StableNames)

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
        self.views, self.stable_names = [], StableNames()    # the page is of this run
        try:
            program = self._run(program, ctx)
        except Exception as exc:
            self._dump_html(ctx, f"{type(exc).__name__}: {exc}")
            raise
        self._dump_timings(ctx)
        self._dump_html(ctx)
        return program

    def _run(self, program: Program, ctx: PassContext) -> Program:
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
            _stamp_reasons(program, p.name)
            self._check(program, p.name, ctx, number, p.reports)
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
            self._dump(program, name, ctx, number, reports)

    def _dump(self, program: Program, name: str, ctx: PassContext, number: int,
              reports: tuple[tuple[str, Report], ...]) -> None:
        """The program after pass ``name`` in each format asked for (the text made once)."""
        path = (Path(self.dump_dir) / f"rank{ctx.inputs.rank}"
                / f"{self._prefix(ctx)}{number:02d}_{name}.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = format_program(program) if {"text", "html"} & set(self.dump_formats) else ""
        if "text" in self.dump_formats:
            self._write(path, text)
            for suffix, report in reports:
                extra = report(program, ctx)
                if extra:
                    self._write(path.with_name(f"{path.stem}.{suffix}.txt"), extra)
        if "dot" in self.dump_formats:
            self._write(path.with_suffix(".dot"), program_dot(program, f"{path.stem}: the "
                                                          f"program after pass {name}"))
        if "html" in self.dump_formats:
            self.views.append(snapshot(program, number, name, text, self.timings.get(name),
                                       self.stable_names))

    def _write(self, path: Path, text: str) -> None:
        path.write_text(text)
        self.dumped.append(path)

    def _dump_html(self, ctx: PassContext, failure: str | None = None) -> None:
        """``<prefix>plan.html``: the page of every pass dumped so far (also when a pass
        failed: the passes before it are what one debugs the failure with)."""
        if self.dump_dir is None or "html" not in self.dump_formats or not self.views:
            return
        path = Path(self.dump_dir) / f"rank{ctx.inputs.rank}" / f"{self._prefix(ctx)}plan.html"
        step = "accumulating " if ctx.inputs.accumulate_only else ""
        title = (f"autopar plan: the {step}{ctx.mode} step, rank {ctx.inputs.rank}, "
                 f"{ctx.inputs.mesh or 'no mesh (serial)'}")
        self._write(path, plan_html(self.views, title, failure))


def _stamp_reasons(program: Program, name: str) -> None:
    """Name pass ``name`` on every placement reason it recorded (one with no pass yet), so
    explain can say which pass decided a placement."""
    for op in program.ops:
        for v in op.outputs:
            if v.why is not None and not v.why.made_by:
                v.why = dataclasses.replace(v.why, made_by=name)

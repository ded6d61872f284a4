"""Offline planning of an unmodified training script: ``python -m autopar plan train.py``.

The CLI opens a planning session and runs the script in this process. Every Engine the
script builds joins the session (optionally with the CLI's strategy and dump dir); the first
``fit`` / ``evaluate`` / ``predict`` step plans its program for the whole mesh, writes the
dumps and stops the script. No launcher, no processes: a 64-rank mesh plans on a laptop.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from ..strategy import Strategy


class PlanningDone(BaseException):
    """Stops the user's script after its first plan (a BaseException, so a script's own
    ``except Exception`` does not swallow it)."""


@dataclass
class PlanSession:
    strategy: Strategy | None = None     # replaces the script's strategy when given
    dump_dir: str | None = None          # replaces the strategy's dump dir when given
    engine: Any = None                   # the engine that planned
    plan: Any = None                     # its Plan


_SESSION: list[PlanSession] = []


def current_session() -> PlanSession | None:
    return _SESSION[-1] if _SESSION else None


@contextlib.contextmanager
def plan_session(strategy: Strategy | None = None, dump_dir: str | None = None
                 ) -> Iterator[PlanSession]:
    session = PlanSession(strategy, dump_dir)
    _SESSION.append(session)
    try:
        yield session
    except PlanningDone:
        pass
    finally:
        _SESSION.remove(session)


def plan_script(script: str, script_args: list[str], strategy_yaml: str | None,
                dump_dir: str, explain: list[str]) -> str:
    """Run ``script`` until its first step is planned; return a report of the plan."""
    import runpy
    import sys

    from ..passes.explain import summarize

    strategy = Strategy.from_yaml(strategy_yaml) if strategy_yaml else None
    saved_argv = sys.argv
    sys.argv = [script, *script_args]
    try:
        with plan_session(strategy, dump_dir) as session:
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
    if session.plan is None:
        raise SystemExit(f"autopar plan: {script} finished without a training, evaluation or "
                         "prediction step, so nothing was planned")
    lines = [summarize(session.plan.program, session.plan.mesh, session.plan.pipeline),
             f"dumps: {dump_dir}/rank0/ (one file per pass; *.explain.txt says why)"]
    lines += [f"\nexplain {what}:\n{session.engine.explain(what, session.plan.spec.mode)}"
              for what in explain]
    return "\n".join(lines)

"""Offline planning of an unmodified training script: ``python -m autopar plan train.py``.

``plan_script`` launches the script as a child process whose environment asks for offline
planning (``engine.launch``: the way torchrun's environment asks for a rank). Every Engine
the script builds reads that once: it takes the CLI's strategy and dump dir, plans its first
``fit`` / ``evaluate`` / ``predict`` step for every rank of the mesh (no processes, no
launcher: a 64-rank mesh plans on a laptop), writes the dumps and the report, and ends the
script. The report is what this function returns.

Within a script, ``engine.prepare(inputs, labels)`` plans without running, and
``engine.summary()`` / ``engine.explain(value)`` read the plan.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from ..auto import compact_yaml, format_auto_plan
from ..cost import Profile, ProfileNotFound, default_profile, default_profile_path, format_step_time
from ..lower import classify_ranks, format_estimates, format_ranks
from ..strategy import DUMP_DIR_ENV
from .launch import (
    PLAN_AUTO_ENV,
    PLAN_DEPTH_ENV,
    PLAN_EXPLAIN_ENV,
    PLAN_LOCATE_ENV,
    PLAN_RANKS_ENV,
    PLAN_REPORT_ENV,
    PLAN_STRATEGY_ENV,
    PLAN_WRITE_ENV,
    OfflinePlanning,
)

__all__ = ["plan_script", "finish_offline_plan"]

# torchrun's variables: the child plans every rank itself, in one process
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT")


def plan_script(script: str, script_args: list[str], strategy_yaml: str | None,
                dump_dir: str, explain: list[str], locate_divergence: bool = False,
                auto: dict | None = None, write_strategy: str | None = None,
                explain_depth: int = 0, ranks: object = "classes") -> str:
    """Run ``script`` until its first step is planned; return the report of the plan.
    ``auto``: an ``auto`` section (``devices``, ``memory_limit_gb``, ...): the auto search
    chooses the strategy (the script's layout dropped; ``strategy_yaml``'s kept as
    constraints) and ``write_strategy`` receives the chosen one's YAML. ``explain_depth``:
    the chain of reasons under each explanation (0: the short answer only). ``ranks``: whose
    lowered programs are dumped (``debug.dump_ranks``: ``classes``, one per class of
    identical ranks, by default; ``all``; a list)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "plan.txt"
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
        env.update({PLAN_REPORT_ENV: str(report), DUMP_DIR_ENV: str(Path(dump_dir).resolve()),
                    PLAN_EXPLAIN_ENV: json.dumps(list(explain)),
                    PLAN_DEPTH_ENV: str(explain_depth), PLAN_RANKS_ENV: json.dumps(ranks)})
        if strategy_yaml:
            # a file, made absolute for the script's own working directory; otherwise a
            # packaged config's name (Strategy.from_yaml("dp_tp")), passed as it is
            env[PLAN_STRATEGY_ENV] = str(Path(strategy_yaml).resolve()) \
                if Path(strategy_yaml).exists() else strategy_yaml
        if locate_divergence:
            env[PLAN_LOCATE_ENV] = "1"
        if auto is not None:
            env[PLAN_AUTO_ENV] = json.dumps(auto)
        if write_strategy:
            env[PLAN_WRITE_ENV] = str(Path(write_strategy).resolve())
        done = subprocess.run([sys.executable, script, *script_args], env=env)
        if report.exists():
            return report.read_text()
        if done.returncode != 0:
            raise SystemExit(f"autopar plan: {script} failed (exit code {done.returncode}) "
                             "before its first step was planned; its output is above")
        raise SystemExit(f"autopar plan: {script} finished without a training, evaluation or "
                         "prediction step, so nothing was planned")


def _time_report(engine, step) -> str:
    """The predicted step time next to memory: on this machine's calibrated profile, else on
    the shipped reference profile, said so (it was not measured here); under ``--auto``
    on the profile the auto search costed with."""
    if engine.auto_plan is not None:
        return (f"{format_step_time(engine.planner.time(step, engine.auto_plan.profile))}\n"
                f"  (from the profile the auto search used: {engine.auto_plan.profile.machine})")
    try:
        profile, source = default_profile(), f"profile {default_profile_path()}"
    except ProfileNotFound:
        try:
            profile = Profile.reference()
        except ProfileNotFound:
            return ("predicted step time: no cost profile (run `python -m autopar calibrate` "
                    "to measure this machine)")
        source = ("the REFERENCE profile of autopar's development machine, not this one: run "
                  "`python -m autopar calibrate` to measure this machine")
    return f"{format_step_time(engine.planner.time(step, profile))}\n  (from {source})"


def _lowered_dumps(engine, step, shown: int = 8) -> str:
    """Where each process's lowered program went (``debug.dump_ranks``), and under
    ``classes`` which ranks each dumped one stands for."""
    asked, where = engine.strategy.debug.dump_ranks, engine.dump_dir
    if asked == "all":
        return f"lowered programs: {where}/rank<r>/ for every rank"
    if asked != "classes":
        return (f"lowered programs: {', '.join(f'rank{r}/' for r in asked)} in {where} "
                "(--ranks)")
    classes = classify_ranks(step.program, step.facts.mesh, step.facts.pipeline)
    lines = [f"lowered programs: {where}/rank<r>/ for one rank per class ({classes.describe()}; "
             "--ranks 0,517 or --ranks all for others):"]
    reps = classes.representatives
    lines += [f"  rank{r}/ stands for ranks {format_ranks(classes.members(r))}"
              for r in reps[:shown]]
    if len(reps) > shown:
        lines.append(f"  ... and {len(reps) - shown} more classes")
    return "\n".join(lines)


def _page(mode: str) -> str:
    """The html page's name for the first planned step of ``mode`` (the pass manager's
    dump prefix: none for training)."""
    return f"{'' if mode == 'train' else mode + '_'}plan.html"


def finish_offline_plan(engine, mode: str, offline: OfflinePlanning, inputs,
                        labels) -> NoReturn:
    """In the script's process: its first step is planned for every rank; write the report
    (the plan at a glance, where the dumps are, the explanations asked for, and the first
    divergence from one device when asked) and end the process, which ran only to be
    planned."""
    step = engine.planner.plan(mode, inputs, labels)
    lines = []
    if engine.auto_plan is not None:
        lines.append(format_auto_plan(engine.auto_plan) + "\n")
    if offline.write_strategy is not None:
        Path(offline.write_strategy).write_text(compact_yaml(engine.strategy))
        lines.append(f"strategy written to {offline.write_strategy}\n")
    lines += [engine.summary(mode), format_estimates(engine.planner.memory(step)),
             _time_report(engine, step),
             f"dumps: {engine.dump_dir}/rank0/ (one file per pass; *.explain.txt says why)",
             _lowered_dumps(engine, step)]
    if "html" in engine.strategy.debug.dump_format:
        lines.append(f"the plan on one page: {engine.dump_dir}/rank0/{_page(mode)}")
    lines += [f"\nexplain {what}:\n{engine.explain(what, mode, offline.explain_depth)}"
              for what in offline.explain]
    if offline.locate_divergence and mode == "train":
        found = engine.locate_divergence(inputs, labels)
        lines.append("\n" + (str(found) if found is not None else
                             "no divergence: every op of the first step matches one device"))
    Path(offline.report).write_text("\n".join(lines) + "\n")
    raise SystemExit(0)

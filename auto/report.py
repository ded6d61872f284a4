"""The planner's report: the top candidates side by side, why the chosen one, what was left
out and why, and the chosen strategy as YAML a user can commit (``compact_yaml``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..strategy import Strategy
from ..strategy.yaml_io import dump_yaml

if TYPE_CHECKING:
    from .evaluate import Estimate
    from .search import AutoPlan

__all__ = ["format_auto_plan", "compact_yaml", "candidate_row"]


def compact_yaml(strategy: Strategy) -> str:
    """``strategy`` as YAML with only what differs from the defaults (reads back equal)."""
    data = strategy.model_dump(exclude_defaults=True, exclude={"auto"})
    text = dump_yaml(data) if data else "{}\n"
    if Strategy.from_yaml_str(text) != strategy.model_copy(update={"auto": None}):
        text = strategy.to_yaml()          # never write a YAML that reads back different
    return text


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def candidate_row(i: int, e: "Estimate", limit: float | None) -> str:
    if e.predicted is None:
        return f"{i:>3}  {e.layout.name():<30} not planned: {e.error}"
    p = e.predicted
    fits = "yes" if e.fits else "NO" if limit is not None else "-"
    bubble = f"{100 * p.bubble:5.1f}%" if p.bubble is not None else "     -"
    return (f"{i:>3}  {e.layout.name():<30} {p.step_s * 1e3:10.2f} {p.compute_s * 1e3:10.2f} "
            f"{p.comm_s * 1e3:9.2f} {bubble:>7} {_mib(p.max_peak):>11} {fits:>5} "
            f"{e.seconds:8.1f}")


def format_auto_plan(plan: "AutoPlan", chosen: bool = True, top: int | None = None) -> str:
    """The report: header, candidates (the best ``top`` that fit, all that do not fit or
    could not be planned are counted), the chosen strategy and the reasons."""
    auto_top = top or plan.top
    limit = plan.memory_limit_bytes
    lines = [f"auto plan: {plan.devices} devices, "
             + (f"memory limit {_mib(limit)} per rank" if limit else "no memory limit")
             + f"; profile {plan.profile.machine} ({plan.profile.processes} processes)"]
    if plan.profile_note:
        lines.append(f"  note: {plan.profile_note}")
    searched = sum(1 for e in plan.candidates if e.predicted is not None)
    how = (f"each planned at {_depth_text(plan)} of the {plan.stack.layers} layers of "
           f"{plan.stack.path!r} and extended linearly" if plan.stack else
           "each planned whole (no repeated layers found)")
    lines.append(f"searched {searched} candidates in {plan.seconds:.1f} s ({how})")
    for degree, tp in sorted(plan.tensor_parallel.items()):
        state = (f"plan {tp.plan}" if tp.plan is not None else f"left out: {tp.why}")
        lines.append(f"  tp{degree}: {state} ({tp.seconds:.1f} s"
                     + (f"; {tp.summary}" if tp.summary else "") + ")")
        if tp.plan is not None and tp.why:
            lines += [f"       {note}" for note in _distinct_notes(tp.why)]
    lines.append("")
    lines.append("predicted per step (ms; compute and comm: the slowest rank's), peak "
                 "memory per rank, seconds spent planning the candidate")
    lines.append(f"{'#':>3}  {'candidate':<30} {'step ms':>10} {'compute':>10} {'comm':>9} "
                 f"{'bubble':>7} {'peak/rank':>11} {'fits':>5} {'planned':>8}")
    fitting = [e for e in plan.candidates if e.fits or (limit is None and e.predicted)]
    shown = fitting[:auto_top] if chosen else []
    rest = [e for e in plan.candidates if e not in fitting]
    for i, e in enumerate(shown + rest[:auto_top] if chosen else plan.candidates, 1):
        lines.append(candidate_row(i, e, limit))
        lines += [f"       {note}" for note in e.notes]
    hidden = len(plan.candidates) - (len(shown) + min(len(rest), auto_top) if chosen
                                     else len(plan.candidates))
    if hidden > 0:
        lines.append(f"     ... {hidden} more (python -m autopar plan --auto --top N)")
    for why in plan.skipped:
        lines.append(f"  not searched: {why}")
    if chosen:
        lines += ["", _why_chosen(plan), "", "strategy (--write-strategy FILE writes it):",
                  compact_yaml(plan.strategy).rstrip()]
    return "\n".join(lines)


def _distinct_notes(why: str) -> list[str]:
    """The plan's notes, one per module pattern (layer 1's repeats layer 0's)."""
    seen, out = set(), []
    for note in why.split("; "):
        key = _layerless(note.split(":")[0])
        if key not in seen:
            seen.add(key)
            out.append(note)
    return out


def _layerless(module: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def _depth_text(plan: "AutoPlan") -> str:
    depths = sorted({d for e in plan.candidates for d in e.layers_planned})
    return " and ".join(str(d) for d in depths) if depths else "all"


def _why_chosen(plan: "AutoPlan") -> str:
    best = plan.chosen
    assert best.predicted is not None
    text = (f"chosen: {best.layout.name()}: predicted {best.predicted.step_s * 1e3:.2f} ms per "
            f"step, peak {_mib(best.predicted.max_peak)} per rank")
    others = [e for e in plan.candidates[1:] if e.fits and e.predicted is not None]
    if others:
        runner = others[0]
        assert runner.predicted is not None
        slower = runner.predicted.step_s / best.predicted.step_s - 1
        text += (f"; the next, {runner.layout.name()}, is predicted {100 * slower:.1f}% "
                 "slower")
    over = [e for e in plan.candidates if e.predicted is not None and not e.fits]
    if over:
        text += f"; {len(over)} candidate(s) exceed the memory limit"
    return text

"""One page per plan (``debug.dump_format: [html]``): every pass in order, what it changed
(a diff of the program text against the pass before), its collectives and why each was
inserted, and the program after it with every op coloured by its placement.

The page is self-contained (inline CSS and a few lines of inline JS, no external assets), so
it opens from a dump directory copied off a cluster. Every text of the program is escaped.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

from ..ir import OpKind, Program, Value
from ..ir.printer import format_program, value_names
from .dump_diff import keyed_diff
from .dump_dot import COMM_COLOR, PLACEMENT_COLORS, op_placement

__all__ = ["Collective", "PassView", "StableNames", "snapshot", "plan_html", "MAX_DIFF_LINES"]

MAX_DIFF_LINES = 600      # per pass: a pass that rewrites everything is summarised past it
_NAME = re.compile(r"%\d+")


@dataclass(frozen=True)
class Collective:
    """One comm op of a program: its result's name, what it runs, for whom and why."""

    value: str
    target: str
    module: str
    why: str
    made_by: str


@dataclass(frozen=True)
class PassView:
    """What the page shows of the program after one pass, taken when the pass ends (later
    passes may change the program in place)."""

    number: int
    name: str
    text: str
    kinds: tuple[str, ...]            # per op (= per line of ``text``): its placement kind
    collectives: tuple[Collective, ...]
    seconds: float | None = None
    keys: tuple[str, ...] = ()        # per line: the text with names stable across passes


class StableNames:
    """Names of values that survive the passes of one plan. The dump names values by
    position, so a pass that inserts one op renames every value after it, and a plain text
    diff would show hundreds of changed lines; diffing lines with these names instead (a
    value keeps the one it got when first seen) shows only the ops a pass added, removed or
    rewired. A pass that copies the program makes new values: its diff is then the whole
    program, as a plain diff would be."""

    def __init__(self) -> None:
        self._labels: dict[Value, str] = {}    # holds the values: no id is reused meanwhile

    def keys(self, program: Program, names: dict[Value, str],
             lines: list[str]) -> tuple[str, ...]:
        for op in program.ops:
            for v in op.outputs:
                self._labels.setdefault(v, f"%v{len(self._labels)}")
        stable = {n: self._labels[v] for v, n in names.items()}
        return tuple(_NAME.sub(lambda m: stable.get(m.group(0), m.group(0)), line)
                     for line in lines)


def snapshot(program: Program, number: int, name: str, text: str | None = None,
             seconds: float | None = None, stable: StableNames | None = None) -> PassView:
    """The view of ``program`` after pass ``name`` (``text``: its dump, when made already;
    ``stable``: the plan's names for diffing, else the printed ones)."""
    names = value_names(program)
    text = format_program(program) if text is None else text
    lines = text.splitlines()
    keys = tuple(lines) if stable is None else stable.keys(program, names, lines)
    collectives = tuple(_collective(op, names) for op in program.ops if op.kind is OpKind.COMM)
    return PassView(number, name, text, tuple(op_placement(op) for op in program.ops),
                    collectives, seconds, keys)


def _collective(op, names: dict[Value, str]) -> Collective:
    """A comm op as the page lists it: why is its result's reason (reshard writes which
    step, between which placements, for which consumer)."""
    result = op.outputs[0] if op.outputs else None
    why = result.why if result is not None else None
    return Collective(names.get(result, "-"), op.target, op.module or "-",
                      why.text if why else "-", why.made_by if why else "")


def plan_html(views: list[PassView], title: str, failure: str | None = None) -> str:
    """The page of a plan's passes (``failure``: why planning stopped after the last)."""
    sections, rows, previous = [], [], None
    for view in views:
        added, removed, diff = _diff(previous, view)
        status = _status(previous, view, added, removed)
        rows.append(_row(view, status))
        sections.append(_section(view, status, diff, previous))
        previous = view
    stop = (f'<section class="failure"><h2>planning stopped</h2><pre>{_esc(failure)}</pre>'
            "</section>" if failure else "")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<header><h1>{_esc(title)}</h1>{_legend()}</header>\n{stop}\n"
            f'<nav><table id="passes"><thead><tr><th>#</th><th>pass</th><th>program</th>'
            f"<th>ops</th><th>collectives</th><th>ms</th></tr></thead><tbody>\n"
            + "\n".join(rows) + "\n</tbody></table></nav>\n" + _CONTROLS
            + "\n".join(sections) + f"\n<script>{_JS}</script>\n</body>\n</html>\n")


def _status(previous: PassView | None, view: PassView, added: int, removed: int) -> str:
    if previous is None:
        return "first"
    if added or removed:
        return f"changed +{added} -{removed}"
    return "unchanged" if previous.text == view.text else "renamed (value names only)"


def _diff(previous: PassView | None, view: PassView) -> tuple[int, int, list[str]]:
    """(+lines, -lines, unified diff lines) of the program against the pass before: lines
    matched by their stable names (``StableNames``), shown as each dump prints them."""
    if previous is None or previous.text == view.text:
        return 0, 0, []
    old, new = previous.text.splitlines(), view.text.splitlines()
    old_keys = previous.keys if len(previous.keys) == len(old) else tuple(old)
    new_keys = view.keys if len(view.keys) == len(new) else tuple(new)
    return keyed_diff(old, new, old_keys, new_keys, f"after {previous.name}",
                      f"after {view.name}", context=1)


def _anchor(view: PassView) -> str:
    return f"pass-{view.number:02d}-{view.name}"


def _row(view: PassView, status: str) -> str:
    ms = "" if view.seconds is None else f"{view.seconds * 1e3:.1f}"
    return (f'<tr class="{_status_class(status)}"><td>{view.number:02d}</td>'
            f'<td><a href="#{_esc(_anchor(view))}">{_esc(view.name)}</a></td>'
            f"<td>{_esc(status)}</td><td>{len(view.kinds)}</td>"
            f"<td>{len(view.collectives)}</td><td>{ms}</td></tr>")


def _status_class(status: str) -> str:
    return status.split()[0]


def _section(view: PassView, status: str, diff: list[str], previous: PassView | None) -> str:
    head = (f'<section class="pass {_status_class(status)}" id="{_esc(_anchor(view))}" '
            f'data-pass="{_esc(view.name)}">\n<h2><span class="number">{view.number:02d}</span> '
            f'<span class="name">{_esc(view.name)}</span> '
            f'<span class="status">{_esc(status)}</span></h2>\n')
    if status == "unchanged":
        return head + (f'<p class="same">the program is the one after '
                       f"{_esc(previous.name)}</p>\n</section>")
    body = [_diff_block(diff)] if diff else []
    body += [_collectives(view), _program(view)]
    return head + "\n".join(body) + "\n</section>"


def _diff_block(diff: list[str]) -> str:
    shown = diff[:MAX_DIFF_LINES]
    lines = [f'<span class="{_diff_class(ln)}">{_esc(ln)}</span>' for ln in shown]
    if len(diff) > MAX_DIFF_LINES:
        lines.append(f'<span class="more">... {len(diff) - MAX_DIFF_LINES} more diff lines '
                     "(the program below is whole)</span>")
    body = "".join(lines)
    return ('<details class="diff" open><summary>what this pass changed</summary>'
            f'<pre class="diff">{body}</pre></details>')


def _diff_class(line: str) -> str:
    if line.startswith(("+++", "---")):
        return "file"
    return {"+": "ins", "-": "del", "@": "hunk"}.get(line[:1], "ctx")


def _collectives(view: PassView) -> str:
    if not view.collectives:
        return '<p class="no-collectives">no collectives</p>'
    rows = "\n".join(
        f'<tr class="collective"><td>{_esc(c.value)}</td><td>{_esc(c.target)}</td>'
        f"<td>{_esc(c.module)}</td><td>{_esc(c.why)}</td><td>{_esc(c.made_by)}</td></tr>"
        for c in view.collectives)
    return (f'<details class="collectives" open><summary>collectives '
            f"({len(view.collectives)})</summary>"
            '<table class="collectives"><thead><tr><th>value</th><th>collective</th>'
            "<th>module</th><th>why it was inserted</th><th>by pass</th></tr></thead>"
            f"<tbody>\n{rows}\n</tbody></table></details>")


def _program(view: PassView) -> str:
    lines = view.text.splitlines()
    kinds = view.kinds if len(view.kinds) == len(lines) else ("unplaced",) * len(lines)
    body = "".join(f'<span class="op {kind}">{_esc(line)}</span>'
                   for line, kind in zip(lines, kinds))
    return (f'<details class="program"><summary>the program after {_esc(view.name)} '
            f'({len(lines)} ops)</summary><pre class="program">{body}</pre></details>')


def _legend() -> str:
    items = [f'<span class="op {kind}">{kind}</span>' for kind in PLACEMENT_COLORS]
    items.append('<span class="op comm">collective</span>')
    return f'<p class="legend">placements: {" ".join(items)}</p>'


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


_CSS = "\n".join([
    "body{font-family:system-ui,sans-serif;margin:1em 2em;color:#212529}",
    "pre{font-family:ui-monospace,monospace;font-size:12px;overflow-x:auto;"
    "background:#f8f9fa;padding:.5em;border:1px solid #dee2e6}",
    "pre span{display:block;white-space:pre}",      # a line each: no newline between
    "table{border-collapse:collapse;font-size:13px}",
    "td,th{border:1px solid #dee2e6;padding:2px 6px;text-align:left;vertical-align:top}",
    "section.pass{border-top:2px solid #adb5bd;margin-top:1em}",
    "section.unchanged h2{color:#6c757d;font-size:1em}",
    "section.failure{background:#f8d7da;padding:.5em}",
    "tr.unchanged{color:#6c757d}",
    ".status{font-size:.8em;color:#6c757d;margin-left:1em}",
    ".ins{background:#d1e7dd}.del{background:#f8d7da}.hunk{color:#6f42c1}.file{color:#6c757d}",
    ".legend span{padding:1px 6px;margin-right:4px;display:inline-block}",
    *(f".op.{kind}{{border-left:6px solid {color};"
      f"{'background:' + color + '55;' if kind != 'unplaced' else ''}}}"
      for kind, color in PLACEMENT_COLORS.items()),
    f".op.comm{{border-left:6px solid #dc3545;background:{COMM_COLOR};font-weight:bold}}",
    ".hidden{display:none!important}",
])

_CONTROLS = ('<p class="controls"><input id="filter" size="40" placeholder="show program lines '
             'containing... (%12, all_reduce, blocks.0.fc1)"> <label><input type="checkbox" '
             'id="changed-only"> only passes that changed the program</label></p>\n')

_JS = """
const filter = document.getElementById('filter');
const changedOnly = document.getElementById('changed-only');
function apply() {
  const q = filter.value.trim();
  document.querySelectorAll('pre.program span.op').forEach(function (s) {
    s.classList.toggle('hidden', q !== '' && !s.textContent.includes(q));
  });
  if (q !== '') {
    document.querySelectorAll('details.program').forEach(function (d) { d.open = true; });
  }
  document.querySelectorAll('section.pass.unchanged').forEach(function (s) {
    s.classList.toggle('hidden', changedOnly.checked);
  });
}
filter.addEventListener('input', apply);
changedOnly.addEventListener('change', apply);
"""

"""Debugging in one screen: ``explain``'s short answer (and ``depth`` for the chain), the
Graphviz and HTML dumps (``debug.dump_format``) and ``python -m autopar diff`` of two plans'
dumps."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import autopar as ap
from autopar.__main__ import main
from autopar.models.gpt import lm_loss
from autopar.pass_infra.dump_diff import diff_dumps, format_dump_diff

from ..parity import lm_data, parity_gpt
from ..passes.test_golden_dumps import GOLDEN, PLANS, golden_files

ROOT = Path(__file__).resolve().parents[2]
DP2 = "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
TP2 = ("mesh: {shape: [2], dim_names: [tp]}\n"
       "tensor_parallel: {axis: tp, plan: {'blocks.*.fc1': colwise, 'blocks.*.fc2': rowwise}}\n")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "headless_shell",
            "chromium-headless-shell")
# .ci/run installs Graphviz and Chromium and sets this: there a missing one fails the run
# instead of skipping its render check
REQUIRE_RENDERERS = os.environ.get("AUTOPAR_REQUIRE_RENDERERS") == "1"


def _tool(names: tuple[str, ...], what: str, package: str) -> str:
    """The first of ``names`` on PATH; without one the calling test is skipped, saying why
    (failed where ``AUTOPAR_REQUIRE_RENDERERS=1``)."""
    found = next((path for path in map(shutil.which, names) if path), None)
    if found is None:
        why = (f"{what} is not installed (none of {', '.join(names)} on PATH; Debian: "
               f"apt-get install {package}, as .ci/run does)")
        if REQUIRE_RENDERERS:
            pytest.fail(f"{why}, and AUTOPAR_REQUIRE_RENDERERS=1 asks for it")
        pytest.skip(why)
    return found


def _plan(strategy_yaml: str, dump_dir: Path | None = None, formats: str = "",
          layers: int = 2) -> ap.Engine:
    """Plan one training step of the small GPT (dumping into ``dump_dir``)."""
    debug = "" if dump_dir is None else (
        f"debug: {{dump_dir: '{dump_dir}'{', dump_format: ' + formats if formats else ''}}}\n")
    model = parity_gpt("adamw", layers=layers)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(strategy_yaml + debug))
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    engine.prepare(x, y)
    return engine


@pytest.fixture(scope="module")
def dp_tp_dumps(tmp_path_factory) -> tuple[ap.Engine, Path]:
    """The dp2 x tp2 GPT of the golden dumps, dumped in every format."""
    where = tmp_path_factory.mktemp("dp2_tp2")
    return _plan(PLANS["dp2_tp2_sp"], where, "[text, dot, html]"), where


# -- explain ---------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["grad[blocks.0.fc1.weight]", "loss", "blocks.0.fc1.weight",
                                  "%40", "wte.weight"])
def test_explain_answers_in_ten_lines_with_placement_rule_and_pass(dp_tp_dumps, what):
    engine, _ = dp_tp_dumps
    text = engine.explain(what)
    lines = text.splitlines()
    assert len(lines) <= 10, text
    assert re.search(r"\{[RSP(),0-9a-z]+\} on mesh\[2,2\]\(dp,tp\)", lines[0]), text
    assert lines[1].startswith("  placement: dp ") and " tp " in lines[1], text
    assert any(ln.startswith("  made by:   pass '") for ln in lines), text
    assert any(ln.startswith("  rule:      ") for ln in lines), text
    assert "'?'" not in text, f"a reason no pass was named on:\n{text}"


def test_explain_names_the_decisions_behind_a_gradient(dp_tp_dumps):
    engine, _ = dp_tp_dumps
    text = engine.explain("grad[blocks.0.fc1.weight]")
    assert "made by:   pass 'reshard'" in text or "made by:   pass 'bucket_collectives'" in text
    decided = text[text.index("decided by:"):]
    # one line per mesh dim first: the batch sharded on dp, the fc1 plan entry on tp
    assert "data_parallel.axis dp" in decided and "'blocks.*.fc1': colwise" in decided
    assert "depth=N" in text


def test_a_larger_depth_shows_more_of_the_chain(dp_tp_dumps):
    engine, _ = dp_tp_dumps
    short = engine.explain("grad[blocks.0.fc1.weight]")
    one, three = (engine.explain("grad[blocks.0.fc1.weight]", depth=d) for d in (1, 3))
    deep = engine.explain("grad[blocks.0.fc1.weight]", depth=64)
    assert one.startswith(short) and three.startswith(short)
    assert len(short.splitlines()) < len(one.splitlines()) < len(three.splitlines()) \
        < len(deep.splitlines())
    assert "value by value (3 deep)" in three and "cut at depth 3" in three
    assert "cut at depth" not in deep       # 64 levels reach every annotation
    with pytest.raises(ValueError, match="depth -1"):
        engine.explain("loss", depth=-1)


def test_explain_of_an_unknown_value_says_what_to_give(dp_tp_dumps):
    engine, _ = dp_tp_dumps
    with pytest.raises(KeyError, match="no value 'nope'.*printed name"):
        engine.explain("nope")


# -- dump formats ----------------------------------------------------------------------------

def test_dump_format_is_validated_and_text_is_the_default():
    assert ap.Strategy().debug.dump_format == ("text",)
    assert ap.Strategy(debug={"dump_format": "html"}).debug.dump_format == ("html",)
    with pytest.raises(ValueError, match=r"unknown format 'svg'; formats: text, dot, html"):
        ap.Strategy(debug={"dump_format": ["text", "svg"]})
    with pytest.raises(ValueError, match=r"'htm' \(did you mean 'html'\?\)"):
        ap.Strategy.from_yaml_str("debug: {dump_format: [htm]}")
    with pytest.raises(ValueError, match="named twice"):
        ap.Strategy(debug={"dump_format": ["dot", "dot"]})
    with pytest.raises(ValueError, match="one or more of text, dot, html"):
        ap.Strategy(debug={"dump_format": []})


def test_text_dumps_are_the_golden_ones_whatever_else_is_dumped(dp_tp_dumps):
    _, where = dp_tp_dumps
    want = {p.name: p.read_text() for p in (GOLDEN / "dp2_tp2_sp").glob("*.txt")}
    assert golden_files(where) == want


def _pass_stems(rank_dir: Path) -> list[str]:
    """``NN_<pass>`` of every pass's program dump, in order."""
    return sorted(p.stem for p in rank_dir.glob("[0-9][0-9]_*.txt")
                  if "." not in p.stem and not p.stem.endswith(("_partition", "_memory")))


def test_a_dot_graph_per_pass_colours_placements_and_marks_collectives(dp_tp_dumps):
    _, where = dp_tp_dumps
    rank0 = where / "rank0"
    stems = _pass_stems(rank0)
    assert len(stems) > 30 and all((rank0 / f"{s}.dot").exists() for s in stems)
    nodes, edges = _parse_dot((rank0 / "00_capture.dot").read_text())
    assert {a["class"] for n, a in nodes.items() if n.startswith("op")} == {"unplaced"}
    reshard = next(rank0.glob("[0-9][0-9]_reshard.dot")).read_text()
    nodes, edges = _parse_dot(reshard)
    classes = {a["class"] for n, a in nodes.items() if n.startswith("op")}
    assert {"replicated", "sharded", "partial", "comm"} <= classes
    comms = [a for a in nodes.values() if a["class"] == "comm" and "tooltip" in a]
    assert comms and all(a["shape"] == '"hexagon"' for a in comms)
    assert any("all_reduce(sum) over tp" in a["tooltip"] for a in comms)
    sharded = [a for a in nodes.values() if a["class"] == "sharded"]
    assert {a["fillcolor"] for a in sharded} == {'"#9ec5fe"'}
    assert len(edges) > len(nodes)


def _render_dot(dot: str, text: str) -> None:
    """Graphviz lays ``text`` out without an error or a warning (a statement it cannot
    parse, an unknown shape, colour or attribute value), and its SVG holds every node and
    edge the DOT declares (``_parse_dot``): none dropped on the way."""
    # layout effort capped: the check is that Graphviz reads every statement
    done = subprocess.run([dot, "-Tsvg", "-Gnslimit=1", "-Gnslimit1=1", "-Gmclimit=0.1",
                           "-Gsearchsize=10"], input=text, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "<svg" in done.stdout, done.stderr[-2000:]
    assert not done.stderr.strip(), f"Graphviz warned:\n{done.stderr[-2000:]}"
    nodes, edges = _parse_dot(text)
    titles = re.findall(r'<g id="(node|edge)\d+" class="(?:node|edge)[^"]*">\s*'
                        r"<title>([^<]*)</title>", done.stdout)
    drawn_nodes = {t for kind, t in titles if kind == "node"}
    drawn_edges = [t.replace("&#45;&gt;", "->") for kind, t in titles if kind == "edge"]
    assert drawn_nodes == set(nodes), set(nodes) ^ drawn_nodes
    assert sorted(drawn_edges) == sorted(f"{a}->{b}" for a, b in edges)


def test_graphviz_draws_every_node_and_edge_of_a_pass_graph(dp_tp_dumps):
    _, where = dp_tp_dumps
    dot = _tool(("dot",), "Graphviz", "graphviz")
    for name in ("00_capture.dot", next((where / "rank0").glob("[0-9][0-9]_reshard.dot")).name):
        _render_dot(dot, (where / "rank0" / name).read_text())


def test_the_graphviz_check_fails_on_a_broken_graph(dp_tp_dumps):
    """The render check itself: a statement Graphviz cannot parse, or a value it does not
    know (it then warns and draws something else), fails it."""
    _, where = dp_tp_dumps
    dot = _tool(("dot",), "Graphviz", "graphviz")
    good = (where / "rank0" / "00_capture.dot").read_text()
    edge = re.search(r"^ *(\w+) -> (\w+);$", good, re.M)
    unparsable = good.replace(edge[0], edge[0].replace(" -> ", " -> -> "), 1)
    with pytest.raises(AssertionError, match="syntax error"):
        _render_dot(dot, unparsable)
    unknown_shape = good.replace('shape="box"', 'shape="boxx"', 1)
    assert unknown_shape != good
    with pytest.raises(AssertionError, match="boxx"):
        _render_dot(dot, unknown_shape)


_ATTR = re.compile(r'\s*(\w+)=("(?:[^"\\]|\\.)*"|[\w.#-]+)\s*(,|$)')


def _parse_dot(text: str) -> tuple[dict[str, dict[str, str]], list[tuple[str, str]]]:
    """A structural check of the DOT we write: ``digraph "..." {``, then graph/node/edge
    defaults, a legend cluster, node statements with quoted attributes and edges between
    declared nodes, braces balanced. Returns the nodes' attributes (unquoted ``class`` and
    ``tooltip``) and the edges."""
    lines = text.rstrip("\n").splitlines()
    assert re.fullmatch(r'digraph "(?:[^"\\]|\\.)*" \{', lines[0]) and lines[-1] == "}"
    nodes, edges, depth = {}, [], 1
    for line in lines[1:-1]:
        stmt = line.strip()
        if stmt.startswith("subgraph "):
            depth += 1
        elif stmt == "}":
            depth -= 1
        elif m := re.fullmatch(r"(\w+) -> (\w+);", stmt):
            edges.append((m[1], m[2]))
        elif m := re.fullmatch(r"(\w+) \[(.*)\];", stmt):
            if m[1] not in ("graph", "node", "edge"):
                nodes[m[1]] = _attrs(m[2])
        else:
            assert re.fullmatch(r'(label="[^"]*"; style=\w+;)', stmt), stmt
        assert depth >= 1, line
    assert depth == 1
    assert all(a in nodes and b in nodes for a, b in edges)
    return nodes, edges


def _attrs(text: str) -> dict[str, str]:
    found, at = {}, 0
    while at < len(text):
        m = _ATTR.match(text, at)
        assert m, f"not a DOT attribute list at {text[at:at + 40]!r}"
        found[m[1]] = m[2]
        at = m.end()
    for key in ("class", "tooltip"):
        if key in found:
            found[key] = found[key].strip('"').replace('\\"', '"').replace("\\\\", "\\")
    return found


class _Page(HTMLParser):
    """Checks nesting (every end tag closes the element open) and collects the passes'
    sections, the collectives' rows and anything that would load from outside."""

    VOID = {"meta", "input", "br", "hr", "img", "link"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.passes: list[str] = []
        self.collectives: dict[str, int] = {}
        self.external: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)
        classes = (attrs.get("class") or "").split()
        if tag == "section" and "pass" in classes:
            self.passes.append(attrs["data-pass"])
        if tag == "tr" and "collective" in classes:
            self.collectives[self.passes[-1]] = self.collectives.get(self.passes[-1], 0) + 1
        for key in ("src", "href"):
            if attrs.get(key) and not attrs[key].startswith("#"):
                self.external.append(attrs[key])
        if tag == "link":
            self.external.append(str(attrs))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def test_the_html_page_shows_every_pass_its_collectives_and_changes(dp_tp_dumps):
    _, where = dp_tp_dumps
    page_path = where / "rank0" / "plan.html"
    page = page_path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert parser.stack == [], parser.stack
    names = [s.split("_", 1)[1] for s in _pass_stems(where / "rank0")]
    assert parser.passes == names
    assert parser.external == []         # self-contained: no asset, no link out of the page
    assert "<script src" not in page and "http" not in page.split("<body>")[1]
    # the collectives reshard inserted, each with why
    assert parser.collectives["reshard"] > 5
    text = "".join(parser.text)
    assert "all_reduce(sum) over dp" in text and "why it was inserted" in text
    assert "what this pass changed" in text and "unchanged" in text
    section = page[page.index('data-pass="reshard"'):]
    section = section[:section.index("</section>")]
    assert '<span class="ins">+%' in section and "comm.all_reduce" in section
    # every text of the program is escaped: the dump's quotes and arrows are entities
    assert "{step=&#x27;" in page and "-&gt; {" in page


# Around the page's own script, in a copy of the page: the first records every uncaught
# error; the second, after it, uses the page's controls as a reader would and writes what it
# saw into <html data-*> (which --dump-dom prints).
_PROBE_ERRORS = """<script>window.probeErrors = [];
window.addEventListener('error', function (e) { window.probeErrors.push(e.message); });
</script>"""
_PROBE_CONTROLS = """<script>(function () {
  const out = document.documentElement.dataset;
  try {
    const ops = Array.from(document.querySelectorAll('pre.program span.op'));
    const filter = document.getElementById('filter');
    filter.value = 'all_reduce';
    filter.dispatchEvent(new Event('input'));
    const shown = ops.filter(function (s) { return !s.classList.contains('hidden'); });
    out.ops = ops.length;
    out.shown = shown.length;
    out.strays = shown.filter(function (s) {
      return !s.textContent.includes('all_reduce');
    }).length;
    const only = document.getElementById('changed-only');
    only.checked = true;
    only.dispatchEvent(new Event('change'));
    out.unchanged = document.querySelectorAll('section.pass.unchanged').length;
    out.unchangedshown = document.querySelectorAll('section.pass.unchanged:not(.hidden)').length;
    out.changedhidden = document.querySelectorAll('section.pass:not(.unchanged).hidden').length;
  } catch (e) {
    window.probeErrors.push('probe: ' + e.message);
  }
  out.errors = window.probeErrors.join(' / ');
})();</script>"""


def _render_in_a_browser(browser: str, page: Path, names: list[str], scratch: Path) -> None:
    """Headless Chromium loads (a probed copy of) ``page``: its script runs without an
    error, the DOM it builds holds every pass of ``names``, the filter shows only the
    program lines holding its text and 'only passes that changed' hides exactly the
    unchanged passes."""
    html = page.read_text()
    assert html.count("<head>") == 1 and html.count("</body>") == 1
    probed = scratch / "probed.html"
    probed.write_text(html.replace("<head>", "<head>" + _PROBE_ERRORS)
                      .replace("</body>", _PROBE_CONTROLS + "</body>"))
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={scratch / 'profile'}", "--dump-dom",
         probed.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    root = re.search(r"<html\b[^>]*>", done.stdout)
    assert root, done.stdout[:2000]
    seen = dict(re.findall(r'\bdata-(\w+)="([^"]*)"', root[0]))
    assert "errors" in seen, f"the probe did not run: {root[0]}"
    assert seen["errors"] == "", f"the page's script failed: {seen['errors']}"
    assert all(f'data-pass="{name}"' in done.stdout for name in names)
    counts = {k: int(v) for k, v in seen.items() if k != "errors"}
    assert 0 < counts["shown"] < counts["ops"] and counts["strays"] == 0, counts
    assert counts["unchanged"] > 0 and counts["unchangedshown"] == 0, counts
    assert counts["changedhidden"] == 0, counts


def test_chromium_runs_the_page_its_passes_and_controls(dp_tp_dumps, tmp_path):
    _, where = dp_tp_dumps
    browser = _tool(BROWSERS, "a headless Chromium", "chromium")
    names = [s.split("_", 1)[1] for s in _pass_stems(where / "rank0")]
    _render_in_a_browser(browser, where / "rank0" / "plan.html", names, tmp_path)


@pytest.mark.parametrize("defect, planted, error", [
    # a syntax error: no listener is ever added
    ("function apply() {", "function apply() {{", "SyntaxError"),
    # a runtime error in the handler the filter calls
    ("filter.value.trim()", "filter.value.trimmed()", "TypeError"),
])
def test_the_browser_check_fails_on_a_broken_page_script(dp_tp_dumps, tmp_path, defect,
                                                         planted, error):
    """The render check itself: the page with a planted script error fails it."""
    _, where = dp_tp_dumps
    browser = _tool(BROWSERS, "a headless Chromium", "chromium")
    page = (where / "rank0" / "plan.html").read_text()
    assert page.count(defect) == 1
    broken = tmp_path / "plan.html"
    broken.write_text(page.replace(defect, planted))
    names = [s.split("_", 1)[1] for s in _pass_stems(where / "rank0")]
    with pytest.raises(AssertionError, match=f"script failed: .*{error}"):
        _render_in_a_browser(browser, broken, names, tmp_path)


def test_without_text_only_the_formats_asked_for_are_written(tmp_path):
    _plan(DP2, tmp_path, "[html]", layers=1)
    rank0 = tmp_path / "rank0"
    assert (rank0 / "plan.html").exists()
    assert not list(rank0.glob("[0-9][0-9]_completion*.txt"))
    assert not list(rank0.glob("*.dot"))


def test_a_failing_pass_still_writes_the_page_of_the_passes_before_it(tmp_path):
    from autopar.pass_infra.context import PassContext, PlanInputs
    from autopar.pass_infra.manager import PassManager, make_pass

    def broken(program, ctx):
        raise RuntimeError("the <broken> pass")

    engine = _plan(DP2, None, layers=1)
    program = engine.planner.last("train").program
    manager = PassManager((make_pass("fine", lambda p, ctx: p), make_pass("broken", broken)),
                          dump_dir=str(tmp_path), dump_formats=("html",))
    with pytest.raises(RuntimeError, match="broken"):
        manager.run(program, PassContext(PlanInputs.of(ap.Strategy())))
    page = (tmp_path / "rank0" / "plan.html").read_text()
    assert "planning stopped" in page and "RuntimeError: the &lt;broken&gt; pass" in page
    assert 'data-pass="fine"' in page and 'data-pass="broken"' not in page


# -- autopar diff ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dp_and_tp_dumps(tmp_path_factory) -> tuple[Path, Path]:
    dp, tp = tmp_path_factory.mktemp("dp2"), tmp_path_factory.mktemp("tp2")
    _plan(DP2, dp, layers=1)
    _plan(TP2, tp, layers=1)
    return dp, tp


def test_diff_of_two_strategies_names_the_passes_that_differ(dp_and_tp_dumps):
    dp, tp = dp_and_tp_dumps
    ranks = {r.rank: {p.name: p for p in r.passes} for r in diff_dumps(dp, tp)}
    assert set(ranks) == {"rank0", "rank1"}
    rank0 = ranks["rank0"]
    assert rank0["capture"].status == "unchanged"
    assert rank0["tensor_parallel_plan"].status == "changed"
    assert rank0["completion"].status == "changed" and rank0["completion"].diff
    # a pass that adds no difference of its own points at the one that made it
    assert rank0["expert_parallel"].same_as == "tensor_parallel_plan"
    assert not rank0["expert_parallel"].diff
    text, differs = format_dump_diff(dp, tp, max_lines=10)
    assert differs
    assert re.search(r"\n  tensor_parallel_plan +changed \(\+\d+ -\d+ lines\)\n", text)
    assert re.search(r"\n  capture +unchanged\n", text)
    assert "+%9: f32[128,32] {S(0)} @mesh[2](tp) = state param 'blocks.0.fc1.weight'" in text
    assert "more diff lines of completion (--max-lines" in text


def test_diff_matches_passes_by_name_not_number(dp_and_tp_dumps, tmp_path):
    dp, _ = dp_and_tp_dumps
    shutil.copytree(dp, tmp_path / "b")
    moved = next((tmp_path / "b" / "rank0").glob("[0-9][0-9]_completion.txt"))
    moved.rename(moved.with_name("99_completion.txt"))
    next((tmp_path / "b" / "rank0").glob("[0-9][0-9]_reshard.txt")).unlink()
    passes = {p.name: p for p in diff_dumps(dp, tmp_path / "b")[0].passes}
    assert passes["completion"].status == "unchanged"
    assert passes["reshard"].status == "only in A"


def test_diff_of_identical_dumps_is_all_unchanged(dp_and_tp_dumps, capsys):
    dp, _ = dp_and_tp_dumps
    main(["diff", str(dp), str(dp), "--exit-code"])
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert len(rows) > 30 and all(ln.split()[-1] == "unchanged" for ln in rows)
    assert re.search(r"rank0: \d+ unchanged, 0 changed, 0 only in A, 0 only in B", out)
    assert "---" not in out


def test_diff_on_the_command_line(dp_and_tp_dumps, capsys):
    dp, tp = dp_and_tp_dumps
    done = subprocess.run([sys.executable, "-m", "autopar", "diff", str(dp), str(tp),
                           "--summary", "--rank", "1"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rank1: " in done.stdout and "rank0" not in done.stdout
    assert re.search(r"partition +changed", done.stdout) and "@@" not in done.stdout
    with pytest.raises(SystemExit) as exit_:
        main(["diff", str(dp), str(tp), "--exit-code", "--summary"])
    assert exit_.value.code == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["diff", str(dp), str(dp / "nowhere")])
    assert "nowhere is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diff", str(dp), str(tp), "--rank", "7"])
    assert "no rank [7]" in capsys.readouterr().err

"""The docs cannot rot: every YAML block in the README and ``docs/`` is a strategy that
``Strategy`` accepts, every ``python -m autopar`` / ``autopar`` command line in them parses
with the CLI's own parser, every link of the README into ``docs/`` names a page, and the
site builds with ``mkdocs build --strict`` (broken links, pages missing from the nav,
docstrings the API reference cannot read)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autopar as ap

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def _blocks(language: str) -> list[tuple[str, str]]:
    """Each fenced block of ``language`` (where it starts, its text), snippets included."""
    return [(f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}",
             SNIPPET.sub(lambda s: (ROOT / s.group(1)).read_text(), m.group(2)))
            for page in PAGES for text in [page.read_text()]
            for m in FENCE.finditer(text) if m.group(1) == language]


YAML = _blocks("yaml")
COMMANDS = [(where, line.split("#")[0].strip()) for language in ("", "bash", "sh")
            for where, block in _blocks(language)
            for line in block.replace("\\\n", " ").splitlines()
            if re.match(r"\s*(python -m autopar|autopar) ", line)]


def test_the_docs_hold_yaml_blocks_and_commands():
    assert len(YAML) >= 14 and len(COMMANDS) >= 10


@pytest.mark.parametrize("where,block", YAML, ids=[w for w, _ in YAML])
def test_every_yaml_block_is_a_strategy(where, block):
    ap.Strategy.from_yaml_str(block)


@pytest.mark.parametrize("where,line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_line_parses(where, line):
    from autopar.__main__ import build_parser
    words = shlex.split(line)
    words = words[3:] if words[:3] == ["python", "-m", "autopar"] else words[1:]
    own = words[:words.index("--")] if "--" in words else words
    try:
        build_parser().parse_args(own)
    except SystemExit as exit:
        pytest.fail(f"{where}: `{line}` does not parse (exit {exit.code})")


def test_every_readme_link_into_docs_names_a_page():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing


def test_the_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (the docs extra)")
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()

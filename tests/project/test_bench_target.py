"""``make bench`` and docs/benchmarks.md agree on the benchmarks: every script in bench/ is
either run by the Makefile's ``bench`` target or listed in the docs as run separately (not
both), and the docs name every script the target runs."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_target() -> set[str]:
    """The scripts the Makefile's ``bench`` target runs."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "no bench target in the Makefile"
    scripts = re.findall(r"^\t\$\(PY\) bench/(\w+\.py)\b", recipe[1], re.M)
    assert len(scripts) == len(recipe[1].splitlines()), recipe[1]
    return set(scripts)


def test_every_benchmark_is_run_by_make_bench_or_listed_as_separate():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    ran, _ = docs.split("Run separately:", 1)
    bullets = re.search(r"Run separately:\n\n((?:\* .*\n(?:  .*\n)*)+)", docs)
    assert bullets, "no list of the benchmarks run separately"
    separate = set(re.findall(r"`(\w+\.py)`", bullets[1]))
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")}
    target = _bench_target()
    assert target <= scripts, target - scripts
    assert not target & separate, target & separate
    assert target | separate == scripts, scripts - target - separate
    named = set(re.findall(r"`(\w+\.py)(?: [^`]*)?`", ran))
    assert named == target, named ^ target

"""Golden dumps: the program after every pass, and what lowering made of it, for three plans
of a 2-layer GPT, checked in under ``tests/passes/golden/<plan>/`` and compared text for text.

A change to any pass, to lowering or to the printer shows here as a readable diff of the
files it changed. When the change is meant, regenerate and read the diff before committing:

    make golden   (AUTOPAR_UPDATE_GOLDEN=1 and this file)

Each plan's directory holds the dumps rank 0 writes (``debug.dump_dir``) except the per-value
explanations (``*.explain.txt``, covered by the explain tests) and the timings; a pass that
left the program as it was has no file of its own: ``index.txt`` lists every pass in order
with the file that holds the program after it. A pipeline's lowered jobs differ per stage,
so its ``jobs`` dumps are kept for every rank.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import autopar as ap
from autopar.models.gpt import lm_loss

from ..parity import lm_data, parity_gpt

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1"
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise, "wte": vocab}')
PLANS = {
    "dp2_tp2_sp": f"""
mesh: {{shape: [2, 2], dim_names: [dp, tp]}}
data_parallel: {{axis: dp}}
tensor_parallel: {{axis: tp, plan: {TP_PLAN}, sequence_parallel: true, sequence_dim: 1}}
""",
    "pp2_1f1b_mb4": """
mesh: {shape: [2], dim_names: [pp]}
pipeline: {axis: pp, schedule: 1F1B, micro_batches: 4, split: auto}
""",
    "dp2_zero3_recompute_o2": """
mesh: {shape: [2], dim_names: [dp]}
data_parallel: {axis: dp}
sharding: {stage: 3, axis: dp, unit: layer}
recompute: {enable: true, modules: ["blocks.*"]}
amp: {enable: true, dtype: bfloat16, level: O2}
""",
}
# dumps every rank writes alike (the global program after each pass) are compared on rank 0;
# a pipeline's lowered jobs on every rank
PER_RANK = re.compile(r"\d\d_jobs\.txt")
SKIPPED = re.compile(r".*\.explain\.txt|timings\.txt")


def plan_dumps(plan: str, where: Path) -> dict[str, str]:
    """Plan one training step of the GPT under ``plan`` and return its golden files."""
    model = parity_gpt("adamw", layers=2)
    strategy = ap.Strategy.from_yaml_str(PLANS[plan] + f"debug: {{dump_dir: '{where}'}}\n")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=strategy)
    x, y = (torch.stack(t) for t in zip(*lm_data(8, 16, 64)))
    engine.prepare(x, y)
    return golden_files(where)


def golden_files(dump_dir: Path) -> dict[str, str]:
    """Rank 0's dumps (every rank's jobs), a pass that changed nothing folded into the index."""
    files, index, previous = {}, [], None
    for path in sorted((dump_dir / "rank0").glob("*.txt")):
        if SKIPPED.fullmatch(path.name):
            continue
        text = path.read_text()
        is_program = "." not in path.stem
        if is_program and text == previous:
            index.append(f"{path.stem}: unchanged")
            continue
        index.append(f"{path.stem}: {path.name}")
        files[path.name] = text
        previous = text if is_program else previous
    for path in sorted(dump_dir.glob("rank*/*.txt")):
        if PER_RANK.fullmatch(path.name) and path.parent.name != "rank0":
            files[f"{path.parent.name}_{path.name}"] = path.read_text()
    files["index.txt"] = "\n".join(index) + "\n"
    return files


def readable_diff(name: str, want: str, got: str, lines: int = 80) -> str:
    diff = list(difflib.unified_diff(want.splitlines(), got.splitlines(), f"golden/{name}",
                                     "planned now", lineterm="", n=2))
    more = f"\n... ({len(diff) - lines} more diff lines)" if len(diff) > lines else ""
    return "\n".join(diff[:lines]) + more


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_dumps_equal_the_golden_ones(plan, tmp_path):
    got = plan_dumps(plan, tmp_path)
    folder = GOLDEN / plan
    if UPDATE:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, text in got.items():
            (folder / name).write_text(text)
    want = {p.name: p.read_text() for p in folder.glob("*.txt")} if folder.exists() else {}
    regenerate = "make golden (AUTOPAR_UPDATE_GOLDEN=1 pytest tests/passes/test_golden_dumps.py)"
    assert want, f"no golden dumps for {plan}: make them with {regenerate}"
    assert sorted(got) == sorted(want), (
        f"{plan}: the dumps made now ({sorted(set(got) - set(want))} new, "
        f"{sorted(set(want) - set(got))} gone) differ from golden/{plan}; if that is meant, "
        f"regenerate with {regenerate} and read the diff")
    changed = [name for name in sorted(want) if got[name] != want[name]]
    assert not changed, (
        f"{plan}: {changed} differ from the golden dumps; if the change is meant, regenerate "
        f"with {regenerate} and read the diff. First difference:\n"
        + readable_diff(f"{plan}/{changed[0]}", want[changed[0]], got[changed[0]]))


def test_golden_files_are_deterministic(tmp_path):
    """Two plans of the same step write the same files (names are given at print time; no
    set or dict order of the planner leaks into a dump)."""
    first = plan_dumps("dp2_tp2_sp", tmp_path / "a")
    assert first == plan_dumps("dp2_tp2_sp", tmp_path / "b")

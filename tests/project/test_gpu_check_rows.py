"""The GPU checks' verdicts, judged on the CPU: ``bench/gpu_check.py``'s speed criterion and
exit status, its row loop on stand-in rows, and which of ``bench/multi_gpu_check.py``'s rows
a launch skips. The scripts are loaded by path (bench/ is not a package); nothing here needs
CUDA but the last test, which is skipped without a GPU."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    """``bench/<name>.py`` as a module, sys.path as it was and no bench/ module left in
    sys.modules (the script puts bench/ first on sys.path to import its sibling
    benchmarks as top-level modules)."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if Path(getattr(sys.modules[added], "__file__", None) or "/").parent == BENCH:
                del sys.modules[added]
    return module


gpu_check = _load("gpu_check")
TIMES = {"eager": 100.0, "eager compiled": 80.0, "autopar": 100.0, "autopar compiled": 80.0}


def test_the_speed_row_passes_within_the_limit_and_says_its_criterion():
    assert gpu_check.SPEED_LIMIT == 1.10
    ok, text = gpu_check.speed_verdict(TIMES)
    assert ok, text
    assert "autopar/eager and compiled autopar/compiled eager <= 1.10, same run" in text
    assert "autopar/eager 1.00 <= 1.10" in text
    assert "autopar/eager compiled 1.00 <= 1.10" in text
    # at the limit itself: passes
    assert gpu_check.speed_verdict({**TIMES, "autopar": 110.0})[0]


@pytest.mark.parametrize("slow, value", [("autopar", 111.0), ("autopar compiled", 88.9),
                                         ("autopar", math.nan), ("eager compiled", 72.0)])
def test_the_speed_row_fails_when_autopar_is_slower_than_the_limit(slow, value):
    ok, text = gpu_check.speed_verdict({**TIMES, slow: value})
    assert not ok, text
    assert "NOT <= 1.10" in text


def test_the_exit_status_is_1_when_any_row_failed_or_did_not_run():
    status = gpu_check.exit_status
    assert status(["pass", "pass"]) == 0
    assert status(["pass", "skipped"]) == 0
    for bad in ("FAIL", "ERROR", "not run"):
        assert status(["pass", bad, "skipped"]) == 1, bad


def _row(ok: bool | None, detail: str = "fine"):
    def row():
        if ok is None:
            raise RuntimeError("the row broke\nsecond line")
        return ok, detail
    return row


def test_the_row_loop_reports_every_row_and_its_status(capsys):
    results = gpu_check.run_rows([("good", _row(True), False), ("bad", _row(False, "a|b"), False),
                                  ("broken", _row(None), False), ("big", _row(True), True)],
                                 budget_s=600, skip_big=True)
    assert results == ["pass", "FAIL", "ERROR", "skipped"]
    assert gpu_check.exit_status(results) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| good | pass | fine | ")
    assert lines[1].startswith("| bad | FAIL | a/b | ")
    assert lines[2].startswith("| broken | ERROR | RuntimeError: the row broke "
                               "(test_gpu_check_rows.py:")
    assert lines[3] == "| big | skipped | --skip-big | - |"
    passing = gpu_check.run_rows([("good", _row(True), False), ("big", _row(True), True)],
                                 budget_s=600, skip_big=True)
    assert gpu_check.exit_status(passing) == 0
    late = gpu_check.run_rows([("good", _row(True), False)], budget_s=-1)
    assert late == ["not run"] and gpu_check.exit_status(late) == 1
    assert "budget of -1 s spent" in capsys.readouterr().out


def test_a_multi_gpu_launch_skips_the_rows_of_another_world_size():
    multi = _load("multi_gpu_check")
    assert multi.SKIPPED == "skipped" and multi.speed_ratio is not None
    for world, runs in ((2, "pp2 1F1B vs pipelining"), (4, "HSDP [2, 2] vs FSDP2 2-D mesh")):
        table = {name: skip for name, _, skip in multi.rows(world)}
        assert len(table) == 6 and table[runs] is None
        skipped = {name: why for name, why in table.items() if why}
        assert len(skipped) == 1, skipped
        (why,) = skipped.values()
        assert why == f"needs {4 if world == 2 else 2} ranks, launched on {world}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CUDA-less run")
def test_without_cuda_the_check_says_so_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_serial_row_passes_on_a_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    ok, detail = gpu_check.row_serial()
    assert ok, detail

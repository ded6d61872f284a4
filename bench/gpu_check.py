"""The one prepared check of autopar on one CUDA GPU (issue 28): a single call, at most about
8 minutes, printing one table to paste into bench/README.md with the date and the device.

    .venv/bin/python bench/gpu_check.py [--budget-s 480] [--skip-big]

Rows, cheapest first (each in its own try: a failing row says why and the next one runs;
a row that would start past the budget is reported as not run):

* serial fp32 parity: a small GPT + AdamW, 3 steps on cuda:0 through ``Engine`` against the
  same eager loop (``torch.manual_seed(seed + step)`` before each step, as the engine
  seeds), losses and parameters at rtol 1e-5 (TF32 off, as torch's default for matmuls);
* dropout masks: the same with dropout 0.1: equal losses only if every mask is eager's;
* bf16 O1: ``amp: {enable: true, dtype: bfloat16, level: O1}`` against eager autocast,
  judged against eager's own distance from its fp32 run (the dtype's tolerance, not ours);
* simulator dp2 x tp2 (Megatron plan) and pp2 1F1B on the one GPU against eager, fp32;
* memory: ``Engine.cost`` peak against ``torch.cuda.max_memory_allocated`` of a step;
* offload (``sharding: {offload: {optimizer: true, params: true}}``): parity as the serial
  row, and the device's measured peak against the same step without offload and against
  the estimate;
* speed: a ~125M-parameter GPT (12 x 768, vocab 50304, seq 1024) in bf16, median step of
  eager, ``torch.compile``d eager, autopar, autopar with ``compile: {enable: true}``; it
  passes when autopar's step is at most ``SPEED_LIMIT`` (1.10) times eager's and compiled
  autopar's at most that times compiled eager's, all four measured in this run;
* calibration: ``python -m autopar calibrate --quick`` on this machine, its time and what
  it measured.

It exits 1 when a row failed (FAIL, ERROR) or was not run for want of budget: the check is
then not a pass; 0 when every row passed or was skipped on request (``--skip-big``).
Without CUDA it says so in one line and exits 0 (CI never has a GPU).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable

import torch

ROOT = Path(__file__).resolve().parent.parent

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3
# the speed criterion: autopar's median step at most this times its torch peer's, both
# measured in the same run (eager, compiled or not, here; the peers of multi_gpu_check.py)
SPEED_LIMIT = 1.10
# a row's result: passed; skipped on request (--skip-big) or not for this launch (a row for
# another world size); the others (FAIL, ERROR, not run for want of budget) fail the check
PASSED, SKIPPED = "pass", "skipped"


def speed_ratio(ours: float, theirs: float, peer: str,
                limit: float = SPEED_LIMIT) -> tuple[bool, str]:
    """(whether ``ours`` is at most ``limit`` times ``theirs``, the ratio said against the
    limit): step times of autopar and its torch ``peer`` in one run (a NaN fails)."""
    ratio = ours / theirs
    ok = ratio <= limit
    return ok, f"autopar/{peer} {ratio:.2f} {'<=' if ok else 'NOT <='} {limit:.2f}"


def speed_verdict(times: dict[str, float], limit: float = SPEED_LIMIT) -> tuple[bool, str]:
    """The speed row's verdict on the median step times of ``eager``, ``eager compiled``,
    ``autopar`` and ``autopar compiled``: autopar against eager and compiled autopar against
    compiled eager, each at most ``limit`` times; the criterion and both ratios in words."""
    plain, plain_text = speed_ratio(times["autopar"], times["eager"], "eager", limit)
    compiled, compiled_text = speed_ratio(times["autopar compiled"], times["eager compiled"],
                                          "eager compiled", limit)
    return plain and compiled, (f"criterion: autopar/eager and compiled autopar/compiled "
                                f"eager <= {limit:.2f}, same run: {plain_text}; compiled "
                                f"{compiled_text}")


def exit_status(results: Iterable[str]) -> int:
    """The check's exit status from its rows' results: 0 when every row passed or was
    skipped, 1 otherwise (a row that failed, raised or was not run for want of budget)."""
    return 0 if all(result in (PASSED, SKIPPED) for result in results) else 1


def _gpt(layers=2, width=64, heads=4, vocab=128, seq=32, dropout=0.0, bias=True):
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                          block_size=seq, dropout=dropout, sdpa=True))
    if not bias:        # Adam follows the rounding noise of a fused qkv bias's zero grads
        for block in model.blocks:
            block.attn.qkv.register_parameter("bias", None)
    return model


def _batches(vocab: int, seq: int, rows: int, n: int, device: str) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (rows, seq), generator=g).to(device),
             torch.randint(0, vocab, (rows, seq), generator=g).to(device)) for _ in range(n)]


def _eager(model, batches, autocast: torch.dtype | None = None) -> list[float]:
    from autopar.models.gpt import lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    model.train()
    for step, (x, y) in enumerate(batches):
        torch.manual_seed(step)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _autopar(model, batches, yaml: str = "") -> tuple[list[float], object]:
    import autopar as ap
    from autopar.models.gpt import lm_loss
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(yaml or "{}"))
    losses = [engine.train_step(x, y) for x, y in batches]
    engine.sync_model()      # offloaded or moved state back into the model's own tensors
    return losses, engine


def _max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _params_close(a: torch.nn.Module, b: torch.nn.Module) -> str:
    worst = 0.0
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        pa, pb = pa.detach().float().cpu(), pb.detach().float().cpu()
        try:
            torch.testing.assert_close(pa, pb, rtol=RTOL, atol=ATOL)
        except AssertionError as err:
            return f"param {name} differs: {str(err).splitlines()[0]}"
        worst = max(worst, ((pa - pb).abs() / pb.abs().clamp_min(1e-12)).max().item())
    return f"params max rel {worst:.1e}"


def _parity(yaml: str = "", dropout: float = 0.0, layers: int = 2) -> tuple[bool, str]:
    model = _gpt(layers=layers, dropout=dropout, bias=False).cuda()
    ref = copy.deepcopy(model)
    batches = _batches(128, 32, 8, STEPS, "cuda")
    got, _ = _autopar(model, batches, yaml)
    want = _eager(ref, batches)
    ok = all(abs(g - w) <= ATOL + RTOL * abs(w) for g, w in zip(got, want))
    params = _params_close(model, ref)
    ok = ok and not params.startswith("param ")
    return ok, f"losses max rel {_max_rel(got, want):.1e}; {params}"


def row_serial() -> tuple[bool, str]:
    return _parity()


def row_dropout() -> tuple[bool, str]:
    return _parity(dropout=0.1)


def row_bf16() -> tuple[bool, str]:
    model = _gpt(bias=False).cuda()
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    batches = _batches(128, 32, 8, STEPS, "cuda")
    got, _ = _autopar(model, batches, "amp: {enable: true, dtype: bfloat16, level: O1}\n")
    want = _eager(ref, batches, autocast=torch.bfloat16)
    fp32 = _eager(ref32, batches)
    ours, eagers = _max_rel(got, want), _max_rel(want, fp32)
    # eager bf16's own distance from fp32 is the scale of bf16 noise on this model
    return ours <= max(eagers, 2.0 ** -8), (f"losses vs eager bf16 max rel {ours:.1e}; eager "
                                            f"bf16 vs eager fp32 {eagers:.1e}")


MEGATRON = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
            '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


def row_sim_dp_tp() -> tuple[bool, str]:
    return _parity("mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
                   f"tensor_parallel: {{axis: tp, plan: {MEGATRON}}}\n"
                   "debug: {simulate: true}\n")


def row_sim_pp() -> tuple[bool, str]:
    return _parity("mesh: {shape: [2], dim_names: [pp]}\n"
                   "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 4}\n"
                   "debug: {simulate: true}\n", layers=4)


def row_memory() -> tuple[bool, str]:
    import autopar as ap
    from autopar.models.gpt import lm_loss
    model = _gpt(layers=4, width=256, heads=8, vocab=1024, seq=256).cuda()
    x, y = _batches(1024, 256, 8, 1, "cuda")[0]
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.train_step(x, y)                       # state made, optimizer state too
    predicted = max(m.peak for m in engine.cost(x, y).values())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(x, y)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    error = predicted / measured - 1
    return abs(error) <= 0.10, (f"predicted {predicted / 2**20:.1f} MiB, max_memory_allocated "
                                f"{measured / 2**20:.1f} MiB ({100 * error:+.1f}%)")


def row_offload_parity() -> tuple[bool, str]:
    return _parity("sharding: {offload: {optimizer: true, params: true}}\n")


def _device_peak(yaml: str) -> tuple[int, int, int]:
    """(predicted device peak, measured max_memory_allocated, predicted host bytes) of a
    step of the memory row's GPT under ``yaml``."""
    import autopar as ap
    from autopar.models.gpt import lm_loss
    model = _gpt(layers=4, width=256, heads=8, vocab=1024, seq=256).cuda()
    x, y = _batches(1024, 256, 8, 1, "cuda")[0]
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(yaml or "{}"))
    engine.train_step(x, y)
    estimate = engine.cost(x, y)[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(x, y)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    del engine, model
    torch.cuda.empty_cache()
    return estimate.peak, measured, estimate.host


def row_offload_memory() -> tuple[bool, str]:
    _, kept, _ = _device_peak("")
    predicted, measured, host = _device_peak(
        "sharding: {offload: {optimizer: true, params: true}}\n")
    error = predicted / measured - 1
    return abs(error) <= 0.10 and measured < kept, (
        f"device peak {kept / 2**20:.1f} -> {measured / 2**20:.1f} MiB offloaded (predicted "
        f"{predicted / 2**20:.1f}, {100 * error:+.1f}%; host {host / 2**20:.1f} MiB)")


def _median_step(step: Callable[[], object], n: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def row_speed() -> tuple[bool, str]:
    import autopar as ap
    from autopar.models.gpt import lm_loss
    seq, rows = 1024, 8
    x, y = _batches(50304, seq, rows, 1, "cuda")[0]
    out = {}
    for name in ("eager", "eager compiled", "autopar", "autopar compiled"):
        model = _gpt(layers=12, width=768, heads=12, vocab=50304, seq=seq).cuda().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        start = time.perf_counter()
        if name.startswith("eager"):
            fwd = torch.compile(model) if name == "eager compiled" else model

            def step(fwd=fwd, opt=opt):
                opt.zero_grad(set_to_none=True)
                lm_loss(fwd(x), y).backward()
                opt.step()
        else:
            yaml = "compile: {enable: true}\n" if name == "autopar compiled" else "{}"
            engine = ap.Engine(model, lm_loss, opt, strategy=ap.Strategy.from_yaml_str(yaml))

            def step(engine=engine):
                engine.train_step(x, y)
        step()
        first = time.perf_counter() - start
        out[name] = (_median_step(step), first)
        del model, opt
        torch.cuda.empty_cache()
    params = sum(p.numel() for p in _gpt(12, 768, 12, 50304, seq).parameters()) / 1e6
    eager = out["eager"][0]
    text = "; ".join(f"{k} {v[0] * 1e3:.1f} ms ({v[0] / eager:.2f}x eager, first step "
                     f"{v[1]:.0f} s)" for k, v in out.items())
    ok, verdict = speed_verdict({k: v[0] for k, v in out.items()})
    return ok, f"GPT {params:.0f}M bf16, batch {rows}x{seq}: {text}; {verdict}"


def row_calibrate() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--quick",
                               "--processes", "1", "--out", str(Path(tmp) / "p.json")],
                              capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - start
        lines = (done.stdout + done.stderr).strip().splitlines()
        machine = next((ln for ln in lines if "profile" in ln.lower()), lines[-1] if lines
                       else "")
        return done.returncode == 0, f"{took:.0f} s, exit {done.returncode}: {machine[:150]}"


ROWS: list[tuple[str, Callable[[], tuple[bool, str]], bool]] = [
    ("serial fp32 parity vs eager", row_serial, False),
    ("dropout masks equal eager's", row_dropout, False),
    ("bf16 O1 vs eager autocast", row_bf16, False),
    ("simulator dp2 x tp2 vs eager", row_sim_dp_tp, False),
    ("simulator pp2 1F1B vs eager", row_sim_pp, False),
    ("memory estimate vs max_memory_allocated", row_memory, False),
    ("offload (optimizer + params) parity vs eager", row_offload_parity, False),
    ("offload: device peak vs kept, estimate", row_offload_memory, False),
    ("calibration (--quick)", row_calibrate, False),
    ("125M GPT bf16 step time", row_speed, True),
]


def run_rows(rows: list[tuple[str, Callable[[], tuple[bool, str]], bool]], budget_s: float,
             skip_big: bool = False) -> list[str]:
    """Run ``rows`` (name, row, big) in order, each in its own try, printing a table line
    per row; a row that would start past ``budget_s`` seconds is not run. Their results."""
    results = []
    start = time.perf_counter()
    for name, row, big in rows:
        if big and skip_big:
            results.append(SKIPPED)
            print(f"| {name} | {SKIPPED} | --skip-big | - |", flush=True)
            continue
        if time.perf_counter() - start > budget_s:
            results.append("not run")
            print(f"| {name} | not run | budget of {budget_s:.0f} s spent | - |", flush=True)
            continue
        began = time.perf_counter()
        try:
            ok, detail = row()
            result = PASSED if ok else "FAIL"
        except Exception as err:       # a failing row is a result, the next one runs
            result = "ERROR"
            where = traceback.extract_tb(err.__traceback__)[-1]
            detail = (f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]} "
                      f"({Path(where.filename).name}:{where.lineno})")
        torch.cuda.empty_cache()
        results.append(result)
        print(f"| {name} | {result} | {detail.replace('|', '/')} | "
              f"{time.perf_counter() - began:.0f} |", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--skip-big", action="store_true", help="leave out the 125M GPT")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing "
              "to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False      # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    print(f"gpu_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {props.name}, "
          f"{props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)\n")
    print("| check | result | detail | s |\n|---|---|---|---|")
    results = run_rows(ROWS, args.budget_s, args.skip_big)
    status = exit_status(results)
    print(f"\ngpu_check: {len(results)} rows, {results.count(PASSED)} passed, "
          f"{results.count(SKIPPED)} skipped: exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())

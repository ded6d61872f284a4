"""Compiled programs (``compile:``, runtime/compiled.py): every program through
``torch.compile`` (Inductor), forward, backward and optimizer update as one graph.

In fp32, parity is judged against what torch.compile itself does to the same model,
measured in the same test: an eager training loop, and the same loop with its step under
``torch.compile``; compiled autopar must stay within twice torch.compile's own deviation
from eager (losses and parameters; at least a few fp32 ulps). Serial steps (our GPT and MLP,
a CNN with BatchNorm, HF Llama, HF GPT-2 with dict inputs), gradient merge, recompute with
dropout in process; dp, tp with sequence parallelism, ZeRO-3, 1F1B, recompute and ring
attention on two real gloo ranks. Evaluate and predict equal the same model's uncompiled
values within fp32's rounding bound; amp O1 (bf16) on two real gloo ranks is within bf16's
rounding bound of the same plan uncompiled (``tests/parity.py`` ``rounding_bound``: derived
from the dtype and the count of roundings, not from a measurement on this CPU). Also: the
overlap of collectives in Inductor's code; refusals that name the op; the compile cache
directory.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import autopar as ap
from autopar.models import MLP
from autopar.models.gpt import lm_loss
from autopar.runtime import CompileError, CompileNote

from ..multiproc import run_ranks
from ..parity import (  # noqa: F401  (one_thread: a fixture pytestmark uses)
    gpt_optimizer,
    lm_data,
    one_thread,
    parity_gpt,
    rounding_bound,
)

pytestmark = pytest.mark.usefixtures("one_thread")

COMPILE = {"compile": {"enable": True}}
EPS = torch.finfo(torch.float32).eps
# the least deviation any bound allows: a few float32 ulps (torch.compile may match eager
# exactly on one CPU and by one ulp on another)
FLOOR = 4 * EPS


def _mlp():
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), None


def _gpt(dropout: float = 0.1, scheduled: bool = True):
    model = parity_gpt("adamw", layers=1, dropout=dropout)
    optimizer, scheduler = gpt_optimizer("adamw", model)
    return model, optimizer, scheduler if scheduled else None


CASES = {"mlp": (_mlp, F.mse_loss, lambda: [(torch.randn(16), torch.randn(8))
                                             for _ in range(32)]),
         "gpt": (_gpt, lm_loss, lambda: lm_data(32, 16, 64))}


def _eager(make, loss_fn, data, compiled: bool, loss_of=None
           ) -> tuple[list[float], torch.nn.Module]:
    """The eager loop over batches of 4 samples (dict inputs stacked key by key), its step
    under torch.compile when ``compiled`` (random ops drawn as eager draws them, as
    autopar's compiled programs draw them). ``loss_of(model, x, y)``: a model that computes
    its own loss."""
    model, optimizer, scheduler = make()
    loss_of = loss_of or (lambda m, x, y: loss_fn(m(x), y))

    def step(x, y):
        optimizer.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    if compiled:
        # every test's loop is this code object: without a reset, Dynamo's recompile limit
        # would (after a few tests) run it eagerly, and its deviation would read 0
        torch._dynamo.reset()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    run = torch.compile(step, options={"fallback_random": True}) if compiled else step
    losses = []
    for i in range(0, len(data), 4):
        xs, ys = zip(*data[i:i + 4])
        x = ({k: torch.stack([s[k] for s in xs]) for k in xs[0]} if isinstance(xs[0], dict)
             else torch.stack(xs))
        torch.manual_seed(i // 4)          # the engine's stream for batch i
        losses.append(run(x, torch.stack(ys)).item())
        if scheduler is not None:
            scheduler.step()
    assert not compiled or torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    return losses, model


def _autopar(make, loss_fn, data, strategy: dict, **fit) -> tuple[ap.Engine, list[float]]:
    model, optimizer, scheduler = make()
    engine = ap.Engine(model, loss_fn, optimizer, strategy=ap.Strategy(**strategy),
                       lr_scheduler=scheduler)
    return engine, engine.fit(data, batch_size=4, verbose=0, **fit)["loss"]


def _deviation(losses, model, want_losses, want_model) -> tuple[float, float]:
    """(largest relative loss deviation, largest relative L2 deviation of a parameter)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    params = max(((p - q).norm() / q.norm()).item()
                 for p, q in zip(model.parameters(), want_model.parameters()))
    return loss, params


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_steps_deviate_from_eager_as_torch_compile_does(case, capsys):
    """Eager, eager under torch.compile, and autopar compiled: autopar's deviation from
    eager within twice torch.compile's (the GPT with dropout 0.1 under an LR warmup, whose
    moving learning rate compiles the step at most twice)."""
    make, loss_fn, make_data = CASES[case]
    data = make_data()
    want = _eager(make, loss_fn, data, compiled=False)
    theirs = _deviation(*_eager(make, loss_fn, data, compiled=True), *want)
    engine, losses = _autopar(make, loss_fn, data, COMPILE)
    ours = _deviation(losses, engine.model, *want)
    with capsys.disabled():
        print(f"\n{case}: deviation from eager (loss, params): torch.compile {theirs[0]:.2e}, "
              f"{theirs[1]:.2e}; compiled autopar {ours[0]:.2e}, {ours[1]:.2e}; compile "
              f"{sum(engine.history['compile_s']):.1f} s")
    for mine, torchs in zip(ours, theirs):
        assert mine <= max(2 * torchs, FLOOR)
    assert 1 <= len(engine.history["compile_s"]) <= 2
    # engine.cost says what the step's compiling took (None for a step not run yet)
    x, y = (torch.stack(t) for t in zip(*data[:4]))
    assert engine.cost(x, y).compile_s == pytest.approx(sum(engine.history["compile_s"]))
    assert engine.cost(x[:2], y[:2]).compile_s is None


def test_gradient_merge_evaluate_and_predict_run_compiled():
    """Gradient merge's pair of programs, evaluate and predict: each compiled once; training
    within the bound above of the same run uncompiled. Evaluate and predict against the same
    trained model uncompiled: predict equal (the compiled forward calls the same addmm
    kernels, and relu rounds nothing), each batch's loss within fp32's rounding bound of its
    mean squared error summed in two orders: per order the difference and the square of
    each of the 32 terms and the 31 additions (non-negative terms: no cancellation), so the
    mean over the batches too."""
    make, loss_fn, make_data = CASES["mlp"]
    data = make_data()
    merge = {"gradient_merge": {"k_steps": 2}}
    plain, want = _autopar(make, loss_fn, data, merge)
    engine, got = _autopar(make, loss_fn, data, {**merge, **COMPILE})
    assert len(engine.history["compile_s"]) == 2          # accumulate, apply
    theirs = _deviation(*_eager(make, loss_fn, data, True), *_eager(make, loss_fn, data, False))
    ours = _deviation(got, engine.model, want, plain.model)
    for mine, torchs in zip(ours, theirs):
        assert mine <= max(2 * torchs, FLOOR)
    uncompiled = ap.Engine(engine.model, loss_fn)
    loss = engine.evaluate(data[:8], batch_size=4)["loss"]
    want_loss = uncompiled.evaluate(data[:8], batch_size=4)["loss"]
    assert abs(loss - want_loss) <= rounding_bound(2 * (2 + 31), torch.float32) * want_loss
    predicted = engine.predict([x for x, _ in data[:8]], batch_size=4)
    want_predicted = uncompiled.predict([x for x, _ in data[:8]], batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(predicted, want_predicted, strict=True))
    assert len(engine.history["compile_s"]) == 4          # and evaluate's, predict's
    assert "compile_s" not in uncompiled.history


# (config, dropout) trained on two real gloo ranks, compiled and not, one launch for each
REAL_RANKS = ["dp:0.1", "tp_sp:0.1", "dp_zero3:0.1", "pp_1f1b:0.1", "dp_recompute:0.1",
              "cp_ring:0"]


def _state_deviation(got: dict, want: dict) -> float:
    return max(((got[k].double() - w.double()).norm() / w.double().norm()).item()
               for k, w in want.items() if w.is_floating_point() and w.norm() > 0)


@pytest.mark.slow
def test_compiled_programs_on_real_ranks_train_as_uncompiled_ones(capsys):
    """dp (bucketed all-reduce starts), tp with sequence parallelism (reduce-scatter,
    all-gather), ZeRO-3 (prefetched gathers, early reduce-scatters), 1F1B (job programs,
    messages between them, the post job in segments), recompute and ring attention (its
    operators and p2p shifts) on two gloo ranks: compiled within twice torch.compile's own
    deviation from eager on the same model (measured here, at least a few fp32 ulps)."""
    plain = run_ranks("train_compiled", 2, "6", "4", "0", *REAL_RANKS, timeout=600)
    compiled = run_ranks("train_compiled", 2, "6", "4", "1", *REAL_RANKS, timeout=600)
    data = lm_data(24, 16, 64)
    theirs = {}
    for dropout in (0.0, 0.1):
        make = lambda: _gpt(dropout, scheduled=False)  # noqa: E731  (as the ranks train)
        theirs[dropout] = _deviation(*_eager(make, lm_loss, data, compiled=True),
                                     *_eager(make, lm_loss, data, compiled=False))
    for run in REAL_RANKS:
        config, dropout = run.split(":")
        bound = [max(2 * t, FLOOR) for t in theirs[float(dropout)]]
        for rank in range(2):
            got, want = compiled[rank][run], plain[rank][run]
            assert len(got["compile_s"]) == 1 and not want["compile_s"], run
            loss = max(abs(a - b) / abs(b) for a, b in zip(got["loss"], want["loss"]))
            assert loss <= bound[0], (run, rank, loss, bound)
            params = _state_deviation(got["state"], want["state"])
            assert params <= bound[1], (run, rank, params, bound)
        with capsys.disabled():
            print(f"\n{run}: compiled vs uncompiled (loss, params) {loss:.1e}, {params:.1e}; "
                  f"bound {bound[0]:.1e}, {bound[1]:.1e}; compile {sum(got['compile_s']):.1f} s")


# The one-layer GPT's longest chains of bf16 roundings under O1, read off its program: 10 in
# the forward (ln1's, ln2's and ln_f's outputs cast; the qkv, proj, fc1, fc2 and head
# contractions; attention; gelu) and 20 to the deepest gradient (tests/passes/test_amp.py). dp
# splits only weight-gradient contractions, each rank's half rounded once and summed in
# fp32, exactly. Compiled, Inductor calls the same extern kernels (mm, addmm, attention and
# its backward), each storing its bf16 result as uncompiled, and a fused kernel computes in
# fp32 and rounds only what it stores: its chains are no longer.
AMP_FORWARD_CHAIN, AMP_CHAIN = 10, 20


@pytest.mark.slow
def test_compiled_amp_o1_on_real_ranks_within_bf16_rounding_of_uncompiled(capsys):
    """dp2 under bf16 amp O1 on two gloo ranks, the one-layer GPT, compiled against the same
    plan uncompiled: Inductor sums in other orders (its fused layer norms, cross-entropy,
    bias gradients) and keeps a fused kernel's intermediates in fp32, which moves the bf16
    roundings after them, so no eager run rounds as it does. The bound is bf16's over both
    runs' chains of roundings
    (``rounding_bound``): each loss within gamma of the two forward chains (20 roundings,
    8.5e-2 relative), every parameter's movement within gamma of the two whole chains (40,
    0.19 of what training moved: AdamW's update is invariant to its gradients' scale). A
    compiled step at half the learning rate moves the parameters 0.5 off, one that does
    not update 1."""
    run = "dp_amp:0:O1"
    plain = run_ranks("train_compiled", 2, "6", "4", "0", run, timeout=600)
    compiled = run_ranks("train_compiled", 2, "6", "4", "1", run, timeout=600)
    init = parity_gpt("adamw", layers=1).state_dict()
    loss_bound = rounding_bound(2 * AMP_FORWARD_CHAIN, torch.bfloat16)
    params_bound = rounding_bound(2 * AMP_CHAIN, torch.bfloat16)
    for rank in range(2):
        got, want = compiled[rank][run], plain[rank][run]
        assert len(got["compile_s"]) == 1 and not want["compile_s"]
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["loss"], want["loss"], strict=True))
        assert loss <= loss_bound, (rank, loss, loss_bound)
        params = _update_deviation(got["state"], want["state"], init)
        assert params <= params_bound, (rank, params, params_bound)
    with capsys.disabled():
        print(f"\n{run}: compiled vs uncompiled, loss {loss:.1e} (bound {loss_bound:.1e}), "
              f"parameters' movement {params:.1e} (bound {params_bound:.2f}); compile "
              f"{sum(got['compile_s']):.1f} s")


def _update_deviation(got: dict, want: dict, init: dict) -> float:
    """The largest over parameters of ||p - p_want|| / ||p_want - p_init||: how much of what
    training moved, it moved differently (the tied head is the embedding, under one
    name)."""
    assert want.keys() <= init.keys()
    return max(((got[k].double() - w.double()).norm()
                / (w.double() - init[k].double()).norm()).item() for k, w in want.items())


def test_simulated_plans_are_refused_or_run_uncompiled_with_a_warning():
    config = "pp_1f1b"
    sections = ap.Strategy.from_yaml(f"configs/{config}.yaml").model_dump(
        exclude={"debug"}, exclude_unset=True)
    make, loss_fn, make_data = CASES["gpt"]
    simulated = {**sections, "debug": {"simulate": True}}
    with pytest.raises(CompileError, match="is not compiled: compiled programs run on real"):
        _autopar(make, loss_fn, make_data()[:8], {**simulated, **COMPILE})
    eager = {"compile": {"enable": True, "fallback": "eager"}}
    with pytest.warns(CompileNote, match="it runs uncompiled"):
        _, got = _autopar(make, loss_fn, make_data()[:8], {**simulated, **eager})
    assert got == _autopar(make, loss_fn, make_data()[:8], simulated)[1]


def test_a_program_the_compiler_refuses_names_the_op(monkeypatch):
    """A kernel Dynamo cannot trace (here relu's, made to read a tensor's values into Python
    first): the error names the op of the failing line; ``fallback: eager`` warns and
    trains uncompiled, like the plan without compile."""
    from autopar.runtime import codegen

    def untraceable(target: str):
        if target != "aten.relu.default":
            return resolve(target)

        def relu(x):
            x.tolist()            # a graph break: fullgraph cannot compile past it
            return torch.relu(x)
        return relu
    resolve = codegen.resolve
    monkeypatch.setattr(codegen, "resolve", untraceable)
    make, loss_fn, make_data = CASES["mlp"]
    data = make_data()[:8]
    with pytest.raises(CompileError, match=r"failed at op aten\.relu\.default .*"
                                           r"Unsupported.*fallback: eager"):
        _autopar(make, loss_fn, data, COMPILE)
    eager = {"compile": {"enable": True, "fallback": "eager"}}
    with pytest.warns(CompileNote, match=r"aten\.relu\.default .*it runs uncompiled"):
        _, got = _autopar(make, loss_fn, data, eager)
    assert got == _autopar(make, loss_fn, data, {})[1]


@pytest.mark.slow
def test_recompute_with_dropout_compiles_and_redraws_its_masks(capsys):
    """Recompute of blocks with dropout: Dynamo cannot read or set the generator, so each
    random op draws from eager's state at it, fed by the runtime, and a recomputed one from
    its original's (``run_with_rng_state``); compiled within the bound above of the same
    plan uncompiled (which equals eager bit for bit)."""
    make, loss_fn, make_data = CASES["gpt"]
    data = make_data()[:16]
    recompute = {"recompute": {"enable": True}}
    plain, want = _autopar(make, loss_fn, data, recompute)
    engine, got = _autopar(make, loss_fn, data, {**recompute, **COMPILE})
    theirs = _deviation(*_eager(make, loss_fn, data, True), *_eager(make, loss_fn, data, False))
    ours = _deviation(got, engine.model, want, plain.model)
    with capsys.disabled():
        print(f"\nrecompute: compiled vs uncompiled {ours[0]:.1e}, {ours[1]:.1e}; "
              f"torch.compile vs eager {theirs[0]:.1e}, {theirs[1]:.1e}")
    for mine, torchs in zip(ours, theirs):
        assert mine <= max(2 * torchs, FLOOR)


def test_compiled_graphs_go_to_the_cache_dir(tmp_path, monkeypatch):
    """Inductor keeps what it compiled in ``compile.cache_dir`` (a restarted run reads it
    back instead of compiling again), not where the environment said before."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    make, loss_fn, make_data = CASES["mlp"]
    cache = tmp_path / "inductor"
    _autopar(make, loss_fn, make_data()[:8],
             {"compile": {"enable": True, "cache_dir": str(cache)}})
    assert any(p.is_file() for p in cache.rglob("*"))
    assert not (tmp_path / "elsewhere").exists()


def _ir_overlaps(dump: str) -> int:
    """Asynchronous collectives of a rank's program dump with compute between their start
    and their wait."""
    lines = dump.splitlines()
    started = {m.group(1): i for i, line in enumerate(lines)
               if (m := re.match(r"(%\d+): !comm.handle = comm\.\w+_start\(", line))}
    count = 0
    for handle, start in started.items():
        wait = next(i for i, line in enumerate(lines) if f"comm.wait({handle})" in line)
        count += any(re.search(r"= (aten|optim)\.", line) for line in lines[start + 1:wait])
    return count


def _compiled_overlaps(code: str) -> int:
    """The same in Inductor's code of the program's first graph: collectives (functional,
    so a start names its buffer) with a kernel between start and ``wait_tensor``."""
    lines = code.split("# ---- graph 1")[0].splitlines()
    started = {}
    for i, line in enumerate(lines):
        made = re.match(r"\s+(buf\d+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|"
                        r"reduce_scatter_tensor|all_to_all_single)\.", line)
        reduced = re.match(r"\s+torch\.ops\._c10d_functional\.all_reduce_\.default\("
                           r"(?:reinterpret_tensor\()?(buf\d+)", line)
        if made or reduced:
            started[(made or reduced).group(1)] = i
    count = 0
    for buf, start in started.items():
        wait = next(i for i, line in enumerate(lines) if i > start and re.search(
            rf"wait_tensor\.default\((?:reinterpret_tensor\()?{buf}\b", line))
        count += any(re.match(r"\s+(extern_kernels\.\w+|cpp_fused_\w+)\(", line)
                     for line in lines[start + 1:wait])
    return count


@pytest.mark.slow
def test_compiled_code_keeps_the_overlap_the_passes_placed(tmp_path):
    """ZeRO-3 on two ranks (prefetched gathers, early reduce-scatters, the loss's
    all-reduce): in Inductor's code of each rank's program (dumped next to the passes'
    dumps) as many collectives have kernels between their start and their wait as the
    program has compute between them, not fewer (Inductor's own order starts some next to
    their wait)."""
    run_ranks("compiled_dump", 2, "dp_zero3", str(tmp_path), timeout=600)
    for rank in range(2):
        folder = tmp_path / f"rank{rank}"
        [program] = folder.glob("[0-9][0-9]_partition.txt")      # the training step's
        [code] = folder.glob("[0-9][0-9]_compiled_program.py")
        planned, compiled = _ir_overlaps(program.read_text()), _compiled_overlaps(code.read_text())
        assert planned >= 4 and compiled >= planned, (rank, planned, compiled)


def _cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _hf(kind: str):
    from .. import models_zoo as zoo
    torch.manual_seed(0)
    model = (zoo.hf_llama if kind == "llama" else zoo.hf_gpt2)("sdpa", 64).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _third_party(name: str):
    """(make, loss_fn, samples, eager loss of a batch): a CNN with BatchNorm (running
    statistics updated in place), HF Llama and HF GPT-2 (dict inputs, their own loss)."""
    g = torch.Generator().manual_seed(1)
    if name == "cnn":
        samples = [(torch.randn(3, 8, 8, generator=g), torch.randint(0, 10, (), generator=g))
                   for _ in range(16)]
        return _cnn, F.cross_entropy, samples, lambda m, x, y: F.cross_entropy(m(x), y)
    ids = torch.randint(0, 64, (16, 16), generator=g)
    samples = [({"input_ids": row}, row) for row in ids]
    return (lambda: _hf(name)), None, samples, \
        lambda m, x, y: m(input_ids=x["input_ids"], labels=y).loss


def _third_party_eager(name: str, compiled: bool) -> tuple[list[float], torch.nn.Module]:
    make, loss_fn, samples, loss_of = _third_party(name)
    return _eager(lambda: (*make(), None), loss_fn, samples, compiled, loss_of=loss_of)


def _with_buffers(deviation: tuple[float, float], model, want) -> tuple[float, float]:
    """``deviation`` with the floating buffers (BatchNorm's running statistics) counted."""
    buffers = [((b - w).norm() / w.norm()).item() for b, w in
               zip(model.buffers(), want.buffers()) if b.is_floating_point() and w.norm() > 0]
    return deviation[0], max([deviation[1], *buffers])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "llama", "gpt2"])
def test_third_party_models_compile_as_torch_compile_does(name, capsys):
    if name != "cnn":
        pytest.importorskip("transformers")
    make, loss_fn, samples, _ = _third_party(name)
    want = _third_party_eager(name, compiled=False)
    theirs_run = _third_party_eager(name, compiled=True)
    theirs = _with_buffers(_deviation(*theirs_run, *want), theirs_run[1], want[1])
    model, optimizer = make()
    engine = ap.Engine(model, loss_fn, optimizer, strategy=ap.Strategy(**COMPILE))
    losses = engine.fit(samples, batch_size=4, verbose=0)["loss"]
    ours = _with_buffers(_deviation(losses, model, *want), model, want[1])
    with capsys.disabled():
        print(f"\n{name}: deviation from eager (loss, params+buffers): torch.compile "
              f"{theirs[0]:.1e}, {theirs[1]:.1e}; compiled autopar {ours[0]:.1e}, {ours[1]:.1e}")
    for mine, torchs in zip(ours, theirs):
        assert mine <= max(2 * torchs, FLOOR)
    # once; SGD's momentum buffers start as None, so its first step is a program of its own
    assert len(engine.history["compile_s"]) == (2 if name == "cnn" else 1)

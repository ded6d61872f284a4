"""Models built on the meta device: planned from shapes, each process materializing only its
pieces with eager's numbers at their positions, never a whole sharded parameter."""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import autopar as ap
import autopar.state.piece_init as piece_init
from autopar.ir import StateKey
from autopar.ir.dist import DistAttr, ProcessMesh, Replicate, Shard, shard_tensor_local
from autopar.lower.executable import StatePiece
from autopar.models import GPT, MLP, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.state.meta_init import MetaInit, MetaInitError, MetaInitNote
from autopar.state.piece_init import PieceIndex, draw_into

from ..parity import assert_same_losses, assert_same_params, eager_train, gpt_optimizer, lm_data

MESH = ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
PLACEMENTS = [(Shard(0), Replicate()), (Shard(0), Shard(0)), (Replicate(), Shard(1)),
              (Shard(1), Shard(0)), (Shard(0, groups=(2, 1, 1)), Replicate())]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 elements, so small tensors cross many chunk boundaries."""
    monkeypatch.setattr(piece_init, "CHUNK", 64)


FILLS = {"uniform": lambda t: t.uniform_(-0.5, 0.5), "normal": lambda t: t.normal_(0.1, 0.02)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(12, 3), (40, 9), (17, 31), (64, 65), (8, 2)])
@pytest.mark.parametrize("fill", sorted(FILLS))
def test_a_piece_draws_eagers_numbers_and_leaves_the_generator_where_eager_does(
        small_chunks, dtype, shape, fill):
    draw = FILLS[fill]
    for placements in PLACEMENTS:
        for coordinate in itertools.product(range(2), range(2)):
            try:
                index = PieceIndex.of(shape, MESH, placements, coordinate)
            except ValueError:
                continue                     # groups that do not divide this shape
            torch.manual_seed(3)
            whole = torch.empty(shape, dtype=dtype)
            draw(whole)
            after = torch.rand(2)
            torch.manual_seed(3)
            piece = torch.empty(index.local_shape, dtype=dtype)
            draw_into(piece, index, draw)
            assert torch.equal(torch.rand(2), after)
            assert torch.equal(piece, shard_tensor_local(whole, MESH, placements, coordinate))


def _pieces_equal(meta_init: MetaInit, model: nn.Module, reference: nn.Module,
                  placements=(Shard(0), Replicate())) -> None:
    want = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for coordinate in itertools.product(range(2), range(2)):
        wanted = {n: StatePiece(StateKey.of_param(n), tuple(t.shape), t.dtype,
                                _fitted(placements, t.shape), coordinate)
                  for n, t in model.named_parameters()}
        before = torch.random.get_rng_state()
        got = meta_init.pieces(wanted)
        assert torch.equal(torch.random.get_rng_state(), before)   # the caller's generator
        for name, piece in wanted.items():
            expected = shard_tensor_local(want[name].detach(), MESH, piece.dist.placements,
                                          coordinate)
            assert torch.equal(got[name], expected), name


def _fitted(placements, shape) -> DistAttr:
    """``placements`` where they fit a tensor of ``shape`` (else replicated on that dim)."""
    fitted = []
    for p in placements:
        if p.is_shard() and (p.dim >= len(shape) or (p.grouped and shape[p.dim] % 8)):
            p = Replicate()
        fitted.append(p)
    return DistAttr(MESH, tuple(fitted)).check(shape)


def _layers(device: str) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(nn.Embedding(50, 12, padding_idx=3), nn.Linear(12, 30),
                             nn.LayerNorm(30), nn.Linear(30, 8))


def test_reset_parameters_in_module_order_is_the_constructors_init(small_chunks):
    """No init path given: each submodule's reset_parameters(), in modules() order, draws
    what building the model on the CPU drew (padding row zeroed through a view)."""
    torch.manual_seed(5)
    reference = _layers("cpu")
    torch.manual_seed(5)
    model = _layers("meta")
    meta_init = MetaInit(model)
    torch.rand(7)                                # the generator moves on: init does not care
    _pieces_equal(meta_init, model, reference)
    _pieces_equal(meta_init, model, reference, (Shard(0), Shard(1)))
    assert all(p.is_meta for p in model.parameters())


def _gpt(device: str, dropout: float = 0.0) -> GPT:
    with torch.device(device):
        return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=8,
                             dropout=dropout))


def _eager_init(model: nn.Module, seed: int, init=None) -> nn.Module:
    """What the contract promises: to_empty, then the init path, eagerly, seeded."""
    model.to_empty(device="cpu")
    if isinstance(model, GPT):
        model.head.weight = model.wte.weight      # to_empty unties (torch's own caveat)
    torch.manual_seed(seed)
    with torch.no_grad():
        (init or (lambda m: m.init_weights()))(model)
    return model


def test_init_weights_of_a_tied_gpt(small_chunks):
    torch.manual_seed(0)
    model = _gpt("meta")
    meta_init = MetaInit(model)
    reference = _eager_init(_gpt("meta"), 0)
    assert model.head.weight is model.wte.weight
    _pieces_equal(meta_init, model, reference)
    _pieces_equal(meta_init, model, reference, (Shard(0, groups=(2, 1, 1)), Replicate()))


def _vit_style(model: nn.Module) -> None:
    """Inits a piece cannot follow: trunc_normal_'s rejection loop reads the values,
    orthogonal_ takes a QR of the whole."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.orthogonal_(module.weight)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def test_inits_that_need_the_whole_draw_it_one_tensor_at_a_time(small_chunks):
    torch.manual_seed(2)
    model = _layers("meta")
    with pytest.warns(MetaInitNote, match=r"0\.weight \(aten\.new_empty.*1\.weight"):
        meta_init = MetaInit(model, _vit_style)
    _pieces_equal(meta_init, model, _eager_init(_layers("meta"), 2, _vit_style))


def test_no_process_allocates_a_whole_sharded_parameter():
    """Counted by the profiler: while a process draws its quarter of three 512 x 512
    weights, no allocation reaches a whole weight's bytes."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512))
    meta_init = MetaInit(model)
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    wanted = {n: StatePiece(StateKey.of_param(n), tuple(t.shape), t.dtype,
                            DistAttr(mesh, (Shard(0),)), (1,))
              for n, t in model.named_parameters()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        pieces = meta_init.pieces(wanted)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    smallest_weight = min(t.numel() * t.element_size() for n, t in model.named_parameters()
                          if n.endswith("weight"))
    assert 0 < largest < smallest_weight
    held = sum(p.numel() * p.element_size() for p in pieces.values())
    whole = sum(t.numel() * t.element_size() for t in model.parameters())
    assert held == whole / 4


def test_a_meta_model_without_an_init_path_names_the_module():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(Scaled())
    with pytest.raises(MetaInitError, match=r"never writes 1 of its tensors: '0\.gain' "
                                            r"\(module '0': Scaled\)"):
        ap.Engine(model, lambda out, y: out.sum(), torch.optim.SGD(model.parameters(), lr=0.1))


def test_init_fn_is_only_for_meta_models_and_must_not_replace_parameters():
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="no meta tensors"):
        ap.Engine(model, init_fn=lambda m: None)
    with torch.device("meta"):
        model = nn.Linear(3, 3)

    def replace(m):
        m.weight = nn.Parameter(torch.zeros(3, 3))
        nn.init.zeros_(m.bias)

    with pytest.raises(MetaInitError, match="replaced parameter 'weight'"):
        ap.Engine(model, init_fn=replace)


STRATEGIES = {
    "serial": "{}",
    "dp2_zero3": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                 "sharding: {stage: 3, axis: dp}\ndebug: {simulate: true}\n",
    "dp2_tp2": "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
               "tensor_parallel: {axis: tp, plan: {\"blocks.*.fc1\": colwise, "
               "\"blocks.*.fc2\": rowwise}}\nsharding: {stage: 2, axis: dp}\n"
               "debug: {simulate: true}\n",
}


@pytest.mark.parametrize("config", sorted(STRATEGIES))
def test_a_meta_gpt_trains_with_eagers_losses(config):
    steps, batch = 4, 4
    data = lm_data(steps * batch, 8, 64)
    torch.manual_seed(0)
    model = _gpt("meta", dropout=0.1)
    engine = ap.Engine(model, lm_loss, gpt_optimizer("sgd", model)[0],
                       strategy=ap.Strategy.from_yaml_str(STRATEGIES[config]))
    reference = _eager_init(_gpt("meta", dropout=0.1), 0)    # seeded as the engine was
    got = engine.fit(data, batch_size=batch, verbose=0)["loss"]
    want = eager_train(reference, lm_loss, gpt_optimizer("sgd", reference)[0], data, batch,
                       steps)
    assert_same_losses(got, want)
    assert_same_params(model, reference)


def test_default_path_matches_a_model_built_on_the_cpu():
    """An MLP of plain layers: building it on meta and letting the engine init it gives
    the model the same seed builds on the CPU."""
    torch.manual_seed(4)
    reference = MLP(16, 30, 6, depth=2)
    torch.manual_seed(4)
    with torch.device("meta"):
        model = MLP(16, 30, 6, depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MetaInitNote)
        engine = ap.Engine(model, nn.functional.mse_loss,
                           torch.optim.SGD(model.parameters(), lr=0.1))
    engine.prepare(torch.randn(4, 16), torch.randn(4, 6))
    assert all(p.is_meta for p in model.parameters())     # planning needs no memory
    engine.evaluate([(torch.randn(16), torch.randn(6))], batch_size=1)
    assert_same_params(model, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3", "pp2"])
def test_a_meta_gpt_on_real_ranks_draws_only_its_pieces_and_trains_like_eager(layout):
    """Two torchrun ranks, ZeRO-3 over dp2 or a 1F1B pipeline: the model stays on meta,
    each rank holds about half the parameters, no allocation while making the executor
    reaches a whole fc1 weight under ZeRO-3 (nor exceeds it in a pipeline), and 20 steps
    (dropout 0.1, tied head) give eager's losses and parameters."""
    from ..multiproc import run_ranks
    steps, batch = 20, 4
    results = run_ranks("train_meta", 2, layout, str(steps))
    torch.manual_seed(0)
    reference = _eager_init(_gpt_for_ranks(), 0)
    want = eager_train(reference, lm_loss, gpt_optimizer("sgd", reference)[0],
                       lm_data(steps * batch, 16, 65), batch, steps)
    whole = sum(t.numel() * t.element_size() for t in reference.parameters())
    fc1 = reference.blocks[0].fc1.weight
    tied = reference.wte.weight.numel() * 4      # a pipeline keeps it on both stages
    for result in results:
        assert result["still_meta"]
        assert_same_losses(result["loss"], want)
        for name, value in reference.state_dict().items():
            if name in result["state"]:
                torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6)
        assert sum(result["held"].values()) <= whole / 2 + tied
        # ZeRO-3 cuts every weight: no allocation is a whole one; a pipeline stage holds
        # its layers whole (and nothing of the other stage's)
        limit = fc1.numel() * fc1.element_size() - (layout == "zero3")
        assert 0 < result["largest_alloc"] <= limit


def _gpt_for_ranks() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=65, block_size=16,
                             dropout=0.1))


def test_a_meta_hugging_face_llama_trains_like_eager_under_zero3_and_tp():
    """Hugging Face's own init path (``init_weights()``: normal_ through ``.data``, rotary
    frequencies copied into their buffers) draws each piece; dp2 x tp2 with ZeRO-3 on the
    simulator trains like eager from ``to_empty`` + ``init_weights()``."""
    from ..capture.test_zoo import BATCH, LLAMA_PLAN, STEPS, TOL, ZOO, _data
    arch = ZOO["llama"]
    data = _data(arch)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = arch.build().train()
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
        f"tensor_parallel: {{axis: tp, plan: {LLAMA_PLAN}}}\nsharding: {{stage: 3, axis: dp}}\n"
        "debug: {simulate: true}\n")
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    with torch.device("meta"):
        reference = arch.build().train()
    reference = _eager_init(reference, 0)    # out of the meta context: HF inits only there
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for step in range(STEPS):
        rows = data[step * BATCH:(step + 1) * BATCH]
        inputs = {k: torch.stack([x[k] for x, _ in rows]) for k in rows[0][0]}
        loss = reference(**inputs, labels=torch.stack([y for _, y in rows])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    assert_same_params(model, reference)
    torch.manual_seed(0)                      # and each real process's pieces of the same init
    with torch.device("meta"):
        model = arch.build()
    meta_init = MetaInit(model)
    with torch.device("meta"):
        reference = arch.build()
    _pieces_equal(meta_init, model, _eager_init(reference, 0), (Shard(0), Shard(1)))

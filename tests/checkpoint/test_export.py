"""``Engine.save(path, format="full")`` and ``python -m autopar export``: the trained model as
one safetensors file, read back by ``safetensors.torch.load_file``, ``load_state_dict`` and
Hugging Face ``from_pretrained``, equal bit for bit to what the engine trained; the
streaming writer against safetensors' own reader."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import autopar as ap
import autopar.checkpoint.consolidate as consolidate_module
from autopar.__main__ import main as cli
from autopar.checkpoint import consolidate_model
from autopar.checkpoint.safetensors_file import (
    DTYPES,
    SafetensorsWriter,
    TensorEntry,
    safetensors_path,
)

from ..parity import gpt_optimizer, lm_data, one_thread, parity_gpt  # noqa: F401

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
BATCH, STEPS = 4, 2


def _simulated(config: str) -> ap.Strategy:
    strategy = ap.Strategy.from_yaml(ROOT / "configs" / f"{config}.yaml")
    return strategy.model_copy(update={"debug": ap.Strategy(debug={"simulate": True}).debug})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (float8 has no ``torch.equal``)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


# -- the writer -----------------------------------------------------------------------------

def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g) * 50
    values = {f"{d}".replace("torch.", ""): (base > 0 if d == torch.bool else base.to(d))
              for d in DTYPES}
    values["scalar_bf16"] = torch.tensor(-2.75, dtype=torch.bfloat16)
    values["empty"] = torch.empty(0, 4)
    values["transposed"] = torch.arange(12.0).reshape(3, 4).t()      # not contiguous
    return values


def test_writer_round_trips_every_dtype_through_safetensors(tmp_path):
    values = _every_dtype()
    path = tmp_path / "t.safetensors"
    entries = [TensorEntry(k, tuple(v.shape), v.dtype) for k, v in values.items()]
    with SafetensorsWriter(path, entries) as writer:
        for k, v in values.items():
            writer.write(k, v)
    back = safetensors_torch.load_file(path)
    assert set(back) == set(values)
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(_bits(back[k]), _bits(v.contiguous())), k
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert header % 8 == 0
    assert not path.with_name(path.name + ".partial").exists()


@pytest.mark.parametrize("wrong", ["shape", "dtype", "order"])
def test_writer_refuses_a_tensor_unlike_its_entry_naming_it(tmp_path, wrong):
    path = tmp_path / "t.safetensors"
    entries = [TensorEntry("a.weight", (2, 3), torch.float32),
               TensorEntry("b.bias", (3,), torch.float32)]
    bad = {"shape": ("a.weight", torch.zeros(3, 2)),
           "dtype": ("a.weight", torch.zeros(2, 3, dtype=torch.float16)),
           "order": ("b.bias", torch.zeros(3))}[wrong]
    with pytest.raises(ValueError, match="a.weight" if wrong != "order" else "b.bias"):
        with SafetensorsWriter(path, entries) as writer:
            writer.write(*bad)
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()


def test_writer_refuses_to_close_with_tensors_missing(tmp_path):
    writer = SafetensorsWriter(tmp_path / "t.safetensors",
                               [TensorEntry("a", (2,), torch.float32),
                                TensorEntry("b", (2,), torch.int64)])
    writer.write("a", torch.ones(2))
    with pytest.raises(ValueError, match="not written: b"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_export_path_is_model_safetensors_in_a_directory(tmp_path):
    assert safetensors_path(tmp_path) == tmp_path / "model.safetensors"
    assert safetensors_path(tmp_path / "new") == tmp_path / "new" / "model.safetensors"
    assert safetensors_path(tmp_path / "w.safetensors") == tmp_path / "w.safetensors"


# -- the engine's export and the CLI --------------------------------------------------------

@pytest.mark.parametrize("config", ["serial", "dp_tp"])
def test_full_export_is_the_trained_state_dict(tmp_path, monkeypatch, config):
    """serial, and dp2 x tp2 on the simulator (vocab-parallel tied embedding, grouped qkv
    shards): the file holds every ``state_dict`` key, tied head included, each equal to the
    trained value; a fresh model loads it strictly. The CLI's consolidation of a checkpoint
    of the same engine gives the same tensors under the canonical names."""
    from autopar.models.gpt import lm_loss
    model = parity_gpt("sgd")
    initial = copy.deepcopy(model.state_dict())
    optimizer, scheduler = gpt_optimizer("sgd", model)
    strategy = ap.Strategy() if config == "serial" else _simulated(config)
    engine = ap.Engine(model, lm_loss, optimizer, strategy=strategy, lr_scheduler=scheduler)
    engine.fit(lm_data(STEPS * BATCH, 16, 64), batch_size=BATCH, verbose=0)

    path = engine.save(tmp_path / "full", format="full")
    assert path == tmp_path / "full" / "model.safetensors"
    exported = safetensors_torch.load_file(path)
    trained = engine.state_dict()
    assert set(exported) == set(model.state_dict()) == set(trained) | {"head.weight"}
    for key, value in trained.items():
        assert torch.equal(exported[key], value), key
    assert torch.equal(exported["head.weight"], trained["wte.weight"])
    assert not torch.equal(exported["wte.weight"], initial["wte.weight"])   # trained
    fresh = parity_gpt("sgd")
    fresh.load_state_dict(exported, strict=True)

    engine.save(tmp_path / "ckpt")
    cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli.safetensors")])
    consolidated = safetensors_torch.load_file(tmp_path / "cli.safetensors")
    assert set(trained) <= set(consolidated) <= set(exported)
    for key, value in consolidated.items():
        assert torch.equal(value, exported[key]), key
    # a few tensors per DCP read (at most 4 KiB together, a larger one alone): the same file
    reads = []
    load = consolidate_module.dcp.load
    monkeypatch.setattr(consolidate_module.dcp, "load",
                        lambda *a, **k: reads.append(load(*a, **k)))
    consolidate_model(tmp_path / "ckpt", tmp_path / "small.safetensors", budget_bytes=4096)
    assert len(consolidated) > len(reads) > 1
    assert (tmp_path / "small.safetensors").read_bytes() == \
        (tmp_path / "cli.safetensors").read_bytes()


def test_hugging_face_reads_the_exports_of_a_tied_llama(tmp_path):
    """A tiny Llama with tied embeddings, a step on dp2 x tp2 (simulated):
    ``from_pretrained`` has exactly the trained parameters, tied, from the engine's export,
    from the CLI's, and from a file of the canonical names only (what a checkpoint without
    the aliases consolidates to: Hugging Face re-ties ``lm_head.weight`` itself)."""
    transformers = pytest.importorskip("transformers")
    from ..capture.test_zoo import LLAMA_PLAN, SEQ, VOCAB
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    initial = model.model.embed_tokens.weight.detach().clone()
    strategy = ap.Strategy.from_yaml_str(
        "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
        f"tensor_parallel: {{axis: tp, plan: {LLAMA_PLAN}}}\ndebug: {{simulate: true}}\n")
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    engine.fit([({"input_ids": row}, row.clone()) for row in ids], batch_size=BATCH,
               verbose=0)
    trained = engine.state_dict()
    assert not torch.equal(trained["model.embed_tokens.weight"], initial)

    full, consolidated, canonical = tmp_path / "full", tmp_path / "cli", tmp_path / "canonical"
    engine.save(full, format="full")
    exported = safetensors_torch.load_file(full / "model.safetensors")
    # the tied head under its own key; the rotary buffers (non-persistent) left out
    assert set(exported) == set(model.state_dict()) and "lm_head.weight" in exported
    assert "model.rotary_emb.inv_freq" in trained
    engine.save(tmp_path / "ckpt")
    cli(["export", str(tmp_path / "ckpt"), str(consolidated)])
    names = {n for n, _ in model.named_parameters()}
    canonical.mkdir()
    safetensors_torch.save_file({k: v for k, v in exported.items() if k in names},
                                canonical / "model.safetensors", metadata={"format": "pt"})
    for directory in (full, consolidated, canonical):
        config.save_pretrained(directory)
        loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        params = dict(loaded.named_parameters())
        assert set(params) == names
        for name, value in params.items():
            assert torch.equal(value, trained[name]), f"{directory.name}: {name}"


def test_cli_refuses_a_directory_that_is_no_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        cli(["export", str(tmp_path), str(tmp_path / "out.safetensors")])


def test_full_export_on_two_real_ranks(tmp_path):
    """tp2 on 2 gloo ranks (torchrun), the GPT built on the meta device (its own tensors
    stay there): each value gathered from its pieces, rank 0 writing; the file equals the
    ranks' ``state_dict`` (gathered) under every ``state_dict`` key."""
    from ..multiproc import run_ranks
    path = tmp_path / "gpt.safetensors"
    ranks = run_ranks("export_full", 2, "tp", str(path), str(STEPS), "1")
    assert ranks[0]["file"] == ranks[1]["file"] == str(path)
    assert ranks[0]["still_meta"] and ranks[1]["still_meta"]
    exported = safetensors_torch.load_file(path)
    state = ranks[0]["state"]
    assert set(exported) == set(parity_gpt("sgd").state_dict()) == set(state) | {"head.weight"}
    for key, value in state.items():
        assert torch.equal(exported[key], value), key
        assert torch.equal(ranks[1]["state"][key], value), key
    assert torch.equal(exported["head.weight"], exported["wte.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["gpt.safetensors"]

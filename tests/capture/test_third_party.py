"""Unmodified third-party transformers (Hugging Face GPT-2 and Llama, tiny configs built
locally, no download) train through the Engine with eager torch's exact losses and
parameters. The models compute their own loss (loss=None) from dict inputs + labels."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap

from .. import models_zoo as zoo

transformers = pytest.importorskip("transformers")

VOCAB = 97
STEPS, BATCH, SEQ = 3, 2, 16
TOL = dict(rtol=1e-5, atol=1e-6)
SEED = 0   # Strategy().seed


def gpt2(attn: str) -> torch.nn.Module:
    return zoo.hf_gpt2(attn, VOCAB)


def llama(attn: str) -> torch.nn.Module:
    return zoo.hf_llama(attn, VOCAB)


def lm_data(n: int = STEPS * BATCH) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [({"input_ids": x}, x.clone()) for x in ids]   # HF shifts the labels itself


def eager(model: torch.nn.Module, data: list) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        batch = data[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([inputs["input_ids"] for inputs, _ in batch])
        y = torch.stack([labels for _, labels in batch])
        torch.manual_seed(SEED + step)   # the engine's dropout stream (GPT-2 drops 0.1)
        out = model(input_ids=x, labels=y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("build,attn", [(gpt2, "eager"), (gpt2, "sdpa"),
                                        (llama, "eager"), (llama, "sdpa")],
                         ids=["gpt2-eager", "gpt2-sdpa", "llama-eager", "llama-sdpa"])
def test_hf_causal_lm_parity(build, attn):
    torch.manual_seed(0)
    model = build(attn).train()
    reference = copy.deepcopy(model)
    data = lm_data()

    engine = ap.Engine(model, None, torch.optim.AdamW(model.parameters(), lr=1e-3))
    history = engine.fit(data, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, verbose=0)

    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(eager(reference, data)),
                               **TOL)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"parameter {name}: {m}")


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_hf_evaluate_and_predict(build):
    torch.manual_seed(0)
    model = build("sdpa")
    data = lm_data()
    engine = ap.Engine(model, None)
    # eval-mode HF models return their KV cache (an object made while tracing): refused
    with pytest.raises(ap.capture.CaptureError, match="use_cache"):
        engine.evaluate(data, batch_size=BATCH)

    model.config.use_cache = False
    reference = copy.deepcopy(model).eval()
    x = torch.stack([inputs["input_ids"] for inputs, _ in data])
    with torch.no_grad():
        losses = [reference(input_ids=b, labels=b).loss for b in x.split(BATCH)]
        logits = reference(input_ids=x).logits
    scores = engine.evaluate(data, batch_size=BATCH)
    assert scores["loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)

    outputs = engine.predict([inputs for inputs, _ in data], batch_size=BATCH)
    assert type(outputs[0]) is type(reference(input_ids=x[:1]))
    assert outputs[0].loss is None
    torch.testing.assert_close(torch.cat([o.logits for o in outputs]), logits, **TOL)


def test_hf_llama_ops_carry_module_paths():
    from autopar.capture.step import capture
    from autopar.ir import OpKind, Role

    model = llama("sdpa")
    x = lm_data()[0][0]["input_ids"][None]
    program = capture(model, None, {"input_ids": x}, x, mode="train").program
    calls = list(program.ops_of(OpKind.CALL))
    modules = {op.module for op in calls if op.role is Role.FORWARD}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj",
            "model.layers.1.post_attention_layernorm", "lm_head"} <= modules
    linked = [op for op in calls if op.role is Role.BACKWARD and op.forward_op is not None]
    assert any(op.module == "model.layers.0.self_attn.q_proj" for op in linked)
    assert all(op.module == op.forward_op.module for op in linked)


def t5() -> torch.nn.Module:
    import transformers
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).train()


T5_STRATEGIES = {
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, split: [decoder]}\n",
}


@pytest.mark.parametrize("name", list(T5_STRATEGIES))
def test_t5_encoder_decoder_matches_eager_under_dp_and_pp(name):
    """T5 builds its decoder inputs in place (``new_zeros``, then writes into slices of it)
    and computes relative position biases every micro-batch reads alike; its SDPA call
    passes a mask without ``dropout_p`` (the schema default, 0, draws nothing)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (8, 12), generator=g)
    labels = torch.randint(1, 64, (8, 6), generator=g)
    data = [({"input_ids": a}, b) for a, b in zip(ids, labels)]
    torch.manual_seed(0)
    reference = t5()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for k in range(2):
        out = reference(input_ids=ids[4 * k:4 * k + 4], labels=labels[4 * k:4 * k + 4])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        want.append(out.loss.item())
    torch.manual_seed(0)
    model = t5()
    strategy = ap.Strategy.from_yaml_str(T5_STRATEGIES[name] + "debug: {simulate: true}\n")
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    got = engine.fit(data, batch_size=4, steps_per_epoch=2, verbose=0)["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"parameter {n}: {m}")

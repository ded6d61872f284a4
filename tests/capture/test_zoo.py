"""Third-party architectures as they come (Hugging Face models built from tiny configs, no
download; the model computes its own loss from dict inputs and labels), trained serially,
under data parallelism, tensor parallelism with a Megatron plan (column/row pairs on the
model's own module names) and a 1F1B pipeline on the simulator: the losses of every step
equal eager torch's. Planning each under dp2 x tp2 with ``debug.strict_rules`` finds an
SPMD rule for every op of the joint graph.

Each entry is one builder, its tp plan and the batch it reads. BatchNorm CNNs (Hugging Face
ResNet: tests/passes/test_sync_batch_norm.py), expert parallelism (tests/passes/test_moe.py) and the
fused-projection layouts in detail (tests/passes/test_tp_attention_layouts.py) have their own files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import yaml

import autopar as ap

transformers = pytest.importorskip("transformers")
# the mixture-of-experts models say their experts dispatch was swapped for a dense one
pytestmark = pytest.mark.filterwarnings("ignore::autopar.capture.step.CaptureNote")

VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, vocab_size=VOCAB)
LLAMA_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
              "*.o_proj": "rowwise", "*.gate_proj": "colwise", "*.up_proj": "colwise",
              "*.down_proj": "rowwise"}
ATTENTION_PLAN = {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
                  "*.o_proj": "rowwise"}


def lm_batch(ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    return {"input_ids": ids}, ids.clone()          # the model shifts the labels itself


def seq2seq_batch(ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    return {"input_ids": ids}, ids[:, :SEQ // 2].flip(1).clone()


def image_batch(ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(int(ids[0, 0]))
    return {"pixel_values": torch.randn(len(ids), 3, 16, 16, generator=g)}, ids[:, 0] % 5


@dataclass(frozen=True)
class Arch:
    build: Callable[[], torch.nn.Module]
    plan: dict[str, str]                  # tensor_parallel.plan on the model's module names
    batch: Callable[[torch.Tensor], tuple[dict, torch.Tensor]] = lm_batch


def _gqa(config_class, model_class) -> Callable[[], torch.nn.Module]:
    """A Llama-like decoder with grouped-query attention (2 key/value heads for 4)."""
    return lambda: model_class(config_class(num_key_value_heads=2, **DECODER))


ZOO = {
    "gpt2": Arch(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB)),
        {"*.attn.c_attn": "colwise", "*.attn.c_proj": "rowwise", "*.mlp.c_fc": "colwise",
         "*.mlp.c_proj": "rowwise"}),
    "llama": Arch(_gqa(transformers.LlamaConfig, transformers.LlamaForCausalLM), LLAMA_PLAN),
    "mistral": Arch(_gqa(transformers.MistralConfig, transformers.MistralForCausalLM),
                    LLAMA_PLAN),
    "qwen2": Arch(_gqa(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), LLAMA_PLAN),
    "phi": Arch(lambda: transformers.PhiForCausalLM(transformers.PhiConfig(**DECODER)),
                {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
                 "*.self_attn.dense": "rowwise", "*.mlp.fc1": "colwise",
                 "*.mlp.fc2": "rowwise"}),
    "gpt_neox": Arch(lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **DECODER)), {"*.query_key_value": "colwise", "*.attention.dense": "rowwise",
                      "*.dense_h_to_4h": "colwise", "*.dense_4h_to_h": "rowwise"}),
    "opt": Arch(lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, vocab_size=VOCAB)),
        {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
         "*.out_proj": "rowwise", "*.fc1": "colwise", "*.fc2": "rowwise"}),
    "bert_mlm": Arch(lambda: transformers.BertForMaskedLM(transformers.BertConfig(**DECODER)),
                     {"*.query": "colwise", "*.key": "colwise", "*.value": "colwise",
                      "*.attention.output.dense": "rowwise", "*.intermediate.dense": "colwise",
                      "*.layer.*.output.dense": "rowwise"}),
    "t5": Arch(lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
        {"*.q": "colwise", "*.k": "colwise", "*.v": "colwise", "*.o": "rowwise",
         "*.wi": "colwise", "*.wo": "rowwise"}, seq2seq_batch),
    # fused [q | k | v] with 2 key/value heads for 4: unequal groups under tp
    "phi3": Arch(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0, **DECODER)),
        {"*.qkv_proj": "colwise", "*.o_proj": "rowwise", "*.gate_up_proj": "colwise",
         "*.down_proj": "rowwise"}),
    # mixture of experts (captured with a dense dispatch); tp on the attention
    "mixtral": Arch(lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2, **DECODER)),
        ATTENTION_PLAN),
    "qwen2_moe": Arch(lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, num_key_value_heads=2, **DECODER)),
        ATTENTION_PLAN | {"*.shared_expert.gate_proj": "colwise",
                          "*.shared_expert.up_proj": "colwise",
                          "*.shared_expert.down_proj": "rowwise"}),
    "vit": Arch(lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5)),
        {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
         "*.o_proj": "rowwise", "*.mlp.fc1": "colwise", "*.mlp.fc2": "rowwise"}, image_batch),
}


def _strategy(name: str, arch: Arch, extra: str = "") -> ap.Strategy:
    plan = yaml.safe_dump({"axis": "tp", "plan": arch.plan}, default_flow_style=True)
    text = {
        "serial": "",
        "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
        "tp2": f"mesh: {{shape: [2], dim_names: [tp]}}\ntensor_parallel: {plan}",
        "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
               "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, split: auto}\n",
        "dp2_tp2": "mesh: {shape: [2, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
                   f"tensor_parallel: {plan}",
    }[name]
    return ap.Strategy.from_yaml_str(text + "debug: {simulate: true" + extra + "}\n")


def _data(arch: Arch) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    inputs, labels = arch.batch(ids)
    return [({k: v[i] for k, v in inputs.items()}, labels[i]) for i in range(len(ids))]


def _eager(arch: Arch, data: list) -> list[float]:
    torch.manual_seed(0)
    model = arch.build().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        rows = data[step * BATCH:(step + 1) * BATCH]
        inputs = {k: torch.stack([x[k] for x, _ in rows]) for k in rows[0][0]}
        torch.manual_seed(step)           # the engine's random stream (dropout)
        loss = model(**inputs, labels=torch.stack([y for _, y in rows])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _engine(arch: Arch, strategy: ap.Strategy) -> ap.Engine:
    torch.manual_seed(0)
    model = arch.build().train()
    return ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                     strategy=strategy)


@pytest.mark.parametrize("strategy", ["serial", "dp2", "tp2", "pp2"])
@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_architecture_trains_like_eager(arch, strategy):
    data = _data(ZOO[arch])
    engine = _engine(ZOO[arch], _strategy(strategy, ZOO[arch]))
    got = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_eager(ZOO[arch], data)), **TOL)


def _planned(name: str, strategy: str, extra: str = ""):
    """The planned training program of one zoo entry on its first batch (nothing runs)."""
    arch = ZOO[name]
    inputs, labels = _data(arch)[0]
    engine = _engine(arch, _strategy(strategy, arch, extra))
    return engine.prepare({k: torch.stack([v] * BATCH) for k, v in inputs.items()},
                          torch.stack([labels] * BATCH))


def _moved_activations(program) -> list[str]:
    """Every all-gather or all-to-all: what moves values the step computes (gradients and
    statistics are all-reduced or reduce-scattered)."""
    return [f"{op.module}: {op.inputs[0].type}" for op in program.ops
            if op.target in ("comm.all_gather", "comm.all_to_all")]


@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_architecture_plans_strictly_under_dp2_tp2(arch):
    """Every op of the joint graph has an SPMD rule (strict planning raises otherwise)."""
    program = _planned(arch, "dp2_tp2", ", strict_rules: true")
    assert any(op.target.startswith("comm.") for op in program.ops)


# Attention that runs as one SDPA kernel (grouped-query or not) keeps its heads sharded;
# attention written as matmuls of [batch * heads] rows (GPT-2, BERT, T5 eager) still gathers.
LOCAL_HEADS = ["llama", "mistral", "qwen2", "phi", "phi3", "gpt_neox", "opt", "mixtral",
               "qwen2_moe", "vit"]


@pytest.mark.parametrize("arch", LOCAL_HEADS)
def test_zoo_tensor_parallel_moves_no_activations_but_the_row_parallel_sums(arch):
    assert _moved_activations(_planned(arch, "tp2")) == []


@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_data_parallel_moves_no_activations(arch):
    """Under dp2 only gradients (and BatchNorm statistics) are reduced."""
    assert _moved_activations(_planned(arch, "dp2")) == []

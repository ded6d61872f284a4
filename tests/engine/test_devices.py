"""Where processes compute (``device: auto | cpu | cuda``, issue 28): the device chosen from
the strategy and LOCAL_RANK, the refusal of ``cuda`` without CUDA, the model and every fed
batch moved there, random ops drawing from that device's generator. The CUDA runs skip
without a GPU (CI never has one); ``bench/gpu_check.py`` is the one-call check on a GPU."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar as ap
from autopar.ir.kernels import generator_state
from autopar.models.gpt import lm_loss
from autopar.runtime import resolve_device

from ..parity import assert_same_losses, assert_same_params, eager_train, lm_data, parity_gpt

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_strategy_names_its_device_and_refuses_others():
    assert ap.Strategy().device == "auto"
    assert ap.Strategy.from_yaml_str("device: cpu").device == "cpu"
    with pytest.raises(ValueError, match="device"):
        ap.Strategy.from_yaml_str("device: tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_is_refused_where_there_is_none_before_anything_runs():
    model = parity_gpt("adamw")
    with pytest.raises(ValueError, match="device: cuda, but this machine has no usable CUDA"):
        ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                  strategy=ap.Strategy.from_yaml_str("device: cuda"))
    assert resolve_device("auto", 0) == torch.device("cpu")


def test_each_local_rank_takes_its_own_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    assert resolve_device("cpu", 1) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK 2 has no device here"):
        resolve_device("cuda", 2)


def test_random_ops_draw_from_the_compute_devices_generator(monkeypatch):
    fake = torch.Generator()
    monkeypatch.setattr(torch.cuda, "default_generators", (torch.Generator(), fake),
                        raising=False)
    try:
        generator_state.use_device(torch.device("cuda", 1))
        assert generator_state.draw_generator() is fake
        fake.manual_seed(5)
        state = generator_state.get_rng_state()
        fake.manual_seed(6)
        generator_state.set_rng_state(state)
        assert torch.equal(fake.get_state(), state)
    finally:
        generator_state.use_device(torch.device("cpu"))
    assert generator_state.draw_generator() is torch.default_generator


def test_the_engine_says_its_device_and_the_optimizer_keeps_its_parameters():
    """A model is moved to the engine's device in place (``module.to``), so the optimizer's
    parameter objects stay the ones it holds; on CUDA the same path moves a CPU model to
    cuda:LOCAL_RANK (``test_serial_on_cuda_trains_like_eager`` passes a CUDA model)."""
    model = parity_gpt("adamw")
    params = list(model.parameters())
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(params),
                       strategy=ap.Strategy.from_yaml_str("device: cpu"))
    assert engine.device == torch.device("cpu")
    assert all(p is q for p, q in zip(model.parameters(), params))


def _cuda_parity(yaml: str, dropout: float = 0.0) -> None:
    model = parity_gpt("adamw", dropout=dropout).cuda()
    ref = copy.deepcopy(model)
    data = [(x.cuda(), y.cuda()) for x, y in lm_data(12, 16, 64)]
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(yaml or "{}"))
    got = engine.fit(data, batch_size=4, verbose=0)["loss"]
    want = eager_train(ref, lm_loss, torch.optim.AdamW(ref.parameters(), lr=1e-3), data,
                       batch_size=4, steps=3)
    assert_same_losses(got, want)
    assert_same_params(model, ref)


@CUDA
def test_serial_on_cuda_trains_like_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    _cuda_parity("device: cuda")


@CUDA
def test_dropout_on_cuda_draws_eagers_masks():
    _cuda_parity("device: cuda", dropout=0.1)


@CUDA
def test_the_simulator_runs_dp2_on_one_cuda_device_like_eager():
    _cuda_parity("device: cuda\nmesh: {shape: [2], dim_names: [dp]}\n"
                 "data_parallel: {axis: dp}\ndebug: {simulate: true}\n", dropout=0.1)


def test_batches_go_to_the_device_one_ahead():
    """Reading batch i+1 and issuing its copy happens before batch i is handed out (on CUDA
    the copy then overlaps step i); the meta device stands in for a GPU here."""
    from autopar.data.loaders import on_device
    read = []

    def source():
        for i in range(3):
            read.append(i)
            yield torch.full((2,), float(i)), {"y": torch.zeros(1)}
    seen = []
    for x, y in on_device(source(), torch.device("meta")):
        seen.append((len(read), x.device.type, y["y"].device.type))
    assert seen == [(2, "meta", "meta"), (3, "meta", "meta"), (3, "meta", "meta")]
    cpu = list(on_device(source(), torch.device("cpu")))
    assert len(cpu) == 3 and cpu[0][0].device.type == "cpu"


@CUDA
def test_a_meta_model_trains_on_cuda_from_its_cpu_drawn_pieces():
    """A model built on meta: its pieces are drawn on the CPU (as ``to_empty(device="cpu")``
    + its init path) and placed on the device; it trains as the CPU-built model would."""
    torch.manual_seed(0)
    reference = parity_gpt("adamw")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = parity_gpt("adamw")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str("device: cuda"))
    state = engine.runtime.state
    data = lm_data(12, 16, 64)
    got = engine.fit(data, batch_size=6, verbose=0)["loss"]
    assert all(t.device.type == "cuda" for t in state.values() if isinstance(t, torch.Tensor))
    want = eager_train(reference, lm_loss, torch.optim.AdamW(reference.parameters(), lr=1e-3),
                       data, 6, 2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_tf32_is_explicit_in_the_strategy():
    assert ap.Strategy().amp.tf32 is False
    assert ap.Strategy.from_yaml_str("amp: {tf32: true}").amp.tf32 is True
    with pytest.raises(ValueError):
        ap.Strategy.from_yaml_str("amp: {tf32: 1}")     # strict: a bool, not a number

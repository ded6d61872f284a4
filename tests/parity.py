"""Eager torch reference loops and comparison helpers for parity tests."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.utils.data import DataLoader

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine: one intra-op thread is several times faster.
    Eager and simulated runs share it, so it changes no comparison. A test module uses it
    by importing it and marking itself ``pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_data(n: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return [(t[:-1], t[1:]) for t in tokens]


def regression_data(n: int, d_in: int, d_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(d_in, generator=g), torch.randn(d_out, generator=g)) for _ in range(n)]


def eager_train(model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                data, batch_size: int | None, steps: int, max_norm: float | None = None,
                scheduler=None, seed: int = 0) -> list[float]:
    """The single-device torch loop autopar must reproduce, step for step (``batch_size``
    None: ``data`` holds whole batches, as a ``DataLoader(batch_size=None)`` hands them)."""
    losses = []
    model.train()
    for step, (x, y) in enumerate(DataLoader(data, batch_size=batch_size)):
        if step >= steps:
            break
        torch.manual_seed(seed + step)     # what the engine does for random ops
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(pa, pb, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def assert_same_losses(ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=RTOL, atol=ATOL)


def rounding_bound(roundings: int, dtype: torch.dtype) -> float:
    """How far, relative, a value computed through a chain of ``roundings`` roundings to
    ``dtype`` can land from the same value computed exactly: Higham's gamma_n = n u / (1 - n
    u), u the dtype's unit roundoff (half its eps: round to nearest), to first order and
    without cancellation. Two runs whose chains hold a and b roundings differ by at most
    gamma_(a+b) of the value, relative: the bound of a half-precision comparison that has no
    exact reference, derived from the dtype and a count, not from a measurement."""
    unit = torch.finfo(dtype).eps / 2
    return roundings * unit / (1 - roundings * unit)


def gpt_optimizer(name: str, model: torch.nn.Module, warmup: int = 10):
    """(optimizer, scheduler or None) as a GPT run uses them: SGD + momentum, or AdamW with
    the usual linear warmup (see tests/end_to_end/test_parity_dist.py for why parity needs it)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))


def parity_gpt(optim: str, vocab: int = 64, seq: int = 16, dropout: float = 0.0,
               layers: int = 2, sdpa: bool | None = None):
    """The small GPT parity runs train. With AdamW it has no qkv bias: the key part of a
    fused qkv bias has an identically zero gradient whose fp32 rounding noise Adam follows
    (tests/end_to_end/test_parity_dist.py). Its attention is SDPA with AdamW, an explicit masked
    softmax with SGD, unless ``sdpa`` says."""
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=32, n_head=4, vocab_size=vocab, block_size=seq,
                          dropout=dropout, sdpa=optim == "adamw" if sdpa is None else sdpa))
    if optim == "adamw":
        for block in model.blocks:
            block.attn.qkv.register_parameter("bias", None)
    return model


def dumped_around(where: Path, name: str) -> tuple[str, str]:
    """The training program rank 0 dumped (``debug.dump_dir``) before and after pass
    ``name``, as the engine planned the step it ran."""
    programs = sorted(f for f in (where / "rank0").glob("[0-9][0-9]_*.txt") if "." not in f.stem)
    at = [f.stem[3:] for f in programs].index(name)
    return programs[at - 1].read_text(), programs[at].read_text()

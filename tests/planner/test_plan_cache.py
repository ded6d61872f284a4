"""Planned programs on disk (``plan_cache_dir``): a second engine over the same model and
strategy (a restarted job) loads the passes' and lowering's work instead of redoing it, and
trains exactly as the first; another model, strategy or optimizer option plans anew."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.models.gpt import lm_loss

from ..parity import lm_data, one_thread, parity_gpt  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
LAYOUT = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
          "debug: {simulate: true}\n")


def _train(cache, layers=2, lr=0.1, layout=LAYOUT):
    model = parity_gpt("sgd", layers=layers)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=lr),
                       strategy=ap.Strategy.from_yaml_str(
                           layout + f"plan_cache_dir: {str(cache)!r}\n"))
    history = engine.fit(lm_data(8, 16, 64), batch_size=4, verbose=0)
    return engine, history["loss"], model


def test_a_restarted_engine_loads_its_plan_and_trains_the_same(tmp_path):
    first, losses, model = _train(tmp_path)
    assert [m.cached for m in first.planner.made] == [False]
    assert len(list(tmp_path.glob("*.plan"))) == 1
    again, same, twin = _train(tmp_path)
    assert [m.cached for m in again.planner.made] == [True]
    assert "the rest from the plan cache" in str(again.planner.made[0])
    assert same == losses
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("change", [dict(layers=1), dict(lr=0.2),
                                    dict(layout=LAYOUT.replace("[2]", "[4]"))],
                         ids=["model", "optimizer", "mesh"])
def test_what_planning_reads_is_in_the_key(tmp_path, change):
    _train(tmp_path)
    other, _, _ = _train(tmp_path, **change)
    assert [m.cached for m in other.planner.made] == [False]
    assert len(list(tmp_path.glob("*.plan"))) == 2

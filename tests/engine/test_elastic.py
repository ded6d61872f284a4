"""Elastic restarts (``elastic: {on_resize: ...}``): a launch of another world size than the
strategy's gets the strategy for the world launched, said in one line; what cannot take it
is refused by name. tests/engine/test_multinode.py kills a node of a real two-node job and checks
the survivors resume from the checkpoint."""
from __future__ import annotations

import pytest

import autopar as ap
from autopar.engine.elastic import ResizeError, resized

DP_TP = ("mesh: {shape: [4, 2], dim_names: [dp, tp]}\ndata_parallel: {axis: dp}\n"
         "tensor_parallel: {axis: tp, plan: {fc1: colwise, fc2: rowwise}}\n"
         "sharding: {stage: 3, axis: dp}\n")


def _strategy(text: str, on_resize: str = "data_parallel") -> ap.Strategy:
    return ap.Strategy.from_yaml_str(text + f"elastic: {{on_resize: {on_resize}}}\n")


def test_the_data_parallel_axis_takes_the_new_world():
    strategy, note = resized(_strategy(DP_TP), 4)
    assert strategy.mesh.shape == (2, 2) and strategy.world_size == 4
    assert strategy.degree("tensor_parallel") == 2 and strategy.sharding.stage == 3
    assert "data_parallel axis 'dp' 4 -> 2" in note and "global batch is kept" in note
    grown, note = resized(_strategy(DP_TP), 16)
    assert grown.mesh.shape == (8, 2) and "x0.5" in note


def test_hsdp_resizes_its_replicas_and_keeps_the_shard_group():
    text = ("mesh: {shape: [2, 2], dim_names: [rep, shard]}\n"
            "data_parallel: {axis: [rep, shard]}\nsharding: {stage: 3, axis: shard}\n")
    strategy, _ = resized(_strategy(text), 2)
    assert strategy.mesh.shape == (1, 2) and strategy.degree("sharding") == 2


def test_what_cannot_take_the_world_is_refused_by_name():
    with pytest.raises(ResizeError, match="launch a multiple of 2"):
        resized(_strategy(DP_TP), 3)
    with pytest.raises(ResizeError, match="no data_parallel axis"):
        resized(_strategy("mesh: {shape: [2], dim_names: [tp]}\n"
                          "tensor_parallel: {axis: tp, plan: {fc1: colwise}}\n"), 4)
    same, note = resized(_strategy(DP_TP, "error"), 4)      # the launch check refuses it
    assert same.world_size == 8 and note is None


def test_auto_plans_for_the_world_it_has():
    strategy, note = resized(_strategy(DP_TP + "amp: {enable: true, dtype: bfloat16}\n",
                                       "auto"), 6)
    assert strategy.auto.devices == 6 and strategy.mesh is None
    assert strategy.amp.enable and "auto plans for 6" in note          # non-layout kept
    planned = ap.Strategy.from_yaml_str("auto: {devices: 8}\n")
    assert resized(planned, 4)[0].world_size == 8                     # not a restart
    assert resized(planned, 4, restarted=True)[0].auto.devices == 4


def test_the_launch_check_names_the_elastic_option():
    from autopar.runtime.process_groups import check_launch
    with pytest.raises(ValueError, match="elastic: {on_resize"):
        check_launch(8, 4)

"""Streaming datasets read in shards (``data/streams.py``): an ``IterableDataset`` given to
``fit`` is read by each data-parallel process in its own shard (round-robin, or the
dataset's own ``shard(num_shards, index)``), and the global batch is the shards' batches
side by side. On the simulator (all shards read in one process) and on 2 real gloo ranks
(each its own) training equals eager torch on those global batches (fp32, rtol 1e-5),
with the shards' different lengths padded to one bucket; a shard that ends first ends the
epoch for all, and shapes that cannot agree are refused on every process, not hung."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

import autopar as ap
from autopar.data.streams import RoundRobin, StreamError, shard_stream, stream_shards
from autopar.ir.dist import ProcessMesh
from autopar.models.gpt import lm_loss
from autopar.runtime import FedRows
from autopar.runtime.job_store import cut_feeds

from ..multiproc import run_ranks
from ..parity import (  # noqa: F401  (one_thread: a fixture)
    assert_same_losses,
    assert_same_params,
    eager_train,
    one_thread,
    parity_gpt,
    twin,
)
from ..stream_data import TokenStream, global_batches

pytestmark = pytest.mark.usefixtures("one_thread")
DP2 = ("mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
       "debug: {simulate: true}\n")


def _eager(model, batches):
    """Eager AdamW on the stream's global batches, one step each."""
    return eager_train(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       batches, None, len(batches))


def _fit(text: str, stream: TokenStream, batch_size: int):
    model = parity_gpt("adamw", seq=64)
    ref = twin(model)
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy.from_yaml_str(text))
    history = engine.fit(stream, batch_size=batch_size, verbose=0)
    return engine, history, model, ref


# -- sharding ---------------------------------------------------------------------------------

def test_round_robin_keeps_every_count_th_item():
    assert list(RoundRobin(range(10), 3, 1)) == [1, 4, 7]
    assert shard_stream(range(4), 1, 0) == range(4)


def test_a_dataset_that_shards_itself_is_asked_for_its_shard():
    stream = TokenStream(8, 2, 2, shardable=True)
    part = shard_stream(stream, 2, 1)
    assert part.keep == (2, 1) and len(list(part)) == 4 and stream.made == 0


def test_each_process_reads_the_shard_of_its_data_parallel_coordinates():
    mesh = ProcessMesh(torch.arange(8).reshape(2, 2, 2), ["rep", "shard", "tp"])
    shards = [stream_shards(("rep", "shard"), mesh, rank, 8)[0] for rank in range(8)]
    assert [s.index for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {(s.count, s.rows) for s in shards} == {(4, 2)}
    assert [s.index for s in stream_shards(("rep", "shard"), mesh, None, 8)] == [0, 1, 2, 3]
    with pytest.raises(StreamError, match="needs batch_size divisible by 4, got 6"):
        stream_shards(("rep", "shard"), mesh, 0, 6)


def test_fed_rows_are_cut_where_they_sit_in_the_global_batch():
    rows = torch.arange(12).reshape(2, 6)            # rows 2:4 of a batch of 4
    fed = {"batch/0": FedRows(rows, 0, 2, 4)}
    assert torch.equal(cut_feeds(fed, {"batch/0": (slice(3, 4), slice(0, 3))})["batch/0"],
                       rows[1:2, 0:3])
    with pytest.raises(ValueError, match="reads rows 0:2 of the batch .*fed only its data "
                                         "shard's rows 2:4"):
        cut_feeds(fed, {"batch/0": (slice(0, 2), slice(None))})
    with pytest.raises(ValueError, match="reads rows 0:4"):
        cut_feeds(fed, {})                           # a replicated feed needs every row


# -- training ---------------------------------------------------------------------------------

def test_a_stream_on_the_simulator_trains_like_eager_on_its_global_batches():
    stream = TokenStream(4 * 4, rows=2, count=2)
    engine, history, model, ref = _fit(DP2 + "data: {seq_buckets: [64]}\n", stream, 4)
    assert_same_losses(history["loss"], _eager(ref, global_batches(stream, 4)))
    assert_same_params(model, ref)
    assert len(engine.planner.made) == 1         # four lengths, one bucket


def test_a_serial_stream_is_read_whole():
    stream = TokenStream(6, rows=2, count=1)
    _, history, model, ref = _fit("data: {seq_buckets: [64]}\n", stream, 2)
    assert_same_losses(history["loss"], _eager(ref, global_batches(stream, 3)))
    assert_same_params(model, ref)


def test_shards_of_different_lengths_without_padding_are_refused():
    with pytest.raises(StreamError, match=r"ranks \[0\]: \[\[2, 20\], \[2, 20\]\]; ranks "
                                          r"\[1\]: \[\[2, 23\], \[2, 23\]\].*seq_buckets"):
        _fit(DP2, TokenStream(8, rows=2, count=2), 4)


def test_a_stream_refuses_shuffle():
    model = parity_gpt("adamw")
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="a stream .* has no index to shuffle"):
        engine.fit(TokenStream(4, 2, 1), batch_size=2, shuffle=True, verbose=0)


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)


@pytest.mark.parametrize("shardable", [False, True], ids=["round_robin", "own_shards"])
def test_each_real_rank_reads_its_shard_and_trains_like_eager(shardable):
    """2 real gloo ranks: 9 items make 2 full steps of 4 (rank 0's shard has a fifth item,
    which ends no epoch alone); the dataset that shards itself builds only its half."""
    ranks = run_ranks("train_stream", 2, str(int(shardable)))
    stream = TokenStream(9, rows=2, count=2)
    model = parity_gpt("adamw", seq=64)
    want = _eager(model, global_batches(stream, 2))
    for rank, result in enumerate(ranks):
        assert_same_losses(result["loss"], want)
        want_state = model.state_dict()
        for name, value in result["state"].items():
            torch.testing.assert_close(value, want_state[name], rtol=1e-5, atol=1e-6)
        assert result["made"] == ((5 if rank == 0 else 4) if shardable else 9)

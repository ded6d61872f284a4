"""Packing (``data/packing.py``): several documents per row of exactly ``row_length``
tokens, ``position_ids`` restarting at each document, labels shifted inside each document
(``ignore_index`` at its end and on padding); streamed, re-iterable as a dataset. Our GPT
reads the ``position_ids`` and keeps attention inside each document, so a packed document's
logits are those of the document alone (SDPA and explicit softmax), and training on packed
batches equals eager torch's (fp32, rtol 1e-5) serial and on the simulator's dp2, tp2, pp2
and cp2 (method allgather). Ring attention refuses the document mask and names allgather."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

import autopar as ap
from autopar.capture import RingAttentionError
from autopar.data.packing import (
    IGNORE_INDEX,
    PackedDataset,
    PackingCollator,
    pack_documents,
)
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import document_mask, lm_loss

from ..parity import (  # noqa: F401  (one_thread: a fixture)
    assert_same_losses,
    assert_same_params,
    gpt_optimizer,
    one_thread,
    parity_gpt,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ, BATCH, STEPS = 16, 4, 3
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')
SIM = "debug: {simulate: true}\n"


def _docs(n: int, lo: int = 1, hi: int = 40, vocab: int = 64, seed: int = 0
          ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g) for k in lengths]


def _rows(docs, row_length, **kw) -> list[list[list[int]]]:
    return [[r.input_ids.tolist(), r.position_ids.tolist(), r.labels.tolist()]
            for r in pack_documents(docs, row_length, **kw)]


X = IGNORE_INDEX


# ---- the packer -------------------------------------------------------------------------

def test_short_documents_share_a_row_and_the_last_row_is_padded():
    assert _rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 6, pad_id=0) == [
        [[1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 0], [2, 3, X, 5, X, 7]],
        # the split document's piece restarts at 0; padding continues its positions
        [[7, 8, 9, 0, 0, 0], [0, 1, 2, 3, 4, 5], [8, 9, X, X, X, X]],
    ]


def test_documents_that_fill_rows_exactly_need_no_padding():
    rows = _rows([[1, 2, 3, 4], [5, 6, 7, 8]], 4)
    assert rows == [[[1, 2, 3, 4], [0, 1, 2, 3], [2, 3, 4, X]],
                    [[5, 6, 7, 8], [0, 1, 2, 3], [6, 7, 8, X]]]
    assert _rows([[1, 2], [3, 4]], 4, split=False) == [[[1, 2, 3, 4], [0, 1, 0, 1],
                                                       [2, X, 4, X]]]


@pytest.mark.parametrize("split", [True, False])
def test_a_document_longer_than_a_row_is_cut_into_pieces_with_positions_from_0(split):
    rows = _rows([[1, 2], list(range(10, 20))], 4, split=split, pad_id=0)
    long_rows = [[[10, 11, 12, 13], [0, 1, 2, 3], [11, 12, 13, 14]],
                 [[14, 15, 16, 17], [0, 1, 2, 3], [15, 16, 17, 18]]]
    if split:       # concatenate-and-split: the long document fills the first row's tail
        assert rows == [[[1, 2, 10, 11], [0, 1, 0, 1], [2, X, 11, 12]],
                        [[12, 13, 14, 15], [0, 1, 2, 3], [13, 14, 15, 16]],
                        [[16, 17, 18, 19], [0, 1, 2, 3], [17, 18, 19, X]]]
    else:           # no split: it starts a row of its own, the first row's tail is padding
        assert rows == [[[1, 2, 0, 0], [0, 1, 2, 3], [2, X, X, X]], *long_rows,
                        [[18, 19, 0, 0], [0, 1, 2, 3], [19, X, X, X]]]


def test_a_document_that_does_not_fit_moves_to_the_next_row_without_split():
    assert _rows([[1, 2, 3], [4, 5, 6], [7]], 5, split=False, pad_id=9) == [
        [[1, 2, 3, 9, 9], [0, 1, 2, 3, 4], [2, 3, X, X, X]],
        [[4, 5, 6, 7, 9], [0, 1, 2, 0, 1], [5, 6, X, X, X]],
    ]


@pytest.mark.parametrize("split", [True, False])
def test_labels_never_cross_a_document_and_every_token_but_the_first_is_one(split):
    """Token ``j`` of document ``i`` is ``1000 i + j``: a label is its token plus one."""
    lengths = [int(n) for n in torch.randint(1, 30, (40,),
                                             generator=torch.Generator().manual_seed(1))]
    docs = [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lengths)]
    rows = list(pack_documents(docs, 16, split=split, pad_id=0))
    ids, labels = torch.stack([r.input_ids for r in rows]), torch.stack([r.labels for r in rows])
    kept = labels != X
    assert torch.equal(labels[kept], ids[kept] + 1)
    assert int(kept.sum()) == sum(n - 1 for n in lengths)
    assert ids[ids != 0].tolist() == [t for d in docs for t in d]   # in order, all of them
    assert all(len(r.input_ids) == 16 for r in rows)
    if split:
        assert len(rows) == -(-sum(lengths) // 16)


def test_packing_streams_from_a_generator():
    read = []

    def endless():
        for i in itertools.count():
            read.append(i)
            yield [i % 50] * 3
    first = list(itertools.islice(pack_documents(endless(), 8), 2))
    assert [r.input_ids.tolist() for r in first] == [[0, 0, 0, 1, 1, 1, 2, 2],
                                                      [2, 3, 3, 3, 4, 4, 4, 5]]
    assert len(read) == 6           # the documents of two rows, nothing ahead


def test_bad_documents_are_named():
    with pytest.raises(ValueError, match=r"document 1: .*1-D .*shape \[2, 2\]"):
        list(pack_documents([[1], torch.zeros(2, 2, dtype=torch.long)], 4))
    with pytest.raises(ValueError, match=r"document 0: .*integer .*torch.float32"):
        list(pack_documents([torch.ones(3)], 4))
    assert _rows([[], [1, 2]], 2) == [[[1, 2], [0, 1], [2, X]]]    # empty ones skipped


def test_the_dataset_is_re_iterable_and_batches_for_the_engine():
    docs = _docs(12)
    ds = PackedDataset(docs, SEQ)
    first, second = list(ds), list(ds)
    assert len(first) == len(second) > 1
    for (a, la), (b, lb) in zip(first, second):
        assert torch.equal(a["idx"], b["idx"]) and torch.equal(la, lb)
    x, y = next(iter(DataLoader(ds, batch_size=BATCH)))
    assert set(x) == {"idx", "position_ids"}
    assert x["idx"].shape == x["position_ids"].shape == y.shape == (BATCH, SEQ)
    hf = PackedDataset(lambda: iter(docs), SEQ, input_key="input_ids")
    assert all(torch.equal(a["input_ids"], b["idx"]) for (a, _), (b, _) in zip(hf, first))
    assert len(list(hf)) == len(first)          # a function gives a fresh stream each time
    with pytest.raises(TypeError, match="one-shot iterator.*lambda"):
        PackedDataset(iter(docs), SEQ)


def test_loader_workers_share_the_rows_without_reading_one_twice():
    ds = PackedDataset(_docs(12), 8)
    loaded = [y for _, y in DataLoader(ds, batch_size=None, num_workers=2)]
    want = [y for _, y in ds]
    assert len(loaded) == len(want)
    assert sorted(map(tuple, (y.tolist() for y in loaded))) == sorted(
        map(tuple, (y.tolist() for y in want)))


def test_the_dataset_wraps_an_iterable_dataset():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_docs(6))
    rows = list(PackedDataset(Stream(), 8))
    assert sum(int((y != X).sum()) for _, y in rows) == sum(len(d) - 1 for d in _docs(6))


def test_the_dataset_reads_a_map_style_dataset_of_hugging_face_rows_by_index():
    class Rows(torch.utils.data.Dataset):     # raises no IndexError past its end
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"input_ids": [i + 1] * 3, "attention_mask": [1] * 3}
    (x, y), = PackedDataset(Rows(), 9, input_key="input_ids")
    assert x["input_ids"].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert y.tolist() == [1, 1, X, 2, 2, X, 3, 3, X]
    with pytest.raises(ValueError, match=r"document 0: a mapping without 'input_ids' .*'text'"):
        list(pack_documents([{"text": "hi"}], 4))


def test_the_collator_packs_a_batch_of_documents():
    collate = PackingCollator(8, rows=3)
    x, y = collate([[1, 2, 3], {"input_ids": [4, 5, 6, 7, 8]}, torch.tensor([9, 9])])
    assert x["idx"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9] + [0] * 6, [0] * 8]
    assert x["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert (y[2] == X).all() and y[1].tolist()[:2] == [9, X]
    with pytest.raises(ValueError, match="fill 2 rows of 8 tokens, more than rows=1"):
        PackingCollator(8, rows=1)([[1] * 6, [2] * 6])


# ---- the document mask ------------------------------------------------------------------

def test_the_document_mask_is_causal_inside_each_document():
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1, 5, 6]]))[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2])     # 5 does not follow 1: a new document
    want = (doc[:, None] == doc[None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
    assert torch.equal(mask, want)


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "explicit"])
def test_a_packed_document_has_the_logits_of_the_document_alone(sdpa):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32,
                          sdpa=sdpa)).eval()
    docs = _docs(7, hi=24)
    rows = list(pack_documents(docs, SEQ, pad_id=0))
    ids = torch.stack([r.input_ids for r in rows])
    positions = torch.stack([r.position_ids for r in rows])
    with torch.no_grad():
        packed = model(ids, positions).flatten(0, 1)
        # each piece a document of its own: cut where the positions restart
        starts = (positions.flatten() == 0).nonzero().flatten().tolist() + [ids.numel()]
        pieces = [ids.flatten()[a:b] for a, b in zip(starts, starts[1:])]
        real = sum(len(d) for d in docs)
        at = 0
        for piece in pieces:
            n = min(len(piece), real - at)          # the last piece's padding is not its own
            alone = model(piece[None, :n])[0]
            torch.testing.assert_close(packed[at:at + n], alone, rtol=1e-5, atol=1e-6)
            at += len(piece)
    assert at == ids.numel()


# ---- training through the engine --------------------------------------------------------

def _eager(model, opt, sched, loader) -> list[float]:
    losses = []
    for x, y in itertools.islice(loader, STEPS):
        opt.zero_grad()
        loss = lm_loss(model(**x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


LAYOUTS = {
    "serial": "",
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n" + SIM,
    "tp2": (f"mesh: {{shape: [2], dim_names: [tp]}}\n"
            f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n" + SIM),
    "pp2": ("mesh: {shape: [2], dim_names: [pp]}\n"
            "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n" + SIM),
    "cp2": ("mesh: {shape: [2], dim_names: [cp]}\n"
            "context_parallel: {axis: cp, method: allgather}\n" + SIM),
    "dp2xcp2": ("mesh: {shape: [2, 2], dim_names: [dp, cp]}\ndata_parallel: {axis: dp}\n"
                "context_parallel: {axis: cp, method: allgather}\n" + SIM),
    "pp2xcp2": ("mesh: {shape: [2, 2], dim_names: [pp, cp]}\n"
                "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n"
                "context_parallel: {axis: cp, method: allgather}\n" + SIM),
}


# AdamW runs SDPA, SGD the explicit softmax (parity_gpt); tp with SGD: AdamW follows the
# rounding noise of a near-zero gradient (tests/end_to_end/test_parity_dist.py)
@pytest.mark.parametrize("layout, optim", [
    ("serial", "adamw"), ("serial", "sgd"), ("dp2", "adamw"), ("tp2", "sgd"),
    ("pp2", "adamw"), ("pp2", "sgd"), ("cp2", "adamw"), ("cp2", "sgd"),
    ("dp2xcp2", "adamw"), ("pp2xcp2", "sgd"),
])
def test_packed_batches_train_like_eager(layout, optim):
    model = parity_gpt(optim, seq=SEQ)
    ref = twin(model)
    data = PackedDataset(_docs(30), SEQ)
    want = _eager(ref, *gpt_optimizer(optim, ref, warmup=2), DataLoader(data, batch_size=BATCH))
    opt, sched = gpt_optimizer(optim, model, warmup=2)
    engine = ap.Engine(model, lm_loss, opt, strategy=ap.Strategy.from_yaml_str(LAYOUTS[layout]),
                       lr_scheduler=sched)
    history = engine.fit(DataLoader(data, batch_size=BATCH), steps_per_epoch=STEPS, verbose=0)
    assert_same_losses(history["loss"], want)
    assert_same_params(model, ref)


def test_ring_attention_refuses_the_document_mask_and_names_allgather():
    model = parity_gpt("adamw", seq=SEQ)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           "mesh: {shape: [2], dim_names: [cp]}\n"
                           "context_parallel: {axis: cp, method: ring}\n" + SIM))
    with pytest.raises(RingAttentionError,
                       match=r"blocks.0.attn.*takes no attn_mask.*packed rows.*method: allgather"):
        engine.fit(DataLoader(PackedDataset(_docs(8), SEQ), batch_size=BATCH), verbose=0)

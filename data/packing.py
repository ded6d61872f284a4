"""Packing: several documents per training row, attention kept inside each document.

Padding every document to a row wastes the compute of the padding; packing concatenates
documents into rows of exactly ``row_length`` tokens instead, and tells the model where each
one starts through ``position_ids`` that restart at 0 at every document (Hugging Face's
``DataCollatorWithFlattening`` convention). A model that reads them keeps attention inside
each document (``models.gpt.document_mask``; Hugging Face's flash-attention models do the
same), so a packed document's logits are those of the document alone.

Per row the packer yields the token ids, the ``position_ids`` and the labels, already
shifted for a model without an internal shift (our GPT with ``models.gpt.lm_loss``):
``labels[t]`` is the next token of the same document, ``ignore_index`` at each document's
last token (its next token is another document's) and on padding. The loss
``F.cross_entropy(..., ignore_index=-100)`` is then the mean over every non-ignored label
token of the global batch, as Hugging Face normalises a packed batch: a document weighs by
its tokens, not by its row.

Two ways to fill a row (``split``):

* ``split=True`` (default; Megatron's and torchtitan's concatenate-and-split, the
  pretraining standard): documents are concatenated in order and the stream is cut every
  ``row_length`` tokens, so there is no padding but the last row's; a document crossing a
  row boundary continues in the next row.
* ``split=False`` (Hugging Face / torchtune "no split", greedy in order): a document that
  does not fit the rest of the row starts the next one, and the row's tail is padded.

Either way a document longer than a row is cut into pieces of at most ``row_length``
tokens, and each piece's ``position_ids`` restart at 0: the model sees the piece as a
document of its own (attention cannot cross rows anyway), and positions stay below
``row_length`` (a learned position embedding of ``block_size`` >= ``row_length`` covers them;
positions continuing past it would not). The labels do not restart: a piece's last label is
the first token of the document's next piece, the true next token, so every token of a
document but its first is a label exactly once, as in the unpacked document.

Padding (``pad_id``, labels ``ignore_index``) takes ``position_ids`` that continue the last
document's (torchtune's convention): the padding joins that document, after every real
token of it, which causal attention never lets a real token read.

Streaming: documents are read one at a time and a row is yielded as soon as it is full;
nothing holds more than one row and one document.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, Union

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

__all__ = ["PackedRow", "PackedDataset", "PackingCollator", "pack_documents", "IGNORE_INDEX"]

IGNORE_INDEX = -100       # torch.nn.functional.cross_entropy's default ignore_index
Document = Union[Sequence[int], torch.Tensor]


class PackedRow(NamedTuple):
    """One packed row: ``input_ids``, ``position_ids`` and ``labels``, each [row_length]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor


def _tokens(doc: Document | Mapping[str, Any], index: int) -> torch.Tensor:
    if isinstance(doc, Mapping):
        if "input_ids" not in doc:
            raise ValueError(f"document {index}: a mapping without 'input_ids' (keys "
                             f"{sorted(doc)}): a document is token ids, or a Hugging Face "
                             "dataset row holding them at 'input_ids'")
        doc = doc["input_ids"]
    t = torch.as_tensor(doc)
    if t.dim() == 1 and not t.numel():
        return t.long()               # [] reads as float32: an empty document, skipped
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise ValueError(f"document {index}: expected a 1-D sequence of integer token ids, "
                         f"got a {t.dtype} tensor of shape {list(t.shape)}")
    return t.long()


def _next_tokens(ids: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each token's label: the document's next token, ``ignore_index`` after the last."""
    return torch.cat([ids[1:], ids.new_full((1,), ignore_index)])


class _Row:
    """The row being filled: pieces of documents, each with positions from 0."""

    def __init__(self, length: int):
        self.length, self.filled = length, 0
        self.ids: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    @property
    def space(self) -> int:
        return self.length - self.filled

    def add(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids.append(ids)
        self.labels.append(labels)
        self.positions.append(torch.arange(len(ids)))
        self.filled += len(ids)

    def close(self, pad_id: int, ignore_index: int) -> PackedRow:
        """The row, its tail padded (positions continuing the last piece's)."""
        pad = self.space
        if pad:
            last = int(self.positions[-1][-1]) + 1
            self.ids.append(torch.full((pad,), pad_id, dtype=torch.long))
            self.labels.append(torch.full((pad,), ignore_index, dtype=torch.long))
            self.positions.append(torch.arange(last, last + pad))
        return PackedRow(torch.cat(self.ids), torch.cat(self.positions), torch.cat(self.labels))


def pack_documents(documents: Iterable[Document], row_length: int, *, split: bool = True,
                   pad_id: int = 0, ignore_index: int = IGNORE_INDEX) -> Iterator[PackedRow]:
    """Pack ``documents`` (each a 1-D sequence of token ids, or a mapping holding them at
    ``"input_ids"``: a Hugging Face dataset row) in order into rows of exactly
    ``row_length`` tokens, streaming; see the module's docstring for ``split``, long
    documents, labels and padding. Empty documents are skipped; the last row is padded."""
    if row_length < 1:
        raise ValueError(f"row_length must be >= 1, got {row_length}")
    row = _Row(row_length)
    for index, doc in enumerate(documents):
        ids = _tokens(doc, index)
        if not len(ids):
            continue
        if not split and row.filled and len(ids) > row.space:
            yield row.close(pad_id, ignore_index)
            row = _Row(row_length)
        labels, start = _next_tokens(ids, ignore_index), 0
        while start < len(ids):
            take = min(row.space, len(ids) - start)
            row.add(ids[start:start + take], labels[start:start + take])
            start += take
            if not row.space:
                yield row.close(pad_id, ignore_index)
                row = _Row(row_length)
    if row.filled:
        yield row.close(pad_id, ignore_index)


def _sample(row: PackedRow, input_key: str, position_key: str) -> tuple[dict, torch.Tensor]:
    return {input_key: row.input_ids, position_key: row.position_ids}, row.labels


class PackedDataset(IterableDataset):
    """Packed rows of ``documents`` as ``({input_key: ids, position_key: positions}, labels)``
    samples, each tensor [row_length]: ``DataLoader(PackedDataset(docs, 128), batch_size=8)``
    gives the batches ``Engine.fit`` takes (the dict's entries become the model's keyword
    arguments). ``input_key``: ``"idx"`` for our GPT, ``"input_ids"`` for Hugging Face
    models.

    ``documents``: any re-iterable of documents as ``pack_documents`` takes them (a list, a
    map-style Dataset, another IterableDataset), or a function returning a fresh iterable
    (to stream a generator). Every ``__iter__`` packs from the start, so each epoch sees the
    same rows. A one-shot iterator is refused: its second epoch would be silently empty.
    Under a DataLoader with ``num_workers`` > 1 each worker packs the whole stream and keeps
    every n-th row, so no row is read twice (their order then follows the loader's
    interleaving)."""

    def __init__(self, documents: Iterable[Document] | Callable[[], Iterable[Document]],
                 row_length: int, *, split: bool = True, pad_id: int = 0,
                 ignore_index: int = IGNORE_INDEX, input_key: str = "idx",
                 position_key: str = "position_ids"):
        super().__init__()
        if not callable(documents) and iter(documents) is documents:
            raise TypeError("PackedDataset: documents is a one-shot iterator (a generator?), "
                            "which a second epoch would find empty: pass a list or dataset, "
                            "or a function returning a fresh iterator (lambda: my_generator())")
        if row_length < 1:
            raise ValueError(f"PackedDataset: row_length must be >= 1, got {row_length}")
        self.documents, self.row_length, self.split = documents, row_length, split
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.input_key, self.position_key = input_key, position_key

    def rows(self) -> Iterator[PackedRow]:
        """Every packed row from the start (all workers' rows)."""
        docs = self.documents() if callable(self.documents) else self.documents
        if isinstance(docs, Dataset) and not isinstance(docs, IterableDataset):
            # by index, as a DataLoader reads it: iter() would call __getitem__ until an
            # IndexError that a map-style dataset need not raise
            docs = map(docs.__getitem__, range(len(docs)))
        return pack_documents(docs, self.row_length, split=self.split, pad_id=self.pad_id,
                              ignore_index=self.ignore_index)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        worker = get_worker_info()
        share, count = (0, 1) if worker is None else (worker.id, worker.num_workers)
        for i, row in enumerate(self.rows()):
            if i % count == share:
                yield _sample(row, self.input_key, self.position_key)


class PackingCollator:
    """A ``collate_fn`` packing a batch of documents into rows (Hugging Face's
    ``DataCollatorWithFlattening``, cut into rows of ``row_length``):
    ``DataLoader(docs, batch_size=16, collate_fn=PackingCollator(128))`` gives
    ``({input_key: [R, row_length], position_key: [R, row_length]}, labels)`` batches. A
    document is a sequence of token ids, or a mapping holding them at ``"input_ids"`` (a
    Hugging Face dataset row). The number of rows ``R`` follows the documents' lengths; give
    ``rows`` to always get that many (rows of padding added, every label ignored; more are
    refused), so that every batch has one shape and the engine plans once."""

    def __init__(self, row_length: int, *, rows: int | None = None, split: bool = True,
                 pad_id: int = 0, ignore_index: int = IGNORE_INDEX, input_key: str = "idx",
                 position_key: str = "position_ids"):
        self.row_length, self.rows, self.split = row_length, rows, split
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.input_key, self.position_key = input_key, position_key

    def __call__(self, features: Sequence[Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        packed = list(pack_documents(features, self.row_length, split=self.split,
                                     pad_id=self.pad_id, ignore_index=self.ignore_index))
        packed += [self._empty_row()] * self._missing(len(packed))
        if not packed:
            raise ValueError("PackingCollator: the batch's documents hold no tokens")
        ids, positions, labels = (torch.stack(t) for t in zip(*packed))
        return {self.input_key: ids, self.position_key: positions}, labels

    def _missing(self, have: int) -> int:
        if self.rows is None:
            return 0
        if have > self.rows:
            raise ValueError(f"PackingCollator: the batch's documents fill {have} rows of "
                             f"{self.row_length} tokens, more than rows={self.rows}: give "
                             "fewer documents per batch or more rows")
        return self.rows - have

    def _empty_row(self) -> PackedRow:
        n = self.row_length
        return PackedRow(torch.full((n,), self.pad_id, dtype=torch.long), torch.arange(n),
                         torch.full((n,), self.ignore_index, dtype=torch.long))

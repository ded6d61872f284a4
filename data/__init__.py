"""The data feed: the user's data in, global batches to the planned steps out.

    feed           Feed: what the engine asks for batches (loaders, padding, streams,
                   the data position, the step's feeds, outputs in the model's structure)
    loaders        global batches of (inputs, labels) from datasets and DataLoaders
    padding        a batch padded to a planned shape (``data:``), its outputs cut back
    packing        several documents per row (PackedDataset), attention kept inside each
    streams        an IterableDataset read in shards by the data-parallel processes
    data_position  where a run's data stands, so a resumed run reads the same batches

``PackedDataset``, ``PackingCollator`` and ``pack_documents`` are also ``autopar.*``.
"""
from .feed import FEED_SECTIONS, Feed, steps_in
from .packing import PackedDataset, PackingCollator, pack_documents
from .padding import PaddingError
from .streams import StreamError

__all__ = ["FEED_SECTIONS", "Feed", "PackedDataset", "PackingCollator", "PaddingError",
           "StreamError", "pack_documents", "steps_in"]

"""The face users call: ``Engine`` (fit / evaluate / predict / prepare / explain).

    engine        the Keras/Paddle-style loops, read top to bottom
    planner       capture -> passes -> lowering, once per mode and batch signature
    model_state   the model and optimizer as named state: starting values, write-back
    launch        how this process was started (torchrun's rank, offline planning)
    offline       ``python -m autopar plan script.py``: plan an unmodified script
    callbacks     hooks around fit / evaluate / predict: progress bar, early stopping, ...
    checkpointing save / load on torch.distributed.checkpoint, into any strategy
    data, logging batches from datasets; the progress display
    packing       several documents per row (PackedDataset), attention kept inside each
"""
from . import callbacks
from .engine import Engine
from .packing import PackedDataset, PackingCollator, pack_documents

__all__ = ["Engine", "PackedDataset", "PackingCollator", "callbacks", "pack_documents"]

"""The face users call: ``Engine`` (fit / evaluate / predict / prepare / explain).

    engine        the Keras/Paddle-style loops, read top to bottom
    planner       capture -> passes -> lowering, once per mode and batch signature
    model_state   the model and optimizer as named state: starting values, write-back
    launch        how this process was started (torchrun's rank, offline planning)
    offline       ``python -m autopar plan script.py``: plan an unmodified script
    callbacks     hooks around fit / evaluate / predict: progress bar, early stopping, ...
    checkpointing save / load on torch.distributed.checkpoint, into any strategy
    data, logging batches from datasets; the progress display
"""
from . import callbacks
from .engine import Engine

__all__ = ["Engine", "callbacks"]

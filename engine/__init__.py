"""The face users call: ``Engine`` (fit / evaluate / predict / prepare / explain).

    engine     the Keras/Paddle-style loops, read top to bottom
    launch     how this process was started (torchrun's rank, offline planning)
    offline    ``python -m autopar plan script.py``: plan an unmodified script
    elastic    a restart on another world size: the strategy for the world launched
    callbacks  hooks around fit / evaluate / predict: progress bar, early stopping, ...
    readings   the history: losses read from the device where they are logged
    logging    the progress display

What the face calls lives below it: the step planner (``autopar.planner``), the data feed
(``autopar.data``), the auto search (``autopar.auto``), the training state and checkpoints
(``autopar.state``), the divergence locator (``autopar.divergence``) and the runtime.
"""
from . import callbacks
from .engine import Engine

__all__ = ["Engine", "callbacks"]

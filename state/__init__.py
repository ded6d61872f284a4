"""The training state, below the engine: the model and optimizer as named, typed state (keys
made where the state is declared and carried by lowering), how far the run has trained, a
meta-device model materialized piece by piece, checkpoints and exports.

    train_state         TrainState (starting values, pieces, write-back) and Progress
    meta_init           a meta-device model's init path, run for each process's pieces
    piece_init          how an init op writes a piece of a tensor
    checkpointing       save / load on torch.distributed.checkpoint, into any strategy
    async_save          a checkpoint snapshotted at the call and written in the background
    safetensors_export  the trained model's state_dict as one safetensors file

The engine hands it the facts of the run (``RunRecord``) and where the values live (the
runtime); nothing here imports the engine.
"""
from .async_save import BackgroundSaver
from .checkpointing import (
    TRAINER_KEY,
    CheckpointError,
    CheckpointMismatch,
    RunRecord,
    load_checkpoint,
    save_checkpoint,
)
from .meta_init import MetaInitError, MetaInitNote
from .safetensors_export import export_full
from .train_state import Progress, TrainState, place_model

__all__ = ["BackgroundSaver", "TRAINER_KEY", "CheckpointError", "CheckpointMismatch",
           "RunRecord", "load_checkpoint", "save_checkpoint", "MetaInitError", "MetaInitNote",
           "export_full", "Progress", "TrainState", "place_model"]

"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): each process writes the
boxes of the state it holds (``boxes``), DCP planners that write and read those boxes
(``dcp_planners``), and the directory lifecycle: a checkpoint appears only once complete,
older ones pruned, metadata read without arbitrary unpickling (``store``); a streaming
safetensors writer (``safetensors_file``) and a checkpoint's model consolidated into one
file (``consolidate``). What the training state saves and loads with them is
``autopar.state.checkpointing``."""
from .boxes import (
    EXTRA,
    MODEL,
    OPTIM,
    Box,
    checkpoint_key,
    piece_boxes,
    writes_piece,
)
from .consolidate import consolidate_model
from .dcp_planners import BoxLoadPlanner, BoxSavePlanner, Chunk
from .safetensors_file import SafetensorsWriter, TensorEntry, safetensors_path
from .store import CheckpointDir, SafeReader, is_checkpoint, latest_checkpoint, prune

__all__ = ["EXTRA", "MODEL", "OPTIM", "Box", "checkpoint_key",
           "piece_boxes", "writes_piece", "consolidate_model", "BoxLoadPlanner", "BoxSavePlanner",
           "Chunk", "SafetensorsWriter", "TensorEntry", "safetensors_path", "CheckpointDir",
           "SafeReader", "is_checkpoint", "latest_checkpoint", "prune"]

"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): each process writes the
boxes of the state it holds (``layout``), DCP planners that write and read those boxes
(``planners``), and the directory lifecycle: a checkpoint appears only once complete, older
ones pruned, metadata read without arbitrary unpickling (``store``)."""
from .boxes import Box, checkpoint_key, piece_boxes, writes_piece
from .store import CheckpointDir, latest_checkpoint

__all__ = ["Box", "checkpoint_key", "piece_boxes", "writes_piece", "CheckpointDir",
           "latest_checkpoint"]

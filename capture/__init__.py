"""Capture: the whole training step of an ordinary ``nn.Module`` (forward, loss, backward)
traced by ``make_fx`` into one IR ``Program``.

    step             capture(): the step traced with fake tensors, and its spec (how results
                     map back to the model's output structure); the batch flattened
    mixed_precision  how the step is traced under amp O1 (autocast) and O2 (half casts)
    experts          a static dispatch substituted for mixture-of-experts layers while tracing
    ring_attention   ring attention substituted for attention while tracing (context parallel)

``ir.from_fx`` turns a traced fx graph into IR ops (capture and the passes that trace small
torch functions use it).
"""
from .mixed_precision import FULL_PRECISION, Precision
from .ring_attention import RingAttentionError
from .step import (
    BatchDimError,
    Captured,
    CaptureError,
    CaptureNote,
    StepSpec,
    batch_dim_of,
    batch_paths,
    batch_size_of,
    call_model,
    capture,
    flatten_batch,
    loss_from_output,
)

__all__ = ["FULL_PRECISION", "Precision", "CaptureError", "CaptureNote", "Captured",
           "StepSpec", "BatchDimError", "RingAttentionError", "batch_dim_of", "batch_paths",
           "batch_size_of", "call_model", "capture", "flatten_batch", "loss_from_output"]

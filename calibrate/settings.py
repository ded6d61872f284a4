"""What a calibration measures and for how long: sizes, windows and repeats of every
measurement (``Settings``), and the half-precision dtypes it measures besides fp32."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Settings", "HALF", "dtype_name"]

HALF = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the profile names it: ``float32``, ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Settings:
    """What to measure and how long: the default takes about a minute on 2 cores with 4
    processes, ``quick`` a few seconds (tests)."""

    matmul_flops: tuple[float, ...]
    pointwise_bytes: tuple[float, ...]
    collective_bytes: tuple[int, ...]     # the full tensor, before the group cuts it
    batch_s: float                        # one timed batch of compute calls
    repeats: int                          # timed batches of each compute point
    comm_repeats: int                     # timed calls of each collective point
    overhead_ops: int = 256
    half_matmul_flops: tuple[float, ...] = (1e4, 1e6, 1e8)    # half precision: slow on CPU
    half_pointwise_bytes: tuple[float, ...] = (1024.0, 65536.0, 4194304.0)
    op_sizes: int = 4                     # sizes of each probed op (calibrate/op_probes.py)
    half_op_sizes: int = 2
    slowdown_repeats: int = 6
    slowdown_window_s: float = 0.1
    pipeline_bytes: tuple[int, ...] = (4096, 65536, 1048576)   # pipeline message sizes
    pipeline_micro_batches: int = 8
    pipeline_repeats: int = 5

    @classmethod
    def default(cls) -> Settings:
        return cls(matmul_flops=tuple(10 ** (k / 2) for k in range(6, 19)),
                   pointwise_bytes=tuple(float(4 ** k) for k in range(3, 14)),
                   collective_bytes=tuple(4 ** k for k in range(5, 13)),
                   batch_s=0.01, repeats=9, comm_repeats=31,
                   half_matmul_flops=tuple(10.0 ** k for k in range(3, 9)),
                   half_pointwise_bytes=tuple(float(4 ** k) for k in range(4, 13, 2)))

    @classmethod
    def quick(cls) -> Settings:
        return cls(matmul_flops=(1e3, 1e5, 1e7), pointwise_bytes=(256.0, 16384.0, 1048576.0),
                   collective_bytes=(1024, 65536, 1048576), batch_s=0.004, repeats=3,
                   comm_repeats=3, overhead_ops=64, half_matmul_flops=(1e4, 1e6),
                   half_pointwise_bytes=(1024.0, 65536.0), op_sizes=2, half_op_sizes=1,
                   slowdown_repeats=1, slowdown_window_s=0.02,
                   pipeline_bytes=(4096, 65536), pipeline_micro_batches=2, pipeline_repeats=1)

"""Strategy: the typed, strict form of the strategy YAML (see configs/serial.yaml).

Pure Python (pydantic + PyYAML); nothing here imports torch or reads the environment.
"""

from .config import (
    ALWAYS_SUPPORTED,
    AXIS_SECTIONS,
    DUMP_DIR_ENV,
    Strategy,
    UnsupportedStrategyError,
)
from .sections import (
    AmpConfig,
    AutoConfig,
    CompileConfig,
    DataParallelConfig,
    DebugConfig,
    ExpertParallelConfig,
    GradClipConfig,
    GradientMergeConfig,
    MeshConfig,
    PipelineConfig,
    RecomputeConfig,
    Section,
    ShardingConfig,
    TensorParallelConfig,
)

__all__ = [
    "ALWAYS_SUPPORTED",
    "AXIS_SECTIONS",
    "DUMP_DIR_ENV",
    "AmpConfig",
    "AutoConfig",
    "CompileConfig",
    "DataParallelConfig",
    "DebugConfig",
    "ExpertParallelConfig",
    "GradClipConfig",
    "GradientMergeConfig",
    "MeshConfig",
    "PipelineConfig",
    "RecomputeConfig",
    "Section",
    "ShardingConfig",
    "Strategy",
    "TensorParallelConfig",
    "UnsupportedStrategyError",
]

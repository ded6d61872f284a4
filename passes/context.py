"""What a pass may read besides the program: chosen once by the engine, never from the
environment inside a pass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.dist import DistAttr, ProcessMesh
from ..pipeline.layout import PipelineLayout
from ..strategy import Strategy


@dataclass
class PassContext:
    strategy: Strategy
    optimizer: torch.optim.Optimizer | None = None
    param_names: dict[int, str] = field(default_factory=dict)   # id(parameter) -> FQN
    mode: str = "train"
    rank: int = 0
    world_size: int = 1
    # The mesh the program runs on: the strategy's, else the one the annotations use
    # (the annotate pass settles it). None: serial, nothing to place.
    mesh: ProcessMesh | None = None
    # shard_tensor placements given to parameters before planning, by parameter FQN.
    param_annotations: dict[str, DistAttr] = field(default_factory=dict)
    # where earlier programs of the same engine placed each parameter: a parameter keeps
    # one placement (eval and predict programs read the pieces training updates)
    kept_placements: dict[str, DistAttr] = field(default_factory=dict)
    # A pipeline's stages and micro-batches (the strategy's, or settled by the annotate pass
    # from layers annotated on several meshes); ``mesh`` is then its logical mesh.
    pipeline: PipelineLayout | None = None
    # micro-batches this program uses (eval and predict may use fewer than training: their
    # batches can be smaller); None: the pipeline's own count
    micro_batches: int | None = None
    # pp position of each parameter annotated on one stage's mesh (shard_tensor)
    param_stages: dict[str, int] = field(default_factory=dict)
    # the pipeline's job order per rank, set by the schedule pass (a PipelineSchedule)
    schedule: Any = None

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self.param_names[id(param)]
        except KeyError:
            raise ValueError(
                f"the optimizer holds a tensor of shape {list(param.shape)} that is not a "
                "parameter of the model given to Engine") from None

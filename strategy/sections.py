"""One pydantic model per section of the strategy YAML.

Each model validates only its own fields; facts that need the mesh (does an axis exist, do two
sections share one) are checked by ``Strategy`` where the mesh is known. Every model forbids
unknown keys and names the key and the section, because a misspelt option that is silently
ignored trains a different model than the user asked for.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .yaml_io import dump_flow

# Mesh dim names are printed in IR dumps and placements, so they are plain identifiers.
AxisName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# Module names and plan patterns (``blocks.*.qkv``): any non-empty text without whitespace.
ModulePattern = Annotated[str, Field(strict=True, pattern=r"^\S+$")]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
StrictBool = Annotated[bool, Field(strict=True)]
StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]
# The batch dim of every fed tensor (inputs and labels), or per fed tensor by its path in
# the batch: ``inputs`` / ``inputs.input_ids`` / ``inputs.0`` / ``labels`` (a path names a
# tensor or everything under it; unlisted tensors use dim 0).
BatchDim = Annotated[int, Field(strict=True, ge=0)] | dict[
    Annotated[str, Field(strict=True, pattern=r"^(inputs|labels)(\.[^.\s]+)*$")],
    Annotated[int, Field(strict=True, ge=0)]]

STRICT = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


def reject_unknown_keys(data: Mapping[Any, Any], allowed: Iterable[str], where: str) -> None:
    """Raise ValueError naming the first unknown key, where it was found and what is allowed.

    ``where`` completes the sentence, e.g. "in section 'amp'".
    """
    allowed = list(allowed)
    for key in data:
        if key in allowed:
            continue
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown key {key!r} {where}{hint}; "
                         f"allowed keys: {', '.join(allowed)}")


class Section(BaseModel):
    """Base of every section: strict keys, immutable, and a notion of being switched on."""

    model_config = STRICT
    SECTION: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            reject_unknown_keys(data, cls.model_fields, f"in section {cls.SECTION!r}")
        return data

    @property
    def is_enabled(self) -> bool:
        """Whether this section changes the training program (presence, unless overridden)."""
        return True

    def describe(self) -> str:
        """The section's values as one line of YAML, the way the user would write them."""
        return f"{self.SECTION}: {dump_flow(self.model_dump())}"

    def note(self) -> str:
        """What the section does, in a few words, for errors about its axis ('': nothing)."""
        return ""

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh dims a parallel section spans (its ``axis``; data_parallel may list
        several)."""
        axis = getattr(self, "axis", None)
        return () if axis is None else (axis,)


class SwitchedSection(Section):
    """A section switched on by ``enable``. Its other settings given without ``enable`` at
    all are refused: they would silently do nothing (``amp: {dtype: bfloat16, level: O2}``
    trains in fp32). ``WITHOUT_ENABLE``: the settings that act with the section off."""

    WITHOUT_ENABLE: ClassVar[frozenset[str]] = frozenset()
    enable: StrictBool = False

    @model_validator(mode="after")
    def _enable_said(self) -> "SwitchedSection":
        given = self.model_fields_set - {"enable"} - self.WITHOUT_ENABLE
        if given and "enable" not in self.model_fields_set:
            raise ValueError(
                f"{self.SECTION}: {', '.join(sorted(given))} given without enable, so "
                f"{'it does' if len(given) == 1 else 'they do'} nothing: add enable: true "
                f"(enable: false keeps the section off)")
        return self

    @property
    def is_enabled(self) -> bool:
        return self.enable


class MeshConfig(Section):
    """The device mesh: ``shape`` gives each dim's size, the last dim is the fastest link."""

    SECTION: ClassVar[str] = "mesh"
    shape: tuple[PositiveInt, ...] = Field(min_length=1)
    dim_names: tuple[AxisName, ...]

    @model_validator(mode="before")
    @classmethod
    def _default_dim_names(cls, data: Any) -> Any:
        """A 1-D mesh may omit its name ("d0"); with more dims, which is which must be said."""
        if not isinstance(data, Mapping) or "dim_names" in data:
            return data
        shape = data.get("shape")
        if isinstance(shape, (list, tuple)) and len(shape) > 1:
            raise ValueError(f"mesh with shape {list(shape)} needs dim_names, one per dim "
                             f"(e.g. [dp, tp]); sections refer to mesh dims by name")
        if isinstance(shape, (list, tuple)) and len(shape) == 1:
            return {**data, "dim_names": ["d0"]}
        return data

    @model_validator(mode="after")
    def _names_match_shape(self) -> MeshConfig:
        if len(self.dim_names) != len(self.shape):
            raise ValueError(f"mesh shape {list(self.shape)} has {len(self.shape)} dims but "
                             f"dim_names {list(self.dim_names)} has {len(self.dim_names)}")
        repeated = sorted({n for n in self.dim_names if self.dim_names.count(n) > 1})
        if repeated:
            raise ValueError(f"mesh dim_names {list(self.dim_names)} repeat {repeated}")
        return self

    @property
    def size(self) -> int:
        """Number of devices (processes) the mesh spans."""
        return math.prod(self.shape)

    def axis_size(self, axis: str) -> int:
        """Size of the named dim; KeyError if the mesh has no such dim."""
        if axis not in self.dim_names:
            raise KeyError(f"mesh {list(self.shape)} with dim_names {list(self.dim_names)} "
                           f"has no dim named {axis!r}")
        return self.shape[self.dim_names.index(axis)]

    @property
    def is_enabled(self) -> bool:
        """A mesh of one device is the serial case."""
        return self.size > 1


class DataParallelConfig(Section):
    """Inputs and labels are sharded on their batch dim over ``axis``; grads are averaged.
    ``axis`` may list several mesh dims (``[rep, shard]``): the batch is cut over each in
    turn, and the gradients are summed over all of them. With ZeRO over one of them
    (``sharding: {stage: 3, axis: shard}``) that is HSDP (FSDP2's 2-D mesh): the state is
    sharded inside a ``shard`` group and replicated across the groups."""

    SECTION: ClassVar[str] = "data_parallel"
    axis: AxisName | tuple[AxisName, ...] = "dp"
    # Gradient all-reduces are fused into buckets of about this many MiB (DDP's
    # bucket_cap_mb), each issued as soon as its last gradient exists and waited for just
    # before the optimizer reads it, so communication overlaps the rest of the backward.
    # 0 keeps one all-reduce per gradient.
    bucket_mb: Annotated[float, Field(ge=0)] = 25.0
    # the dim of the fed tensors that is the batch, e.g. 1 for [seq, batch, ...] inputs
    batch_dim: BatchDim = 0

    @field_validator("axis")
    @classmethod
    def _distinct_axes(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(value, tuple):
            if not value or len(set(value)) != len(value):
                raise ValueError(f"data_parallel.axis {list(value)}: a list of axes must name "
                                 "one or more distinct mesh dims")
            if len(value) == 1:
                return value[0]
        return value

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return self.axis if isinstance(self.axis, tuple) else (self.axis,)


class ContextParallelConfig(Section):
    """The sequence split over ``axis`` (context parallelism, for long sequences): every fed
    tensor is cut along ``seq_dim`` (the token ids and the labels: [batch, seq]), so each
    rank holds its chunk of every activation. ``allgather``: attention gathers the keys and
    values over the axis and each rank attends its query rows to all of them (a causal mask
    offset to its rows); the keys' and values' gradients are reduce-scattered back.
    ``ring``: no rank holds more than its chunk of the keys and values: they are passed
    around the ring of the axis's ranks (p2p), each rank attending its rows to one chunk at
    a time, and the blocks merged by their log-sum-exp; the backward passes them around
    again with their gradients (``capture/ring_attention.py``)."""

    SECTION: ClassVar[str] = "context_parallel"
    axis: AxisName = "cp"
    method: Literal["allgather", "ring"] = "allgather"
    seq_dim: Annotated[int, Field(strict=True, ge=0)] = 1

    def note(self) -> str:
        return "the sequence split" + (", ring attention" if self.method == "ring" else "")


class TensorParallelConfig(Section):
    """Megatron-style layer sharding over ``axis``; ``plan`` maps module patterns to styles.

    A plan entry is sugar for ``shard_tensor`` annotations on the matched module's parameters.
    ``sequence_parallel`` (Megatron-SP) also shards the activations between the parallel
    pairs (LayerNorm, dropout, residual adds) on ``sequence_dim`` over ``axis``: the outputs
    of rowwise and vocab modules are reduce-scattered there instead of all-reduced, and
    gathered again before each colwise module. ``sequence_dim`` 1 fits ``[batch, seq,
    hidden]`` activations, 0 ``[seq, batch, hidden]`` ones.
    """

    SECTION: ClassVar[str] = "tensor_parallel"
    axis: AxisName = "tp"
    plan: dict[ModulePattern, Literal["colwise", "rowwise", "vocab"]] = Field(default_factory=dict)
    sequence_parallel: StrictBool = False
    sequence_dim: Annotated[int, Field(strict=True, ge=0)] = 1

    @model_validator(mode="after")
    def _sequence_dim_needs_sequence_parallel(self) -> TensorParallelConfig:
        """A sequence dim other than the default says the user expects SP to be on."""
        if self.sequence_dim != 1 and not self.sequence_parallel:
            raise ValueError(f"tensor_parallel sequence_dim={self.sequence_dim} needs "
                             "sequence_parallel: true")
        return self


class ExpertParallelConfig(Section):
    """Mixture-of-experts weights split by expert over ``axis``: every parameter of an
    experts module (one that holds the experts' weights stacked in 3-D ``[experts, ...]``
    tensors) is ``Shard(0)`` there, so each rank holds and runs its own experts; the
    tokens' sum over their experts becomes a sum over ranks."""

    SECTION: ClassVar[str] = "expert_parallel"
    axis: AxisName = "ep"


class PipelineConfig(Section):
    """Pipeline stages over ``axis``; ``split`` is "auto" or the module names where a stage
    begins (stage boundaries, so one fewer than the number of stages).

    ``batch_norm``: what a training BatchNorm normalizes by when there are several
    micro-batches. ``whole_batch`` (the default): the statistics of the whole batch, as
    eager torch on the batch, which a pipeline cannot compute (refused, naming the op).
    ``per_micro_batch``: each micro-batch by its own statistics, running statistics
    updated once per micro-batch in order (what torch.distributed.pipelining computes)."""

    SECTION: ClassVar[str] = "pipeline"
    axis: AxisName = "pp"
    schedule: Literal["FThenB", "1F1B", "VPP", "ZBH1"] = "1F1B"
    micro_batches: PositiveInt = 1
    split: Literal["auto"] | tuple[ModulePattern, ...] = "auto"
    vpp_chunks: PositiveInt = 1
    # the dim micro-batches cut (as data_parallel.batch_dim; the two must agree)
    batch_dim: BatchDim = 0
    batch_norm: Literal["whole_batch", "per_micro_batch"] = "whole_batch"

    @model_validator(mode="after")
    def _chunks_match_schedule(self) -> PipelineConfig:
        """Chunks only mean something for VPP, and VPP with one chunk is just 1F1B."""
        if self.schedule == "VPP" and self.vpp_chunks < 2:
            raise ValueError("pipeline schedule VPP needs vpp_chunks >= 2 (model chunks per "
                             f"stage), got {self.vpp_chunks}")
        if self.schedule != "VPP" and self.vpp_chunks != 1:
            raise ValueError(f"pipeline vpp_chunks={self.vpp_chunks} needs schedule VPP, "
                             f"got {self.schedule}")
        if isinstance(self.split, tuple) and len(set(self.split)) != len(self.split):
            raise ValueError(f"pipeline split {list(self.split)} repeats a module name")
        return self

    def num_stages(self, axis_size: int) -> int:
        """Stages in the whole pipeline: one per rank on the axis, times the VPP chunks."""
        return axis_size * self.vpp_chunks


class OffloadConfig(Section):
    """What of the state lives in host memory (pinned, on CUDA) instead of the device's:
    ``optimizer``: the optimizer state, updated on the host (ZeRO-Offload; each gradient
    is copied out as the backward makes it, the new parameter copied back); ``params``:
    the parameters too, copied to the device where the step reads them (FSDP2's
    ``CPUOffloadPolicy``). On a CPU run both homes are the same memory: the program is
    the same, no byte moves."""

    SECTION: ClassVar[str] = "sharding.offload"
    optimizer: StrictBool = False
    params: StrictBool = False

    @model_validator(mode="after")
    def _params_need_optimizer(self) -> "OffloadConfig":
        if self.params and not self.optimizer:
            raise ValueError("sharding.offload: params: true keeps the parameters on the host, "
                             "where their update runs, so the optimizer state goes there too: "
                             "set optimizer: true as well")
        return self

    @property
    def is_enabled(self) -> bool:
        return self.optimizer or self.params


class ShardingConfig(Section):
    """ZeRO over ``axis``: 1 shards optimizer states, 2 also grads, 3 also parameters.
    ``offload``: which state lives in host memory (any stage, 0 included)."""

    SECTION: ClassVar[str] = "sharding"
    STAGES: ClassVar[str] = ("0 (off), 1 (optimizer state sharded), 2 (and gradients), "
                             "3 (and parameters)")
    axis: AxisName = "dp"
    stage: Annotated[int, Field(strict=True)] = 0
    # stage 3's gather unit: each repeated layer's parameters as one collective (FSDP's
    # per-block wrapping: few large collectives), or each module's (less memory in flight)
    unit: Literal["layer", "module"] = "layer"
    offload: OffloadConfig = OffloadConfig()

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, value: int) -> int:
        if not 0 <= value <= 3:
            bound = "greater than or equal to 0" if value < 0 else "less than or equal to 3"
            raise ValueError(f"sharding stage {value}: a stage must be {bound}; ZeRO stages "
                             f"are {cls.STAGES}")
        return value

    def note(self) -> str:
        return f"ZeRO stage {self.stage}"

    def describe(self) -> str:
        """As ``Section.describe``; offload only where it is on (its defaults say nothing)."""
        values = self.model_dump(exclude=set() if self.offload.is_enabled else {"offload"})
        return f"{self.SECTION}: {dump_flow(values)}"

    @property
    def is_enabled(self) -> bool:
        """Stage 0 keeps every state replicated: the same as no sharding."""
        return self.stage > 0


class AmpConfig(SwitchedSection):
    """Automatic mixed precision in ``dtype``.

    ``level`` O1: the casts ``torch.autocast`` makes (the step is captured under autocast,
    so the program holds exactly eager autocast's casts). O2: each floating parameter is
    cast to ``dtype`` once at the top of the step and the forward, the activations and the
    backward run in ``dtype``; the fp32 parameters are the master weights the optimizer
    updates, with fp32 optimizer state (FSDP2's MixedPrecisionPolicy). ``reduce_dtype``:
    the dtype gradients are summed in across ranks under O2 (float32: cast, then reduce;
    the half dtype: reduce, then cast). float16 needs loss scaling: ``loss_scale``
    "dynamic" (``torch.amp.GradScaler``'s rules with ``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``) or a fixed number; a step whose gradients hold
    an inf or nan on any rank is skipped (``passes/scale_loss.py``). ``loss_scale`` works
    without ``enable`` too: the step keeps the model's dtypes and only the loss is scaled,
    as GradScaler scales an fp32 model's. ``tf32``: on CUDA, whether float32 matmuls and
    convolutions may run as TensorFloat-32 (``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.backends.cudnn.allow_tf32``, process-wide, set by the engine when it computes
    on CUDA): off by default, so float32 means float32 and a run equals eager fp32 to
    1e-5; on, Ampere-and-later matmuls run several times faster at 10-bit mantissas.
    """

    SECTION: ClassVar[str] = "amp"
    WITHOUT_ENABLE: ClassVar[frozenset[str]] = frozenset({
        "loss_scale", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
        "tf32"})
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    level: Literal["O1", "O2"] = "O1"
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    loss_scale: Literal["dynamic"] | Annotated[float, Field(strict=True, gt=0)] | None = None
    init_scale: Annotated[float, Field(strict=True, gt=0)] = 65536.0
    growth_factor: Annotated[float, Field(strict=True, gt=1)] = 2.0
    backoff_factor: Annotated[float, Field(strict=True, gt=0, lt=1)] = 0.5
    growth_interval: PositiveInt = 2000
    tf32: StrictBool = False

    @model_validator(mode="after")
    def _consistent(self) -> AmpConfig:
        if self.reduce_dtype not in ("float32", self.dtype):
            raise ValueError(f"amp reduce_dtype {self.reduce_dtype} must be float32 or the "
                             f"amp dtype {self.dtype}")
        if self.reduce_dtype != "float32" and self.level != "O2":
            raise ValueError(f"amp reduce_dtype {self.reduce_dtype} needs level O2 (under O1 "
                             "parameters and their gradients stay float32)")
        if self.enable and self.dtype == "float16" and self.loss_scale is None:
            raise ValueError("amp dtype float16 needs loss_scale: dynamic (or a fixed number): "
                             "float16 gradients underflow without it")
        # a round trip writes every field, so only a value off its default says the user
        # expects dynamic scaling
        changed = sorted(name for name in ("init_scale", "growth_factor", "backoff_factor",
                                           "growth_interval")
                         if getattr(self, name) != type(self).model_fields[name].default)
        if self.loss_scale != "dynamic" and changed:
            raise ValueError(f"amp {changed} only apply to loss_scale: dynamic")
        return self



class RecomputeConfig(SwitchedSection):
    """Activation recomputation: the forward of each module matched by ``modules`` (glob
    patterns over module paths, e.g. ``blocks.*``; absent: every repeated layer, each
    instance of a module list of identical layers) keeps only its inputs for the backward
    and is run again just before its backward needs the rest. ``policy`` full recomputes
    every op of the segment (collectives included); selective keeps the outputs of matmuls,
    attention and collectives and recomputes only the cheap ops between them (Megatron's
    selective recompute)."""

    SECTION: ClassVar[str] = "recompute"
    modules: tuple[ModulePattern, ...] = ()
    policy: Literal["full", "selective"] = "full"


class GradientMergeConfig(Section):
    """Accumulate gradients over ``k_steps`` batches before one optimizer step (and one
    gradient all-reduce / reduce-scatter); ``avg`` divides the sum by ``k_steps``, so k
    batches of B train like one batch of k*B under a mean loss."""

    SECTION: ClassVar[str] = "gradient_merge"
    k_steps: PositiveInt = 1
    avg: StrictBool = True

    @property
    def is_enabled(self) -> bool:
        return self.k_steps > 1


class CompileConfig(SwitchedSection):
    """Compile every lowered program with ``torch.compile``: forward, backward and the
    optimizer update of a step as one graph. ``backend``: ``inductor`` (fused kernels), or
    ``aot_eager`` / ``eager`` to debug a compile problem. ``mode`` is ``torch.compile``'s.
    ``fallback``: what a program the compiler refuses does: ``error`` (the default: an error
    naming the op) or ``eager`` (a warning saying why, then it runs uncompiled).
    ``cache_dir``: Inductor's on-disk cache (default: torch's), so a restarted run skips
    the compile."""

    SECTION: ClassVar[str] = "compile"
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"
    fallback: Literal["error", "eager"] = "error"
    cache_dir: Annotated[str, Field(strict=True, min_length=1)] | None = None


class GradClipConfig(Section):
    """Clip gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

    ``max_norm`` null means no clipping; ``norm_type`` may be ``.inf`` (or the string "inf").
    """

    SECTION: ClassVar[str] = "grad_clip"
    max_norm: StrictFloat | None = None
    norm_type: StrictFloat = 2.0

    @field_validator("norm_type", mode="before")
    @classmethod
    def _inf_from_text(cls, value: Any) -> Any:
        """YAML reads ``inf`` as text (only ``.inf`` is a float); accept both spellings."""
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            return math.inf
        return value

    @field_validator("max_norm")
    @classmethod
    def _positive_finite(cls, value: float | None) -> float | None:
        if value is not None and not (0 < value < math.inf):
            raise ValueError(f"grad_clip max_norm must be a finite number > 0 or null, got {value}")
        return value

    @field_validator("norm_type")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not value > 0:  # also rejects nan
            raise ValueError(f"grad_clip norm_type must be > 0 or inf, got {value}")
        return value

    @property
    def is_enabled(self) -> bool:
        return self.max_norm is not None


class AutoConfig(Section):
    """Let the planner choose: over ``devices`` ranks it searches the mesh and the degrees
    of the ``axes`` it may use (data, tensor and pipeline parallel), ZeRO stages, pipeline
    micro-batches and recompute of the repeated layers, and inside each candidate the
    tensor-parallel placements (an integer program); it keeps the candidate its cost model
    predicts fastest within ``memory_limit_gb`` per rank. Sections written beside ``auto``
    are constraints it keeps (a mesh, a tensor-parallel plan, a ZeRO stage, ...), and so are
    ``shard_tensor`` annotations. ``profile``: a machine profile JSON (``python -m autopar
    calibrate``); default this machine's, else the shipped reference (the report says so).
    ``nodes``: the machines ``devices`` span; tensor parallelism never crosses one."""

    SECTION: ClassVar[str] = "auto"
    devices: PositiveInt
    # machines the devices are spread over, evenly: tensor parallelism stays inside one
    # (its collectives run every layer; the mesh puts tp last, on consecutive ranks)
    nodes: PositiveInt = 1
    memory_limit_gb: Annotated[float, Field(gt=0)] | None = None
    axes: tuple[Literal["dp", "tp", "pp"], ...] = Field(default=("dp", "tp", "pp"), min_length=1)
    zero_stages: tuple[Annotated[int, Field(strict=True, ge=0, le=3)], ...] = (0, 1, 2, 3)
    micro_batches: tuple[PositiveInt, ...] | None = None   # None: pp and 2 pp
    schedule: Literal["FThenB", "1F1B", "ZBH1"] = "1F1B"
    recompute: StrictBool = True            # may recompute the repeated layers to fit memory
    time_budget_s: Annotated[float, Field(gt=0)] = 60.0
    top: PositiveInt = 5                    # candidates shown side by side
    profile: Annotated[str, Field(strict=True, min_length=1)] | None = None

    @field_validator("axes", "zero_stages", "micro_batches")
    @classmethod
    def _no_repeats(cls, value: tuple | None) -> tuple | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"auto: {list(value)} repeats an entry")
        return value

    @model_validator(mode="after")
    def _nodes_split_devices(self) -> "AutoConfig":
        if self.devices % self.nodes:
            raise ValueError(f"auto: {self.devices} devices do not spread evenly over "
                             f"{self.nodes} nodes (devices = nodes x processes per node)")
        return self


class ElasticConfig(Section):
    """What a launch of another world size than the strategy's does (an elastic restart that
    lost or gained a node: torchrun ``--nnodes MIN:MAX``). ``on_resize``: ``error`` (the
    default) refuses it naming both sizes; ``data_parallel`` resizes the data-parallel axis
    (the first one listed, the replicas under HSDP) to take the new world, the other mesh
    dims kept; ``auto`` lets the planner choose the layout for the new world (as ``auto:``).
    The global batch is kept: each rank's share of it changes, and the log says so."""

    SECTION: ClassVar[str] = "elastic"
    on_resize: Literal["error", "data_parallel", "auto"] = "error"

    @property
    def is_enabled(self) -> bool:
        return self.on_resize != "error"


class DataConfig(Section):
    """How batches meet the planned programs. A program is specialised to its batch's
    shapes, and a new shape plans a new one: ``seq_buckets`` pads each batch's sequence
    (dim ``seq_dim`` of the fed tensors) up to the smallest listed length that holds it,
    ``pad_to_multiple`` up to a multiple, so a few plans serve every length. Token ids are
    padded with ``pad_id``, labels (the ``labels`` argument, and any fed tensor named
    ``labels``) with ``ignore_index``, an ``attention_mask`` with 0: a token-averaged loss
    (cross-entropy ignoring ``ignore_index``) and its gradients stay those of the unpadded
    batch, as long as no real position reads a padded one (a causal model never does; any
    other must mask it). ``pad_rows``: a batch with fewer rows than the first one (the
    short last batch) is padded with rows whose labels are all ``ignore_index``."""

    SECTION: ClassVar[str] = "data"
    seq_buckets: tuple[Annotated[int, Field(strict=True, gt=0)], ...] | None = None
    pad_to_multiple: Annotated[int, Field(strict=True, gt=0)] | None = None
    seq_dim: Annotated[int, Field(strict=True, ge=0)] = 1
    pad_rows: StrictBool = False
    pad_id: StrictInt = 0
    ignore_index: StrictInt = -100

    @field_validator("seq_buckets")
    @classmethod
    def _sorted_buckets(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or list(value) != sorted(set(value))):
            raise ValueError(f"data.seq_buckets {list(value)}: list one or more distinct "
                             "lengths in increasing order")
        return value

    @model_validator(mode="after")
    def _one_rule(self) -> DataConfig:
        if self.seq_buckets is not None and self.pad_to_multiple is not None:
            raise ValueError("data: seq_buckets and pad_to_multiple both say how to pad the "
                             "sequence; give one")
        return self

    @property
    def is_enabled(self) -> bool:
        return self.pads_sequence or self.pad_rows

    @property
    def pads_sequence(self) -> bool:
        return self.seq_buckets is not None or self.pad_to_multiple is not None


class DebugConfig(Section):
    """Debug aids: IR dumps, verifiers between passes, strict SPMD rule lookup.

    ``strict_rules`` makes an op without an SPMD rule an error instead of a replicate fallback.
    ``simulate`` runs every rank of a distributed plan in this one process, with exact
    collective semantics (slow; for tests and for debugging plans without a launcher).
    ``locate_divergence`` checks each new training plan's first step on the simulator, op by
    op, against the same step on one device, and stops at the first op that differs.
    ``trace`` writes a pipeline's jobs, each rank on a timeline, as a Chrome/Perfetto trace
    (``<dump_dir>/pipeline_trace.json``: measured wall times of every step of ``fit`` on
    real processes, the schedule's simulated timeline when simulating).
    ``dump_format`` says what ``dump_dir`` receives for each pass: ``text`` (the program
    after each pass, ``NN_<pass>.txt``; the default), ``dot`` (the same program as a Graphviz
    graph, ``NN_<pass>.dot``, values coloured by placement, collectives marked) and ``html``
    (one self-contained page per plan, ``<prefix>plan.html``: every pass, its program, its
    collectives and what it changed). Any combination; a single name is a list of one.
    ``dump_ranks`` says whose lowered programs are written (``rank<r>/NN_partition.txt`` or
    ``NN_jobs.txt``, and ``NN_memory.txt``): ``all`` (every process lowered; the default),
    ``classes`` (one process per class of identical ranks: every distinct program once) or
    a list of ranks (``[0, 517]``). Planning in one process without simulating lowers only
    those.
    These never change what is computed, so the section is never "enabled" as a feature.
    """

    SECTION: ClassVar[str] = "debug"
    DUMP_FORMATS: ClassVar[tuple[str, ...]] = ("text", "dot", "html")
    dump_dir: Annotated[str, Field(strict=True, min_length=1)] | None = None
    dump_format: tuple[Literal["text", "dot", "html"], ...] = ("text",)
    dump_ranks: Literal["all", "classes"] | tuple[Annotated[int, Field(strict=True, ge=0)],
                                                  ...] = "all"
    verify: StrictBool = True
    strict_rules: StrictBool = False
    simulate: StrictBool = False
    trace: StrictBool = False
    locate_divergence: StrictBool = False

    @field_validator("dump_format", mode="before")
    @classmethod
    def _known_formats(cls, value: Any) -> Any:
        """One name or a list of distinct known names: an unknown one is named with the
        formats there are (a misspelt format would silently write nothing)."""
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not names:
            raise ValueError(f"debug.dump_format {value!r}: give one or more of "
                             f"{', '.join(cls.DUMP_FORMATS)}, e.g. [text, html]")
        for name in names:
            if name not in cls.DUMP_FORMATS:
                close = difflib.get_close_matches(str(name), cls.DUMP_FORMATS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"debug.dump_format: unknown format {name!r}{hint}; formats: "
                                 f"{', '.join(cls.DUMP_FORMATS)}")
        if len(set(names)) != len(names):
            raise ValueError(f"debug.dump_format {list(names)}: a format is named twice")
        return tuple(names)

    @field_validator("dump_ranks", mode="before")
    @classmethod
    def _rank_list(cls, value: Any) -> Any:
        """``all``, ``classes`` or a non-empty list of distinct ranks (one rank: a list of
        one)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, (list, tuple)):
            if not value or len(set(value)) != len(value):
                raise ValueError(f"debug.dump_ranks {list(value)}: give distinct ranks, e.g. "
                                 "[0, 517], or all, or classes")
            return tuple(value)
        return value

    @property
    def is_enabled(self) -> bool:
        return False

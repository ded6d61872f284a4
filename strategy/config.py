"""The Strategy: every section of the strategy YAML, checked together against the mesh.

Sections validate their own fields (``sections.py``); this module adds the facts that need
the whole strategy: each ``axis`` is a dim of the mesh, parallel sections do not fight over
one axis, the world size fits the mesh, and the engine can refuse sections it does not
implement yet instead of silently ignoring them. No code here reads the environment: the
engine passes ``os.environ`` where an override applies.

The strategy is pure data: it imports nothing of autopar's. What needs the mesh as a
``ProcessMesh`` or a schedule's rules is checked where the strategy is interpreted
(``pass_infra.parallel_layout``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from .sections import (
    STRICT,
    AmpConfig,
    AutoConfig,
    CompileConfig,
    ContextParallelConfig,
    DataConfig,
    DataParallelConfig,
    DebugConfig,
    ElasticConfig,
    ExpertParallelConfig,
    GradClipConfig,
    GradientMergeConfig,
    MeshConfig,
    PipelineConfig,
    RecomputeConfig,
    Section,
    ShardingConfig,
    TensorParallelConfig,
    reject_unknown_keys,
)
from .yaml_io import dump_yaml, load_yaml

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

# Sections that place work on a mesh dim, in the order their degrees are reported.
AXIS_SECTIONS: tuple[str, ...] = ("data_parallel", "tensor_parallel", "pipeline", "sharding",
                                  "expert_parallel", "context_parallel")
# Pairs of sections that may name the same axis: ZeRO shards state across data-parallel ranks,
# and experts may be split across them (each rank's tokens meet every rank's experts).
SHAREABLE_AXES: frozenset[frozenset[str]] = frozenset({
    frozenset({"data_parallel", "sharding"}), frozenset({"data_parallel", "expert_parallel"})})
# What the ranks of another section's axis hold, which is why ZeRO may not shard over it: it
# cuts state that the ranks of its axis hold alike (data-parallel replicas).
HOLD_DIFFERENT_PARAMS: Mapping[str, str] = {
    "tensor_parallel": "different pieces of the parameters",
    "pipeline": "different stages' parameters", "expert_parallel": "different experts"}
# Never refused by check_supported: they change no program (no pass implements them).
ALWAYS_SUPPORTED: frozenset[str] = frozenset({"debug", "seed"})
# Environment variable that overrides debug.dump_dir (read by the engine, passed in).
DUMP_DIR_ENV = "AUTOPAR_DUMP_DIR"
# The strategy files shipped in the package (``configs/NAME.yaml``), loadable by NAME.
_CONFIGS_DIR = "configs"
_CONFIG_NAME = re.compile(r"[\w-]+")     # a bare name: no directory, no suffix


class UnsupportedStrategyError(ValueError):
    """An enabled strategy section that this version of autopar cannot honour yet.

    ``sections`` lists the refused section names, in strategy order.
    """

    def __init__(self, descriptions: Mapping[str, str]) -> None:
        self.descriptions = dict(descriptions)
        self.sections = tuple(self.descriptions)
        super().__init__("\n".join(
            f"{name} is not supported yet in this version of autopar ({text})"
            for name, text in self.descriptions.items()))

    def __reduce__(self) -> tuple[type, tuple[dict[str, str]]]:
        """Pickle by the constructor argument, so the error survives crossing processes."""
        return type(self), (self.descriptions,)


class Strategy(BaseModel):
    """How to parallelise training: a mesh and the sections that place work on its dims.

    Every section is optional and absent means off; ``Strategy()`` is serial on one device.
    Instances are immutable and compare by value.
    """

    model_config = STRICT

    mesh: MeshConfig | None = None
    data_parallel: DataParallelConfig | None = None
    tensor_parallel: TensorParallelConfig | None = None
    context_parallel: ContextParallelConfig | None = None
    pipeline: PipelineConfig | None = None
    sharding: ShardingConfig | None = None
    expert_parallel: ExpertParallelConfig | None = None
    amp: AmpConfig = Field(default_factory=AmpConfig)
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    gradient_merge: GradientMergeConfig = Field(default_factory=GradientMergeConfig)
    grad_clip: GradClipConfig = Field(default_factory=GradClipConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    seed: int = Field(default=0, strict=True, ge=0, lt=2**64)  # what torch.manual_seed takes
    # Where every process computes: ``cuda`` (device LOCAL_RANK: parameters, optimizer state
    # and every fed batch there, NCCL between processes), ``cpu`` (gloo), ``auto``: CUDA when
    # this machine has it. ``cuda`` on a machine without it is refused when the engine starts.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How long a rank waits in one collective or message before it fails (torch's default
    # for gloo and NCCL): a peer that hangs instead of dying stops the job after this long.
    collective_timeout_s: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    # Per-rank memory budget in GiB: planning fails, naming the biggest holders, when a
    # rank's predicted peak (``engine.cost``) exceeds it. None: no check.
    memory_limit_gb: float | None = Field(default=None, gt=0)
    # Where planned programs are kept on disk, by what they were planned from (the captured
    # step, this strategy, the optimizer, the processes, autopar's and torch's versions): a
    # restarted job, or another engine over the same model, skips the passes and lowering
    # (``planner/plan_cache.py``). None: plans are kept in memory only.
    plan_cache_dir: str | None = None
    # The planner chooses the mesh, degrees and placements (``autopar.auto``); the sections
    # above that are present are constraints it keeps.
    auto: AutoConfig | None = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Strategy:
        """Load a strategy file, or a strategy shipped with autopar by its name.

        A string that is a bare name (letters, digits, ``_`` and ``-``: no directory, no
        ``.yaml``) and not an existing file names a packaged config: ``from_yaml("dp_tp")``
        loads ``configs/dp_tp.yaml`` from the installed package (``named_configs()`` lists
        them); an unknown name raises FileNotFoundError listing them. A ValueError names the
        file and what is wrong in it.
        """
        if isinstance(path, str) and _CONFIG_NAME.fullmatch(path) and not os.path.isfile(path):
            source: Path | Traversable = _named_config(path)
            where = f"{path} ({_CONFIGS_DIR}/{path}.yaml in the autopar package)"
        else:
            source = Path(path)
            where = str(source)
        with source.open(encoding="utf-8") as stream:
            data = load_yaml(stream)
        try:
            return cls._from_data(data)
        except ValueError as err:
            raise ValueError(f"invalid strategy file {where}:\n{err}") from err

    @staticmethod
    def named_configs() -> tuple[str, ...]:
        """The names of the strategies shipped with autopar (``configs/*.yaml``), sorted:
        each loads with ``Strategy.from_yaml(name)``."""
        return tuple(sorted(_packaged_configs()))

    @classmethod
    def from_yaml_str(cls, text: str) -> Strategy:
        """Load a strategy from YAML text; an empty document is the serial strategy."""
        return cls._from_data(load_yaml(text))

    @classmethod
    def _from_data(cls, data: Any) -> Strategy:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ValueError("a strategy YAML document must be a mapping of sections, "
                             f"got {type(data).__name__}")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        """Every present section with all its values; ``from_yaml_str`` reads it back equal."""
        return dump_yaml({name: value for name, value in self.model_dump().items()
                          if value is not None})

    @model_validator(mode="before")
    @classmethod
    def _top_level_keys(cls, data: Any) -> Any:
        """Unknown keys are errors; a section written as null (``amp:``) means absent."""
        if not isinstance(data, Mapping):
            return data
        reject_unknown_keys(data, cls.model_fields, "at the top level of the strategy")
        return {key: value for key, value in data.items()
                if not (value is None and key != "seed")}

    @model_validator(mode="after")
    def _fits_mesh(self) -> Strategy:
        """All cross-section problems at once, each with the mesh they were checked against."""
        problems = (self._axis_problems() + self._shared_axis_problems()
                    + self._split_problems() + self._batch_dim_problems())
        if problems:
            raise ValueError(f"strategy does not fit its mesh ({self.describe_mesh()}):\n  - "
                             + "\n  - ".join(problems))
        return self

    def _axis_sections(self) -> dict[str, Section]:
        """Present sections that name a mesh axis, by section name."""
        return {name: getattr(self, name) for name in AXIS_SECTIONS
                if getattr(self, name) is not None}

    def _axis_problems(self) -> list[str]:
        names = self.mesh.dim_names if self.mesh is not None else ()
        return [f"{name}.axis {axis!r}{_noted(config)} is not one of the mesh dim_names"
                for name, config in self._axis_sections().items() for axis in config.mesh_axes
                if axis not in names
                # a pipeline without a mesh takes its stages from the meshes layers are
                # annotated on (semi-auto); the planner checks there are several
                and not (name == "pipeline" and self.mesh is None)
                # ZeRO stage 0 shards nothing (its offload alone may be on): no axis read
                and not (name == "sharding" and not config.is_enabled)
                # under ``auto`` without a mesh, the planner makes one with these axes
                and not (self.auto is not None and self.mesh is None)]

    def _shared_axis_problems(self) -> list[str]:
        sections = list(self._axis_sections().items())
        return [f"{a}.axis and {b}.axis are both {axis!r}; only data_parallel may share "
                f"an axis (with sharding or expert_parallel)" + _why_not_shared(ca, cb)
                for i, (a, ca) in enumerate(sections) for b, cb in sections[i + 1:]
                for axis in ca.mesh_axes
                if axis in cb.mesh_axes and not self._may_share(a, b, axis)]

    def _may_share(self, a: str, b: str, axis: str) -> bool:
        """Pairs of SHAREABLE_AXES, and ZeRO with experts split over the data-parallel ranks
        (all three on one axis): it shards the state the ranks hold alike there and leaves
        each rank's own experts as they are."""
        pair = frozenset({a, b})
        return pair in SHAREABLE_AXES or (
            pair == {"sharding", "expert_parallel"} and self.data_parallel is not None
            and axis in self.data_parallel.mesh_axes)

    def _batch_dim_problems(self) -> list[str]:
        dp, pipe = self.data_parallel, self.pipeline
        if dp is None or pipe is None or 0 in (dp.batch_dim, pipe.batch_dim) \
                or dp.batch_dim == pipe.batch_dim:
            return []      # 0 is the default: the other section's value holds
        return [f"data_parallel.batch_dim {dp.batch_dim} and pipeline.batch_dim "
                f"{pipe.batch_dim} differ: micro-batches cut each data-parallel piece along "
                "the same batch dim, so give both the same value (or set one)"]

    @property
    def batch_dim(self) -> int | dict[str, int]:
        """The batch dim of the fed tensors (``data_parallel`` or ``pipeline``; 0)."""
        for section in (self.data_parallel, self.pipeline):
            if section is not None and section.batch_dim != 0:
                return section.batch_dim
        return 0

    def _split_problems(self) -> list[str]:
        """An explicit split lists stage boundaries: one fewer than the number of stages."""
        pipe = self.pipeline
        if (pipe is None or pipe.split == "auto" or self.mesh is None
                or pipe.axis not in self.mesh.dim_names):
            return []  # no explicit split, or a bad axis that _axis_problems reports
        size = self.mesh.axis_size(pipe.axis)
        stages = pipe.num_stages(size)
        if len(pipe.split) == stages - 1:
            return []
        return [f"pipeline.split lists {len(pipe.split)} stage boundaries {list(pipe.split)}, "
                f"but axis {pipe.axis!r} of size {size} x vpp_chunks {pipe.vpp_chunks} = "
                f"{stages} stages needs {stages - 1}"]

    # ---- facts --------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes the strategy runs on: the mesh size; without a mesh, ``auto.devices``
        (the planner chooses the mesh for them), else 1."""
        if self.mesh is None and self.auto is not None:
            return self.auto.devices
        return self.mesh.size if self.mesh is not None else 1

    def degree(self, section: str) -> int:
        """Ranks a parallel section spans: its axis size when on, 1 when off or absent."""
        if section not in AXIS_SECTIONS:
            raise KeyError(f"{section!r} is not a parallel section; those are {AXIS_SECTIONS}")
        config = getattr(self, section)
        if config is None or not config.is_enabled or self.mesh is None:
            return 1
        return math.prod(self.mesh.axis_size(axis) for axis in config.mesh_axes)

    def parallel_degrees(self) -> dict[str, int]:
        """Degree of every parallel section, in a fixed order (1 for those that are off)."""
        return {name: self.degree(name) for name in AXIS_SECTIONS}

    def enabled_sections(self) -> tuple[str, ...]:
        """Sections that change the training program, in strategy order."""
        return tuple(name for name in type(self).model_fields
                     if isinstance(value := getattr(self, name), Section) and value.is_enabled)

    def describe_mesh(self) -> str:
        """The mesh in one phrase, for error messages."""
        if self.mesh is None:
            return "no mesh: serial, one device"
        return (f"mesh shape {list(self.mesh.shape)}, dim_names {list(self.mesh.dim_names)}, "
                f"{self.mesh.size} devices")

    def describe_degrees(self) -> str:
        """Each parallel degree with its axis, and the mesh dims no section uses."""
        parts = []
        for name in AXIS_SECTIONS:
            config = getattr(self, name)
            state = ("absent" if config is None else
                     f"axis {config.axis!r}" if config.is_enabled else "off")
            parts.append(f"{name}={self.degree(name)} ({state})")
        used = {axis for config in self._axis_sections().values() if config.is_enabled
                for axis in config.mesh_axes}
        unused = [n for n in (self.mesh.dim_names if self.mesh else ()) if n not in used]
        if unused:
            parts.append(f"dims used by no section (replicated): {unused}")
        return ", ".join(parts)

    # ---- checks the engine runs -----------------------------------------------------------

    def check_world_size(self, world_size: int) -> None:
        """Fail before any work when the launcher started a different number of processes."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be a positive int, got {world_size!r}")
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} does not match the strategy, which needs "
                f"{self.world_size} processes: {self.describe_mesh()}; degrees: "
                f"{self.describe_degrees()}")

    def check_supported(self, supported: Collection[str]) -> None:
        """Refuse every enabled section not in ``supported``, so none is silently ignored.

        debug and seed are always supported. Raises UnsupportedStrategyError
        listing all refused sections with their values.
        """
        if isinstance(supported, str):
            raise TypeError("check_supported takes a collection of section names, not a str")
        unknown = sorted(set(supported) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"check_supported got unknown section names {unknown}; "
                             f"sections are {list(type(self).model_fields)}")
        refused = {name: getattr(self, name).describe() for name in self.enabled_sections()
                   if name not in supported and name not in ALWAYS_SUPPORTED}
        if refused:
            raise UnsupportedStrategyError(refused)

    def resolved_dump_dir(self, environ: Mapping[str, str]) -> str | None:
        """Where IR dumps go: ``AUTOPAR_DUMP_DIR`` when set and non-empty, else debug.dump_dir.

        The engine passes ``os.environ``; taking it as an argument keeps this pure and testable.
        """
        return environ.get(DUMP_DIR_ENV) or self.debug.dump_dir


def _packaged_configs() -> dict[str, Traversable]:
    """``configs/*.yaml`` of the installed package by name, read through importlib.resources
    (a wheel, an editable install or a zip import alike)."""
    package = __name__.partition(".")[0]      # autopar, by name: the strategy imports none of it
    configs = resources.files(package).joinpath(_CONFIGS_DIR)
    if not configs.is_dir():
        return {}
    return {entry.name[:-len(".yaml")]: entry for entry in configs.iterdir()
            if entry.name.endswith(".yaml") and entry.is_file()}


def _named_config(name: str) -> Traversable:
    """The packaged strategy file called ``name``; FileNotFoundError lists the names."""
    configs = _packaged_configs()
    if name not in configs:
        raise FileNotFoundError(
            f"no strategy file {name!r} and no packaged strategy of that name; packaged "
            f"strategies: {', '.join(sorted(configs)) or '(none found)'} (or give a path to "
            "a YAML file)")
    return configs[name]


def _noted(section: Section) -> str:
    note = section.note()
    return f" ({note})" if note else ""


def _why_not_shared(a: Section, b: Section) -> str:
    """Why ZeRO may not shard over another section's axis, when one of the two is sharding."""
    zero, other = (a, b) if a.SECTION == "sharding" else (b, a)
    if zero.SECTION != "sharding" or other.SECTION not in HOLD_DIFFERENT_PARAMS:
        return ""
    return (f"; {zero.note()} shards state that the ranks of its axis hold alike "
            f"(data-parallel replicas), but the ranks of {other.SECTION} axis {other.axis!r} "
            f"hold {HOLD_DIFFERENT_PARAMS[other.SECTION]}: shard over the data-parallel axis"
            + (" (experts split over it too are left as they are)"
               if other.SECTION == "expert_parallel" else ""))

"""Where a process's state lives, and which executor runs a lowered plan there. An engine
holds one runtime for its lifetime:

* ``LocalRuntime`` — everything in this process: a serial plan (the model's own tensors,
  trained in place), every rank of a plan simulated (``debug.simulate``: full tensors, each
  step cut into pieces and assembled back), or a pipeline of one process;
* ``DistributedRuntime`` — this process as one of several real ones under torchrun: it joins
  the process group, makes each mesh's groups once, and holds this process's pieces of the
  state (``RankState``); every plan of the engine keeps its state where the first put it.

``executor(lowered, initial)`` picks the implementation from the plan (``ProgramExecutor``,
``SimulatedExecutor``, ``PipelineExecutor``, ``PipelineSimulator``; a gradient-merge pair
runs as a ``CycleExecutor`` of two); ``initial(piece)`` is the whole starting value of a
state (a parameter, or fresh optimizer state; None for one the first update creates); real
processes take their pieces from ``pieces(wanted)`` when given (a model built on the meta
device has no whole value to cut).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..ir.kernels.generator_state import use_device
from ..lower.executable import Lowered, PipelineProcess, RankProgram, StatePiece
from .compiled import not_compiled
from .cycle import CycleExecutor
from .executor import Executor, ProgramExecutor
from .pipeline_process import PipelineExecutor, logical_groups
from .pipeline_simulator import PipelineSimulator
from .process_groups import check_launch, init_distributed, mesh_groups, p2p_group, shutdown
from .rank_state import Pieces, PipelineAxis, RankState, at_home
from .simulator import SimulatedExecutor

__all__ = ["Initial", "LocalRuntime", "DistributedRuntime"]

Initial = Callable[[StatePiece], "torch.Tensor | None"]


def _executor(make: Callable[..., Executor], lowered: Lowered, initial: Initial,
              pieces: Pieces | None) -> Executor:
    """The plan's executor: of its program, or of a gradient-merge pair (``CycleExecutor``)."""
    if lowered.accumulating is None:
        return make(lowered, initial, pieces)
    return CycleExecutor(lowered, make(lowered.accumulating, initial, pieces),
                         make(lowered, initial, pieces))


def _not_compiled(lowered: Lowered, what: str) -> None:
    """Plans that run uncompiled under ``compile:`` (said, or refused)."""
    if lowered.compile is not None:
        not_compiled(lowered.compile, what, "compiled programs run on real processes (one "
                     "per rank, under torchrun); simulated ranks run uncompiled")


def _processes(lowered: Lowered) -> int:
    if lowered.pipeline is not None:
        return lowered.pipeline.world_size
    return lowered.mesh.size if lowered.mesh is not None else 1


class LocalRuntime:
    """Full tensors in this process, by state name (``state``: shared with the engine)."""

    def __init__(self, state: dict[str, Any], simulate: bool, launched: int = 1,
                 device: torch.device | None = None):
        self.state, self.simulate, self.launched = state, simulate, launched
        self.device = device or torch.device("cpu")
        self.draw_on_device()

    def executor(self, lowered: Lowered, initial: Initial,
                 pieces: Pieces | None = None) -> Executor:
        return _executor(self._executor, lowered, initial, pieces)

    def _executor(self, lowered: Lowered, initial: Initial,
                  pieces: Pieces | None = None) -> Executor:
        processes = _processes(lowered)
        if processes > 1 and not self.simulate:
            check_launch(processes, self.launched)     # raises: a launch that cannot run it
        for name, piece in next(iter(lowered.processes.values())).state.items():
            if piece.const is None:    # the model's own tensors stay themselves when home
                value = self.state[name] if name in self.state else initial(piece)
                self.state[name] = at_home(value, piece, self.device)
        if processes > 1:
            _not_compiled(lowered, "a simulated plan (every rank in this process)")
        if lowered.pipeline is not None:
            if processes == 1 and not self.simulate:
                return PipelineExecutor(lowered.process(0), self.state,
                                        lowered.mesh, groups=None, compile=lowered.compile)
            return PipelineSimulator(lowered, self.state)
        if processes > 1:
            return SimulatedExecutor(lowered, self.state)
        return ProgramExecutor(lowered.process(0), self.state, compile=lowered.compile,
                               random_ops=lowered.random_ops)

    def draw_on_device(self) -> None:
        """Random ops and generator states of this process's programs on this runtime's
        device's generator."""
        use_device(self.device)

    def names(self) -> list[str]:
        return sorted(self.state)

    def close(self, together: bool = True) -> None:
        """Nothing to release: no process groups."""

    def full(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)


class DistributedRuntime:
    """This process of a launch of ``world`` processes (torchrun's RANK and WORLD_SIZE)."""

    def __init__(self, rank: int, world: int, device: torch.device,
                 timeout: timedelta | None = None):
        self.rank, self.world, self.device = rank, world, device
        self.draw_on_device()
        self.timeout = timeout            # of every collective and message
        self.state: RankState | None = None
        self._mesh = None                 # the mesh (or full pipeline mesh) state lives on

    def draw_on_device(self) -> None:
        use_device(self.device)

    def agree(self, make: Callable[[], str]) -> str:
        """Rank 0's ``make()``, on every rank: the others wait for it (joining the launch's
        process group first). A failure on rank 0 is raised on every rank, so none waits
        for an answer that never comes."""
        init_distributed(self.device, self.world, self.world, self.timeout)
        box: list[object] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", make())
            except Exception as err:
                box[0] = ("error", f"{type(err).__name__}: {err}")
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        status, text = box[0]
        if status != "ok":
            raise RuntimeError(f"rank 0 failed, so rank {self.rank} stops too: {text}")
        return text

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a small picklable object), by rank, on every rank."""
        init_distributed(self.device, self.world, self.world, self.timeout)
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def executor(self, lowered: Lowered, initial: Initial,
                 pieces: Pieces | None = None) -> Executor:
        return _executor(self._executor, lowered, initial, pieces)

    def _executor(self, lowered: Lowered, initial: Initial,
                  pieces: Pieces | None = None) -> Executor:
        processes = _processes(lowered)
        if processes == 1 and lowered.pipeline is None:
            raise ValueError(
                f"a plan with no mesh (serial) cannot run on a launch of world size "
                f"{self.world}: give the strategy a mesh of {self.world} ranks, or launch one "
                "process")
        init_distributed(self.device, processes, self.world, self.timeout)
        made = lowered.process(self.rank)
        if isinstance(made, PipelineProcess):
            return self._pipeline(lowered, made, initial, pieces)
        return self._rank(lowered, made, initial, pieces)

    def _rank(self, lowered: Lowered, made: RankProgram, initial: Initial,
              pieces: Pieces | None) -> Executor:
        groups = mesh_groups(lowered.mesh)
        state = self._state(lowered.mesh, lambda: RankState(groups, device=self.device))
        state.adopt(made.state, made.state, initial, pieces)
        return ProgramExecutor(made, state.tensors, groups, compile=lowered.compile,
                               random_ops=lowered.random_ops)

    def _pipeline(self, lowered: Lowered, made: PipelineProcess, initial: Initial,
                  pieces: Pieces | None) -> Executor:
        full_mesh = lowered.pipeline.full_mesh
        groups = mesh_groups(full_mesh)
        group = p2p_group(full_mesh)
        axis = PipelineAxis(made.pp, made.peers, groups.axes[0].group)
        state = self._state(full_mesh, lambda: RankState(
            logical_groups(groups, lowered.mesh, made.coordinate, 0), axis, self.device))
        state.adopt(made.state, made.held, initial, pieces)
        return PipelineExecutor(made, state.tensors, lowered.mesh, groups, group, self.device,
                                compile=lowered.compile)

    def _state(self, mesh, make: Callable[[], RankState]) -> RankState:
        """This process's state (made with the first plan; every later plan of the engine
        runs on the same processes and keeps its state there)."""
        if self.state is None:
            self.state, self._mesh = make(), mesh
        elif mesh != self._mesh:
            raise ValueError(f"this engine runs on {self._mesh}; a program planned on {mesh} "
                             "cannot share its state")
        return self.state

    def names(self) -> list[str]:
        return self.state.names() if self.state is not None else []

    def full(self, name: str) -> torch.Tensor | None:
        """A state gathered whole (a collective: every process calls it, same order)."""
        return self.state.full(name)

    def close(self, together: bool = True) -> None:
        """Release the process groups (every step has finished its collectives and
        messages); the state pieces stay readable on this process. ``together``: every
        process is closing (the normal end of a script), so they first meet at a barrier
        and none tears its connections down while a peer is still finishing its last
        step (a gloo peer that sees its connections close mid-exit can abort); a process
        leaving on an error closes alone."""
        shutdown(barrier=together)
        self._mesh = None

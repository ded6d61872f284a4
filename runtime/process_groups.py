"""c10d process groups for a ProcessMesh: one group per line of ranks along each mesh dim.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must call
it for every group, in the same order, or the run hangs. So every rank walks the same list
(mesh dims in order, ``ProcessMesh.groups(dim)`` order within a dim) and keeps the groups it
belongs to. Groups are made once per mesh and shared by every program on that mesh.

c10d orders a group's members by global rank; the mesh orders them by their index along
the dim. ``MeshAxisGroup.order`` maps one onto the other, so collectives that concatenate or
scatter (all-gather, reduce-scatter, all-to-all) keep the mesh's order whatever ids the mesh
holds.
"""
from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..ir.dist import ProcessMesh

__all__ = ["MeshAxisGroup", "MeshGroups", "check_launch", "init_distributed", "backend_for",
           "p2p_group", "shutdown", "resolve_device"]


@dataclass(frozen=True)
class MeshAxisGroup:
    """This rank's group along one mesh dim."""

    group: Any                 # a c10d ProcessGroup
    ranks: tuple[int, ...]     # global ranks, by index along the mesh dim
    index: int                 # this rank's index along the mesh dim
    order: tuple[int, ...]     # order[g] = mesh index of the member with group rank g

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class MeshGroups:
    mesh: ProcessMesh
    rank: int
    coordinate: tuple[int, ...]
    axes: tuple[MeshAxisGroup, ...]   # one per mesh dim

    def __getitem__(self, mesh_dim: int) -> MeshAxisGroup:
        return self.axes[mesh_dim]


_CACHE: dict[ProcessMesh, MeshGroups] = {}


def mesh_groups(mesh: ProcessMesh) -> MeshGroups:
    """This rank's groups on ``mesh`` (created on first use, on every rank alike)."""
    if mesh not in _CACHE:
        _CACHE[mesh] = _create(mesh)
    return _CACHE[mesh]


def _create(mesh: ProcessMesh) -> MeshGroups:
    rank, world = dist.get_rank(), dist.get_world_size()
    if max(mesh.process_ids) >= world:
        raise ValueError(f"{mesh} names process {max(mesh.process_ids)}, but only {world} "
                         f"processes were launched (ranks 0..{world - 1})")
    coordinate = mesh.coordinate(rank)
    if coordinate is None:
        raise ValueError(f"rank {rank} is not in {mesh}: every launched process must be on "
                         "the mesh (a mesh per pipeline stage comes with pipelines)")
    axes = []
    for d in range(mesh.ndim):
        mine = None
        for ranks in mesh.groups(d):
            group = _new_group(ranks, world)
            if rank in ranks:
                mine = (group, tuple(ranks))
        group, ranks = mine
        members = sorted(ranks)
        axes.append(MeshAxisGroup(group, ranks, coordinate[d],
                                  tuple(ranks.index(r) for r in members)))
    return MeshGroups(mesh, rank, coordinate, tuple(axes))


_P2P: dict[ProcessMesh, Any] = {}


def p2p_group(mesh: ProcessMesh) -> Any:
    """A group of every process of ``mesh`` for a pipeline's point-to-point messages, apart
    from the groups collectives use (made once, by every rank alike)."""
    if mesh not in _P2P:
        mesh_groups(mesh)
        _P2P[mesh] = dist.new_group(sorted(mesh.process_ids),   # destroyed by shutdown()
                                    timeout=_TIMEOUT[0])
    return _P2P[mesh]


def _new_group(ranks: list[int], world: int) -> Any:
    if len(ranks) == world and sorted(ranks) == list(range(world)):
        return dist.group.WORLD
    group = dist.new_group(ranks, timeout=_TIMEOUT[0])
    _MADE.append(group)
    return group


# the groups made here, and whether the default group is ours (init_distributed made it)
_MADE: list[Any] = []
_OWN_DEFAULT: list[bool] = [False]
# the collective timeout init_distributed was given: new groups do not inherit the default
# group's, so each is made with it
_TIMEOUT: list[timedelta | None] = [None]


def shutdown(barrier: bool = False) -> None:
    """Destroy the process groups autopar made, the default one too when autopar created it
    (not one the user's own code did): no c10d work is left for the interpreter's exit.
    With ``barrier`` every process of the default group first waits for all the others (a
    collective: only when every process is closing); without it, local and safe to call
    twice. The destroyed groups are collected at once, while the interpreter is whole."""
    if dist.is_initialized():
        if barrier and (_MADE or _P2P or _OWN_DEFAULT[0]):
            dist.barrier()
        for group in [*_MADE, *_P2P.values()]:
            if group is not None and group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        if _OWN_DEFAULT[0]:
            dist.destroy_process_group()
    _MADE.clear()
    _P2P.clear()
    _CACHE.clear()
    _OWN_DEFAULT[0] = False
    gc.collect()


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_launch(expected_world_size: int, world: int) -> None:
    """A plan on ``expected_world_size`` processes refuses a launch of ``world`` before any
    collective could hang."""
    if world != expected_world_size:
        raise ValueError(
            f"the strategy's mesh has {expected_world_size} ranks but WORLD_SIZE is {world}: "
            f"launch {expected_world_size} processes in all (`torchrun --nproc-per-node "
            f"{expected_world_size} script.py`, or machines x --nproc-per-node = "
            f"{expected_world_size} over several machines; or set "
            "debug.simulate: true to run every rank in this process; for an elastic job "
            "whose world size changes, elastic: {on_resize: data_parallel | auto})")


def init_distributed(device: torch.device, expected_world_size: int, world: int,
                     timeout: timedelta | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (env:// rendezvous, so multi-node works
    through torchrun's own flags); returns (rank, world size). ``world`` is the launch's
    WORLD_SIZE; it must match the plan before any collective could hang. ``timeout``
    bounds every collective and message of the groups made here (None: torch's default)."""
    check_launch(expected_world_size, world)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("WORLD_SIZE is set but MASTER_ADDR is not: launch with torchrun")
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend_for(device), timeout=timeout,
                                **_attempt_store(os.environ, timeout))
        _TIMEOUT[0] = timeout
        _OWN_DEFAULT[0] = True
        atexit.register(shutdown)      # a script that never calls Engine.close()
    if dist.get_world_size() != expected_world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, the strategy's "
                         f"mesh {expected_world_size}")
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(environ, timeout: timedelta | None) -> dict:
    """After an elastic restart (TORCHELASTIC_RESTART_COUNT > 0): the env:// store under a
    prefix of its own (``init_process_group``'s ``store``, ``rank``, ``world_size``). With c10d
    rendezvous torchrun hands the workers of every attempt its one rendezvous store, with no
    prefix per attempt, so the new default group could read the dead attempt's addresses (a
    peer's gloo address from before the restart: connection refused). Else nothing: torch's
    own env:// rendezvous."""
    restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts == 0:
        return {}
    store, rank, world = next(dist.rendezvous(
        "env://", timeout=timeout or dist.default_pg_timeout))
    return {"store": dist.PrefixStore(f"autopar/attempt_{restarts}", store),
            "rank": rank, "world_size": world}


def resolve_device(choice: str, local_rank: int) -> torch.device:
    """The device a process computes on for the strategy's ``device`` (``auto``: CUDA when
    this machine has it): ``cuda:LOCAL_RANK`` or the CPU. ``cuda`` without CUDA is refused
    here, before any process group or plan exists."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"strategy device: cuda, but this machine has no usable CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}; "
            "torch.cuda.is_available() is False): use device: cpu, or auto to take CUDA "
            "where it exists")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"strategy device: cuda: LOCAL_RANK {local_rank} has no device here "
                         f"({count} CUDA device(s)); launch at most {count} processes per "
                         "node (torchrun --nproc-per-node)")
    return torch.device("cuda", local_rank)

"""In-process simulator: one step of a lowered plan on every rank of its mesh.

It checks a plan end to end without processes or a network: each rank's local program runs
on its own pieces, cut from the full feeds and state by lowering's slices and placements,
and every comm op runs with the reference collective semantics
(``reshard.simulate.apply_step``) over all ranks' pieces at once. The ranks' programs have
the same ops in the same order, so they are interpreted in lockstep, op by op. Results and
updated state are assembled back into full tensors, so a step can be compared with (and
chained like) a single-device step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..ir.attrs import MULTI, NAME
from ..ir.core import Op, OpKind, Slot, Value
from ..ir.dist import assemble, shard_tensor_local
from ..ir.ops import draws_random, resolve
from ..lower.executable import (
    BucketStart,
    BucketWait,
    Comm,
    GatherStart,
    GatherWait,
    Lowered,
    RankProgram,
    ScatterStart,
    ScatterWait,
)
from ..reshard.simulate import apply_step
from .seeding import draw_generator, forked_generator

__all__ = ["simulate_step", "SimulatedExecutor", "call_op", "communicate", "initial_value"]

Coordinate = tuple[int, ...]


def call_op(op, env: dict[Value, Any]) -> list[Any]:
    swap = lambda a: env[a] if isinstance(a, Value) else a  # noqa: E731
    args, kwargs = pytree.tree_map(swap, (op.args, op.kwargs),
                                   is_leaf=lambda a: isinstance(a, Value))
    out = resolve(op.target)(*args, **kwargs)
    if not op.outputs:           # an effect only (setting the generator back)
        return []
    if len(op.outputs) == 1 and not op.attrs.get(MULTI):
        return [out]
    out = list(out)
    if len(out) != len(op.outputs):
        raise ValueError(f"simulate_step: {op.target} returned {len(out)} values, the program "
                         f"expects {len(op.outputs)}")
    return out


def communicate(ops: dict[Coordinate, Any], comm: Comm, envs: dict, mesh) -> None:
    """One comm op on every rank: a reshard step, a bucket's or a gather unit's start (its
    steps, one per input, run at once: the handle holds the results) or its wait."""
    started = isinstance(comm, (BucketStart, GatherStart, ScatterStart))
    if isinstance(comm, (BucketWait, GatherWait, ScatterWait)):
        for c, op in ops.items():
            for v, x in zip(op.outputs, envs[c][op.args[0]][:len(op.outputs)]):
                envs[c][v] = x
        return
    steps = comm.steps if started else (comm.step,)
    results: dict[Coordinate, list] = {c: [] for c in ops}
    for k, step in enumerate(steps):
        moved = apply_step({c: envs[c][op.args[k]] for c, op in ops.items()}, mesh, step)
        for c in ops:
            results[c].append(moved[c])
    for c, op in ops.items():
        if isinstance(comm, (GatherStart, ScatterStart)):
            # the runtime's handle holds the unit's flat input until the wait (the
            # collective reads it) besides its output buffer: the meter counts both. A
            # reduce-scatter's output on gloo is every member's block for this one (the
            # all-to-all of ``collectives._FlatReduceScatter``), the input's size
            flat = torch.cat([envs[c][v].reshape(-1) for v in op.args])
            received = (torch.empty_like(flat),) if isinstance(comm, ScatterStart) else ()
            envs[c][op.outputs[0]] = (*results[c], flat, *received)
        elif isinstance(comm, BucketStart) and comm.gathered:
            # on gloo, an all-gather of both terms (``collectives._GatheredReduce``): the
            # handle holds both
            both = torch.cat([envs[c][v].reshape(-1) for v in op.args] * 2)
            envs[c][op.outputs[0]] = (*results[c], both)
        else:
            envs[c][op.outputs[0]] = tuple(results[c]) if started else results[c][0]


def _piece(full: Any, value: Value, coordinate: Coordinate) -> Any:
    """The rank's piece of a full input/state; non-tensors (param_groups) as they are."""
    if not isinstance(full, torch.Tensor) or not value.is_tensor or value.dist is None:
        return full
    return shard_tensor_local(full, value.dist.mesh, value.dist.placements, coordinate)


def initial_value(op, feeds: dict[str, Any], state: dict[str, Any], rank: RankProgram) -> Any:
    name = op.attrs[NAME]
    if op.kind is OpKind.INPUT:
        if name not in feeds:
            raise KeyError(f"simulate_step: no feed {name!r}")
        return feeds[name]
    if name in state:
        return state[name]
    piece = rank.state.get(name)
    if piece is not None and piece.const is not None:
        return piece.const
    raise KeyError(f"simulate_step: no initial value for program state {name!r}")


# after each op: (its index, the global op, every rank's local op, every rank's values,
# the generator state it drew from or None); the divergence locator compares there
Observer = Callable[[int, Op, dict, dict, Any], None]


def simulate_step(lowered: Lowered, feeds: dict[str, Any], state: dict[str, torch.Tensor],
                  observe: Observer | None = None
                  ) -> tuple[dict[Slot, Any], dict[str, torch.Tensor]]:
    """Run one step of a lowered plan (every process lowered) on all ranks of its mesh.

    ``feeds`` are the full ``batch/<i>`` tensors and ``param_groups/<i>`` dicts, ``state``
    the full state tensors by name (never mutated). Returns the full results by slot
    (update slots included) and the full new state: ``state`` with every updated entry
    replaced by its assembled new value. ``observe`` is called after every op.
    """
    mesh = lowered.mesh if lowered.mesh is not None and lowered.mesh.size > 1 else None
    ranks = {r.coordinate: r for r in lowered.processes.values()}
    coords: list[Coordinate] = list(mesh.coordinates()) if mesh is not None else [()]
    missing = [c for c in coords if c not in ranks]
    if missing:
        raise ValueError(f"simulate_step: ranks at {missing[:4]} were not lowered")
    programs = {c: ranks[c].program for c in coords}
    envs: dict[Coordinate, dict[Value, Any]] = {c: {} for c in coords}
    global_ops = lowered.program.ops
    first_rank = ranks[coords[0]]
    with torch.no_grad():
        for i, global_op in enumerate(global_ops):
            ops = {c: programs[c].ops[i] for c in coords}
            if global_op.kind is OpKind.OUTPUT:
                break
            rng = None
            if global_op.kind in (OpKind.INPUT, OpKind.STATE):
                full = initial_value(global_op, feeds, state, first_rank)
                if mesh is None and isinstance(full, torch.Tensor) \
                        and global_op.kind is OpKind.STATE:
                    full = full.clone()   # kernels update state in place: keep the caller's
                for c, op in ops.items():
                    envs[c][op.outputs[0]] = _piece(full, op.outputs[0], c) if mesh else full
            elif global_op.kind is OpKind.COMM:
                communicate(ops, first_rank.comms[i], envs, mesh)
            else:
                # a random op's local form draws the global tensor and keeps its slice: every
                # rank draws from the same generator state, which then advances once. Ask
                # the global op: the local form's target (autopar.sliced_random) is not the
                # global op, and ranks that drew in turn would draw unrelated numbers
                rng = draw_generator().get_state() if draws_random(global_op) else None
                for c, op in ops.items():
                    if rng is not None:
                        draw_generator().set_state(rng)
                    for v, x in zip(op.outputs, call_op(op, envs[c])):
                        envs[c][v] = x
            if observe is not None:
                observe(i, global_op, ops, envs, rng)
    results: dict[Slot, Any] = {}
    for k, layout in enumerate(lowered.results):
        per_rank = {c: envs[c][programs[c].output_op.args[k]] for c in coords}
        if mesh is None:
            results[layout.slot] = per_rank[()]
        elif isinstance(per_rank[coords[0]], torch.Tensor) and layout.shape is not None:
            results[layout.slot] = assemble(per_rank, layout.shape, mesh,
                                            layout.dist.placements)
        else:
            results[layout.slot] = per_rank[coords[0]]
    new_state = dict(state)
    new_state.update({s.name: v for s, v in results.items() if s.kind == "update"})
    return results, new_state


class SimulatedExecutor:
    """The Executor interface over ``simulate_step``: every rank of a lowered plan in this
    one process (``debug.simulate``). Slow, exact: for tests and for debugging plans without
    launching processes.

    ``state`` holds full tensors; updates are copied into them in place, so a model whose
    parameters the state aliases trains in place as in serial runs.
    """

    def __init__(self, lowered: Lowered, state: dict[str, Any]):
        self.lowered, self.state = lowered, state

    def run(self, feeds: dict[str, Any], seed: int | None = None, batch: int = 0
            ) -> dict[Slot, Any]:
        with forked_generator(seed):
            results, _ = simulate_step(self.lowered, feeds, self.state)
        for slot, value in results.items():
            if slot.kind != "update":
                continue
            old = self.state.get(slot.name)
            if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                    and old.shape == value.shape:
                old.copy_(value)
            else:
                self.state[slot.name] = value
        return {slot: v for slot, v in results.items() if slot.kind != "update"}

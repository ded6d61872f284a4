"""In-process simulator: one step of a planned global program on every rank of its mesh.

It checks a plan end to end without processes or a network: each rank's local program
(``passes.partition``) runs on its own pieces, cut from the full feeds and state by the
INPUT/STATE values' dists, and every communication op runs as the reference collective
semantics (``reshard.simulate.apply_step``) over all ranks' pieces at once. The ranks'
programs have the same ops in the same order, so they are interpreted in lockstep, op by
op. Results and updated state are assembled back into full tensors, so a step can be
compared with (and chained like) a single-device step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..ir.core import OpKind, Program, Slot, StateKind, Value
from ..ir.dist import assemble, shard_tensor_local
from ..passes.partition import partition, program_mesh
from ..reshard.simulate import apply_step
from ..ir.ops import draws_random, resolve
from ..ir.attrs import CONST, MULTI, NAME, STATE
from ..reshard.comm import BUCKET_STEPS, RESHARD_STEP

__all__ = ["simulate_step", "SimulatedExecutor"]

Coordinate = tuple[int, ...]


def _initial(op, value: Value, feeds: dict[str, Any], state: dict[str, Any]) -> Any:
    name = op.attrs[NAME]
    if op.kind is OpKind.INPUT:
        if name not in feeds:
            raise KeyError(f"simulate_step: no feed {name!r}")
        return feeds[name]
    if name in state:
        return state[name]
    if op.attrs[STATE] is StateKind.CONST:
        return op.attrs[CONST]
    raise KeyError(f"simulate_step: no initial value for program state {name!r}")


def _piece(full: Any, value: Value, coordinate: Coordinate) -> Any:
    """The rank's piece of a full input/state; non-tensors (param_groups) as they are."""
    if not isinstance(full, torch.Tensor) or not value.is_tensor or value.dist is None:
        return full
    return shard_tensor_local(full, value.dist.mesh, value.dist.placements, coordinate)


def call_op(op, env: dict[Value, Any]) -> list[Any]:
    swap = lambda a: env[a] if isinstance(a, Value) else a  # noqa: E731
    args, kwargs = pytree.tree_map(swap, (op.args, op.kwargs),
                                   is_leaf=lambda a: isinstance(a, Value))
    out = resolve(op.target)(*args, **kwargs)
    if len(op.outputs) == 1 and not op.attrs.get(MULTI):
        return [out]
    out = list(out)
    if len(out) != len(op.outputs):
        raise ValueError(f"simulate_step: {op.target} returned {len(out)} values, the program "
                         f"expects {len(op.outputs)}")
    return out


def communicate(ops: dict[Coordinate, Any], envs: dict, mesh) -> None:
    """One comm op on every rank: a reshard step, a bucket's start (its steps, one per
    input, run at once: the handle holds the results) or a bucket's wait."""
    first = next(iter(ops.values()))
    if first.target == "comm.wait":
        for c, op in ops.items():
            for v, x in zip(op.outputs, envs[c][op.args[0]]):
                envs[c][v] = x
        return
    steps = first.attrs.get(BUCKET_STEPS) or (first.attrs[RESHARD_STEP],)
    results: dict[Coordinate, list] = {c: [] for c in ops}
    for k, step in enumerate(steps):
        moved = apply_step({c: envs[c][op.args[k]] for c, op in ops.items()}, mesh, step)
        for c in ops:
            results[c].append(moved[c])
    for c, op in ops.items():
        if first.target == "comm.all_reduce_start":
            envs[c][op.outputs[0]] = tuple(results[c])
        else:
            envs[c][op.outputs[0]] = results[c][0]


def rank_programs(program: Program) -> dict[Coordinate, Program]:
    """Every rank's local program, by mesh coordinate (the program itself when serial)."""
    mesh = program_mesh(program)
    if mesh is None:
        return {(): program}
    return {c: partition(program, c) for c in mesh.coordinates()}


def simulate_step(program: Program, feeds: dict[str, Any], state: dict[str, torch.Tensor],
                  locals_: dict[Coordinate, Program] | None = None
                  ) -> tuple[dict[Slot, Any], dict[str, torch.Tensor]]:
    """Run one step of ``program`` (planned, global) on all ranks of its mesh.

    ``feeds`` are the full ``batch/<i>`` tensors and ``param_groups/<i>`` dicts, ``state``
    the full state tensors by name (never mutated). Returns the full results by slot
    (update slots included) and the full new state: ``state`` with every updated entry
    replaced by its assembled new value. ``locals_``: the ranks' programs from
    ``rank_programs`` (partitioned here when not given; a caller running many steps passes
    them once).
    """
    mesh = program_mesh(program)
    coords: list[Coordinate] = list(mesh.coordinates()) if mesh is not None else [()]
    locals_ = locals_ if locals_ is not None else rank_programs(program)
    envs: dict[Coordinate, dict[Value, Any]] = {c: {} for c in coords}
    n_ops = len(program.ops)
    if any(len(p.ops) != n_ops for p in locals_.values()):
        raise ValueError("simulate_step: rank programs differ in length")

    with torch.no_grad():
        for i in range(n_ops):
            ops = {c: locals_[c].ops[i] for c in coords}
            first = ops[coords[0]]
            if first.kind is OpKind.OUTPUT:
                break
            if first.kind in (OpKind.INPUT, OpKind.STATE):
                full = _initial(first, first.outputs[0], feeds, state)
                if mesh is None and isinstance(full, torch.Tensor) and first.kind is OpKind.STATE:
                    full = full.clone()   # kernels update state in place: keep the caller's
                for c, op in ops.items():
                    envs[c][op.outputs[0]] = _piece(full, op.outputs[0], c) if mesh else full
            elif first.kind is OpKind.COMM:
                communicate(ops, envs, mesh)
            elif first.kind is OpKind.CALL:
                # a random op's local form draws the global tensor and keeps its slice: every
                # rank draws from the same generator state, which then advances once. Ask
                # the global op: the local form's target (autopar.sliced_random) is no ATen
                # random op, and ranks that drew in turn would draw unrelated numbers
                rng = torch.default_generator.get_state() \
                    if draws_random(program.ops[i]) else None
                for c, op in ops.items():
                    if rng is not None:
                        torch.default_generator.set_state(rng)
                    for v, x in zip(op.outputs, call_op(op, envs[c])):
                        envs[c][v] = x
            else:
                raise ValueError(f"simulate_step: unknown op kind {first.kind}")

    results: dict[Slot, Any] = {}
    for k, (slot, value) in enumerate(program.results()):
        per_rank = {c: envs[c][locals_[c].output_op.args[k]] for c in coords}
        if mesh is None:
            results[slot] = per_rank[()]
        elif isinstance(per_rank[coords[0]], torch.Tensor) and value.is_tensor:
            results[slot] = assemble(per_rank, value.type.shape, mesh, value.dist.placements)
        else:
            results[slot] = per_rank[coords[0]]
    new_state = dict(state)
    new_state.update({s.name: v for s, v in results.items() if s.kind == "update"})
    return results, new_state


class SimulatedExecutor:
    """The Executor interface over ``simulate_step``: the engine runs a distributed plan on
    every rank of its mesh in this one process (``debug.simulate``). Slow, exact: for tests
    and for debugging plans without launching processes.

    The engine's ``state`` holds full tensors; updates are copied into them in place, so a
    model whose parameters the state aliases trains in place as in serial runs.
    """

    def __init__(self, program: Program, state: dict[str, Any]):
        self.program, self.state = program, state
        self.locals = rank_programs(program)    # partitioned once, at planning time

    def run(self, feeds: dict[str, Any], seed: int | None = None) -> dict[Slot, Any]:
        generator = torch.default_generator
        saved = generator.get_state()
        if seed is not None:
            generator.manual_seed(seed)
        try:
            results, _ = simulate_step(self.program, feeds, self.state, self.locals)
        finally:
            generator.set_state(saved)
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

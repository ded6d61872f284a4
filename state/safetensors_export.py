"""``Engine.save(path, format="full")``: the model's ``state_dict`` as one ``safetensors``
file, what ``model.load_state_dict`` and Hugging Face ``from_pretrained`` read.

The file holds exactly the keys of ``model.state_dict()``: a tied weight under each of its
names (``load_state_dict(strict=True)`` wants them all), non-persistent buffers left out.
Values are the trained ones, taken one tensor at a time and streamed into the file
(``checkpoint.safetensors_file``), so no process ever holds more than one whole tensor: in
this process (serial, simulated) from the state's whole tensors; on real processes each
gathered from its pieces (``runtime.full``, a collective every process calls for every
value, in the same order; a tied weight once), and only rank 0 writes. A model built on the
meta device stays there: its values come from the pieces.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checkpoint import SafetensorsWriter, TensorEntry, safetensors_path
from ..runtime import DistributedRuntime
from .train_state import TrainState

__all__ = ["export_full", "state_dict_aliases"]


def export_full(state: TrainState, runtime: Any, path: str | os.PathLike) -> Path:
    """Write the model's trained ``state_dict`` to ``path`` (a ``.safetensors`` file, or
    ``path/model.safetensors`` for a directory or a name without a suffix); returns the
    file. Every process calls it."""
    target = safetensors_path(path)
    distributed = isinstance(runtime, DistributedRuntime)
    if distributed and runtime.state is None:
        raise ValueError("save(format='full'): on real processes the state is placed by the "
                         "first step; train (or evaluate) once before exporting")
    if not distributed:
        state.materialize()
    aliases = state_dict_aliases(state.model)
    value_of, shape_of = _rank_access(state, runtime) if distributed else _local_access(state)
    entries = [TensorEntry(key, *shape_of(name)) for name, keys in aliases.items()
               for key in keys]
    writes = not distributed or dist.get_rank() == 0
    with SafetensorsWriter(target, entries) if writes else contextlib.nullcontext() as writer:
        for name, keys in aliases.items():
            value = value_of(name)
            for key in keys if writer is not None else ():
                writer.write(key, value)
            del value
    if distributed:
        dist.barrier()
    return target


def state_dict_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's and persistent buffer's canonical name (``named_parameters`` /
    ``named_buffers``, the engine's state names) -> its ``state_dict`` keys (several for a
    tied weight), in ``state_dict`` order."""
    canonical = {id(b): n for n, b in model.named_buffers()}
    canonical.update({id(p): n for n, p in model.named_parameters()})
    out: dict[str, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = canonical.get(id(value))
        if name is None:
            raise ValueError(f"save(format='full'): state_dict key {key!r} is neither a "
                             "parameter nor a buffer of the model (added by a state_dict "
                             "hook?): the engine has no trained value for it")
        out.setdefault(name, []).append(key)
    return out


Access = tuple[Callable[[str], torch.Tensor], Callable[[str], tuple[tuple[int, ...],
                                                                      torch.dtype]]]


def _local_access(state: TrainState) -> Access:
    """Whole tensors in this process (the model's own, trained in place)."""
    tensors = state.tensors

    def shape_of(name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(tensors[name].shape), tensors[name].dtype

    return tensors.__getitem__, shape_of


def _rank_access(state: TrainState, runtime: DistributedRuntime) -> Access:
    """Real processes: a value the plan holds is gathered from its pieces (a collective);
    a constant is its whole value; a value no plan holds is the model's own tensor (the same
    on every process)."""
    held = runtime.state
    gathered = set(held.names())

    def value_of(name: str) -> torch.Tensor:
        if name in gathered:
            value = runtime.full(name)
            if value is None:
                raise ValueError(f"save(format='full'): state {name!r} has no value on "
                                 "any process")
            return value
        piece = held.pieces.get(name)
        return piece.const if piece is not None else state.tensors[name]

    def shape_of(name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name in held.pieces:
            piece = held.pieces[name]
            return tuple(piece.shape), piece.dtype
        own = state.tensors[name]
        if own.is_meta:
            raise ValueError(f"save(format='full'): {name!r} is in no plan's state and the "
                             "model's own tensor is on the meta device: no value to export")
        return tuple(own.shape), own.dtype

    return value_of, shape_of

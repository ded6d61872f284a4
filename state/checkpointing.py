"""``Engine.save`` / ``Engine.load``: the training state as a DCP checkpoint.

What a checkpoint holds:

* every parameter, persistent buffer and optimizer state value (and the loss scaler's
  state), each process writing only the boxes of the pieces it holds (``checkpoint.boxes``)
  under the value's global shape, so any strategy can read it back;
* ``autopar.trainer``: JSON with what exact resume needs beyond tensors (optimizer steps,
  batches trained, the data position, the LR scheduler's and the param groups' state) and
  what the checkpoint was written under (the strategy's YAML, the world size).

Loading reads into the layout of the run that loads: in this process (serial, simulated)
whole tensors; on real processes each its pieces, in place when the state is already
placed, else when the first step places it (``TrainState.pieces`` asks ``PendingLoad``). A
simulated run writes the boxes its simulated ranks would write, so the simulator checks the
same tiling real ranks produce.

What is saved is what the state's typed keys say (``checkpoint.checkpoint_key``): the
model's parameters and buffers, the optimizer's state, the loss scaler's; the engine hands
over only the facts of the run (``RunRecord``).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..checkpoint import (
    EXTRA,
    MODEL,
    OPTIM,
    Box,
    BoxLoadPlanner,
    BoxSavePlanner,
    CheckpointDir,
    Chunk,
    SafeReader,
    checkpoint_key,
    is_checkpoint,
    piece_boxes,
    writes_piece,
)
from ..ir import StateKey, StateKind
from ..ir.kernels.optim import rule_for
from ..lower.executable import Lowered, PipelineProcess, StatePiece
from ..runtime import DistributedRuntime
from ..strategy import Strategy
from .train_state import TrainState

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "CheckpointMismatch",
           "PendingLoad", "RunRecord", "SaveJob", "begin_save", "dump_save", "TRAINER_KEY"]

TRAINER_KEY = "autopar.trainer"
DATA_KEY = "autopar.data"
FORMAT = "autopar-checkpoint/1"


class CheckpointError(RuntimeError):
    """A save that did not complete (every process raises it; nothing became visible)."""


class CheckpointMismatch(ValueError):
    """A checkpoint that does not belong to this model (or optimizer)."""


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records of the run besides its state, and where its dumps go."""

    strategy: Strategy
    world_size: int
    rank: int                       # this process's (0 unless on real processes)
    dump_dir: str | None
    plans: Sequence[Lowered] = ()   # the plans made so far (a simulated save writes the
                                    # boxes their simulated ranks would)


# -- saving ---------------------------------------------------------------------------------

@dataclass
class SaveJob:
    """One save, between its start (every process at the call) and its commit: what this
    process writes, and the directory it becomes. The synchronous save and the background
    one (``state.async_save``) share it, so both commit alike."""

    target: CheckpointDir
    chunks: list[Chunk]              # this process's boxes (views of the live state)
    blobs: dict[str, bytes]          # the trainer record, by key
    own_blobs: dict[str, bytes]      # this process's own: where its data stands
    required: list[str]              # the keys some process must have written
    distributed: bool                # real processes (DCP coordinates them)
    coordinator: bool                # the process that commits

    def planner(self) -> BoxSavePlanner:
        return BoxSavePlanner(self.chunks, self.blobs, self.own_blobs)

    def writer(self) -> FileSystemWriter:
        return FileSystemWriter(self.target.partial)

    def failure(self, failed: BaseException) -> CheckpointError:
        """The error every process raises for a write that failed (DCP's, or another)."""
        if isinstance(failed, CheckpointError):
            return failed
        if isinstance(failed, CheckpointException):
            return CheckpointError(f"save to {self.target.final} failed on rank(s) "
                                   f"{sorted(failed.failures)}: {_first_failure(failed)}; it "
                                   f"stays {self.target.partial.name} and earlier checkpoints "
                                   "are intact")
        return CheckpointError(f"save to {self.target.final} failed: {type(failed).__name__}: "
                               f"{failed}; it stays {self.target.partial.name}")

    def commit(self, written: Metadata) -> None:
        """After DCP returned (on the coordinator, that means every process wrote: DCP
        gathers their write results before writing ``.metadata``): check, then rename."""
        _check_complete(self.required, written, self.target)   # the same metadata everywhere
        if self.coordinator:
            self.target.commit()


def begin_save(state: TrainState, runtime: Any, path: str | os.PathLike, run: RunRecord
               ) -> SaveJob:
    """Refuse what cannot be saved, collect this process's boxes, and clear the partial
    directory before anyone writes (every process calls it; a collective)."""
    k, trained = run.strategy.gradient_merge.k_steps, state.progress.batches_trained
    if trained % k:
        raise ValueError(f"save: {trained % k} batch(es) into a gradient_merge cycle of "
                         f"k_steps={k}; save after an optimizer step (fit's save_freq counts "
                         "optimizer steps)")
    distributed = isinstance(runtime, DistributedRuntime)
    if distributed and runtime.state is None:
        raise ValueError("save: on real processes the state is placed by the first step; "
                         "train (or evaluate) once before saving")
    chunks = _rank_chunks(state, runtime) if distributed else _local_chunks(state, run)
    rank = dist.get_rank() if distributed else 0
    data = state.progress.data
    job = SaveJob(CheckpointDir(path), chunks,
                  {TRAINER_KEY: json.dumps(_trainer_record(state, run)).encode()},
                  {data_key(rank): data} if data is not None else {},
                  _required_keys(state), distributed, rank == 0)
    if job.coordinator:
        job.target.prepare()
    _barrier(distributed)
    return job


def save_checkpoint(state: TrainState, runtime: Any, path: str | os.PathLike,
                    run: RunRecord) -> Path:
    """Write the training state to the directory ``path`` (every process calls it)."""
    job = begin_save(state, runtime, path, run)
    try:
        with _single_process_quietly():
            written = dcp.save({}, storage_writer=job.writer(), planner=job.planner(),
                               no_dist=not job.distributed)
    except CheckpointException as failed:
        raise job.failure(failed) from failed
    job.commit(written)
    _barrier(job.distributed)
    dump_save(run, job)
    return job.target.final


def dump_save(run: RunRecord, job: SaveJob) -> None:
    """The dump of the boxes a save writes (``debug.dump_dir``)."""
    _dump(run, job.distributed, f"save_{job.target.final.name}", job.chunks)


def _dump(run: RunRecord, distributed: bool, name: str, chunks: list[Chunk]) -> None:
    """``<dump_dir>/rank<r>/checkpoint_<save|load>_<dir>.txt``: the boxes this process
    wrote or read, per key (simulated: every simulated rank's), and their bytes."""
    if run.dump_dir is None:
        return
    path = Path(run.dump_dir) / f"rank{run.rank}" / f"checkpoint_{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    total = sum(c.box.numel() * c.tensor.element_size() for c in chunks)
    lines = [f"# {name}: {len(chunks)} boxes, {total:,} bytes"
             + ("" if distributed else " (this process: every simulated rank's boxes)")]
    for c in sorted(chunks, key=lambda c: (c.key, c.box.offsets)):
        where = ", ".join(f"{o}:{o + n}" for o, n in zip(c.box.offsets, c.box.sizes))
        lines.append(f"{c.key}  {list(c.shape)}  [{where}]  {c.tensor.dtype}")
    path.write_text("\n".join(lines) + "\n")


def _required_keys(state: TrainState) -> list[str]:
    """The keys of every parameter and persistent buffer (and their tied aliases)."""
    module = _written_keys(state, state.module_state_names())
    return [k for keys in module.values() for k in keys]


def _check_complete(required: list[str], written: Metadata, target: CheckpointDir) -> None:
    """Every parameter and persistent buffer has boxes in the checkpoint (DCP checks that the
    boxes of each key it got tile it; a key no process wrote would go unnoticed)."""
    missing = sorted(k for k in required if k not in written.state_dict_metadata)
    if missing:
        raise CheckpointError(f"save to {target.final}: no process wrote {', '.join(missing[:10])}"
                              f"{' ...' if len(missing) > 10 else ''}; it stays "
                              f"{target.partial.name}")


def _first_failure(failed: CheckpointException) -> str:
    error = next(iter(failed.failures.values()))
    error = error[0] if isinstance(error, tuple) else error
    return f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns that it assumes one process when no process group exists: here that is
    the plan (serial or simulated), not an accident."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _checkpoint_names(state: TrainState, names) -> dict[str, str]:
    """State name -> checkpoint key, for the states a checkpoint holds (what the typed key
    says: not gradient-merge accumulators, not constants; not non-persistent buffers, which
    ``state_dict`` leaves out too)."""
    skipped = _non_persistent_buffers(state.model)
    found = {n: checkpoint_key(state.keys[n]) for n in names
             if n in state.keys and n not in skipped}
    return {n: k for n, k in found.items() if k is not None}


def _written_keys(state: TrainState, names) -> dict[str, list[str]]:
    """State name -> the keys its boxes are written under: its own, and a tied weight's
    other names too (``model.state_dict()`` lists both, so plain DCP can load it)."""
    aliases = _aliases(state.model)
    return {n: [k, *(MODEL + a for a in aliases.get(n, ()))]
            for n, k in _checkpoint_names(state, names).items()}


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Canonical name -> the other names ``state_dict`` gives the same tensor."""
    out: dict[str, list[str]] = {}
    for named in (model.named_parameters, model.named_buffers):
        canonical = {id(t): n for n, t in named()}
        for n, t in named(remove_duplicate=False):
            if canonical[id(t)] != n:
                out.setdefault(canonical[id(t)], []).append(n)
    return out


def _non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    return {f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules()
            for b in getattr(m, "_non_persistent_buffers_set", ())}


def _box_of(tensor: torch.Tensor, box: Box, at: tuple[int, ...]) -> torch.Tensor:
    """The view of ``tensor`` holding ``box``, which starts at ``at`` in it."""
    view = tensor
    for d, (start, size) in enumerate(zip(at, box.sizes)):
        view = view.narrow(d, start, size)
    return view


def _rank_chunks(state: TrainState, runtime: DistributedRuntime) -> list[Chunk]:
    """This real process's boxes: of the pieces it holds, those it writes."""
    held = runtime.state
    pp = held.pipeline.pp if held.pipeline is not None else None
    chunks = []
    for name, keys in _written_keys(state, held.names()).items():
        piece, value = held.pieces[name], held.tensors.get(name)
        if value is None or (piece.owner is not None and piece.owner != pp) \
                or not writes_piece(piece):
            continue
        chunks += [Chunk(key, tuple(piece.shape), box, _box_of(value, box, box.local))
                   for box in piece_boxes(piece) for key in keys]
    return chunks


def _local_chunks(state: TrainState, run: RunRecord) -> list[Chunk]:
    """Every box this process writes: whole tensors, or under a simulated mesh the boxes
    the simulated ranks would write, cut from the whole tensors."""
    tensors = state.tensors
    layout = _simulated_layout(run)
    chunks = []
    for name, keys in _written_keys(state, [n for n, v in tensors.items()
                                            if isinstance(v, torch.Tensor)]).items():
        value = tensors[name]
        shape = tuple(value.shape)
        boxes = [b for p in layout[name] for b in piece_boxes(p)] if name in layout \
            else [Box((0,) * len(shape), shape, (0,) * len(shape))]    # held by no plan
        chunks += [Chunk(key, shape, box, _box_of(value, box, box.offsets))
                   for box in boxes for key in keys]
    return chunks


def _simulated_layout(run: RunRecord) -> dict[str, list[StatePiece]]:
    """Per state, the pieces the simulated ranks write (those of the plan that holds the
    most state: training's, when there is one)."""
    if not run.strategy.debug.simulate or not run.plans:
        return {}
    lowered = max(run.plans, key=lambda low: len(next(iter(low.processes.values())).state))
    if len(lowered.processes) < 2:
        return {}
    out: dict[str, list[StatePiece]] = {}
    for made in lowered.processes.values():
        held = made.held if isinstance(made, PipelineProcess) else made.state.keys()
        pp = made.pp if isinstance(made, PipelineProcess) else None
        for name in held:
            piece = made.state[name]
            if piece.const is not None or checkpoint_key(piece.key) is None:
                continue
            writers = out.setdefault(name, [])
            if (piece.owner is None or piece.owner == pp) and writes_piece(piece):
                writers.append(piece)
    return out


def _trainer_record(state: TrainState, run: RunRecord) -> dict[str, Any]:
    optimizer, scheduler = state.optimizer, state.lr_scheduler
    groups = optimizer.param_groups if optimizer is not None else []
    progress = state.progress
    record = {"format": FORMAT, "global_step": progress.global_step,
              "batches_trained": progress.batches_trained, "epoch": progress.epoch,
              "batch_in_epoch": progress.batch_in_epoch, "world_size": run.world_size,
              "strategy": run.strategy.to_yaml(), "torch": torch.__version__,
              "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
              "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
              # the typed keys of autopar's own states (the loss scaler's), to load them by
              "extra_states": [{"kind": key.kind.value, "param": key.param, "key": key.key}
                               for key in state.keys.values()
                               if (checkpoint_key(key) or "").startswith(EXTRA)]}
    try:
        json.dumps(record)
    except TypeError as err:
        raise TypeError(f"save: the LR scheduler's or optimizer's param-group state holds a "
                        f"value a checkpoint cannot store as JSON ({err})") from None
    return record


# -- loading --------------------------------------------------------------------------------

@dataclass
class PendingLoad:
    """A checkpoint loaded before the state was placed on real processes: the pieces the
    first steps place are read from it, each process on its own (reading needs no
    collective), and forgotten once read."""

    path: Path
    metadata: Metadata
    keys: dict[str, str]                  # state name -> checkpoint key, for states it holds
    on_read: Callable[[list[Chunk]], None] = lambda chunks: None   # the dump

    def read(self, wanted: Mapping[str, StatePiece]) -> dict[str, torch.Tensor]:
        """This process's pieces of the ``wanted`` states the checkpoint holds."""
        out, chunks = {}, []
        for name, piece in wanted.items():
            key = self.keys.pop(name, None)
            if key is None:
                continue
            saved = self.metadata.state_dict_metadata[key]
            local = piece.dist.local_shape(piece.shape, piece.coordinate) if piece.dist \
                else tuple(piece.shape)
            out[name] = torch.empty(local, dtype=saved.properties.dtype)
            chunks += [Chunk(key, tuple(piece.shape), box, _box_of(out[name], box, box.local))
                       for box in piece_boxes(piece)]
        if chunks:
            _read(self.path, chunks, [])
            self.on_read(chunks)
        return out


def load_checkpoint(state: TrainState, runtime: Any, path: str | os.PathLike,
                    run: RunRecord) -> dict[str, Any]:
    """Read the checkpoint at ``path`` into the training state, under the run's own
    strategy; returns its trainer record (every process calls it)."""
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"load: {path} is not a complete checkpoint (a directory "
                                "with DCP's .metadata, not a .partial one)")
    metadata = SafeReader(path).read_metadata()
    position = _data_position_key(metadata, run.rank)
    blobs = _read(path, [], [TRAINER_KEY, *([position] if position else [])])
    trainer = json.loads(blobs[TRAINER_KEY])
    keys = _loadable(state, metadata, trainer)
    if isinstance(runtime, DistributedRuntime):
        _load_rank(state, runtime, path, metadata, keys, run)
    else:
        _load_local(state, path, metadata, keys, run)
    _restore_trainer(state, trainer)
    state.progress.data = blobs.get(position) if position else None
    return trainer


def data_key(rank: int) -> str:
    """Where a process's data position is kept (``data.data_position``)."""
    return f"{DATA_KEY}/rank{rank}"


def _data_position_key(metadata: Metadata, rank: int) -> str | None:
    """The data position a process resumes from: its own, or, on a process the writing
    run did not have (a grown world), the first process's: every process reads the same
    global batches unless a stream is sharded, whose position is its own."""
    for key in (data_key(rank), data_key(0)):
        if key in metadata.state_dict_metadata:
            return key
    return None


def _read(path: Path, chunks: list[Chunk], blob_keys: list[str]) -> dict[str, bytes]:
    """Fill ``chunks`` and read ``blob_keys``: each process alone (DCP's load plan needs
    nothing from the others: every process reads the boxes its own pieces overlap)."""
    planner = BoxLoadPlanner(chunks, blob_keys)
    with _single_process_quietly():
        dcp.load({}, storage_reader=SafeReader(path), planner=planner, no_dist=True)
    return planner.blobs


def _load_local(state: TrainState, path: Path, metadata: Metadata, keys: dict[str, str],
                run: RunRecord) -> None:
    """Whole tensors into this process's state: in place where the state already has the
    value (the model's own tensors), else new tensors the first step adopts."""
    state.materialize()
    tensors = state.tensors
    chunks, fresh = [], {}
    for name, key in keys.items():
        saved = metadata.state_dict_metadata[key]
        shape = tuple(saved.size)
        own = tensors.get(name)
        if isinstance(own, torch.Tensor) and tuple(own.shape) == shape and not own.is_meta:
            dest = own
        else:
            dest = fresh[name] = torch.empty(shape, dtype=saved.properties.dtype)
        chunks.append(Chunk(key, shape, Box((0,) * len(shape), shape, (0,) * len(shape)),
                            dest))
    _read(path, chunks, [])
    _dump(run, False, f"load_{path.name}", chunks)
    tensors.update(fresh)
    state.refresh_optimizer_state()


def _load_rank(state: TrainState, runtime: DistributedRuntime, path: Path, metadata: Metadata,
               keys: dict[str, str], run: RunRecord) -> None:
    """Real processes: the pieces already placed are read in place; the rest wait for the
    step that places them (``PendingLoad``)."""
    held = runtime.state
    chunks = []
    placed = {} if held is None else {n: held.pieces[n] for n in keys
                                      if held.tensors.get(n) is not None}
    for name, piece in placed.items():
        chunks += [Chunk(keys[name], tuple(piece.shape), box,
                         _box_of(held.tensors[name], box, box.local))
                   for box in piece_boxes(piece)]
    _read(path, chunks, [])
    _dump(run, True, f"load_{path.name}_in_place", chunks)
    state.pending = PendingLoad(
        path, metadata, {n: k for n, k in keys.items() if n not in placed},
        lambda read: _dump(run, True, f"load_{path.name}_placed_by_step", read))


def _loadable(state: TrainState, metadata: Metadata, trainer: dict[str, Any]
              ) -> dict[str, str]:
    """State name -> key of every value the checkpoint gives this run; a checkpoint of
    another model (missing, unexpected or reshaped keys) is refused, naming them."""
    saved = {k: v for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    expected = _checkpoint_names(state, state.module_state_names())
    shapes = {n: tuple(state.tensors[n].shape) for n in expected}
    keys = dict(expected)
    problems = []
    missing = sorted(k for k in expected.values() if k not in saved)
    known = set(expected.values()) | {MODEL + a for names in _aliases(state.model).values()
                                      for a in names}
    unexpected = sorted(k for k in saved if k.startswith(MODEL) and k not in known)
    reshaped = [f"{k}: saved {list(saved[k].size)}, model {list(shapes[n])}"
                for n, k in expected.items() if k in saved and tuple(saved[k].size) != shapes[n]]
    for what, items in (("missing", missing), ("unexpected", unexpected),
                        ("shape mismatch", reshaped)):
        if items:
            problems.append(f"{what} ({len(items)}): " + ", ".join(items[:20])
                            + (" ..." if len(items) > 20 else ""))
    optim_keys, optim_problems = _optimizer_keys(state, saved)
    problems += optim_problems
    if problems:
        raise CheckpointMismatch("load: the checkpoint does not match this model:\n  "
                                 + "\n  ".join(problems))
    keys.update(optim_keys)
    # autopar's own states (the loss scaler's), by the typed keys the record lists
    extra = [StateKey(StateKind(e["kind"]), e["param"], e["key"])
             for e in trainer.get("extra_states", ())]
    state.learn_keys(extra)
    keys.update({key.name: checkpoint_key(key) for key in extra if checkpoint_key(key) in saved})
    return keys


def _optimizer_keys(state: TrainState, saved: Mapping[str, Any]
                    ) -> tuple[dict[str, str], list]:
    """Optimizer state name -> its checkpoint key, and what does not fit this optimizer
    (state of another optimizer kind, of a parameter it does not train). A run without an
    optimizer reads none. The typed keys are learned (``TrainState.keys``)."""
    optimizer = state.optimizer
    if optimizer is None:
        return {}, []
    expected: dict[str, StateKey] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, _ in rule_for(optimizer).states(group):
                key = StateKey.optimizer(state.param_names[id(p)], k)
                expected[checkpoint_key(key)] = key
    unexpected = sorted(k for k in saved if k.startswith(OPTIM) and k not in expected)
    problems = [f"optimizer state this {type(optimizer).__name__} does not have "
                f"({len(unexpected)}): " + ", ".join(unexpected[:20])] if unexpected else []
    found = {k: key for k, key in expected.items() if k in saved}
    state.learn_keys(found.values())
    return {key.name: k for k, key in found.items()}, problems


def _restore_trainer(state: TrainState, trainer: dict[str, Any]) -> None:
    if trainer.get("format") != FORMAT:
        raise CheckpointMismatch(f"load: trainer state of format {trainer.get('format')!r}, "
                                 f"expected {FORMAT!r}")
    progress = state.progress
    progress.global_step = trainer["global_step"]
    progress.batches_trained = trainer["batches_trained"]
    progress.epoch, progress.batch_in_epoch = trainer["epoch"], trainer["batch_in_epoch"]
    progress.resume_at = (trainer["epoch"], trainer["batch_in_epoch"])
    if state.lr_scheduler is not None and trainer["lr_scheduler"] is not None:
        state.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
    if state.optimizer is not None and trainer["param_groups"]:
        _restore_groups(state.optimizer, trainer["param_groups"])


def _restore_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Hyperparameters of each param group (the LR a scheduler moved, betas...); JSON made
    tuples lists, so a value takes the type the optimizer gave it."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointMismatch(f"load: the checkpoint has {len(saved)} param groups, the "
                                 f"optimizer {len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v

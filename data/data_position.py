"""Where a run's data stands, so that a resumed run reads the batches the uninterrupted one
would have read.

An epoch's order is drawn when its loader starts iterating: a shuffling sampler draws from
its own generator, or from torch's global one when it has none, and a loader's workers are
seeded from the loader's generator (or the global one). So each epoch's reader records the
states of those generators as they were when it started; a checkpoint keeps them with the
number of batches trained, and a resumed run puts them back, iterates the epoch from its
start and skips the batches trained before the checkpoint (``fit``'s replay). The shuffled
order, the workers' seeds and any random transform a dataset draws from the global
generator in the main process then come out as they did.

A loader that keeps its own position (``state_dict`` / ``load_state_dict``: torchdata's
``StatefulDataLoader``) is asked for it instead, after each batch it hands out, and resumes
from it without the replay. Its own restore leaves its generator elsewhere than the
uninterrupted epoch would (torchdata 0.11 draws the order again as it restores), so once
the resumed epoch is read, its generators are put where they were at the checkpoint: a
sampler draws an epoch's order as the epoch starts, so that is where the epoch left them.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

__all__ = ["DataPosition", "EpochReader", "position_between_epochs", "is_stateful"]


@dataclass
class DataPosition:
    """What a checkpoint keeps of the data: the generator states at the start of the epoch
    being read (torch's global one first, then the loader's own, in ``loader_generators``
    order), and a stateful loader's own state after the last batch trained."""

    generators: list[torch.Tensor] = field(default_factory=list)
    loader: dict[str, Any] | None = None
    # a stateful loader's own generators as the checkpoint found them
    generators_then: list[torch.Tensor] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"generators": self.generators, "loader": self.loader,
                    "generators_then": self.generators_then}, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> DataPosition:
        saved = torch.load(io.BytesIO(data), weights_only=True)
        return cls(list(saved["generators"]), saved["loader"], list(saved["generators_then"]))


def is_stateful(loader: Any) -> bool:
    """A loader that saves and restores its own position (torchdata's Stateful protocol)."""
    return callable(getattr(loader, "state_dict", None)) and \
        callable(getattr(loader, "load_state_dict", None))


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader's iteration draws from besides the global one: its own (the
    workers' base seed), its sampler's and its batch sampler's sampler's (the order); each
    once."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [getattr(loader, "generator", None), getattr(sampler, "generator", None),
             getattr(getattr(batch_sampler, "sampler", None), "generator", None)]
    unique: list[torch.Generator] = []
    for g in found:
        if isinstance(g, torch.Generator) and all(g is not u for u in unique):
            unique.append(g)
    return unique


def _generator_states(own: list[torch.Generator]) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + [g.get_state() for g in own]


def _restore_generators(own: list[torch.Generator], states: list[torch.Tensor]) -> None:
    if len(states) != len(own) + 1:
        raise ValueError(f"resume: the checkpoint's data position holds {len(states) - 1} "
                         f"loader generator state(s), the loader given draws from {len(own)}: "
                         "pass the loader the interrupted run used")
    torch.set_rng_state(states[0])
    for generator, state in zip(own, states[1:]):
        generator.set_state(state)


def position_between_epochs(loader: Any, own: list[torch.Generator]) -> DataPosition:
    """The position before an epoch starts: the generators as they are now (the next epoch
    draws from them as it starts), and a stateful loader's own state."""
    return DataPosition(_generator_states(own),
                        loader.state_dict() if is_stateful(loader) else None)


class EpochReader:
    """One epoch of a loader's batches, drawing its order from torch's global generator and
    ``own`` (``loader_generators``: those of a user's loader; a loader made over a dataset
    is seeded by its epoch). Started from a checkpoint's ``resume`` position, it first puts
    the generators back (a stateful loader: its own state, so that it continues after the
    last batch trained). ``position(k)`` is the position after its k-th batch."""

    def __init__(self, loader: Iterable, own: list[torch.Generator],
                 resume: DataPosition | None = None):
        self.loader, self.own = loader, own
        self.stateful = is_stateful(loader)
        self.continues = False     # a stateful loader resumed mid-epoch: no replay needed
        self._then: list[torch.Tensor] = []    # where the generators end this epoch
        if resume is not None:
            _restore_generators(own, resume.generators)
            if self.stateful and resume.loader is not None:
                loader.load_state_dict(resume.loader)
                self.continues, self._then = True, resume.generators_then
        self.started = _generator_states(own)
        self._after: dict[int, dict[str, Any]] = {}

    def batches(self, first: int = 1) -> Iterator[Any]:
        """The loader's batches; the first is batch ``first`` of the epoch."""
        for index, batch in enumerate(self.loader, start=first):
            if self.stateful:
                # kept for the batches a prefetching consumer may not have trained yet
                self._after[index] = self.loader.state_dict()
                self._after.pop(index - 3, None)
            yield batch
        for generator, state in zip(self.own, self._then):    # (not the global one)
            generator.set_state(state)

    def position(self, batches_trained: int) -> DataPosition:
        """The position after the epoch's first ``batches_trained`` batches."""
        if not self.stateful:
            return DataPosition(self.started)
        loader_state = self._after.get(batches_trained)
        if loader_state is None:
            raise RuntimeError(f"data position: the loader's state after batch "
                               f"{batches_trained} of the epoch was not kept")
        return DataPosition(self.started, loader_state, [g.get_state() for g in self.own])

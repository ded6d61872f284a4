"""A stream of next-token pairs for the streaming tests (``tests/data/test_streams.py``, and the
real ranks of ``tests/rank_main.py``): item ``i``'s length depends on its global batch and
on the shard that reads it round-robin, so the shards of one step differ in length."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

BASE = (20, 33, 27, 41)


class TokenStream(IterableDataset):
    """``n`` items, for global batches of ``rows * count`` items read by ``count`` shards
    round-robin; ``made`` counts the items this process built. With ``shardable`` it has
    Hugging Face's ``shard(num_shards, index)`` and builds only its shard's items."""

    def __init__(self, n: int, rows: int, count: int, shardable: bool = False,
                 keep: tuple[int, int] | None = None):
        self.n, self.rows, self.count, self.keep = n, rows, count, keep
        self.made = 0
        if shardable:
            self.shard = self._shard

    def _shard(self, num_shards: int, index: int) -> TokenStream:
        part = TokenStream(self.n, self.rows, self.count, keep=(num_shards, index))
        self.parts = [*getattr(self, "parts", []), part]
        return part

    def length(self, i: int) -> int:
        return BASE[(i // (self.rows * self.count)) % len(BASE)] + 3 * (i % self.count)

    def item(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 64, (self.length(i) + 1,),
                               generator=torch.Generator().manual_seed(i))
        return tokens[:-1], tokens[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            if self.keep is None or i % self.keep[0] == self.keep[1]:
                self.made += 1
                yield self.item(i)


def global_batches(stream: TokenStream, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch: the shards' batches side by side, padded to the longest
    (token id 0, label -100)."""
    out = []
    for k in range(steps):
        parts = []
        for s in range(stream.count):
            items = [stream.item(s + stream.count * j)
                     for j in range(k * stream.rows, (k + 1) * stream.rows)]
            parts.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
        longest = max(x.shape[1] for x, _ in parts)
        out.append((torch.cat([F.pad(x, (0, longest - x.shape[1]), value=0) for x, _ in parts]),
                    torch.cat([F.pad(y, (0, longest - y.shape[1]), value=-100)
                               for _, y in parts])))
    return out

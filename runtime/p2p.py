"""A pipeline rank's point-to-point messages on c10d, posted so that no rank can wait forever.

Both ends of a pair of ranks know every message between them and one order for them
(``Message.order``, from the planned schedule). Each end posts the pair's messages in that
order: a receive is posted (``irecv`` into a fresh buffer) as soon as it is due or before
any later message of the pair, a send (``isend``) as soon as its value exists, after every
earlier receive of the pair. NCCL matches a pair's operations in posting order and gloo a
direction's, so both ends always agree on which buffer a message fills; and since a send
never waits and every wait is for a message an earlier job of the peer sends, no cycle of
waits can form (``pipeline.jobs``).
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

import torch
import torch.distributed as dist

from ..pipeline.jobs import Message

__all__ = ["P2PTransport"]


class P2PTransport:
    """``send(message, tensor)`` / ``recv(message) -> tensor`` for one process at pp
    position ``me``, with the process at its coordinate on every pp position (``peers``)
    and the shape and dtype of every message it receives."""

    def __init__(self, messages: tuple[Message, ...], me: int, peers: Mapping[int, int],
                 shapes: dict[Message, tuple[tuple[int, ...], torch.dtype]], device,
                 group=None):
        self.me, self.peers, self.shapes, self.device, self.group = me, peers, shapes, device, group
        self.pairs: dict[int, list[Message]] = {}
        for m in messages:
            if me in (m.src, m.dst) and m.src != m.dst:
                self.pairs.setdefault(m.dst if m.src == me else m.src, []).append(m)
        for pair in self.pairs.values():
            pair.sort(key=lambda m: m.order)
        self.index = {m: (other, i) for other, pair in self.pairs.items()
                      for i, m in enumerate(pair)}
        self.start_step()

    def start_step(self) -> None:
        self.posted = {other: 0 for other in self.pairs}       # next message to post
        self.incoming: dict[Message, tuple] = {}                # posted receives
        self.outgoing: deque = deque()                          # posted sends

    # -- posting ------------------------------------------------------------------------------
    def _post_receives(self, other: int, upto: int) -> None:
        """Post the pair's receives up to position ``upto`` (inclusive); a send met on the
        way must already be posted, since its value was made by an earlier job."""
        pair = self.pairs[other]
        while self.posted[other] <= upto:
            m = pair[self.posted[other]]
            if m.src == self.me:
                raise RuntimeError(f"pipeline p2p on rank {self.me}: message {m} is due "
                                   "before a later message of the pair is posted, but its "
                                   "value does not exist yet (a plan and schedule that "
                                   "disagree)")
            shape, dtype = self.shapes[m]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self.incoming[m] = (self._post(m, other, buffer), buffer)
            self.posted[other] += 1

    def _post(self, m: Message, other: int, tensor: torch.Tensor):
        """Post one message of the pair with ``other``: the only place that calls c10d."""
        if m.src == self.me:
            return dist.isend(tensor, self.peers[other], group=self.group)
        return dist.irecv(tensor, self.peers[other], group=self.group)

    def send(self, m: Message, tensor: torch.Tensor) -> None:
        other, i = self.index[m]
        if self.posted[other] < i:
            self._post_receives(other, i - 1)
        if self.posted[other] != i:
            raise RuntimeError(f"pipeline p2p on rank {self.me}: {m} posted out of order")
        tensor = tensor.contiguous()
        self.outgoing.append((self._post(m, other, tensor), tensor))
        self.posted[other] += 1

    def prefetch(self) -> None:
        """Post every receive the pair order allows now (up to this rank's next send of each
        pair), so a message travels while this rank computes instead of when it is needed."""
        for other, pair in self.pairs.items():
            upto = self.posted[other]
            while upto < len(pair) and pair[upto].src != self.me:
                upto += 1
            if upto > self.posted[other]:
                self._post_receives(other, upto - 1)

    def recv(self, m: Message) -> torch.Tensor:
        other, i = self.index[m]
        if m not in self.incoming:
            self._post_receives(other, i)
        work, buffer = self.incoming.pop(m)
        work.wait()
        return buffer

    def finish(self) -> None:
        """Wait for every send of the step (their buffers may then be reused)."""
        while self.outgoing:
            work, _ = self.outgoing.popleft()
            work.wait()
        if self.incoming:
            raise RuntimeError(f"pipeline p2p on rank {self.me}: received but never read "
                               f"{sorted(str(m) for m in self.incoming)}")

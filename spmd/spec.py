"""Einsum-like sharding specs: what an op does to each tensor dim, as data.

A spec letters every dim of every tensor input and output (``"mk,kn->mn"`` for mm). The
inference engine (``einsum.py``) reads nothing else, so most rules are one line: a spec
string plus a few flags. The letter ``1`` marks a dim that may never be sharded and is never
matched across tensors (a broadcast size-1 dim); every other letter names one logical axis.
"""
from __future__ import annotations

from dataclasses import dataclass

LINEAR_KINDS = ("none", "sum", "each")
UNSHARDABLE = "1"


def _split_side(side: str) -> list[str | None]:
    """One side of a spec, per operand: ``-`` is a non-tensor operand (None)."""
    if not side and "," not in side:
        return [""]
    return [None if s == "-" else s for s in side.split(",")]


@dataclass(frozen=True)
class Spec:
    """How an op maps tensor dims to tensor dims.

    inputs/outputs: one letter string per tensor input (in ``op.inputs`` order) and per
        output; ``None`` for an output that is not a tensor.
    replicated: letters that must stay unsharded (a softmax axis, a cut or gathered dim).
    even: letters shardable only when every shard has the same size (reshapes).
    reduce: per output, how a sharded input letter missing from that output combines across
        ranks (``"sum"`` for a contraction, ``"max"``/``"min"``) or ``None`` when the op
        does not reduce over it (then the letter cannot be sharded).
    linear: how Partial inputs pass through. ``"sum"``: the op is linear in all its
        ``linear_inputs`` jointly (add, views), so all-partial in -> partial out. ``"each"``:
        linear in each separately (mul, mm), so one partial input with the rest replicated
        -> partial out. ``"none"``: partial inputs are resolved first.
    partial_ops: which Partial ops pass through a linear op (max/min only through moves).
    """

    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    replicated: frozenset[str] = frozenset()
    even: frozenset[str] = frozenset()
    reduce: tuple[str | None, ...] = ()
    linear: str = "none"
    linear_inputs: frozenset[int] | None = None
    partial_ops: frozenset[str] = frozenset({"sum", "avg"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "replicated", frozenset(self.replicated))
        object.__setattr__(self, "even", frozenset(self.even))
        object.__setattr__(self, "partial_ops", frozenset(self.partial_ops))
        if self.linear_inputs is not None:
            object.__setattr__(self, "linear_inputs", frozenset(self.linear_inputs))
        reduce = self.reduce
        if isinstance(reduce, str) or reduce is None:
            reduce = (reduce,) * len(self.outputs)
        elif not reduce:
            reduce = ("sum",) * len(self.outputs)
        object.__setattr__(self, "reduce", tuple(reduce))
        self._validate()

    def _validate(self) -> None:
        if self.linear not in LINEAR_KINDS:
            raise ValueError(f"spec {self}: linear={self.linear!r}, expected one of {LINEAR_KINDS}")
        if len(self.reduce) != len(self.outputs):
            raise ValueError(f"spec {self}: {len(self.reduce)} reduce entries for "
                             f"{len(self.outputs)} outputs")
        for letters in (*self.inputs, *self.outputs):
            if letters is None:
                continue
            named = [c for c in letters if c != UNSHARDABLE]
            if len(named) != len(set(named)):
                raise ValueError(f"spec {self}: a letter repeats within {letters!r}")

    # -- parsing -----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, **flags) -> "Spec":
        """``"mk,kn->mn"``; ``-`` stands for a non-tensor output, an empty side for a
        0-d tensor (``"ab->"``: a full reduction to a scalar)."""
        if "->" not in text:
            raise ValueError(f"spec {text!r} has no '->'")
        lhs, rhs = text.replace(" ", "").split("->")
        return cls(tuple(_split_side(lhs)), tuple(_split_side(rhs)), **flags)

    # -- queries -------------------------------------------------------------------------
    def input_letters(self) -> frozenset[str]:
        cached = self.__dict__.get("_input_letters")
        if cached is None:   # specs are immutable; the engine asks this often
            cached = frozenset(c for s in self.inputs if s for c in s if c != UNSHARDABLE)
            self.__dict__["_input_letters"] = cached
        return cached

    def is_linear_input(self, index: int) -> bool:
        return self.linear != "none" and (self.linear_inputs is None or index in self.linear_inputs)

    def shardable(self, letter: str) -> bool:
        """Whether the letter may be sharded at all (divisibility is checked with sizes)."""
        if letter == UNSHARDABLE or letter in self.replicated:
            return False
        if letter in self.input_letters():
            for out, reduce in zip(self.outputs, self.reduce):
                if out is not None and letter not in out and reduce is None:
                    return False
        return True

    def __str__(self) -> str:
        side = lambda xs: ",".join("-" if x is None else x for x in xs)  # noqa: E731
        return f"{side(self.inputs)}->{side(self.outputs)}"


def pointwise_letters(shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> list[str]:
    """Right-aligned broadcasting letters: an input dim of size 1 under a larger output dim
    gets the unshardable letter, every other dim the output dim's letter."""
    names = _letters(len(out_shape))
    result = []
    for shape in shapes:
        offset = len(out_shape) - len(shape)
        result.append("".join(
            UNSHARDABLE if size == 1 and out_shape[offset + i] != 1 else names[offset + i]
            for i, size in enumerate(shape)))
    return result


def _letters(n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    if n > len(alphabet):
        raise ValueError(f"a spec cannot letter {n} dims")
    return alphabet[:n]


def letters(n: int, start: int = 0) -> str:
    """``n`` distinct letters, from position ``start`` of the alphabet."""
    return _letters(start + n)[start:]


__all__ = ["Spec", "UNSHARDABLE", "pointwise_letters", "letters", "LINEAR_KINDS"]

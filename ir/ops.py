"""The op table: what an IR op target is, read alike by planning and by the runtime.

A target is data (``aten.mm.default``, ``autopar.vocab_embedding``, ``optim.adam``). This
module is the one place that turns it into what runs it and what is known about it:

* ``op_info(target)``: the kernel, the schema, and the traits passes ask about — draws
  random numbers, mutates an input or global state, returns a view, is pointwise — read
  from the ATen schema and tags, or declared where an ``autopar.*`` / ``optim.*`` kernel is
  defined (``ir/kernels/``, registered with ``@kernel`` when this module loads);
* ``schema_args(op)``: an op's arguments by schema name, with the schema default for every
  argument the call omitted (an omitted argument always means its default);
* ``draws_random(op)``: whether this call consumes the generator (a random kernel called
  with ``dropout_p=0``, given or by default, does not).

A target with no entry fails naming the op and this table.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .core import Op

__all__ = ["Batched", "OpInfo", "kernel", "op_info", "resolve", "schema_args",
           "draws_random", "target_name", "UnknownOpError"]


class UnknownOpError(KeyError):
    """A target that is neither an operator torch knows nor a kernel of ``ir/kernels``."""


@dataclass(frozen=True)
class Batched:
    """A list-taking form of a kernel: a run of ops of one target that share the arguments
    at ``shared`` positions (one optimizer param group) becomes one call taking lists at
    the other positions, as ``optimizer.step()`` updates a whole param group at once."""

    kernel: Callable
    shared: frozenset[int]


@dataclass(frozen=True)
class OpInfo:
    target: str
    kernel: Callable
    schema: torch.FunctionSchema | None   # None: an autopar kernel (plain Python)
    random: bool       # may draw from the generator (see ``draws_random`` for one call)
    mutates: bool      # writes an input in place, or global state
    view: bool         # a result aliases an input it does not write
    pointwise: bool
    batched: Batched | None = None

    @property
    def effectful(self) -> bool:
        """Whether running it matters beyond its results: dropping it would change state
        or the random stream."""
        return self.random or self.mutates


_DECLARED: dict[str, OpInfo] = {}


def kernel(target: str, *, random: bool = False, mutates: bool = False,
           batched: Callable | None = None, shared: Iterable[int] = ()
           ) -> Callable[[Callable], Callable]:
    """Declare the kernel of an ``autopar.*`` / ``optim.*`` target with its traits."""
    def register(fn: Callable) -> Callable:
        if target in _DECLARED:
            raise ValueError(f"kernel for {target!r} registered twice")
        _DECLARED[target] = OpInfo(target, fn, None, random, mutates, False, False,
                                   Batched(batched, frozenset(shared)) if batched else None)
        return fn
    return register


@functools.lru_cache(maxsize=None)
def op_info(target: str) -> OpInfo:
    """Everything the table knows about ``target``."""
    if target in _DECLARED:
        return _DECLARED[target]
    overload = _overload(target)
    schema, tags = overload._schema, overload.tags
    returns_alias = any(r.alias_info is not None and not r.alias_info.is_write
                        for r in schema.returns)
    return OpInfo(target, overload, schema,
                  random=torch.Tag.nondeterministic_seeded in tags,
                  mutates=schema.is_mutable, view=returns_alias,
                  pointwise=torch.Tag.pointwise in tags)


def _overload(target: str) -> torch._ops.OpOverload:
    namespace, _, rest = target.partition(".")
    opname, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError) as exc:
        raise UnknownOpError(
            f"no kernel for op {target!r}: not an operator torch knows and not a kernel of "
            "autopar/ir/kernels/ (the op table, autopar.ir.ops)") from exc


def resolve(target: str) -> Callable:
    """The callable that runs ``target``."""
    return op_info(target).kernel


def target_name(overload: Any) -> str:
    """The IR target of a torch operator overload (what ``resolve`` turns back into it)."""
    if isinstance(overload, torch._ops.OpOverload):
        return f"{overload.namespace}.{overload._opname}.{overload._overloadname}"
    raise UnknownOpError(f"{overload!r} is not a torch operator overload")


def _positional_names(schema: torch.FunctionSchema) -> list[str]:
    return [a.name for a in schema.arguments if not a.kwarg_only]


def given_args(op: Op) -> list[tuple[str, Any]]:
    """(schema name, argument) for what the call was given, positional ones first."""
    schema = op_info(op.target).schema
    if schema is None:
        raise UnknownOpError(f"{op.target} has no schema: it is an autopar kernel")
    return list(zip(_positional_names(schema), op.args)) + list(op.kwargs.items())


def schema_args(op: Op) -> dict[str, Any]:
    """The op's arguments by schema name; an omitted one is its schema default (None for an
    omitted argument without a default)."""
    given = dict(given_args(op))
    schema = op_info(op.target).schema
    return {a.name: given[a.name] if a.name in given
            else a.default_value if a.has_default_value() else None
            for a in schema.arguments}


def draws_random(op: Op) -> bool:
    """Whether this call consumes the generator: a random target, unless its only
    randomness is a dropout probability of 0 (attention kernels called without dropout)."""
    info = op_info(op.target)
    if not info.random:
        return False
    if info.schema is None or not any(a.name == "dropout_p" for a in info.schema.arguments):
        return True
    return schema_args(op)["dropout_p"] != 0


# The autopar kernels register themselves in the table as they load.
from . import kernels  # noqa: E402,F401

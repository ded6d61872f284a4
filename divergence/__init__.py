"""Where does a plan first stop computing what one device computes? One question, two
references, one entry (``locate_divergence``):

    plan_reference   ``reference="plan"``: the plan's step on the simulator next to its own
                     global program on whole tensors, op by op (finds what parallelism
                     breaks: a placement, a reshard, a rule's local form)
    eager_reference  ``reference="eager"``: the plan's global program next to the user's
                     model run eagerly, module by module, then the loss and the gradients
                     (finds what capture and the rewriting passes break, which the plan's
                     own reference shares)

The engine hands over the planned program, the state and the feeds; the references lower
and run it themselves. Above the runtime (it runs plans) and below the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..ir import ProcessMesh, Program
from ..ir.printer import value_names
from ..lower import StatePiece, lower_program
from ..strategy import AmpConfig
from .eager_reference import EagerDivergence, compare_with_eager, run_eager
from .plan_reference import Divergence, locate_in_plan, whole_values

__all__ = ["Divergence", "EagerDivergence", "EagerModel", "REFERENCES", "locate_divergence"]

REFERENCES = ("plan", "eager")


@dataclass(frozen=True)
class EagerModel:
    """What ``reference="eager"`` runs: the user's model and loss on the batch, under the
    strategy's ``amp`` (O1 is torch.autocast; O2 has no eager counterpart)."""

    model: torch.nn.Module
    loss: Callable | None
    inputs: Any
    labels: Any
    amp: AmpConfig


def locate_divergence(program: Program, mesh: ProcessMesh | None, tensors: dict[str, Any],
                      initial: Callable[[StatePiece], torch.Tensor], feeds: dict[str, Any],
                      seed: int, *, reference: str = "plan", rtol: float = 1e-4,
                      atol: float = 1e-5, eager: EagerModel | None = None
                      ) -> Divergence | EagerDivergence | None:
    """The first divergence of one training step of ``program`` (planned on ``mesh``) from
    the ``reference``, or None. ``tensors``: the state's whole values by name (not
    changed); ``initial`` makes those it lacks (optimizer states a first step creates);
    ``seed``: the step's random stream. ``rtol``/``atol`` judge the plan reference; the
    eager one judges each value at its dtype's ``torch.testing`` tolerance."""
    if reference not in REFERENCES:
        raise ValueError(f"locate_divergence: reference={reference!r} is not 'plan' (the "
                         "plan's own program on one device) or 'eager' (the model run "
                         "eagerly)")
    if reference == "eager":
        _check_eager(eager)
    lowered = lower_program(program, mesh, None, None)
    state = dict(tensors)
    for name, piece in next(iter(lowered.processes.values())).state.items():
        if name not in state and piece.const is None:
            state[name] = initial(piece)
    if reference == "plan":
        return locate_in_plan(lowered, feeds, state, seed=seed, rtol=rtol, atol=atol)
    amp = eager.amp
    run = run_eager(eager.model, eager.loss, eager.inputs, eager.labels, seed,
                    getattr(torch, amp.dtype) if amp.is_enabled else None)
    values = whole_values(lowered, feeds, state, seed)
    return compare_with_eager(lowered.program, values, run, value_names(lowered.program))


def _check_eager(eager: EagerModel | None) -> None:
    if eager is None:
        raise ValueError("locate_divergence(reference='eager') needs the model to run eagerly")
    amp = eager.amp
    if amp.is_enabled and amp.level != "O1":
        raise ValueError(f"locate_divergence(reference='eager'): amp level {amp.level} "
                         "casts the parameters themselves, which eager torch has no "
                         "counterpart of; compare under level O1 (torch.autocast)")

"""Loss scaling's check-and-unscale (``passes/scale_loss.py``): one pass over a gradient says
whether it holds an inf or nan and gives it divided by the loss scale.

``autopar.unscale_checked(grad, inv_scale) -> (unscaled, found)`` runs GradScaler's own
kernel, ``torch._amp_foreach_non_finite_check_and_unscale_``, on a copy of the gradient (the
IR's values are never written in place): ``unscaled`` is ``grad * inv_scale`` exactly as
``GradScaler.unscale_`` writes it, ``found`` 1.0 where the *scaled* gradient holds an inf or
nan, else 0.0 (float32, like GradScaler's ``found_inf``). One flag per gradient, so a
gradient's flag is the same whichever rank or pipeline stage checks it.
"""
from __future__ import annotations

import torch

from ..ops import kernel


@kernel("autopar.unscale_checked")
def unscale_checked(grad: torch.Tensor, inv_scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    unscaled = grad.clone()
    found = torch.zeros((), dtype=torch.float32, device=grad.device)
    torch._amp_foreach_non_finite_check_and_unscale_([unscaled], found, inv_scale)
    return unscaled, found

"""Loss scaling for float16 training, as ``torch.amp.GradScaler`` does it, across the ranks.

float16 gradients underflow; GradScaler multiplies the loss by a scale before
the backward, divides the gradients by it before the optimizer, skips a step
whose gradients hold an inf or NaN (and halves the scale), and doubles the
scale after 2000 steps without one. In a pipeline the whole model must agree:

* one scale for the whole pipeline: every rank holds the same value and updates
  it by the same rule from the same verdict, so they never drift apart;
* the loss rank starts each micro-batch's backward from the scale (the
  gradient of the loss is ``scale``, as for ``scaler.scale(loss).backward()``;
  ``scale / k`` when accumulating over k calls, :mod:`orgel.runtime.optimizer`),
  so every gradient that crosses between ranks is scaled, as in one process;
* after the gradient sums every rank unscales its gradients with GradScaler's
  own kernel, and the inf/NaN verdict is summed over all ranks in the step's
  closing all-reduce: every rank skips the same steps;
* gradients are unscaled once, at the optimizer step, before clipping; the
  scale and its growth counter are saved in the checkpoint shard and restored
  with it.
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    """One rank's copy of the pipeline's loss scale (GradScaler's defaults)."""

    def __init__(self, device: torch.device, *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.device = device
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def unscale_(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Divide every gradient by the scale in place; 1.0 if one holds an inf or NaN here.

        A DTensor gradient (tensor parallelism, FSDP) is unscaled in its local part: the
        fused kernel takes plain tensors, and each rank checks its own part."""
        from orgel.runtime.sharding import own_part

        found = torch.zeros((), dtype=torch.float32, device=self.device)
        inv_scale = self.scale.double().reciprocal().float()
        groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
        for p in {id(p): p for p in params}.values():  # each object once
            if p.grad is not None:
                grad = own_part(p.grad)
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for grads in groups.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        return found

    def update(self, found_inf: bool) -> None:
        """Back off after a skipped step; grow after ``growth_interval`` good ones."""
        flag = torch.full((), 1.0 if found_inf else 0.0, dtype=torch.float32, device=self.device)
        torch._amp_update_scale_(self.scale, self.growth_tracker, flag, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))

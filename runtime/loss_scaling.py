"""Dynamic loss scaling for fp16 training.

Under fp16 autocast, activation gradients below fp16's smallest subnormal (6e-8) flush to zero, so
small updates are lost; bf16 has fp32's exponent range and needs none. The loss is multiplied by a
scale before backward, and the gradients divided by it before the step. A step whose gradients
overflowed (a non-finite global norm) is skipped and the scale halved; after `growth_interval` finite
steps in a row it doubles. The constants are torch.amp.GradScaler's defaults (init_scale 2**16,
growth_factor 2, backoff_factor 0.5, growth_interval 2000; PyTorch's AMP documentation).

What it costs: nothing beyond the clip's work. The overflow check is the global gradient norm the
clip computes anyway (one scalar all-reduce over every rank, so all of them skip the same steps), and
the division folds into the clip's scaling, which the fused optimizer applies in its own kernel
(`runtime.optimizer.defer_gradient_scale`). Under fp16 the norm is computed even without clipping,
as the cost model and the ledger price a step (`cost_models.optimizer`, `cost_models.collectives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LossScale:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    finite_in_a_row: int = 0
    skipped_steps: int = 0  # in all, for the user's log

    def update(self, unscaled_norm: float) -> bool:
        """Whether the step may run, given its gradients' global norm (unscaled); moves the scale."""
        if not math.isfinite(unscaled_norm):
            self.scale *= self.backoff_factor
            self.finite_in_a_row = 0
            self.skipped_steps += 1
            return False
        self.finite_in_a_row += 1
        if self.finite_in_a_row == self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_in_a_row = 0
        return True


def loss_scale_for(precision: str) -> LossScale | None:
    """A fresh dynamic loss scale where `precision` needs one (fp16), else None."""
    return LossScale() if precision == "fp16" else None


def scaled_loss(loss_fn, owner):
    """`loss_fn` whose result is multiplied, in fp32, by `owner.loss_scale`'s current scale, read at each
    call (for pipeline schedules, which call the loss and run backward themselves; None: unscaled)."""
    def scaled(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        scale = owner.loss_scale
        return loss if scale is None else loss.float() * scale.scale

    return scaled

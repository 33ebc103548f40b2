"""Dynamic loss scaling for fp16 training.

Under fp16 autocast, activation gradients below fp16's smallest subnormal (6e-8) flush to zero, so
small updates are lost; bf16 has fp32's exponent range and needs none. The loss is multiplied by a
scale before backward, and the gradients divided by it before the step. A step whose gradients
overflowed (a non-finite global norm) is skipped and the scale halved; after `growth_interval` finite
steps in a row it doubles. The constants are torch.amp.GradScaler's defaults (init_scale 2**16,
growth_factor 2, backoff_factor 0.5, growth_interval 2000; PyTorch's AMP documentation).

What it costs: nothing beyond the clip's work, and the host does not wait for the norm before it
queues the step. The overflow check is the global gradient norm the clip computes anyway (one scalar
all-reduce over every rank, so all of them skip the same steps), and the division folds into the
clip's scaling, which the fused optimizer applies in its own kernel
(`runtime.optimizer.defer_gradient_scale`). The scale, its count of finite steps and the skipped
steps live on the device: whether a step overflowed goes to torch's fused Adam or AdamW as its
found-inf flag, which skips the update there, and the scale moves by `torch._amp_update_scale_`, as
GradScaler does. With other optimizers (SGD, the foreach AdamW of CPU runs) the host reads the flag
and skips the step itself. (The step still ends with the host reading the loss, and under offload
the flag is copied to the host optimizer.) Under fp16 the norm is computed even without clipping, as
the cost model and the ledger price a step (`cost_models.optimizer`, `cost_models.collectives`).
"""

from __future__ import annotations

import torch

FIELDS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "finite_in_a_row", "skipped_steps")


class LossScale:
    """The scale and its counters as 0-dim device tensors; the properties read them on the host (a
    synchronization: for logs and checkpoints, not for every step)."""

    def __init__(self, device: torch.device | str = "cpu", scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.factor = torch.full((), scale, dtype=torch.float32, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)  # finite steps in a row
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # in all, for the user's log

    def update(self, found_inf: torch.Tensor) -> None:
        """Move the scale after a step whose overflow flag is `found_inf` (1.0: overflowed, 0.0: finite)."""
        found_inf = found_inf.to(device=self.factor.device, dtype=torch.float32)
        torch._amp_update_scale_(self.factor, self.growth_tracker, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.skipped += found_inf.to(torch.int64)

    @property
    def scale(self) -> float:
        return float(self.factor)

    @scale.setter
    def scale(self, value: float) -> None:
        self.factor.fill_(value)  # in place: a pipeline's loss reads this tensor

    @property
    def finite_in_a_row(self) -> int:
        return int(self.growth_tracker)

    @finite_in_a_row.setter
    def finite_in_a_row(self, value: int) -> None:
        self.growth_tracker.fill_(value)

    @property
    def skipped_steps(self) -> int:
        return int(self.skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.skipped.fill_(value)

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def load_state_dict(self, state: dict) -> None:
        for name in FIELDS:
            if name in state:
                setattr(self, name, state[name])


def overflowed(norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the (unscaled) global norm is not finite, else 0.0: the step's found-inf flag, on the device."""
    return (~torch.isfinite(norm)).to(torch.float32)


def loss_scale_for(precision: str, device: torch.device | str = "cpu") -> LossScale | None:
    """A fresh dynamic loss scale where `precision` needs one (fp16), else None."""
    return LossScale(device) if precision == "fp16" else None


def scaled_loss(loss_fn, owner):
    """`loss_fn` whose result is multiplied, in fp32, by `owner.loss_scale`'s current scale, read at each
    call (for pipeline schedules, which call the loss and run backward themselves; None: unscaled)."""
    def scaled(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        scale = owner.loss_scale
        return loss if scale is None else loss.float() * scale.factor

    return scaled

"""The optimizer step on the device, per implementation: HBM bytes per parameter, counted pass by
pass in torch's own code (torch/optim/adam.py at 2.13; AdamW is Adam with decoupled weight decay).

- `fused` (`AdamW(fused=True)`, the runtime's on CUDA): one kernel reads the fp32 weight, gradient
  and two moments and writes weight and moments: 16 + 12 = 28 bytes.
- `foreach` (torch's default, `_multi_tensor_adam`): weight decay (read and write the weight, 8),
  `lerp_` of the first moment (read moment and gradient, write moment, 12), `mul_` of the second
  (8), `addcmul_` into it (read it and the gradient twice, write it, 16), `sqrt` into a new list (8),
  `div_` and `add_` on that list (8 + 8), `addcdiv_` into the weight (read weight, moment and list,
  write weight, 16): 84 bytes, and a temporary the size of the fp32 moments while it runs.
- Gradient clipping (the runtime's `clip_grad_norm_`): foreach norms read every gradient (4 bytes);
  the fused step then applies the scale in its own kernel (`runtime.optimizer.defer_gradient_scale`),
  while before a foreach step a scaling pass reads and writes every gradient (8 more): 4 and 12.
- `apex` (a what-if: apex's FusedAdam, Megatron-LM's and DeepSpeed's optimizer): the fused kernel's
  28 bytes, with the clip's 12 (its multi-tensor scale is a pass of its own).
Bf16 moments (`optimizer_state=bf16`) move 2 bytes less per moment access: 4 accesses fused, 8
foreach. Checked, not fitted: on an H100 (3.35 TB/s at η_memory 0.85) foreach − fused for GPT-1.3B
(1.316e9 parameters) is (84 − 28) bytes x 1.316e9 / 2.85e12 = 25.9 ms, measured 26.6 ms (vocabulary
50,257) and 21.3 ms (50,304) in plain PyTorch (../shared/gpu/h100-2026-11-26.json, step anatomy).
"""

from __future__ import annotations

STEP_BYTES_PER_PARAM = {"fused": 28, "foreach": 84, "apex": 28}
MOMENT_ACCESSES = {"fused": 4, "foreach": 8, "apex": 4}
CLIP_BYTES_PER_PARAM = {"fused": 4, "foreach": 12, "apex": 12}
# foreach's `sqrt` list: one fp32 tensor per parameter, alive through the step's last passes.
TEMPORARY_BYTES_PER_PARAM = {"fused": 0, "foreach": 4, "apex": 0}


def step_bytes_per_param(implementation: str = "fused", optimizer_state: str = "fp32", clip: bool = True) -> float:
    """HBM traffic of one optimizer step (and the gradient clipping before it) per parameter."""
    moments = MOMENT_ACCESSES[implementation] * (2 if optimizer_state == "bf16" else 0)
    return STEP_BYTES_PER_PARAM[implementation] - moments + (CLIP_BYTES_PER_PARAM[implementation] if clip else 0)


def temporary_bytes_per_param(implementation: str = "fused") -> float:
    """Device memory the step allocates beside the model states, per parameter it updates."""
    return TEMPORARY_BYTES_PER_PARAM[implementation]

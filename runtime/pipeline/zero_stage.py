"""Pipeline stages that run the plan's ZeRO stage, not torch's one choice for every FSDP stage.

torch's `PipelineStage` tells an FSDP2 stage before every micro-batch's backward to keep its weights
gathered and its gradients unreduced, and reduce-scatters them once after the last one
(`perform_reduce_grad`): ZeRO 1's traffic and memory whatever the units were built with. This
stage lets it do so, then sets what the plan's ZeRO stage says instead
(`runtime.data_parallel.pipeline_microbatch_flags`): ZeRO 2 reduce-scatters every micro-batch so
only gradient shards persist; ZeRO 3 frees the gathered weights after every backward (and,
built with `reshard_after_forward`, after every forward), gathering them again for each use, its
gradients still reduced once per step. `cost_models.collectives` prices exactly these.
"""

from __future__ import annotations

import contextlib

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from autopar.runtime.data_parallel import pipeline_microbatch_flags

_SETTERS = ("set_requires_gradient_sync", "set_reshard_after_backward")


class ZeroPipelineStage(PipelineStage):
    """A `PipelineStage` whose FSDP2 units sync and reshard per micro-batch as ZeRO `zero` says."""

    def __init__(self, *args, zero: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.zero = zero

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        module = self.submod
        if not isinstance(module, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        sync, reshard = pipeline_microbatch_flags(self.zero)
        module.set_requires_gradient_sync(sync)
        module.set_reshard_after_backward(reshard)
        with _setters_ignored(module):  # torch's stage would set its own (no sync, keep gathered) here
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


@contextlib.contextmanager
def _setters_ignored(module: FSDPModule):
    """The module's gradient-sync and reshard-after-backward setters do nothing inside (instance
    attributes shadow the class's methods; removed on the way out)."""
    for name in _SETTERS:
        object.__setattr__(module, name, _ignore)
    try:
        yield
    finally:
        for name in _SETTERS:
            object.__delattr__(module, name)


def _ignore(*args, **kwargs) -> None:
    return None

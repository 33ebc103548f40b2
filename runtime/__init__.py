"""Plan execution on torch.distributed: one module or subpackage per concern, composed by `parallelize`.

mesh (DeviceMesh and this rank's stages), tensor_parallel/ (TP/SP: module rules or DTensor),
context_parallel (sequence shards: ring and Ulysses attention), expert_parallel, data_parallel (dp
gradient sync, FSDP2 for ZeRO 1-3), pipeline/ (stages and schedules), recompute, precision, init
(sharding-independent initialization of local shards), parallelize (the composition and the step).
Around the step: data/ (token datasets and the dp loader), checkpoint/ (save and load under any
plan), training_loop, launch.
"""

from autopar.runtime.parallelize import ParallelModel, parallelize

__all__ = ["ParallelModel", "parallelize"]

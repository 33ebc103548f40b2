"""Tensor (and sequence) parallelism: the plan's per-parameter tp placements realized on a model.

Two realizations, tried by dry runs before anything runs: module_rules (Megatron-style column/row
parallel blocks, sp, the vocabulary-parallel head; the static placement check) and dtensor (DTensor
through the model's own forward; dtensor_rules registers the sharding rules it needs on CPU).
dry_run runs a planned layout on fake tensors and records its collectives, realization
(`TensorParallelRealizer`) picks the realization a plan runs with, autocast keeps the tp
collectives in the low precision under autocast.

The rest of the runtime and the API import from the modules (nothing is re-exported here):
module_rules' `apply_tensor_parallel`, `check_tp_placements`, `plan_refusal`, `tp_placement`,
`default_head_path`; realization's `capabilities_for` (the capability table, dry runs included);
dtensor's `step_context`.
"""

"""Checkpoints: save and load a `ParallelModel` and its optimizer under any plan, safely.

checkpointer (`Checkpointer`: save, publish, resume, verify), state (the plan-independent state dict
and each rank's expected write bytes), reader (DCP reading that refuses unsafe or damaged files),
files (on-disk layout, manifests and digests) and cost (the predicted save time, gathered over ranks).

The rest of the runtime and the CLI import from the modules themselves (nothing is re-exported here):
`checkpointer.Checkpointer`, `CheckpointError`, `check_writable_directory`, `verify_checkpoint`;
`cost.predict_save` (the training loop); `files.sha256_bytes_per_s` (the report).
"""

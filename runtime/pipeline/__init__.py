"""Pipeline parallelism: the model cut into stages where the plan's units sit, run by schedules.

split cuts the model's captured program (`runtime.model_program`) into stage graphs, each node on
the stage of its layer or unit, with what crosses each cut; schedule builds the stage modules
from the split (`cut_pipeline`), checks they cover the model, and runs them with
torch.distributed.pipelining schedules (`build_schedule`, `microbatch_inputs`).

The rest of the runtime and the API import from the modules (nothing is re-exported here):
schedule's `cut_pipeline`, `build_schedule`, `check_stage_cover`, `microbatch_inputs`,
`tied_gradient_groups` (parallelize) and `pipeline_refusal` (the capability table).
"""

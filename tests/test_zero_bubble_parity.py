"""Parity: torch's zero-bubble schedules (the backward split into input- and weight-gradient passes,
Qi et al., ICLR 2024) train autopar's captured stages like one process (fp32, gloo, 2 processes).

interleaved_zb over vp = 1 (ZB-H1) and vp = 2 loop-placed chunks, and zbv's V (rank 0 holds the first and
the last stage, so the tied embedding and head sum no gradient across ranks): every loss matches the
single-process reference to relative 1e-5, the gathered weights to 1e-5, and each rank's collectives in
a step are those the plan predicted (`test_runtime_parity._check`).
"""

from __future__ import annotations

from parity_harness import batches, make_plan, reference_run, run_plans, tiny_config
from test_runtime_parity import _check

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16

ZERO_BUBBLE_GPT = [
    dict(dp=1, tp=1, pp=2, schedule="interleaved_zb", vp=1, microbatch=2),
    dict(dp=1, tp=1, pp=2, schedule="interleaved_zb", vp=2, microbatch=2),
    dict(dp=1, tp=1, pp=2, schedule="zbv", vp=2, microbatch=2),
]


def test_zero_bubble_schedules_match_one_process():
    overrides = tiny_config()
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plans = [make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH) for strategy in ZERO_BUBBLE_GPT]
    zbv = plans[-1]
    assert [stage.device_ids for stage in zbv.stages] == [[0], [1], [1], [0]]  # the V: stages 0 and 3 on rank 0
    jobs = [dict(plan=plan.to_json(), model="gpt", overrides=overrides, data=data) for plan in plans]
    results = run_plans(2, jobs)
    losses, state = reference_run("gpt", overrides, data)
    for strategy, plan, ranks in zip(ZERO_BUBBLE_GPT, plans, results):
        _check(strategy, plan, ranks, losses, state)

"""Checkpoint cost: the save-time model and Young/Daly's interval (hand-computed values), each rank's
expected share of a checkpoint under dp, ZeRO-3 and tp (the shares add up to the one-process
checkpoint, and match the bytes DCP writes), and `autopar run` printing measured beside predicted."""

from __future__ import annotations

import io
import math
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
import torch.distributed as dist

from parity_harness import SEED, make_plan, run_plans, tiny_config

GLOBAL_BATCH = 8


def test_save_time_is_the_busiest_nodes_write_plus_the_largest_ranks_hash():
    from autopar.cost_models.checkpoint import save_time_s

    per_rank = [4e9, 4e9, 1e9, 1e9]  # two nodes of two ranks: node 0 writes 8 GB, node 1 writes 2 GB
    assert save_time_s(per_rank, 2, node_storage_write_bytes_per_s=2e9, hash_bytes_per_s=1e9) == pytest.approx(4 + 4)
    assert save_time_s(per_rank, 4, node_storage_write_bytes_per_s=2e9, hash_bytes_per_s=1e9) == pytest.approx(5 + 4)
    with pytest.raises(ValueError):
        save_time_s(per_rank, 0, 1e9, 1e9)


def test_young_daly_interval_and_the_llama3_failure_rate():
    from autopar.cost_models.checkpoint import (checkpoint_every_steps, checkpoint_interval_s,
                                                mean_time_between_failures_s)

    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs = one per 3.09 h on all of them
    assert mean_time_between_failures_s(16_384) / 3600 == pytest.approx(54 * 24 / 419)
    assert mean_time_between_failures_s(8) == pytest.approx(2048 * mean_time_between_failures_s(16_384))
    # C = 60 s, M = 24 h: Young sqrt(2 C M) = 3,220 s; Daly 3,220 * (1 + sqrt(C/2M)/3 + C/2M/9) - 60
    save, mtbf = 60.0, 86_400.0
    young = math.sqrt(2 * save * mtbf)
    ratio = save / (2 * mtbf)
    assert checkpoint_interval_s(save, mtbf) == pytest.approx(young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save)
    assert checkpoint_interval_s(save, mtbf) == pytest.approx(3180.1, abs=0.1)
    assert checkpoint_interval_s(2 * mtbf, mtbf) == mtbf  # saving takes longer than failures allow
    assert checkpoint_every_steps(save, 2.0, mtbf) == 1590
    assert checkpoint_every_steps(save, 1e6, mtbf) == 1


@pytest.fixture(scope="module")
def world_of_one():
    yield make_plan("gpt", tiny_config(), dict(dp=1, tp=1, pp=1, zero=0, microbatch=8), 1, GLOBAL_BATCH).to_json()
    if dist.is_initialized():
        dist.destroy_process_group()


def _build(plan_json: str):
    from test_checkpoint import _build as build_with

    return build_with(plan_json, "adamw")


def _step(parallel, optimizer) -> None:
    batch = torch.randint(0, tiny_config()["vocab"], (GLOBAL_BATCH, tiny_config()["seq_len"]),
                          generator=torch.Generator().manual_seed(0))
    parallel.train_step(batch, optimizer)


def test_a_ranks_share_counts_adams_state_before_it_exists_and_matches_the_files(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer
    from autopar.runtime.checkpoint.reader import read_safe_metadata
    from autopar.runtime.checkpoint.state import expected_write_bytes

    parallel, optimizer = _build(world_of_one)
    params = list(parallel.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    before = expected_write_bytes(parallel, optimizer)
    assert before == 3 * param_bytes  # weights, exp_avg, exp_avg_sq
    _step(parallel, optimizer)
    after = expected_write_bytes(parallel, optimizer)
    assert after == 3 * param_bytes + 4 * len(params)  # and one fp32 step count per parameter
    Checkpointer(tmp_path).save(1, parallel, optimizer, {})
    checkpoint = tmp_path / "step-00000001"
    written = sum(p.stat().st_size for p in checkpoint.glob("*.distcp"))
    entries = len(read_safe_metadata(checkpoint).state_dict_metadata)
    assert after <= written <= after + 2048 * entries, (after, written, entries)  # a small header per tensor


def _shares_job(job: dict) -> dict:
    from autopar.runtime.checkpoint.state import expected_write_bytes

    parallel, optimizer = _build(job["plan"])
    _step(parallel, optimizer)
    return {"bytes": expected_write_bytes(parallel, optimizer)}


def test_shares_of_the_ranks_add_up_to_the_one_process_checkpoint_under_dp_zero3_and_tp(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.state import expected_write_bytes

    parallel, optimizer = _build(world_of_one)
    _step(parallel, optimizer)
    whole = expected_write_bytes(parallel, optimizer)
    strategies = [dict(dp=2, tp=1, pp=1, zero=0, microbatch=4), dict(dp=2, tp=1, pp=1, zero=3, microbatch=4),
                  dict(dp=1, tp=2, pp=1, zero=0, microbatch=8)]
    jobs = [dict(plan=make_plan("gpt", tiny_config(), s, 2, GLOBAL_BATCH).to_json()) for s in strategies]
    results = run_plans(2, jobs, runner=_shares_job, outdir=tmp_path)
    for strategy, ranks in zip(strategies, results):
        shares = [rank["bytes"] for rank in ranks]
        # the step counts are plain tensors on every rank: counted once in all, whatever the plan
        assert sum(shares) == pytest.approx(whole, abs=8 * len(list(parallel.parameters()))), (strategy, shares)
        assert max(shares) <= 0.6 * whole, (strategy, shares)  # spread over both ranks, not all on one


def test_run_prints_the_predicted_save_time_the_interval_and_each_measured_save(tmp_path, monkeypatch):
    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["run", "--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=257,seq_len=32",
                     "--cluster", "local", "--global-batch", "8", "--steps", "4", "--checkpoint-dir",
                     str(tmp_path / "ck"), "--checkpoint-every", "2", "--log-every", "2"])
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    cost = [line for line in lines if line.startswith("checkpoint cost: predicted ")]
    assert len(cost) == 1 and "Young/Daly suggests a checkpoint every" in cost[0] and "--checkpoint-every" in cost[0]
    saves = [line for line in lines if line.startswith("saved checkpoint ")]
    assert len(saves) == 2 and all(" s (predicted " in line for line in saves), saves

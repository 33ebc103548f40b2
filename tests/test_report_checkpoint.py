"""Checkpoint cost in `autopar plan`'s report (issue #19 item 4): the bytes each GPU saves agree with
what the runtime counts for the same plan, the save time and the suggested --checkpoint-every are
cost_models/checkpoint.py's for those bytes, and every renderer shows them."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

import autopar
from autopar.cost_models import checkpoint as cost
from autopar.models import build_model
from autopar.report import build_report, load_report, render_html, render_text

TINY = "layers=4,hidden=32,heads=4,vocab=257,seq_len=32"


def _plan(cluster, gpus: int, strategy: str, global_batch: int = 8):
    spec = build_model("gpt", TINY)
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="fp32",
                          cluster=autopar.load_cluster(cluster, gpus=gpus), global_batch=global_batch,
                          strategy=strategy, use_ilp=False)
    assert result.fits
    return spec, result


def test_one_process_plan_predicts_the_bytes_the_runtime_will_write():
    """A world-1 plan: the report's share is what `autopar run` counts for that plan before it saves
    (runtime/checkpoint/state.expected_write_bytes, which tests/test_checkpoint_cost.py checks against
    the files DCP writes)."""
    import torch

    from autopar.runtime.checkpoint.state import expected_write_bytes

    spec, result = _plan("local", None, "dp=1")
    predicted = result.summary().checkpoint
    had_group = dist.is_initialized()
    try:
        parallel = autopar.parallelize(spec.module, result.plan, loss_fn=spec.loss_fn, seed=0)
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
        assert predicted.bytes_per_rank == [expected_write_bytes(parallel, optimizer)]
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    assert predicted.checkpoint_bytes == 12 * sum(p.numel() for p in spec.module.parameters())


def test_pipeline_ranks_share_by_their_stages_parameters_and_the_interval_follows_young_daly():
    spec, result = _plan("dgx-h100", 8, "pp=2,dp=2,tp=2,microbatch=1,zero=1,schedule=1f1b,vp=1")
    report = build_report(result.search, model="gpt", cluster=result.cluster, global_batch=8, seq_len=32, fixed={},
                          precision="fp32", plan=result.plan, hash_bytes_per_s=1e9)
    checkpoint = report.checkpoint
    modules = dict(spec.module.named_modules())
    expected = []
    for rank in range(2):  # a rank's unique parameters (tied ones where first listed), over its dp x tp GPUs
        seen = {id(p) for stage in result.plan.stages[:rank] for path in stage.module_paths
                for p in modules[path].parameters()}
        params = {id(p): p.numel() for path in result.plan.stages[rank].module_paths
                  for p in modules[path].parameters() if id(p) not in seen}
        expected.append(12 * sum(params.values()) / 4)
    assert checkpoint.bytes_per_rank == pytest.approx(expected)
    assert checkpoint.checkpoint_bytes == 12 * sum(p.numel() for p in spec.module.parameters())
    # 8 GPUs on one node: the node writes the whole checkpoint; the largest share is hashed
    assert checkpoint.busiest_node_bytes == pytest.approx(checkpoint.checkpoint_bytes)
    save_s = checkpoint.checkpoint_bytes / 50e9 + max(expected) / 1e9
    assert checkpoint.save_time_s == pytest.approx(save_s)
    mtbf_s = 3600 / (8 * 419 / (54 * 24 * 16_384))
    assert checkpoint.mtbf_s == pytest.approx(mtbf_s)
    young = math.sqrt(2 * save_s * mtbf_s)  # Daly's correction is tiny for C << M
    assert checkpoint.interval_s == pytest.approx(young, rel=0.01)
    step_s = report.predicted.step_time_s
    assert checkpoint.checkpoint_every == cost.checkpoint_every_steps(save_s, step_s, mtbf_s) > 1
    assert "fixed cost per save" in checkpoint.leaves_out


def test_every_renderer_shows_it_and_the_json_keeps_it(tmp_path):
    _, result = _plan("dgx-h100", 2, "dp=2")
    report = result.summary()
    text = render_text(report)
    assert "checkpoint\n  save " in text and f"--checkpoint-every {report.checkpoint.checkpoint_every:,}" in text
    assert "not priced: a fixed cost per save" in text
    html = render_html(report)
    assert 'id="checkpoint-cost"' in html and "Young/Daly" in html
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report.model_dump(mode="json")))
    assert load_report(path).checkpoint == report.checkpoint
    older = report.model_dump(mode="json")
    del older["checkpoint"]  # a report saved before the field existed still loads
    path.write_text(json.dumps(older))
    assert load_report(path).checkpoint is None and "checkpoint\n" not in render_text(load_report(path))

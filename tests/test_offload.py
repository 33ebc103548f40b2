"""Optimizer-state offload (`offload=optimizer`, issue #20 item 3): costing, search, plan, what-if, runtime.

On CPU/gloo FSDP2's CPUOffloadPolicy moves nothing (every tensor is on the host already), so the
runtime test shows the data path: the policy is applied, training matches one process and the
collectives that execute are the plan's ledger.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.cost_models import offload as offload_cost_model
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.facts import model_facts
from autopar.cost_models.memory import state_bytes_per_param
from autopar.errors import AutoparError
from autopar.graph.capture import trace
from autopar.models import build_model
from autopar.plan_schema import Strategy, load_plan

from parity_harness import batches, make_plan, reference_run, run_job, run_plans, tiny_config
from test_runtime_parity import GLOBAL_BATCH, SEQ, STEPS, _check

SMALL = dict(layers=4, hidden=256, heads=8, vocab=512, seq_len=64)  # 3.3M parameters


@pytest.fixture(scope="module")
def small_facts():
    spec = build_model("gpt", SMALL)
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16", name="small")
    return model_facts(graph, heads=8, vocab=512)


def _strategy(**keys) -> Strategy:
    base = dict(dp=2, tp=1, pp=1, zero=1, microbatch=2, num_microbatches=2)
    return Strategy(**{**base, **keys})


def test_offload_moves_optimizer_states_from_device_to_host(small_facts):
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    kept = evaluate(small_facts, cluster, _strategy(), 8)
    moved = evaluate(small_facts, cluster, _strategy(offload="optimizer"), 8)
    before, after = kept.memory[0], moved.memory[0]
    assert before.optimizer_states > 0 and after.optimizer_states == 0
    # ZeRO 1 keeps its gathered weights and unsharded gradients on the device
    assert (after.parameters, after.gradients, after.activations) == (before.parameters, before.gradients,
                                                                       before.activations)
    shard = small_facts.num_params / 2  # the rank's optimizer shard over dp=2
    per = state_bytes_per_param("bf16")
    assert before.optimizer_states == pytest.approx(shard * per.optimizer)
    # host: fp32 weight + gradient + two moments per shard parameter, for every GPU of the node
    assert moved.host_memory_bytes == pytest.approx(shard * 16 * cluster.gpus_per_node)
    assert kept.host_memory_bytes == 0 and moved.host_capacity_bytes == pytest.approx(2e12 * 0.95)


def test_zero3_offload_keeps_no_sharded_state_on_the_device(small_facts):
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    memory = evaluate(small_facts, cluster, _strategy(zero=3, offload="optimizer"), 8).memory[0]
    assert memory.parameters == memory.gradients == memory.optimizer_states == 0
    assert memory.buffers > 0  # the gathered units in use and prefetched


def test_zero3_offload_buffers_add_the_prefetched_units_fp32_host_shard():
    """FSDP2 copies a unit's fp32 host shard to the device and casts it for the all-gather
    (`FSDPParam.all_gather_inputs`): 4 + 2 bytes per parameter of the shard, beside the two gathered
    16-bit units that ZeRO 3 holds without offload."""
    from autopar.cost_models.memory import OFFLOAD_STAGING_BYTES_PER_PARAM, device_memory

    unit, dp = 1.2e8, 4
    common = dict(params_on_device=1e9, largest_unit_params=unit, precision="bf16", zero=3, dp=dp,
                  activation_bytes=0.0)
    kept = device_memory(**common)
    moved = device_memory(**common, offload="optimizer")
    assert OFFLOAD_STAGING_BYTES_PER_PARAM == 6
    assert kept.buffers == pytest.approx(2 * unit * 2)
    assert moved.buffers == pytest.approx(2 * unit * 2 + unit / dp * (4 + 2))
    assert moved.margin == pytest.approx(0.05 * moved.buffers)


def test_offload_time_is_the_pcie_copies_and_the_cpu_adam_step(small_facts):
    """The step grows by the exposed PCIe copies and the CPU step, and loses the device's optimizer step."""
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    kept = evaluate(small_facts, cluster, _strategy(), 8)
    moved = evaluate(small_facts, cluster, _strategy(offload="optimizer"), 8)
    shard = small_facts.num_params / 2
    per_gpu_host_bandwidth = 614.4e9 / 2  # DDR5 of both Xeon 8480C sockets, shared by the node's 2 GPUs
    # AdamW's 28 bytes per parameter and the clipping's norm read, 4 (the fused step applies the scale)
    cpu_step = shard * (28 + 4) / (per_gpu_host_bandwidth * offload_cost_model.CPU_ADAM_EFFICIENCY)
    copy = shard * 4 / (63.0e9 * 0.70) + 10e-6  # one shard over PCIe Gen5 x16 at its measured share
    forward = sum(stage.forward_s for stage in moved.stages)
    backward = sum(stage.backward_s for stage in moved.stages)
    units = 4 + 1  # four layers and the root unit
    exposed = max(copy - forward, copy / units) + max(copy - backward, copy / units)
    assert moved.breakdown["cpu_optimizer"] == pytest.approx(cpu_step)
    assert moved.breakdown["offload_transfer"] == pytest.approx(exposed)
    assert moved.breakdown["optimizer"] == 0
    assert moved.step_time_s == pytest.approx(kept.step_time_s - kept.breakdown["optimizer"] + cpu_step + exposed)


def test_a_measured_host_rate_prices_the_cpu_step(small_facts):
    """A cluster that measured its host (`--cluster local`) prices the CPU AdamW step at that rate,
    shared by the node's GPUs, instead of the host memory bandwidth."""
    cluster = autopar.load_cluster("dgx-h100", gpus=2).model_copy(update={"host_optimizer_params_per_s": 1.5e9})
    moved = evaluate(small_facts, cluster, _strategy(offload="optimizer"), 8)
    shard = small_facts.num_params / 2
    assert moved.breakdown["cpu_optimizer"] == pytest.approx(shard * 2 / 1.5e9)


def test_the_host_rate_measured_is_the_runtimes_host_step():
    """`autopar.host_rates` times what the runtime runs on host shards: clipping to the global norm,
    then the fused CPU AdamW; the same step on the same shards gives the runtime's result."""
    from autopar.host_rates import host_optimizer_params_per_s, host_step
    from autopar.runtime.optimizer import build_optimizer, optimizer_implementation

    assert optimizer_implementation([torch.zeros(4)], offload="optimizer") == "fused"
    torch.manual_seed(0)
    start = [torch.randn(64) for _ in range(3)]
    grads = [torch.randn(64) * 5 for _ in range(3)]

    def shards():
        params = [torch.nn.Parameter(w.clone()) for w in start]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        return params

    measured = shards()
    host_step(measured, torch.optim.AdamW(measured, lr=1e-2, fused=True))
    reference = shards()
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert torch.linalg.vector_norm(torch.cat([p.grad for p in reference])) == pytest.approx(1.0, rel=1e-4)
    build_optimizer(reference, 1e-2, offload="optimizer").step()
    for ours, theirs in zip(measured, reference):
        torch.testing.assert_close(ours.grad, theirs.grad)
        torch.testing.assert_close(ours.detach(), theirs.detach())
    rate = host_optimizer_params_per_s(params=2**16, repeats=1)  # a rate, not a speed target: a loaded
    assert math.isfinite(rate) and rate > 0  # 2-core VM measured 6e5 where it measures 1e6 alone


def test_zero2_and_zero3_copy_every_micro_batch():
    assert offload_cost_model.transfers_per_step(1, 4) == (1, 1)
    assert offload_cost_model.transfers_per_step(2, 4) == (1, 4)
    assert offload_cost_model.transfers_per_step(3, 4) == (8, 4)


def test_a_plan_over_the_nodes_host_memory_does_not_fit(small_facts):
    cluster = autopar.load_cluster("dgx-h100", gpus=2).model_copy(update={"host_memory_bytes": 10**6})
    evaluation = evaluate(small_facts, cluster, _strategy(offload="optimizer"), 8)
    assert not evaluation.fits and not evaluation.fits_host
    assert all(m.total_bytes <= evaluation.capacity_bytes for m in evaluation.memory)  # the device would fit


def test_cluster_files_override_the_host_figures(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("preset: dgx-a100-80gb\nhost_link: {bandwidth_bytes_per_s: 20.0e9}\nhost_memory_bytes: 512e9\n")
    cluster = autopar.load_cluster(str(path))
    assert cluster.host_link.effective_bandwidth_bytes_per_s == 20e9  # a given bandwidth is taken as measured
    assert cluster.host_memory_bytes == 512 * 10**9
    assert cluster.host_memory_bandwidth_bytes_per_s == 409.6e9  # the preset's
    assert autopar.load_cluster("dgx-a100-80gb").host_link.name == "pcie4-x16"
    assert autopar.load_cluster("dgx-h100").host_link.name == "pcie5-x16"


# --- search: offload only when nothing fits without it ----------------------------------------------

def _tight_cluster(headroom_mib: int, host_bytes: int = 2 * 10**12):
    """One H100 whose usable memory is `headroom_mib` past the 2 GiB CUDA/NCCL reserve."""
    cluster = autopar.load_cluster("dgx-h100", gpus=1)
    gpu = cluster.gpu.model_copy(update={"memory_bytes": 2 * 2**30 + headroom_mib * 2**20})
    return cluster.model_copy(update={"gpu": gpu, "host_memory_bytes": host_bytes, "memory_headroom": 0.0})


def _plan_small(cluster, strategy=None):
    spec = build_model("gpt", SMALL)
    return autopar.plan(spec.module, spec.example_inputs(1), cluster=cluster, global_batch=4, strategy=strategy,
                        loss_fn=spec.loss_fn, name="small", seq_len=64, use_ilp=False)


def test_search_offloads_only_when_nothing_fits_without_it():
    roomy = _plan_small(_tight_cluster(4096))
    assert roomy.fits and roomy.plan.strategy.offload == "none"
    assert not any("offload" in row.label for row in roomy.why_not)
    # 3.3M parameters: 53 MB of model states with Adam, 13 MB without its states (bf16 weights, gradients)
    tight = _plan_small(_tight_cluster(30))
    assert tight.fits and tight.plan.strategy.offload == "optimizer"
    assert tight.plan.strategy.zero >= 1
    row = next(row for row in tight.why_not if row.label == "no offload (offload=none)")
    assert row.strategy.offload == "none" and row.fits is False and "nothing fits without offload" in row.reason
    text = tight.summary()
    assert text.predicted.breakdown.cpu_optimizer > 0 and text.predicted.host_memory_bytes > 0


def test_no_fit_names_the_host_memory_when_that_is_short():
    result = _plan_small(_tight_cluster(30, host_bytes=10**6))
    assert not result.fits
    reason = result.no_fit_reason()
    assert "host memory per node" in reason and "even with optimizer states offloaded" in reason


def test_offload_none_fixed_is_respected():
    result = _plan_small(_tight_cluster(30), strategy="offload=none")
    assert not result.fits and result.chosen.strategy.offload == "none"
    assert "leave offload free" in result.no_fit_reason()


# --- plan file, what-if, capability table --------------------------------------------------------

def test_offload_plan_round_trips_and_older_plans_load_without_it(tmp_path):
    result = _plan_small(_tight_cluster(30))
    path = tmp_path / "plan.json"
    result.write(plan=path)
    assert load_plan(path) == result.plan and load_plan(path).strategy.offload == "optimizer"
    data = json.loads(path.read_text())
    del data["strategy"]["offload"]  # a plan written before the field existed
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_plan(old).strategy.offload == "none"


def test_what_if_prices_offload_from_the_strategy_flag(capsys):
    code = main(["plan", "--model", "gpt", "--model-config", "layers=4,hidden=256,heads=8,vocab=512,seq_len=64",
                 "--cluster", "dgx-h100", "--gpus", "2", "--global-batch", "8",
                 "--strategy", "dp=2,zero=1,microbatch=2,offload=optimizer", "--no-ilp"])
    out = capsys.readouterr().out
    assert code == 0
    assert "offload       optimizer states" in out and "cpu optimizer" in out and "offload transfer" in out
    assert "offload=optimizer" in out.split("--strategy", 1)[1].splitlines()[0]


def test_offload_outside_the_capability_table_is_refused():
    with pytest.raises(AutoparError, match="offload=optimizer runs through FSDP2"):
        _plan_small(_tight_cluster(4096), strategy="dp=1,tp=1,pp=1,zero=0,offload=optimizer")
    with pytest.raises(AutoparError, match="use one of none, optimizer"):
        _plan_small(_tight_cluster(4096), strategy="offload=params")


# --- runtime: FSDP2's CPU offload policy, parity and ledger on 2 gloo processes ------------------

OFFLOAD_WORLD2 = [dict(dp=2, tp=1, pp=1, zero=1, microbatch=2, offload="optimizer"),
                  dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, offload="optimizer")]


def run_offload_job(job: dict) -> dict:
    """`run_job`, plus which offload policy each FSDP2 unit of the trained model runs with."""
    from torch.distributed.fsdp import FSDPModule

    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    result = run_job(job)
    spec = build_model(job["model"], job["overrides"])
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn)
    result["policies"] = sorted({type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                                 for m in parallel.modules[0].modules()
                                 if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group})
    result["parameter_devices"] = sorted({p.device.type for p in parallel.parameters()})
    return result


def test_offload_parity_and_ledger_on_two_processes():
    """dp=2 with ZeRO 1 and 3 and offload=optimizer: losses within relative 1e-5 of one process, final
    weights within 1e-5, and each step's collectives equal to the plan's ledger."""
    overrides = tiny_config()
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plans = [make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH) for strategy in OFFLOAD_WORLD2]
    jobs = [dict(plan=plan.to_json(), model="gpt", overrides=overrides, data=data) for plan in plans]
    results = run_plans(2, jobs, runner=run_offload_job)
    losses, state = reference_run("gpt", overrides, data)
    for strategy, plan, ranks in zip(OFFLOAD_WORLD2, plans, results):
        assert plan.strategy.offload == "optimizer"
        _check(strategy, plan, ranks, losses, state)
        for rank in ranks:
            assert rank["policies"] == ["CPUOffloadPolicy"], rank["policies"]
            assert rank["parameter_devices"] == ["cpu"]


def test_gpu_rows_prices_an_offload_row_on_the_host_it_ran_on(tmp_path, monkeypatch):
    """benchmarks/gpu_rows.py re-prices a gpu_suite offload row with the host rates the suite measured
    beside it (`priced_on_this_host`), not the preset DGX host's."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_rows

    row = {"case": "offload", "model": "gpt", "model_config": None, "seq_len": 16, "global_batch": 4,
           "precision": "bf16", "strategy": {"dp": 1, "tp": 1, "pp": 1, "zero": 3, "recompute": "none",
                                             "microbatch": 4, "offload": "optimizer"},
           "step_time_s_mean": 1.0, "max_memory_reserved_bytes": 1, "max_memory_allocated_bytes": 1,
           "predicted_on_this_host": {"status": "ok", "host_optimizer_params_per_s": 2e9,
                                      "host_link_bytes_per_s": 20e9}}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"plans": [row, {**row, "case": "unmeasured", "predicted_on_this_host": None}]}))
    measured, unmeasured = gpu_rows.rows_of(path)
    cluster = gpu_rows._cluster(measured["host"])
    # a file without `host_step` timed AdamW alone: its rate at AdamW's 28 of the step's 28 + 12 bytes
    assert cluster.host_optimizer_params_per_s == pytest.approx(2e9 * 28 / 40)
    assert cluster.host_link.effective_bandwidth_bytes_per_s == 20e9
    row["predicted_on_this_host"]["host_step"] = "clip+adamw"  # the suite's rate since a075975
    path.write_text(json.dumps({"plans": [row]}))
    assert gpu_rows._cluster(gpu_rows.rows_of(path)[0]["host"]).host_optimizer_params_per_s == 2e9
    row["predicted_on_this_host"]["host_step"] = "norm+adamw"  # since the fused step applies the clip's scale
    path.write_text(json.dumps({"plans": [row]}))
    assert gpu_rows._cluster(gpu_rows.rows_of(path)[0]["host"]).host_optimizer_params_per_s == 2e9
    assert unmeasured["host"] is None and gpu_rows._cluster(None).host_optimizer_params_per_s is None

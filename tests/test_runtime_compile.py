"""torch.compile (`parallelize(..., compile=True)`, `autopar run --compile`) trains like eager: the
whole stage with its loss where the plan allows it (one process, dp at ZeRO 0), each block elsewhere.

Tolerances: measured on CPU (torch 2.13, inductor, fp32), compiled losses differ from the eager
single-process reference by at most 2.1e-7 relative and final weights by at most 1.5e-8 absolute
(inductor fuses LayerNorm/GeLU reductions in another order). The bounds below leave about 5x room;
a real error (a block run twice, a missed gradient, a wrong shard) moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from autopar.capabilities import whole_stage_problem

from parity_harness import MAX_GRAD_NORM, SEED, _free_port, batches, make_optimizer, make_plan, reference_run, \
    run_plans, tiny_config

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-7
WEIGHT_RTOL = 1e-6


def _compiled_job(job: dict) -> dict:
    """One plan trained with compile=True on this rank (run by parity_harness.run_plans)."""
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    torch._dynamo.reset()  # a graph cached by an earlier test would be reused silently: count only this run's
    spec = build_model(job["model"], job["overrides"])
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn, seed=SEED, compile=True)
    optimizer = make_optimizer(parallel.parameters())
    graphs_before = counters["stats"]["unique_graphs"]
    losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in job["data"]]
    compiled = sorted(path for module in parallel.modules for path, sub in module.named_modules()
                      if getattr(sub.forward, "_autopar_compiled", False))
    result = {"losses": losses, "compiled": compiled, "names": sorted(parallel.named_parameters()),
              "graphs": counters["stats"]["unique_graphs"] - graphs_before,
              "whole": parallel.forward_loss is not None, "compile_text": parallel.optimizations["compile"]}
    state = parallel.full_state_dict()
    if parallel.layout.dp_rank == 0 and parallel.layout.tp_rank == 0:
        result["state"] = state
    return result


def _check(label: str, ranks: list[dict], reference_losses: list[float], reference_state: dict, layers: int,
           whole: bool) -> None:
    state, compiled = {}, set()
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference_losses), rtol=LOSS_RTOL,
                                   atol=0, msg=lambda m: f"{label} rank {rank} losses: {m}")
        assert result["whole"] == whole, (label, result["compile_text"])
        # per block: each block this rank holds is compiled, nothing else; whole stage: no block apart
        held = sorted({".".join(name.split(".")[:2]) for name in result["names"] if name.startswith("layers.")})
        assert result["compiled"] == ([] if whole else held), (label, rank, result["compiled"], held)
        assert result["graphs"] >= 1, label  # the compiled code really ran (0: dynamo fell back or skipped)
        compiled.update(result["compiled"])
        state.update(result.get("state", {}))
    assert compiled == (set() if whole else {f"layers.{i}" for i in range(layers)}), (label, compiled)
    assert set(state) == set(reference_state), label  # names as uncompiled: plans and checkpoints still apply
    for name, value in state.items():
        torch.testing.assert_close(value, reference_state[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda m: f"{label} weight {name}: {m}")


def _run(strategies: list[dict], world: int, model: str = "gpt") -> None:
    overrides = tiny_config(model)
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plans = [make_plan(model, overrides, strategy, world, GLOBAL_BATCH) for strategy in strategies]
    jobs = [dict(plan=plan.to_json(), model=model, overrides=overrides, data=data) for plan in plans]
    if world == 1:
        results = [[_in_process(job)] for job in jobs]
    else:
        results = run_plans(world, jobs, runner=_compiled_job)
    reference_losses, reference_state = reference_run(model, overrides, data)
    for strategy, ranks in zip(strategies, results):
        label = ",".join(f"{k}={v}" for k, v in strategy.items())
        whole = whole_stage_problem(plans[0].strategy.model_copy(update=strategy)) is None
        _check(label, ranks, reference_losses, reference_state, overrides["layers"], whole)


def _in_process(job: dict) -> dict:
    """A one-process gloo group here (no spawn: its import time would dominate the test)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return _compiled_job(job)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def _clean_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_one_process_compiles_the_whole_stage_with_its_loss_and_trains_like_eager(_clean_env):
    _run([dict(dp=1, tp=1, pp=1, microbatch=8), dict(dp=1, tp=1, pp=1, microbatch=4, recompute="full")], world=1)


def test_llama_compiles_whole_and_per_block_and_trains_like_eager(_clean_env):
    """Rotary embeddings, grouped-query attention, RMSNorm and SwiGLU: the whole stage at one process,
    and each block under selective recompute (the policy's dispatch mode stays outside the graph)."""
    _run([dict(dp=1, tp=1, pp=1, microbatch=8), dict(dp=1, tp=1, pp=1, microbatch=4, recompute="selective")],
         world=1, model="llama")


@pytest.mark.slow
def test_two_processes_llama_zero_and_tensor_parallel_compiled():
    """Without sp a Llama block reads the embedding's row-parallel output as it is, an async collective's
    result, which broke the compiled block's backward until `compile._settled_inputs` waited for it."""
    _run([dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, recompute="full"),
          dict(dp=1, tp=2, pp=1, zero=0, microbatch=4),
          dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4),
          dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4, recompute="full")], world=2, model="llama")


@pytest.mark.slow
def test_two_processes_data_parallel_and_zero_compiled():
    _run([dict(dp=2, tp=1, pp=1, zero=0, microbatch=2),
          dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, recompute="full")], world=2)


@pytest.mark.slow
def test_two_processes_tensor_parallel_compiled():
    """Full recompute under tp compiles the block inside its checkpoint (`compile_blocks(inside_checkpoint=
    True)`): a compiled checkpoint saved the device mesh among its tensors and failed."""
    _run([dict(dp=1, tp=2, pp=1, zero=0, microbatch=4),
          dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4, recompute="selective"),
          dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4, recompute="full")], world=2)


@pytest.mark.slow
def test_two_processes_zero_bubble_pipelines_compiled():
    """Zero-bubble schedules differentiate a stage twice over one retained graph, which a compiled
    backward donating its buffers refused mid-step (`compile_blocks(split_backward=True)`); the
    searcher refused them compiled until then, and now plans them."""
    _run([dict(dp=1, tp=1, pp=2, schedule="zbv", vp=2, microbatch=2, compile=True),
          dict(dp=1, tp=1, pp=2, schedule="interleaved_zb", vp=2, microbatch=2, compile=True)], world=2)


@pytest.mark.slow
def test_two_processes_pipeline_compiled():
    _run([dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2),
          dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2, recompute="full")], world=2)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, pair: tuple | None = None) -> torch.Tensor:
        out = torch.tanh(self.linear(h)) + h
        return out if pair is None else out + 3 * pair[0]


class _RowParallelStem(torch.nn.Module):
    """A vocabulary-parallel embedding whose output (an async all-reduce's result) two compiled blocks
    read: directly, and inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.first, self.second = _Block(), _Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.second(torch.zeros_like(self.first(h)), pair=(h, None)).sum()


def _async_inputs_job(job: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from autopar.runtime.compile import compile_blocks

    torch._dynamo.reset()
    ids = torch.arange(10).reshape(2, 5) % 16
    torch.manual_seed(0)
    reference = _RowParallelStem()
    reference(ids).backward()
    torch.manual_seed(0)
    model = _RowParallelStem()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                       {"embed": RowwiseParallel(input_layouts=Replicate())})
    compile_blocks(model, ["first", "second"], backend="aot_eager")
    model(ids).backward()
    return {"embed": (model.embed.weight.grad.full_tensor(), reference.embed.weight.grad),
            "first": (model.first.linear.weight.grad, reference.first.linear.weight.grad),
            "second": (model.second.linear.weight.grad, reference.second.linear.weight.grad)}


def test_compiled_blocks_wait_for_async_collective_inputs_even_nested():
    """A row-parallel output handed on as a local tensor is an async collective's result; entering a
    compiled block as it is, its gradient came back as a plain tensor where the collective's backward
    expects a DTensor, and backward failed (a Llama block at tp=2 without sp). Waited for first, in
    the arguments and inside a tuple, every gradient is eager's."""
    for rank in run_plans(2, [{}], runner=_async_inputs_job)[0]:
        for name, (compiled, eager) in rank.items():
            torch.testing.assert_close(compiled, eager, msg=lambda m: f"{name}: {m}")


def test_compiling_a_block_twice_is_refused():
    from autopar.errors import AutoparError
    from autopar.models import build_model
    from autopar.runtime.compile import compile_blocks

    module = build_model("gpt", tiny_config()).module
    names = [name for name, _ in module.named_parameters()]
    assert compile_blocks(module, ["layers.0", "layers.1", "no.such.block"]) == ["layers.0", "layers.1"]
    assert [name for name, _ in module.named_parameters()] == names  # nothing renamed
    assert not getattr(module.layers["2"].forward, "_autopar_compiled", False)
    with pytest.raises(AutoparError, match="block layers.1 is already compiled"):
        compile_blocks(module, ["layers.1"])


def _cli(argv: list[str]) -> tuple[int, str]:
    from autopar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_autopar_run_compile_matches_the_uncompiled_run(_clean_env, tmp_path):
    tiny = ",".join(f"{key}={value}" for key, value in tiny_config().items())  # the shapes compiled above: cached
    train = ["run", "--model", "gpt", "--model-config", tiny, "--global-batch", str(GLOBAL_BATCH), "--lr", "3e-3",
             "--seed", "7", "--data", "synthetic", "--cluster", "local", "--steps", "4", "--log-every", "1"]
    losses = {}
    for label, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"])):
        metrics = tmp_path / f"{label}.jsonl"
        torch._dynamo.reset()
        graphs_before = counters["stats"]["unique_graphs"]
        code, err = _cli([*train, "--metrics", str(metrics), *extra])
        assert code == 0, err
        graphs = counters["stats"]["unique_graphs"] - graphs_before
        assert (graphs >= 1) == (label == "compiled"), (label, graphs)  # compiled only when asked
        losses[label] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["compiled"]) == 4
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=LOSS_RTOL, atol=0)


def test_a_model_torch_cannot_compile_is_said_in_one_line_with_the_eager_way_out(_clean_env, tmp_path, monkeypatch):
    """A compiler that fails at the first step (here a backend that raises, as inductor does on a model
    it cannot lower): `autopar run` stops with one line naming it and the eager way out, exit 2, no
    traceback; nothing is checkpointed. Eager, the same run trains."""
    import importlib

    from autopar.runtime.compile import compile_forward_loss

    parallelize_module = importlib.import_module("autopar.runtime.parallelize")  # the package exports the function

    def refusing_backend(graph_module, example_inputs):
        raise RuntimeError("no kernel for this op\nsecond line")

    monkeypatch.setattr(parallelize_module, "compile_forward_loss",
                        lambda module, loss_fn: compile_forward_loss(module, loss_fn, backend=refusing_backend))
    tiny = ",".join(f"{key}={value}" for key, value in tiny_config().items())
    train = ["run", "--model", "gpt", "--model-config", tiny, "--global-batch", str(GLOBAL_BATCH), "--data",
             "synthetic", "--cluster", "local", "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    torch._dynamo.reset()
    code, err = _cli([*train, "--compile"])
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("searching", "tracing"))]
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1] == ("autopar: error: torch.compile failed on this model (BackendCompilerFailed, RuntimeError: "
                         "no kernel for this op); train it eager: --no-compile, or a plan with compile=false")
    assert not list((tmp_path / "ck").glob("step-*"))
    torch._dynamo.reset()
    assert _cli([*train, "--no-compile"])[0] == 0


def test_a_plan_priced_compiled_is_compiled_by_default_and_refused_eager(one_process_group):
    """`parallelize` follows the plan's `compile` unless told otherwise; a plan priced compiled (whose
    memory counts what the compiled step saves, `cost_models.compiled_stage`) is refused eager before
    anything is built."""
    from autopar.errors import AutoparError
    from autopar.models import build_model
    from autopar.runtime.parallelize import parallelize

    overrides = tiny_config("gpt")
    plan = make_plan("gpt", overrides, {"dp": 1, "tp": 1, "pp": 1, "compile": True}, 1, GLOBAL_BATCH)
    assert plan.strategy.compile
    spec = build_model("gpt", overrides)
    with pytest.raises(AutoparError, match="priced compiled"):
        parallelize(spec.module, plan, loss_fn=spec.loss_fn, compile=False)
    parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn)  # compile=None: the plan's
    assert parallel.forward_loss is not None and parallel.optimizations["compile"] != "off"


def test_a_plan_keeping_sequence_shards_is_refused_compiled(one_process_group):
    """Keeping sequence shards (`sp_inputs=regathered`) runs eager only: the search never offers it with
    compile, and `parallelize(compile=True)` refuses such a plan before anything is built."""
    from autopar.capabilities import RUNTIME_CAPABILITIES
    from autopar.errors import AutoparError
    from autopar.models import build_model
    from autopar.runtime.parallelize import parallelize

    overrides = tiny_config("gpt")
    strategy = {"dp": 1, "tp": 2, "pp": 1, "sp": True, "microbatch": 4, "sp_inputs": "regathered"}
    plan = make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH)
    assert "eager" in RUNTIME_CAPABILITIES.supports(plan.strategy.model_copy(update={"compile": True}))
    spec = build_model("gpt", overrides)
    with pytest.raises(AutoparError, match="sp_inputs=regathered"):
        parallelize(spec.module, plan, loss_fn=spec.loss_fn, compile=True)

"""Context parallelism (cp, ring and Ulysses) on gloo processes: attention alone against one
process's SDPA, then whole plans against one process's training (every loss to relative 1e-5, the
gathered final weights to 1e-5, fp32) with each rank's collectives equal to the contract's closed
form (`cp_rows`) and to the plan's own ledger (`cost_models.collectives.step_collectives`): the
plans are the searcher's, with cp fixed as `--strategy cp=2` fixes it.
"""

from __future__ import annotations

import pytest
import torch

from autopar.plan_schema import Plan

from parity_harness import batches, make_plan, reference_run, run_plans, tiny_config

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
FP32 = 4


pytestmark = pytest.mark.usefixtures("one_thread")


# --- plans ---------------------------------------------------------------------------------------

def cp_plan(family: str, overrides: dict, *, cp: int, kind: str, dp: int = 1, tp: int = 1, zero: int = 0,
            recompute: str = "none", microbatch: int = 2) -> Plan:
    """The searcher's plan with cp fixed (`autopar.plan`, as `--strategy cp=...` asks), its micro-batches
    `microbatch` x cp sequences: the tokens per rank of a dp x cp plan with micro-batches of `microbatch`."""
    strategy = dict(dp=dp, cp=cp, cp_kind=kind, tp=tp, pp=1, zero=zero, microbatch=microbatch * cp,
                    recompute=recompute)
    return make_plan(family, overrides, strategy, dp * cp * tp, GLOBAL_BATCH)


# --- the ledger ----------------------------------------------------------------------------------

def cp_rows(strategy, *, layers: int, seq: int, heads: int, kv_heads: int, head_dim: int,
            recomputed_layers: int = 0, activation_bytes: int = FP32) -> dict:
    """{("cp", kind): (calls, bytes)} per rank per step, as the contract states it."""
    s = strategy
    m, b, cp = s.num_microbatches, s.microbatch, s.cp
    token_bytes = b * (seq // cp) * head_dim * activation_bytes  # one head's share of a shard
    q_bytes, kv_bytes = token_bytes * heads // s.tp, token_bytes * kv_heads // s.tp
    calls = m * layers
    repeats = m * recomputed_layers
    if s.cp_kind == "ring":
        per_call = 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp  # forward K/V, backward K/V, dK/dV home
        count = per_call * calls + 2 * (cp - 1) * repeats
        return {("cp", "send"): (count, count * kv_bytes), ("cp", "recv"): (count, count * kv_bytes)}
    forward = 2 * q_bytes + 2 * kv_bytes  # Q, K, V to head shards, the output back
    return {("cp", "all_to_all"): (8 * calls + 4 * repeats, 2 * forward * calls + forward * repeats)}


def expected_ledger(plan: Plan, config: dict) -> dict:
    """The plan's own ledger (`cost_models.collectives.step_collectives`, in `plan.predicted`), after
    checking its "cp" rows against the contract's closed form (`cp_rows`)."""
    from autopar.cost_models.collectives import merge_world

    s = plan.strategy
    rows = {(r.axis, r.kind): (r.calls, r.bytes) for r in plan.predicted.collectives[0]}
    heads, layers = config["heads"], config["layers"]
    recomputed = layers if s.recompute == "full" else 0
    closed = cp_rows(s, layers=layers, seq=SEQ, heads=heads, kv_heads=config.get("kv_heads", heads),
                     head_dim=config["hidden"] // heads, recomputed_layers=recomputed)
    priced = {key: value for key, value in rows.items() if key[0] == "cp"}
    assert priced == {key: (calls, float(size)) for key, (calls, size) in closed.items()}, (s, priced, closed)
    return merge_world(rows, {axis.name: axis.size for axis in plan.mesh})


# --- attention alone -----------------------------------------------------------------------------

def attention_job(job: dict) -> dict:
    """This rank's shard of causal attention (forward and gradients) and the whole one's, float64 inputs."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.runtime.context_parallel import ContextParallel, ring_attention, shard_positions, ulysses_attention

    world, kind = dist.get_world_size(), job["kind"]
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, job["kv_heads"], 16, 8
    q, grad = (torch.randn(batch, heads, seq, dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=generator) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = heads // kv_heads
    out = F.scaled_dot_product_attention(whole[0], whole[1].repeat_interleave(groups, 1),
                                         whole[2].repeat_interleave(groups, 1), is_causal=True)
    out.backward(grad)
    positions = shard_positions(seq, world, dist.get_rank(), kind)
    local = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    attend = ring_attention if kind == "ring" else ulysses_attention
    local_out = attend(ContextParallel(world, kind, dist.get_rank(), dist.group.WORLD), *local)
    local_out.backward(grad[:, :, positions])
    return {"out": (local_out.detach(), out.detach()[:, :, positions]),
            **{f"grad_{n}": (t.grad, w.grad[:, :, positions]) for n, t, w in zip("qkv", local, whole)}}


def _attention_parity(world: int) -> None:
    jobs = [dict(kind="ring", kv_heads=2), dict(kind="ring", kv_heads=4), dict(kind="ulysses", kv_heads=world)]
    for job, ranks in zip(jobs, run_plans(world, jobs, runner=attention_job)):
        for rank, result in enumerate(ranks):
            for name, (got, want) in result.items():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{job} rank {rank} {name}: {m}")


@pytest.mark.slow  # CI time (the 2-core CI machine sits near its 20-minute budget)
def test_ring_and_ulysses_attention_match_sdpa_on_two_ranks():
    """Causal attention over the zigzag (ring, with GQA) and contiguous (Ulysses) shards: the output and
    the gradients of q, k and v equal one process's SDPA on the same positions (fp32, 1e-5)."""
    _attention_parity(2)


@pytest.mark.slow
def test_ring_and_ulysses_attention_match_sdpa_on_four_ranks():
    _attention_parity(4)


def test_shard_positions_zigzag_and_contiguous():
    from autopar.runtime.context_parallel import shard_positions

    assert shard_positions(16, 2, 0, "ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1, "ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_positions(16, 2, 1, "ulysses").tolist() == list(range(8, 16))
    assert sorted(sum((shard_positions(16, 4, r, "ring").tolist() for r in range(4)), [])) == list(range(16))


# --- plans: parity and ledger --------------------------------------------------------------------

def _parity(world: int, family: str, cases: list[dict]) -> None:
    """Each case's plan trains like one process; each rank's collectives are `expected_ledger`'s."""
    config = tiny_config(family)
    data = batches(config["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    built = [cp_plan(family, config, **case) for case in cases]
    jobs = [dict(plan=plan.to_json(), model=family, overrides=config, data=data) for plan in built]
    results = run_plans(world, jobs)
    losses, state = reference_run(family, config, data)
    for case, plan, ranks in zip(cases, built, results):
        label = ",".join(f"{k}={v}" for k, v in case.items())
        expected = {key: (calls, round(size)) for key, (calls, size) in expected_ledger(plan, config).items()}
        gathered = {}
        for rank, result in enumerate(ranks):
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{label} rank {rank} losses: {m}")
            for name, placement in result["placements"].items():
                assert plan.param_placements[name] == placement, (label, rank, name, placement)
            assert result["collectives"] == expected, (label, rank, result["collectives"], expected)
            gathered.update(result.get("state", {}))
        assert set(gathered) == set(state), label
        for name, value in gathered.items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {name}: {m}")


def test_cp2_ring_and_ulysses_train_like_one_process():
    """World 2 on GPT (learned positions): ring, ring with selective recompute (attention's results
    kept, nothing resent), Ulysses with full recompute (the forward's four all-to-alls resent)."""
    _parity(2, "gpt", [dict(cp=2, kind="ring"), dict(cp=2, kind="ring", recompute="selective"),
                       dict(cp=2, kind="ulysses", recompute="full")])


@pytest.mark.slow
def test_cp2_on_llama_and_with_full_recompute():
    """World 2: Ulysses on Llama (RoPE, GQA: 4 heads, 2 kv heads) plain and with selective recompute,
    ring on Llama under ZeRO-3 (FSDP2 over dp x cp); ring on GPT with full recompute (the forward's
    K/V rounds resent)."""
    _parity(2, "llama", [dict(cp=2, kind="ulysses"), dict(cp=2, kind="ulysses", recompute="selective"),
                         dict(cp=2, kind="ring", zero=3)])
    _parity(2, "gpt", [dict(cp=2, kind="ring", recompute="full")])


@pytest.mark.slow  # ~30-45 s on the 2-core CI machine, which sits near its 20-minute budget
def test_cp2_with_tp2_and_with_dp2_on_four_processes():
    """World 4: ring cp=2 x tp=2 (module-rule tp, vocabulary-parallel loss on the shards), and ring
    dp=2 x cp=2 under ZeRO-3 with full recompute."""
    _parity(4, "gpt", [dict(cp=2, tp=2, kind="ring"),
                       dict(cp=2, dp=2, kind="ring", zero=3, recompute="full", microbatch=1)])


def bf16_job(job: dict) -> dict:
    """Two steps under bf16 autocast; the last step's collectives."""
    from autopar.models import build_model
    from autopar.runtime.collectives import CollectiveCounter, group_axes
    from autopar.runtime.parallelize import parallelize

    from parity_harness import SEED, make_optimizer

    spec = build_model(job["model"], job["overrides"])
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn, seed=SEED,
                           precision="bf16")
    optimizer = make_optimizer(parallel.parameters())
    losses = [parallel.train_step(job["data"][0], optimizer)]
    with CollectiveCounter(group_axes(parallel)) as counter:
        losses.append(parallel.train_step(job["data"][1], optimizer))
    return {"losses": losses, "collectives": counter.counts.as_rows()}


@pytest.mark.slow
def test_cp_sends_bf16_activations_under_bf16_autocast():
    """Under bf16 autocast K/V blocks, their gradient accumulators and Ulysses' all-to-alls move 2 bytes
    per element (the contract's activation bytes); the loss stays near fp32's one-process loss."""
    config = tiny_config("llama")
    data = batches(config["vocab"], GLOBAL_BATCH, SEQ, 2)
    cases = [dict(cp=2, kind="ring"), dict(cp=2, kind="ulysses")]
    plans = [cp_plan("llama", config, **case) for case in cases]
    results = run_plans(2, [dict(plan=p.to_json(), model="llama", overrides=config, data=data) for p in plans],
                        runner=bf16_job)
    losses, _ = reference_run("llama", config, data)
    for plan, ranks in zip(plans, results):
        want = cp_rows(plan.strategy, layers=config["layers"], seq=SEQ, heads=config["heads"],
                       kv_heads=config["kv_heads"], head_dim=config["hidden"] // config["heads"], activation_bytes=2)
        for result in ranks:
            assert {k: v for k, v in result["collectives"].items() if k[0] == "cp" and k[1] != "all_reduce"} == want
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=2e-2, atol=0)


@pytest.mark.slow
def test_more_cp_combinations_on_four_processes():
    """Ulysses cp=2 x tp=2 and dp=2 x cp=2 (ZeRO 0, buckets over dp x cp) on GPT; ring cp=4 with
    full recompute and Ulysses cp=4 on GPT (4 heads, 4 kv heads); ring dp=2 x cp=2 on Llama."""
    _parity(4, "gpt", [dict(cp=2, tp=2, kind="ulysses"), dict(cp=2, dp=2, kind="ulysses", microbatch=1),
                       dict(cp=4, kind="ring", recompute="full", microbatch=1),
                       dict(cp=4, kind="ulysses", microbatch=1)])
    _parity(4, "llama", [dict(cp=2, dp=2, kind="ring", microbatch=1)])


# --- refusals and `autopar run` ------------------------------------------------------------------

RUN_CONFIG = dict(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
RUN_MODEL = ["--model", "gpt", "--model-config", ",".join(f"{k}={v}" for k, v in RUN_CONFIG.items())]
RUN_TRAIN = [*RUN_MODEL, "--global-batch", "4", "--lr", "3e-3", "--seed", "7", "--data", "synthetic",
             "--cluster", "local"]


@pytest.fixture(scope="module")
def run_plan_file(tmp_path_factory):
    """A ring cp=2 plan file for RUN_CONFIG at global batch 4."""
    plan = make_plan("gpt", RUN_CONFIG, dict(dp=1, cp=2, cp_kind="ring", tp=1, pp=1, zero=0, microbatch=4), 2, 4)
    path = tmp_path_factory.mktemp("cp") / "plan.json"
    path.write_text(plan.to_json())
    return path


def test_what_context_parallelism_refuses_is_one_line_each():
    from autopar.models import build_model
    from autopar.plan_schema import Strategy
    from autopar.runtime.context_parallel import context_parallel_problem

    def problem(family="gpt", config=None, seq_len=16, loss_fn=None, **keys):
        strategy = Strategy(**{**dict(dp=1, tp=1, pp=1, microbatch=2, num_microbatches=1, cp=2), **keys})
        model = build_model(family, config or tiny_config(family)).module
        return context_parallel_problem(model, strategy, seq_len, loss_fn)

    from autopar.models import lm_loss

    assert problem() is None and problem("llama", cp_kind="ulysses", loss_fn=lm_loss) is None
    assert problem(zero=3, recompute="full") is None and problem(tp=2) is None
    assert "pipeline stages" in problem(pp=2)
    assert "sequence parallelism" in problem(tp=2, sp=True)
    assert "not zero=1" in problem(zero=1)
    assert problem(recompute="selective") is None
    assert "cp must divide both" in problem("llama", tp=2, cp_kind="ulysses")  # 1 kv head per tp rank
    assert "not divisible by 4" in problem(seq_len=14)
    assert "dense models only" in problem(config=tiny_config(moe_experts=4))
    assert "no dropout" in problem(config=tiny_config(dropout=0.1))
    assert "lm_loss" in problem(loss_fn=lambda logits, ids: logits.sum())
    strategy = Strategy(dp=1, tp=2, pp=1, microbatch=2, num_microbatches=1, cp=2)
    assert "not DTensor's" in context_parallel_problem(build_model("gpt", tiny_config()).module, strategy,
                                                       tp_realization="dtensor")
    assert "zoo's gpt and llama" in context_parallel_problem(torch.nn.Linear(2, 2), Strategy(
        dp=1, tp=1, pp=1, microbatch=1, num_microbatches=1, cp=2))


def test_a_hand_edited_cp_plan_is_checked_against_the_model(run_plan_file):
    from autopar.models import build_model
    from autopar.plan_checks import plan_problem_for_model

    plan = Plan.from_json(run_plan_file.read_text())
    assert plan_problem_for_model(plan, build_model("gpt", RUN_CONFIG).module) is None
    sp = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"tp": 2, "sp": True})})
    assert "sequence parallelism" in plan_problem_for_model(sp, build_model("gpt", RUN_CONFIG).module)


@pytest.mark.slow
def test_checkpoints_cross_between_one_process_and_cp2_zero3_under_torchrun(tmp_path, monkeypatch):
    """One process saves at step 2; a ulysses cp=2 ZeRO-3 run under torchrun resumes it and saves at
    step 4; one process resumes that for step 5: every loss is the uninterrupted run's (rel 1e-5)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    plan = make_plan("gpt", RUN_CONFIG, dict(dp=1, cp=2, cp_kind="ulysses", tp=1, pp=1, zero=3, microbatch=4), 2, 4)
    (tmp_path / "plan.json").write_text(plan.to_json())
    train = [a for a in RUN_TRAIN if a not in ("--cluster", "local")]

    def losses(path):
        return {record["step"]: record["loss"] for record in map(json.loads, path.read_text().splitlines())}

    assert main(["run", *RUN_TRAIN, "--steps", "5", "--log-every", "1", "--checkpoint-dir", str(tmp_path / "one"),
                 "--checkpoint-every", "2", "--metrics", str(tmp_path / "one.jsonl")]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "autopar",
         "run", *train, "--plan", str(tmp_path / "plan.json"), "--steps", "4", "--log-every", "1",
         "--resume", str(tmp_path / "one" / "step-00000002"), "--checkpoint-dir", str(tmp_path / "cp"),
         "--checkpoint-every", "4", "--metrics", str(tmp_path / "cp.jsonl")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["run", *RUN_TRAIN, "--steps", "5", "--log-every", "1", "--resume", str(tmp_path / "cp" / "step-00000004"),
                 "--checkpoint-dir", str(tmp_path / "again"), "--metrics", str(tmp_path / "again.jsonl")]) == 0
    want, under_cp, after = (losses(tmp_path / f"{name}.jsonl") for name in ("one", "cp", "again"))
    assert sorted(under_cp) == [3, 4] and sorted(after) == [5]
    for step, loss in {**under_cp, **after}.items():
        assert loss == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_autopar_run_cp2_under_torchrun_matches_one_process(tmp_path, run_plan_file, monkeypatch):
    """`autopar run --plan` with a ring cp=2 plan on two torchrun processes: the loss after 3 steps is
    one process's (same synthetic batches and init), to relative 1e-5."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    single = tmp_path / "single.jsonl"
    assert main(["run", *RUN_TRAIN, "--steps", "3", "--log-every", "3", "--metrics", str(single)]) == 0
    metrics = tmp_path / "cp.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "autopar",
         "run", *RUN_TRAIN, "--plan", str(run_plan_file), "--steps", "3", "--log-every", "3",
         "--metrics", str(metrics)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cp=2 cp_kind=ring" in done.stdout
    (want,) = [json.loads(line) for line in single.read_text().splitlines()]
    (got,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert got["step"] == 3 and got["loss"] == pytest.approx(want["loss"], rel=1e-5)

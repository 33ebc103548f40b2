"""fp16 training with a dynamic loss scale (`runtime/loss_scaling.py`), on CPU autocast and gloo.

Without a scale, fp16 activation gradients below its smallest subnormal flush to zero; with it they
reach the optimizer as fp32 computes them. An overflow skips the step on every rank together and
halves the scale. Every layout trains like one fp16 process, and sends what its plan predicted."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from parity_harness import MAX_GRAD_NORM, batches, make_plan, run_plans, tiny_config
from test_runtime_parity import _check_collectives

STEPS = 3
GLOBAL_BATCH = 8
TINY_LOSS = 2.0**-16  # a loss this small leaves fp16 activation gradients below 6e-8 (every one, here)


def fp16_plan(strategy: dict, world: int):
    return make_plan("gpt", tiny_config("gpt"), strategy, world, GLOBAL_BATCH, precision="fp16")


class _Recorder(torch.optim.SGD):
    """SGD that keeps the gradients each step saw (after the clip's and the loss scale's scaling)."""

    def __init__(self, params):
        super().__init__(params, lr=0.05, momentum=0.9)
        self.seen: list[dict[int, torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append({id(p): p.grad.detach().clone() for group in self.param_groups for p in group["params"]
                          if p.grad is not None})
        return super().step(closure)


def train(job: dict) -> dict:
    """Train the tiny GPT under `job`'s plan and precision: losses, the final weights, what the scale did,
    the last step's collectives and the position table's gradient in the first step."""
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.collectives import CollectiveCounter, group_axes
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", tiny_config("gpt"))
    factor, half = job.get("loss_factor", 1.0), job.get("half_loss", False)

    def loss_fn(out, x):  # `half`: a user's loss left in 16 bits (the zoo's upcasts its logits)
        loss = spec.loss_fn(out, x) * factor
        return loss.half() if half else loss
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=loss_fn, seed=0,
                           precision=job["precision"])
    if job.get("unscaled"):
        parallel.loss_scale = None
    if job.get("initial_scale") is not None:
        parallel.loss_scale.scale = job["initial_scale"]
    fused = job.get("optimizer") == "fused"  # torch's fused AdamW, as the runtime builds on a GPU
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=1e-3, fused=True) if fused else \
        _Recorder(parallel.parameters())
    before = {name: p.detach().clone() for name, p in parallel.full_state_dict().items()}
    data = job["data"]
    with _counted_flag_reads() as host_reads:
        losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in data[:-1]]
        with CollectiveCounter(group_axes(parallel)) as counter:
            losses.append(parallel.train_step(data[-1], optimizer, max_grad_norm=MAX_GRAD_NORM))
    named = {id(p): name for name, p in parallel.named_parameters().items()}
    seen = [] if fused else optimizer.seen
    first = {named[key]: grad for key, grad in seen[0].items()} if seen else {}
    steps = max((int(state["step"]) for state in optimizer.state.values()), default=0) if fused else len(seen)
    scale = parallel.loss_scale
    return {"losses": losses, "state": parallel.full_state_dict(), "before": before, "pp_rank": parallel.layout.pp_rank,
            "collectives": counter.counts.as_rows(), "steps_taken": steps, "flag_reads": host_reads[0],
            "scale": scale.scale if scale else None, "skipped": scale.skipped_steps if scale else None,
            "first_grads": {name: grad for name, grad in first.items() if name == "pos_embed.weight"}}


@contextlib.contextmanager
def _counted_flag_reads():
    """Count the host's reads of each step's overflow flag (`found_inf.item()`), a synchronization."""
    runtime = sys.modules["autopar.runtime.parallelize"]
    reads, original = [0], runtime.overflowed

    def flagged(norm):
        flag = original(norm)

        def item():
            reads[0] += 1
            return torch.Tensor.item(flag)
        flag.item = item
        return flag
    runtime.overflowed = flagged
    try:
        yield reads
    finally:
        runtime.overflowed = original


@pytest.fixture(scope="module")
def data():
    return batches(tiny_config("gpt")["vocab"], GLOBAL_BATCH, tiny_config("gpt")["seq_len"], STEPS)


def test_the_scale_moves_as_torch_gradscaler_does():
    from autopar.runtime.loss_scaling import LossScale, overflowed

    scale = LossScale(growth_interval=3)

    def step(norm: float) -> None:
        scale.update(overflowed(torch.tensor(norm)))
    step(float("inf"))
    assert scale.scale == 2.0**15 and scale.skipped_steps == 1
    step(float("nan"))
    assert scale.scale == 2.0**14
    for _ in range(2):
        step(1.0)
    assert scale.scale == 2.0**14 and scale.finite_in_a_row == 2
    step(1.0)
    assert scale.scale == 2.0**15  # the third finite step in a row doubles it
    assert scale.finite_in_a_row == 0 and scale.skipped_steps == 2


def test_small_gradients_survive_in_fp16_only_with_the_scale(data):
    """A loss of 2^-16 times the usual: the position table's gradient (reached through every layer) as
    fp32 computes it, as fp16 does with the scale (close to it), and without (flushed to zero)."""
    plan = fp16_plan({"dp": 1, "tp": 1, "pp": 1, "microbatch": 8}, 1)
    jobs = [dict(plan=plan.to_json(), precision=precision, data=data[:1], loss_factor=TINY_LOSS, unscaled=unscaled)
            for precision, unscaled in (("fp32", False), ("fp16", False), ("fp16", True))]
    (fp32,), (scaled,), (unscaled,) = run_plans(1, jobs, runner=train)
    (name, reference), = fp32["first_grads"].items()
    assert reference.abs().max() > 0
    error = (scaled["first_grads"][name] - reference).norm() / reference.norm()
    assert error < 0.01, error
    flushed = unscaled["first_grads"][name]
    assert flushed.norm() < 0.05 * reference.norm()


@pytest.mark.parametrize("strategy", [dict(dp=2, tp=1, pp=1, microbatch=2), dict(dp=1, tp=2, pp=1, microbatch=4),
                                      dict(dp=1, tp=1, pp=2, microbatch=2, schedule="1f1b")],
                         ids=["dp", "tp", "pp"])
def test_fp16_layouts_train_like_one_fp16_process_and_send_what_was_planned(data, strategy):
    plan = fp16_plan(strategy, 2)
    single = fp16_plan({"dp": 1, "tp": 1, "pp": 1, "microbatch": 8}, 1)
    (reference,), = run_plans(1, [dict(plan=single.to_json(), precision="fp16", data=data)], runner=train)
    ranks, = run_plans(2, [dict(plan=plan.to_json(), precision="fp16", data=data)], runner=train)
    state = {}
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference["losses"]), rtol=2e-3, atol=0)
        assert rank["scale"] == reference["scale"] == 2.0**16 and rank["skipped"] == 0
        _check_collectives(str(strategy), plan, rank)
        state.update(rank["state"])
    for name, value in state.items():
        torch.testing.assert_close(value, reference["state"][name], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "fused"])
def test_an_overflow_skips_the_step_on_every_rank_and_halves_the_scale(data, optimizer):
    """A scale of 2^40 overflows fp16 at once: the first step is skipped on both dp ranks alike (the
    weights untouched), and the halved scale then fits. The fused AdamW takes the overflow flag in its
    own step, which leaves weights, moments and its step count as they are, so the host never reads the
    flag; SGD takes none, and the host reads it once per step."""
    plan = fp16_plan({"dp": 2, "tp": 1, "pp": 1, "microbatch": 2}, 2)
    ranks, = run_plans(2, [dict(plan=plan.to_json(), precision="fp16", data=data[:1], initial_scale=2.0**40,
                                optimizer=optimizer)], runner=train)
    for rank in ranks:
        assert rank["skipped"] == 1 and rank["steps_taken"] == 0 and rank["scale"] == 2.0**39
        assert rank["flag_reads"] == (0 if optimizer == "fused" else 1)
        for name, value in rank["state"].items():
            assert torch.equal(value, rank["before"][name]), name
    ranks, = run_plans(2, [dict(plan=plan.to_json(), precision="fp16", data=3 * data, initial_scale=2.0**22,
                                optimizer=optimizer)], runner=train)
    for rank in ranks:  # from 2^22: halved until it fits, then every step runs
        assert rank["skipped"] >= 1 and rank["steps_taken"] >= 1, rank["skipped"]
        assert rank["skipped"] + rank["steps_taken"] == 3 * len(data)
        assert rank["scale"] == 2.0 ** (22 - rank["skipped"])
        assert any(not torch.equal(value, rank["before"][name]) for name, value in rank["state"].items())


def resumed_scale(job: dict) -> dict:
    """Save an fp16 run whose scale has moved, load it into a fresh one: the scale it resumes with."""
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.checkpoint.checkpointer import Checkpointer
    from autopar.runtime.parallelize import parallelize

    def fresh():
        spec = build_model("gpt", tiny_config("gpt"))
        return parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn, seed=0, precision="fp16")

    saved = fresh()
    saved.loss_scale.scale, saved.loss_scale.finite_in_a_row, saved.loss_scale.skipped_steps = 1024.0, 7, 3
    Checkpointer(job["directory"]).save(1, saved)
    loaded = fresh()
    Checkpointer(job["directory"]).load("latest", loaded)
    scale = loaded.loss_scale
    return {"scale": scale.scale, "in_a_row": scale.finite_in_a_row, "skipped": scale.skipped_steps}


def test_a_checkpoint_resumes_at_the_scale_it_reached(tmp_path):
    plan = fp16_plan({"dp": 1, "tp": 1, "pp": 1, "microbatch": 8}, 1)
    (result,), = run_plans(1, [dict(plan=plan.to_json(), directory=str(tmp_path / "ck"))], runner=resumed_scale)
    assert result == {"scale": 1024.0, "in_a_row": 7, "skipped": 3}


@pytest.mark.parametrize("strategy", [dict(dp=2, tp=1, pp=1, zero=2, microbatch=2),
                                      dict(dp=1, tp=1, pp=2, zero=2, microbatch=2, schedule="1f1b")],
                         ids=["zero2", "zero2-pp"])
def test_a_16_bit_loss_is_scaled_in_fp32(data, strategy):
    """Under ZeRO, FSDP2 computes in fp16 and a user's loss may stay 16-bit: scaled by 2^16 in its own
    dtype it would overflow (the logged loss inf, `autopar run` stopped at step 1). It is scaled in fp32,
    as GradScaler does. Without pp the seed reaching the loss is the scale over the micro-batches: no
    step is skipped. A pipeline's seed is the scale itself, above fp16's largest (65,504), so its first
    step is skipped and the halved scale fits, as GradScaler's would."""
    plan = fp16_plan(strategy, 2)
    half, full = run_plans(2, [dict(plan=plan.to_json(), precision="fp16", data=data, half_loss=True),
                               dict(plan=plan.to_json(), precision="fp16", data=data)], runner=train)
    for rank, reference in zip(half, full):
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
        assert rank["skipped"] == (1 if strategy["pp"] > 1 else 0) and reference["skipped"] == 0
        assert rank["steps_taken"] == STEPS - rank["skipped"] and rank["scale"] == 2.0**16 / 2 ** rank["skipped"]
        torch.testing.assert_close(rank["losses"][0], reference["losses"][0], rtol=1e-3, atol=0)


def test_only_torch_fused_adam_takes_the_overflow_flag():
    """Fused SGD takes a found-inf flag too, but makes its momentum buffers uninitialized on its first
    step, which a skipped first step would leave for the next to read: the host decides for it, as for
    every optimizer that takes no deferred scale."""
    from autopar.runtime.optimizer import clear_gradient_scale, defer_gradient_scale, hand_found_inf

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    for optimizer, takes in ((torch.optim.AdamW([param], fused=True), True),
                             (torch.optim.Adam([param], fused=True), True),
                             (torch.optim.SGD([param], lr=0.1, momentum=0.9, fused=True), False),
                             (torch.optim.AdamW([param], foreach=True), False)):
        defer_gradient_scale(optimizer, torch.tensor(0.5), {param.device})
        assert hand_found_inf(optimizer, torch.tensor(1.0)) is takes, type(optimizer).__name__
        assert (getattr(optimizer, "found_inf", None) is not None) is takes
        clear_gradient_scale(optimizer)

"""The runtime's optimizer (issue #29): AdamW fused where the shards allow it, and it trains alike.

Tolerance: fused and foreach AdamW round differently (measured on CPU, torch 2.13: losses within
1.04e-7 relative over the 4 steps below); 1e-5 leaves room, and a wrong step (lr, a moment
skipped, a shard stepped twice) moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import copy

import torch

from autopar.runtime.optimizer import build_optimizer, optimizer_implementation
from parity_harness import MAX_GRAD_NORM, SEED, batches, make_plan, tiny_config

GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 4, 1e-2


def test_fused_on_cuda_and_for_host_states_under_offload_else_foreach():
    cpu = [torch.nn.Parameter(torch.zeros(3))]
    assert optimizer_implementation(cpu) == "foreach"  # the gloo tests' references use foreach
    assert optimizer_implementation(cpu, offload="optimizer") == "fused"  # torch's fused CPU AdamW
    assert optimizer_implementation([torch.nn.Parameter(torch.zeros(3, device="meta"))]) == "foreach"
    optimizer = build_optimizer(cpu, 1e-3, offload="optimizer")
    assert optimizer.defaults["fused"] and optimizer.defaults["lr"] == 1e-3


def _reference(overrides: dict, data: list[torch.Tensor]) -> list[float]:
    """One process, whole batch, torch's default (foreach) AdamW."""
    from autopar.models import build_model
    from autopar.runtime.init import InitSource, materialize

    spec = build_model("gpt", overrides)
    module = copy.deepcopy(spec.module)
    materialize(module, InitSource(spec.module, SEED), torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, foreach=True)
    losses = []
    for batch in data:
        loss = spec.loss_fn(module(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_offloaded_states_step_with_fused_host_adamw_like_foreach(one_process_group):
    """ZeRO-3 with offload=optimizer on one process: FSDP2's host shards, stepped by the fused CPU
    AdamW the runtime chooses, give the losses of a plain foreach AdamW run."""
    from autopar.models import build_model
    from autopar.runtime.parallelize import parallelize

    overrides = tiny_config()
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    plan = make_plan("gpt", overrides, dict(dp=1, tp=1, pp=1, zero=3, offload="optimizer",
                                            microbatch=GLOBAL_BATCH), 1, GLOBAL_BATCH)
    spec = build_model("gpt", overrides)
    parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=SEED)
    optimizer = parallel.build_optimizer(LR)
    assert parallel.optimizations["optimizer"] == "AdamW fused on the host"
    assert parallel.optimizations["allocator"] == "not applied (not a CUDA device)"
    losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(overrides, data)), rtol=1e-5, atol=0)


def test_clipping_scale_deferred_to_the_fused_step_matches_scaling_first():
    """The clip's scale handed to the fused AdamW (`defer_gradient_scale`) gives the parameters and
    gradients of scaling the gradients first; foreach steps scale themselves; a later step without
    clipping does not reuse the scale."""
    from autopar.runtime.optimizer import clear_gradient_scale, defer_gradient_scale

    torch.manual_seed(0)
    start = [torch.randn(33, 7) for _ in range(3)]
    grads = [torch.randn(33, 7) * 3 for _ in range(3)]

    def params():
        made = [torch.nn.Parameter(w.clone()) for w in start]
        for param, grad in zip(made, grads):
            param.grad = grad.clone()
        return made

    scale = torch.tensor(0.3)
    scaled_first, deferred = params(), params()
    torch._foreach_mul_([p.grad for p in scaled_first], scale)
    reference = build_optimizer(scaled_first, LR, offload="optimizer")
    reference.step()
    optimizer = build_optimizer(deferred, LR, offload="optimizer")
    assert defer_gradient_scale(optimizer, scale, {torch.device("cpu")})
    optimizer.step()
    assert optimizer.grad_scale is None  # the step's post hook forgot it, as after a user's own step
    for ours, theirs in zip(deferred, scaled_first):
        torch.testing.assert_close(ours.grad, theirs.grad)
        torch.testing.assert_close(ours.detach(), theirs.detach())
    before = [p.detach().clone() for p in deferred]
    for param, grad in zip(deferred, grads):
        param.grad = grad.clone()
    for param, grad in zip(scaled_first, grads):
        param.grad = grad.clone()
    optimizer.step()  # unclipped: the whole gradients
    reference.step()
    for ours, theirs, old in zip(deferred, scaled_first, before):
        torch.testing.assert_close(ours.detach(), theirs.detach())
        assert not torch.equal(ours.detach(), old)
    foreach = build_optimizer(params(), LR)
    assert not foreach.defaults["fused"] and not defer_gradient_scale(foreach, scale, {torch.device("cpu")})
    # deferred again: one hook still; a scale left by a step that never ran is cleared explicitly
    assert defer_gradient_scale(optimizer, scale, {torch.device("cpu")})
    assert len(optimizer._optimizer_step_post_hooks) == 1
    clear_gradient_scale(optimizer)
    assert optimizer.grad_scale is None


def test_a_step_that_raises_leaves_no_deferred_scale(one_process_group):
    """`train_step` hands the clip's scale to a fused AdamW; if the step raises, the scale is dropped
    (a `finally`), so the next step cannot divide by a stale one."""
    import pytest

    from autopar.models import build_model
    from autopar.runtime.parallelize import parallelize

    overrides = tiny_config()
    (batch,) = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, 1)
    plan = make_plan("gpt", overrides, dict(dp=1, tp=1, pp=1, microbatch=GLOBAL_BATCH), 1, GLOBAL_BATCH)
    spec = build_model("gpt", overrides)
    parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=SEED)
    optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR, fused=True)  # fused on the CPU: the scale defers
    seen = []

    def failing_step(*_args, **_kwargs):
        seen.append(optimizer.grad_scale)
        raise RuntimeError("injected")

    optimizer.step = failing_step
    with pytest.raises(RuntimeError, match="injected"):
        parallel.train_step(batch, optimizer, max_grad_norm=1e-3)  # a small norm: the clip scales
    assert seen and seen[0] is not None  # the scale was deferred to the step
    assert getattr(optimizer, "grad_scale", None) is None


def _train_with_adamw(job: dict) -> dict:
    """In each process: the plan's model stepped by the runtime's AdamW (`build_optimizer`), or by a
    fused AdamW a user built over `parallel.parameters()` (its clip scale deferred to the step)."""
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", job["overrides"])
    parallel = parallelize(spec.module, Plan.from_json(job["plan"]), loss_fn=spec.loss_fn, seed=SEED)
    if job["optimizer"] == "runtime":
        optimizer = parallel.build_optimizer(LR)
    else:
        optimizer = torch.optim.AdamW(parallel.parameters(), lr=LR, fused=True)
    kinds = sorted({type(p).__name__ for p in parallel.parameters()})
    losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in job["data"]]
    state = parallel.full_state_dict()
    return {"losses": losses, "kinds": kinds, "optimizer": type(optimizer).__name__,
            "state": state if parallel.layout.tp_rank == 0 else None}


def test_adamw_steps_tensor_parallel_shards_beside_plain_weights_like_one_process():
    """Tensor parallelism without sp keeps the norms' weights plain beside DTensor shards. torch's
    foreach and fused AdamW refused that mix ("got mixed torch.Tensor and DTensor") at the first step
    of every such plan: `train_step` steps the runtime's AdamW and a user's own fused one under implicit
    replication (`runtime.optimizer.step_context`). Both train like one process, as the all-DTensor
    case with sp does."""
    from parity_harness import run_plans

    overrides = tiny_config()
    data = batches(overrides["vocab"], GLOBAL_BATCH, SEQ, STEPS)
    cases = [(dict(dp=1, tp=2, pp=1, zero=0, sp=False, microbatch=GLOBAL_BATCH), "runtime"),
             (dict(dp=1, tp=2, pp=1, zero=0, sp=False, microbatch=GLOBAL_BATCH), "user fused"),
             (dict(dp=1, tp=2, pp=1, zero=0, sp=True, microbatch=GLOBAL_BATCH), "runtime")]
    jobs = [dict(plan=make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH).to_json(), overrides=overrides,
                 data=data, optimizer=optimizer) for strategy, optimizer in cases]
    reference = _reference(overrides, data)
    for (strategy, optimizer), ranks in zip(cases, run_plans(2, jobs, runner=_train_with_adamw)):
        kinds = ranks[0]["kinds"]
        assert kinds == (["DTensor"] if strategy["sp"] else ["DTensor", "Parameter"]), (strategy, kinds)
        assert ranks[0]["optimizer"] == "AdamW"  # torch's own: a checkpoint names it alike under every plan
        for rank in ranks:
            torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference), rtol=1e-5, atol=0)

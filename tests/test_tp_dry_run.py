"""Dry runs of planned tp placements (`runtime.tensor_parallel.dry_run`, `runtime.tensor_parallel.realization`): what they
decide and what they record, checked against independent derivations; refusals before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parity_harness import run_plans, tiny_config

# --- a custom op with no DTensor sharding rule: tp cannot run through it ------------------------


@torch.library.custom_op("autopar_test::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softsign.register_fake
def _(x):
    return torch.empty_like(x)


def _softsign_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs()) ** 2


softsign.register_autograd(_softsign_backward,
                           setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class CustomKernelLM(nn.Module):
    """A model whose forward calls a custom kernel (as models with hand-written kernels do) and
    reshapes with its configured group count (so local shards break it too)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(16, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        groups = softsign(self.up(h)).reshape(*ids.shape, 4, 16).mean(dim=-2)
        return self.head(h + self.down(groups))


class AttentionLM(nn.Module):
    """nn.MultiheadAttention between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        attended, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + attended))


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _graph(model, seq_len: int = 8):
    from autopar.cost_models.facts import model_facts
    from autopar.graph import trace

    example = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    graph = trace(model, (example,), loss_fn=next_token_loss, name=type(model).__name__, seq_len=seq_len)
    return example, graph, model_facts(graph, heads=4, kv_heads=4, vocab=64)


def test_a_model_whose_tp_cannot_run_is_refused_before_anything_runs():
    """Its dry run fails in the custom kernel (no DTensor rule): asked for tp=2, the search says so in one
    line before any process starts; left free, it offers no tp > 1 and lists the reason."""
    from autopar.cluster import load_cluster
    from autopar.errors import AutoparError
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.search import search

    model = CustomKernelLM()
    example, graph, facts = _graph(model)
    capabilities = capabilities_for(model, example, next_token_loss)
    cluster = load_cluster("dgx-h100", gpus=2)
    with pytest.raises(AutoparError) as refused:
        search(graph, facts, cluster, 8, fixed=dict(tp=2), use_ilp=False, capabilities=capabilities)
    message = str(refused.value)
    assert "\n" not in message
    assert "tensor parallelism (tp=2) does not run on this model" in message
    assert "autopar_test.softsign" in message and "sharding strategy" in message
    free = search(graph, facts, cluster, 8, use_ilp=False, capabilities=capabilities)
    assert all(candidate.strategy.tp == 1 for candidate in free.ranked)
    assert any("autopar_test.softsign" in reason for reason in free.rejected), free.rejected


def test_multihead_attention_stays_replicated_with_a_reason():
    """DTensor cannot shard nn.MultiheadAttention per head (its forward folds heads into the batch
    dimension): the dry run finds where it fails, keeps that module replicated, shards the rest; with
    it replicated the module rules run them (a vocabulary-parallel embedding and head)."""
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.tp_placements import planned_tp_placements

    model = AttentionLM()
    example, graph, facts = _graph(model)
    realize = capabilities_for(model, example, next_token_loss).tp_realization
    planned = planned_tp_placements({}, graph, facts, 2)
    assert planned["attn.in_proj_weight"] == "S(0)" and planned["attn.out_proj.weight"] == "S(1)"
    realization = realize(planned, 2, False, 2)
    assert realization.name == "modules"
    assert {name: value for name, value in realization.placements.items() if value != "R"} == {
        "embed.weight": "S(0)", "head.weight": "S(0)", "head.bias": "S(0)"}
    (note,) = realization.notes
    assert note.startswith("attn keeps its parameters replicated") and "unflatten" in note


@pytest.mark.parametrize("precision, sp", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_dry_run_of_the_megatron_layout_sends_what_the_graph_predicts(precision, sp):
    """Two independent derivations agree on the zoo GPT: the graph's Megatron propagation
    (`step_collectives`) and the dry run of the module rules, with and without full recompute.
    Under bf16 autocast the ledger prices every activation collective in bf16, as Megatron-LM sends
    them: the block inputs, the head's input and the embedding's partial output are sent so too
    (runtime/tensor_parallel/autocast.py), with sequence parallelism's all-gathers and reduce-scatters."""
    from autopar.cost_models.collectives import step_collectives
    from autopar.cost_models.placed_collectives import dry_run_ledger
    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.collectives import head_vocab
    from autopar.graph import trace
    from autopar.models import build_model
    from autopar.plan_schema import Strategy
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.tp_placements import planned_tp_placements

    spec = build_model("gpt", tiny_config())
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, name="gpt", seq_len=16,
                  precision=precision)
    facts = model_facts(graph, heads=4, kv_heads=4, vocab=96)
    realize = capabilities_for(spec.module, spec.example_inputs(1)[0], spec.loss_fn, precision).tp_realization
    layers = tuple(facts.units[i].name for i in facts.layer_units)
    for recompute in ("none", "full"):
        s = Strategy(dp=1, tp=2, pp=1, sp=sp, microbatch=2, num_microbatches=3, recompute=recompute)
        realization = realize(planned_tp_placements({}, graph, facts, 2), 2, sp, 2, recompute, layers)
        assert realization.name == "modules", realization.reason
        ledger = step_collectives([list(facts.units)], s, precision, 0, seq_len=16, vocab=head_vocab(facts, s),
                                  clip_grad_norm=False)
        predicted = {kind: (calls, round(size)) for (axis, kind), (calls, size) in ledger.items() if axis == "tp"}
        recomputed = set(layers) if recompute == "full" else set()
        assert dry_run_ledger(realization.collectives, 3, recomputed) == predicted, recompute
        loss_parallel_bytes = 2 * 15 * 4  # the vocab-parallel loss's fp32 per-token max and sums
        sent = {c.bytes for c in realization.collectives if c.phase != "step" and c.bytes != loss_parallel_bytes}
        activation_bytes = 2 * 16 * 32 * (2 if precision == "bf16" else 4)  # one micro-batch's, in `precision`
        # Every activation collective carries `precision`: the micro-batch's hidden states (whole, as the
        # counter sizes all-gathers and reduce-scatters) and the position table's lookup (no batch dimension).
        assert sent == {activation_bytes, activation_bytes // 2}, sent


def test_dry_runs_are_cached_and_every_alias_of_a_tied_weight_counts_once():
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    model = AttentionLM()
    example, _, _ = _graph(model)
    realize = capabilities_for(model, example, next_token_loss).tp_realization
    placements = {"embed.weight": "S(0)", "head.weight": "S(0)", "head.bias": "S(0)"}
    first = realize(placements, 2, False, 2)
    runs = realize.dry_runs
    assert realize(dict(placements), 2, False, 2) is first and realize.dry_runs == runs
    realize(placements, 2, False, 4)  # another micro-batch size is another dry run
    assert realize.dry_runs == runs + 1


def _dry_run_in_a_process_group(job: dict) -> dict:
    """In a spawned process with a live gloo group: the dry run must leave it alone (a subprocess)."""
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    model = AttentionLM()
    model.load_state_dict(job["state"])
    realize = capabilities_for(model, torch.zeros(1, 8, dtype=torch.long), next_token_loss).tp_realization
    realization = realize(job["placements"], 2, False, 2)
    dist.barrier()  # the live group still works
    return {"name": realization.name, "collectives": realization.collectives, "world": dist.get_world_size()}


def test_with_a_live_process_group_the_dry_run_runs_in_a_subprocess():
    from autopar.runtime.tensor_parallel.realization import capabilities_for

    model = AttentionLM()
    placements = {"embed.weight": "S(0)", "head.weight": "S(0)", "head.bias": "S(0)"}
    here = capabilities_for(model, torch.zeros(1, 8, dtype=torch.long), next_token_loss).tp_realization(
        placements, 2, False, 2)
    ((there,),) = run_plans(1, [dict(state=model.state_dict(), placements=placements)],
                            runner=_dry_run_in_a_process_group)
    assert there["world"] == 1 and there["name"] == here.name == "modules"
    assert there["collectives"] == here.collectives and here.collectives


def test_cpu_attention_runs_on_each_ranks_heads():
    """The CPU flash-attention handler: on rank 0 of a (fake) tp=2 group, heads-sharded q, k, v with
    every mask shape give rank 0's heads of the one-process result, forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar.runtime.tensor_parallel.dtensor_rules  # noqa: F401

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=generator, requires_grad=True) for _ in range(3))
    masks = [None, torch.randn(2, 1, 8, 8, generator=generator), torch.randn(1, 4, 8, 8, generator=generator),
             torch.randn(2, 4, 8, 8, generator=generator), torch.ones(8, 8, dtype=torch.bool).tril()]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for mask in masks:
            expected = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            grads = torch.autograd.grad(expected.pow(2).sum(), (q, k, v))
            local = [t.detach()[:, :2].clone().requires_grad_() for t in (q, k, v)]
            sharded = [DTensor.from_local(t, mesh, [Shard(1)]) for t in local]
            given_mask = mask if mask is None else DTensor.from_local(mask, mesh, [Replicate()])
            with implicit_replication():
                out = nn.functional.scaled_dot_product_attention(*sharded, attn_mask=given_mask)
            assert out.placements == (Shard(1),)
            torch.testing.assert_close(out.to_local(), expected[:, :2], rtol=1e-5, atol=1e-6)
            out.to_local().pow(2).sum().backward()
            for mine, whole in zip(local, grads):
                torch.testing.assert_close(mine.grad, whole[:, :2], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_convolution_and_restride_gaps_run_replicated():
    """The smaller DTensor gaps `runtime.tensor_parallel.dtensor_rules` fills, on rank 0 of a (fake) tp=2 group with
    replicated tensors (no communication, so values are checkable): a convolution's backward whose
    input was a plain tensor (Whisper's stem), and a pooler's 1x1 average (Swin's), forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar.runtime.tensor_parallel.dtensor_rules  # noqa: F401

    generator = torch.Generator().manual_seed(0)
    conv = nn.Conv1d(3, 4, kernel_size=3, padding=1)
    signal = torch.randn(2, 3, 10, generator=generator)
    expected = conv(signal)
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), tuple(conv.parameters()))
    hidden = torch.randn(2, 5, 4, generator=generator, requires_grad=True)
    pooled = nn.AdaptiveAvgPool1d(1)(hidden.transpose(1, 2))
    (pooled_grad,) = torch.autograd.grad(pooled.pow(2).sum(), hidden)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        weight, bias = (nn.Parameter(DTensor.from_local(p.detach().clone(), mesh, [Replicate()])) for p in
                        conv.parameters())
        with implicit_replication():
            out = nn.functional.conv1d(signal, weight, bias, padding=1)
            out.to_local().pow(2).sum().backward()
        torch.testing.assert_close(out.to_local(), expected)
        torch.testing.assert_close(weight.grad.to_local(), expected_grads[0])
        torch.testing.assert_close(bias.grad.to_local(), expected_grads[1])
        # Partial sums with the whole value on rank 0: the fake group's reductions leave rank 0's
        # value as it is, which is then the true sum; the pooler restrides in place, then in backward
        local = hidden.detach().clone().requires_grad_()
        partial = DTensor.from_local(local, mesh, [Partial()])
        out = nn.AdaptiveAvgPool1d(1)(partial.transpose(1, 2))
        torch.testing.assert_close(out.to_local(), pooled)
        out.to_local().pow(2).sum().backward()
        torch.testing.assert_close(local.grad, pooled_grad)
    finally:
        dist.destroy_process_group()


class ResidualInsideBlockLM(nn.Module):
    """A block that adds its own input back (the residual inside the block): under autocast its input
    cannot be sent in bf16 without rounding what the residual reads."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(32, 64)
            self.down = nn.Linear(64, 32)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.block = self.Block()
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_under_autocast_a_block_whose_input_feeds_a_residual_is_refused_by_name():
    from autopar.runtime.tensor_parallel.dry_run import MODULES, DryRunSpec, dry_run

    placements = (("block.down.weight", "S(1)"), ("block.up.bias", "S(0)"), ("block.up.weight", "S(0)"))
    spec = DryRunSpec(tp=2, placements=placements, realization=MODULES, microbatch=2, precision="bf16",
                      head_path="head")
    outcome = dry_run(ResidualInsideBlockLM(), torch.zeros(1, 8, dtype=torch.long), next_token_loss, spec)
    assert outcome.failed_module == "block"
    assert outcome.reason.startswith("AutoparError: tensor-parallel block block reads its input in add besides its "
                                     "linear projections"), outcome.reason


# --- a deep model's dry run, answered by its shallow twins (`runtime.tensor_parallel.twin_dry_run`) ---------

class _Stacked(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))


def _synthetic_run(step_bytes, fail_at=None, last_differs_in=None):
    """A dry run by depth: two forward all-reduces per block, and one step all-reduce whose size
    `step_bytes(depth)` gives; with `last_differs_in`, that model's last block sends one more."""
    from autopar.capabilities import TpCollective
    from autopar.runtime.tensor_parallel.dry_run import DryRun

    asked = []

    def run(twin, spec):
        depth = len(twin.layers)
        asked.append((depth, spec.placements, spec.recompute))
        if depth == fail_at:
            return DryRun(reason="RuntimeError: no")
        records = [TpCollective("forward", "all_reduce", 64, f"layers.{k}.{part}") for k in range(depth)
                   for part in ("attn", "mlp")]
        if last_differs_in is not None and twin.layers[-1] is last_differs_in.layers[-1]:
            records.append(TpCollective("forward", "all_gather", 64, f"layers.{depth - 1}"))
        records += [TpCollective("recompute", "all_reduce", 64, f"layers.{k}") for k in range(depth) if spec.recompute]
        return DryRun(reason=None, collectives=tuple(records + [TpCollective("step", "all_reduce", step_bytes(depth), "")]))
    return run, asked


def test_twins_answer_for_the_whole_depth_only_when_they_grow_alike():
    from collections import Counter

    from autopar.runtime.tensor_parallel.dry_run import MODULES, DryRunSpec
    from autopar.runtime.tensor_parallel.twin_dry_run import TWIN_DEPTHS, dry_run_on_twins

    model = _Stacked(20)
    placements = tuple(sorted({f"layers.{k}.weight": "S(0)" for k in range(20)}.items()))
    every = tuple(f"layers.{k}" for k in range(20))
    spec = DryRunSpec(tp=2, placements=placements, realization=MODULES, microbatch=1, recompute=every)
    run, asked = _synthetic_run(lambda depth: 100 + 8 * depth)
    answer = dry_run_on_twins(model, spec, run)
    assert [depth for depth, _, _ in asked] == [*TWIN_DEPTHS, 3]  # and the last two blocks behind the first
    assert asked[0][1] == tuple(item for item in placements if item[0] in ("layers.0.weight", "layers.1.weight"))
    assert asked[0][2] == ("layers.0", "layers.1")
    from autopar.capabilities import TpCollective

    assert Counter(answer.collectives)[TpCollective("forward", "all_reduce", 64, "layers.19.mlp")] == 1
    assert sum(1 for c in answer.collectives if c.phase == "forward") == 40
    assert {c.module for c in answer.collectives if c.phase == "recompute"} == set(every)
    assert [c.bytes for c in answer.collectives if c.phase == "step"] == [100 + 8 * 20]

    assert dry_run_on_twins(model, spec, _synthetic_run(lambda depth: 100 + depth ** 2)[0]) is None  # not linear
    assert dry_run_on_twins(model, spec, _synthetic_run(lambda depth: 100, fail_at=3)[0]) is None  # a twin failed
    some = dataclasses.replace(spec, recompute=every[:5])  # recompute that differs between blocks
    assert dry_run_on_twins(model, some, _synthetic_run(lambda depth: 100)[0]) is None
    uneven = dataclasses.replace(spec, placements=placements[:-1] + (("layers.9.weight", "R"),))
    assert dry_run_on_twins(model, uneven, _synthetic_run(lambda depth: 100)[0]) is None
    assert dry_run_on_twins(_Stacked(10), spec, _synthetic_run(lambda depth: 100)[0]) is None  # shallow: whole
    assert dry_run_on_twins(model, spec, _synthetic_run(lambda depth: 100, last_differs_in=model)[0]) is None
    model.layers[7].window = 4  # one block set apart (a sliding-window layer among global ones)
    assert dry_run_on_twins(model, spec, _synthetic_run(lambda depth: 100)[0]) is None
    del model.layers[7].window
    model.layers[7].layer_idx = 7  # what numbers a layer does not set it apart
    assert dry_run_on_twins(model, spec, _synthetic_run(lambda depth: 100)[0]) is not None


def _compare_twins_with_the_whole_model(family: str, config: str, monkeypatch) -> None:
    from collections import Counter

    from autopar.cost_models.facts import model_facts
    from autopar.cost_models.placed_collectives import dry_run_ledger
    from autopar.graph import trace
    from autopar.models import build_model
    from autopar.runtime.tensor_parallel import twin_dry_run
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.tp_placements import planned_tp_placements

    spec = build_model(family, config)
    graph = trace(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16")
    facts = model_facts(graph, heads=4, kv_heads=4, vocab=spec.config.padded_vocab)
    layers = tuple(facts.units[i].name for i in facts.layer_units)
    placements = planned_tp_placements({}, graph, facts, 2)
    for recompute in ("none", "full", "selective"):
        paths = layers if recompute != "none" else ()
        answers = {}
        for whole in (False, True):
            monkeypatch.setattr(twin_dry_run, "MIN_BLOCKS", 10**6 if whole else 16)
            realize = capabilities_for(spec.module, spec.example_inputs(1)[0], spec.loss_fn, "bf16").tp_realization
            answers[whole] = realize(placements, 2, False, 2, recompute, paths)
            assert realize.twin_answers == (0 if whole else 1)
        twins, whole = answers[False], answers[True]
        assert twins.name == whole.name and twins.name is not None
        assert Counter((c.phase, c.kind, c.bytes) for c in twins.collectives) == \
            Counter((c.phase, c.kind, c.bytes) for c in whole.collectives), recompute
        assert Counter(c for c in twins.collectives if c.phase == "recompute") == \
            Counter(c for c in whole.collectives if c.phase == "recompute")
        for recomputed in (set(), set(paths)):
            assert dry_run_ledger(twins.collectives, 3, recomputed) == dry_run_ledger(whole.collectives, 3, recomputed)
    import autopar  # and the plan priced from either is the same
    planned = {}
    for whole in (False, True):
        monkeypatch.setattr(twin_dry_run, "MIN_BLOCKS", 10**6 if whole else 16)
        result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, precision="bf16",
                              cluster=autopar.load_cluster("dgx-h100", gpus=2), global_batch=4,
                              strategy="tp=2,recompute=full,microbatch=2", use_ilp=False, probe_cache=None)
        planned[whole] = (result.prediction.step_time_s, result.prediction.peak_memory_bytes,
                          result.plan.predicted if result.plan is not None else None)
    assert planned[False] == planned[True]


def test_a_deep_models_module_rule_dry_run_is_its_twins(monkeypatch):
    """GPT, 16 blocks, the module rules: the twins' answer counts what the whole model's dry run
    sends, per phase, kind and size, recomputes the same layers, and prices the same plan."""
    _compare_twins_with_the_whole_model("gpt", "layers=16,hidden=64,heads=4,seq_len=32,vocab=128", monkeypatch)


@pytest.mark.slow
def test_a_deep_moe_models_dtensor_dry_run_is_its_twins(monkeypatch):
    """The zoo's MoE Llama, 16 blocks, DTensor: the step's one all-reduce of the partial gradients
    grows in size with depth (not in number), and is extrapolated so."""
    _compare_twins_with_the_whole_model(
        "llama", "layers=16,hidden=64,heads=4,kv_heads=4,seq_len=32,vocab=128,moe_experts=4,moe_top_k=2", monkeypatch)

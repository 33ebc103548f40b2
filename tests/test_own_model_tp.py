"""Tensor parallelism by the module rules on a model written here in plain torch, as users write one: a
bare position table beside the embedding, attention in a module of its own, and the MLP's two Linears
held by the residual block itself, beside its norms. It trains like one process (losses and final
weights) under each recompute policy, and sends the collectives its plan predicted
(`tests/test_runtime_parity.py`'s checks). Sequence parallelism runs once the table is a module of its
own; beside the embedding it is refused before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parity_harness import SEED, plan_for, run_plans, train_parallel, train_reference

VOCAB, HIDDEN, HEADS, SEQ = 64, 32, 4, 16
GLOBAL_BATCH, STEPS = 4, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, HIDDEN // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """The MLP inline: `up` and `down` are the block's own Linears, beside its norms and attention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(HIDDEN), Attention(), nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PositionTable(nn.Module):
    """A learned table added to the stream, as a module of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


class OwnLM(nn.Module):
    """`table_module`: the position table in a module of its own, else a bare parameter of the model."""

    def __init__(self, table_module: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        if table_module:
            self.positions = PositionTable()
        else:
            self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)  # a bare table, not an nn.Embedding
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = self.positions(x) if hasattr(self, "positions") else x + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(table_module: bool = False) -> OwnLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return OwnLM(table_module)


def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def run_job(job: dict) -> dict:
    from autopar.plan_schema import Plan

    return train_parallel(build(job["table_module"]), loss_fn, Plan.from_json(job["plan"]), job["data"])


def _plan(strategy: dict, table_module: bool = False):
    return plan_for(build(table_module), (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),), loss_fn,
                    name="own-lm", seq_len=SEQ, heads=HEADS, kv_heads=HEADS, vocab=VOCAB, strategy=strategy, world=2,
                    global_batch=GLOBAL_BATCH)


STRATEGIES = [dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="none", sp=False),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=2, recompute="full", sp=False),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="selective", sp=False)]
WITH_SP = [dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="none", sp=True),
           dict(dp=1, tp=2, pp=1, zero=0, microbatch=2, recompute="selective", sp=True)]


def test_module_rules_train_a_users_own_model_like_one_process():
    from test_runtime_parity import _check

    generator = torch.Generator().manual_seed(SEED + 1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]
    cases = [(strategy, False) for strategy in STRATEGIES] + [(strategy, True) for strategy in WITH_SP]
    plans = [_plan(strategy, table_module) for strategy, table_module in cases]
    assert [plan.tp_realization for plan in plans] == ["modules"] * len(plans)  # not DTensor's fallback
    results = run_plans(2, [dict(plan=plan.to_json(), data=data, table_module=table_module)
                            for plan, (_, table_module) in zip(plans, cases)], runner=run_job)
    for plan, ranks, (strategy, table_module) in zip(plans, results, cases):
        losses, state = train_reference(copy.deepcopy(build(table_module)), loss_fn, data)
        _check(strategy, plan, ranks, losses, state)


def test_sequence_parallelism_with_a_bare_table_beside_the_embedding_is_refused_before_anything_runs():
    from autopar.errors import AutoparError

    with pytest.raises(AutoparError) as refused:
        _plan(WITH_SP[0])
    assert "sequence parallelism does not run on this model: pos is a parameter of OwnLM, beside its " \
           "submodules" in str(refused.value)


def test_the_position_tables_gradient_is_gathered_under_sequence_parallelism():
    """Each rank's position-table gradient holds its own positions' rows: one all-gather of it whole per
    step (fp32), priced beside the norms' summed gradients."""
    ledger = {row.kind: (row.calls, row.bytes) for row in _plan(WITH_SP[0], True).predicted.collectives[0]
              if row.axis == "tp"}
    without = {row.kind: (row.calls, row.bytes) for row in _plan(STRATEGIES[0], True).predicted.collectives[0]
               if row.axis == "tp"}
    assert "all_gather" not in without
    gathers = 2 * (3 * 2 + 1)  # each block's two inputs and the head's, gathered in forward and in backward
    per_micro_batch = GLOBAL_BATCH * SEQ * HIDDEN * 4  # fp32 activations, the whole micro-batch of 4
    assert ledger["all_gather"] == (gathers + 1, gathers * per_micro_batch + SEQ * HIDDEN * 4)


def test_one_column_parallel_linear_beside_other_layers_gathers_its_own_input():
    """Where a block holds one column-parallel linear beside its norms, that linear's input is the block
    input the rules gather; where it holds several (attention with q/k norms, as Qwen3's), the module's
    own input is, as before."""
    from autopar.runtime.tensor_parallel.module_rules import _BlockInput, _Chained, _styles

    class QkNormAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
            self.q_norm, self.k_norm = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)

    own = _styles(build(), {"blocks.0.up.weight": "S(0)", "blocks.0.up.bias": "S(0)",
                            "blocks.0.down.weight": "S(1)"}, sp=False, head_path="head")
    assert isinstance(own["blocks.0.up"], _Chained) and "blocks.0" not in own
    assert isinstance(own["blocks.0.up"].styles[0], _BlockInput) and own["blocks.0.up"].styles[0].path == "blocks.0.up"
    qk = _styles(nn.ModuleDict({"attn": QkNormAttention()}),
                 {**{f"attn.{p}.{w}": "S(0)" for p in "qkv" for w in ("weight", "bias")}, "attn.o.weight": "S(1)"},
                 sp=False)
    assert isinstance(qk["attn"], _BlockInput) and not isinstance(qk["attn.q"], _Chained)


def test_the_plan_file_check_reads_the_plans_own_placements():
    """A bare 2-D parameter outside nn.Linear/nn.Embedding refuses the module rules only while
    placements are unknown; a plan that keeps it replicated is accepted before anything runs."""
    from autopar.runtime.tensor_parallel.module_rules import plan_refusal, static_capabilities

    plan = _plan(STRATEGIES[0])
    assert plan.param_placements["pos"] == "RR"
    assert static_capabilities(build()).tensor_parallel_refusal is not None  # without placements
    assert plan_refusal(build(), plan) is None
    sharded = plan.model_copy(update={"param_placements": {**plan.param_placements, "pos": "RS(0)"}})
    assert "pos is S(0) over tp, but the runtime shards only Linear and Embedding parameters" in plan_refusal(
        build(), sharded)
    with_sp = plan.model_copy(update={"strategy": plan.strategy.model_copy(update={"sp": True})})
    assert plan_refusal(build(), with_sp).startswith("sequence parallelism does not run on this model")


@pytest.mark.slow  # ~40 s on 4 processes
def test_sequence_parallelism_with_pipeline_stages_on_four_processes():
    """Pipeline stages hand on local shards: the table's module gives one back (it gave a DTensor, which
    the next block's residual add refused mid-step)."""
    from test_runtime_parity import _check

    generator = torch.Generator().manual_seed(SEED + 1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]
    strategy = dict(dp=1, tp=2, pp=2, schedule="1f1b", zero=0, microbatch=2, recompute="none", sp=True)
    plan = plan_for(build(True), (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),), loss_fn, name="own-lm",
                    seq_len=SEQ, heads=HEADS, kv_heads=HEADS, vocab=VOCAB, strategy=strategy, world=4,
                    global_batch=GLOBAL_BATCH)
    (ranks,) = run_plans(4, [dict(plan=plan.to_json(), data=data, table_module=True)], runner=run_job)
    losses, state = train_reference(copy.deepcopy(build(True)), loss_fn, data)
    _check(strategy, plan, ranks, losses, state)


def test_a_table_module_hands_pipeline_stages_local_shards():
    """What the slow pp test runs, on one process: under sp with the logits gathered (the stream of
    pipeline stages: local shards), the table's module gives back a local shard for the residual add."""
    from autopar.runtime.tensor_parallel.dry_run import MODULES, DryRunSpec, dry_run
    from autopar.runtime.tensor_parallel.module_rules import tp_placement

    plan = _plan(WITH_SP[0], True)
    placements = {name: tp_placement(text) for name, text in plan.param_placements.items()}
    spec = DryRunSpec(realization=MODULES, sp=True, head_path="head", vocab_parallel_loss=False, tp=2,
                      placements=tuple(sorted(placements.items())), microbatch=1, precision="fp32", recompute=(),
                      recompute_policy="none")
    outcome = dry_run(build(True), torch.zeros(1, SEQ, dtype=torch.long), loss_fn, spec)
    assert outcome.ok, outcome.reason

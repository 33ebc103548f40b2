"""Tensor parallelism by the module rules on a model written here in plain torch, as users write one: a
bare position table beside the embedding, attention in a module of its own, and the MLP's two Linears
held by the residual block itself, beside its norms. It trains like one process (losses and final
weights), with and without sequence parallelism and recompute, and sends the collectives its plan
predicted (`tests/test_runtime_parity.py`'s checks)."""

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


class OwnLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)  # a bare table, not an nn.Embedding
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build() -> OwnLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return OwnLM()


def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def run_job(job: dict) -> dict:
    from autopar.plan_schema import Plan

    return train_parallel(build(), loss_fn, Plan.from_json(job["plan"]), job["data"])


def _plan(strategy: dict):
    return plan_for(build(), (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),), loss_fn, name="own-lm",
                    seq_len=SEQ, heads=HEADS, kv_heads=HEADS, vocab=VOCAB, strategy=strategy, world=2,
                    global_batch=GLOBAL_BATCH)


STRATEGIES = [dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="none", sp=False),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=2, recompute="full", sp=False),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="selective", sp=False),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=4, recompute="none", sp=True),
              dict(dp=1, tp=2, pp=1, zero=0, microbatch=2, recompute="selective", sp=True)]


def test_module_rules_train_a_users_own_model_like_one_process():
    from test_runtime_parity import _check

    generator = torch.Generator().manual_seed(SEED + 1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]
    plans = [_plan(strategy) for strategy in STRATEGIES]
    assert [plan.tp_realization for plan in plans] == ["modules"] * len(plans)  # not DTensor's fallback
    results = run_plans(2, [dict(plan=plan.to_json(), data=data) for plan in plans], runner=run_job)
    losses, state = train_reference(copy.deepcopy(build()), loss_fn, data)
    for plan, ranks, strategy in zip(plans, results, STRATEGIES):
        _check(strategy, plan, ranks, losses, state)


def test_the_position_tables_gradient_is_gathered_under_sequence_parallelism():
    """Each rank's position-table gradient holds its own positions' rows: one all-gather of it whole per
    step (fp32), priced beside the norms' summed gradients."""
    ledger = {row.kind: (row.calls, row.bytes) for row in _plan(STRATEGIES[3]).predicted.collectives[0]
              if row.axis == "tp"}
    without = {row.kind: (row.calls, row.bytes) for row in _plan(STRATEGIES[0]).predicted.collectives[0]
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


@pytest.mark.parametrize("sp", [False, True])
def test_the_plan_file_check_reads_the_plans_own_placements(sp):
    """A bare 2-D parameter outside nn.Linear/nn.Embedding refuses the module rules only while
    placements are unknown; a plan that keeps it replicated is accepted before anything runs."""
    from autopar.runtime.tensor_parallel.module_rules import plan_refusal, static_capabilities

    plan = _plan(STRATEGIES[3 if sp else 0])
    assert plan.param_placements["pos"] == "RR"
    assert static_capabilities(build()).tensor_parallel_refusal is not None  # without placements
    assert plan_refusal(build(), plan) is None
    sharded = plan.model_copy(update={"param_placements": {**plan.param_placements, "pos": "RS(0)"}})
    assert "pos is S(0) over tp, but the runtime shards only Linear and Embedding parameters" in plan_refusal(
        build(), sharded)

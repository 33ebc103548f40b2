"""What data parallelism and pipeline cuts send for parameters and tensors the usual model lacks:
a frozen parameter (no gradient to sync), a trainable one no op reads (a dp bucket still reduces its
zero gradient; FSDP2 reduce-scatters nothing for it) and a tensor made from weights alone but
expanded to the batch (learned queries), which crosses a pipeline cut once per sample.

Found by `benchmarks/zoo_coverage.py`: Whisper's frozen position table was priced in the gradient
sync, BEiT's unread mask token was not, and Whisper's decoder ids, built to the batch size, crossed
its encoder/decoder cut four times the bytes priced.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from parity_harness import SEED, plan_for, run_plans, train_parallel, train_reference

VOCAB, HIDDEN, SEQ, QUERIES = 48, 16, 8, 4
GLOBAL_BATCH, STEPS = 4, 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class QueriesModel(nn.Module):
    """Token embedding plus a frozen position table, an unread mask token, learned queries expanded to
    the batch and read only by the head (so they cross every pipeline cut), four blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Parameter(torch.randn(SEQ, HIDDEN), requires_grad=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.queries = nn.Parameter(torch.randn(QUERIES, HIDDEN))
        self.query_proj = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions
        queries = self.query_proj(self.queries).expand(ids.shape[0], QUERIES, HIDDEN)
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, :QUERIES] + queries)


def build() -> QueriesModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return QueriesModel()


def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, :QUERIES].reshape(-1))


def _example(batch: int) -> torch.Tensor:
    return torch.zeros(batch, SEQ, dtype=torch.long, device="meta")


def _plan(strategy: dict, example_batch: int = 2):
    return plan_for(build(), (_example(example_batch),), loss_fn, name="queries", seq_len=SEQ, heads=1, kv_heads=1,
                    vocab=VOCAB, strategy=strategy, world=2, global_batch=GLOBAL_BATCH)


def _ledger(plan) -> dict:
    return {(row.axis, row.kind): (row.calls, row.bytes) for row in plan.predicted.collectives[0]}


def test_frozen_and_unread_parameters_in_the_priced_gradient_sync():
    """Closed form: the dp bucket reduces every trainable parameter (the unread mask token's zero
    gradient included, the frozen table not); FSDP2 reduce-scatters only gradients that exist."""
    model = build()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dp = _ledger(_plan(dict(dp=2, tp=1, pp=1, zero=0, microbatch=2)))
    assert dp[("dp", "all_reduce")][1] == trainable * 4
    zero3 = _ledger(_plan(dict(dp=2, tp=1, pp=1, zero=3, microbatch=2)))  # one micro-batch per rank
    gathered, reduced = zero3[("dp", "all_gather")][1], zero3[("dp", "reduce_scatter")][1]
    # Each unit is gathered twice (forward, backward) and reduced once. What is gathered but not
    # reduced: the frozen table (8 rows of 16) and the mask token, [1, 1, 16] padded to 2 rows at dp=2.
    assert gathered / 2 - reduced == (SEQ * HIDDEN + 2 * HIDDEN) * 4


def test_batch_expanded_queries_cross_the_cut_per_sample():
    """Traced at batch 2, the queries ([batch, 4, 16], made from weights alone) are priced per sample;
    traced at batch 1 they are not told apart from a weight-made tensor (the gap the docstring of
    `cost_models.units.cut_tensors` states)."""
    strategy = dict(dp=1, tp=1, pp=2, schedule="gpipe", microbatch=2)
    per_sample = _ledger(_plan(strategy))[("pp", "send")]
    once = _ledger(_plan(strategy, example_batch=1))[("pp", "send")]
    activation, queries = 2 * SEQ * HIDDEN * 4, QUERIES * HIDDEN * 4
    assert per_sample[1] == 2 * (activation + 2 * queries)  # two micro-batches of two
    assert once[1] == 2 * (activation + queries)


def run_job(job: dict) -> dict:
    from autopar.plan_schema import Plan

    return train_parallel(build(), loss_fn, Plan.from_json(job["plan"]), job["data"], compile=job["compile"])


STRATEGIES = [dict(dp=2, tp=1, pp=1, zero=0, microbatch=2), dict(dp=2, tp=1, pp=1, zero=3, microbatch=2),
              dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2)]
# ZeRO 1 and 2, optimizer offload and recompute on a user's own model (eager)
MORE = [dict(dp=2, tp=1, pp=1, zero=1, microbatch=2), dict(dp=2, tp=1, pp=1, zero=2, microbatch=2),
        dict(dp=2, tp=1, pp=1, zero=3, microbatch=2, offload="optimizer"),
        dict(dp=2, tp=1, pp=1, zero=0, microbatch=2, recompute="full"),
        dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2, recompute="full", recompute_layers=(1, 1))]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_parity_and_ledger_with_frozen_unread_and_batch_expanded_tensors(compile):
    """Also compiled, as a user's own model: the whole stage with its loss under dp, each block under
    ZeRO 3 and in pipeline stages."""
    from test_runtime_parity import _check

    generator = torch.Generator().manual_seed(SEED + 1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]
    strategies = STRATEGIES if compile else STRATEGIES + MORE
    plans = [_plan(strategy) for strategy in strategies]
    results = run_plans(2, [dict(plan=plan.to_json(), data=data, compile=compile) for plan in plans], runner=run_job)
    losses, state = train_reference(copy.deepcopy(build()), loss_fn, data)
    for plan, ranks, strategy in zip(plans, results, strategies):
        _check(strategy, plan, ranks, losses, state)
    ways = [ranks[0]["compile"] for ranks in results]
    assert ways[0] == ("whole stage with its loss" if compile else "off"), ways
    assert all(way.startswith("per block") if compile else way == "off" for way in ways[1:]), ways

"""Pipeline stages of unequal layer counts, interleaved (vp > 1) and 1F1B: priced in closed form,
cut by the inter-op program, offered by the search, and trained like one process.

Llama 3 405B's layout is the case in point: 126 layers on pp=16 × vp=8 virtual stages, the first
chunk holding the embedding alone and the last the head alone (Dubey et al. 2024, §3.3.2).
"""

from __future__ import annotations

import pytest

from autopar.cost_models.pipeline import estimate, in_flight_counts, peak_held, simulate
from autopar.cost_models.strategy import even_stage_layers
from autopar.searcher.inter_op import UnitCost, in_flight, partition
from parity_harness import batches, make_plan, reference_run, run_plans, tiny_config

GLOBAL_BATCH = 8
STEPS = 4


# --- closed forms ---------------------------------------------------------------------------------

def test_uneven_interleaved_step_time_in_closed_form():
    """pp=2, vp=2, m=2; virtual stages 0..3 on ranks 0,1,0,1 with forwards e, 1, 1, h and backwards
    twice those (no transfer time). Rank 0 runs F0(0) F0(1) F2(0) F2(1) B2(0) B2(1) B0(0) B0(1) in
    Megatron's order (warm-up (pp-1-r)·2 + (vp-1)·pp = 4 forwards), rank 1 F1(0) F1(1) F3(0) B3(0)
    F3(1) B3(1) B1(0) B1(1) (warm-up 2). With e = 0.25 and h = 0.5, each pass starting when its
    rank is free and its input has arrived, by hand:
      rank 0: F0 0–.25, .25–.5; F2 mb0 waits F1(0) (ends 1.25) → 1.25–2.25, mb1 waits F1(1) (2.25) → 2.25–3.25;
      rank 1: F1 .25–1.25, 1.25–2.25; F3(0) waits F2(0) (2.25) → 2.25–2.75, B3(0) 2.75–3.75,
              F3(1) waits F2(1) (3.25) → 3.75–4.25, B3(1) 4.25–5.25;
      rank 0: B2(0) waits B3(0) (3.75) → 3.75–5.75, B2(1) waits B3(1) (5.25) → 5.75–7.75;
      rank 1: B1(0) waits B2(0) (5.75) → 5.75–7.75, B1(1) waits B2(1) (7.75) → 7.75–9.75;
      rank 0: B0(0) waits B1(0) (7.75) → 7.75–8.25, B0(1) waits B1(1) (9.75) → 9.75–10.25.
    """
    e, h = 0.25, 0.5
    forward = [e, 1.0, 1.0, h]
    backward = [2 * f for f in forward]
    result = simulate(forward, backward, 2, "interleaved", pp=2, vp=2)
    assert result.step_time_s == pytest.approx(10.25)
    assert result.rank_end_s == pytest.approx((10.25, 9.75))
    assert result.rank_busy_s == pytest.approx((2 * 3 * (e + 1.0), 2 * 3 * (1.0 + h)))


def test_in_flight_counts_per_chunk_follow_the_pass_order():
    """Rank 0 of pp=4, vp=2, m=8: warm-up 2·3 + 4 = 10 forwards, the peak after the 11th:
    micro-batches 0-3 and 4-6 of chunk 0 (7), 0-3 of chunk 1 (4). Steady state then swaps a
    chunk-1 backward for a chunk-0 forward once, (8, 3). The last rank: warm-up 4, peak (4, 1)."""
    assert in_flight_counts("interleaved", 0, 4, 8, 2) == ((7, 4), (8, 3))
    assert in_flight_counts("interleaved", 3, 4, 8, 2) == ((4, 1), (5, 0))
    assert in_flight_counts("1f1b", 1, 4, 8) == ((3,),)
    assert in_flight_counts("gpipe", 1, 4, 8) == ((8,),)
    # An embedding-only first chunk (weight 0) moves rank 0's peak to the steady state's vector.
    assert peak_held("interleaved", 0, 4, 8, 2, [0.0, 1.0]) == 4.0
    assert peak_held("interleaved", 0, 4, 8, 2, [1.0, 0.0]) == 8.0
    assert peak_held("interleaved", 0, 4, 8, 2, [1.0, 1.0]) == 11.0  # the even case: warm-up + 1 passes


@pytest.mark.parametrize("pp, vp, m", [(2, 2, 4), (3, 2, 6), (4, 3, 8), (4, 2, 4)])
def test_the_estimates_peak_is_the_simulations_for_uneven_chunks(pp, vp, m):
    weights = [0.1 * (1 + (3 * s) % 7) for s in range(pp * vp)]
    times = [1.0 + 0.3 * ((5 * s) % 4) for s in range(pp * vp)]
    simulated = simulate(times, [2 * t for t in times], m, "interleaved", pp=pp, vp=vp, stage_weight=weights)
    estimated = estimate(times, [2 * t for t in times], m, "interleaved", pp=pp, vp=vp, stage_weight=weights)
    assert estimated.peak_in_flight == pytest.approx(simulated.peak_in_flight)


def test_llama3_layout_cuts_the_1f1b_bubble():
    """126 layers (forward 1, backward 2 per layer), an embedding of forward 0.01 and a head of 0.66
    (128,256 × 16,384 against a layer's 3.2B weights), 32 micro-batches: 1F1B on 16 stages of 8 and
    7 layers idles (15 of the slowest rank's passes, 15 · 24 = 360 of 768 + 360) about 32% of the
    step; interleaved over 128 one-layer chunks about (pp - 1) / (m · vp) = 15 / 256 of the work."""
    embed, head = 0.01, 0.66
    sizes = even_stage_layers(126, 16 * 8)
    assert sizes[0] == sizes[-1] == 0 and set(sizes[1:-1]) == {1}
    chunks = [embed] + [1.0] * 126 + [head]
    interleaved = simulate(chunks, [2 * t for t in chunks], 32, "interleaved", pp=16, vp=8)
    layers = even_stage_layers(126, 16)
    stages = [3.0 * n for n in layers]
    stages[0] += 3 * embed
    stages[-1] += 3 * head
    plain = simulate([t / 3 for t in stages], [2 * t / 3 for t in stages], 32, "1f1b", pp=16)
    work = 32 * 3 * 8  # the slowest rank's passes: 8 layers per micro-batch
    assert plain.step_time_s == pytest.approx(work + 15 * 24, rel=0.01)
    assert interleaved.step_time_s == pytest.approx(work * (1 + 15 / 256), rel=0.01)
    quick = estimate(chunks, [2 * t for t in chunks], 32, "interleaved", pp=16, vp=8)
    assert quick.step_time_s == pytest.approx(interleaved.step_time_s, rel=0.01)  # what the ranking sees


# --- the inter-op program -------------------------------------------------------------------------

def test_interleaved_partition_gives_the_heavy_head_a_chunk_of_its_own():
    """An embedding, 10 layers and a head as heavy as 2 layers on pp=2 × vp=2: the balanced chunks
    are [emb + 3 layers], [3], [3], [1 + head] (bottleneck 3.1), which an even split cannot give."""
    costs = [UnitCost(0.1, 1, 1)] + [UnitCost(1.0, 1, 1)] * 10 + [UnitCost(2.0, 1, 1)]
    bounds = partition(costs, 4, num_microbatches=4, vp=2)
    layers = [sum(1 for i in range(a, b) if 0 < i < 11) for a, b in bounds]
    assert layers == [3, 3, 3, 1]


def test_interleaved_partition_holds_each_chunk_to_its_share_of_memory():
    """Each chunk must fit in capacity / vp holding the most micro-batches its rank ever holds of it
    (pp=2, vp=2, m=4: rank 0's chunks 4 and 2, rank 1's 3 and 1), so the early chunks get fewer units.
    Capacity 20, 10 per chunk, units of 1 state byte and 1 activation byte: at most 2, 2, 3 and 5
    units (2 · (1 + 4) = 10, 2 · (1 + 3) = 8, 3 · (1 + 2) = 9, 5 · (1 + 1) = 10), all 12 of them."""
    assert [in_flight(s, 4, 4, "interleaved", vp=2) for s in range(4)] == [4, 3, 2, 1]
    costs = [UnitCost(1.0, 1.0, 1.0)] * 12
    assert partition(costs, 4, num_microbatches=4, vp=2) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    tight = partition(costs, 4, num_microbatches=4, vp=2, memory_capacity_bytes=20.0)
    assert tight == [(0, 2), (2, 4), (4, 7), (7, 12)]
    assert partition(costs, 4, num_microbatches=4, vp=2, memory_capacity_bytes=8.0) is None


# --- the search and the runtime -------------------------------------------------------------------

def _stage_layers(plan) -> list[int]:
    return [sum(1 for unit in stage.units if unit.startswith("layers.")) for stage in plan.stages]


def test_the_search_offers_interleaved_when_layers_do_not_divide_into_stages():
    import autopar
    from autopar.models import build_model

    spec = build_model("gpt", tiny_config(layers=5))
    result = autopar.plan(spec.module, spec.example_inputs(1), cluster=autopar.load_cluster("dgx-h100", gpus=2),
                          global_batch=GLOBAL_BATCH, strategy=dict(dp=1, tp=1, pp=2), loss_fn=spec.loss_fn,
                          precision="fp32", name="gpt", seq_len=16, heads=4, vocab=96)
    offered = {(c.strategy.schedule, c.strategy.vp) for c in result.search.ranked}
    rejected = " ".join(result.search.rejected)
    assert any(schedule == "interleaved" for schedule, _ in offered), (offered, rejected)
    assert "divisible by pp×vp" not in rejected


PARITY = [  # (layers, strategy, layers per stage the plan must give)
    (5, dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2), None),
    (2, dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2), [0, 1, 1, 0]),  # Llama 3's ends
    (3, dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2), None),
]


def test_uneven_stages_train_like_one_process():
    """Interleaved with 5 layers on 4 virtual stages, the embedding and the head each alone on a
    virtual stage, and 1F1B with 3 layers on 2 stages: losses, final weights and each rank's
    collectives (pp sends and receives per cut) as planned."""
    from test_runtime_parity import _check

    jobs, plans, references = [], [], []
    for layers, strategy, expected in PARITY:
        overrides = tiny_config(layers=layers)
        plan = make_plan("gpt", overrides, strategy, 2, GLOBAL_BATCH)
        counts = _stage_layers(plan)
        if expected is None:
            assert len(set(counts)) > 1, counts  # the layers do not divide: the stages differ
        else:
            assert counts == expected, counts
        data = batches(overrides["vocab"], GLOBAL_BATCH, 16, STEPS)
        jobs.append(dict(plan=plan.to_json(), model="gpt", overrides=overrides, data=data))
        plans.append(plan)
        references.append(reference_run("gpt", overrides, data))
    results = run_plans(2, jobs)
    for (layers, strategy, _), plan, ranks, reference in zip(PARITY, plans, results, references):
        _check({"layers": layers, **strategy}, plan, ranks, *reference)

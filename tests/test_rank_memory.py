"""Each rank's peak under tensor parallelism and pipeline stages against the memory model (`profiler.rank_memory`: the CPU
allocator's events around one `train_step` through the runtime, 2 gloo processes, real small tensors).

The loss's layout decides the last stage's largest transient: on vocabulary shards under `loss_parallel`
(a vocabulary-parallel head at pp = 1) its backward holds three fp32 shards of the logits; with the head
kept replicated every tp rank holds the whole logits and two fp32 gradients of them. Before the layout
was priced, these plans measured 15% (sharded) and 40% (replicated) over their prediction. Asserted:
within 2% below and 5% above, on every rank, for the least of 5 steps' peaks (one step's moves by up to
3% under gloo: `step_peak_bytes`; CI's machine once measured a Llama rank at 0.977). A pipeline's last stage keeps each in-flight micro-batch's
logits, and a stage's backward holds its gradients in flight and, accumulating without ZeRO, a weight's
fresh gradient beside its sum: priced since, those stages are within 2% below and 5% above (GPipe's
first stage 20%).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from autopar.cost_models.backward_memory import loss_gradient_bytes  # noqa: E402
from autopar.cost_models.memory import LossLayout  # noqa: E402
from autopar.plan_schema import Strategy  # noqa: E402


def _strategy(**keys) -> Strategy:
    return Strategy(**{"dp": 1, "tp": 1, "pp": 1, "microbatch": 1, "num_microbatches": 1, **keys})


def test_the_loss_layout_follows_the_head_and_the_stages():
    """Vocabulary shards (under `loss_parallel`) only at pp = 1 with a vocabulary-parallel head, whether
    the analytic layout (`vocab` given) or a dry run's placements say so; a pipeline's last stage
    gathers the logits."""
    tp2, pp2 = _strategy(tp=2), _strategy(tp=2, pp=2)
    assert LossLayout.of(tp2, 1024) == LossLayout(vocab_parallel=True) and LossLayout(True).loss_parallel
    assert LossLayout.of(tp2, None) == LossLayout(False)  # the head kept replicated
    assert LossLayout.of(tp2, None, vocab_parallel=True) == LossLayout(True)  # a dry run's column-parallel head
    assert LossLayout.of(tp2, 1024, vocab_parallel=False) == LossLayout(False)
    assert LossLayout.of(pp2, 1024) == LossLayout(False)
    assert LossLayout.of(_strategy(), 1024) == LossLayout(False)


def test_the_loss_gradients_are_counted_as_the_layout_runs_them(gpt_256):
    """8 bytes per logit of the whole logits, or 12 per logit of a tp shard under `loss_parallel`."""
    _, _, facts = gpt_256
    s = _strategy(tp=2, microbatch=2)
    logits = 2 * facts.seq_len * facts.vocab
    assert loss_gradient_bytes(facts, s, LossLayout(False)) == 8 * logits
    assert loss_gradient_bytes(facts, s, LossLayout(True)) == 12 * logits / 2
    assert loss_gradient_bytes(facts, s) == 8 * logits  # no layout given: the whole logits


def test_the_fresh_gradient_is_the_largest_weight_this_rank_holds():
    """The transient of accumulating micro-batches (`accumulated_gradient_bytes`): the largest trainable
    weight's fp32 gradient, its tp shard, a stacked experts tensor's 1/ep, a tied copy borrowed on a later
    stage; none with one micro-batch or under ZeRO."""
    import dataclasses

    from autopar.cost_models.backward_memory import accumulated_gradient_bytes
    from autopar.cost_models.facts import Unit

    def unit(shapes, borrowed=()):
        return Unit(name="u", layer_type=None, ops=(), params=0, sharded_params=0, input_bytes=0.0,
                    param_shapes=tuple(shapes), param_trainable=(True,) * len(shapes), borrowed=borrowed)

    table = unit([((1000, 64), 0), ((64,), None)])
    many = dict(num_microbatches=4)
    assert accumulated_gradient_bytes(_strategy(**many), [table]) == 4 * 1000 * 64
    assert accumulated_gradient_bytes(_strategy(tp=2, **many), [table]) == 4 * 1000 * 64 / 2
    assert accumulated_gradient_bytes(_strategy(), [table]) == 0  # one micro-batch: nothing accumulates
    assert accumulated_gradient_bytes(_strategy(zero=1, **many), [table]) == 0
    frozen = dataclasses.replace(table, param_trainable=(False, True))
    assert accumulated_gradient_bytes(_strategy(**many), [frozen]) == 4 * 64
    experts = unit([((8, 64, 256), None)])
    assert accumulated_gradient_bytes(_strategy(dp=4, ep=4, **many), [experts]) == 4 * 8 * 64 * 256 / 4
    head = unit([((64,), None)], borrowed=(("pre", 1000 * 64, True),))
    assert accumulated_gradient_bytes(_strategy(pp=2, tp=2, **many), [head]) == 4 * 1000 * 64 / 2
    assert accumulated_gradient_bytes(_strategy(**many), [head]) == 4 * 64  # one stage: the owner's


def test_a_unit_backward_holds_its_gradients_in_flight_and_a_stage_frees_later_units_first(gpt_256):
    """`unit_working_bytes`, closed form for the zoo GPT (bf16 trace, micro-batch 2): differentiating a
    layer holds the stream's gradient (S·H) and its down projection's 4H-wide input's (4·S·H), 2 bytes
    each, and accumulating micro-batches its largest weight's fresh fp32 gradient (H × 4H); the
    embedding's is its table padded to 1,024 rows; the head's only its fresh gradient (its gradients in
    flight are the loss's). `backward_working_bytes`: on a first pipeline stage the table's gradient
    comes after the layer freed its micro-batch's activations, so the layer's working set is the
    stage's; a split backward (zero-bubble) frees nothing before its W pass."""
    from autopar.cluster import load_cluster
    from autopar.cost_models.backward_memory import unit_working_bytes
    from autopar.cost_models.evaluate import stage_working_bytes
    from autopar.cost_models.stage_costs import unit_kept_bytes

    _, _, facts = gpt_256
    pre, layer, second, post = facts.units
    S, H = 128, 256  # conftest's GPT_256
    one, many = _strategy(microbatch=2), _strategy(microbatch=2, num_microbatches=4)
    assert unit_working_bytes(one, layer, second, False) == 2 * (S * H + 4 * S * H) * 2
    assert unit_working_bytes(many, layer, second, False) == 2 * (S * H + 4 * S * H) * 2 + 4 * H * 4 * H
    assert unit_working_bytes(many, pre, layer, False) == 2 * (S * H + S * H) * 2 + 4 * 1024 * H
    assert unit_working_bytes(many, post, None, False, holds_loss=True) == 4 * H  # its final norm: the table is tied
    cluster = load_cluster("dgx-h100", gpus=2)
    staged = _strategy(pp=2, microbatch=2, num_microbatches=4)
    first = stage_working_bytes(facts, cluster, staged)[0]
    assert unit_working_bytes(staged, pre, layer, True) < unit_kept_bytes(layer, staged, "none", autocast=True)[0]
    assert first == unit_working_bytes(staged, layer, second, True)
    # a table 8 times larger: its fresh gradient is the stage's largest, less the layer's freed activations
    # under 1F1B, whole under a split backward
    import dataclasses

    table = dataclasses.replace(pre, param_shapes=(((8192, H), 0), *pre.param_shapes[1:]))
    wide = dataclasses.replace(facts, units=(table, layer, second, post))
    kept = unit_kept_bytes(layer, staged, "none", autocast=True)[0]
    assert stage_working_bytes(wide, cluster, staged)[0] == unit_working_bytes(staged, table, layer, True) - kept
    split = staged.model_copy(update={"schedule": "interleaved_zb"})
    assert stage_working_bytes(wide, cluster, split)[0] == unit_working_bytes(split, table, layer, True)
    # recompute: the layer's working set beside what recompute rebuilds for it, both held at its backward
    for policy in ("full", "selective"):
        recomputing = staged.model_copy(update={"recompute": policy})
        rebuilt = unit_kept_bytes(layer, recomputing, policy, autocast=True)[1]
        assert rebuilt > 0
        assert stage_working_bytes(facts, cluster, recomputing)[0] == \
            unit_working_bytes(recomputing, layer, second, True) + rebuilt


@pytest.mark.parametrize("label, low, high", [
    ("tp=2 vocab-parallel head", 0.98, 1.05), ("tp=2 sp bf16", 0.98, 1.05),
    ("tp=2 head replicated (the ILP's)", 0.98, 1.05), ("llama tp=2", 0.98, 1.05),
    # pipeline stages (at 87a22fc, before their terms, the search's interleaved plan measured 0.908 and
    # 0.894; before the backward's working set, the small vocabulary's first stage 0.955); GPipe's first
    # stage is 15% over: the fresh table gradient counted beside both micro-batches (`rank_memory_cases.py`)
    ("pp=2 1f1b, 4 micro-batches", 0.98, 1.05), ("pp=2 vocabulary 1,024", 0.98, 1.05),
    ("pp=2 gpipe, 2 micro-batches of 2", 0.98, 1.20),
    # recompute: a layer's working set and its rebuilt activations are live together (the larger alone
    # measured 0.915 and 0.944 on the first stage)
    ("pp=2 full recompute, 1,024 positions", 0.98, 1.05), ("pp=2 selective recompute, 1,024 positions", 0.98, 1.05)])
def test_each_rank_peaks_as_priced(label, low, high):
    import rank_memory_cases

    (case,) = [case for case in rank_memory_cases.CASES if case[0] == label]
    if case[6]:  # the ILP's choice: check it still keeps the head replicated, which the case is about
        plan_json, _ = rank_memory_cases.planned(case)
        assert '"embed.weight":"RR"' in plan_json.replace(" ", ""), "the ILP now shards the head: pick another case"
    rows = rank_memory_cases.run([case])
    assert len(rows) == 2
    for row in rows:
        assert low <= row["ratio"] <= high, row
        assert row["worst_ratio"] >= low - 0.03, row  # gloo's race: up to 3 activation buffers (`step_peak_bytes`)


def test_a_vocabulary_parallel_lookup_makes_the_whole_tables_gradient(gpt_256):
    """Under tp the embedding's backward holds two fp32 gradients of its whole table (1,024 × 256 in
    conftest's GPT), not of its rows; nothing without tp, nothing for a layer (no lookup)."""
    from autopar.cost_models.backward_memory import lookup_gradient_bytes

    _, _, facts = gpt_256
    pre, layer = facts.units[:2]
    assert any(pre.param_looked_up) and not any(layer.param_looked_up)
    assert lookup_gradient_bytes(_strategy(tp=2), pre) == 2 * 4 * 1024 * 256
    assert lookup_gradient_bytes(_strategy(tp=4), pre) == 2 * 4 * 1024 * 256
    assert lookup_gradient_bytes(_strategy(), pre) == 0
    assert lookup_gradient_bytes(_strategy(tp=2), layer) == 0


def test_pipeline_stages_under_tensor_parallelism_peak_as_priced():
    """pp = 2 × tp = 2 (4 gloo processes). The first stage peaks in its vocabulary-parallel embedding's
    backward, where DTensor makes the whole table's gradient (`lookup_gradient_bytes`): 0.79 of the
    model before it was counted, now 1.10 over (the model holds every gradient at once). The last stage runs the loss on whole logits and saves its log-probabilities whole
    (`last_stage_kept_bytes`): 0.925 of the model before they were counted."""
    import rank_memory_cases

    (case,) = [case for case in rank_memory_cases.CASES if case[0] == "pp=2 x tp=2"]
    rows = rank_memory_cases.run([case])
    assert len(rows) == 4
    for row in rows:
        low, high = (0.98, 1.15) if row["pp_rank"] == 0 else (0.98, 1.05)
        assert low <= row["ratio"] <= high, row


def test_a_dry_run_plan_prices_its_column_parallel_head_as_the_analytic_one_does(gpt_256):
    """The search prices a model whose tp is decided by dry runs (`capabilities_for`) from what they
    send; its head's sharding comes from the placements (`head_shards_vocabulary`), so the zoo GPT at
    tp = 2 under Megatron's layout is priced the same peak either way. Before, the dry-run path priced
    the whole logits: 15% more (a review, 87a22fc)."""
    from autopar.cluster import load_cluster
    from autopar.runtime.tensor_parallel.realization import capabilities_for
    from autopar.searcher.search import search

    spec, graph, facts = gpt_256
    example = spec.example_inputs(1)
    fixed = dict(dp=1, tp=2, pp=1, sp=False, zero=0, microbatch=2, recompute="none")
    cluster = load_cluster("dgx-h100", gpus=2)
    analytic = search(graph, facts, cluster, 2, fixed=fixed, use_ilp=False)
    dry_run = search(graph, facts, cluster, 2, fixed=fixed, use_ilp=False,
                     capabilities=capabilities_for(spec.module, example, spec.loss_fn))
    assert dry_run.best.tp_layout is not None and dry_run.best.tp_realization == "modules"  # priced from a dry run
    assert dry_run.best.evaluation.peak_memory_bytes == pytest.approx(analytic.best.evaluation.peak_memory_bytes,
                                                                      rel=1e-3)

"""Why-not rows: one row per strategy, never the chosen plan, and each says why it loses in numbers
that the cost model reproduces."""

import re

import pytest

from autopar.cluster import load_cluster
from autopar.cost_models.collectives import head_vocab
from autopar.cost_models.evaluate import evaluate
from autopar.cost_models.memory import RESERVED_BYTES
from autopar.plan_schema import Strategy
from autopar.searcher.search import search
from autopar.searcher.why_not import part_label, step_parts

CLUSTER = load_cluster("dgx-h100", gpus=16)
FAMILIES = ("pure data parallel", "tensor parallel only (tp=8)", "no pipeline (pp=1)")
SLOWER = re.compile(r"\d+\.\d\d× slower(, [a-zA-Z0-9 -]+ ([\d.]+ (s|ms|µs)|<1 µs)( per step)? "
                    r"\(chosen plan: ([\d.]+ (s|ms|µs)|none|<1 µs)\))?")


def _key(strategy):
    return strategy.model_copy(update={"recompute_layers": None})


@pytest.fixture(scope="module")
def batch_24(gpt_512):
    """24 sequences on 16 GPUs: pure data parallel (dp=16) cannot split the batch."""
    graph, facts = gpt_512
    return search(graph, facts, CLUSTER, 24, use_ilp=False)


@pytest.mark.parametrize("batch, fixed", [(24, {}), (32, {"tp": 1}), (64, {"pp": 2})])
def test_one_row_per_strategy_and_never_the_chosen_plan(gpt_512, batch, fixed):
    graph, facts = gpt_512
    result = search(graph, facts, CLUSTER, batch, fixed=fixed, use_ilp=False)
    keys = [_key(row.strategy) for row in result.why_not if row.strategy is not None]
    assert len(keys) == len(set(keys)) and _key(result.best.strategy) not in keys
    labels = [label for row in result.why_not for label in row.label.split(" / ") if label != "runner-up"]
    assert len(labels) == len(set(labels))
    if fixed == {"tp": 1}:  # with tp fixed to 1, no pipeline means pure data parallel: one row or none
        rows = [row.label for row in result.why_not if "pure data parallel" in row.label or "no pipeline" in row.label]
        assert rows in ([], ["pure data parallel / no pipeline (pp=1)"])
    else:  # each family has a row, or is the chosen plan
        chosen = result.best.strategy
        for family, wanted in zip(FAMILIES, ({"tp": 1, "pp": 1}, {"tp": 8, "pp": 1}, {"pp": 1})):
            is_chosen = all(getattr(chosen, k) == v for k, v in wanted.items())
            assert is_chosen or any(family in label for label in labels), family


def test_a_batch_that_does_not_divide_is_priced_where_it_does(gpt_512, batch_24):
    _, facts = gpt_512
    row = next(row for row in batch_24.why_not if "pure data parallel" in row.label)
    s = row.strategy
    assert (s.dp, s.tp, s.pp) == (16, 1, 1) and row.global_batch == 32
    assert row.reason.startswith("global batch 24 does not divide over its 16 data-parallel ranks; at global batch 32: ")
    exact = evaluate(facts, CLUSTER, s, 32, vocab=head_vocab(facts, s))
    assert row.slowdown == pytest.approx(batch_24.best.evaluation.tokens_per_s / exact.tokens_per_s, rel=1e-12)
    pace = row.slowdown if row.slowdown >= 1 else 1 / row.slowdown
    assert f"{pace:.2f}× {'slower' if row.slowdown >= 1 else 'faster'} per token" in row.reason


def test_each_row_says_why_it_loses_in_numbers(batch_24):
    reference = batch_24.best.evaluation
    for row in batch_24.why_not:
        assert row.strategy is not None and row.slowdown is not None, row
        if row.label == "runner-up":  # same batch: the slowdown is the step-time ratio
            candidate = next(c for c in batch_24.ranked if c.strategy == row.strategy)
            assert row.slowdown == pytest.approx(candidate.evaluation.step_time_s / reference.step_time_s)
            # a runner-up within 0.5% is "as fast" (the cost terms of #18 put one there on this model)
            assert SLOWER.fullmatch(row.reason) or row.reason == "as fast (within 0.5%)", row.reason
        assert re.search(r"\d+\.\d\d× (slower|faster)|needs \d+\.\d GiB|as fast", row.reason), row.reason
        assert "invalid" not in row.reason


def test_rows_that_do_not_fit_name_the_memory_that_overflows(gpt_512):
    graph, facts = gpt_512
    gpu = CLUSTER.gpu.model_copy(update={"memory_bytes": int(RESERVED_BYTES + 2**24)})  # 16 MiB usable
    result = search(graph, facts, CLUSTER.model_copy(update={"gpu": gpu}), 32, use_ilp=False)
    assert result.best is None and result.why_not
    for row in result.why_not:
        assert not row.fits
        assert re.match(r"(.*: )?needs \d+\.\d GiB per GPU > 0\.0 GiB usable \((parameters|gradients|optimizer states"
                        r"|activations|buffers|margin) \d+\.\d GiB\)", row.reason), row.reason


def _evaluated(facts, batch, **knobs):
    fields = dict(dp=16, tp=1, pp=1, microbatch=2, num_microbatches=1, zero=0)
    fields.update(knobs)
    strategy = Strategy(**fields)
    return evaluate(facts, CLUSTER, strategy, batch, vocab=head_vocab(facts, strategy))


def test_step_parts_split_exposed_communication(gpt_512):
    """In the passes: tensor-parallel collectives and ZeRO-3 gathers; after the last backward: the
    gradient sync. The parts add up to the step on the critical rank."""
    _, facts = gpt_512
    pure = _evaluated(facts, 32)
    parts = step_parts(pure)
    assert parts["in_passes"] == pytest.approx(0.0, abs=1e-12) and parts["sync"] > 0
    assert part_label("sync", pure.strategy) == "exposed gradient all-reduce"
    tensor = _evaluated(facts, 32, dp=8, tp=2, microbatch=4)
    assert step_parts(tensor)["in_passes"] > 0
    assert part_label("in_passes", tensor.strategy) == "exposed tensor-parallel collectives"
    piped = _evaluated(facts, 32, dp=4, pp=4, num_microbatches=4, schedule="1f1b")
    for evaluation in (pure, tensor, piped):
        assert sum(step_parts(evaluation).values()) == pytest.approx(evaluation.step_time_s, rel=1e-9)

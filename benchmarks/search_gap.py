"""Optimality gap of the search against exhaustive enumeration, on spaces larger than the tests'.

Issue #5 asks for a gap of at most 1% under the same cost model. The search ranks every completion
with the closed-form pipeline estimate and simulates only its best few; this benchmark simulates
every valid completion (same capability table, same strategy rules, same head pricing) and reports
how far the search's plan is from the best of them. A negative gap means the search beat the
enumeration: its stage partition is searched, the enumeration's is the even split. Recompute counts per
stage are fitted in both (the fewest layers that fit are the fastest, see `cost_models.recompute`).

    python benchmarks/search_gap.py [--only gpt3-1.3b,...]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import autopar
from autopar.errors import AutoparError
from autopar.models import build_model
from autopar.cost_models.evaluate import evaluate, partition, with_fewest_recomputed_layers
from autopar.cost_models.strategy import check_strategy
from autopar.cost_models.collectives import head_vocab
from autopar.searcher.candidates import completions

CASES = [
    # (label, model, cluster, gpus, global batch, seq, fixed strategy keys)
    ("gpt3-1.3b", "gpt3-1.3b", "dgx-h100", 16, 256, 2048, {}),
    ("gpt3-6.7b", "gpt3-6.7b", "dgx-a100-80gb", 32, 512, 2048, {}),
    ("llama3-8b", "llama3-8b", "dgx-h100", 64, 512, 4096, {}),
    # ZeRO-1 at most (ZeRO-3 lets pure data parallelism fit the cases above): the model must be split
    ("gpt3-13b", "gpt3-13b", "dgx-a100-40gb", 16, 256, 2048, {"zero": 1}),
    ("llama3-70b", "llama3-70b", "dgx-h100", 64, 256, 4096, {"zero": 1}),
]


def exhaustive(facts, cluster, global_batch: int, layers: int, capabilities, fixed):
    """(best fitting evaluation, completions simulated) over every valid completion of `fixed`."""
    best, simulated = None, 0
    for strategy in completions(fixed, cluster.world_size, global_batch):
        if capabilities.supports(strategy) is not None:
            continue
        try:
            check_strategy(strategy, world_size=cluster.world_size, global_batch=global_batch, layers=layers,
                           heads=facts.heads, kv_heads=facts.kv_heads)
        except AutoparError:
            continue
        simulated += 1
        stages = partition(facts, strategy.pp * strategy.vp)

        def run(trial):
            return evaluate(facts, cluster, trial, global_batch, stages=stages, vocab=head_vocab(facts, trial))

        # per-stage recompute counts: the fewest that fit are the fastest (time grows and memory
        # falls with each recomputed layer; tests/test_recompute_layers.py checks it by brute force)
        result = with_fewest_recomputed_layers(run(strategy), stages, run)
        if result.fits and (best is None or result.step_time_s < best.step_time_s):
            best = result
    return best, simulated


def label_of(s) -> str:
    return (f"dp={s.dp} tp={s.tp} pp={s.pp} mb={s.microbatch} {s.schedule}" + (f" v={s.vp}" if s.vp > 1 else "")
            + f" zero={s.zero} rc={s.recompute}"
            + ("" if s.recompute_layers is None else "[" + "/".join(map(str, s.recompute_layers)) + "]")
            + f" sp={s.sp}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; search without the ILP "
          f"(the enumeration has no intra-op choices either)")
    print(f"{'model':<10} {'cluster':<18} {'search s':>8} {'enumerated':>10} {'enum s':>7} {'gap':>7}  search / best")
    for label, model, cluster_name, gpus, batch, seq, fixed in CASES:
        if args.only and label not in args.only.split(","):
            continue
        spec = build_model(model)
        cluster = autopar.load_cluster(cluster_name, gpus=gpus)
        planned = autopar.plan(spec.module, spec.example_inputs(1, seq), cluster=cluster, global_batch=batch,
                               strategy=fixed, loss_fn=spec.loss_fn, precision="bf16", name=label, use_ilp=False)
        result, facts, capabilities = planned.search, planned.facts, planned.capabilities
        started = time.perf_counter()
        best, simulated = exhaustive(facts, cluster, batch, len(facts.layer_units), capabilities, fixed)
        enumerated_s = time.perf_counter() - started
        if result.best is None or best is None:
            print(f"{label:<10} {f'{gpus} × {cluster.gpu.name}':<18} no fitting plan "
                  f"(search: {result.best is not None}, enumeration: {best is not None})")
            continue
        found = result.best.evaluation
        gap = (found.step_time_s - best.step_time_s) / best.step_time_s
        label = label + "".join(f" {k}={v}" for k, v in fixed.items())
        print(f"{label:<10} {f'{gpus} × {cluster.gpu.name}':<18} {result.search_s:>8.1f} {simulated:>10} "
              f"{enumerated_s:>7.0f} {gap:>+7.2%}  {label_of(found.strategy)} {found.step_time_s:.3f} s / "
              f"{label_of(best.strategy)} {best.step_time_s:.3f} s", flush=True)


if __name__ == "__main__":
    main()

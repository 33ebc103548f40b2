"""Searched plans vs the experts' hand-tuned configurations, under the same cost model.

For every row of the published runs in scope (`validate_published.py`'s files): the published strategy costed as it ran (as
`validate_published.py` prices it: even split, micro-batch and schedule chosen by the cost model
where the row does not give them), and the searched plan on the same cluster and batch, under the
same implementation profile (attention kernel, dropout, overlap), which the search keeps fixed.
Goal (issue #5): searched ≤ published for every row (ratio ≤ 1).

    python benchmarks/plan_vs_expert.py [--no-ilp] [--only ID,...]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from autopar.cost_models.implementation import PROFILE_KEYS
from autopar.cost_models.strategy import parse_strategy
from autopar.searcher.candidates import what_if
from autopar.searcher.search import search
from published_runs import load_runs, published_run, trace_run  # the same rows, model and fixed keys as the validation

RUNS = [Path(__file__).resolve().parent.parent.parent / "shared" / "validation" / "published-runs-dev.json",
        Path(__file__).resolve().parent / "published_runs_more.json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[str(path) for path in RUNS], help="published-runs JSON files")
    parser.add_argument("--only", default="")
    parser.add_argument("--no-ilp", action="store_true")
    args = parser.parse_args()
    # rows out of the cost model's scope (`validate_published.py`) have no price to compare against
    runs = [row for path in args.runs for row in load_runs(path)[1] if not row.get("out_of_scope")]
    if args.only:
        runs = [r for r in runs if r["id"] in args.only.split(",")]
    print(f"machine: {platform.node()} {platform.machine()}")
    print(f"{'run':<26} {'expert (tp,pp,dp)':<18} {'expert s':>8} {'searched':<36} {'searched s':>10} {'ratio':>6}")
    worst = 0.0
    for row in runs:
        run = published_run(row)
        if isinstance(run, str):
            print(f"skipped {row['id']}: {run}")
            continue
        trace_run(run)
        graph, facts, cluster, fixed = run.graph, run.facts, run.cluster, parse_strategy(run.strategy_text())
        expert = what_if(facts, cluster, fixed, row["global_batch"], layers=row["layers"])
        expert_best = expert.best or expert.ranked[0]
        profile = {key: fixed[key] for key in PROFILE_KEYS if key in fixed}
        found = search(graph, facts, cluster, row["global_batch"], layers=row["layers"], fixed=profile,
                       use_ilp=not args.no_ilp)
        chosen = found.best or found.ranked[0]
        s = chosen.strategy
        label = f"tp={s.tp} pp={s.pp} dp={s.dp} mb={s.microbatch} z={s.zero} {s.recompute[:4]}"
        ratio = chosen.evaluation.step_time_s / expert_best.step_time_s
        worst = max(worst, ratio)
        print(f"{row['id']:<26} {str((row['tp'], row['pp'], row['dp'])):<18} {expert_best.step_time_s:>8.2f} "
              f"{label:<36} {chosen.evaluation.step_time_s:>10.2f} {ratio:>6.3f}", flush=True)
    print(f"worst searched/expert ratio: {worst:.3f} (goal ≤ 1)")


if __name__ == "__main__":
    main()

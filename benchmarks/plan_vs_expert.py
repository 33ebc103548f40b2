"""Searched plans vs the experts' hand-tuned configurations, under the same cost model.

For every row of the published runs (Megatron-LM SC'21 Table 1, 32 to 3,072 A100s): the
published strategy costed as it ran (even split, micro-batch and schedule chosen by the cost
model, since Table 1 does not give them), and the searched plan on the same cluster and batch.
Goal (issue #5): searched ≤ published for every row (ratio ≤ 1).

    python benchmarks/plan_vs_expert.py [--no-ilp] [--only ID,...]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from autopar.searcher.candidates import what_if
from autopar.searcher.search import search
from validate_published import published_setup  # the same graph and fixed keys as the validation

RUNS = Path(__file__).resolve().parent.parent.parent / "shared" / "validation" / "published-runs-dev.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(RUNS))
    parser.add_argument("--only", default="")
    parser.add_argument("--no-ilp", action="store_true")
    args = parser.parse_args()
    runs = json.loads(Path(args.runs).read_text())["runs"]
    if args.only:
        runs = [r for r in runs if r["id"] in args.only.split(",")]
    print(f"machine: {platform.node()} {platform.machine()}; cost model on preset dgx-a100-80gb")
    print(f"{'run':<26} {'expert (tp,pp,dp)':<18} {'expert s':>8} {'searched':<36} {'searched s':>10} {'ratio':>6}")
    worst = 0.0
    for run in runs:
        graph, facts, cluster, fixed = published_setup(run)
        expert = what_if(facts, cluster, fixed, run["global_batch"], layers=run["layers"])
        expert_best = expert.best or expert.ranked[0]
        found = search(graph, facts, cluster, run["global_batch"], layers=run["layers"], use_ilp=not args.no_ilp)
        chosen = found.best or found.ranked[0]
        s = chosen.strategy
        label = f"tp={s.tp} pp={s.pp} dp={s.dp} mb={s.microbatch} z={s.zero} {s.recompute[:4]}"
        ratio = chosen.evaluation.step_time_s / expert_best.step_time_s
        worst = max(worst, ratio)
        print(f"{run['id']:<26} {str((run['tp'], run['pp'], run['dp'])):<18} {expert_best.step_time_s:>8.2f} "
              f"{label:<36} {chosen.evaluation.step_time_s:>10.2f} {ratio:>6.3f}", flush=True)
    print(f"worst searched/expert ratio: {worst:.3f} (goal ≤ 1)")


if __name__ == "__main__":
    main()

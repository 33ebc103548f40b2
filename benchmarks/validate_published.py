"""Cost model vs published measured runs, with leave-one-family-out cross-validation.

Each row (`benchmarks/published_runs.py` reads it) is priced as `autopar plan --strategy` prices
it: the GPT it trained, traced on the meta device; the published dp, tp, pp, ZeRO stage and
recompute; the implementation it ran with (attention kernel, dropout, dp/tp overlap, from the row
or its era); the micro-batch size and schedule, when the row does not give them, chosen by the
cost model. Measured step time comes from the row's accounting: hardware FLOPs with recompute
(Megatron-LM SC'21, Eq. 3) or model FLOPs without (6N + 12lhs per token, N with the embeddings),
or a measured time when the row has one.

The cost model's cited constants stay as cited; its fitted ones (`FITTED`) are fitted here by
minimizing the mean absolute percentage error, and printed. Cross-validation: for each family
(one publication's table), fit on every other family and score the family left out; the
leave-one-family-out MAPE is the mean over all rows of those held-out errors. The final
predictions use the fit on all rows, which is what `cost_models.compute.FITTED_EFFICIENCY` holds.

A row with `out_of_scope` (its reason: software whose behavior the cost model has no term for) is
priced and printed with its error, apart, and enters no fit and no MAPE: a known gap, not hidden.

    python benchmarks/validate_published.py [--runs PATH ...] [--only ID,...] [--no-fit]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This tree's autopar, not whichever one the environment's editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from published_runs import PublishedRun, load_runs, published_run, trace_run  # noqa: E402

from autopar.cost_models.compute import FITTED_EFFICIENCY, Efficiency  # noqa: E402
from autopar.cost_models.strategy import parse_strategy  # noqa: E402
from autopar.searcher.candidates import evaluate_fitted, priced_as_run, what_if  # noqa: E402

DEFAULT_RUNS = Path(__file__).resolve().parent.parent.parent / "shared" / "validation" / "published-runs-dev.json"
MORE_RUNS = Path(__file__).resolve().parent / "published_runs_more.json"  # further families, each field cited
# The fitted constants and the ranges searched (log-spaced grid, then refined around the best).
# (matmul 0: the GPU's own ceiling; launch_overhead_s: per kernel, `cost_models.compute`)
FITTED = {"matmul": (0.4, 0.95), "launch_overhead_s": (1e-6, 1e-4)}
GRID = 9


def choose(run: PublishedRun, efficiency: Efficiency):
    """What `autopar plan --strategy` predicts for the run: the fastest completion that fits."""
    fixed = parse_strategy(run.strategy_text())
    result = what_if(run.facts, run.cluster, fixed, run.row["global_batch"], layers=run.row["layers"],
                     efficiency=efficiency)
    return result.best or result.ranked[0]


_PRICED: dict[str, object] = {}


def step_time_s(run: PublishedRun, strategy, efficiency: Efficiency, exact: bool = False) -> float:
    """The run under `strategy` (its micro-batch and schedule chosen already)."""
    if run.id not in _PRICED:
        _PRICED[run.id] = priced_as_run(run.facts, parse_strategy(run.strategy_text()))
    return evaluate_fitted(_PRICED[run.id], run.cluster, strategy, run.row["global_batch"], exact=exact,
                           efficiency=efficiency, fit=False).step_time_s


def mape(runs: list[PublishedRun], strategies: dict[str, object], efficiency: Efficiency) -> float:
    errors = [abs(step_time_s(run, strategies[run.id], efficiency) / run.measured_step_time_s() - 1) for run in runs]
    return sum(errors) / len(errors)


def fit(runs: list[PublishedRun], strategies: dict[str, object], base: Efficiency) -> tuple[Efficiency, float]:
    """Coordinate search over `FITTED` on log grids (three sweeps, the later ones around the best
    so far), minimizing MAPE on `runs` with each run's strategy held fixed (closed-form pipeline).
    It starts from the middle of each range, never from the committed values: those were fitted
    on every row, the held-out family included."""
    values = {name: math.sqrt(low * high) for name, (low, high) in FITTED.items()}
    ranges = dict(FITTED)
    best = mape(runs, strategies, dataclasses.replace(base, **values))
    for sweep in range(3):
        for name, (low, high) in ranges.items():
            grid = [low * (high / low) ** (i / (GRID - 1)) for i in range(GRID)] + [0.0]
            for value in grid:
                trial = {**values, name: value}
                score = mape(runs, strategies, dataclasses.replace(base, **trial))
                if score < best - 1e-12:
                    best, values = score, trial
        ranges = {name: (max(values[name], low) / 3, max(values[name], low) * 3) for name, (low, _) in FITTED.items()}
    return dataclasses.replace(base, **values), best


def machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = "?"
    return f"{platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'}), commit {commit or '?'}"


def traced_runs(rows: list[dict]) -> list[PublishedRun]:
    runs: list[PublishedRun] = []
    for row in rows:
        run = published_run(row)
        if isinstance(run, str):
            print(f"skipped {row['id']}: {run}")
            continue
        started = time.perf_counter()
        runs.append(trace_run(run))
        print(f"traced {run.id} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    for run in runs:
        print(f"{run.id}: --strategy {run.strategy_text()}; {run.accounting}"
              + (f"; assumed: {', '.join(run.assumptions)}" if run.assumptions else "")
              + (f"; from the supplement: {'; '.join(run.supplemented)}" if run.supplemented else ""))
    return runs


def cross_validate(runs: list[PublishedRun], committed: Efficiency) -> dict[str, float]:
    """Prints the fit on all rows and on each family's complement; returns each row's error when
    its family was left out of the fit (its micro-batch and schedule chosen under that fit)."""
    chosen = {run.id: choose(run, committed).strategy for run in runs}
    fitted_all, score = fit(runs, chosen, committed)
    print(f"fit on all {len(runs)} rows: {_constants(fitted_all)} (training MAPE {score:.1%}, closed-form pipeline); "
          f"committed: {_constants(committed)}")
    held_out: dict[str, float] = {}
    for family in sorted({run.family for run in runs}):
        train = [run for run in runs if run.family != family]
        if not train:
            continue
        fitted, score = fit(train, chosen, committed)
        print(f"fit without {family}: {_constants(fitted)} (training MAPE {score:.1%})")
        for run in (run for run in runs if run.family == family):
            predicted = step_time_s(run, choose(run, fitted).strategy, fitted, exact=True)
            held_out[run.id] = predicted / run.measured_step_time_s() - 1
    return held_out


def _constants(efficiency: Efficiency) -> str:
    return ", ".join(f"{name}={getattr(efficiency, name):.4g}" for name in FITTED)


def print_table(runs: list[PublishedRun], committed: Efficiency, held_out: dict[str, float],
                summary: str = "MAPE (committed constants)") -> None:
    print(f"\n{'run':<30} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'chosen':<20} {'measured s':>10} "
          f"{'predicted s':>11} {'error':>7} {'held out':>9} {'peak GiB':>8}  fits")
    errors: dict[str, float] = {}
    for run in runs:
        evaluation = choose(run, committed)
        s = evaluation.strategy
        measured = run.measured_step_time_s()
        errors[run.id] = evaluation.step_time_s / measured - 1
        label = f"mb={s.microbatch} {s.schedule}" + (f" v={s.vp}" if s.vp > 1 else "")
        device_fit = evaluation.peak_memory_bytes <= evaluation.capacity_bytes + evaluation.headroom_bytes
        fits = "yes" if evaluation.fits else ("device only" if device_fit else "NO")
        out = f"{held_out[run.id]:>+9.1%}" if run.id in held_out else f"{'':>9}"
        print(f"{run.id:<30} {run.row['n_gpus']:>5} {s.tp:>3} {s.pp:>3} {s.dp:>3} {label:<20} {measured:>10.2f} "
              f"{evaluation.step_time_s:>11.2f} {errors[run.id]:>+7.1%} {out} "
              f"{evaluation.peak_memory_bytes / 2**30:>8.1f}  {fits}")
    _summary(summary, runs, errors)
    if held_out:
        _summary("leave-one-family-out MAPE", runs, held_out)


def _summary(label: str, runs: list[PublishedRun], errors: dict[str, float]) -> None:
    scored = [run for run in runs if run.id in errors]
    print(f"{label} over {len(scored)} runs: {sum(abs(errors[r.id]) for r in scored) / len(scored):.2%}")
    for family in sorted({run.family for run in scored}):
        family_errors = [abs(errors[run.id]) for run in scored if run.family == family]
        print(f"  {family}: {sum(family_errors) / len(family_errors):.1%} over {len(family_errors)} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[str(DEFAULT_RUNS), str(MORE_RUNS)], help="published-runs JSON files")
    parser.add_argument("--only", default="", help="comma-separated row ids")
    parser.add_argument("--no-fit", action="store_true", help="price with FITTED_EFFICIENCY as committed, no fits")
    args = parser.parse_args()
    rows = [row for path in args.runs for row in load_runs(path)[1]]
    if args.only:
        rows = [row for row in rows if row["id"] in args.only.split(",")]
    print(f"machine: {machine()}")
    runs = traced_runs(rows)
    scored = [run for run in runs if not run.row.get("out_of_scope")]
    held_out = {} if args.no_fit or not scored else cross_validate(scored, FITTED_EFFICIENCY)
    if scored:
        print_table(scored, FITTED_EFFICIENCY, held_out)
    gaps = [run for run in runs if run.row.get("out_of_scope")]
    if gaps:
        print("\nout of the cost model's scope (priced, in no fit and no MAPE):")
        for reason in sorted({run.row["out_of_scope"] for run in gaps}):
            print(f"  {reason}")
        print_table(gaps, FITTED_EFFICIENCY, {}, summary="error (committed constants)")


if __name__ == "__main__":
    main()

"""GEMM kernels timed on a GPU at the shapes the GEMM shape term was fitted on, beside the term's price.

    python benchmarks/gemm_shapes.py --collect benchmarks/gemm_shapes.json     # CPU, ~3 min: the shapes
    python benchmarks/gemm_shapes.py --out gemm_times.json [--budget-s 90]      # a GPU: time them
    python benchmarks/gemm_shapes.py --report gemm_times.json                   # anywhere: the term against them

Why: the shape term (`cost_models.compute`, `gemm_half_ridges`) was fitted on whole steps of the
published multi-GPU runs (`benchmarks/validate_published.py`). GPT-1.3B's GEMMs, timed alone on an
H100 and an H200, run at the term's ceiling where it prices them 35–50% slower
(`benchmarks/gemm_kernels.py`). Timing the published runs' own per-rank GEMMs on one GPU of the
same family says which it is: either the term describes those kernels, or it absorbs other costs of
those steps.

`--collect` traces each published run (both row files `validate_published.py` reads), takes the
micro-batch the committed cost model chooses for it, and writes every distinct per-rank product
(count, m, n, k) with the FLOPs it carries in each family's steps. GPT-1.3B's products at batch 8,
the one-GPU rows', come along as the family `gpt3-1.3b one GPU`.

Timing: each product is run 20 times back to back between two CUDA events after three warm-up
calls, in bf16, so no per-call synchronization enters the time. Products over `--max-gib` of
operands are skipped. The GPU's SM clock and power are sampled meanwhile (`gpu_clock.py`): the whole
run's in `clock`, each product's (where a sample fell in it) in its row. On CPU (`--device cpu`)
the script checks itself at small sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_kernels import PRESETS  # noqa: E402  (the device name -> preset rule, one copy)
from gpu_clock import ClockSampler  # noqa: E402

DEFAULT_SHAPES = ROOT / "benchmarks" / "gemm_shapes.json"
ONE_GPU = "gpt3-1.3b one GPU"
REPEATS = 20


def _products(facts, microbatch: int, tp: int) -> dict[tuple, float]:
    """(count, m, n, k) -> FLOPs per micro-batch of every GEMM one rank runs."""
    found: dict[tuple, float] = {}
    for unit in facts.units:
        for op in unit.ops:
            if op.gemm is None:
                continue
            dims = tuple(int(round(d)) for d in op.gemm.at(microbatch, tp if op.tp_sharded else 1))
            found[dims] = found.get(dims, 0.0) + 2.0 * dims[0] * dims[1] * dims[2] * dims[3]
    return found


def collect(path: Path) -> int:
    """The per-rank products of every published run and of the one-GPU GPT-1.3B, with their FLOPs."""
    import autopar
    from autopar.cost_models.compute import FITTED_EFFICIENCY
    from autopar.cost_models.facts import model_facts
    from autopar.models import build_model
    from published_runs import load_runs, published_run, trace_run
    from validate_published import DEFAULT_RUNS, MORE_RUNS, choose

    shapes: dict[tuple, dict[str, float]] = {}
    for rows_path in (DEFAULT_RUNS, MORE_RUNS):
        for row in load_runs(rows_path)[1]:
            run = published_run(row)
            if isinstance(run, str) or row.get("out_of_scope"):
                continue
            started = time.perf_counter()
            run = trace_run(run)
            s = choose(run, FITTED_EFFICIENCY).strategy
            for dims, flops in _products(run.facts, s.microbatch, s.tp).items():
                family = shapes.setdefault(dims, {})
                family[run.family] = family.get(run.family, 0.0) + flops
            print(f"collected {run.id} (mb={s.microbatch}, tp={s.tp}; {time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    spec = build_model("gpt3-1.3b", None)
    graph = autopar.trace(spec.module, spec.example_inputs(1, 2048), loss_fn=spec.loss_fn, precision="bf16",
                          seq_len=2048)
    facts = model_facts(graph, heads=16, kv_heads=16, vocab=spec.config.padded_vocab)
    for dims, flops in _products(facts, 8, 1).items():
        shapes.setdefault(dims, {})[ONE_GPU] = flops
    listed = [{"count": d[0], "m": d[1], "n": d[2], "k": d[3], "flops_by_family": families}
              for d, families in sorted(shapes.items(), key=lambda item: -sum(item[1].values()))]
    path.write_text(json.dumps({"shapes": listed}, indent=1) + "\n")
    print(f"wrote {len(listed)} products to {path}")
    return 0


def time_products(shapes: list[dict], device: str, budget_s: float, max_gib: float, cap: int | None = None) -> list:
    """Each product's seconds per call (None with the reason where skipped)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started, timed = time.perf_counter(), []
    for shape in shapes:
        count, m, n, k = (min(shape[x], cap) if cap else shape[x] for x in ("count", "m", "n", "k"))
        row = {**shape, "count": count, "m": m, "n": n, "k": k}
        size = count * (m * k + k * n + m * n) * (2 if device == "cuda" else 4)
        if size > max_gib * 2**30:
            timed.append({**row, "time_s": None, "skipped": f"{size / 2**30:.1f} GiB of operands"})
            continue
        if time.perf_counter() - started > budget_s:
            timed.append({**row, "time_s": None, "skipped": "over the time budget"})
            continue
        a = torch.randn(count, m, k, device=device, dtype=dtype)
        b = torch.randn(count, k, n, device=device, dtype=dtype)
        out = torch.empty(count, m, n, device=device, dtype=dtype)
        product = (lambda: torch.mm(a[0], b[0], out=out[0])) if count == 1 else (lambda: torch.bmm(a, b, out=out))
        for _ in range(3):
            product()
        began_s = time.perf_counter()
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(REPEATS):
                product()
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3 / REPEATS
        else:
            begin_s = time.perf_counter()
            for _ in range(REPEATS):
                product()
            seconds = (time.perf_counter() - begin_s) / REPEATS
        timed.append({**row, "time_s": seconds, "span_s": (began_s, time.perf_counter())})
        del a, b, out
    return timed


def report(record: dict, half_ridges: float | None = None) -> int:
    """Per family: its products' time as timed and as the shape term prices them (FLOPs-weighted)."""
    import autopar
    from autopar.cost_models.compute import FITTED_EFFICIENCY, gemm_efficiency

    preset = next((p for marker, p in PRESETS if marker in record["device"]), None)
    if preset is None:
        print(f"gemm_shapes: no preset for the device {record['device']!r}", file=sys.stderr)
        return 2
    gpu = autopar.load_cluster(preset, gpus=1).gpu
    peak = gpu.peak_flops_per_s("bf16")
    efficiency = FITTED_EFFICIENCY if half_ridges is None else replace(FITTED_EFFICIENCY, gemm_half_ridges=half_ridges)
    ceiling, half = efficiency.matmul_for(gpu), efficiency.gemm_half_dim_for(gpu, "bf16")
    print(f"{record['device']} ({preset}), torch {record['torch']}, commit {record['commit']}; ceiling {ceiling:.3f}, "
          f"d_half {half:.0f} (gemm_half_ridges {efficiency.gemm_half_ridges})")
    totals: dict[str, list[float]] = {}
    all_flops: dict[str, float] = {}
    for row in record["products"]:
        for family, family_flops in row["flops_by_family"].items():
            all_flops[family] = all_flops.get(family, 0.0) + family_flops
        if row.get("time_s") is None:
            continue
        flops = 2.0 * row["count"] * row["m"] * row["n"] * row["k"]
        measured = flops / row["time_s"] / peak
        modelled = gemm_efficiency((row["count"], row["m"], row["n"], row["k"]), ceiling, half)
        for family, family_flops in row["flops_by_family"].items():
            share = totals.setdefault(family, [0.0, 0.0, 0.0])
            share[0] += family_flops / (peak * measured)
            share[1] += family_flops / (peak * modelled)
            share[2] += family_flops
    print(f"  {'family':32} {'timed s':>10} {'priced s':>10} {'priced/timed':>12} {'FLOPs timed':>11}")
    for family, (timed_s, priced_s, timed_flops) in sorted(totals.items()):
        print(f"  {family:32} {timed_s:10.4f} {priced_s:10.4f} {priced_s / timed_s - 1:+12.1%} "
              f"{timed_flops / all_flops[family]:11.0%}")
    print("  (a family's runs ran on their own GPUs: an A100 family timed here shows its shapes' penalty on "
          "this GPU, not what its fit absorbed there)")
    shape_law(record["products"], peak, ceiling, half)
    return 0


BANDS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, None))


def shape_law(products: list[dict], peak: float, ceiling: float, half: float) -> tuple[float, float]:
    """How efficiency depends on shape in the kernels timed: by smallest dimension, and the term's own
    law (ceiling × Π d/(d + d_half)) fitted to them, minimizing the FLOPs-weighted mean |log error|.
    Returns the fitted (ceiling, d_half)."""
    import numpy as np
    from scipy.optimize import minimize

    timed = [p for p in products if p.get("time_s")]
    dims = np.array([[p["m"], p["n"], p["k"]] for p in timed], dtype=float)
    flops = np.array([2.0 * p["count"] * p["m"] * p["n"] * p["k"] for p in timed])
    seconds = np.array([p["time_s"] for p in timed])
    weight = np.array([sum(p["flops_by_family"].values()) for p in timed])
    weight /= weight.sum()
    achieved = flops / seconds / peak

    def priced(top: float, half_dim: float):
        return flops / (peak * top * np.prod(dims / (dims + max(half_dim, 0.0)), axis=1))

    def loss(x) -> float:
        return float(np.sum(weight * np.abs(np.log(priced(*x) / seconds))))

    fitted = minimize(loss, [ceiling, half], method="Nelder-Mead").x
    smallest = dims.min(axis=1)
    print(f"  by smallest dimension: {'products':>8} {'timed η (median)':>17} {'committed priced/timed':>23}")
    for low, high in BANDS:
        band = (smallest >= low) & (smallest < (high or np.inf))
        if band.any():
            label = f"{low}-{high}" if high else f">= {low}"
            print(f"  {label:>21} {band.sum():8d} {np.median(achieved[band]):17.3f} "
                  f"{np.median(priced(ceiling, half)[band] / seconds[band]) - 1:+23.1%}")
    print(f"  the term's law fitted to these kernels: ceiling {fitted[0]:.3f}, d_half {max(fitted[1], 0.0):.0f} "
          f"(FLOPs-weighted mean |log error| {loss(fitted):.3f}; committed {loss([ceiling, half]):.3f})")
    return float(fitted[0]), float(max(fitted[1], 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", type=Path, help="write the published runs' per-rank products here (CPU)")
    parser.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES)
    parser.add_argument("--out", type=Path, help="time the products and write them here")
    parser.add_argument("--report", type=Path, help="price a timing file's products with the shape term")
    parser.add_argument("--half-ridges", type=float, help="price at this gemm_half_ridges (default: committed)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-s", type=float, default=90.0)
    parser.add_argument("--max-gib", type=float, default=8.0)
    parser.add_argument("--cap", type=int, help="cap every dimension (a CPU check at small sizes)")
    args = parser.parse_args(argv)
    if args.collect:
        return collect(args.collect)
    if args.report:
        return report(json.loads(args.report.read_text()), args.half_ridges)
    if not args.out:
        parser.error("give --collect, --out or --report")
    import torch

    shapes = json.loads(args.shapes.read_text())["shapes"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with ClockSampler() as clock:  # the SM clock and power while the products run (`gpu_clock.py`)
        products = time_products(shapes, args.device, args.budget_s, args.max_gib, args.cap)
    for row in products:
        span = row.pop("span_s", None)
        if span and clock.samples:
            row["clock"] = clock.between(*span)
    record = {"device": device, "torch": torch.__version__, "commit": _commit(), "dtype": "bf16",
              "repeats": REPEATS, "clock": clock.summary(), "products": products}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    done = sum(1 for row in record["products"] if row.get("time_s") is not None)
    print(f"timed {done} of {len(shapes)} products on {device}; wrote {args.out}")
    return 0


def _commit() -> str:
    import os
    import subprocess

    if os.environ.get("AUTOPAR_COMMIT"):
        return os.environ["AUTOPAR_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False)
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())

"""Capture time and peak memory of graph capture, from gpt2-124m to gpt3-175b and llama3-405b.

Each model is traced in its own process so that its peak RSS is its own. Goal on the 2-core CPU
machine: gpt3-175b captured in ≤ 60 s and ≤ 4 GiB RSS. A deep stack is captured from a shallow twin
(`autopar.graph.repeats`); `--full-trace` traces every block instead, for comparison.

    python benchmarks/trace_scaling.py [--models gpt2-124m,gpt3-175b] [--batch 1] [--precision bf16] [--full-trace]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

DEFAULT_MODELS = [
    "gpt2-124m", "gpt2-1.5b", "gpt3-1.3b", "gpt3-13b", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b",
]


def measure_one(name: str, batch: int, precision: str, full_trace: bool = False) -> dict:
    from autopar.graph import trace
    from autopar.models import build_model

    started = time.perf_counter()
    spec = build_model(name)
    built = time.perf_counter()
    graph = trace(spec.module, spec.example_inputs(batch), loss_fn=spec.loss_fn, precision=precision, name=name,
                  expand_repeats=not full_trace)
    traced = time.perf_counter()
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "model": name,
        "params_b": graph.num_params / 1e9,
        "seq_len": graph.seq_len,
        "ops": len(graph.nodes),
        "layer_types": [f"{lt.class_name}×{len(lt.instances)}" for lt in graph.layer_types],
        "build_s": built - started,
        "capture_s": traced - built,
        "peak_rss_gib": peak_rss_bytes / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--full-trace", action="store_true", help="trace every block (no shallow twin)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one model in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.batch, args.precision, args.full_trace)))
        return
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{__import__('os').cpu_count()} CPUs; batch {args.batch}, {args.precision}"
          + (", every block traced" if args.full_trace else ""))
    header = f"{'model':<13} {'params':>8} {'seq':>5} {'ops':>6} {'build s':>8} {'capture s':>9} {'peak RSS':>9}  layer types"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        result = subprocess.run(
            [sys.executable, __file__, "--one", name, "--batch", str(args.batch), "--precision", args.precision]
            + (["--full-trace"] if args.full_trace else []),
            capture_output=True, text=True,
        )
        if result.returncode:
            print(f"{name:<13} failed: {result.stderr.strip().splitlines()[-1] if result.stderr else result.returncode}")
            continue
        row = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{row['model']:<13} {row['params_b']:>7.2f}B {row['seq_len']:>5} {row['ops']:>6} "
              f"{row['build_s']:>8.1f} {row['capture_s']:>9.1f} {row['peak_rss_gib']:>7.2f} G  {', '.join(row['layer_types'])}")


if __name__ == "__main__":
    main()

"""Does the op profile add up to a real training step? Run on the GPU machine, in one call.

    python benchmarks/profile_validation.py [--model gpt3-1.3b] [--seq-len 2048] [--batch 1] [--db PATH]

1. Trace the model (bf16), profile every distinct signature of its step on the device, and sum the
   profiled time of every node (each looked up in the database by its signature).
2. Build the same model with real weights on the device in bf16 and time eager forward + loss +
   backward steps (warm-up, then the median). No optimizer step: the graph has none either.
3. Memory: the profiled activations (allocator deltas of the forward ops' outputs, scaled to the
   part kept for backward) against torch.cuda.max_memory_allocated over the eager forward pass,
   less what was allocated before it (the weights).
Prints the device name and both ratios (profiled / measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def profiled_step(model: str, overrides: str | None, *, batch: int, seq_len: int | None, precision: str,
                  device: str, db_path: str, warmup: int = 3, repeats: int = 10, variants: bool = False) -> dict:
    """Profile the step's signatures into `db_path` and price one step from the database."""
    from autopar.graph import trace
    from autopar.models import build_model
    from autopar.profiler.database import ProfileDB
    from autopar.profiler.graph_profile import estimate_step, profile_graph
    from autopar.profiler.operators import device_name, stderr_progress

    spec = build_model(model, overrides)
    graph = trace(spec.module, spec.example_inputs(batch, seq_len), loss_fn=spec.loss_fn, precision=precision,
                  name=model, seq_len=seq_len or spec.default_seq_len)
    with ProfileDB(db_path) as db:
        summary = profile_graph(graph, db, device, tp_degrees=(2, 4, 8) if variants else (),
                                microbatches=(1, 2, 4) if variants else (), warmup=warmup, repeats=repeats,
                                progress=stderr_progress(20))
        estimate = estimate_step(graph, db, device_name(device))
    return {
        "nodes": len(graph.nodes), "signatures": summary.graph_signatures, "measured": summary.measured,
        "skipped": summary.skipped, "profile_s": summary.elapsed_s, "step_time_s": estimate.time_s,
        "coverage": estimate.coverage, "missing_ops": estimate.missing_ops,
        "activation_bytes": estimate.activation_bytes, "activation_source": estimate.activation_source,
    }


def measured_step(model: str, overrides: str | None, *, batch: int, seq_len: int | None, precision: str,
                  device: str, warmup: int = 3, repeats: int = 10) -> dict:
    """Median eager forward+backward time, and (on GPU) the forward pass's peak memory."""
    import torch

    from autopar.models import build_model

    cuda = device.startswith("cuda")
    spec = build_model(model, overrides, device=device, seed=0)
    module = spec.module.to(getattr(torch, DTYPES[precision])).train()
    inputs = spec.example_inputs(batch, seq_len, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        spec.loss_fn(module(*inputs), *inputs).backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    result = {"step_time_s": statistics.median(times), "forward_peak_bytes": None, "step_peak_bytes": None}
    if cuda:
        module.zero_grad(set_to_none=True)
        sync()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = spec.loss_fn(module(*inputs), *inputs)
        sync()
        result["forward_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
        result["after_forward_bytes"] = torch.cuda.memory_allocated(device) - before
        loss.backward()
        sync()
        result["step_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def compare(profiled: dict, measured: dict) -> dict:
    memory = measured.get("forward_peak_bytes")
    return {
        "time_ratio": profiled["step_time_s"] / measured["step_time_s"],
        "activation_ratio": profiled["activation_bytes"] / memory if memory else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--model-config", default=None)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--db", default=None, help="profile database (default: a temporary file)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", action="store_true", help="also profile the tp / micro-batch shapes")
    args = parser.parse_args(argv)

    import torch

    from autopar.profiler.operators import device_name

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_validation: no CUDA GPU here; run it on the GPU machine (or pass --device cpu)", file=sys.stderr)
        return 2
    db_path = args.db or os.path.join(tempfile.mkdtemp(prefix="autopar-validation-"), "profile.db")
    shape = dict(batch=args.batch, seq_len=args.seq_len, precision=args.precision, device=args.device)
    profiled = profiled_step(args.model, args.model_config, **shape, db_path=db_path, repeats=args.repeats,
                             variants=args.variants)
    measured = measured_step(args.model, args.model_config, **shape, repeats=args.repeats)
    ratios = compare(profiled, measured)
    print(f"device: {device_name(args.device)}  (torch {torch.__version__}, host {platform.node()})")
    print(f"model: {args.model} batch {args.batch} seq {args.seq_len} {args.precision}; "
          f"{profiled['nodes']} nodes, {profiled['signatures']} signatures, profiled in {profiled['profile_s']:.1f} s")
    print(f"step time: profiled sum {profiled['step_time_s'] * 1e3:.2f} ms, eager {measured['step_time_s'] * 1e3:.2f} ms, "
          f"ratio {ratios['time_ratio']:.3f} (coverage {profiled['coverage']:.1%})")
    if ratios["activation_ratio"] is not None:
        print(f"activations: profiled {profiled['activation_bytes'] / 2**30:.3f} GiB, forward max_memory_allocated "
              f"{measured['forward_peak_bytes'] / 2**30:.3f} GiB, ratio {ratios['activation_ratio']:.3f}")
    print(json.dumps({"profiled": profiled, "measured": measured, "ratios": ratios}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tracked vs predicted peak memory of one single-GPU training step, shape by shape (issue #29).

Tracked: `autopar.profiler.memory_tracker.tracked_step_memory`, torch's MemTracker over two fake-tensor
steps on the CPU (the second step's peak). Predicted: the plan's evaluation at dp=tp=pp=1, zero 0 on
one dgx-h100 GPU, its `MemoryBreakdown`. The ratio compares against the breakdown's sum WITHOUT the
allocator margin (parameters + gradients + optimizer states + activations + buffers): the tracker
counts tensor storage, not the caching allocator's fragmentation. `plan.predicted.peak_memory_bytes`
(with the margin; no CUDA/NCCL reserve is in it) is printed beside it.

    .venv/bin/python benchmarks/memory_tracker_shapes.py [--json PATH] [--only SUBSTRING] [--big]

`--cuda` (on a GPU machine) also runs the same two steps for real on CUDA and prints the second
step's `torch.cuda.max_memory_allocated` (the caching allocator's allocated bytes: CUDA autocast,
CUDA kernels, cuBLAS workspace; not its reserved bytes); `--no-analytic` skips the planner.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import autopar
from autopar.cost_models.memory import activation_factor, storage_bytes
from autopar.models import build_model
from autopar.profiler.memory_tracker import _clip_grad_norm, recompute_paths, tracked_step_memory
from autopar.runtime.recompute import apply_recompute

GPT = "layers=4,hidden=512,heads=8,vocab=50257,seq_len=1024"
LLAMA = "layers=4,hidden=512,heads=8,kv_heads=4,vocab=32000,seq_len=1024"
# (model, config, seq_len, microbatch, num_microbatches, precision, recompute, optimizer)
SHAPES = [
    ("gpt", GPT, 512, 1, 1, "fp32", "none", "fused"),
    ("gpt", GPT, 512, 1, 1, "bf16", "none", "fused"),
    ("gpt", GPT, 512, 1, 1, "bf16", "none", "foreach"),
    ("gpt", GPT, 512, 1, 1, "bf16", "selective", "fused"),
    ("gpt", GPT, 512, 1, 1, "bf16", "full", "fused"),
    ("gpt", GPT, 512, 2, 1, "bf16", "none", "fused"),
    ("gpt", GPT, 512, 4, 1, "bf16", "none", "fused"),
    ("gpt", GPT, 512, 2, 2, "bf16", "none", "fused"),
    ("gpt", GPT, 512, 4, 1, "fp32", "full", "fused"),
    ("gpt", GPT, 1024, 1, 1, "bf16", "none", "fused"),
    ("gpt", GPT.replace("layers=4", "layers=8"), 512, 1, 1, "bf16", "none", "fused"),
    ("gpt", GPT.replace("vocab=50257", "vocab=100000"), 512, 1, 1, "bf16", "none", "fused"),
    ("llama", LLAMA, 512, 1, 1, "fp32", "none", "fused"),
    ("llama", LLAMA, 512, 1, 1, "bf16", "none", "fused"),
    ("llama", LLAMA, 512, 2, 1, "bf16", "selective", "fused"),
    ("llama", LLAMA, 512, 4, 1, "bf16", "full", "fused"),
    ("llama", LLAMA, 512, 2, 2, "bf16", "none", "fused"),
]
BIG = [
    ("gpt3-1.3b", None, 2048, 1, 1, "bf16", "none", "fused"),
    ("gpt3-1.3b", None, 2048, 1, 1, "bf16", "selective", "fused"),
    ("gpt3-1.3b", None, 2048, 2, 1, "bf16", "full", "fused"),
]
CATEGORIES = {"Parameter": "P", "Gradient": "G", "Optstate": "O", "Activation": "A", "Temp": "T", "Buffer": "B",
              "Other": "X"}


def label(row) -> str:
    model, config, seq, mb, nmb, precision, recompute, opt = row
    extra = ""
    if config is not None:
        base = GPT if model == "gpt" else LLAMA
        extra = ",".join(sorted(set(config.split(",")) - set(base.split(",")))) + " " if config != base else ""
    return (f"{model} {extra}s={seq} {mb}x{nmb} {precision} rc={recompute}"
            + (f" {opt}" if opt != "fused" else ""))


def predicted(row, cluster) -> dict:
    model, config, seq, mb, nmb, precision, recompute, optimizer = row
    spec = build_model(model, config)
    result = autopar.plan(spec.module, spec.example_inputs(1, seq), cluster=cluster, global_batch=mb * nmb,
                          loss_fn=spec.loss_fn, precision=precision, name=model, seq_len=seq,
                          strategy=f"dp=1,tp=1,pp=1,zero=0,recompute={recompute},microbatch={mb},"
                                   f"optimizer_impl={optimizer}" + (",recompute_layers=all" if recompute != "none" else ""))
    memory = result.prediction.memory[0]
    parts = {k: int(v) for k, v in memory.as_dict().items()}
    modules = result.plan.recompute_modules if result.plan is not None else None
    if recompute != "none" and modules is not None and modules != recompute_paths(spec.module):
        print(f"  note: the plan recomputes {modules}, the tracker {recompute_paths(spec.module)}", file=sys.stderr)
    factor = activation_factor(precision, 0, "none", "fp32", autocast_counted=result.prediction.autocast_activations)
    storage = storage_bytes(memory, factor)  # as MemTracker counts
    return {"parts": parts, "without_margin": int(storage),
            "plan_peak": int(result.prediction.peak_memory_bytes), "fits": result.fits}


def cuda_step_memory(row) -> dict:
    """The tracker's two steps for real on CUDA (autocast on cuda, fused AdamW): allocated-byte peaks."""
    model, config, seq, mb, nmb, precision, recompute, opt = row
    spec = build_model(model, config, device="cuda", seed=0)
    module = spec.module
    apply_recompute(module, recompute_paths(module), recompute)
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=opt == "fused", foreach=None if opt == "fused" else True)
    batch = torch.randint(0, spec.config.vocab, (mb * nmb, seq), device="cuda")
    peaks = []
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for x in batch.chunk(nmb):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = spec.loss_fn(module(x), x)
            (loss / nmb).backward()
            del loss
        _clip_grad_norm(params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    result = {"peak_bytes": peaks[1], "first_step_peak_bytes": peaks[0], "after_step_bytes": torch.cuda.memory_allocated()}
    del module, optimizer, params, batch, spec
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--only", help="run the shapes whose label contains this")
    parser.add_argument("--big", action="store_true", help="also gpt3-1.3b at s=2048")
    parser.add_argument("--cuda", action="store_true", help="also the real step's allocated peak on CUDA")
    parser.add_argument("--no-analytic", action="store_true", help="skip the planner's prediction")
    args = parser.parse_args(argv)
    cluster = None if args.no_analytic else autopar.load_cluster("dgx-h100", gpus=1)
    rows = SHAPES + (BIG if args.big else [])
    if args.only:
        rows = [r for r in rows if args.only in label(r)]
    gib = 2**30
    print(f"{'shape':<44} {'tracked':>8} {'step1':>7} {'analytic':>8} {'+margin':>8} {'ratio':>6}  "
          f"tracker at peak (GiB: P G O A T) | analytic (P G O A)" + (" | cuda peak, step1, cuda/tracked" * args.cuda))
    out = []
    for row in rows:
        start = time.perf_counter()
        tracked = tracked_step_memory(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7])
        seconds = time.perf_counter() - start
        pred = predicted(row, cluster) if cluster is not None else {
            "parts": dict.fromkeys(("parameters", "gradients", "optimizer_states", "activations"), 0),
            "without_margin": 0, "plan_peak": 0}
        ratio = pred["without_margin"] / tracked["peak_bytes"]
        cuda = cuda_step_memory(row) if args.cuda else None
        cats = " ".join(f"{tracked['by_category'].get(k, 0) / gib:.3f}" for k in ("Parameter", "Gradient", "Optstate",
                                                                                   "Activation", "Temp"))
        p = pred["parts"]
        parts = " ".join(f"{p[k] / gib:.3f}" for k in ("parameters", "gradients", "optimizer_states", "activations"))
        print(f"{label(row):<44} {tracked['peak_bytes'] / gib:8.3f} {tracked['first_step_peak_bytes'] / gib:7.3f} "
              f"{pred['without_margin'] / gib:8.3f} {pred['plan_peak'] / gib:8.3f} {ratio:6.3f}  {cats} | {parts}"
              + (f" | {cuda['peak_bytes'] / gib:.3f} {cuda['first_step_peak_bytes'] / gib:.3f} "
                 f"{cuda['peak_bytes'] / tracked['peak_bytes']:.3f}" if cuda else ""), flush=True)
        out.append({"label": label(row), "model": row[0], "model_config": row[1], "seq_len": row[2],
                    "microbatch": row[3], "num_microbatches": row[4], "precision": row[5], "recompute": row[6],
                    "optimizer": row[7], "tracked": tracked, "predicted": pred, "ratio_without_margin": ratio,
                    "tracker_seconds": round(seconds, 1), "cuda": cuda})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Token loader throughput on this CPU against what one GPU consumes training GPT-1.3B.

The loader must never be what a step waits for. One GPU training GPT-1.3B consumes
    tokens/s = MFU x peak FLOP/s / (6 x parameters)
and the goal (issue #7) is a loader at least 20x faster than that, on one CPU thread with prefetch,
so a machine's CPUs stay free for everything else. Reference figures, as the issue states them:
measured on the lent H100 2026-11-22, eager 48.8% MFU; bf16 dense peak 989 TFLOP/s per the H100 SXM
datasheet. The data is the default corpus (the standard library's source as bytes); settings are
GPT-1.3B's: sequence 2,048, 8 sequences per rank.

    python benchmarks/loader_throughput.py [--steps 2000] [--dp-size 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from autopar.models import build_model
from autopar.runtime.data.corpus import default_corpus
from autopar.runtime.data.loader import TokenDataset, TokenLoader

REFERENCE_MFU = 0.488  # eager GPT-1.3B, measured on the lent H100 2026-11-22 (issue #7)
H100_BF16_PEAK_FLOPS = 989e12  # dense bf16, H100 SXM datasheet
GOAL_RATIO = 20.0


def gpu_tokens_per_s() -> tuple[float, int]:
    """Tokens/s one H100 consumes for GPT-1.3B at the reference MFU, and the parameter count."""
    model = build_model("gpt3-1.3b").module  # on the meta device: counts parameters, allocates nothing
    num_params = sum(p.numel() for p in model.parameters())
    return REFERENCE_MFU * H100_BF16_PEAK_FLOPS / (6 * num_params), num_params


def measure(dataset: TokenDataset, seq_len: int, rows_per_rank: int, dp_size: int, steps: int,
            prefetch: int) -> tuple[float, float]:
    """(tokens/s handed to this rank in steady state, seconds to the first batch)."""
    started = time.perf_counter()
    loader = TokenLoader(dataset, seq_len, rows_per_rank * dp_size, dp_rank=dp_size - 1, dp_size=dp_size, seed=0,
                         prefetch=prefetch)
    loader.next()
    first_batch_s = time.perf_counter() - started
    loader.wait_prefetched()
    started = time.perf_counter()
    num_tokens = 0
    for _ in range(steps):
        tokens, _ = loader.next()
        num_tokens += tokens.numel()
    elapsed = time.perf_counter() - started
    loader.close()
    return num_tokens / elapsed, first_batch_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="batches timed (default 2000)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows-per-rank", type=int, default=8)
    parser.add_argument("--dp-size", type=int, default=8, help="dp degree the global batch is split over (default 8)")
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.node()} {platform.machine()} {platform.processor() or ''}".rstrip()
          + f", {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")

    started = time.perf_counter()
    dataset = TokenDataset(default_corpus())
    print(f"default corpus: {dataset.num_tokens:,} tokens, {dataset.index['num_documents']} documents "
          f"({time.perf_counter() - started:.2f} s to open or prepare)")
    seq, rows = args.seq_len, args.rows_per_rank
    print(f"loader: seq {seq}, {rows} rows per rank, global batch {rows * args.dp_size} over dp={args.dp_size}, "
          f"prefetch {args.prefetch}, {args.steps} batches")

    loader_tokens_per_s, first_batch_s = measure(dataset, seq, rows, args.dp_size, args.steps, args.prefetch)
    gpu_rate, num_params = gpu_tokens_per_s()
    ratio = loader_tokens_per_s / gpu_rate
    print(f"loader:  {loader_tokens_per_s / 1e6:8.2f} M tokens/s per rank (first batch after {first_batch_s * 1e3:.1f} ms)")
    print(f"GPU:     {gpu_rate / 1e3:8.1f} k tokens/s for GPT-1.3B ({num_params / 1e9:.3f} B parameters) = "
          f"{REFERENCE_MFU:.1%} MFU x {H100_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s / (6 x parameters)")
    print("         reference: MFU measured on the lent H100 2026-11-22 (eager); peak per the H100 SXM datasheet")
    verdict = "meets" if ratio >= GOAL_RATIO else "MISSES"
    print(f"ratio:   {ratio:8.1f}x what one GPU consumes ({verdict} the goal of ≥ {GOAL_RATIO:.0f}x)")


if __name__ == "__main__":
    main()

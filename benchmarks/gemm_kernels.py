"""The GEMM shape term against GEMM kernels timed on real GPUs: the op-profile databases we hold.

    python benchmarks/gemm_kernels.py [--db PATH ...] [--half-ridges 1.71]

`cost_models.compute` prices a GEMM at η_matmul · Π d/(d + d_half) over its m, n and k, with d_half
= `gemm_half_ridges` ridge points of the GPU (peak FLOP/s over HBM bytes/s). That constant was fitted
on whole steps of published multi-GPU runs (`benchmarks/validate_published.py`), where it can absorb
whatever else those steps spend. Here each distinct GEMM of a profiled model is priced alone and set
beside the kernel the profiler timed for it on the GPU (`profiler/`, each op timed by itself): the
efficiency it reached (FLOPs / time / dense peak), the efficiency the model gives it, and their
ratio, weighted by how often the step runs it. It also prints the committed constant's kernel total
beside the total at other values, so a refit can see both scales: kernels and steps.

A database's model is read from its file name (`...-gpt3-1.3b.db`); its batch from its signatures
(`cost_models.calibration.profiled_batch`). Times of kernels under ~10 µs carry the profiler's own
timing latency; the table marks the GEMMs under 1 GFLOP.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DBS = [*sorted((ROOT / "benchmarks" / "gpu_runs").glob("h[12]00-*.db")),
               ROOT.parent / "shared" / "gpu" / "profile-h100-gpt3-1.3b.db"]
# (what the device name holds, preset), first match wins: the SXM parts the presets describe
PRESETS = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100-SXM4-40GB", "dgx-a100-40gb"), ("A100", "dgx-a100-80gb"))
SMALL_FLOPS = 1e9


@dataclass(frozen=True)
class Kernel:
    signature: str
    count: int  # times one step runs it
    flops: float
    measured_s: float
    node: object  # the graph's node: what the model prices

    def model_efficiency(self, gpu, half_ridges: float) -> float:
        """The model's η for this GEMM alone: the ceiling, its shape's penalty, the misaligned factor."""
        from autopar.cost_models.calibration import _gemm_shape_factor
        from autopar.cost_models.compute import DEFAULT_EFFICIENCY

        efficiency = replace(DEFAULT_EFFICIENCY, gemm_half_ridges=half_ridges)
        return efficiency.matmul_for(gpu) * _gemm_shape_factor(self.node, gpu, "bf16", efficiency)


def model_of(path: Path) -> str | None:
    found = re.search(r"(gpt3-[0-9.]+b|gpt2-[0-9]+m|llama[-0-9.a-z]*)\.db$", path.name)
    return found.group(1) if found else None


def kernels(path: Path):
    """(device name, its GPU, the distinct GEMMs of the database's model with their measured times)."""
    import autopar
    from autopar.cost_models.calibration import _kind, profiled_batch
    from autopar.models import build_model
    from autopar.profiler.database import ProfileDB
    from autopar.profiler.signatures import needs_profile, signature_of

    model = model_of(path)
    if model is None:
        raise SystemExit(f"gemm_kernels: cannot tell the model of {path.name}: name it ...-<zoo model>.db")
    spec = build_model(model, None)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        keys = [key for (key,) in connection.execute("select signature_key from op_profiles")]
    batch = profiled_batch(keys, spec.default_seq_len) or 1
    graph = autopar.trace(spec.module, spec.example_inputs(batch, spec.default_seq_len), loss_fn=spec.loss_fn,
                          precision="bf16", seq_len=spec.default_seq_len, name=model)
    database = ProfileDB(path, readonly=True)
    device = database.devices()[0]
    preset = next((p for marker, p in PRESETS if marker in device), None)
    if preset is None:
        raise SystemExit(f"gemm_kernels: no preset for the device {device!r} of {path.name}")
    gpu = autopar.load_cluster(preset, gpus=1).gpu
    found: dict[str, Kernel] = {}
    untimed = 0
    for node in graph.nodes:
        if not (needs_profile(node) and _kind(node) == "matmul"):
            continue
        signature = signature_of(node)
        measured = database.lookup_time_s(device, "bf16", signature)
        if not measured:
            untimed += 1
            continue
        known = found.get(signature.key)
        found[signature.key] = Kernel(signature.key, (known.count if known else 0) + 1, node.flops, measured, node)
    if untimed:
        print(f"  ({untimed} GEMMs of the step have no time in {path.name}: left out of the totals below)")
    return f"{device} ({preset})", gpu, list(found.values())


def report(path: Path, half_ridges: float, alternatives: list[float]) -> None:
    from autopar.cost_models.compute import DEFAULT_EFFICIENCY

    device, gpu, found = kernels(path)
    peak = gpu.peak_flops_per_s("bf16")
    ceiling = DEFAULT_EFFICIENCY.matmul_for(gpu)
    print(f"{path.name}: {device}, η_matmul ceiling {ceiling:.3f}, d_half = {half_ridges} × "
          f"{peak / gpu.hbm_bandwidth_bytes_per_s:.0f} FLOP/B")
    print(f"  {'runs':>4} {'GFLOP':>7} {'measured µs':>11} {'η measured':>10} {'η model':>8} {'model/measured':>14}  GEMM")
    for kernel in sorted(found, key=lambda k: -k.flops * k.count):
        model_eta = kernel.model_efficiency(gpu, half_ridges)
        measured_eta = kernel.flops / kernel.measured_s / peak
        small = " (< 1 GFLOP: timing latency)" if kernel.flops < SMALL_FLOPS else ""
        print(f"  {kernel.count:4d} {kernel.flops / 1e9:7.1f} {kernel.measured_s * 1e6:11.1f} {measured_eta:10.3f} "
              f"{model_eta:8.3f} {measured_eta / model_eta:14.2f}  {kernel.signature[:90]}{small}")
    measured_s = sum(k.count * k.measured_s for k in found)
    for value in [half_ridges, *alternatives]:
        model_s = sum(k.count * k.flops / (peak * k.model_efficiency(gpu, value)) for k in found)
        print(f"  one step's GEMMs: measured {measured_s * 1e3:.1f} ms, priced {model_s * 1e3:.1f} ms at "
              f"gemm_half_ridges {value} ({model_s / measured_s - 1:+.1%})")


def main(argv: list[str] | None = None) -> int:
    from autopar.cost_models.compute import FITTED_EFFICIENCY

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", action="append", type=Path, help="op-profile databases (default: those we hold)")
    parser.add_argument("--half-ridges", type=float, default=FITTED_EFFICIENCY.gemm_half_ridges)
    parser.add_argument("--compare", default="0,0.5", help="other gemm_half_ridges to total the step's GEMMs at")
    args = parser.parse_args(argv)
    paths = [p for p in (args.db or DEFAULT_DBS) if p.exists()]
    if not paths:
        print("gemm_kernels: no op-profile database found (benchmarks/gpu_runs/ or ../shared/gpu/)", file=sys.stderr)
        return 2
    alternatives = [float(v) for v in args.compare.split(",") if v]
    for path in paths:
        report(path, args.half_ridges, alternatives)
    return 0


if __name__ == "__main__":
    sys.exit(main())

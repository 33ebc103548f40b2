"""A one-GPU step's parts as the cost model prices them, beside the kernels a diagnosis timed.

    python benchmarks/step_parts.py [benchmarks/gpu_runs/*-diagnosis.json ...]   # ~1 min on CPU

Why: a step's predicted total can land within a few percent while its parts are off in opposite
directions (the seventh session found GEMMs priced 28% slow and vector ops 2.3× fast on the H200,
cancelling). A refit of any one term needs the parts side by side. For each GPT-1.3B row without
recompute in a `gpu_diagnose.py` file, the committed model prices the row's ops one by one
(`cost_models.compute.op_time_s`, at the row's micro-batch, on the preset of the GPU it ran on),
summed by op kind:
- GEMMs (matmul ops) against the diagnosis's `gemm` kernels;
- fused attention against its `attention` kernels;
- the rest of the step (vector ops, autocast's weight casts and gradient accumulation, the clip,
  the loss) against its elementwise, reduction and copy kernels;
- the optimizer step against its fused optimizer kernels;
- the GPU's idle time within the step, which the model does not price apart.
The measured parts are kernel time inside one profiled step; the priced total is the plan's step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_kernels import PRESETS  # noqa: E402  (device name -> preset)

DEFAULT_FILES = sorted((ROOT / "benchmarks" / "gpu_runs").glob("h[12]00-*-diagnosis.json"))
MODEL, SEQ_LEN, HEADS = "gpt3-1.3b", 2048, 16
VECTOR_KINDS = ("elementwise/other", "reduction", "copy", "triton")  # triton: inductor's fused kernels


@functools.cache
def _facts():
    import autopar
    from autopar.cost_models.facts import model_facts
    from autopar.models import build_model

    spec = build_model(MODEL, None)
    graph = autopar.trace(spec.module, spec.example_inputs(1, SEQ_LEN), loss_fn=spec.loss_fn, precision="bf16",
                          seq_len=SEQ_LEN)
    return spec, model_facts(graph, heads=HEADS, kv_heads=HEADS, vocab=spec.config.padded_vocab)


def priced_parts(preset: str, strategy: dict) -> dict[str, float]:
    """Seconds per step by part, with the committed cost model."""
    import autopar
    from autopar.cost_models.compute import DEFAULT_EFFICIENCY, input_casts_s, op_time_s

    spec, facts = _facts()
    cluster = autopar.load_cluster(preset, gpus=1)
    microbatch, count = strategy["microbatch"], strategy.get("num_microbatches", 1)
    # one GPU at ZeRO 0: autocast over fp32 weights; its casts of the GEMMs' inputs are vector work
    efficiency = replace(DEFAULT_EFFICIENCY, compiled=strategy["compile"],
                         padded_gemms=strategy.get("gemm_padding", True), autocast=True)
    parts = {"matmul": 0.0, "attention": 0.0, "vector": 0.0}
    for unit in facts.units:
        for op in unit.ops:
            if op.kind in parts:
                casts = input_casts_s(op, cluster.gpu, batch=microbatch, tp=1, efficiency=efficiency)
                parts[op.kind] += count * (op_time_s(op, cluster.gpu, "bf16", batch=microbatch, tp=1, sp=False,
                                                     efficiency=efficiency) - casts)
                parts["vector"] += count * casts
    fixed = ",".join(f"{k}={strategy[k]}" for k in ("dp", "tp", "pp", "zero", "recompute", "microbatch"))
    fixed += f",compile={str(strategy['compile']).lower()}"
    result = autopar.plan(spec.module, spec.example_inputs(1, SEQ_LEN), cluster=cluster,
                          global_batch=microbatch * count, loss_fn=spec.loss_fn, precision="bf16", name=MODEL,
                          seq_len=SEQ_LEN, strategy=fixed)
    predicted = (result.plan.predicted if result.plan is not None else result.prediction)
    step = predicted.step_time_s
    optimizer = predicted.breakdown["optimizer"]  # a plan's and a refused prediction's: both dicts
    return {"gemm": parts["matmul"], "attention": parts["attention"],
            "rest": step - parts["matmul"] - parts["attention"] - optimizer, "optimizer": optimizer,
            "idle": 0.0, "step": step, "vector_ops": parts["vector"]}


def measured_parts(row: dict) -> dict[str, float]:
    kinds = {kind: value["time_s"] for kind, value in row["by_kind"].items()}
    return {"gemm": kinds.get("gemm", 0.0), "attention": kinds.get("attention", 0.0),
            "rest": sum(kinds.get(kind, 0.0) for kind in VECTOR_KINDS), "optimizer": kinds.get("optimizer", 0.0),
            "idle": row["idle_s"], "step": row["busy_s"] + row["idle_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, default=DEFAULT_FILES)
    args = parser.parse_args(argv)
    shown = 0
    for path in args.files:
        record = json.loads(path.read_text())
        preset = next((p for marker, p in PRESETS if marker in record["device"]), None)
        for row in record["rows"]:
            strategy = row.get("strategy") or {}
            if (row.get("status") != "ok" or "@" in row["case"] or not row["case"].startswith("g13-")
                    or strategy.get("recompute") != "none" or strategy.get("num_microbatches", 1) != 1
                    or preset is None or "by_kind" not in row):
                continue
            priced, measured = priced_parts(preset, strategy), measured_parts(row)
            print(f"{path.name} {row['case']} ({record['device']}, {preset}; committed cost model)")
            print(f"  {'part':34s} {'priced ms':>10s} {'in-step ms':>11s} {'priced/in-step':>15s}")
            for part, label in (("gemm", "GEMMs"), ("attention", "fused attention"),
                                ("rest", "vector ops, casts, clip, loss"), ("optimizer", "optimizer step"),
                                ("idle", "GPU idle"), ("step", "step")):
                ratio = f"{priced[part] / measured[part] - 1:+.1%}" if measured[part] and priced[part] else "-"
                print(f"  {label:34s} {priced[part] * 1e3:10.1f} {measured[part] * 1e3:11.1f} {ratio:>15s}")
            shown += 1
    if not shown:
        print("step_parts: no GPT-1.3B row without recompute in the files given", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's time goes on the GPU, for the predictions that miss (issue #29).

    python benchmarks/gpu_diagnose.py --plans plans.json --out $OUT/gpu_diagnose.json [--cases a,b]

For each named plan row of `gpu_suite.py` (plans made earlier with `gpu_suite.py --predict-only`),
built through `parallelize` as the suite builds it:
- **phases**: the step's parts timed apart, a synchronization after each (forward and backward over
  the micro-batches, gradient sync, clipping, the optimizer, zero-grad and the loss), the order
  `ParallelModel.train_step` runs them in;
- **kernels** of one profiled step (torch.profiler): device time by kind (GEMM, attention, triton,
  the optimizer's, other elementwise, copies), the device's busy and idle time over the step's
  span, the longest kernels;
- **gradient accumulation**: the device time of autograd's AccumulateGrad nodes, the pass that adds
  each micro-batch's gradients into `.grad` (the lead for the micro-batch rows' under-prediction);
- **host**: the CPU time of the optimizer step and of FSDP's labelled regions (offload's suspects).

A CPU smoke run (`--device cpu --smoke`) checks the script; tests/test_benchmarks_smoke.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # noqa: E402
import gpu_suite_plans  # noqa: E402
from gpu_clock import ClockSampler  # noqa: E402

DEFAULT_CASES = "g13-mb8-sel,g13-mb8-none,g13-mb8-none-compile,g27-mb4-offload"
# two micro-batches, so that the smoke run sees gradients accumulated
SMOKE_CASE = ("smoke-mb2x2", "gpt", gpu_suite_plans.SMOKE_CONFIG, 64, 4, "fp32",
              "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=2", False)
KINDS = [  # first match wins
    ("copy", re.compile(r"^Memcpy|^Memset")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|splitK", re.I)),
    ("optimizer", re.compile(r"adam|FusedOptimizer", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|multi_tensor", re.I)),
]


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "elementwise/other")


def busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def device_time_us(event) -> float:
    return event.device_time_total


def kernel_summary(events) -> dict:
    """Device kernels of one step by kind, busy and idle time, the longest kernels."""
    # the device timeline also carries the host's labelled regions (record_function: the optimizer
    # step, FSDP's hooks) as user annotations: not kernels (at 0621687 this dropped every kernel named
    # like its host-side launch too, inductor's triton kernels: that file's compiled row lacks them)
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation]
    by_kind: dict[str, dict] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        duration = e.time_range.end - e.time_range.start
        row = by_kind.setdefault(kind_of(e.name), {"time_s": 0.0, "count": 0})
        row["time_s"] += duration / 1e6
        row["count"] += 1
        by_name.setdefault(e.name[:120], [0.0, 0])[0] += duration / 1e6
        by_name[e.name[:120]][1] += 1
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    span_s = (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e6 if spans else 0.0
    busy = busy_s(spans)
    longest = sorted(by_name.items(), key=lambda item: -item[1][0])[:15]
    return {"kernels": len(kernels), "span_s": span_s, "busy_s": busy, "idle_s": span_s - busy,
            "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1]["time_s"])),
            "longest": [{"name": name, "time_s": t, "count": n} for name, (t, n) in longest]}


def host_summary(events) -> dict:
    """Device time of gradient accumulation; CPU time of the optimizer step and FSDP's regions."""
    accumulate = [e for e in events if e.name == "torch::autograd::AccumulateGrad"]
    labelled: dict[str, dict] = {}
    for e in events:
        if e.name.startswith(("FSDP::", "Optimizer.step")):
            row = labelled.setdefault(e.name, {"cpu_s": 0.0, "device_s": 0.0, "count": 0})
            row["cpu_s"] += e.cpu_time_total / 1e6
            row["device_s"] += device_time_us(e) / 1e6
            row["count"] += 1
    return {"accumulate_grad": {"count": len(accumulate),
                                "device_s": sum(device_time_us(e) for e in accumulate) / 1e6,
                                "cpu_s": sum(e.cpu_time_total for e in accumulate) / 1e6},
            "labelled": dict(sorted(labelled.items(), key=lambda item: -item[1]["cpu_s"])[:20])}


def phase_times(parallel, ids: torch.Tensor, optimizer, device: str, steps: int) -> dict:
    """Mean seconds of each part of `train_step`, a synchronization after each part."""
    from autopar.runtime.optimizer import clear_gradient_scale

    parts = {"forward_backward": [], "sync_gradients": [], "clip": [], "optimizer": [], "zero_grad_and_loss": []}
    for _ in range(steps):
        gpu_suite.synchronize(device)
        marks = [time.perf_counter()]
        loss_sum = parallel.forward_backward(parallel.local_batch(ids))
        # the clip hands its scale to a fused optimizer as train_step's does (at 0621687 it did not here:
        # that file's clip phase includes a scaling pass train_step no longer makes)
        for act in (lambda: None, parallel.sync_gradients, lambda: parallel.clip_grad_norm_(1.0, optimizer),
                    optimizer.step,
                    lambda: (clear_gradient_scale(optimizer), optimizer.zero_grad(set_to_none=True),
                             parallel.global_loss(loss_sum))):
            act()
            gpu_suite.synchronize(device)
            marks.append(time.perf_counter())
        for name, start, end in zip(parts, marks, marks[1:]):
            parts[name].append(end - start)
    return {name: sum(times) / len(times) for name, times in parts.items()}


def attention_first(backend: str | None):
    """SDPA's backends with `backend` ("cudnn") tried first, for the whole row: compile and warm-up
    included, since a compiled graph keeps the backend chosen when it was traced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend is None:
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True) if backend == "cudnn" else contextlib.nullcontext()


def diagnose(case: tuple, made: dict, device: str, steps: int, attention: str | None = None) -> dict:
    """One plan row: phases, then one profiled step's kernels and host regions."""
    from torch.profiler import ProfilerActivity, profile

    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    name, model, config, seq_len, batch, precision, _, compile_ = case
    spec = build_model(model, config)
    plan = Plan.from_json(made["plan"])

    def measure() -> dict:
        with attention_first(attention):
            return measured()

    def measured() -> dict:
        gpu_suite.free(device)
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=0, precision=precision, compile=compile_)
        optimizer = parallel.build_optimizer(1e-4)
        ids = torch.randint(0, spec.config.vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        for _ in range(3 if compile_ else 2):
            parallel.train_step(ids, optimizer, max_grad_norm=1.0)
        with ClockSampler() as clock:  # the SM clock and power over the timed steps (`gpu_clock.py`)
            phases = phase_times(parallel, ids, optimizer, device, 2 if plan.strategy.offload != "none" else steps)
        gpu_suite.synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            parallel.train_step(ids, optimizer, max_grad_norm=1.0)
            gpu_suite.synchronize(device)
            profiled_s = time.perf_counter() - started
        events = prof.events()
        return {"strategy": plan.strategy.model_dump(), "predicted": made["predicted"],
                "phases_s": phases, "clock": clock.summary(), "profiled_step_s": profiled_s,
                **kernel_summary(events), **host_summary(events)}

    return {"case": name + (f"@{attention}-attention" if attention else "")} | gpu_suite.guarded(measure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--plans", help="plans made by gpu_suite.py --predict-only (made here when left out)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="plan rows to diagnose (comma-separated names)")
    parser.add_argument("--out", default="gpu_diagnose.json")
    parser.add_argument("--cudnn-attention", default="",
                        help="rows to run again with cuDNN's attention tried first (comma-separated names)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan for the phases")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on CPU: checks the script, nothing else")
    args = parser.parse_args(argv)
    wanted = [SMOKE_CASE] if args.smoke else [c for c in gpu_suite_plans.PLANS if c[0] in set(args.cases.split(","))]
    if args.plans:
        carried = json.loads(Path(args.plans).read_text())
        made, made_at = carried["plans"], carried["commit"]
    else:
        made, made_at = gpu_suite_plans.make_plans(wanted, lambda line: print(line, flush=True)), gpu_suite.commit()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore())
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    record = {"device": device, "torch": torch.__version__, "commit": gpu_suite.commit(), "plans_made_at": made_at,
              "rows": []}
    again = [(c, "cudnn") for c in ([SMOKE_CASE] if args.smoke else gpu_suite_plans.PLANS) if c[0] in set(args.cudnn_attention.split(","))]
    for case, attention in [(c, None) for c in wanted] + again:
        started = time.perf_counter()
        row = diagnose(case, made[case[0]], args.device, args.steps, attention) \
            if "plan" in made.get(case[0], {}) else {"case": case[0], "status": "not planned"}
        record["rows"].append(row)
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
        phases = {k: round(v * 1e3, 1) for k, v in row.get("phases_s", {}).items()}
        print(f"{row['case']}: {row['status']} in {time.perf_counter() - started:.0f} s; phases ms {phases}; "
              f"busy {row.get('busy_s', 0) * 1e3:.1f} ms idle {row.get('idle_s', 0) * 1e3:.1f} ms; "
              f"accumulate {row.get('accumulate_grad', {}).get('device_s', 0) * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

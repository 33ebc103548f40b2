"""The whole one-GPU check in one command (issue #29): autopar's runtime against hand-written PyTorch,
predicted against measured on a dozen plans, and the op profile, each goal with a verdict.

    python benchmarks/gpu_suite.py --out $OUT/gpu_suite.json [--plans plans.json] [--budget-s 470]

Plans are made with `autopar.plan` for one GPU of the `--cluster` preset (`dgx-h100` unless
named, `dgx-h200` for an H200; strategy fixed as listed in `gpu_suite_plans.PLANS`, plus two the search chooses)
and run through `parallelize` → `ParallelModel.train_step` with the optimizer the runtime builds
(`ParallelModel.build_optimizer`). `--predict-only --out plans.json`
makes them without a GPU (tracing and search on CPU), so the device's minutes go to measuring;
`--plans plans.json` then reads them (made at the same commit: the file says which).

Measured per plan: step time (warm-up steps untimed, then each step between synchronizations; mean
and min; then, but for offload rows, three steps back to back with each loss read once the next step
is queued, as `autopar run` reads them: `step_time_s_back_to_back`), `max_memory_allocated` and `max_memory_reserved` over all steps after a reset taken before
`parallelize`, first and last loss, or the out-of-memory / error that stopped it. Phases, in order of
value, each skipped with its reason when `--budget-s` would be exceeded: plans, baselines (plain
eager, plain compiled, the reference GPT eager and compiled: `gpu_baselines.py`), kernels per step
(torch.profiler), the op profile (`autopar profile` of GPT-2 124M) and its calibrated predictions.
The JSON is rewritten after every row, so a run cut short keeps what it measured. Verdicts:
`python benchmarks/gpu_rows.py FILE` re-prices any such file with the cost model at hand.

A CPU smoke run (`--device cpu --smoke`: a tiny GPT, fp32, two plans, no compile) only checks that the
script works; tests/test_benchmarks_smoke.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_baselines import plain_step, reference_step  # noqa: E402
from gpu_suite_goals import (DEFAULT_ALLOCATOR_CASES, attention_flops_per_token, mfu,  # noqa: E402
                             mfu_with_attention, params_of, verdicts)
from gpu_suite_plans import GPT13, PLANS, SMOKE_CONFIG, SMOKE_PLANS, make_plans, priced_on_this_host  # noqa: E402


def commit() -> str:
    """HEAD's short hash; AUTOPAR_COMMIT where the checkout travels without its .git (the device machine)."""
    if os.environ.get("AUTOPAR_COMMIT"):
        return os.environ["AUTOPAR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"



def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed(step, device: str, warmup: int, steps: int, queued_step=None, queued_steps: int = 0) -> dict:
    """Warm-up steps untimed, then each step between synchronizations (the rows compare on these).
    With `queued_step` (one that returns its loss queued, `ParallelModel.queued_train_step`), then
    `queued_steps` more back to back, each loss read once the next step is queued as `autopar run`
    reads them: their mean is what a run's tokens/s sees, without a wait for the host between steps.
    `warmup_s`: the warm-up steps' wall time, a compiled row's one-time compile in it (what choosing
    compile for a short run would have to price)."""
    synchronize(device)
    started = time.perf_counter()
    losses = [float(step()) for _ in range(warmup)]
    synchronize(device)
    warmup_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        losses.append(float(step()))
        synchronize(device)
        times.append(time.perf_counter() - started)
    record = {"step_time_s_mean": sum(times) / len(times), "step_time_s_min": min(times), "warmup_s": warmup_s,
              "first_loss": losses[0], "last_loss": losses[-1], "losses": losses}
    if queued_step is not None and queued_steps > 0:
        synchronize(device)
        started, previous = time.perf_counter(), None
        for _ in range(queued_steps):
            current = queued_step()
            if previous is not None:
                losses.append(previous.value())
            previous = current
        losses.append(previous.value())
        synchronize(device)
        record |= {"step_time_s_back_to_back": (time.perf_counter() - started) / queued_steps,
                   "last_loss": losses[-1]}
    if device == "cuda":
        record |= {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                   "max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
    return record


def guarded(measure) -> dict:
    """One row; an out-of-memory or a failure is this row's status, not the end of the suite."""
    try:
        return {"status": "ok", **measure()}
    except torch.OutOfMemoryError:
        return {"status": "out of memory"}
    except Exception as error:  # a compile failure in one row must not hide the others
        first = (str(error).strip().splitlines() or [""])[0][:300]
        return {"status": f"error: {type(error).__name__}: {first}"}


@contextlib.contextmanager
def default_allocator(device: str, wanted: bool):
    """The CUDA allocator's default setting for one row: set as a user would (PYTORCH_CUDA_ALLOC_CONF,
    which `configure_allocator` leaves as it is), then autopar's own setting again for the next rows."""
    if not wanted or device != "cuda":
        yield
        return
    setting = "expandable_segments:False"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = setting
    torch.cuda.memory._set_allocator_settings(setting)
    try:
        yield
    finally:
        del os.environ["PYTORCH_CUDA_ALLOC_CONF"]


@contextlib.contextmanager
def unpadded_runtime(wanted: bool):
    """The runtime with its GEMM padding patched out, for a `gemm_padding=false` row: the what-if
    plan's price against the step measured without the padding (the runtime runs no such plan)."""
    if not wanted:
        yield
        return
    import importlib

    capabilities = importlib.import_module("autopar.capabilities")
    recipe = importlib.import_module("autopar.runtime.parallelize")  # the module (the package exports the function)

    padding, knobs = recipe.apply_gemm_padding, capabilities._RUNTIME_KNOBS
    recipe.apply_gemm_padding = lambda model, strategy, precision: "off (patched out by the benchmark)"
    capabilities._RUNTIME_KNOBS = tuple((knob, False if knob == "gemm_padding" else value) for knob, value in knobs)
    try:
        yield
    finally:
        recipe.apply_gemm_padding, capabilities._RUNTIME_KNOBS = padding, knobs


def run_plan(case: tuple, made: dict, device: str, steps: int) -> dict:
    """Measure one plan through autopar's runtime."""
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    name, model, config, seq_len, batch, precision, _, compile_ = case
    plan = Plan.from_json(made["plan"])
    spec = build_model(model, config)
    unpadded = not plan.strategy.gemm_padding

    def measure() -> dict:
        free(device)
        with default_allocator(device, name in DEFAULT_ALLOCATOR_CASES), unpadded_runtime(unpadded):
            parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, seed=0, precision=precision,
                                   compile=plan.strategy.compile or compile_ is True)
        optimizer = parallel.build_optimizer(1e-4)
        ids = torch.randint(0, spec.config.vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        offload = plan.strategy.offload != "none"
        warmup = 2  # the same for every row, so that losses compare step by step (compiled vs eager)
        record = timed(lambda: parallel.train_step(ids, optimizer, max_grad_norm=1.0), device,
                       warmup, max(2, steps // 2) if offload else steps,
                       queued_step=lambda: parallel.queued_train_step(ids, optimizer, max_grad_norm=1.0),
                       queued_steps=0 if offload else 3)
        return record | {"optimizations": dict(parallel.optimizations)}

    return guarded(measure)


def baselines(device: str, smoke: bool, steps: int) -> list[tuple[str, object]]:
    """(name, step factory) of the hand-written baselines (`gpu_baselines.py`)."""
    if smoke:
        tiny = dict(layers=2, hidden=64, heads=4, batch=4, seq_len=64, vocab=384, real_vocab=257, device=device)
        return [("plain eager", lambda: plain_step("gpt", SMOKE_CONFIG + ",vocab_multiple=1", 4, 64, "fp32", False,
                                                   device)),
                ("reference eager", lambda: reference_step(compiled=False, **tiny))]
    model, config, seq_len = GPT13
    unpadded = "vocab_multiple=1"
    gpt13 = dict(layers=24, hidden=2048, heads=16, batch=8, seq_len=seq_len)
    return [("plain eager", lambda: plain_step(model, unpadded, 8, seq_len, "bf16", False)),
            ("plain compiled", lambda: plain_step(model, unpadded, 8, seq_len, "bf16", True)),
            ("reference eager", lambda: reference_step(compiled=False, **gpt13)),
            ("reference compiled", lambda: reference_step(compiled=True, **gpt13))]


def kernels_per_step(case: tuple, made: dict, device: str) -> dict:
    """Kernels one training step launches (torch.profiler), the launch-overhead floor's count."""
    from torch.profiler import ProfilerActivity, profile

    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    name, model, config, seq_len, batch, precision, _, compile_ = case
    spec = build_model(model, config)

    def measure() -> dict:
        free(device)
        plan = Plan.from_json(made["plan"])
        compiled = plan.strategy.compile or compile_ is True  # a plans file from before compile was priced
        parallel = parallelize(spec.module, plan, loss_fn=spec.loss_fn, precision=precision, compile=compiled)
        optimizer = parallel.build_optimizer(1e-4)
        ids = torch.randint(0, spec.config.vocab, (batch, seq_len))
        for _ in range(3 if compiled else 2):
            parallel.train_step(ids, optimizer, max_grad_norm=1.0)
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            parallel.train_step(ids, optimizer, max_grad_norm=1.0)
            synchronize(device)
        events = prof.events()
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                       "cuLaunchKernelEx"))
        kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        return {"case": name, "kernel_launches": launches, "device_events": kernels}

    return guarded(measure)


def op_profile(device: str, out_dir: Path, smoke: bool) -> dict:
    """Profile GPT-1.3B's step ops at micro-batches 8, 4, 2, 1 into a database beside the JSON, for
    `gpu_rows.py` to calibrate predictions with; and GPT-2 124M's op sum against its eager step."""
    import profile_validation as pv

    model, config, seq_len, batch = ("gpt", SMOKE_CONFIG, 64, 4) if smoke else ("gpt3-1.3b", None, 2048, 8)
    db = out_dir / "gpu_suite_profile.db"

    def measure() -> dict:
        free(device)
        started = time.perf_counter()
        profiled = pv.profiled_step(model, config, batch=batch, seq_len=seq_len, precision="bf16", device=device,
                                    db_path=str(db), repeats=5, variants=not smoke)
        small = ("gpt", SMOKE_CONFIG, 64) if smoke else ("gpt2-124m", None, 1024)
        shape = dict(batch=4, seq_len=small[2], precision="bf16", device=device)
        small_db = str(out_dir / "gpu_suite_profile_124m.db")
        small_profiled = pv.profiled_step(small[0], small[1], **shape, db_path=small_db, repeats=5)
        small_measured = pv.measured_step(small[0], small[1], **shape, repeats=5)
        return {"database": db.name, "gpt13": {k: profiled[k] for k in ("signatures", "step_time_s", "coverage")},
                "gpt2_124m": {"profiled_s": small_profiled["step_time_s"], "eager_s": small_measured["step_time_s"],
                              **pv.compare(small_profiled, small_measured)},
                "wall_s": time.perf_counter() - started}

    return guarded(measure)


class Suite:
    """Rows in measurement order, rewritten to the JSON after each; the phases' time budget."""

    def __init__(self, args) -> None:
        self.args, self.started = args, time.perf_counter()
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        self.record = {"device": device, "torch": torch.__version__, "commit": commit(), "host": platform.node(),
                       "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                       "plans": [], "baselines": [], "kernels": [], "op_profile": None, "skipped": []}

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def afford(self, what: str, cost_s: float) -> bool:
        if self.left_s() >= cost_s:
            return True
        self.record["skipped"].append(f"{what}: {self.left_s():.0f} s left of --budget-s, needs about {cost_s:.0f}")
        return False

    def save(self) -> None:
        self.record["wall_s"] = time.perf_counter() - self.started
        Path(self.args.out).write_text(json.dumps(self.record, indent=1, default=str) + "\n")

    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {line}", flush=True)


def measure_plans(suite: Suite, cases: list[tuple], made: dict, peak: float, only: set[str]) -> None:
    """Each plan row through autopar's runtime, with its MFU in both accountings; offload rows are also
    priced with this host's measured rates."""
    args = suite.args
    for case in cases:
        name, model, config, seq_len, batch, precision, strategy, compile_ = case
        if only and name not in only:
            continue
        row = {"case": name, "model": model, "model_config": config, "seq_len": seq_len, "global_batch": batch,
               "precision": precision, "fixed": strategy, "compile": compile_}
        planned = made.get(name, {})
        if "plan" not in planned:
            row["status"] = f"refused by the search: {planned.get('refused', 'not planned')}"
        elif suite.afford(f"plan {name}", 60 if compile_ else 20):
            row |= {"strategy": planned["strategy"], "predicted": planned["predicted"]}
            row |= run_plan(case, planned, args.device, args.steps)
            if row["status"] == "ok":
                params = params_of(model, config)
                row["mfu"] = mfu(params, batch * seq_len, row["step_time_s_mean"], peak)
                row["mfu_with_attention"] = mfu_with_attention(
                    params, attention_flops_per_token(model, config, seq_len), batch * seq_len,
                    row["step_time_s_mean"], peak)
                if row.get("step_time_s_back_to_back"):
                    row["mfu_back_to_back"] = mfu(params, batch * seq_len, row["step_time_s_back_to_back"], peak)
            if strategy and "offload=optimizer" in strategy and suite.afford(f"host rates {name}", 20):
                row["predicted_on_this_host"] = guarded(lambda: priced_on_this_host(case, args.device))
        else:
            continue
        suite.record["plans"].append(row)
        suite.save()
        back_to_back = row.get("step_time_s_back_to_back")
        suite.say(f"{name}: {row['status']} " + (f"{row['step_time_s_mean'] * 1e3:.1f} ms (predicted "
                  f"{row['predicted']['step_time_s'] * 1e3:.1f}" + (f"; back to back {back_to_back * 1e3:.1f}"
                                                                    if back_to_back else "") + ")"
                                                    if row["status"] == "ok" else ""))


def measure_baselines(suite: Suite, peak: float) -> None:
    """The hand-written baselines' rows, under the allocator setting the plans left (parallelize
    configures the CUDA allocator for the process: runtime/allocator.py)."""
    args = suite.args
    ran = [row for row in suite.record["plans"] if "optimizations" in row]
    suite.record["baselines_allocator"] = ran[-1]["optimizations"].get("allocator", "default") if ran else "default"
    model, config, seq_len = ("gpt", SMOKE_CONFIG, 64) if args.smoke else GPT13
    params, tokens = params_of(model, config), (4 * 64) if args.smoke else 8 * seq_len
    attention = attention_flops_per_token(model, config, seq_len)
    for name, factory in baselines(args.device, args.smoke, args.steps):
        if not suite.afford(name, 90 if "compiled" in name else 20):
            continue
        free(args.device)
        row = {"variant": name} | guarded(lambda: timed(factory(), args.device, 3, 2 * args.steps))
        if row["status"] == "ok":
            row["mfu"] = mfu(params, tokens, row["step_time_s_mean"], peak)
            row["mfu_with_attention"] = mfu_with_attention(params, attention, tokens, row["step_time_s_mean"], peak)
        suite.record["baselines"].append(row)
        suite.save()
        suite.say(f"{name}: {row['status']} " + (f"{row['step_time_s_mean'] * 1e3:.1f} ms, MFU {row['mfu']:.1%}"
                                                 if row["status"] == "ok" else ""))


def measure_kernels(suite: Suite, cases: list[tuple], made: dict) -> None:
    """Kernels per step of the eager and compiled GPT-1.3B rows (the launch-overhead floor's count)."""
    for case in [c for c in cases if c[0] in ("g13-mb8-none", "g13-mb8-none-compile", "smoke-mb4")]:
        if case[0] not in made or not suite.afford(f"kernels {case[0]}", 40):
            continue
        suite.record["kernels"].append(kernels_per_step(case, made[case[0]], suite.args.device))
        suite.save()
        suite.say(f"kernels {case[0]}: {suite.record['kernels'][-1]}")


def report(suite: Suite) -> None:
    """The verdicts, written to the JSON and printed one per goal, and what the budget skipped."""
    suite.record["verdicts"] = verdicts(suite.record)
    suite.save()
    print(f"device {suite.record['device']}, torch {suite.record['torch']}, commit {suite.record['commit']}, "
          f"{suite.record['wall_s']:.0f} s")
    for row in suite.record["verdicts"]:
        print(f"  {row['verdict']:>12}  {row['goal']}: {row['value']}" + (f" ({row['why']})" if "why" in row else ""))
    for line in suite.record["skipped"]:
        print(f"  skipped: {line}")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default="gpu_suite.json", help="the JSON written (plans.json with --predict-only)")
    parser.add_argument("--plans", help="plans made earlier with --predict-only (skips tracing here)")
    parser.add_argument("--predict-only", action="store_true", help="make the plans and stop (no GPU needed)")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on CPU: checks the script, nothing else")
    parser.add_argument("--cluster", default="dgx-h100",
                        help="the one-GPU preset the plans are made for (dgx-h200 on an H200)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="skip phases that would end after this")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--skip", default="", help="phases to skip: plans,baselines,kernels,profile")
    parser.add_argument("--cases", default="", help="run only these plan rows (comma-separated names)")
    args = parser.parse_args(argv)
    if not args.predict_only and args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available: use --device cpu --smoke for a smoke run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = SMOKE_PLANS if args.smoke else PLANS
    if args.predict_only:
        made = make_plans(cases, lambda line: print(line, flush=True), args.cluster)
        Path(args.out).write_text(json.dumps({"commit": commit(), "cluster": args.cluster, "plans": made}) + "\n")
        return 0
    suite = Suite(args)
    skip = set(filter(None, args.skip.split(",")))
    if args.plans:
        carried = json.loads(Path(args.plans).read_text())
        made = carried["plans"]
        suite.record["plans_made_at"] = carried["commit"]
        args.cluster = carried.get("cluster", "dgx-h100")
    else:
        made = make_plans(cases, suite.say, args.cluster)
        suite.record["plans_made_at"] = suite.record["commit"]
    from autopar.cluster import load_cluster

    suite.record["cluster"] = args.cluster
    peak = load_cluster(args.cluster, gpus=1).gpu.peak_flops_per_s("bf16")
    suite.record["peak_flops_per_s"] = peak
    import torch.distributed as dist

    if not dist.is_initialized():  # one process group for every plan (parallelize reuses it)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore())
    if "plans" not in skip:
        measure_plans(suite, cases, made, peak, set(filter(None, args.cases.split(","))))
    if "baselines" not in skip:
        measure_baselines(suite, peak)
    if "kernels" not in skip:
        measure_kernels(suite, cases, made)
    if "profile" not in skip and suite.afford("op profile", 90):
        suite.record["op_profile"] = op_profile(args.device, Path(args.out).resolve().parent, args.smoke)
        suite.say(f"op profile: {suite.record['op_profile']}")
    report(suite)
    return 0

if __name__ == "__main__":
    sys.exit(main())

"""Which parallelism runs on models no one here wrote: plan, dp, ZeRO-3, tp, pp per model (issue #17).

For each model of `benchmarks/zoo_models.py` (Hugging Face causal, masked, encoder-decoder, vision
and audio models built from configs, plain-torch oddities) and each mode, on 2 gloo processes:
  plan      `autopar.plan` with the mode's degrees fixed (dgx-h100 sized to 2 GPUs, fp32);
  run       `autopar.parallelize` trains 3 steps on the planned layout; parity with one process
            (losses rtol 1e-4, final weights rtol/atol 1e-4) and the last step's collectives equal to
            the plan's ledger.
Each cell is ok, refused (a reason given before anything ran), mismatch (ran, but parity or the
ledger failed) or crashed (an exception or a hang mid-run). Goals: 0 crashes; tp with parity on
≥ 90% of the models whose blocks hold Linear projections; pp on ≥ 90% of those with ≥ 2 repeated blocks.

    python benchmarks/zoo_coverage.py [--only llama,bert] [--modes dp,tp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_models import ZooModel, by_name, zoo  # noqa: E402

MODES = {
    "dp": dict(dp=2, tp=1, pp=1, zero=0),
    "zero3": dict(dp=2, tp=1, pp=1, zero=3),
    "tp": dict(dp=1, tp=2, pp=1),
    "pp": dict(dp=1, tp=1, pp=2),
}
WORLD = 2
GLOBAL_BATCH = 4
STEPS = 3
SEED = 1234
LR = 0.05
MAX_GRAD_NORM = 1.0
TIMEOUT_S = 240
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def built(model: ZooModel) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return model.build()


def batches(model: ZooModel) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [model.inputs(GLOBAL_BATCH, generator) for _ in range(STEPS)]


def optimizer_for(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(model: ZooModel, data: list[torch.Tensor]) -> tuple[list[float], dict]:
    module = built(model)
    optimizer = optimizer_for(module.parameters())
    losses = []
    for batch in data:
        loss = model.loss_fn(module(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in module.named_parameters()}


def plan_for(model: ZooModel, strategy: dict):
    import autopar

    with torch.device("meta"):
        module = model.build()
    result = autopar.plan(module, model.example(), cluster=autopar.load_cluster("dgx-h100", gpus=WORLD),
                          global_batch=GLOBAL_BATCH, strategy=strategy, loss_fn=model.loss_fn, precision="fp32",
                          name=model.name)
    if result.plan is None:
        raise autopar.AutoparError(result.no_fit_reason())
    return result.plan


def worker(job_path: str, rank: int) -> None:
    """One rank of one job (run as a subprocess): parallelize, train, count, gather, save."""
    import torch.distributed as dist

    from autopar.plan_schema import Plan
    from autopar.runtime.collectives import CollectiveCounter, group_axes
    from autopar.runtime.parallelize import parallelize

    job = torch.load(job_path, weights_only=False)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = by_name()[job["model"]]
    result: dict = {}
    try:
        parallel = parallelize(built(model), Plan.from_json(job["plan"]), loss_fn=model.loss_fn, seed=SEED)
        optimizer = optimizer_for(parallel.parameters())
        data = job["data"]
        losses = [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in data[:-1]]
        with CollectiveCounter(group_axes(parallel)) as counter:
            losses.append(parallel.train_step(data[-1], optimizer, max_grad_norm=MAX_GRAD_NORM))
        state = parallel.full_state_dict()
        result = {"losses": losses, "collectives": counter.counts.as_rows(), "pp_rank": parallel.layout.pp_rank,
                  "state": state if parallel.layout.dp_rank == 0 and parallel.layout.tp_rank == 0 else {}}
    except Exception as error:  # recorded, not raised: the parent classifies it
        from autopar.errors import AutoparError

        kind = "refused" if isinstance(error, AutoparError) else "crashed"
        result = {"error": kind, "message": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"}
    torch.save(result, f"{job_path}.rank{rank}")
    os._exit(0)  # gloo's threads outlive destroy_process_group (autopar/__main__.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(model: ZooModel, plan, data: list[torch.Tensor], directory: Path) -> list[dict] | str:
    """Both ranks' results, or "hung" when the job outlives TIMEOUT_S."""
    job_path = directory / f"{model.name}.job"
    torch.save({"model": model.name, "plan": plan.to_json(), "data": data, "port": _free_port()}, job_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    processes = [subprocess.Popen([sys.executable, __file__, "--worker", str(job_path), str(rank)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank in range(WORLD)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=max(deadline - time.monotonic(), 1))[1])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            return "hung"
    results = []
    for rank, stderr in enumerate(outputs):
        path = Path(f"{job_path}.rank{rank}")
        if not path.exists():
            last = [line for line in (stderr or "").splitlines() if line.strip()]
            return f"crashed: rank {rank} died ({last[-1][:200] if last else 'no output'})"
        results.append(torch.load(path, weights_only=False))
    return results


def verdict(plan, results: list[dict], reference_losses: list[float], reference_state: dict) -> tuple[str, str]:
    from autopar.cost_models.collectives import merge_world

    errors = [r for r in results if "error" in r]
    if errors:
        return errors[0]["error"], errors[0]["message"]
    for rank, result in enumerate(results):
        got, want = torch.tensor(result["losses"]), torch.tensor(reference_losses)
        if not torch.allclose(got, want, rtol=TOLERANCE["rtol"], atol=0):
            return "mismatch", f"rank {rank} losses {got.tolist()} vs one process {want.tolist()}"
        predicted = {(r.axis, r.kind): (r.calls, r.bytes) for r in plan.predicted.collectives[result["pp_rank"]]}
        predicted = {key: (calls, round(size)) for key, (calls, size) in
                     merge_world(predicted, {axis.name: axis.size for axis in plan.mesh}).items()}
        if result["collectives"] != predicted:
            return "mismatch", f"rank {rank} ledger: executed {sorted(result['collectives'].items())} vs " \
                               f"planned {sorted(predicted.items())}"
    state = {}
    for result in results:
        state.update(result["state"])
    if set(state) != set(reference_state):
        return "mismatch", f"gathered weights differ in names: {sorted(set(state) ^ set(reference_state))[:3]}"
    for name, value in state.items():
        if not torch.allclose(value, reference_state[name], **TOLERANCE):
            error = (value - reference_state[name]).abs().max().item()
            return "mismatch", f"weight {name} off by {error:.2e}"
    return "ok", ""


def cell(model: ZooModel, mode: str, data, ref, directory: Path) -> tuple[str, str]:
    from autopar.errors import AutoparError

    try:
        plan = plan_for(model, MODES[mode])
    except AutoparError as error:
        return "refused", str(error)
    except Exception as error:  # the planner itself crashed: that is a crash too
        return "crashed", f"plan: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    results = run_job(model, plan, data, directory)
    if isinstance(results, str):
        return ("crashed", results) if results != "hung" else ("crashed", f"hung past {TIMEOUT_S} s")
    return verdict(plan, results, *ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--json", help="write every cell as JSON here")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    models = [m for m in zoo() if not args.only or m.name in args.only.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"commit {commit}; {WORLD} gloo processes, {STEPS} steps")
    print(f"{'model':<22} {'family':<8} " + " ".join(f"{m:<9}" for m in modes))
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as temporary:
        for model in models:
            data = batches(model)
            try:
                ref = reference(model, data)
            except Exception as error:
                print(f"{model.name:<22} reference run failed: {error}")
                continue
            cells = {mode: cell(model, mode, data, ref, Path(temporary)) for mode in modes}
            rows.append({"model": model.name, "family": model.family, "linear_blocks": model.linear_blocks,
                         "repeated_blocks": model.repeated_blocks,
                         "cells": {mode: {"status": s, "reason": r} for mode, (s, r) in cells.items()}})
            print(f"{model.name:<22} {model.family:<8} " + " ".join(f"{cells[m][0]:<9}" for m in modes), flush=True)
    print("\nreasons")
    for row in rows:
        for mode, c in row["cells"].items():
            if c["status"] != "ok":
                print(f"  {row['model']} {mode} {c['status']}: {c['reason']}")
    print("\n" + summary(rows, modes) + f" ({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "rows": rows}, indent=2))


def summary(rows: list[dict], modes: list[str]) -> str:
    counts = {mode: {} for mode in modes}
    for row in rows:
        for mode, c in row["cells"].items():
            counts[mode][c["status"]] = counts[mode].get(c["status"], 0) + 1
    crashes = sum(c.get("crashed", 0) for c in counts.values())
    parts = [f"{mode}: " + ", ".join(f"{n} {status}" for status, n in sorted(c.items())) for mode, c in counts.items()]
    goals = []
    for mode, eligible in (("tp", lambda r: r["linear_blocks"]), ("pp", lambda r: r["repeated_blocks"] >= 2)):
        if mode in modes:
            pool = [r for r in rows if eligible(r)]
            ok = sum(r["cells"][mode]["status"] == "ok" for r in pool)
            goals.append(f"{mode} parity {ok}/{len(pool)} eligible ({ok / max(len(pool), 1):.0%}, goal ≥ 90%)")
    return (f"summary: {len(rows)} models; " + "; ".join(parts) + f"; crashes {crashes} (goal 0); " + "; ".join(goals))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()

"""Crash recovery and elastic restarts under torchrun.

Crash trials: each launches `torchrun --max-restarts 1 -m autopar run` with checkpoints every K
steps, waits until rank 0's metrics reach a randomly drawn step, SIGKILLs one worker (a random
rank), and lets torchrun restart the job, which resumes from its last checkpoint (`--resume auto`).
The final checkpoint's weights and optimizer state must equal, bit for bit, those of a run that was
never interrupted (fp32 on CPU is deterministic for a fixed plan).

Elastic trials: two torchrun agents on this machine form one job (`--nnodes 1:2`, one process
each, c10d rendezvous on localhost); at a random step one agent and its worker are SIGKILLed (a
node lost). The surviving agent re-forms the job with one process; `autopar run` searches a plan
for that world size, reshards the last checkpoint onto it and continues. Such a trial counts as
exact when its final checkpoint equals, bit for bit, that of a one-process run started from the
same checkpoint (the uninterrupted run at the new size from that step), with the same losses;
the losses after the restart are also compared with an uninterrupted two-process run (the data
position must be exact; only the reduction order differs).

    python benchmarks/fault_injection.py                  # 20 crash trials and 5 elastic trials
    python benchmarks/fault_injection.py --trials 3 --elastic-trials 1 --steps 8

Measured (2-core x86-64 VM shared with other jobs, torch 2.13.0 CPU, 2026-11-24, --trials 5
--elastic-trials 5): crash 5/5 exact; elastic 5/5 exact (continued from steps 9, 3, 6, scratch, 3;
losses after the restart within 2.1e-7 relative of the uninterrupted two-process run); 705 s.

Prints the machine, one line per trial, "recovered exactly: N/T" and "elastic: resumed exactly:
N/T"; exits 1 unless every trial counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIG = "layers=2,hidden=32,heads=2,vocab=257,seq_len=32"
ELASTIC_GLOBAL_BATCH = 8
# Both agents must join the first rendezvous round (10 s window), so that the job starts with two
# processes rather than growing from one; a lost agent is declared dead after 3 missed 1 s heartbeats.
ELASTIC_RDZV_CONF = "join_timeout=120,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def train_arguments(workdir: Path, steps: int, checkpoint_every: int | None, global_batch: int) -> list[str]:
    """`autopar run`'s flags shared by every launch here (all checkpoints kept, for the references)."""
    every = ["--checkpoint-every", str(checkpoint_every)] if checkpoint_every else []
    return ["-m", "autopar", "run", "--model", "gpt", "--model-config", MODEL_CONFIG, "--cluster", "local",
            "--global-batch", str(global_batch), "--steps", str(steps), "--precision", "fp32", "--lr", "3e-3",
            "--checkpoint-dir", str(workdir / "checkpoints"), *every, "--keep-last", "1000", "--log-every", "1",
            "--metrics", str(workdir / "metrics.jsonl"), "--no-progress"]


def job_command(workdir: Path, nproc: int, steps: int, checkpoint_every: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            *train_arguments(workdir, steps, checkpoint_every, 4 * nproc), "--strategy", f"dp={nproc}"]


def _environment() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    return env


def last_logged_step(metrics: Path) -> int:
    import json

    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.strip().endswith("}")]
    return max(steps, default=0)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The worker torchrun started for `rank` (its children carry RANK in their environment)."""
    try:
        children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


def run_job(workdir: Path, *, nproc: int = 2, steps: int = 10, checkpoint_every: int = 3,
            kill_after_step: int | None = None, kill_rank: int = 1, timeout_s: float = 300) -> dict:
    """One launch; with kill_after_step, SIGKILL `kill_rank` once rank 0 has logged that step."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "log.txt", "w")
    command = job_command(workdir, nproc, steps, checkpoint_every, max_restarts=1 if kill_after_step else 0)
    process = subprocess.Popen(command, cwd=workdir, env=_environment(), stdout=log, stderr=subprocess.STDOUT)
    killed_at = None
    deadline = time.monotonic() + timeout_s
    try:
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"job in {workdir} ran past {timeout_s:.0f} s")
            if kill_after_step is not None and killed_at is None:
                logged = last_logged_step(workdir / "metrics.jsonl")
                pid = worker_pid(process.pid, kill_rank) if logged >= kill_after_step else None
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = logged
            time.sleep(0.05)
    finally:
        log.close()
    text = (workdir / "log.txt").read_text()
    return {"returncode": process.returncode, "killed_after_step": killed_at,
            "resumed": "resumed from" in text, "log": text}


def losses(metrics: Path) -> dict[int, float]:
    """{step: loss} from a metrics file (the last record of each step: a resumed run rewrites them)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return {}
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def final_state(checkpoints: Path, steps: int) -> dict:
    """Everything the final checkpoint holds (weights, optimizer state), as plain tensors, read with
    the allow-list reader `autopar run` loads with (nothing in the files is executed)."""
    from autopar.runtime.checkpoint.reader import read_checkpoint_state

    return read_checkpoint_state(checkpoints / f"step-{steps:08d}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and the workers it started (they run in sessions of their own)."""
    workers = _children(process.pid)
    if process.poll() is None:
        process.kill()
    for worker in workers:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def elastic_command(workdir: Path, port: int, steps: int, checkpoint_every: int) -> list[str]:
    """One agent of a two-node elastic job on this machine (no --strategy: each round searches a plan)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", "autopar-elastic", "--rdzv-conf", ELASTIC_RDZV_CONF,
            *train_arguments(workdir, steps, checkpoint_every, ELASTIC_GLOBAL_BATCH)]


def run_elastic_job(workdir: Path, *, steps: int = 12, checkpoint_every: int = 3, lose_after_step: int | None = None,
                    timeout_s: float = 600) -> dict:
    """Agents A and B (one worker each) as one job; with lose_after_step, B and its worker are SIGKILLed
    once rank 0 has logged that step, and A carries on alone. A starts first and hosts the rendezvous
    store (the agent that is lost must not be the one holding it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    command = elastic_command(workdir, port, steps, checkpoint_every)
    logs = [open(workdir / name, "w") for name in ("agent-a.txt", "agent-b.txt")]
    survivor = subprocess.Popen(command, cwd=workdir, env=_environment(), stdout=logs[0], stderr=subprocess.STDOUT)
    lost = None
    deadline = time.monotonic() + timeout_s
    try:
        while not _listening(port) and survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        other = subprocess.Popen(command, cwd=workdir, env=_environment(), stdout=logs[1], stderr=subprocess.STDOUT)
        try:
            while survivor.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"elastic job in {workdir} ran past {timeout_s:.0f} s")
                if lose_after_step is not None and lost is None \
                        and last_logged_step(workdir / "metrics.jsonl") >= lose_after_step:
                    lost = last_logged_step(workdir / "metrics.jsonl")
                    _stop(other)
                time.sleep(0.05)
            if lose_after_step is None:
                other.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            _stop(other)
    finally:
        _stop(survivor)
        for log in logs:
            log.close()
    text = (workdir / "agent-a.txt").read_text()
    resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", text)
    return {"returncode": survivor.returncode, "lost_after_step": lost,
            "resumed_step": int(resumed[-1]) if resumed else None,
            "replanned": _trained_on_one_process(text), "log": text}


def _trained_on_one_process(log: str) -> bool:
    """Whether a round trained on one process, under a plan with dp=1 (no --strategy and no --plan
    are given, so that plan was searched for the world of one the round had)."""
    return re.search(r"^training \S+ .* on 1 process\(es\), \w+: dp=1 ", log, re.MULTILINE) is not None


def one_process_from(resume: str | Path, workdir: Path, steps: int, checkpoint_every: int) -> dict:
    """One process with the elastic job's flags and `--resume resume` (a checkpoint, "auto" or "none")."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, *train_arguments(workdir, steps, checkpoint_every, ELASTIC_GLOBAL_BATCH),
                           "--resume", str(resume)], cwd=workdir, env=_environment(), capture_output=True, text=True,
                          timeout=600)
    return {"returncode": done.returncode, "log": done.stdout + done.stderr}


def two_processes(workdir: Path, steps: int, checkpoint_every: int) -> dict:
    """An uninterrupted two-process run with the elastic job's flags (its plan is searched the same way)."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *train_arguments(workdir, steps, checkpoint_every, ELASTIC_GLOBAL_BATCH)],
                          cwd=workdir, env=_environment(), capture_output=True, text=True, timeout=600)
    return {"returncode": done.returncode, "log": done.stdout + done.stderr}


def elastic_verdict(workdir: Path, outcome: dict, steps: int, checkpoint_every: int,
                    uninterrupted: dict[int, float]) -> tuple[bool, str]:
    """(exact, one line): the elastic job against a one-process run from the checkpoint it resumed."""
    if outcome["returncode"] != 0:
        return False, "job failed"
    if outcome["lost_after_step"] is None:
        return False, "finished before the loss (not counted)"
    step = outcome["resumed_step"]
    checkpoint = workdir / "checkpoints" / f"step-{step:08d}" if step is not None else "none"
    reference_dir = workdir / "one-process-reference"
    reference = one_process_from(checkpoint, reference_dir, steps, checkpoint_every)
    if reference["returncode"] != 0:
        return False, "the one-process reference failed: " + reference["log"][-500:]
    expected = final_state(reference_dir / "checkpoints", steps)
    if not any(key.startswith("model.") for key in expected) or not any(key.startswith("optim.") for key in expected):
        return False, f"the reference checkpoint holds no weights or optimizer state ({len(expected)} entries)"
    diff = differences(expected, final_state(workdir / "checkpoints", steps))
    elastic, alone = losses(workdir / "metrics.jsonl"), losses(reference_dir / "metrics.jsonl")
    after = range((step or 0) + 1, steps + 1)
    same_losses = all(elastic.get(s) == alone.get(s) for s in after)
    drift = max((abs(elastic[s] - uninterrupted[s]) / abs(uninterrupted[s]) for s in after
                 if s in elastic and s in uninterrupted), default=float("nan"))
    exact = not diff and same_losses and outcome["replanned"]
    verdict = ("exact" if exact else f"differs ({len(diff)} tensors, losses equal: {same_losses}, "
               f"re-planned: {outcome['replanned']})")
    return exact, f"{verdict}; losses after the restart vs uninterrupted 2 processes: max relative {drift:.1e}"


def differences(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """Keys whose values are not bitwise equal (tensors) or not equal (anything else)."""
    import torch

    found = []
    for key in sorted(set(expected) | set(actual)):
        name = f"{prefix}{key}"
        if key not in expected or key not in actual:
            found.append(f"{name}: only in {'actual' if key in actual else 'expected'}")
            continue
        a, b = expected[key], actual[key]
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, name + ".")
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                found.append(name)
        elif a != b:
            found.append(name)
    return found


def crash_trials(root: Path, args, chooser: random.Random) -> int:
    """The crash trials; returns how many ended exactly where the uninterrupted run ends."""
    started = time.perf_counter()
    reference = run_job(root / "reference", nproc=args.nproc, steps=args.steps, checkpoint_every=args.checkpoint_every)
    if reference["returncode"] != 0:
        print(reference["log"][-3000:])
        print("the uninterrupted reference run failed")
        return 0
    expected = final_state(root / "reference" / "checkpoints", args.steps)
    print(f"reference: {args.steps} steps on {args.nproc} processes in {time.perf_counter() - started:.1f} s")
    recovered = 0
    for trial in range(args.trials):
        kill_step = chooser.randint(1, args.steps - 1)
        rank = chooser.randrange(args.nproc)
        started = time.perf_counter()
        outcome = run_job(root / f"trial-{trial:02d}", nproc=args.nproc, steps=args.steps,
                          checkpoint_every=args.checkpoint_every, kill_after_step=kill_step, kill_rank=rank)
        verdict = "job failed"
        if outcome["returncode"] == 0 and outcome["killed_after_step"] is None:
            verdict = "finished before the kill (not counted)"
        elif outcome["returncode"] == 0:
            diff = differences(expected, final_state(root / f"trial-{trial:02d}" / "checkpoints", args.steps))
            verdict = "exact" if not diff else f"differs in {len(diff)} tensors (e.g. {diff[0]})"
            recovered += not diff
        print(f"trial {trial:2d}: SIGKILL rank {rank} after step {outcome['killed_after_step']} "
              f"(drawn {kill_step}); resumed from a checkpoint: {outcome['resumed']}; {verdict} "
              f"[{time.perf_counter() - started:.1f} s]", flush=True)
        if verdict == "job failed":
            print(outcome["log"][-2000:])
    return recovered


def elastic_trials(root: Path, args, chooser: random.Random) -> int:
    """The elastic trials; returns how many resumed exactly (see the module docstring)."""
    started = time.perf_counter()
    uninterrupted = two_processes(root / "elastic-reference", args.steps, args.checkpoint_every)
    if uninterrupted["returncode"] != 0:
        print(uninterrupted["log"][-3000:])
        print("the uninterrupted two-process reference run failed")
        return 0
    print(f"elastic reference: {args.steps} steps on 2 processes in {time.perf_counter() - started:.1f} s")
    reference_losses = losses(root / "elastic-reference" / "metrics.jsonl")
    exact_count = 0
    for trial in range(args.elastic_trials):
        lose_step = chooser.randint(1, args.steps - 1)
        workdir = root / f"elastic-{trial:02d}"
        started = time.perf_counter()
        outcome = run_elastic_job(workdir, steps=args.steps, checkpoint_every=args.checkpoint_every,
                                  lose_after_step=lose_step)
        exact, verdict = elastic_verdict(workdir, outcome, args.steps, args.checkpoint_every, reference_losses)
        exact_count += exact
        step = outcome["resumed_step"]
        start = f"from the step-{step} checkpoint" if step is not None else "from scratch (no checkpoint published yet)"
        print(f"elastic {trial:2d}: agent B lost after step {outcome['lost_after_step']} (drawn {lose_step}); "
              f"continued on 1 process {start}; {verdict} "
              f"[{time.perf_counter() - started:.1f} s]", flush=True)
        if verdict == "job failed":
            print(outcome["log"][-2000:])
    return exact_count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="crash trials")
    parser.add_argument("--elastic-trials", type=int, default=5, help="elastic trials (two agents, one lost)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn kill steps and ranks")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    import torch

    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    chooser = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.workdir or scratch)
        started = time.perf_counter()
        recovered = crash_trials(root, args, chooser) if args.trials else 0
        print(f"recovered exactly: {recovered}/{args.trials}", flush=True)
        resumed = elastic_trials(root, args, chooser) if args.elastic_trials else 0
        print(f"elastic: resumed exactly: {resumed}/{args.elastic_trials}")
        print(f"total {time.perf_counter() - started:.0f} s")
        return 0 if recovered == args.trials and resumed == args.elastic_trials else 1


if __name__ == "__main__":
    sys.exit(main())

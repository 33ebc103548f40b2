"""Crash recovery under torchrun: SIGKILL a rank at a random step and check the job ends where an
uninterrupted one does.

Each trial launches `torchrun --max-restarts 1 -m autopar run` with checkpoints every K steps, waits
until rank 0's metrics reach a randomly drawn step, SIGKILLs one worker (a random rank), and lets
torchrun restart the job, which resumes from its last checkpoint (`--resume auto`). The final
checkpoint's weights and optimizer state must equal, bit for bit, those of a run that was never
interrupted (fp32 on CPU is deterministic for a fixed plan).

    python benchmarks/fault_injection.py                  # 20 trials, 2 processes
    python benchmarks/fault_injection.py --trials 3 --steps 8

Prints one line per trial and "recovered exactly: N/T"; exits 1 unless all trials recovered.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIG = "layers=2,hidden=32,heads=2,vocab=257,seq_len=32"


def job_command(workdir: Path, nproc: int, steps: int, checkpoint_every: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            "-m", "autopar", "run", "--model", "gpt", "--model-config", MODEL_CONFIG, "--cluster", "local",
            "--strategy", f"dp={nproc}", "--global-batch", str(4 * nproc), "--steps", str(steps),
            "--precision", "fp32", "--lr", "3e-3", "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-every", str(checkpoint_every), "--log-every", "1",
            "--metrics", str(workdir / "metrics.jsonl"), "--no-progress"]


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


def final_state(checkpoints: Path, steps: int) -> dict:
    """Everything the final checkpoint holds (weights, optimizer state), as plain tensors, read with
    the allow-list reader `autopar run` loads with (nothing in the files is executed)."""
    from autopar.runtime.checkpoint_reader import read_checkpoint_state

    return read_checkpoint_state(checkpoints / f"step-{steps:08d}")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn kill steps and ranks")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    chooser = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.workdir or scratch)
        started = time.perf_counter()
        reference = run_job(root / "reference", nproc=args.nproc, steps=args.steps,
                            checkpoint_every=args.checkpoint_every)
        if reference["returncode"] != 0:
            print(reference["log"][-3000:])
            print("the uninterrupted reference run failed")
            return 1
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
        print(f"recovered exactly: {recovered}/{args.trials}")
        return 0 if recovered == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark scripts must at least run: their CPU paths on a tiny model (no figures checked)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_validate_gpu_runs_on_cpu():
    result = subprocess.run(
        [sys.executable, "benchmarks/validate_gpu.py", "--device", "cpu", "--precision", "fp32", "--configs", "gpt:2",
         "--model-config", "layers=1,hidden=32,heads=2,vocab=64,seq_len=16", "--steps", "3"],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("gpt ")]
    assert len(rows) == 2  # recompute off and on

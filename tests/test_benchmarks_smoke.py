"""GPU benchmark scripts must at least run: their CPU paths on a tiny model (no figures checked)."""

import json
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


def test_runtime_mfu_runs_on_cpu(tmp_path):
    import json  # imports here: this file is appended to, not rewritten

    import pytest

    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/runtime_mfu.py", "--device", "cpu", "--precision", "fp32", "--no-compile",
         "--model", "gpt", "--model-config", "layers=1,hidden=32,heads=2,vocab=64,seq_len=16", "--seq-len", "16",
         "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--matmul-size", "128", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.startswith(("eager ", "autopar "))]
    assert rows == ["eager", "autopar"]  # --no-compile: the two uncompiled variants, in order
    record = json.loads(out.read_text())
    assert [row["variant"] for row in record["rows"]] == ["eager", "autopar"]
    for row in record["rows"]:
        assert row["status"] == "ok" and row["tokens_per_s"] == pytest.approx(2 * 16 / row["step_s"])
        assert row["mfu"] == pytest.approx(6 * record["num_params"] * row["tokens_per_s"] / record["peak_flops_per_s"])
        assert row["mfu_vs_matmul"] > 0 and row["peak_memory_bytes"] == 0  # CPU: no CUDA memory figure
    eager, runtime = record["rows"]
    assert runtime["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)  # same weights, same tokens
    assert record["ratios"]["c_over_b"] is None  # nothing compiled to compare
    assert record["ratios"]["autopar_over_eager"] > 0
    assert record["plan"].startswith("dp=1 tp=1 pp=1") and record["matmul_ceiling_flops_per_s"] > 0


def test_zoo_coverage_runs_one_cell(tmp_path):
    """The coverage benchmark plans and runs one model in one mode and reports it (a CNN under dp)."""
    import json

    out = tmp_path / "zoo.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/zoo_coverage.py", "--only", "plain-cnn", "--modes", "dp", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "summary: 1 models; dp: 1 ok; crashes 0" in result.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "plain-cnn" and row["cells"]["dp"] == {"status": "ok", "reason": ""}


def test_gpu_suite_runs_on_cpu(tmp_path):
    """benchmarks/gpu_suite.py's CPU smoke run: every phase writes its rows and the goals get verdicts
    (the figures mean nothing on a CPU; the GPU run is the device check)."""
    out = tmp_path / "suite.json"
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())
    assert [row["case"] for row in record["plans"]] == ["smoke-mb4", "smoke-searched"]
    assert all(row["status"] == "ok" and row["predicted"]["step_time_s"] > 0 for row in record["plans"])
    assert record["plans"][0]["optimizations"]["vocab padding"] == "257 -> 384 rows (padded logits masked)"
    assert record["baselines_allocator"] == "not applied (not a CUDA device)"
    assert [row["variant"] for row in record["baselines"]] == ["plain eager", "reference eager"]
    assert record["op_profile"]["status"] == "ok" and (tmp_path / "gpu_suite_profile.db").exists()
    assert {row["goal"] for row in record["verdicts"]} >= {"no out-of-memory on a plan the searcher accepts"}
    assert "device cpu, torch" in result.stdout and "no out-of-memory on a plan the searcher accepts" in result.stdout


def test_compiled_memory_runs_on_cpu():
    """benchmarks/compiled_memory.py: one tiny GPT block through AOT autograd with both partitioners;
    inductor's min-cut never keeps more for backward than the default partition."""
    import re

    result = subprocess.run([sys.executable, "benchmarks/compiled_memory.py", "--model", "gpt", "--batch", "2",
                             "--seq-len", "64"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    kept = [float(x) for x in re.findall(r"partition[^:]*:\s+([0-9.]+) GiB", result.stdout)]
    assert len(kept) == 2 and 0 < kept[1] <= kept[0], result.stdout

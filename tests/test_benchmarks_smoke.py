"""GPU benchmark scripts must at least run: their CPU paths on a tiny model (no figures checked)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    # MFU in both accountings: 6N, and 6N + 12 l h s (2 layers, hidden 64, sequence 64), the same step time
    from autopar.models import build_model

    params = sum(p.numel() for p in build_model("gpt", "layers=2,hidden=64,heads=4,vocab=257,seq_len=64,"
                                                       "vocab_multiple=1").module.parameters())
    for row in record["plans"] + record["baselines"]:
        assert row["mfu_with_attention"] == pytest.approx(row["mfu"] * (6 * params + 12 * 2 * 64 * 64) / (6 * params))
    for row in record["plans"]:  # 3 queued steps back to back after the synchronized ones, losses read
        assert row["step_time_s_back_to_back"] > 0 and len(row["losses"]) == 2 + 5 + 3  # warm-up, timed, queued
        assert row["warmup_s"] > 0
        assert row["mfu_back_to_back"] == pytest.approx(row["mfu"] * row["step_time_s_mean"]
                                                        / row["step_time_s_back_to_back"])
    assert record["plans"][0]["optimizations"]["vocab padding"] == "257 -> 384 rows (padded logits masked)"
    assert record["baselines_allocator"] == "not applied (not a CUDA device)"
    assert [row["variant"] for row in record["baselines"]] == ["plain eager", "reference eager"]
    assert record["op_profile"]["status"] == "ok" and (tmp_path / "gpu_suite_profile.db").exists()
    assert {row["goal"] for row in record["verdicts"]} >= {"no out-of-memory on a plan the searcher accepts"}
    assert "device cpu, torch" in result.stdout and "no out-of-memory on a plan the searcher accepts" in result.stdout


def test_compiled_memory_runs_on_cpu():
    """benchmarks/compiled_memory.py: a tiny GPT with its loss through AOT autograd with both
    partitioners; inductor's min-cut never keeps more of a layer for backward than the default partition."""
    import re

    result = subprocess.run([sys.executable, "benchmarks/compiled_memory.py", "--model", "gpt", "--model-config",
                             "hidden=256,heads=4,vocab=512", "--batch", "2", "--seq-len", "64"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    kept = [float(x) for x in re.findall(r"partition: a layer [0-9.]+ GiB \(([0-9.]+) of the traced", result.stdout)]
    assert len(kept) == 2 and 0 < kept[1] <= kept[0], result.stdout


def test_gpu_diagnose_runs_on_cpu(tmp_path):
    """benchmarks/gpu_diagnose.py's CPU smoke run: the step's phases are timed, and autograd's
    gradient accumulation is found once per parameter and micro-batch (2 micro-batches)."""
    from autopar.models import build_model

    out = tmp_path / "diagnose.json"
    result = subprocess.run([sys.executable, "benchmarks/gpu_diagnose.py", "--device", "cpu", "--smoke", "--out",
                             str(out), "--cudnn-attention", "smoke-mb2x2"], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    row, again = json.loads(out.read_text())["rows"]
    assert again["case"] == "smoke-mb2x2@cudnn-attention" and again["status"] == "ok"  # math attention on a CPU
    assert row["status"] == "ok" and row["case"] == "smoke-mb2x2", row
    assert set(row["phases_s"]) == {"forward_backward", "sync_gradients", "clip", "optimizer", "zero_grad_and_loss"}
    assert all(seconds > 0 for seconds in row["phases_s"].values())
    assert set(row["clock"]) & {"unavailable", "samples"}  # the clock over the timed steps, or why not
    parameters = len(list(build_model("gpt", "layers=2,hidden=64,heads=4,vocab=257,seq_len=64").module.parameters()))
    assert row["accumulate_grad"]["count"] == 2 * parameters
    assert row["kernels"] == 0 and row["busy_s"] == 0  # no device kernels on a CPU
    assert "Optimizer.step#AdamW.step" in row["labelled"]


def test_gpu_diagnose_busy_time_and_kernel_kinds():
    """The device's busy time is the union of kernel intervals (overlaps counted once); kernels are
    sorted into kinds by name as torch.profiler reports them on an H100."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_diagnose

    assert gpu_diagnose.busy_s([(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (6.0, 7.0)]) == 25e-6
    assert gpu_diagnose.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert gpu_diagnose.kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert gpu_diagnose.kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert gpu_diagnose.kind_of("triton_per_fused_add_native_layer_norm_0") == "triton"
    assert gpu_diagnose.kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert gpu_diagnose.kind_of("void at::native::(anonymous namespace)::fused_adam_kernel") == "optimizer"
    assert gpu_diagnose.kind_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == \
        "elementwise/other"


def test_gpu_suite_runs_a_what_if_row_with_the_padding_patched_out(one_process_group):
    """gpu_suite's `gemm_padding=false` row: the runtime refuses that plan, so the suite runs it with the
    padding patched out (and puts it back after); the losses equal the padded row's, as padding leaves
    them unchanged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite
    import gpu_suite_plans

    import autopar.capabilities as capabilities

    config = "layers=1,hidden=64,heads=4,vocab=1025,seq_len=32,vocab_multiple=1"
    fixed = "dp=1,tp=1,pp=1,zero=0,recompute=none,microbatch=2"
    padded = ("padded", "gpt", config, 32, 2, "bf16", fixed, False)
    unpadded = ("unpadded", "gpt", config, 32, 2, "bf16", fixed + ",gemm_padding=false", False)
    made = gpu_suite_plans.make_plans([padded, unpadded], lambda line: None)
    knobs = capabilities._RUNTIME_KNOBS
    runs = [gpu_suite.run_plan(case, made[case[0]], "cpu", 2) for case in (unpadded, padded)]
    assert capabilities._RUNTIME_KNOBS == knobs  # restored
    assert [run["status"] for run in runs] == ["ok", "ok"], runs
    assert runs[0]["optimizations"]["GEMM padding"] == "off (patched out by the benchmark)"
    assert runs[1]["optimizations"]["GEMM padding"].startswith("head 1,025 -> 1,152")
    assert runs[0]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-6)


def test_gpu_suite_plans_its_chosen_row_as_autopar_run_does_on_a_gpu():
    """gpu_suite's `g13-chosen` row is searched eager and compiled, and keeps the faster predicted (the plan
    `autopar run` trains on a GPU): its prediction is the lesser of the two fixed ways'."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite_plans

    config = "layers=2,hidden=256,heads=4,vocab=512,seq_len=128"
    cases = [("eager", "gpt", config, 128, 8, "bf16", None, False),
             ("compiled", "gpt", config, 128, 8, "bf16", "compile=true", False),
             ("chosen", "gpt", config, 128, 8, "bf16", None, gpu_suite_plans.CHOOSE)]
    made = gpu_suite_plans.make_plans(cases, lambda line: None)
    times = {case: made[case]["predicted"]["step_time_s"] for case in made}
    assert times["chosen"] == min(times["eager"], times["compiled"]) and times["eager"] != times["compiled"]
    assert made["chosen"]["strategy"]["compile"] == (times["compiled"] < times["eager"])


def test_gpu_suite_judges_the_chosen_plan_on_its_own_row_and_ranks_eager_plans_apart():
    """The chosen-plan goal reads `g13-chosen` (what `autopar run` trains on a GPU): a failed chosen row is
    not measured, never judged on the eager search's row; files from before it are judged on `g13-searched`.
    The predicted-fastest goal ranks eager plans only: a compiled plan, whatever its name, is left out."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite_goals

    def row(case, predicted, measured, compiled=False, status="ok"):
        return {"case": case, "status": status, "global_batch": 8, "strategy": {"compile": compiled},
                "predicted": {"step_time_s": predicted, "peak_memory_bytes": 1.0},
                "step_time_s_mean": measured, "max_memory_reserved_bytes": 2.0}

    def verdict(plans, name):
        goals = gpu_suite_goals.verdicts({"plans": plans, "baselines": []})
        return next(g for g in goals if g["goal"].startswith(name))

    eager = [row("g13-searched", 0.30, 0.30), row("g13-mb4x2-none", 0.33, 0.29)]
    assert verdict(eager + [row("g13-chosen", 0.28, 0.27, compiled=True)],
                   "step time within 5% on the chosen plan")["goal"].endswith("(g13-chosen)")
    failed = verdict(eager + [row("g13-chosen", 0.28, 0.0, compiled=True, status="out of memory")],
                     "step time within 5% on the chosen plan")
    assert failed["verdict"] == "not measured" and failed["why"] == "out of memory"
    assert verdict(eager, "step time within 5% on the chosen plan")["goal"].endswith("(g13-searched)")
    ranked = verdict(eager + [row("g13-chosen", 0.20, 0.20, compiled=True)], "predicted-fastest")
    assert ranked["value"] == "g13-searched / g13-mb4x2-none" and ranked["verdict"] == "missed"

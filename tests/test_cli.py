"""The CLI: real runs of `autopar inspect`, and one clear line for each bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.graph import OpGraph

SMALL = ["--model", "gpt", "--model-config", "layers=2,hidden=64,heads=4,vocab=100,seq_len=32"]


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_table(capsys):
    code, out, err = run(capsys, "inspect", *SMALL, "--batch", "2")
    assert code == 0
    assert "GPTBlock × 2" in out and "forward FLOPs" in out and "tied" in out
    assert "tracing gpt" in err


def test_inspect_json_to_stdout_and_graph_file(capsys, tmp_path):
    graph_path = tmp_path / "graph.json"
    code, out, _ = run(capsys, "inspect", *SMALL, "--json", "-", "--graph", str(graph_path), "--precision", "fp32")
    assert code == 0
    summary = json.loads(out)
    assert summary["layer_types"][0]["count"] == 2
    assert summary["tokens_per_step"] == 32
    assert summary["memory_bytes"]["optimizer_states"] == 8 * summary["parameters"]
    graph = OpGraph.from_json(graph_path.read_text())
    assert graph.forward_flops == summary["forward_flops"]


def test_inspect_json_file(capsys, tmp_path):
    target = tmp_path / "summary.json"
    code, out, _ = run(capsys, "inspect", *SMALL, "--json", str(target))
    assert code == 0 and "layer types" in out
    assert json.loads(target.read_text())["model"] == "gpt"


def _assert_one_line_error(code, out, err, *words):
    assert code == 2
    progress = ("tracing ", "searching ", "roofline calibrated")
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(progress)]
    assert len(lines) == 1, err
    assert lines[0].startswith("autopar: error: ")
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["inspect", "--model", "gpt-9000"], ["unknown model 'gpt-9000'"]),
        (["inspect", "--model", "no_such_pkg.models:build"], ["cannot import 'no_such_pkg.models'"]),
        (["inspect", "--model", "gpt2-124m", "--seq-len", "4096"], ["exceeds", "seq_len=4096"]),
        (["inspect", "--model", "gpt", "--model-config", "hidden=100,heads=3"], ["divisible by heads"]),
        (["inspect", "--model", "gpt", "--batch", "0"], ["--batch", "must be at least 1"]),
        (["inspect"], ["--model"]),
        (["frobnicate"], ["invalid choice"]),
        (["inspect", *SMALL, "--gpus", "8"], ["give --cluster too"]),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    _assert_one_line_error(*run(capsys, *argv), *words)


def test_untraceable_model_is_one_line(capsys, tmp_path, monkeypatch):
    module = tmp_path / "branchy.py"
    module.write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.inner = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.inner(x)\n"
        "    def example_inputs(self, batch, seq, device='meta'):\n"
        "        return (torch.empty(batch, 8, device=device),)\n"
        "class Inner(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        y = super().forward(x)\n"
        "        return y * 2 if y.sum() > 0 else y\n"
        "def build():\n"
        "    model = Branchy(); model.inner = Inner(8, 8); return model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "inspect", "--model", "branchy:build")
    _assert_one_line_error(code, out, err, "cannot trace", "in module 'inner'", "depend on tensor values")


def test_failed_run_writes_nothing(capsys, tmp_path):
    target = tmp_path / "summary.json"
    code, _, _ = run(capsys, "inspect", "--model", "gpt-9000", "--json", str(target))
    assert code == 2 and not target.exists()
    code, _, err = run(capsys, "inspect", *SMALL, "--json", str(tmp_path / "missing-dir" / "out.json"))
    _assert_one_line_error(code, "", err, "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(Exception, match="unknown model"):
        main(["--debug", "inspect", "--model", "gpt-9000"])


def test_python_dash_m_is_the_same_cli():
    result = subprocess.run(
        [sys.executable, "-m", "autopar", "inspect", "--model", "gpt-9000"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("autopar: error: unknown model")
    assert "Traceback" not in result.stderr


def _plan_for(fingerprint, path, schema_version=None):
    from autopar.plan_schema import MeshAxis, Plan, Provenance, StagePlan, Strategy, save_plan

    plan = Plan(
        mesh=[MeshAxis(name="dp", size=2)],
        strategy=Strategy(dp=2, tp=1, pp=1, microbatch=1, num_microbatches=1),
        stages=[StagePlan(index=0, module_paths=["embed", "layers.0", "layers.1", "head"], device_ids=[0, 1],
                          mesh_shape={"dp": 2})],
        provenance=Provenance(model_name="gpt", model_fingerprint=fingerprint, cluster_name="dgx-h100", world_size=2),
    )
    save_plan(plan, path)
    if schema_version is not None:
        data = json.loads(Path(path).read_text())
        data["schema_version"] = schema_version
        Path(path).write_text(json.dumps(data))
    return path


def test_cluster_fit_and_plan_check(capsys, tmp_path):
    code, out, _ = run(capsys, "inspect", *SMALL, "--json", "-")
    fingerprint = json.loads(out)["model_fingerprint"]
    plan_path = _plan_for(fingerprint, tmp_path / "plan.json")
    code, out, _ = run(capsys, "inspect", *SMALL, "--cluster", "dgx-h100", "--gpus", "16",
                       "--check-plan", str(plan_path), "--json", "-")
    assert code == 0
    summary = json.loads(out)
    assert summary["cluster_fit"]["world_size"] == 16
    assert summary["cluster_fit"]["min_gpus_for_model_states"] == 1
    assert summary["plan_check"]["ok"] is True


def test_gpt3_175b_needs_many_a100s_for_its_model_states(capsys):
    code, out, _ = run(capsys, "inspect", "--model", "gpt3-175b", "--seq-len", "128",
                       "--cluster", "dgx-a100-80gb", "--gpus", "64", "--json", "-")
    assert code == 0
    fit = json.loads(out)["cluster_fit"]
    # 16 bytes/parameter (bf16 weight and gradient, fp32 master and Adam moments) over 80 GiB GPUs.
    assert fit["min_gpus_for_model_states"] == -(-16 * 174_604_259_328 // (80 * 2**30))


@pytest.mark.parametrize(
    "content, words",
    [
        ("gpu: [unclosed\n", ["not valid YAML", "line 2"]),
        ("preset: dgx-h100\ngpu: B300-imaginary\n", ["unknown GPU kind", "B300-imaginary"]),
        ("name: x\ngpus_per_node: 8\n", ["gpu"]),
    ],
)
def test_bad_cluster_file_is_one_line(capsys, tmp_path, content, words):
    path = tmp_path / "cluster.yaml"
    path.write_text(content)
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--cluster", str(path)), *words)


def test_bad_cluster_arguments(capsys, tmp_path):
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--cluster", "dgx-h9000"), "unknown", "dgx-h9000")
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--cluster", "dgx-h100", "--gpus", "12"), "12")
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--cluster", str(tmp_path / "nope.yaml")), "nope.yaml")


def test_plan_for_another_model_or_version_is_one_line(capsys, tmp_path):
    foreign = _plan_for("ffffffffffffffff", tmp_path / "foreign.json")
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--check-plan", str(foreign)), "fingerprint", "autopar plan")
    code, out, _ = run(capsys, "inspect", *SMALL, "--json", "-")
    old = _plan_for(json.loads(out)["model_fingerprint"], tmp_path / "old.json", schema_version=0)
    _assert_one_line_error(*run(capsys, "inspect", *SMALL, "--check-plan", str(old)), "schema version 0")


PLAN_SMALL = ["plan", *SMALL, "--seq-len", "32", "--global-batch", "16", "--cluster", "dgx-h100", "--gpus", "8"]


def test_plan_json_contract(capsys):
    code, out, _ = run(capsys, *PLAN_SMALL, "--strategy", "tp=2,pp=2,dp=2,microbatch=1,zero=1,recompute=full,"
                       "schedule=1f1b,vp=1,sp=false", "--json", "-")
    assert code == 0
    result = json.loads(out)
    assert result["strategy"] == {"dp": 2, "tp": 2, "pp": 2, "sp": False, "zero": 1, "recompute": "full",
                                  "recompute_layers": None, "microbatch": 1, "num_microbatches": 8, "schedule": "1f1b", "vp": 1,
                                  # the implementation profile (issue #18): the autopar runtime's by default
                                  "attention": "fused", "dropout": 0.0, "dp_overlap": True, "tp_overlap": False,
                                  "optimizer_state": "fp32", "zero3_fetch": "unit", "offload": "none", "ep": 1, "cp": 1,
                                  "cp_kind": "ring", "optimizer_impl": "fused", "compile": False,
                                  "gemm_padding": True, "weight_passes": True, "sp_inputs": "gathered"}
    assert result["fits"] is True
    predicted = result["predicted"]
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes"):
        assert predicted[key] > 0
    assert set(predicted["breakdown"]) == {"compute", "exposed_communication", "bubble", "recompute", "optimizer",
                                           "offload_transfer", "cpu_optimizer", "expert_all_to_all", "context_exchange"}
    assert predicted["breakdown"]["expert_all_to_all"] == 0  # ep=1
    assert predicted["breakdown"]["offload_transfer"] == predicted["breakdown"]["cpu_optimizer"] == 0  # offload=none
    assert predicted["tokens_per_s"] == pytest.approx(16 * 32 / predicted["step_time_s"])


def test_plan_fills_in_free_keys_and_prints_a_report(capsys):
    code, out, _ = run(capsys, *PLAN_SMALL, "--strategy", "tp=2")
    assert code == 0
    assert "tp=2" in out and "chosen by the cost model" in out and "runners-up" in out


def test_a_published_run_priced_as_it_ran_prints_its_report(capsys):
    """The implementation knobs of issue #18 in the text report, a fractional dropout included."""
    code, out, _ = run(capsys, *PLAN_SMALL, "--strategy", "dp=8,zero=3,attention=math,dropout=0.1,dp_overlap=false")
    assert code == 0
    assert "fixed: dp, zero, attention, dropout, dp_overlap;" in out
    assert "runs attention=fused" in out  # priced as other software ran it: the runtime would not run it so


def test_plan_that_cannot_fit_exits_3(capsys):
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--seq-len", "256", "--global-batch", "8",
                         "--cluster", "dgx-h100", "--gpus", "8", "--strategy", "dp=8,tp=1,pp=1,zero=0")
    assert code == 3
    assert "DOES NOT FIT" in out and "no plan fits" in err
    # 16 bytes of model state per parameter over 74.1 GiB a plan may use (78 usable less the planner's
    # 5% headroom, issue #18): 175B needs at least 36 such GPUs.
    assert "no plan fits in 74.1 GiB" in err and "add GPUs (≥ 36 for the model states alone)" in err
    assert "a zero stage above 0" in err and "(fixed: dp=8, tp=1, pp=1, zero=0)" in err


@pytest.mark.parametrize(
    "strategy, words",
    [
        ("tp=3", ["does not divide the world size 8"]),
        ("dp=2,tp=2,pp=1,cp=1", ["dp×cp×tp×pp", "world size"]),
        ("cp=3", ["cp=3 = 3 does not divide the world size 8"]),
        ("tp=8,pp=1,dp=1", ["does not divide the 4 attention heads"]),
        ("pp=8,dp=1,tp=1", ["stages for 2 layers"]),
    ],
)
def test_plan_rejects_invalid_strategies_with_the_rule(capsys, strategy, words):
    _assert_one_line_error(*run(capsys, *PLAN_SMALL, "--strategy", strategy), *words)


def test_plan_calibrated_from_a_cpu_profile(capsys, tmp_path):
    db = str(tmp_path / "profiles.db")
    model = ["--model", "gpt", "--model-config", "layers=1,hidden=64,heads=4,vocab=100,seq_len=32", "--seq-len", "32",
             "--precision", "fp32"]
    assert main(["profile", *model, "--device", "cpu", "--db", db, "--tp", "1", "--microbatches", "1",
                 "--repeats", "2", "--warmup", "1"]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, "plan", *model, "--global-batch", "2", "--cluster", "local", "--profile", db,
                         "--json", "-")
    assert code == 0 and json.loads(out)["predicted"]["step_time_s"] > 0
    assert "roofline calibrated on cpu" in err and "matmul from" in err
    _assert_one_line_error(*run(capsys, "plan", *model, "--global-batch", "2", "--cluster", "dgx-h100",
                                "--profile", db), "pass --profile-device")


def test_an_fp16_plan_is_priced_and_runs(capsys, tmp_path):
    """fp16 plans are priced and, with a loss scale, run (`runtime.loss_scaling`): no refusal note."""
    code = main(["plan", "--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=96,seq_len=16",
                 "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "4", "--precision", "fp16",
                 "--no-ilp", "--no-probe-cache", "--save-plan", str(tmp_path / "plan.json")])
    out, err = capsys.readouterr()
    assert code == 0 and (tmp_path / "plan.json").exists() and "step" in out
    assert "refused" not in err

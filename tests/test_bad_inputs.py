"""Bad inputs, as a new user types them (issue #19): every case must exit non-zero (2; 3 when no plan
fits), print exactly one `autopar:` line naming the problem, show no traceback, and write nothing;
a snapshot of the working directory (every output path lives in it) taken before and after shows
that nothing changed. Cases run in this process (`autopar.cli.main`) except the torchrun ones.

Each case is (id, argv, words the line must hold[, exit code]). In argv, `{w}` is the working
directory, `{src}` the directory of the user's factory modules (on sys.path, outside the snapshot),
`{plan}` a valid world-2 pipeline plan of TINY and `{plan:NAME}` a hand-edited copy of it
(see `HAND_EDITS`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar.cli import main

TINY_CONFIG = "layers=2,hidden=32,heads=4,vocab=257,seq_len=32"
TINY = ["--model", "gpt", "--model-config", TINY_CONFIG]
PLAN = ["plan", *TINY, "--cluster", "local", "--global-batch", "4"]
RUN = ["run", *TINY, "--cluster", "local", "--global-batch", "4", "--steps", "2", "--data", "synthetic"]
PROFILE = ["profile", *TINY, "--device", "cpu", "--db", "{w}/p.db", "--tp", "1", "--microbatches", "1"]
PROGRESS = ("tracing ", "searching ", "preparing ", "roofline calibrated")

# Factory modules a user might hand us (each case writes its own, under a name of its own).
FACTORIES = {
    "raises_at_import": "raise RuntimeError('no GPU driver found')\n",
    "syntax_error": "def build(:\n    pass\n",
    "missing_dependency": "import a_package_nobody_installed\n\ndef build():\n    pass\n",
    "raises_while_building": "def build(**kwargs):\n    raise ValueError('width must be a power of two')\n",
    "bad_example_inputs": (
        "import torch\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layer = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.layer(x)\n"
        "    def example_inputs(self, batch, seq_len, device='meta'):\n"
        "        raise KeyError('input_ids')\n"
        "def build():\n"
        "    return Model()\n"),
}

# Hand edits of the valid plan (two pipeline ranks on devices 0 and 1: stage 0 holds embed, pos_embed
# and layers.0; stage 1 layers.1, final_norm and head).
HAND_EDITS = {
    "same_device": lambda plan: plan["stages"][1].update(device_ids=[0]),
    "module_twice": lambda plan: plan["stages"][1]["module_paths"].append("layers.0"),
    "inside_other_stage": lambda plan: plan["stages"][1]["module_paths"].append("layers.0.attn"),
    "unknown_module": lambda plan: plan["stages"][1]["module_paths"].append("layers.7"),
    "no_stage_for_head": lambda plan: plan["stages"][1]["module_paths"].remove("head"),
    "split_layer": lambda plan: plan["stages"][0].update(
        module_paths=[p for p in plan["stages"][0]["module_paths"] if p != "layers.0"] + ["layers.0.attn"]),
    "mesh_reordered": lambda plan: plan.update(mesh=plan["mesh"][::-1]),
    "too_few_microbatches": lambda plan: plan["strategy"].update(num_microbatches=1),
    "stage_mesh_shape": lambda plan: plan["stages"][0].update(mesh_shape={"dp": 2, "tp": 1}),
}

CLUSTER_FILES = {
    "inf_bandwidth": "preset: dgx-h100\nintra_node: {bandwidth_bytes_per_s: .inf}\n",
    "nan_latency": "preset: dgx-h100\ninter_node: {latency_s: .nan}\n",
    "negative_bandwidth": "preset: dgx-h100\ninter_node: {bandwidth_bytes_per_s: -25.0e9}\n",
    "inf_peak": "preset: local\ngpu: {peak_tflops: {fp32: .inf}}\n",
    "bool_nodes": "preset: dgx-h100\nnum_nodes: true\n",
    "inf_storage": "preset: dgx-h100\nnode_storage_write_bytes_per_s: .inf\n",
    "python_tag": 'preset: !!python/object/apply:os.system ["touch executed"]\n',  # loading never runs code
    "one_mib_gpu": "preset: dgx-h100\ngpu: {memory_bytes: 1048576}\n",  # TINY's model states need 1.6 MB
}

CASES = [
    # --- inspect ---------------------------------------------------------------------------------------
    ("inspect-factory-raises-at-import", ["inspect", "--model", "raises_at_import:build", "--json", "{w}/s.json"],
     ["factory 'raises_at_import:build'", "RuntimeError: no GPU driver found", "--debug"]),
    ("inspect-factory-syntax-error", ["inspect", "--model", "syntax_error:build", "--graph", "{w}/g.json"],
     ["factory 'syntax_error:build'", "SyntaxError", "line 1"]),
    ("inspect-factory-missing-dependency", ["inspect", "--model", "missing_dependency:build"],
     ["factory 'missing_dependency:build'", "a_package_nobody_installed"]),
    ("inspect-factory-raises-while-building", ["inspect", "--model", "raises_while_building:build",
                                               "--json", "{w}/s.json"],
     ["while building the model", "ValueError: width must be a power of two"]),
    ("inspect-factory-example-inputs-raise", ["inspect", "--model", "bad_example_inputs:build", "--json", "{w}/s.json"],
     ["example_inputs", "KeyError"]),
    ("inspect-seq-len-negative", ["inspect", *TINY, "--seq-len", "-8", "--json", "{w}/s.json"],
     ["--seq-len", "at least 1", "-8"]),
    ("inspect-seq-len-zero", ["inspect", *TINY, "--seq-len", "0", "--graph", "{w}/g.json"], ["--seq-len", "at least 1"]),
    ("inspect-batch-zero", ["inspect", *TINY, "--batch", "0"], ["--batch", "at least 1"]),
    ("inspect-gpus-zero", ["inspect", *TINY, "--cluster", "dgx-h100", "--gpus", "0"], ["--gpus", "at least 1"]),
    ("inspect-cluster-inf-bandwidth", ["inspect", *TINY, "--cluster", "{w}/inf_bandwidth.yaml", "--json", "{w}/s.json"],
     ["intra_node.bandwidth_bytes_per_s", "finite", "fix the file"]),
    ("inspect-cluster-nan-latency", ["inspect", *TINY, "--cluster", "{w}/nan_latency.yaml"],
     ["inter_node.latency_s", "finite"]),
    ("inspect-cluster-negative-bandwidth", ["inspect", *TINY, "--cluster", "{w}/negative_bandwidth.yaml"],
     ["inter_node.bandwidth_bytes_per_s", "greater than 0"]),
    ("inspect-cluster-bool-nodes", ["inspect", *TINY, "--cluster", "{w}/bool_nodes.yaml"], ["num_nodes", "integer"]),
    ("inspect-cluster-python-tag", ["inspect", *TINY, "--cluster", "{w}/python_tag.yaml"],
     ["not valid YAML", "python/object"]),
    ("inspect-model-config-inf", ["inspect", "--model", "llama", "--model-config", "layers=2,rope_theta=inf"],
     ["rope_theta", "finite"]),
    ("inspect-model-config-twice", ["inspect", "--model", "gpt", "--model-config", "layers=2,layers=3"],
     ["sets layers twice"]),
    ("inspect-check-plan-same-device", ["inspect", *TINY, "--check-plan", "{plan:same_device}", "--json", "{w}/s.json"],
     ["device 0 runs stages of pipeline ranks 0 and 1"]),
    ("inspect-check-plan-module-twice", ["inspect", *TINY, "--check-plan", "{plan:module_twice}", "--graph",
                                        "{w}/g.json"], ["'layers.0' is listed in stage 0 and stage 1"]),
    ("inspect-check-plan-unknown-module", ["inspect", *TINY, "--check-plan", "{plan:unknown_module}"],
     ["'layers.7'", "the model lacks"]),
    ("inspect-outputs-same-file", ["inspect", *TINY, "--graph", "{w}/out.json", "--json", "{w}/out.json"],
     ["--graph and --json both name"]),
    ("inspect-output-dir-missing", ["inspect", *TINY, "--graph", "{w}/g.json", "--json", "{w}/missing/s.json"],
     ["--json", "does not exist"]),
    ("inspect-output-is-directory", ["inspect", *TINY, "--json", "{w}/dir", "--graph", "{w}/g.json"],
     ["is a directory"]),
    # --- plan ------------------------------------------------------------------------------------------
    ("plan-seq-len-zero", [*PLAN, "--seq-len", "0", "--save-plan", "{w}/p.json", "--json", "{w}/r.json"],
     ["--seq-len", "at least 1"]),
    ("plan-global-batch-zero", [*PLAN[:-1], "0", "--save-plan", "{w}/p.json"], ["--global-batch", "at least 1"]),
    ("plan-cluster-inf-peak", ["plan", *TINY, "--cluster", "{w}/inf_peak.yaml", "--global-batch", "4", "--save-plan",
                               "{w}/p.json"], ["gpu.peak_tflops.fp32", "finite"]),
    ("plan-cluster-inf-storage", ["plan", *TINY, "--cluster", "{w}/inf_storage.yaml", "--global-batch", "4",
                                  "--report", "{w}/r.html"], ["node_storage_write_bytes_per_s", "finite"]),
    ("plan-no-fit-writes-nothing", ["plan", *TINY, "--cluster", "{w}/one_mib_gpu.yaml", "--gpus", "2",
                                    "--global-batch", "4", "--save-plan", "{w}/p.json", "--json", "{w}/r.json",
                                    "--report", "{w}/r.html", "--trace", "{w}/t.json"],
     ["no plan fits", "add GPUs", "not written"], 3),
    ("plan-outputs-same-file", [*PLAN, "--save-plan", "{w}/p.json", "--trace", "{w}/p.json"],
     ["--save-plan and --trace both name"]),
    ("plan-one-output-dir-missing", [*PLAN, "--save-plan", "{w}/p.json", "--json", "{w}/r.json", "--trace",
                                     "{w}/missing/t.json"], ["--trace", "does not exist"]),
    ("plan-report-is-directory", [*PLAN, "--save-plan", "{w}/p.json", "--report", "{w}/dir"], ["is a directory"]),
    ("plan-tp-not-dividing-heads", ["plan", "--model", "gpt", "--model-config", "layers=2,hidden=48,heads=3,vocab=257,"
                                    "seq_len=32", "--cluster", "dgx-h100", "--gpus", "2", "--global-batch", "4",
                                    "--strategy", "tp=2", "--save-plan", "{w}/p.json"],
     ["tp=2 does not divide the 3 attention heads"]),
    ("plan-factory-raises-while-building", ["plan", "--model", "raises_while_building:build", "--cluster", "local",
                                            "--global-batch", "4", "--save-plan", "{w}/p.json"],
     ["factory 'raises_while_building:build'", "ValueError"]),
    ("plan-profile-db-missing", [*PLAN, "--profile", "{w}/none.db", "--save-plan", "{w}/p.json"],
     ["no profile database", "autopar profile"]),
    # --- run -------------------------------------------------------------------------------------------
    ("run-dry-run-same-device", ["run", *TINY, "--plan", "{plan:same_device}", "--steps", "2", "--dry-run"],
     ["device 0 runs stages of pipeline ranks 0 and 1"]),
    ("run-dry-run-module-twice", ["run", *TINY, "--plan", "{plan:module_twice}", "--steps", "2", "--dry-run"],
     ["'layers.0' is listed in stage 0 and stage 1"]),
    ("run-dry-run-inside-other-stage", ["run", *TINY, "--plan", "{plan:inside_other_stage}", "--steps", "2",
                                        "--dry-run"], ["'layers.0.attn' (stage 1) lies inside module 'layers.0'"]),
    ("run-dry-run-no-stage-for-head", ["run", *TINY, "--plan", "{plan:no_stage_for_head}", "--steps", "2", "--dry-run"],
     ["no stage runs parameter", "head"]),
    ("run-dry-run-mesh-reordered", ["run", *TINY, "--plan", "{plan:mesh_reordered}", "--steps", "2", "--dry-run"],
     ["pp, dp, cp and tp, in that order"]),
    ("run-dry-run-too-few-microbatches", ["run", *TINY, "--plan", "{plan:too_few_microbatches}", "--steps", "2",
                                          "--dry-run"], ["needs at least pp=2 micro-batches"]),
    ("run-dry-run-stage-mesh-shape", ["run", *TINY, "--plan", "{plan:stage_mesh_shape}", "--steps", "2", "--dry-run"],
     ["mesh_shape"]),
    ("run-split-layer", ["run", *TINY, "--plan", "{plan:split_layer}", "--steps", "2", "--data", "synthetic",
                         "--metrics", "{w}/m.jsonl"], ["without the rest of 'layers.0'", "whole layers"]),
    ("run-plan-for-two-processes", ["run", *TINY, "--plan", "{plan}", "--steps", "2", "--data", "synthetic",
                                    "--metrics", "{w}/m.jsonl", "--checkpoint-dir", "{w}/ck"],
     ["needs 2 processes", "torchrun"]),
    ("run-seq-len-zero", [*RUN, "--seq-len", "0", "--metrics", "{w}/m.jsonl"], ["--seq-len must be at least 1"]),
    ("run-seq-len-negative", [*RUN, "--seq-len", "-8", "--checkpoint-dir", "{w}/ck"], ["--seq-len must be at least 1"]),
    ("run-seed-negative", [*RUN, "--seed", "-1", "--metrics", "{w}/m.jsonl"], ["--seed must be 0 or more"]),
    ("run-config-seq-len-zero", ["run", "--config", "{w}/run.yaml", "--metrics", "{w}/m.jsonl"],
     ["--seq-len must be at least 1"]),
    ("run-config-python-tag", ["run", "--config", "{w}/python_tag.yaml", "--model", "gpt", "--steps", "2"],
     ["not valid YAML"]),
    ("run-cluster-inf-bandwidth", ["run", *TINY, "--cluster", "{w}/inf_bandwidth.yaml", "--global-batch", "4",
                                   "--steps", "2", "--data", "synthetic", "--metrics", "{w}/m.jsonl"], ["finite"]),
    ("run-metrics-and-tensorboard-same-path", [*RUN, "--metrics", "{w}/out", "--tensorboard", "{w}/out"],
     ["--metrics and --tensorboard both name"]),
    ("run-tensorboard-is-file", [*RUN, "--metrics", "{w}/m.jsonl", "--tensorboard", "{w}/file.txt"],
     ["--tensorboard", "is a file"]),
    ("run-profile-dir-is-file", [*RUN[:-4], "--steps", "3", "--data", "synthetic", "--profile-steps", "1",
                                 "--profile-dir", "{w}/file.txt", "--metrics", "{w}/m.jsonl"],
     ["--profile-dir", "is a file"]),
    ("run-metrics-dir-missing", [*RUN, "--metrics", "{w}/missing/m.jsonl", "--checkpoint-dir", "{w}/ck"],
     ["--metrics", "does not exist"]),
    ("run-checkpoint-dir-is-file", [*RUN, "--checkpoint-dir", "{w}/file.txt", "--metrics", "{w}/m.jsonl"],
     ["--checkpoint-dir", "is a file"]),
    ("run-factory-model", ["run", "--model", "raises_while_building:build", "--cluster", "local", "--global-batch",
                           "4", "--steps", "2", "--metrics", "{w}/m.jsonl"], ["ValueError: width must be a power"]),
    # --- data ------------------------------------------------------------------------------------------
    ("data-prepare-empty-text-field", ["data", "prepare", "--input", "{w}/text.txt", "--out", "{w}/ds",
                                       "--text-field", ""], ["--text-field is empty"]),
    ("data-prepare-eos-without-tokenizer", ["data", "prepare", "--input", "{w}/text.txt", "--out", "{w}/ds",
                                            "--eos-token", "<eos>"], ["--eos-token", "--tokenizer"]),
    ("data-prepare-shard-tokens-zero", ["data", "prepare", "--input", "{w}/text.txt", "--out", "{w}/ds",
                                        "--shard-tokens", "0"], ["--shard-tokens", "at least 1"]),
    ("data-prepare-input-missing", ["data", "prepare", "--input", "{w}/nothing.txt", "--out", "{w}/ds"],
     ["does not exist"]),
    ("data-prepare-out-is-file", ["data", "prepare", "--input", "{w}/text.txt", "--out", "{w}/file.txt"],
     ["is a file"]),
    ("data-prepare-bad-tokenizer", ["data", "prepare", "--input", "{w}/text.txt", "--out", "{w}/ds", "--tokenizer",
                                    "{w}/file.txt"], ["tokenizer"]),
    ("data-prepare-jsonl-without-field", ["data", "prepare", "--input", "{w}/records.jsonl", "--out", "{w}/ds"],
     ["no \"text\" field", "--text-field"]),
    ("data-info-not-a-dataset", ["data", "info", "{w}/dir"], ["not a prepared dataset"]),
    # --- profile ---------------------------------------------------------------------------------------
    ("profile-unknown-model", ["profile", "--model", "gpt-9000", "--device", "cpu", "--db", "{w}/p.db"],
     ["unknown model"]),
    ("profile-seq-len-negative", [*PROFILE, "--seq-len", "-3"], ["--seq-len", "at least 1"]),
    ("profile-seq-len-too-long", [*PROFILE, "--seq-len", "64"], ["exceeds", "seq_len=64"]),
    ("profile-repeats-zero", [*PROFILE, "--repeats", "0"], ["--repeats", "at least 1"]),
    ("profile-factory-raises-at-import", ["profile", "--model", "raises_at_import:build", "--device", "cpu", "--db",
                                          "{w}/p.db"], ["factory 'raises_at_import:build'"]),
    ("profile-db-not-ours", [*PROFILE[:-6], "--db", "{w}/file.txt", "--tp", "1"], ["not a readable profile database"]),
    ("profile-db-dir-missing", [*PROFILE[:-6], "--db", "{w}/missing/p.db"], ["does not exist"]),
    ("profile-collectives-unknown-op", ["profile", "--collectives", "--db", "{w}/p.db", "--collective-ops",
                                        "all_reduce,allreduce"], ["unknown collective", "'allreduce'"]),
    ("profile-collectives-bad-sizes", ["profile", "--collectives", "--db", "{w}/p.db", "--min-bytes", "1M",
                                       "--max-bytes", "1K"], ["--min-bytes", "--max-bytes"]),
]


PARAMS = [pytest.param(argv, words, rest[0] if rest else 2, id=case_id) for case_id, argv, words, *rest in CASES]


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its kind, size, modification time and content hash."""
    entries: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            entries[name] = ("link", os.readlink(path))
        elif path.is_dir():
            entries[name] = ("dir",)
        else:
            stat = path.stat()
            entries[name] = ("file", stat.st_size, stat.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return entries


@pytest.fixture(scope="module")
def valid_plan(tmp_path_factory) -> dict:
    """A plan of TINY for two pipeline ranks of one process each (stage i on device i)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code = main(["plan", *TINY, "--cluster", "dgx-h100", "--gpus", "2", "--global-batch", "4", "--precision", "fp32",
                 "--strategy", "pp=2,dp=1,tp=1,microbatch=1,schedule=1f1b,vp=1", "--no-ilp", "--save-plan", str(path)])
    assert code == 0
    plan = json.loads(path.read_text())
    assert [stage["device_ids"] for stage in plan["stages"]] == [[0], [1]]
    assert plan["stages"][1]["module_paths"][-1] == "head" and "layers.0" in plan["stages"][0]["module_paths"]
    return plan


@pytest.fixture
def workspace(tmp_path, monkeypatch, valid_plan):
    """The working directory of one case, its inputs in place; factory sources in a directory beside it."""
    work, src = tmp_path / "work", tmp_path / "src"
    work.mkdir()
    src.mkdir()
    (work / "dir").mkdir()
    (work / "file.txt").write_text("not what the flag wants\n")
    (work / "text.txt").write_text("hello world\n" * 50)
    (work / "records.jsonl").write_text('{"body": "hello"}\n')
    (work / "run.yaml").write_text(f"model: gpt\nmodel_config: {TINY_CONFIG}\ncluster: local\nglobal_batch: 4\n"
                                   f"steps: 2\ndata: synthetic\nseq_len: 0\n")
    for name, text in CLUSTER_FILES.items():
        (work / f"{name}.yaml").write_text(text)
    (work / "plan.json").write_text(json.dumps(valid_plan))
    for name, edit in HAND_EDITS.items():
        plan = json.loads(json.dumps(valid_plan))
        edit(plan)
        (work / f"plan-{name}.json").write_text(json.dumps(plan))
    for name, text in FACTORIES.items():
        (src / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for name in FACTORIES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(work)
    return work


def _expand(argv: list[str], work: Path) -> list[str]:
    def one(arg: str) -> str:
        arg = re.sub(r"\{plan:(\w+)\}", lambda m: str(work / f"plan-{m.group(1)}.json"), arg)
        return arg.replace("{plan}", str(work / "plan.json")).replace("{w}", str(work))

    return [one(arg) for arg in argv]


def _assert_handled(code: int, out: str, err: str, words, exit_code: int) -> None:
    """Exit code, exactly one `autopar:` line holding `words`, no traceback (progress lines aside)."""
    assert code == exit_code, (code, err[-2000:])
    said = [line for line in (out + "\n" + err).splitlines() if line.startswith("autopar:")]
    assert len(said) == 1, err[-2000:]
    others = [line for line in err.splitlines() if line.strip() and not line.startswith(("autopar:", *PROGRESS))]
    assert not others, others  # stderr holds the one line and progress, nothing else
    assert "Traceback" not in out + err
    for word in words:
        assert word in said[0], (word, said[0])


@pytest.mark.parametrize("argv, words, exit_code", PARAMS)
def test_bad_input_is_one_line_nonzero_exit_and_nothing_written(workspace, capsys, argv, words, exit_code):
    before = _snapshot(workspace)
    argv = _expand(argv, workspace)
    outputs = [Path(arg) for arg in argv if arg.startswith(str(workspace))]
    existed = {path: path.exists() for path in outputs}
    code = main(argv)
    captured = capsys.readouterr()
    _assert_handled(code, captured.out, captured.err, words, exit_code)
    assert {path: path.exists() for path in outputs} == existed  # no output path appeared (or vanished)
    assert _snapshot(workspace) == before  # and nothing under the working directory changed at all
    assert not dist.is_initialized()


def test_the_suite_covers_every_command():
    commands = {argv[0] for _, argv, *_ in CASES}
    assert commands == {"inspect", "plan", "run", "data", "profile"} and len(CASES) >= 40


def test_debug_shows_the_factory_traceback(workspace):
    """--debug raises instead: the factory's own error is chained as the cause."""
    from autopar.errors import AutoparError

    with pytest.raises(AutoparError) as raised:
        main(["--debug", "inspect", "--model", "raises_while_building:build"])
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_peer_rank_reports_after_the_grace_period(monkeypatch, capsys):
    """A rank other than 0 says it too (after a wait, so that rank 0's line comes first when both
    meet the input): a bad input only it meets is never swallowed."""
    import time

    import autopar.cli.commands as cli

    monkeypatch.setattr(cli, "PEER_REPORT_DELAY_S", 0.2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    started = time.perf_counter()
    code = main(["inspect", *TINY, "--seq-len", "0"])
    waited = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 2 and waited >= 0.2
    assert err.count("autopar: error:") == 1 and "--seq-len" in err
    monkeypatch.setenv("RANK", "0")
    started = time.perf_counter()
    assert main(["inspect", *TINY, "--seq-len", "0"]) == 2
    assert time.perf_counter() - started < 0.2  # rank 0 does not wait
    assert capsys.readouterr().err.count("autopar: error:") == 1


# --- torchrun: two processes, each meeting the bad input ----------------------------------------------
TORCHRUN_CASES = [
    # The case: tp=2 with 3 heads, found by both ranks after tracing.
    pytest.param("tp-does-not-divide-heads",
                 ["run", "--model", "gpt", "--model-config", "layers=2,hidden=48,heads=3,vocab=257,seq_len=32",
                  "--cluster", "local", "--global-batch", "4", "--steps", "2", "--strategy", "tp=2", "--data",
                  "synthetic", "--metrics", "{w}/m.jsonl", "--checkpoint-dir", "{w}/ck"],
                 ["tp=2 does not divide the 3 attention heads"], id="tp-does-not-divide-heads"),
    pytest.param("hand-edited-plan",
                 ["run", *TINY, "--plan", "{plan:same_device}", "--steps", "2", "--data", "synthetic",
                  "--metrics", "{w}/m.jsonl"], ["device 0 runs stages of pipeline ranks 0 and 1"],
                 id="hand-edited-plan", marks=pytest.mark.slow),
    pytest.param("collectives-unknown-op",
                 ["profile", "--collectives", "--db", "{w}/p.db", "--collective-ops", "allreduce"],
                 ["unknown collective"], id="collectives-unknown-op", marks=pytest.mark.slow),
]


def _our_frames(stderr: str) -> list[str]:
    """Traceback frames in our code: every frame shown must be torchrun's own (installed packages),
    from its report that a worker failed."""
    frames = [line.strip() for line in stderr.splitlines() if line.lstrip().startswith('File "')]
    return [frame for frame in frames if "site-packages" not in frame and "<frozen" not in frame]


@pytest.mark.parametrize("case_id, argv, words", TORCHRUN_CASES)
def test_under_torchrun_the_user_reads_one_line(workspace, case_id, argv, words):
    before = _snapshot(workspace)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "autopar", *_expand(argv, workspace)],
                          cwd=workspace, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0  # torchrun's own code (1) once a worker failed
    assert re.search(r"exitcode\s*:\s*2\b", done.stderr), done.stderr[-3000:]  # the worker that failed exited 2
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("autopar:")]
    assert len(said) == 1, done.stderr[-3000:]
    for word in words:
        assert word in said[0]
    tracebacks = re.split(r"(?=Traceback \(most recent call last\):)", done.stderr)[1:]
    assert all("ChildFailedError" in block for block in tracebacks), done.stderr[-3000:]  # torchrun's report only
    assert not _our_frames(done.stderr), done.stderr[-3000:]
    assert _snapshot(workspace) == before

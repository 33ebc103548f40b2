"""`autopar run`: real training on one process and under torchrun, and one line for each bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar.cli import main

MODEL = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=64,seq_len=16"]
TRAIN = [*MODEL, "--global-batch", "4", "--lr", "3e-3", "--seed", "7", "--data", "synthetic"]
BYTES = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=257,seq_len=32", "--cluster", "local",
         "--global-batch", "8", "--lr", "3e-3", "--log-every", "1"]
KEYS = {"step", "loss", "tokens_per_s", "mfu", "mfu_as_planned", "mfu_nominal", "peak_memory_bytes"}
PROGRESS = ("tracing ", "searching ")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """30 steps on this process, logged every 5: (exit code, stdout, metrics records)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    metrics = tmp_path_factory.mktemp("single") / "m.jsonl"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["run", *TRAIN, "--cluster", "local", "--steps", "30", "--log-every", "5",
                     "--metrics", str(metrics)])
    assert code == 0, err.getvalue()
    return out.getvalue(), _records(metrics)


def test_one_process_trains_and_writes_metrics(single_run):
    out, records = single_run
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]  # 30 steps / --log-every 5
    for record in records:
        assert KEYS <= set(record)
        assert record["tokens_per_s"] > 0 and record["mfu"] > 0
        assert record["mfu_nominal"] is True and record["peak_memory_bytes"] == 0  # CPU: nominal peak, no CUDA
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.3, losses  # the synthetic stream is learnable: the loss really falls
    assert "synthetic" in out and "dp=1 tp=1 pp=1" in out
    # the log says once what its "MFU (nominal)" is relative to
    assert out.count("MFU (nominal) = 6 × parameters × tokens/s per device (as planned: the plan's model FLOPs "
                     "per token, attention included, as its predicted MFU counts them), over a placeholder fp32 "
                     "peak of 1 TFLOP/s for cpu, a device known only nominally") == 1
    # as planned: the plan's FLOPs per token, the same ratio to 6N at every step (attention and the padded
    # head's rows counted)
    ratios = {round(r["mfu_as_planned"] / r["mfu"], 9) for r in records}
    assert len(ratios) == 1 and ratios.pop() > 1
    assert sum(line.startswith("step ") for line in out.splitlines()) == 6
    assert not dist.is_initialized()  # the group the run made for itself is gone


def test_torchrun_two_processes_data_parallel_matches_one_process(single_run, tmp_path):
    _, records = single_run
    metrics = tmp_path / "m.jsonl"
    torchrun = Path(sys.executable).parent / "torchrun"
    # faulthandler: a rank that dies on a signal prints its Python stacks (a rare abort was seen once)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "autopar", "run", *TRAIN, "--cluster", "local",
         "--strategy", "dp=2", "--steps", "5", "--log-every", "5", "--metrics", str(metrics)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp=2 tp=1 pp=1" in done.stdout and "2 process(es)" in done.stdout
    assert done.stdout.count("step      5") == 1  # rank 0 alone logs
    (record,) = _records(metrics)
    assert record["step"] == 5
    # same init and the same synthetic batches, the batch split over two ranks: the same loss after 5 steps
    assert record["loss"] == pytest.approx(records[0]["loss"], rel=1e-5)


@pytest.fixture(scope="module")
def world2_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "world2.json"
    code = main(["plan", *MODEL, "--cluster", "dgx-h100", "--gpus", "2", "--global-batch", "4", "--precision", "fp32",
                 "--strategy", "dp=2", "--save-plan", str(path)])
    assert code == 0 and path.is_file()
    return path


def _one_line_error(capsys, argv, *words):
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith(PROGRESS)]
    assert code == 2, captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("autopar: error: ") and "Traceback" not in captured.err
    for word in words:
        assert word in lines[0]
    assert not dist.is_initialized()


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(capsys, tmp_path, world2_plan):
    metrics = tmp_path / "m.jsonl"
    common = ["--steps", "2", "--metrics", str(metrics), "--data", "synthetic"]
    cases = [
        (["run", *MODEL, "--plan", str(tmp_path / "missing.json"), *common], ["missing.json", "not found"]),
        (["run", *TRAIN, "--cluster", "local", "--steps", "0", "--metrics", str(metrics)], ["--steps", "at least 1"]),
        (["run", *MODEL, "--plan", str(world2_plan), *common], ["needs 2 processes", "torchrun"]),
        (["run", *MODEL, "--plan", str(world2_plan), "--global-batch", "6", *common], ["plan needs", "= 4"]),
        (["run", *MODEL, "--plan", str(world2_plan), "--strategy", "tp=2", *common], ["disagrees", "tp=1"]),
        (["run", "--model", "gpt-9000", "--cluster", "local", "--global-batch", "4", *common], ["unknown model"]),
        (["run", *TRAIN, "--cluster", "local", "--strategy", "dp=2", *common], ["does not divide the world size 1"]),
        (["run", *MODEL, "--cluster", "local", "--global-batch", "3", "--strategy", "microbatch=2", *common],
         ["not divisible"]),
        (["run", *MODEL, "--plan", str(world2_plan), "--model-config", "layers=3,hidden=32,heads=4,vocab=64,seq_len=16",
          *common], ["fingerprint"]),
        (["run", *TRAIN, "--cluster", "local", "--checkpoint-every", "2", *common], ["--checkpoint-dir"]),
        (["run", *MODEL, "--cluster", "local", "--global-batch", "4", "--steps", "2", "--metrics", str(metrics)],
         ["vocab=257", "byte-level"]),
    ]
    for argv, words in cases:
        _one_line_error(capsys, argv, *words)
        assert not metrics.exists(), argv


def test_dry_run_prints_the_plan_and_trains_nothing(capsys, tmp_path, world2_plan):
    metrics = tmp_path / "m.jsonl"
    code = main(["run", *MODEL, "--plan", str(world2_plan), "--steps", "5", "--dry-run", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "dp=2 tp=1 pp=1" in out and "pp=1 x dp=2 x tp=1" in out
    assert "predicted step" in out and "GiB" in out and "nothing trained" in out
    assert "plan is for 2 processes" in out  # this launch has one
    assert not metrics.exists() and not dist.is_initialized()


def _quiet_main(argv) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_embedded_corpus_trains_by_default(tmp_path):
    metrics = tmp_path / "m.jsonl"
    code, out, err = _quiet_main(["run", *BYTES, "--steps", "30", "--log-every", "10", "--metrics", str(metrics)])
    assert code == 0, err
    records = _records(metrics)
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(KEYS | {"data"} <= set(r) and "stdlib" in r["data"] for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, records  # bytes of Python source are learnable
    assert "stdlib" in out


def test_resume_continues_exactly_where_the_checkpoint_stopped(tmp_path):
    straight, parts = tmp_path / "straight.jsonl", tmp_path / "parts.jsonl"
    code, _, err = _quiet_main(["run", *BYTES, "--steps", "6", "--checkpoint-dir", str(tmp_path / "a"),
                                "--checkpoint-every", "3", "--metrics", str(straight)])
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-00000003", "step-00000006"]
    for steps in ("3", "6"):
        code, out, err = _quiet_main(["run", *BYTES, "--steps", steps, "--checkpoint-dir", str(tmp_path / "b"),
                                      "--resume", "auto", "--metrics", str(parts)])
        assert code == 0, err
    assert "resumed from" in out and "step 3" in out
    first, second = _records(straight), _records(parts)
    assert [r["step"] for r in second] == [1, 2, 3, 4, 5, 6]  # the resumed run continues the metrics file
    assert [r["loss"] for r in second] == pytest.approx([r["loss"] for r in first], rel=1e-6)
    # already at --steps: nothing to train, exit 0 (a restart loop may run the command again)
    code, out, _ = _quiet_main(["run", *BYTES, "--steps", "6", "--checkpoint-dir", str(tmp_path / "b")])
    assert code == 0 and "nothing to train" in out


def test_checkpoint_errors_come_before_training(capsys, tmp_path):
    directory = tmp_path / "ck"
    code, _, err = _quiet_main(["run", *BYTES, "--steps", "1", "--checkpoint-dir", str(directory)])
    assert code == 0, err
    other = ["--model", "gpt", "--model-config", "layers=3,hidden=32,heads=4,vocab=257,seq_len=32"]
    metrics = tmp_path / "m.jsonl"
    _one_line_error(capsys, ["run", *other, *BYTES[4:], "--steps", "2", "--checkpoint-dir", str(directory),
                             "--metrics", str(metrics)], "fingerprint")
    _one_line_error(capsys, ["run", *BYTES, "--steps", "2", "--resume", str(tmp_path / "nowhere")], "--resume")
    _one_line_error(capsys, ["run", *BYTES, "--steps", "2", "--data", str(tmp_path / "nodata")], "does not exist")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, ["run", *BYTES, "--steps", "2", "--data", str(tmp_path / "empty")], "not a prepared")
    assert not metrics.exists()


def test_dataset_ids_beyond_the_model_vocabulary_are_refused(capsys, tmp_path):
    from autopar.runtime.data.prepare import prepare_tokens

    text = tmp_path / "t.txt"
    text.write_text("hello world " * 2000)
    prepare_tokens([str(text)], str(tmp_path / "ds"))
    small = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=64,seq_len=32"]
    _one_line_error(capsys, ["run", *small, *BYTES[4:], "--steps", "2", "--data", str(tmp_path / "ds")], "vocab")


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path):
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    job = subprocess.Popen([sys.executable, "-m", "autopar", "run", *BYTES, "--steps", "100000",
                            "--checkpoint-dir", str(tmp_path / "ck")],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.startswith("step      2"):
                job.send_signal(signal.SIGTERM)
                break
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err[-2000:]
    assert "SIGTERM: stopped after step" in out and "Traceback" not in err
    saved = sorted((tmp_path / "ck").glob("step-*"))
    assert len(saved) == 1 and 2 <= int(saved[0].name.split("-")[1]) < 100000


def _search_on_two_ranks(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks calling `run_plan.search_plan`: rank 1's own search raises if it runs."""
    from autopar.cli import run_plan
    from autopar.errors import AutoparError
    from autopar.models import build_model
    from autopar.cli.run import Environment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    if rank == 1:
        def searched_on_rank_1(*args, **kwargs):
            raise AssertionError("rank 1 searched")

        run_plan.searched_plan = searched_on_rank_1
    spec = build_model("gpt", "layers=2,hidden=32,heads=4,vocab=64,seq_len=16")
    (example,) = spec.example_inputs(1, 16)
    cluster, env = run_plan.planning_cluster("local", 2), Environment(world_size=2, rank=rank, local_rank=rank)
    plan = run_plan.search_plan(spec, example, cluster, {"dp": 2}, 4, 16, "fp32", env)
    try:
        run_plan.search_plan(spec, example, cluster, {"microbatch": 2}, 3, 16, "fp32", env)
        refusal = None
    except AutoparError as error:
        refusal = [str(error), error.exit_code]
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"plan": plan.to_json(), "refusal": refusal}))


@pytest.mark.slow  # 17 s; the default set's torchrun dp=2 run goes through the same search and broadcast
def test_under_torchrun_rank_0_alone_searches_and_every_rank_gets_its_plan_or_refusal(tmp_path, one_thread):
    import torch.multiprocessing as mp

    from tests.parity_harness import _free_port

    mp.spawn(_search_on_two_ranks, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first == second  # rank 1 never searched (it would have raised): it holds rank 0's answers
    assert json.loads(first["plan"])["strategy"]["dp"] == 2
    assert "not divisible" in first["refusal"][0] and first["refusal"][1] == 2


def test_mfu_as_planned_counts_the_plans_model_flops():
    """`planned_flops_per_token` reads back, from a plan's prediction, the traced FLOPs per token its
    MFU counts (`ModelFacts.flops_per_sample` over the sequence), on any strategy."""
    import autopar
    from autopar.models import build_model
    from autopar.runtime.training_loop import planned_flops_per_token

    spec = build_model("gpt", "layers=2,hidden=64,heads=4,vocab=257,seq_len=64")
    for strategy in ("dp=8", "tp=2,pp=2,dp=2"):
        planned = autopar.plan(spec.module, spec.example_inputs(1, 64), loss_fn=spec.loss_fn, global_batch=16,
                               cluster=autopar.load_cluster("dgx-h100", gpus=8), strategy=strategy, use_ilp=False)
        assert planned_flops_per_token(planned.plan) == pytest.approx(planned.facts.flops_per_sample / 64, rel=1e-9)
    assert planned_flops_per_token(planned.plan.model_copy(update={"predicted": None})) is None

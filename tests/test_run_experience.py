"""`autopar run` beyond the training itself: YAML run configs, progress bar, TensorBoard events,
--profile-steps against the plan, async checkpoints, disk full, and resuming under another strategy."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import struct
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar.cli import main

MODEL_CONFIG = "layers=2,hidden=32,heads=4,vocab=257,seq_len=32"
BYTES = ["--model", "gpt", "--model-config", MODEL_CONFIG, "--cluster", "local", "--global-batch", "8",
         "--lr", "3e-3", "--log-every", "1"]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _quiet_main(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one_line_error(argv, *words, code=2):
    got, out, err = _quiet_main(argv)
    lines = [line for line in err.splitlines() if line.startswith("autopar: error: ")]
    assert got == code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    assert not dist.is_initialized()
    return lines[0]


def test_yaml_config_with_flags_overriding_it_is_what_runs_and_what_the_checkpoint_keeps(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: gpt\nmodel-config: {MODEL_CONFIG}\ncluster: local\nglobal_batch: 8\n"
                      f"steps: 50\nlr: 0.002\nseed: 3\nlog_every: 1\ncheckpoint_dir: {tmp_path / 'ck'}\n"
                      f"metrics: {tmp_path / 'm.jsonl'}\n")
    code, out, err = _quiet_main(["run", "--config", str(config), "--steps", "3", "--seed", "5"])
    assert code == 0, err
    assert [r["step"] for r in _records(tmp_path / "m.jsonl")] == [1, 2, 3]  # --steps beat the file's 50
    state = json.loads((tmp_path / "ck" / "step-00000003" / "state.json").read_text())
    saved = state["extra"]["config"]
    assert saved["steps"] == 3 and saved["seed"] == 5  # flags
    assert saved["lr"] == 0.002 and saved["model_config"] == MODEL_CONFIG and saved["log_every"] == 1  # file
    assert saved["max_grad_norm"] == 1.0  # defaults come from the run config model


def test_bad_run_configs_are_one_line_each(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: [1\n")
    _one_line_error(["run", "--config", str(bad_yaml), "--model", "gpt", "--steps", "2"], "not valid YAML")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: gpt\nsteps: 2\nlearning_rate: 0.1\n")
    _one_line_error(["run", "--config", str(unknown)], "unknown setting", "learning_rate", "lr")
    wrong_type = tmp_path / "type.yaml"
    wrong_type.write_text("model: gpt\nsteps: many\n")
    _one_line_error(["run", "--config", str(wrong_type)], "steps", "type.yaml")
    _one_line_error(["run", "--config", str(tmp_path / "absent.yaml"), "--model", "gpt", "--steps", "2"],
                    "cannot read --config")
    _one_line_error(["run", "--model", "gpt"], "--steps is required")


def test_progress_bar_on_request_and_log_lines_still_complete(tmp_path):
    code, out, err = _quiet_main(["run", *BYTES, "--steps", "3", "--progress"])
    assert code == 0, err
    assert "training: 100%" in err and "3/3" in err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1", "2", "3"]
    code, out, err = _quiet_main(["run", *BYTES, "--steps", "2", "--no-progress"])
    assert code == 0 and "training:" not in err


def _tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Read the event files (TFRecord framing: length, crc, Event proto, crc) with tensorboardX's protos."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_events_hold_each_logged_step(tmp_path):
    metrics = tmp_path / "m.jsonl"
    code, _, err = _quiet_main(["run", *BYTES, "--steps", "4", "--log-every", "2", "--metrics", str(metrics),
                                "--tensorboard", str(tmp_path / "tb")])
    assert code == 0, err
    scalars = _tensorboard_scalars(tmp_path / "tb")
    records = _records(metrics)
    assert [step for step, _ in scalars["train/loss"]] == [2, 4]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"train/tokens_per_s", "train/mfu", "train/peak_memory_bytes"} <= set(scalars)


def test_profile_steps_prints_predicted_vs_measured_saves_traces_and_extends_the_report(tmp_path):
    plan, report = tmp_path / "plan.json", tmp_path / "plan.html"
    code, _, err = _quiet_main(["plan", "--model", "gpt", "--model-config", MODEL_CONFIG, "--cluster", "dgx-h100",
                                "--gpus", "1", "--global-batch", "8", "--precision", "fp32",
                                "--save-plan", str(plan), "--report", str(report)])
    assert code == 0, err
    before = report.read_text()
    code, out, err = _quiet_main(["run", "--model", "gpt", "--model-config", MODEL_CONFIG, "--plan", str(plan),
                                  "--steps", "5", "--profile-steps", "2", "--profile-dir", str(tmp_path / "prof"),
                                  "--report", str(report), "--log-every", "1"])
    assert code == 0, err
    assert "profiled steps 2-3" in out and "predicted vs measured" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("step time"))
    assert "ms" in row and "%" in row
    compute = next(line for line in out.splitlines() if line.strip().startswith("compute, pp rank 0"))
    assert "ms" in compute and "%" in compute
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4", "5"]
    trace = json.loads((tmp_path / "prof" / "rank0.trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    after = report.read_text()
    assert 'id="measured"' in after and 'id="measured"' not in before and "step time" in after


def test_report_and_profile_outputs_are_checked_before_training(tmp_path):
    _one_line_error(["run", *BYTES, "--steps", "3", "--report", str(tmp_path / "r.html")], "--profile-steps")
    _one_line_error(["run", *BYTES, "--steps", "3", "--profile-steps", "1", "--report", str(tmp_path / "r.html")],
                    "not found", "autopar plan")
    _one_line_error(["run", *BYTES, "--steps", "3", "--profile-steps", "3"], "--profile-steps 3", "--steps")


def test_async_checkpoints_from_the_cli_are_complete_and_resume_exactly(tmp_path):
    from autopar.runtime.checkpoint.checkpointer import verify_checkpoint

    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    code, out, err = _quiet_main(["run", *BYTES, "--steps", "4", "--checkpoint-dir", str(tmp_path / "a"),
                                  "--checkpoint-every", "2", "--async-checkpoint", "--metrics", str(straight)])
    assert code == 0, err
    assert "saving checkpoint" in out
    for step in (2, 4):
        verify_checkpoint(tmp_path / "a" / f"step-{step:08d}")  # raises on a missing or altered file
    assert (tmp_path / "a" / "latest").read_text().strip() == "step-00000004"
    code, out, err = _quiet_main(["run", *BYTES, "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"),
                                  "--resume", str(tmp_path / "a" / "step-00000002"), "--metrics", str(resumed)])
    assert code == 0, err
    assert [r["step"] for r in _records(resumed)] == [3, 4]
    assert [r["loss"] for r in _records(resumed)] == pytest.approx([r["loss"] for r in _records(straight)][2:],
                                                                    rel=1e-6)


def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream
    saves = {"data_files": 0}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp"):
            saves["data_files"] += 1
            if saves["data_files"] >= 2:  # the first checkpoint writes, the second finds the disk full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with original(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    directory = tmp_path / "ck"
    line = _one_line_error(["run", *BYTES, "--steps", "4", "--checkpoint-dir", str(directory),
                            "--checkpoint-every", "2"], "space")
    assert "step-00000002 and `latest` are intact" in line and "free space" in line
    assert (directory / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000002"]  # nothing half-written


def test_two_processes_resume_under_another_strategy_with_the_same_losses(tmp_path):
    """torchrun dp=2 for 6 steps (checkpoint at 4); then torchrun tp=2 from that checkpoint: steps 5-6
    must match the uninterrupted dp=2 run."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["-m", "autopar", "run", "--model", "gpt", "--model-config", MODEL_CONFIG, "--cluster", "local",
              "--global-batch", "8", "--precision", "fp32", "--lr", "3e-3", "--log-every", "1", "--steps", "6"]
    first = subprocess.run([*torchrun, *common, "--strategy", "dp=2", "--checkpoint-dir", str(tmp_path / "dp"),
                            "--checkpoint-every", "4", "--metrics", str(tmp_path / "dp.jsonl")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run([*torchrun, *common, "--strategy", "tp=2,sp=true", "--checkpoint-dir",
                             str(tmp_path / "tp"), "--resume", str(tmp_path / "dp" / "step-00000004"),
                             "--metrics", str(tmp_path / "tp.jsonl")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "dp=1 tp=2" in second.stdout and "resumed from" in second.stdout
    straight = {r["step"]: r["loss"] for r in _records(tmp_path / "dp.jsonl")}
    continued = {r["step"]: r["loss"] for r in _records(tmp_path / "tp.jsonl")}
    assert sorted(continued) == [5, 6]
    assert [continued[s] for s in (5, 6)] == pytest.approx([straight[s] for s in (5, 6)], rel=1e-5)


class _Event:
    """The parts of a torch.profiler FunctionEvent that the measurement reads."""

    def __init__(self, name: str, start_us: float, end_us: float, device: str = "DeviceType.CPU"):
        from types import SimpleNamespace

        self.name, self.device_type = name, device
        self.time_range = SimpleNamespace(start=start_us, elapsed_us=lambda: end_us - start_us)


def test_compute_time_counts_nested_operators_once_and_leaves_collectives_out():
    from autopar.cli.run_profile import collective_time_s, compute_time_s

    cpu = [_Event("aten::linear", 0, 100), _Event("aten::addmm", 10, 90),  # nested: counted once
           _Event("aten::copy_", 150, 200), _Event("gloo:all_reduce", 180, 260),  # 20 us of the copy is gloo's
           _Event("ProfilerStep#1", 0, 400), _Event("aten::mul", 300, 320)]
    assert compute_time_s(cpu, cuda=False) == pytest.approx((100 + 30 + 20) / 1e6)
    assert collective_time_s(cpu, cuda=False) == pytest.approx(80 / 1e6)
    gpu = [_Event("ampere_sgemm", 0, 50, "DeviceType.CUDA"), _Event("ncclKernel_AllReduce", 40, 90, "DeviceType.CUDA"),
           _Event("Memcpy HtoD", 90, 95, "DeviceType.CUDA"), _Event("aten::mm", 0, 10),
           _Event("vectorized_elementwise", 100, 110, "DeviceType.CUDA")]
    assert compute_time_s(gpu, cuda=True) == pytest.approx(60 / 1e6)  # kernels only, NCCL's and copies out
    assert collective_time_s(gpu, cuda=True) == pytest.approx(50 / 1e6)


def test_two_pipeline_ranks_each_get_a_measured_compute_row(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run([*torchrun, "-m", "autopar", "run", *BYTES, "--precision", "fp32", "--steps", "3",
                           "--strategy", "pp=2,microbatch=2", "--profile-steps", "1",
                           "--profile-dir", str(tmp_path / "prof")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("  ")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("  ")
            and "%" in line}
    assert {"step time", "compute, pp rank 0", "compute, pp rank 1"} <= set(rows), done.stdout
    assert done.stdout.count("predicted vs measured") == 1  # rank 0 alone prints the table
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["rank0.trace.json", "rank1.trace.json"]

"""Checkpoints: plan-independent state, atomic publication, integrity, resharding across plans.

One gloo group of two processes runs every multi-process case (resharding between plans, async
against sync save, disk full and a failing write on one rank); the rest runs in this process as a
world of one. Resharding is checked as parity: training resumed under another plan gives the
losses of training continued under the saving plan, to relative 1e-5 (fp32, CPU).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist

from parity_harness import MAX_GRAD_NORM, SEED, batches, make_plan, run_plans, tiny_config

GLOBAL_BATCH = 8
SEQ = 16
STEPS_BEFORE = 3
STEPS_AFTER = 3
DATA = batches(tiny_config()["vocab"], GLOBAL_BATCH, SEQ, STEPS_BEFORE + STEPS_AFTER)
GATE_TIMEOUT_S = 20.0
ROOT = Path(__file__).resolve().parent.parent


# ---- shared by this process and the workers -------------------------------------------------------
def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    from autopar.runtime.optimizer import build_optimizer

    # the runtime's (`autopar run`'s): foreach on the CPU, whose step under tp without sp needs
    # `step_context`, and whose class a checkpoint names alike under every plan
    return build_optimizer(list(params), 1e-3, weight_decay=0.1)


def _build(plan_json: str, optimizer_kind: str, overrides: dict | None = None):
    from autopar.models import build_model
    from autopar.plan_schema import Plan
    from autopar.runtime.parallelize import parallelize

    spec = build_model("gpt", overrides or tiny_config())
    parallel = parallelize(spec.module, Plan.from_json(plan_json), loss_fn=spec.loss_fn, seed=SEED)
    return parallel, _optimizer(parallel.parameters(), optimizer_kind)


def _train(parallel, optimizer, data) -> list[float]:
    return [parallel.train_step(batch, optimizer, max_grad_norm=MAX_GRAD_NORM) for batch in data]


def _draws() -> list[float]:
    """One value from each generator a checkpoint restores."""
    return [random.random(), *torch.rand(2).tolist(), float(numpy.random.rand())]


def _local_optimizer_state(parallel, optimizer) -> dict[str, torch.Tensor]:
    from autopar.runtime.checkpoint.state import optimizer_entries

    values = optimizer_entries(parallel, optimizer).values
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in values.items()}


class _FailingStream:
    """A checkpoint file that takes `limit_bytes` bytes, then fails as `make_error` says."""

    def __init__(self, stream, make_error, limit_bytes: int) -> None:
        self._stream, self._make_error, self._left = stream, make_error, limit_bytes

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._left:
            self._stream.write(data[:self._left])
            self._stream.flush()
            self._left = 0
            raise self._make_error()
        self._left -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _wrapped_data_files(wrap, on_rank: int | None = None):
    """DCP's data files written (on one rank, or all) through `wrap(stream)`."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        rank = dist.get_rank() if dist.is_initialized() else 0
        with original(self, path, mode) as stream:
            if "w" in mode and str(path).endswith(".distcp") and on_rank in (None, rank):
                yield wrap(stream)
            else:
                yield stream

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = original


def _failing_writes(make_error, on_rank: int | None = None, limit_bytes: int = 256):
    """Data files fail after `limit_bytes` bytes, as a full disk or a crash would."""
    return _wrapped_data_files(lambda stream: _FailingStream(stream, make_error, limit_bytes), on_rank)


def _gated_writes(gate: threading.Event, timed_out: list):
    """Data files opened only once `gate` is set: a save that blocked would wait here in vain."""
    def wrap(stream):
        if not gate.wait(timeout=GATE_TIMEOUT_S):
            timed_out.append(True)
        return stream

    return _wrapped_data_files(wrap)


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _listing(directory: str) -> dict:
    path = Path(directory)
    pointer = (path / "latest").read_text().strip() if (path / "latest").exists() else None
    return {"entries": sorted(p.name for p in path.iterdir()), "latest": pointer}


# ---- jobs in the two-process group ------------------------------------------------------------------
def _reshard_job(job: dict) -> dict:
    """Train under plan A, save, continue under A; load under each other plan and continue there."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(job["plan"], job["optimizer"])
    _train(parallel, optimizer, DATA[:STEPS_BEFORE])
    extra = {"step": STEPS_BEFORE, "plan": job["plan"], "data_position": STEPS_BEFORE * GLOBAL_BATCH}
    primary = Checkpointer(job["directory"], async_save=job["async"])
    if job["async"]:  # the same state saved synchronously, to compare with
        Checkpointer(job["sync_directory"]).save(STEPS_BEFORE, parallel, optimizer, extra)
    gate, timed_out = threading.Event(), []
    with _gated_writes(gate, timed_out) if job["async"] else contextlib.nullcontext():
        primary.save(STEPS_BEFORE, parallel, optimizer, extra)
        result = {"draws": _draws(), "runs": []}
        result["losses"] = _train(parallel, optimizer, DATA[STEPS_BEFORE:])  # before an async save writes
        gate.set()
        primary.wait()
    result["write_waited_for_training"] = not timed_out
    result["state"] = parallel.full_state_dict()
    for plan_json in job["others"]:
        other, other_optimizer = _build(plan_json, job["optimizer"])
        loaded = Checkpointer(job["directory"]).load("latest", other, other_optimizer)
        run = {"extra_equal": loaded == extra, "draws": _draws()}
        if job["async"] and plan_json is job["others"][0]:
            twin, twin_optimizer = _build(plan_json, job["optimizer"])
            Checkpointer(job["sync_directory"]).load("latest", twin, twin_optimizer)
            run["async_equals_sync"] = _same_state(other, other_optimizer, twin, twin_optimizer)
        run["losses"] = _train(other, other_optimizer, DATA[STEPS_BEFORE:])
        run["state"] = other.full_state_dict()
        result["runs"].append(run)
    return result


def _same_state(parallel, optimizer, twin, twin_optimizer) -> bool:
    params = {k: p.detach() for k, p in parallel.named_parameters().items()}
    twin_params = {k: p.detach() for k, p in twin.named_parameters().items()}
    state, twin_state = _local_optimizer_state(parallel, optimizer), _local_optimizer_state(twin, twin_optimizer)
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in params.values()]
    twin_local = [(p.to_local() if hasattr(p, "to_local") else p) for p in twin_params.values()]
    return (params.keys() == twin_params.keys() and all(torch.equal(a, b) for a, b in zip(local, twin_local))
            and state.keys() == twin_state.keys() and all(torch.equal(state[k], twin_state[k]) for k in state))


def _grow_job(job: dict) -> dict:
    """A checkpoint of a world of one (plain tensors) loaded under dp=2 ZeRO-3 (DTensor shards)."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(job["plan"], "sgd")
    Checkpointer(job["directory"]).load("latest", parallel, optimizer)
    return {"draws": _draws(), "losses": _train(parallel, optimizer, DATA[STEPS_BEFORE:])}


def _failure_job(job: dict) -> dict:
    """Disk full and a failing write on one rank, sync and async: nothing half-published, all ranks
    told; then a bit flipped in one rank's file: every rank falls back to the previous checkpoint."""
    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(job["plan"], "sgd")
    _train(parallel, optimizer, DATA[:1])
    directory = job["directory"]
    checkpointer = Checkpointer(directory, keep_last=2)
    checkpointer.save(1, parallel, optimizer, {"step": 1})
    seen = {}
    for label, make_error, errors, asynchronous in [
            ("disk_full", _disk_full, AutoparError, False),
            ("crash", lambda: RuntimeError("simulated crash inside the write"), RuntimeError, False),
            ("async_disk_full", _disk_full, AutoparError, True)]:
        writer = Checkpointer(directory, keep_last=2, async_save=asynchronous)
        with _failing_writes(make_error, on_rank=1):
            try:
                writer.save(2, parallel, optimizer, {"step": 2})
                writer.wait()
                seen[label] = None
            except errors as error:
                seen[label] = str(error)
        dist.barrier()
        seen[f"{label}_listing"] = _listing(directory)
        dist.barrier()  # both ranks looked before the next case writes
    checkpointer.save(2, parallel, optimizer, {"step": 2})
    checkpointer.save(3, parallel, optimizer, {"step": 3})
    seen["final_listing"] = _listing(directory)
    if dist.get_rank() == 0:  # rank 0 hashes this file when the ranks verify together
        _flip_one_bit(Path(directory, "step-00000003", "__1_0.distcp"))
    dist.barrier()
    seen["after_bit_flip"] = checkpointer.load("latest", parallel, optimizer)
    return seen


def _flip_one_bit(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x10
    path.write_bytes(bytes(content))


JOBS = {"reshard": _reshard_job, "grow": _grow_job, "failure": _failure_job}


def _run_job(job: dict):
    return JOBS[job["kind"]](job)


def _run_group(world: int, jobs: list[dict], outdir: Path) -> list[list[dict]]:
    return run_plans(world, jobs, runner=_run_job, outdir=outdir)


# ---- fixtures ---------------------------------------------------------------------------------------
def _plan(strategy: dict, world: int, overrides: dict | None = None) -> str:
    return make_plan("gpt", overrides or tiny_config(), strategy, world, GLOBAL_BATCH).to_json()


SGD_A = dict(dp=2, tp=1, pp=1, zero=0, microbatch=2)
SGD_OTHERS = [dict(dp=1, tp=2, pp=1, sp=True, zero=0, microbatch=4),
              dict(dp=1, tp=1, pp=2, schedule="interleaved", vp=2, microbatch=2),
              dict(dp=2, tp=1, pp=1, zero=1, microbatch=2)]
ADAMW_A = dict(dp=2, tp=1, pp=1, zero=3, microbatch=2)
ADAMW_OTHERS = [dict(dp=1, tp=1, pp=2, schedule="1f1b", microbatch=2),
                dict(dp=1, tp=2, pp=1, zero=0, microbatch=4)]
ONE = dict(dp=1, tp=1, pp=1, zero=0, microbatch=8)


@pytest.fixture(scope="module")
def world_of_one():
    """This process as a world of one (parallelize starts it); torn down after the module."""
    yield _plan(ONE, 1)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group(world_of_one, tmp_path_factory):
    """Every two-process case, run once; plus a world-of-one checkpoint for the group to grow from."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    root = tmp_path_factory.mktemp("group")
    parallel, optimizer = _build(world_of_one, "sgd")
    _train(parallel, optimizer, DATA[:STEPS_BEFORE])
    Checkpointer(root / "one").save(STEPS_BEFORE, parallel, optimizer, {"step": STEPS_BEFORE})
    one = {"draws": _draws(), "losses": _train(parallel, optimizer, DATA[STEPS_BEFORE:])}
    jobs = [dict(kind="reshard", optimizer="sgd", plan=_plan(SGD_A, 2), others=[_plan(s, 2) for s in SGD_OTHERS],
                 directory=str(root / "sgd"), sync_directory=None, **{"async": False}),
            dict(kind="reshard", optimizer="adamw", plan=_plan(ADAMW_A, 2),
                 others=[_plan(s, 2) for s in ADAMW_OTHERS], directory=str(root / "adamw-async"),
                 sync_directory=str(root / "adamw-sync"), **{"async": True}),
            dict(kind="grow", plan=_plan(ADAMW_A, 2), directory=str(root / "one")),
            dict(kind="failure", plan=_plan(SGD_A, 2), directory=str(root / "failure"))]
    results = _run_group(2, jobs, root)
    return {"root": root, "one": one, "sgd": results[0], "adamw": results[1], "grow": results[2],
            "failure": results[3]}


def _merged_state(ranks: list[dict], key: str = "state") -> dict[str, torch.Tensor]:
    merged = {}
    for result in ranks:
        merged.update(result[key])
    return merged


def _assert_resumes_alike(ranks: list[dict], labels: list[str]) -> None:
    expected_losses = torch.tensor(ranks[0]["losses"])
    expected_state = _merged_state(ranks)
    for index, label in enumerate(labels):
        for rank, result in enumerate(ranks):
            run = result["runs"][index]
            assert run["extra_equal"], (label, rank)
            assert run["draws"] == result["draws"], (label, rank, "generators not restored")
            torch.testing.assert_close(torch.tensor(run["losses"]), expected_losses, rtol=1e-5, atol=0,
                                       msg=lambda m: f"{label} rank {rank} losses: {m}")
        state = _merged_state([result["runs"][index] for result in ranks])
        assert state.keys() == expected_state.keys(), label
        for name, value in state.items():
            torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{label} weight {name}: {m}")


# ---- the group's cases ------------------------------------------------------------------------------
def test_sgd_checkpoint_of_dp2_zero0_resumes_under_tp_sp_interleaved_pp_and_zero1(group):
    _assert_resumes_alike(group["sgd"], ["tp=2 sp", "pp=2 interleaved", "dp=2 zero1"])


def test_adamw_checkpoint_of_zero3_resumes_under_pp_1f1b_and_tp(group):
    _assert_resumes_alike(group["adamw"], ["pp=2 1f1b", "tp=2"])


def test_async_save_loads_exactly_as_sync_save(group):
    """The files are written only after three more training steps changed every weight: what lands
    on disk is the copy staged when save() returned."""
    for result in group["adamw"]:
        assert result["write_waited_for_training"], "save() blocked until its files were written"
        assert result["runs"][0]["async_equals_sync"]


def test_checkpoint_of_two_ranks_resumes_in_one_process_and_one_rank_grows_to_two(group, world_of_one):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    for name in ("sgd", "adamw"):
        ranks = group[name]
        parallel, optimizer = _build(world_of_one, "sgd" if name == "sgd" else "adamw")
        directory = group["root"] / ("sgd" if name == "sgd" else "adamw-async")
        Checkpointer(directory).load("latest", parallel, optimizer)
        assert _draws() == ranks[0]["draws"]
        torch.testing.assert_close(torch.tensor(_train(parallel, optimizer, DATA[STEPS_BEFORE:])),
                                   torch.tensor(ranks[0]["losses"]), rtol=1e-5, atol=0)
    for rank, result in enumerate(group["grow"]):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(group["one"]["losses"]),
                                   rtol=1e-5, atol=0)
        if rank == 0:  # rank 1 did not exist when saved: it keeps its own generators
            assert result["draws"] == group["one"]["draws"]


def test_failed_saves_across_ranks_publish_nothing(group):
    for seen in group["failure"]:
        for label in ("disk_full", "async_disk_full"):
            message = seen[label]
            assert message is not None and "\n" not in message and "disk full" in message, (label, message)
            assert "step-00000002" in message and "step-00000001" in message, message
        assert seen["crash"] is not None and "simulated crash" in seen["crash"] and "\n" not in seen["crash"]
        for label in ("disk_full", "crash", "async_disk_full"):  # temp dir gone, previous and latest intact
            assert seen[f"{label}_listing"] == {"entries": ["latest", "step-00000001"], "latest": "step-00000001"}
        assert seen["final_listing"] == {"entries": ["latest", "step-00000002", "step-00000003"],
                                         "latest": "step-00000003"}
        assert seen["after_bit_flip"] == {"step": 2}  # both ranks fell back together


# ---- a world of one ---------------------------------------------------------------------------------
def test_round_trip_restores_weights_adamw_state_hyperparameters_extra_and_generators(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(world_of_one, "adamw")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for batch in DATA[:STEPS_BEFORE]:
        parallel.train_step(batch, optimizer)
        scheduler.step()
    extra = {"step": STEPS_BEFORE, "scheduler": scheduler.state_dict(), "loader": {"epoch": 0, "position": 24}}
    Checkpointer(tmp_path).save(STEPS_BEFORE, parallel, optimizer, extra)
    draws = _draws()

    other, other_optimizer = _build(world_of_one, "adamw")
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=2, gamma=0.5)
    loaded = Checkpointer(tmp_path).load("latest", other, other_optimizer)
    other_scheduler.load_state_dict(loaded["scheduler"])
    assert loaded == json.loads(json.dumps(extra))
    assert _draws() == draws
    for name, param in parallel.named_parameters().items():
        assert torch.equal(param, other.named_parameters()[name]), name
    state, other_state = _local_optimizer_state(parallel, optimizer), _local_optimizer_state(other, other_optimizer)
    assert state.keys() == other_state.keys() and any(k.endswith(".exp_avg_sq") for k in state)
    assert all(torch.equal(state[k], other_state[k]) for k in state)
    assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 5e-4
    assert other_optimizer.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
    for batch in DATA[STEPS_BEFORE:]:
        assert parallel.train_step(batch, optimizer) == other.train_step(batch, other_optimizer)
        scheduler.step(), other_scheduler.step()
        assert scheduler.get_last_lr() == other_scheduler.get_last_lr()


class _CountingSGD(torch.optim.SGD):
    """An optimizer whose step also keeps a plain Python value in its state (DCP stores it as an object)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["updates"] = self.state[param].get("updates", 0) + 1
        return loss


def test_optimizer_state_that_is_not_a_tensor_round_trips(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, _ = _build(world_of_one, "sgd")
    optimizer = _CountingSGD(parallel.parameters(), lr=0.05, momentum=0.9)
    _train(parallel, optimizer, DATA[:STEPS_BEFORE])
    Checkpointer(tmp_path).save(STEPS_BEFORE, parallel, optimizer, {})
    other, _ = _build(world_of_one, "sgd")
    other_optimizer = _CountingSGD(other.parameters(), lr=0.05, momentum=0.9)
    Checkpointer(tmp_path).load("latest", other, other_optimizer)
    counts = [other_optimizer.state[p]["updates"] for p in other.parameters()]
    assert counts == [STEPS_BEFORE] * len(counts)
    assert torch.equal(torch.tensor(_train(parallel, optimizer, DATA[STEPS_BEFORE:])),
                       torch.tensor(_train(other, other_optimizer, DATA[STEPS_BEFORE:])))


def test_publication_keep_last_replacement_and_leftovers(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(world_of_one, "sgd")
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    assert checkpointer.latest() is None and checkpointer.list() == []
    for step in (1, 2, 3):
        checkpointer.save(step, parallel, optimizer, {"step": step})
    assert [info.step for info in checkpointer.list()] == [2, 3]
    assert (tmp_path / "latest").read_text() == "step-00000003\n"
    assert checkpointer.latest() == tmp_path / "step-00000003"
    (tmp_path / ".step-00000009.tmp" / "rng").mkdir(parents=True)  # what a killed save leaves
    (tmp_path / ".step-00000009.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / ".latest.12345.partial").write_text("step-0000")
    checkpointer.save(3, parallel, optimizer, {"step": 3, "again": True})  # the same step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert checkpointer.load("latest", parallel, optimizer) == {"step": 3, "again": True}
    assert checkpointer.load(2, parallel, optimizer) == {"step": 2}


def test_damaged_files_are_named_and_latest_falls_back(world_of_one, tmp_path, capfd):
    from autopar.runtime.checkpoint.checkpointer import CheckpointError, Checkpointer

    parallel, optimizer = _build(world_of_one, "sgd")
    checkpointer = Checkpointer(tmp_path, keep_last=3)
    weights = {}
    for step in (1, 2, 3):
        _train(parallel, optimizer, DATA[step - 1:step])
        checkpointer.save(step, parallel, optimizer, {"step": step})
        weights[step] = parallel.full_state_dict()
    _flip_one_bit(tmp_path / "step-00000003" / "__0_0.distcp")
    metadata = tmp_path / "step-00000002" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    capfd.readouterr()

    with pytest.raises(CheckpointError, match=r"step-00000003 is damaged: file __0_0.distcp does not match") as error:
        checkpointer.load(3, parallel, optimizer)
    assert "\n" not in str(error.value) and error.value.file == "__0_0.distcp"
    other, other_optimizer = _build(world_of_one, "sgd")
    assert checkpointer.load("latest", other, other_optimizer) == {"step": 1}
    for name, value in other.full_state_dict().items():
        assert torch.equal(value, weights[1][name]), name
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2, warnings
    assert "step-00000003 is damaged: file __0_0.distcp" in warnings[0] and "loading step-00000001" in warnings[0]
    assert "step-00000002 is damaged: file .metadata has 100 bytes" in warnings[1]


def test_a_killed_save_leaves_the_previous_checkpoint_and_is_swept_by_the_next(world_of_one, tmp_path):
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(world_of_one)
    directory = tmp_path / "run"
    code = f"import test_checkpoint as t; t._killed_save({str(plan_file)!r}, {str(directory)!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    finished = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 17, finished.stderr[-2000:]
    assert sorted(p.name for p in directory.iterdir()) == [".step-00000002.tmp", "latest", "step-00000001"]
    assert (directory / "latest").read_text() == "step-00000001\n"
    checkpointer = Checkpointer(directory)
    parallel, optimizer = _build(world_of_one, "sgd")
    assert checkpointer.load("latest", parallel, optimizer) == {"step": 1}
    checkpointer.save(2, parallel, optimizer, {"step": 2})
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def _killed_save(plan_file: str, directory: str) -> None:
    """Child process: save step 1, then die (no cleanup, no exception handling) inside step 2's write."""
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(Path(plan_file).read_text(), "sgd")
    _train(parallel, optimizer, DATA[:1])
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, parallel, optimizer, {"step": 1})

    def die() -> OSError:
        os._exit(17)

    with _failing_writes(die, limit_bytes=4096):
        checkpointer.save(2, parallel, optimizer, {"step": 2})


def test_checkpoint_of_another_model_is_refused_in_one_line(world_of_one, tmp_path):
    from autopar.errors import AutoparError
    from autopar.runtime.checkpoint.checkpointer import Checkpointer

    parallel, optimizer = _build(world_of_one, "sgd")
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, parallel, optimizer, {})
    wider = tiny_config(hidden=48)
    other, other_optimizer = _build(_plan(ONE, 1, wider), "sgd", wider)
    with pytest.raises(AutoparError, match="model fingerprint") as error:
        checkpointer.load("latest", other, other_optimizer)
    assert "\n" not in str(error.value)
    manifest_path = tmp_path / "step-00000001" / "manifest.json"  # no fingerprint: names and shapes decide
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "model_fingerprint": None}))
    with pytest.raises(AutoparError, match=r"with shape \(128, 32\), this model's is \(128, 48\)"):
        checkpointer.load("latest", other, other_optimizer)
    with pytest.raises(AutoparError, match="holds SGD state, this optimizer is AdamW"):
        checkpointer.load("latest", parallel, torch.optim.AdamW(parallel.parameters()))

"""Crash recovery: a rank SIGKILLed under `torchrun --max-restarts` comes back and the job ends bit for bit
where an uninterrupted job ends; and the per-round store that makes the restart possible."""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_injection  # noqa: E402

STEPS = 6
EVERY = 2


def test_a_killed_rank_restarts_and_the_job_ends_exactly_where_an_uninterrupted_one_does(tmp_path):
    reference = fault_injection.run_job(tmp_path / "reference", steps=STEPS, checkpoint_every=EVERY)
    assert reference["returncode"] == 0, reference["log"][-3000:]
    expected = fault_injection.final_state(tmp_path / "reference" / "checkpoints", STEPS)

    outcome = fault_injection.run_job(tmp_path / "killed", steps=STEPS, checkpoint_every=EVERY,
                                      kill_after_step=3, kill_rank=1)
    log = outcome["log"]
    assert outcome["returncode"] == 0, log[-3000:]
    assert outcome["killed_after_step"] is not None and outcome["killed_after_step"] >= 3
    # torchrun saw a worker fail (the killed one, -9, or its peer, which exits 1 on the broken
    # connection; whichever it notices first) and started a second round
    assert "failed (exitcode:" in log and log.count("training gpt") == 2, log[-3000:]
    assert outcome["resumed"], log[-3000:]  # from step 2 or later, not from scratch
    assert "Traceback" not in log.split("failed (exitcode:")[-1]  # the restarted round ran cleanly
    actual = fault_injection.final_state(tmp_path / "killed" / "checkpoints", STEPS)
    assert fault_injection.differences(expected, actual) == []
    keys = _flat_keys(expected)  # the comparison covered weights and optimizer moments
    assert "model.layers.0.mlp.fc1.weight" in keys and "optim.layers.0.mlp.fc1.weight.exp_avg_sq" in keys


def _flat_keys(state: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in state.items():
        keys += _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def test_differences_sees_a_single_flipped_bit():
    import torch

    a = {"model": {"w": torch.ones(3)}, "step": 4}
    b = {"model": {"w": torch.ones(3).clone()}, "step": 4}
    assert fault_injection.differences(a, b) == []
    b["model"]["w"].view(torch.int32)[1] ^= 1
    assert fault_injection.differences(a, b) == ["model.w"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_ranks_skip_a_store_announced_by_a_dead_round(monkeypatch):
    """The agent's store still holds the previous round's announcement (a port nobody listens on);
    rank 1 must wait for rank 0's new store instead of failing on the old one."""
    from torch.distributed import TCPStore

    from autopar.runtime import launch

    agent_port = _free_port()
    agent = TCPStore("127.0.0.1", agent_port, world_size=2, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    agent.set(launch.ANNOUNCE_KEY, str(_free_port()))  # a dead round's store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    monkeypatch.setenv("AUTOPAR_INIT_TIMEOUT_S", "30")

    stores = {}

    def rank(number: int, delay_s: float) -> None:
        time.sleep(delay_s)
        stores[number] = launch.round_store(number, 2)

    late_rank0 = threading.Thread(target=rank, args=(0, 1.0))
    late_rank0.start()
    rank(1, 0.0)  # starts first and meets the stale announcement
    late_rank0.join()
    stores[0].set("probe", b"from rank 0")
    assert stores[1].get("probe") == b"from rank 0"
    assert int(agent.get(launch.ANNOUNCE_KEY)) == stores[0].port


def test_no_store_from_rank_0_is_one_clear_error(monkeypatch):
    from torch.distributed import TCPStore

    from autopar.errors import AutoparError
    from autopar.runtime import launch

    agent_port = _free_port()
    agent = TCPStore("127.0.0.1", agent_port, world_size=2, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    agent.set(launch.ANNOUNCE_KEY, str(_free_port()))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    monkeypatch.setenv("AUTOPAR_INIT_TIMEOUT_S", "1")
    with pytest.raises(AutoparError, match="found no process-group store from rank 0"):
        launch.round_store(1, 2)

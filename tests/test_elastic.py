"""Elastic restarts re-plan: a job that comes back with fewer processes searches a plan for its new
world size, reshards the last checkpoint onto it and continues with the data position exact.

Two checks of every continuation: (1) against an uninterrupted two-process run, the losses after the
restart agree to rtol 1e-5 (only the reduction order differs; a data position off by one batch
moves the loss by far more, which the test also shows), and (2) against a one-process run started
from the same checkpoint (the uninterrupted run at the new size from that step), the losses and the
final weights and optimizer state are bitwise equal (fp32 on CPU).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_injection  # noqa: E402

STEPS = 6
EVERY = 3


def _data_position(checkpoint: Path) -> dict:
    data = json.loads((checkpoint / "state.json").read_text())["extra"]["data"]
    return {key: data[key] for key in ("epoch", "samples_in_epoch", "seed", "global_batch")}


def test_a_job_restarted_with_fewer_processes_replans_reshards_and_continues_exactly(tmp_path):
    straight = fault_injection.two_processes(tmp_path / "two", STEPS, EVERY)
    assert straight["returncode"] == 0, straight["log"][-3000:]
    assert "dp=2" in straight["log"]
    saved = tmp_path / "two" / "checkpoints" / "step-00000003"

    # the directory a two-process job leaves when it dies after publishing step 3
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    shutil.copytree(saved, job / "checkpoints" / saved.name)
    (job / "checkpoints" / "latest").write_text(saved.name + "\n")
    restarted = fault_injection.one_process_from("auto", job, STEPS, EVERY)
    log = restarted["log"]
    assert restarted["returncode"] == 0, log[-3000:]
    assert "resumed from" in log and "(step 3)" in log
    assert "resharded step-00000003, saved by 2 process(es) under dp=2" in log and "onto 1 under dp=1" in log, log
    assert "for steps 4-6 on 1 process(es), cpu: dp=1 " in log  # the plan searched for the new world size

    alone = fault_injection.one_process_from(saved, tmp_path / "alone", STEPS, EVERY)
    assert alone["returncode"] == 0, alone["log"][-3000:]

    two = fault_injection.losses(tmp_path / "two" / "metrics.jsonl")
    continued = fault_injection.losses(job / "metrics.jsonl")
    reference = fault_injection.losses(tmp_path / "alone" / "metrics.jsonl")
    after = [4, 5, 6]
    assert [continued[s] for s in after] == [reference[s] for s in after]
    assert [continued[s] for s in after] == pytest.approx([two[s] for s in after], rel=1e-5, abs=0)
    shifted = [two[s + 1] for s in after[:-1]]  # what one batch too far would have given
    assert [continued[s] for s in after[:-1]] != pytest.approx(shifted, rel=1e-3, abs=0)

    final = job / "checkpoints" / "step-00000006"
    expected = fault_injection.final_state(tmp_path / "alone" / "checkpoints", STEPS)
    assert "model.layers.0.mlp.fc1.weight" in expected and "optim.layers.0.mlp.fc1.weight.exp_avg_sq" in expected
    assert fault_injection.differences(expected, fault_injection.final_state(job / "checkpoints", STEPS)) == []
    assert _data_position(final) == _data_position(tmp_path / "two" / "checkpoints" / "step-00000006")


@pytest.mark.slow
def test_a_lost_agent_under_nnodes_1_2_replans_on_the_survivor_and_continues_exactly(tmp_path):
    """Two torchrun agents on this machine (`--nnodes 1:2`, one process each); agent B and its worker
    are SIGKILLed after step 3; agent A re-forms the job alone and continues from step 2's checkpoint."""
    steps, every = 6, 2
    straight = fault_injection.two_processes(tmp_path / "two", steps, every)
    assert straight["returncode"] == 0, straight["log"][-3000:]
    outcome = fault_injection.run_elastic_job(tmp_path / "elastic", steps=steps, checkpoint_every=every,
                                              lose_after_step=3)
    log = outcome["log"]
    assert outcome["returncode"] == 0, log[-3000:]
    assert outcome["lost_after_step"] is not None and outcome["lost_after_step"] >= 3
    assert re.search(r"^training \S+ .* on 2 process\(es\), cpu: dp=2 ", log, re.MULTILINE), log[-3000:]
    assert outcome["replanned"], log[-3000:]  # the survivor's round trained on 1 process under dp=1
    assert outcome["resumed_step"] is not None and outcome["resumed_step"] >= 2
    exact, verdict = fault_injection.elastic_verdict(tmp_path / "elastic", outcome, steps, every,
                                                     fault_injection.losses(tmp_path / "two" / "metrics.jsonl"))
    assert exact, verdict
    drift = float(verdict.rsplit("max relative ", 1)[1])
    assert drift < 1e-5, verdict

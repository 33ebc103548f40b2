"""`autopar run --model pkg.mod:factory`: a user's model trained on one process and under torchrun, its
logged losses equal to a plain PyTorch loop on the same batches and initial weights, and one line for
each factory `autopar run` cannot train.

Tolerance: losses to rel 1e-5 (fp32 on CPU; the parallel runs differ from the plain loop only in the
order of floating-point sums: gradient clipping's norm, tp partial sums, pipeline micro-batches).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.cli import main
from test_run_cli import _one_line_error, _records

TESTS = Path(__file__).parent
ROOT = TESTS.parent
REGRESSOR = ["--model", "tiny_factories:regressor", "--cluster", "local", "--global-batch", "8"]
COMMON = ["--lr", "3e-3", "--seed", "3", "--log-every", "1"]
STEPS = 4


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def reference_losses(model_name: str, batches: list[torch.Tensor], lr: float = 3e-3, seed: int = 3,
                     config: str | None = None) -> list[float]:
    """A plain PyTorch loop: the factory's model with autopar's seeded initial weights (the same for
    every plan), AdamW, the global gradient norm clipped at 1 (`autopar run`'s default)."""
    from autopar.models import build_model
    from autopar.runtime.init import InitSource, materialize

    spec = build_model(model_name, config)
    model = copy.deepcopy(spec.module)
    materialize(model, InitSource(spec.module, seed), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        loss = spec.loss_fn(model(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _regressor_batches(steps: int = STEPS) -> list[torch.Tensor]:
    """What `--data synthetic` draws for float inputs: N(0, 1) global batches from the seed's generator."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(8, 16, generator=generator) for _ in range(steps)]


def _hook_batches(steps: int = STEPS) -> list[torch.Tensor]:
    from tiny_factories import regressor_with_batches

    model = regressor_with_batches()
    return [model.batches(8, step) for step in range(1, steps + 1)]


@pytest.mark.parametrize("factory, batches, data", [
    ("tiny_factories:regressor", _regressor_batches, "synthetic"),
    ("tiny_factories:regressor_with_batches", _hook_batches, "tiny_factories:regressor_with_batches.batches"),
])
def test_one_process_trains_a_factory_model_like_a_plain_loop(tmp_path, capsys, factory, batches, data):
    metrics = tmp_path / "m.jsonl"
    code = main(["run", "--model", factory, *REGRESSOR[2:], *COMMON, "--steps", str(STEPS), "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "global batch 8 of float32[16]" in out
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["data"] for r in records} == {data}
    expected = reference_losses(factory, batches())
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)
    other_init = reference_losses(factory, batches(), seed=4)  # the check can fail: other weights, other losses
    assert max(abs(a - b) for a, b in zip(expected, other_init)) > 1e-3


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([*torchrun, "-m", "autopar", "run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_torchrun_pipeline_parallel_factory_model_matches_one_process(tmp_path):
    """A plain-torch model with float inputs, its pp=2 plan searched by each rank through autopar.plan."""
    metrics = tmp_path / "m.jsonl"
    done = _torchrun([*REGRESSOR, *COMMON, "--steps", str(STEPS), "--strategy", "pp=2", "--metrics", str(metrics)],
                     tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pp=2" in done.stdout and "2 process(es)" in done.stdout
    losses = [r["loss"] for r in _records(metrics)]
    assert losses == pytest.approx(reference_losses("tiny_factories:regressor", _regressor_batches()), rel=1e-5)


@pytest.mark.slow  # ~60 s: the tp=2 search dry-runs DTensor placements, then a torchrun launch
def test_torchrun_tensor_parallel_hf_gpt2_factory_matches_one_process(tmp_path):
    """The README's example factory (a Hugging Face GPT-2 from a config) under a tp=2 plan that shards
    its weights (DTensor through HF's forward), given with --plan. Wide enough (hidden 256) that
    sharding pays on the planning cluster: at the factory's default hidden 32 no sharding the search
    prices beats replicating every weight (its tp=2 step: 1.08 ms), so it keeps them all replicated."""
    import autopar
    from autopar.models import build_model
    from autopar.cli.run_data import SyntheticTokens
    from autopar.cli.run_plan import planning_cluster

    name, config = "examples.hf_gpt2_factory:build", "hidden=256"
    spec = build_model(name, config)
    result = autopar.plan(spec.module, spec.example_inputs(1, 16), cluster=planning_cluster("local", 2),
                          global_batch=8, strategy={"tp": 2}, loss_fn=spec.loss_fn, precision="fp32", name=name,
                          seq_len=16)
    plan = tmp_path / "plan.json"
    result.write(plan=str(plan))
    placements = json.loads(plan.read_text())["param_placements"].values()
    assert any("S(" in p for p in placements)  # weights really sharded: the parity below is not trivial
    metrics = tmp_path / "m.jsonl"
    done = _torchrun(["--model", name, "--model-config", config, "--plan", str(plan), *COMMON, "--steps", "3",
                      "--metrics", str(metrics)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tp=2" in done.stdout
    stream = SyntheticTokens(96, 8, 16, seed=3)  # what --data synthetic draws for int64 ids of a 96-token vocabulary
    expected = reference_losses(name, [stream.next_batch() for _ in range(3)], config=config)
    assert [r["loss"] for r in _records(metrics)] == pytest.approx(expected, rel=1e-5)


def test_factories_autopar_run_cannot_train_are_one_line_each(capsys, tmp_path):
    from autopar.runtime.data.prepare import prepare_tokens

    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    prepare_tokens([str(text)], str(tmp_path / "ds"))
    metrics = tmp_path / "m.jsonl"
    common = ["--cluster", "local", "--global-batch", "4", "--steps", "2", "--metrics", str(metrics)]
    cases = [
        ("tiny_factories:mlp", [], ["without a loss", "loss(output, inputs)"]),
        ("tiny_factories:no_example_inputs", [], ["cannot tell what inputs", "example_inputs"]),
        ("tiny_factories:complex_input", [], ["cannot draw", "complex64", "make_batch"]),
        ("tiny_factories:ids_without_range", [], ["states no range", "vocab_size"]),
        ("tiny_factories:two_inputs", [], ["2 inputs", "one tensor"]),
        ("tiny_factories:regressor_with_batches", ["--model-config", "wrong_shape=true"],
         ["batch hook returned float32[4, 17]", "float32[4, 16]"]),
        ("tiny_factories:regressor", ["--data", str(tmp_path / "ds")], ["token ids", "float32[16]"]),
    ]
    for factory, extra, words in cases:
        _one_line_error(capsys, ["run", "--model", factory, *common, *extra], *words)
        assert not metrics.exists(), factory

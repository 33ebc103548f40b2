"""The probes' answers kept on disk (`autopar.probe_cache`): a second plan of one model runs neither
the pipeline capture nor the tp dry run, and plans what the first plan did."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.models import build_model
from autopar.probe_cache import ProbeCache, model_key

TINY = "layers=2,hidden=32,heads=4,vocab=96,seq_len=16"


@pytest.fixture
def probe_runs(monkeypatch):
    """How many pipeline captures and tp dry runs ran (the probes' costly parts)."""
    import autopar.runtime.pipeline.schedule as schedule
    import autopar.runtime.tensor_parallel.realization as realization

    runs = {"pipeline": 0, "dry_run": 0}

    def counted(name, function):
        def run(*args, **kwargs):
            runs[name] += 1
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(schedule, "capture_program", counted("pipeline", schedule.capture_program))
    monkeypatch.setattr(realization, "dry_run", counted("dry_run", realization.dry_run))
    return runs


def _plan(model, inputs, loss_fn, cache, **options):
    return autopar.plan(model, inputs, loss_fn=loss_fn, global_batch=8, cluster=autopar.load_cluster("dgx-h100", gpus=4),
                        use_ilp=False, probe_cache=cache, **options)


def _chosen(result) -> dict:
    plan = result.plan.model_dump(mode="json")
    plan["provenance"].pop("created_at")
    return plan


def test_a_second_plan_reads_the_probes_answers(tmp_path, probe_runs):
    spec = build_model("gpt", TINY)
    cache = ProbeCache(tmp_path)
    first = _plan(spec.module, spec.example_inputs(1), spec.loss_fn, cache)
    assert (cache.runs, cache.hits) == (2, 0)  # the pipeline capture and the tp=2 probe of the module rules
    assert probe_runs["pipeline"] == 1 and probe_runs["dry_run"] >= 1
    captured = dict(probe_runs)

    again = build_model("gpt", TINY)  # a new object of the same model: the key is the model's, not the object's
    second = _plan(again.module, again.example_inputs(1), again.loss_fn, cache)
    assert (cache.runs, cache.hits) == (2, 2)
    assert probe_runs == captured  # neither probe ran again
    assert second.capabilities.pipeline_refusal == first.capabilities.pipeline_refusal is None
    assert second.capabilities.tp_realization is None  # the static module rules, as the probe decided
    assert _chosen(second) == _chosen(first)
    assert [e.strategy for e in second.runners_up] == [e.strategy for e in first.runners_up]

    for entry in tmp_path.glob("*.json"):  # a damaged entry is computed again, not trusted
        entry.write_text("{not json")
    _plan(again.module, again.example_inputs(1), again.loss_fn, cache)
    assert (cache.runs, cache.hits) == (4, 2) and probe_runs["pipeline"] == 2


class CalledTwice(torch.nn.Module):
    """Its first block runs twice, so no pipeline stage can own it: the cut is refused (the capture
    sees the second call's value come out of a block that does not return it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.blocks[0](x)


def _mean_square(output, inputs):
    return output.pow(2).mean()


def test_a_remembered_refusal_is_the_refusal(tmp_path, probe_runs):
    cache = ProbeCache(tmp_path)
    inputs = (torch.zeros(1, 8),)
    first = _plan(CalledTwice(), inputs, _mean_square, cache)
    refusal = first.capabilities.pipeline_refusal
    assert refusal and "'blocks.0'" in refusal
    second = _plan(CalledTwice(), inputs, _mean_square, cache)
    assert probe_runs["pipeline"] == 1 and cache.hits >= 1
    assert second.capabilities.pipeline_refusal == refusal
    assert all(c.strategy.pp == 1 for c in second.search.ranked)
    stored = [json.loads(p.read_text()) for p in tmp_path.glob("pipeline-*.json")]
    assert [entry["answer"]["refusal"] for entry in stored] == [refusal]


def test_the_key_follows_what_the_probes_read():
    spec = build_model("gpt", TINY)
    inputs = spec.example_inputs(1)
    key = model_key(spec.module, inputs, spec.loss_fn)
    assert key is not None and key == model_key(build_model("gpt", TINY).module, inputs, spec.loss_fn)
    assert model_key(spec.module, spec.example_inputs(1, 8), spec.loss_fn) != key  # another input shape
    assert model_key(spec.module, inputs, _mean_square) != key  # another loss
    assert model_key(build_model("gpt", TINY + ",dropout=0.1").module, inputs, spec.loss_fn) != key  # a setting
    spec.module.eval()
    assert model_key(spec.module, inputs, spec.loss_fn) != key  # training mode
    spec.module.train()
    spec.module.layers["0"].register_forward_hook(lambda *args: None)
    assert model_key(spec.module, inputs, spec.loss_fn) != key  # a hook
    assert model_key(spec.module, inputs, lambda out, x: out.float().mean()) is not None
    assert model_key(spec.module, inputs, torch.mean) is None  # a loss whose source cannot be read: not cached

"""`autopar run` on a GPU without --compile/--no-compile searches its plan eager and compiled and keeps
the one predicted faster (`run_plan.chosen_compile`); planned here on CPU for GPU clusters."""

from __future__ import annotations

import pytest
import torch

from autopar.cli.run_plan import _searched_plan, chosen_compile
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.models import build_model

SMALL = "layers=2,hidden=256,heads=4,vocab=512,seq_len=128"


def _gpt():
    spec = build_model("gpt", SMALL)
    (example,) = spec.example_inputs(1, 128)
    return spec, example


def test_the_plan_predicted_faster_is_kept_and_said():
    spec, example = _gpt()
    cluster = load_cluster("dgx-h100", gpus=1)
    said = []
    chosen = chosen_compile(spec, example, cluster, {}, 8, 128, "bf16", said.append)
    times = {compiled: _searched_plan(spec, example, cluster, {"compile": compiled}, 8, 128, "bf16",
                                      lambda _: None).predicted.step_time_s for compiled in (False, True)}
    assert times[True] != times[False]
    assert chosen.strategy.compile == (times[True] < times[False])
    assert chosen.predicted.step_time_s == min(times.values())
    assert said[-1] == (f"compile {'on' if chosen.strategy.compile else 'off'}: predicted {times[True] * 1e3:.4g} ms "
                        f"a step compiled, {times[False] * 1e3:.4g} ms eager (--compile/--no-compile decide instead)")


def test_a_layout_that_runs_only_eager_is_kept_eager(monkeypatch):
    """Hugging Face GPT-2's tp runs through DTensor, which the runtime does not compile: asked for tp=2,
    only the eager search finds a plan, and that is the one kept. The runtime's probes of the model
    ran once: the second search read the first's answers."""
    import autopar.probe_cache
    from test_hf_parity import SEQ, hf_loss, hf_model

    caches = []
    made = autopar.probe_cache.ProbeCache.__init__
    monkeypatch.setattr(autopar.probe_cache.ProbeCache, "__init__",
                        lambda self, folder: (made(self, folder), caches.append(self))[0])
    model = hf_model("gpt2")
    spec = type("Spec", (), dict(module=model, loss_fn=staticmethod(hf_loss), name="hf-gpt2"))()
    example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    said = []
    chosen = chosen_compile(spec, example, load_cluster("dgx-h100", gpus=2), {"tp": 2}, 8, SEQ, "bf16", said.append)
    assert chosen.strategy.tp == 2 and not chosen.strategy.compile and chosen.tp_realization == "dtensor"
    assert said[-1].startswith("compile off: the compiled search found no plan (") and "DTensor" in said[-1]
    assert len(caches) == 1 and caches[0].runs >= 1 and caches[0].hits >= 1


def test_when_neither_fits_the_eager_refusal_stands():
    spec, example = _gpt()
    with pytest.raises(AutoparError) as eager:
        _searched_plan(spec, example, load_cluster("dgx-h100", gpus=1), {"microbatch": 3}, 8, 128, "bf16",
                       lambda _: None)
    with pytest.raises(AutoparError) as chosen:
        chosen_compile(spec, example, load_cluster("dgx-h100", gpus=1), {"microbatch": 3}, 8, 128, "bf16",
                       lambda _: None)
    assert str(chosen.value) == str(eager.value)


def test_the_flag_parses_three_ways():
    import argparse

    from autopar.cli.run_config import add_run_arguments, run_config

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    values = [run_config(parser.parse_args(["--model", "gpt", "--steps", "1", *flag])).compile
              for flag in ([], ["--compile"], ["--no-compile"])]
    assert values == [None, True, False]


def test_a_compile_flag_that_contradicts_the_strategy_or_the_plan_is_refused_first(capsys, tmp_path, monkeypatch):
    """One line, exit 2, before any search or process group: --no-compile against --strategy
    compile=true, and against a plan priced compiled."""
    from autopar.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = ["--model", "gpt", "--model-config", "layers=2,hidden=32,heads=4,vocab=64,seq_len=16"]
    plan = tmp_path / "compiled.json"
    assert main(["plan", *model, "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "4",
                 "--strategy", "compile=true", "--save-plan", str(plan)]) == 0
    capsys.readouterr()
    for argv, words in (
            ([*model, "--cluster", "local", "--global-batch", "4", "--steps", "1", "--strategy", "compile=true",
              "--no-compile"], "--no-compile disagrees with --strategy compile=true: drop one"),
            ([*model, "--plan", str(plan), "--steps", "1", "--no-compile"],
             f"plan {plan} was priced compiled")):
        assert main(["run", *argv]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("autopar: error: ") and words in lines[0], lines

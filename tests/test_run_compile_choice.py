"""`autopar run` on a GPU without --compile/--no-compile searches its plan eager and compiled and keeps
the one predicted faster (`autopar.plan(..., choose_compile=True)`, `searcher.compile_choice`);
planned here on CPU for GPU clusters."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cli.run_plan import searched_plan
from autopar.cluster import load_cluster
from autopar.errors import AutoparError
from autopar.models import build_model

SMALL = "layers=2,hidden=256,heads=4,vocab=512,seq_len=128"


def _gpt():
    spec = build_model("gpt", SMALL)
    (example,) = spec.example_inputs(1, 128)
    return spec, example


def _plan(spec, example, cluster, strategy, **options):
    return autopar.plan(spec.module, (example,), cluster=cluster, global_batch=8, strategy=strategy,
                        loss_fn=spec.loss_fn, precision="bf16", name=spec.name, seq_len=128, **options)


def test_the_plan_predicted_faster_is_kept_from_one_trace_and_said(monkeypatch):
    import autopar.api

    spec, example = _gpt()
    cluster = load_cluster("dgx-h100", gpus=1)
    times = {compiled: _plan(spec, example, cluster, {"compile": compiled}).plan.predicted.step_time_s
             for compiled in (False, True)}
    captures = []
    capture = autopar.api._capture
    monkeypatch.setattr(autopar.api, "_capture", lambda *a, **k: (captures.append(1), capture(*a, **k))[1])
    result = _plan(spec, example, cluster, {}, choose_compile=True)
    assert len(captures) == 1  # both ways searched over one trace
    assert times[True] != times[False]
    chosen = result.plan
    assert chosen.strategy.compile == (times[True] < times[False])
    assert chosen.predicted.step_time_s == min(times.values())
    choice = result.compile_choice
    assert (choice.compiled, choice.eager_step_time_s, choice.compiled_step_time_s) == \
        (chosen.strategy.compile, times[False], times[True])
    other = result.why_not[0]  # the way not taken, priced against the chosen plan
    assert other.label == ("eager (compile=false)" if choice.compiled else "compiled (compile=true)")
    assert other.strategy.compile != chosen.strategy.compile and other.slowdown >= 1.0
    said = []
    searched_plan(spec, example, cluster, {}, 8, 128, "bf16", said.append, choose_compile=True)
    assert said[-1] == (f"compile {'on' if chosen.strategy.compile else 'off'}: predicted {times[True] * 1e3:.4g} ms "
                        f"a step compiled, {times[False] * 1e3:.4g} ms eager (--compile/--no-compile decide instead)")


def test_a_fixed_compile_key_is_not_chosen_over():
    spec, example = _gpt()
    result = _plan(spec, example, load_cluster("dgx-h100", gpus=1), {"compile": False}, choose_compile=True)
    assert result.compile_choice is None and not result.plan.strategy.compile


def test_a_layout_that_runs_only_eager_is_kept_eager():
    """Hugging Face GPT-2's tp runs through DTensor, which the runtime does not compile: asked for tp=2,
    only the eager search finds a plan, and that is the one kept, with the compiled search's reason.
    (Which realization the eager plan takes is the search's affair: its layout at this tiny size keeps
    every weight replicated, which the module rules run since the fifteenth session.)"""
    from test_hf_parity import SEQ, hf_loss, hf_model

    model = hf_model("gpt2")
    example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    result = autopar.plan(model, (example,), cluster=load_cluster("dgx-h100", gpus=2), global_batch=8,
                          strategy={"tp": 2}, loss_fn=hf_loss, precision="bf16", seq_len=SEQ, choose_compile=True)
    assert result.plan.strategy.tp == 2 and not result.plan.strategy.compile
    choice = result.compile_choice
    assert not choice.compiled and choice.compiled_step_time_s is None and "DTensor" in choice.refusal
    assert choice.line().startswith("compile off: the compiled search found no plan (")


def test_when_neither_fits_the_eager_refusal_stands():
    """A fixed micro-batch that fits neither way: both searches run, and the refusal (exit 3) is the eager
    search's; the report says what each way found."""
    spec, example = _gpt()
    cluster = load_cluster("dgx-h100", gpus=1)
    huge = {"microbatch": 65536, "recompute": "none"}
    with pytest.raises(AutoparError) as eager:
        searched_plan(spec, example, cluster, huge, 65536, 128, "bf16", lambda _: None)
    said = []
    with pytest.raises(AutoparError) as chosen:
        searched_plan(spec, example, cluster, huge, 65536, 128, "bf16", said.append, choose_compile=True)
    assert str(chosen.value) == str(eager.value) and chosen.value.exit_code == eager.value.exit_code == 3
    assert "searching the compiled plan" in said  # the compiled way was searched too
    result = autopar.plan(spec.module, (example,), cluster=cluster, global_batch=65536, strategy=huge,
                          loss_fn=spec.loss_fn, precision="bf16", seq_len=128, choose_compile=True)
    choice = result.compile_choice
    assert not result.fits and choice.eager_step_time_s is None and choice.compiled_step_time_s is None
    assert choice.line().startswith("neither the eager nor the compiled search found a plan (compiled: the closest needs")
    assert result.why_not[0].label == "compiled (compile=true)" and result.why_not[0].fits is False


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


def _result(step_time_s=None, closest_gib=None):
    """A search's result holding only what the choice reads: the best plan's step time, or the closest one."""
    from types import SimpleNamespace

    from autopar.searcher.search import SearchResult

    evaluation = SimpleNamespace(step_time_s=step_time_s, peak_memory_bytes=(closest_gib or 0) * 2**30,
                                 capacity_bytes=80 * 2**30, strategy=None)
    candidate = SimpleNamespace(evaluation=evaluation)
    return SearchResult(best=candidate if step_time_s is not None else None, ranked=[candidate], why_not=[],
                        candidates=1, rejected={}, search_s=0.0)


def test_a_bug_met_only_compiled_leaves_the_eager_plan():
    from autopar.searcher.compile_choice import search_choosing_compile

    def search(fixed):
        if fixed.get("compile"):
            raise RuntimeError("inductor fell over\nsecond line")
        return _result(0.5)

    kept = search_choosing_compile(search, {})
    assert kept.best.evaluation.step_time_s == 0.5
    assert kept.compile_choice.refusal == "RuntimeError: inductor fell over" and not kept.compile_choice.compiled


def test_compiled_is_kept_when_only_it_fits():
    from autopar.searcher.compile_choice import search_choosing_compile

    kept = search_choosing_compile(lambda fixed: _result(0.4) if fixed.get("compile") else _result(closest_gib=90), {})
    choice = kept.compile_choice
    assert kept.best.evaluation.step_time_s == 0.4 and choice.compiled and choice.eager_step_time_s is None
    assert choice.line() == ("compile on: the eager search found no plan (the closest needs 90.0 GiB per GPU of "
                             "80.0 GiB usable)")
    row = kept.why_not[0]  # the way not taken, with why
    assert row.label == "eager (compile=false)" and row.fits is False and row.reason.startswith("found no plan: ")
    assert kept.candidates == 2  # both searches counted


def test_autopar_plan_chooses_compile_when_asked(capsys, tmp_path):
    """`autopar plan --choose-compile` prints the choice, its --strategy line reproduces the plan kept, and
    the JSON report and the HTML report's labels carry it."""
    import json

    from autopar.cli import main

    spec, example = _gpt()
    result = _plan(spec, example, load_cluster("dgx-h100", gpus=1), {}, choose_compile=True)
    argv = ["plan", "--model", "gpt", "--model-config", SMALL, "--cluster", "dgx-h100", "--gpus", "1",
            "--global-batch", "8", "--seq-len", "128", "--choose-compile", "--json", str(tmp_path / "r.json"),
            "--report", str(tmp_path / "r.html")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    line = result.compile_choice.line()
    assert line in err.splitlines() and out.rstrip().endswith(f"eager and compiled; {line}")
    flag = next(text for text in out.splitlines() if text.startswith("--strategy"))
    assert ("compile=true" in flag) == result.plan.strategy.compile
    recorded = json.loads((tmp_path / "r.json").read_text())["search"]["compile_choice"]
    assert recorded["compiled"] == result.compile_choice.compiled and recorded["line"] == line
    assert recorded["eager_step_time_s"] == result.compile_choice.eager_step_time_s
    assert "compile=true" in (tmp_path / "r.html").read_text()  # the compiled way's label: the plan's or its row's

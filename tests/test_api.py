"""The public API: the README's example runs as written, and `autopar.plan` is the path every caller takes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import autopar

ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "the README's Python API section has no python block"
    return match.group(1)


def test_readme_python_example_runs_verbatim(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), "README.md", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "predicted" in out and "why not" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["strategy"]["recompute"] == "none"
    assert (tmp_path / "plan.html").read_text().startswith("<!DOCTYPE html>")
    assert "traceEvents" in json.loads((tmp_path / "plan.trace.json").read_text())


@pytest.fixture(scope="module")
def unfit():
    """gpt3-13b on one H100 without offload: nothing fits whatever else the strategy (offloaded, it
    fits: tests/test_offload.py)."""
    from autopar.models import build_model

    spec = build_model("gpt3-13b")
    return autopar.plan(spec.module, spec.example_inputs(1, 256), loss_fn=spec.loss_fn, seq_len=256,
                        cluster=autopar.load_cluster("dgx-h100", gpus=1), global_batch=2, name="gpt3-13b",
                        strategy={"offload": "none"})


def test_no_fit_advice_never_suggests_what_is_already_set(unfit):
    assert unfit.plan is None and not unfit.fits
    free = unfit.no_fit_reason()
    assert free.startswith("no plan fits in") and "add GPUs (≥ 3 for the model states alone)" in free
    assert "zero stage" not in free and "recompute" not in free  # the searcher already tried them
    assert "leave offload free" in free  # the one key fixed
    at_zero3 = dataclasses.replace(unfit, fixed={"zero": 3, "recompute": "selective", "microbatch": 2}).no_fit_reason()
    assert "zero stage" not in at_zero3
    assert "let recompute be chosen" in at_zero3 and "a micro-batch below 2" in at_zero3
    at_zero1 = dataclasses.replace(unfit, fixed={"zero": 1, "recompute": "full"}).no_fit_reason()
    assert "a zero stage above 1" in at_zero1 and "recompute" not in at_zero1.split("):", 1)[1]


def test_when_nothing_fits_the_plan_shown_is_the_closest_to_fitting(unfit):
    """The plan shown and the "closest" the reason names are the least memory of those refined (the
    fastest that does not fit needed more: the reason named its memory as the closest's)."""
    peaks = [c.evaluation.peak_memory_bytes for c in unfit.search.ranked]
    assert unfit.prediction.peak_memory_bytes == min(peaks) and peaks == sorted(peaks)
    assert f"the closest needs {min(peaks) / 2**30:.1f} GiB" in unfit.no_fit_reason()


def test_no_plan_is_written_when_none_fits(unfit, tmp_path):
    with pytest.raises(autopar.AutoparError, match="no plan fits"):
        unfit.write(plan=tmp_path / "plan.json", json_path=tmp_path / "summary.json")
    assert list(tmp_path.iterdir()) == []


def test_write_is_all_or_none(tmp_path):
    """One unwritable output and no file is written at all."""
    from autopar.models import build_model

    spec = build_model("gpt", "layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, global_batch=4,
                          cluster=autopar.load_cluster("dgx-h100", gpus=2), use_ilp=False)
    (tmp_path / "taken").mkdir()
    with pytest.raises(autopar.AutoparError, match="is a directory"):
        result.write(plan=tmp_path / "plan.json", report=tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    result.write(plan=tmp_path / "plan.json", json_path=tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text())["plan"] == json.loads((tmp_path / "plan.json").read_text())


def test_parallelize_trains_fp16_with_a_loss_scale(one_process_group):
    """fp16 trains under a dynamic loss scale (`runtime.loss_scaling`, tests/test_loss_scaling.py); bf16
    needs none."""
    from autopar.models import build_model

    spec = build_model("gpt", "layers=2,hidden=32,heads=4,vocab=96,seq_len=16")
    result = autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, global_batch=4,
                          cluster=autopar.load_cluster("dgx-h100", gpus=1), precision="fp16", use_ilp=False)
    parallel = autopar.parallelize(spec.module, result.plan, loss_fn=spec.loss_fn, precision="fp16")
    assert parallel.loss_scale is not None and parallel.loss_scale.scale == 2.0**16
    assert parallel.optimizations["loss scaling"] == "dynamic, from 65,536 (fp16)"  # `autopar run` prints it
    bf16 = autopar.parallelize(spec.module, result.plan, loss_fn=spec.loss_fn, precision="bf16")
    assert bf16.loss_scale is None


def test_model_hints_read_zoo_and_hugging_face_configs():
    from autopar.models import build_model

    spec = build_model("llama", "layers=2,hidden=64,heads=8,kv_heads=2,vocab=100,seq_len=16")
    # the head's width: the zoo pads 100 to a multiple of 128 (the cost model prices the padded GEMM)
    assert autopar.model_hints(spec.module) == {"heads": 8, "kv_heads": 2, "vocab": 128}
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=77)
    with __import__("torch").device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert autopar.model_hints(model) == {"heads": 4, "kv_heads": 4, "vocab": 77}


def test_a_model_with_a_data_dependent_training_branch_is_planned_from_its_eval_step():
    """Wav2Vec2's LayerDrop flips a coin per layer in training mode: no training graph, so autopar plans
    module-level dp/ZeRO from the eval-mode step, says so, and offers no tp or pp."""
    import torch

    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, conv_dim=(16, 16), conv_stride=(5, 4),
                                         conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=4, layerdrop=0.5)
    with torch.device("meta"):
        model = transformers.Wav2Vec2ForCTC(config)
    notes = []
    result = autopar.plan(model, torch.zeros(1, 800, device="meta"), loss_fn=lambda out, x: out.logits.float().mean(),
                          precision="fp32", cluster=autopar.load_cluster("dgx-h100", gpus=4), global_batch=8,
                          use_ilp=False, progress=notes.append)
    assert result.plan is not None and model.training  # the model's mode is restored
    assert result.plan.strategy.tp == 1 and result.plan.strategy.pp == 1
    (note,) = result.notes
    assert "cannot trace" in note and "Wav2Vec2Encoder" in note and "eval-mode step" in note
    assert any(message == f"note: {note}" for message in notes)
    with pytest.raises(autopar.AutoparError, match="need the training step's op graph"):
        autopar.plan(model, torch.zeros(1, 800, device="meta"), loss_fn=lambda out, x: out.logits.float().mean(),
                     precision="fp32", cluster=autopar.load_cluster("dgx-h100", gpus=4), global_batch=8,
                     strategy="tp=2", use_ilp=False)


def test_slow_refinements_are_reported_as_progress(monkeypatch):
    """A refined candidate that takes `SLOW_REFINE_S` or more (tp dry runs of a large model) is
    reported, numbered by its place in the search's list, through `autopar.plan`'s progress; quick
    ones are not (the time is the slow candidate's own, not the search's so far)."""
    import time

    from autopar.models import build_model
    from autopar.searcher import search as search_module

    spec = build_model("gpt", "layers=2,hidden=64,heads=4,seq_len=32,vocab=128")
    cluster = autopar.load_cluster("dgx-h100", gpus=2)
    refine, refined = search_module.Refiner.refine, search_module._refined
    slow, searches = [], []

    def second_candidate_slow(refiner, strategies, progress):
        searches.append(len(strategies))
        slow[:] = strategies[1:2]
        return refined(refiner, strategies, progress)

    def refine_slowly(self, strategy):
        if slow and strategy is slow[0]:
            time.sleep(0.3)
        return refine(self, strategy)

    monkeypatch.setattr(search_module, "SLOW_REFINE_S", 0.25)
    monkeypatch.setattr(search_module, "_refined", second_candidate_slow)
    monkeypatch.setattr(search_module.Refiner, "refine", refine_slowly)
    notes: list[str] = []
    autopar.plan(spec.module, spec.example_inputs(1), loss_fn=spec.loss_fn, cluster=cluster, global_batch=4,
                 use_ilp=False, progress=notes.append)
    reported = [note for note in notes if note.startswith("refined ")]
    assert any(count > 2 for count in searches)
    assert reported == [f"refined 2 of {count} candidates in 0 s ..." for count in searches if count >= 2]

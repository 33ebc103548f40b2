"""Plans save, load and diff; stale, foreign or malformed plans fail with one line naming the fix."""

import json

import pytest
from pydantic import ValidationError

from autopar.errors import AutoparError
from autopar.plan_schema import (
    PLAN_SCHEMA_VERSION,
    MeshAxis,
    Plan,
    PredictedMetrics,
    Provenance,
    StagePlan,
    Strategy,
    diff_plans,
    load_plan,
    parse_placements,
    save_plan,
)

FINGERPRINT = "0123456789abcdef"


def make_plan(tp: int = 2, **changes) -> Plan:
    """pp=2 x dp=2 x tp on 4*tp ranks, rank = pp*(2*tp) + dp*tp + tp_index."""
    dp, pp = 2, 2
    per_stage = dp * tp
    fields = dict(
        mesh=[MeshAxis(name="pp", size=pp), MeshAxis(name="dp", size=dp), MeshAxis(name="tp", size=tp)],
        strategy=Strategy(dp=dp, tp=tp, pp=pp, sp=True, zero=1, recompute="selective", microbatch=2,
                          num_microbatches=8, schedule="1f1b"),
        stages=[
            StagePlan(index=0, module_paths=["embed", "layers.0", "layers.1"], device_ids=list(range(per_stage)),
                      mesh_shape={"dp": dp, "tp": tp}),
            StagePlan(index=1, module_paths=["layers.2", "layers.3", "head"],
                      device_ids=list(range(per_stage, 2 * per_stage)), mesh_shape={"dp": dp, "tp": tp}),
        ],
        param_placements={"layers.0.attn.q_proj.weight": "RS(0)", "layers.0.mlp.down.weight": "RS(1)",
                          "embed.weight": "RR"},
        op_placements={"mm_3": "S(0)P"},
        recompute_modules=["layers.0.attn", "layers.2.attn"],
        predicted=PredictedMetrics(step_time_s=1.25, tokens_per_s=26214.4, tflops_per_gpu=310.5, mfu=0.314,
                                   peak_memory_bytes=[60 * 2**30, 52 * 2**30],
                                   breakdown={"compute": 0.9, "exposed_communication": 0.1, "bubble": 0.15,
                                              "recompute": 0.05, "optimizer": 0.05}),
        provenance=Provenance(model_name="gpt3-1.3b", model_fingerprint=FINGERPRINT, cluster_name="dgx-h100",
                              world_size=pp * per_stage),
    )
    fields.update(changes)
    return Plan(**fields)


def _one_line_error(excinfo, *words):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_save_load_round_trip(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    loaded = load_plan(path, expected_fingerprint=FINGERPRINT)
    assert loaded == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(path.read_text())["schema_version"] == PLAN_SCHEMA_VERSION == 1
    assert diff_plans(plan, loaded) == []


def test_diff_finds_a_changed_tp():
    before, after = make_plan(tp=2), make_plan(tp=4)
    lines = diff_plans(before, after)
    assert "strategy.tp: 2 -> 4" in lines
    assert "mesh: pp=2 x dp=2 x tp=2 -> pp=2 x dp=2 x tp=4" in lines
    assert any(line.startswith("stage 1 device_ids:") for line in lines)
    assert "provenance.world_size: 8 -> 16" in lines
    assert not any("strategy.dp" in line for line in lines)


def test_diff_reports_placements_and_recompute():
    before = make_plan()
    after = make_plan(param_placements={**before.param_placements, "embed.weight": "RS(0)", "head.weight": "RR"},
                      recompute_modules=["layers.0.attn"])
    lines = diff_plans(before, after)
    assert "param_placements[embed.weight]: RR -> RS(0)" in lines
    assert "param_placements[head.weight]: (absent) -> RR" in lines
    assert any(line.startswith("recompute_modules:") and "layers.2.attn" in line for line in lines)


def test_atomic_save_keeps_old_plan_when_serialization_fails(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=2), path)
    before = path.read_text()

    def broken(self):
        raise RuntimeError("serializer crashed")

    monkeypatch.setattr(Plan, "to_json", broken)
    with pytest.raises(RuntimeError):
        save_plan(make_plan(tp=4), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_atomic_save_keeps_old_plan_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(make_plan(tp=2), path)
    before = path.read_text()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full_disk)  # fails after the temporary file is written, before the rename
    with pytest.raises(AutoparError) as excinfo:
        save_plan(make_plan(tp=4), path)
    _one_line_error(excinfo, "No space left")
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def _write(tmp_path, data):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_schema_version_mismatch(tmp_path):
    data = json.loads(make_plan().to_json())
    data["schema_version"] = 0
    with pytest.raises(AutoparError) as excinfo:
        load_plan(_write(tmp_path, data))
    _one_line_error(excinfo, "schema version 0", "reads version 1", "re-run `autopar plan`")


def test_fingerprint_mismatch(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    with pytest.raises(AutoparError) as excinfo:
        load_plan(path, expected_fingerprint="fedcba9876543210")
    _one_line_error(excinfo, f"model fingerprint {FINGERPRINT}", "this model is fedcba9876543210",
                    "re-run `autopar plan` for this model")


@pytest.mark.parametrize("text", ["S(0", "S(x)R", "Q", "s(0)R", "S(-1)R", "R R", ""])
def test_malformed_placement_strings(text):
    with pytest.raises(AutoparError) as excinfo:
        parse_placements(text)
    _one_line_error(excinfo, "placement string", "S(<dim>)")


def test_parse_placements():
    assert parse_placements("S(0)R") == [("S", 0), ("R", None)]
    assert parse_placements("RS(12)P") == [("R", None), ("S", 12), ("P", None)]


def test_malformed_placement_in_a_plan_file(tmp_path):
    data = json.loads(make_plan().to_json())
    data["param_placements"]["embed.weight"] = "RS(x)"
    with pytest.raises(AutoparError) as excinfo:
        load_plan(_write(tmp_path, data))
    _one_line_error(excinfo, "param_placements.embed.weight", "malformed placement string 'RS(x)'")


def test_placement_count_must_match_the_mesh(tmp_path):
    data = json.loads(make_plan().to_json())
    data["op_placements"]["mm_3"] = "S(0)RR"
    with pytest.raises(AutoparError) as excinfo:
        load_plan(_write(tmp_path, data))
    _one_line_error(excinfo, "op_placements[mm_3]", "3 placements", "2 axes")


def test_mesh_size_mismatch(tmp_path):
    data = json.loads(make_plan().to_json())
    data["provenance"]["world_size"] = 16
    with pytest.raises(AutoparError) as excinfo:
        load_plan(_write(tmp_path, data))
    _one_line_error(excinfo, "mesh pp=2 x dp=2 x tp=2 holds 8 devices", "world size is 16")


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d["strategy"].update(tp=4), ["mesh axis tp=2", "strategy.tp=4"]),
        (lambda d: d["stages"].pop(), ["stages lists 1", "pp x vp = 2"]),
        (lambda d: d["strategy"].update(zero=4), ["strategy.zero", "less than or equal to 3"]),
        (lambda d: d["strategy"].update(vp=2), ["vp=2", "interleaved"]),
        (lambda d: d["strategy"].update(recompute="some"), ["strategy.recompute"]),
        (lambda d: d["stages"][0].update(device_ids=[0, 1, 2]), ["stage 0 mesh_shape", "holds 4", "lists 3"]),
        (lambda d: d["predicted"].update(peak_memory_bytes=[1]), ["peak_memory_bytes", "pp=2"]),
        (lambda d: d.update(extra=1), ["extra", "unknown field"]),
        (lambda d: d["strategy"].update(recompute_layers=[1, 1]), ["stage 0 recomputes 0", "gives it 1"]),
        (lambda d: d["strategy"].update(recompute_layers=[1]), ["recompute_layers lists 1 stages", "pp x vp = 2"]),
        (lambda d: d["provenance"].pop("model_fingerprint"), ["provenance.model_fingerprint", "missing"]),
    ],
)
def test_invalid_plans_fail_with_one_line(tmp_path, mutate, words):
    data = json.loads(make_plan().to_json())
    mutate(data)
    with pytest.raises(AutoparError) as excinfo:
        load_plan(_write(tmp_path, data))
    _one_line_error(excinfo, "plan.json is invalid", "re-run `autopar plan`", *words)


def test_recompute_layers_round_trip_with_the_modules_they_name(tmp_path):
    strategy = make_plan().strategy.model_copy(update={"recompute_layers": (1, 0)})
    plan = make_plan(strategy=strategy, recompute_modules=["layers.0"])
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert load_plan(path).strategy.recompute_layers == (1, 0)


def test_interleaved_needs_pp_times_vp_stages():
    strategy = Strategy(dp=1, tp=1, pp=2, microbatch=1, num_microbatches=4, schedule="interleaved", vp=2)
    stages = [StagePlan(index=i, module_paths=[f"layers.{i}"], device_ids=[i % 2], mesh_shape={}) for i in range(4)]
    provenance = Provenance(model_name="m", model_fingerprint=FINGERPRINT, cluster_name="local", world_size=2)
    plan = Plan(mesh=[MeshAxis(name="pp", size=2)], strategy=strategy, stages=stages, provenance=provenance)
    assert len(plan.stages) == 4
    with pytest.raises(ValidationError, match="stages lists 4 but pp x vp = 2"):
        Plan(mesh=plan.mesh, strategy=strategy.model_copy(update={"vp": 1}), stages=stages, provenance=provenance)


@pytest.mark.parametrize(
    "content, words",
    [(None, ["not found"]), ("{not json", ["not valid JSON", "line 1"]), ("[1, 2]", ["no schema_version"])],
)
def test_unreadable_plan_files(tmp_path, content, words):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AutoparError) as excinfo:
        load_plan(path)
    _one_line_error(excinfo, "plan.json", *words)

"""The profiler on CPU: signatures and their sharded shapes, the timing harness, the database,
the α-β fit, collectives on gloo, the `profile` command and the validation benchmark's CPU side."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import autopar
import autopar.cli.commands
from autopar.errors import AutoparError
from autopar.graph.ir import TensorMeta
from autopar.models import build_model
from autopar.profiler.cli import add_profile_command
from autopar.profiler.collectives import (
    COLLECTIVES, cost_coefficients, default_sizes, fit_alpha_beta, group_layouts, profile_collectives,
    require_torchrun_env,
)
from autopar.profiler.database import ProfileDB
from autopar.profiler.graph_profile import estimate_step, node_time_s, profile_graph
from autopar.profiler.operators import device_name, profile_signatures, time_op
from autopar.profiler.records import OpTiming
from autopar.profiler.signatures import (
    OpSignature, needs_profile, scale_signature, sharded_variants, signature_of, signatures_to_profile, token_dims,
    tp_dims, unique_signatures,
)

REPO = Path(__file__).resolve().parents[1]
TINY = "hidden=64,heads=4,vocab=96,seq_len=16"
BATCH, SEQ = 2, 16  # tokens per step: 32, distinct from every other dim of the tiny models
CPU = device_name("cpu")


def _trace(family: str = "gpt", layers: int = 2, precision: str = "fp32"):
    spec = build_model(family, f"layers={layers},{TINY}")
    return autopar.trace(spec.module, spec.example_inputs(BATCH, SEQ), loss_fn=spec.loss_fn,
                         precision=precision, seq_len=SEQ)


@pytest.fixture(scope="module")
def gpt_graph():
    return _trace("gpt", 4)


def _t(*shape, dtype="float32"):
    return TensorMeta(shape=shape, dtype=dtype)


def _shapes(sig):
    return [m.shape for m in sig.inputs], [m.shape for m in sig.outputs]


def _frozen_shapes(sig):
    return tuple(m.shape for m in sig.inputs), tuple(m.shape for m in sig.outputs)


# --- signatures ------------------------------------------------------------------------------------
def test_dedupe_far_fewer_signatures_than_nodes_and_flat_in_depth(gpt_graph):
    signatures = unique_signatures(gpt_graph.nodes)
    assert len(signatures) * 5 < len(gpt_graph.nodes)
    assert len(unique_signatures(_trace("gpt", 2).nodes)) == len(signatures)
    assert len(unique_signatures(_trace("gpt", 6).nodes)) == len(signatures)
    assert all(signature_of(n).key for n in gpt_graph.nodes)
    assert not any(s.op.startswith(("aten.view", "aten.t.", "aten.transpose")) for s in signatures)


def test_signature_keys_carry_reconstructed_scalars(gpt_graph):
    keys = {s.packet: s for s in unique_signatures(gpt_graph.nodes)}
    assert keys["native_layer_norm"].scalar_dict()["normalized_shape"] == (64,)
    assert keys["_scaled_dot_product_flash_attention"].scalar_dict()["is_causal"] is True
    assert keys["sum"].scalar_dict() == {"dim": (0,), "keepdim": True}
    assert keys["_log_softmax"].scalar_dict() == {"dim": -1, "half_to_float": False}
    assert keys["slice_backward"].scalar_dict()["input_sizes"] == (BATCH, SEQ, 128)  # vocabulary 96 padded
    assert OpSignature.model_validate_json(keys["sum"].model_dump_json()) == keys["sum"]


def test_sharded_addmm_shapes():
    tokens, k, n = BATCH * SEQ, 64, 256
    forward = OpSignature(op="aten.addmm.default", inputs=(_t(n), _t(tokens, k), _t(k, n)), outputs=(_t(tokens, n),))
    assert tp_dims(forward, batch=BATCH, seq_len=SEQ) == ("K", "N")
    column = scale_signature(forward, batch=BATCH, seq_len=SEQ, tp=2, tp_dim="N")
    assert _shapes(column) == ([(128,), (32, 64), (64, 128)], [(32, 128)])
    row = scale_signature(forward, batch=BATCH, seq_len=SEQ, tp=4, tp_dim="K")
    assert _shapes(row) == ([(256,), (32, 16), (16, 256)], [(32, 256)])
    micro = scale_signature(forward, batch=BATCH, seq_len=SEQ, microbatch=1)
    assert _shapes(micro) == ([(256,), (16, 64), (64, 256)], [(16, 256)])
    both = scale_signature(forward, batch=BATCH, seq_len=SEQ, tp=8, tp_dim="N", microbatch=4)
    assert _shapes(both) == ([(32,), (64, 64), (64, 32)], [(64, 32)])
    assert scale_signature(forward, batch=BATCH, seq_len=SEQ) is forward
    with pytest.raises(ValueError, match="tp_dim"):
        scale_signature(forward, batch=BATCH, seq_len=SEQ, tp=2, tp_dim="M")  # M holds the tokens
    odd = OpSignature(op="aten.mm.default", inputs=(_t(32, 6), _t(6, 10)), outputs=(_t(32, 10),))
    assert scale_signature(odd, batch=BATCH, seq_len=SEQ, tp=4, tp_dim="N") is None  # 10 does not divide
    variants = sharded_variants(forward, batch=BATCH, seq_len=SEQ)
    # (1 + 3 degrees × 2 dims) × (traced batch + micro-batches 1 and 4), less the traced signature itself
    assert len(variants) == 7 * 3 - 1
    assert {(v.tp, v.tp_dim, v.microbatch) for v in variants} >= {(2, "N", None), (8, "K", 1), (1, None, 4)}


def test_weight_gradient_mm_keeps_tokens_in_the_contraction():
    grad_weight = OpSignature(op="aten.mm.default", inputs=(_t(256, 32), _t(32, 64)), outputs=(_t(256, 64),))
    assert tp_dims(grad_weight, batch=BATCH, seq_len=SEQ) == ("M", "N")
    scaled = scale_signature(grad_weight, batch=BATCH, seq_len=SEQ, tp=2, tp_dim="M", microbatch=4)
    assert _shapes(scaled) == ([(128, 64), (64, 64)], [(128, 64)])


def test_ambiguous_token_dim_gets_variants_for_each_reading():
    square = OpSignature(op="aten.mm.default", inputs=(_t(32, 32), _t(32, 64)), outputs=(_t(32, 64),))  # width = tokens
    assert token_dims(square, batch=BATCH, seq_len=SEQ) == ("M", "K")
    as_weight_grad = scale_signature(square, batch=BATCH, seq_len=SEQ, microbatch=1, token_dim="K")
    assert _shapes(as_weight_grad) == ([(32, 16), (16, 64)], [(32, 64)])
    shapes = {_frozen_shapes(v.signature) for v in sharded_variants(square, batch=BATCH, seq_len=SEQ, microbatches=(1,))}
    assert (((16, 32), (32, 64)), ((16, 64),)) in shapes and (((32, 16), (16, 64)), ((32, 64),)) in shapes
    with pytest.raises(ValueError, match="token_dim"):
        scale_signature(square, batch=BATCH, seq_len=SEQ, microbatch=1, token_dim="N")


def test_sharded_bmm_and_attention_shapes():
    bmm = OpSignature(op="aten.bmm.default", inputs=(_t(8, 16, 16), _t(8, 16, 16)), outputs=(_t(8, 16, 16),))
    assert _shapes(scale_signature(bmm, batch=BATCH, seq_len=SEQ, tp=2, microbatch=1))[0] == [(2, 16, 16)] * 2
    q = _t(2, 4, 16, 16, dtype="bfloat16")
    flash = OpSignature(
        op="aten._scaled_dot_product_flash_attention.default", inputs=(q, q, q),
        outputs=(q, _t(2, 4, 16), _t(2, dtype="uint64"), _t(dtype="uint64"), _t(0, dtype="bfloat16")),
        scalars={"is_causal": True},
    )
    scaled = scale_signature(flash, batch=BATCH, seq_len=SEQ, tp=4, microbatch=1)
    ins, outs = _shapes(scaled)
    assert ins == [(1, 1, 16, 16)] * 3 and outs == [(1, 1, 16, 16), (1, 1, 16), (2,), (), (0,)]
    assert scale_signature(flash, batch=BATCH, seq_len=SEQ, tp=8) is None  # 4 heads do not split 8 ways
    gelu = OpSignature(op="aten.gelu.default", inputs=(_t(2, 16, 256),), outputs=(_t(2, 16, 256),))
    assert sharded_variants(gelu, batch=BATCH, seq_len=SEQ) == []
    assert scale_signature(gelu, batch=BATCH, seq_len=SEQ, tp=2) is None


def test_profile_plan_lists_graph_signatures_first(gpt_graph):
    base = unique_signatures(gpt_graph.nodes)
    planned = signatures_to_profile(gpt_graph, tp_degrees=(2, 4), microbatches=(1,))
    assert planned[: len(base)] == base and len(planned) > len(base)
    assert len(set(planned)) == len(planned)


# --- timing harness --------------------------------------------------------------------------------
def test_timing_real_cpu_ops_gives_positive_medians():
    signatures = [
        OpSignature(op="aten.mm.default", inputs=(_t(64, 32), _t(32, 48)), outputs=(_t(64, 48),)),
        OpSignature(op="aten.add.Tensor", inputs=(_t(4, 16, 64), _t(16, 64)), outputs=(_t(4, 16, 64),)),
        OpSignature(op="aten.native_layer_norm.default", inputs=(_t(4, 8), _t(8), _t(8)),
                    outputs=(_t(4, 8), _t(4, 1), _t(4, 1)), scalars={"normalized_shape": (8,), "eps": 1e-5}),
    ]
    lines = []
    results = profile_signatures(signatures, "cpu", warmup=1, repeats=5,
                                 progress=lambda done, total, timing: lines.append((done, total)))
    for result in results:
        assert result.measured and result.time_s > 0 and result.repeats == 5, result
        assert result.mem_alloc_delta_bytes is None  # no memory profile on CPU
    assert lines[-1] == (3, 3)


def test_oversize_shapes_are_skipped_with_a_note_not_allocated():
    huge = OpSignature(op="aten.mm.default", inputs=(_t(2**20, 2**20), _t(2**20, 2**20)), outputs=(_t(2**20, 2**20),))
    result = time_op(huge, "cpu")  # 12 TiB: refused from the estimate, before any allocation
    assert not result.measured and "too large" in result.skipped
    small = OpSignature(op="aten.mm.default", inputs=(_t(64, 64), _t(64, 64)), outputs=(_t(64, 64),))
    assert "too large" in time_op(small, "cpu", memory_limit_bytes=1000).skipped


def test_unsynthesizable_and_unknown_ops_are_skipped_with_a_reason():
    index_select = OpSignature(op="aten.index_select.default", inputs=(_t(8, 4), _t(3, dtype="int64")),
                               outputs=(_t(3, 4),))
    assert "cannot be synthesized" in time_op(index_select, "cpu").skipped
    assert "no such op" in time_op(OpSignature(op="aten.no_such_op.default", inputs=()), "cpu").skipped


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_zoo_step_signature_runs_on_cpu(family):
    graph = _trace(family, 1, precision="bf16")
    signatures = signatures_to_profile(graph, tp_degrees=(2,), microbatches=(1,))
    results = profile_signatures(signatures, "cpu", warmup=0, repeats=1)
    assert [r.skipped for r in results if not r.measured] == []


def test_fused_attention_is_timed_through_sdpa_and_its_backward_alone(monkeypatch):
    """SDPA picks the kernel the runtime runs (cuDNN's on the H200, where the trace names flash);
    the backward's forward runs untimed: a forward slowed by 50 ms leaves the backward's time alone."""
    import time as clock

    import torch

    graph = _trace("gpt", 1, precision="bf16")
    attention = {s.packet: s for s in signatures_to_profile(graph, tp_degrees=(), microbatches=())
                 if "attention" in s.packet}
    assert set(attention) == {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def slow_sdpa(*args, **kwargs):
        calls.append(kwargs["is_causal"])
        clock.sleep(0.05)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", slow_sdpa)
    forward = time_op(attention["_scaled_dot_product_flash_attention"], "cpu", warmup=0, repeats=2)
    backward = time_op(attention["_scaled_dot_product_flash_attention_backward"], "cpu", warmup=0, repeats=2)
    assert forward.measured and backward.measured, (forward, backward)
    assert forward.time_s >= 0.05 > backward.time_s
    assert calls and all(calls)  # causal, as traced; the backward's forwards ran too (untimed)
    assert len(calls) == 2 + 3  # two timed forwards; the backward's gradient shape, then one per repeat


def test_grouped_query_attention_signatures_run_through_sdpa():
    q, kv = _t(2, 4, 16, 8, dtype="bfloat16"), _t(2, 2, 16, 8, dtype="bfloat16")
    forward = OpSignature(op="aten._scaled_dot_product_flash_attention.default", inputs=(q, kv, kv),
                          scalars={"is_causal": True, "dropout_p": 0.0})
    backward = OpSignature(op="aten._scaled_dot_product_flash_attention_backward.default",
                           inputs=(q, q, kv, kv), scalars={"is_causal": True, "dropout_p": 0.0})
    for sig in (forward, backward):
        result = time_op(sig, "cpu", warmup=0, repeats=1)
        assert result.measured, result


# --- database --------------------------------------------------------------------------------------
def _timing(key: str, time_s: float | None = 1e-3, op: str = "aten.mm.default") -> OpTiming:
    return OpTiming(key, op, time_s, 5 if time_s else 0, skipped=None if time_s else "too large for cpu")


def test_database_round_trip_and_device_isolation(tmp_path):
    path = tmp_path / "profile.db"
    sig = OpSignature(op="aten.mm.default", inputs=(_t(4, 4), _t(4, 4)), outputs=(_t(4, 4),))
    with ProfileDB(path) as db:
        db.record_op("NVIDIA H100 80GB HBM3", "bf16", _timing(sig.key, 2e-5))
        db.record_op("NVIDIA H100 80GB HBM3", "bf16", _timing("skipped-one", None))
    with ProfileDB(path, readonly=True) as db:  # reused across runs
        assert db.lookup_time_s("NVIDIA H100 80GB HBM3", "bf16", sig) == pytest.approx(2e-5)
        assert db.lookup_time_s("NVIDIA A100-SXM4-80GB", "bf16", sig) is None  # another GPU kind: never
        assert db.lookup_time_s("NVIDIA H100 80GB HBM3", "fp16", sig) is None
        assert db.lookup_time_s("NVIDIA H100 80GB HBM3", "bf16", sig, torch_version="0.0") is None
        assert db.lookup_time_s("NVIDIA H100 80GB HBM3", "bf16", "skipped-one") is None
        skipped = db.lookup("NVIDIA H100 80GB HBM3", "bf16", "skipped-one", include_skipped=True)
        assert skipped.note == "too large for cpu"
        assert db.devices() == ["NVIDIA H100 80GB HBM3"]
        with pytest.raises(AutoparError, match="read-only"):
            db.record_op("x", "bf16", _timing("k"))


def test_database_merge_prefers_measurements_then_newer_rows(tmp_path):
    with ProfileDB(tmp_path / "a.db") as a, ProfileDB(tmp_path / "b.db") as b:
        a.record_op("gpu", "bf16", _timing("old", 1.0), measured_at=100)
        a.record_op("gpu", "bf16", _timing("measured-here", 1.0), measured_at=100)
        b.record_op("gpu", "bf16", _timing("old", 2.0), measured_at=200)
        b.record_op("gpu", "bf16", _timing("measured-here", None), measured_at=300)
        b.record_op("other-gpu", "bf16", _timing("new", 3.0))
    with ProfileDB(tmp_path / "a.db") as a:
        assert a.merge(tmp_path / "b.db") == 2
        assert a.lookup_time_s("gpu", "bf16", "old") == 2.0
        assert a.lookup_time_s("gpu", "bf16", "measured-here") == 1.0  # a skip never replaces a measurement
        assert a.lookup_time_s("other-gpu", "bf16", "new") == 3.0
        assert a.merge(tmp_path / "b.db") == 0
        a.export_json(tmp_path / "profile.json")
    document = json.loads((tmp_path / "profile.json").read_text())
    assert document["format"] == "autopar-profile" and len(document["op_profiles"]) == 3


@pytest.mark.parametrize("content", [b"this is not a database at all" * 40, "sqlite"])
def test_corrupt_or_foreign_database_is_refused_and_never_overwritten(tmp_path, content):
    path = tmp_path / "profile.db"
    if content == "sqlite":
        foreign = sqlite3.connect(path)
        foreign.execute("CREATE TABLE mine (x INTEGER)")
        foreign.commit()
        foreign.close()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(AutoparError) as caught:
        ProfileDB(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    with ProfileDB(tmp_path / "good.db") as good, pytest.raises(AutoparError):
        good.merge(path)
    assert path.read_bytes() == before


def test_unwritable_database_path_is_one_line(tmp_path):
    with pytest.raises(AutoparError, match="does not exist"):
        ProfileDB(tmp_path / "missing-dir" / "profile.db")
    with pytest.raises(AutoparError, match="no profile database"):
        ProfileDB(tmp_path / "absent.db", readonly=True)
    with pytest.raises(AutoparError, match="directory"):
        ProfileDB(tmp_path)


def test_profile_graph_reuses_and_estimate_adds_up(tmp_path):
    graph = _trace("gpt", 2)
    with ProfileDB(tmp_path / "p.db") as db:
        first = profile_graph(graph, db, "cpu", tp_degrees=(2,), microbatches=(1,), warmup=0, repeats=1)
        assert first.measured == first.total_signatures > first.graph_signatures and not first.skipped
        again = profile_graph(graph, db, "cpu", tp_degrees=(2,), microbatches=(1,), warmup=0, repeats=1)
        assert again.measured == 0 and again.reused == first.total_signatures
        estimate = estimate_step(graph, db, CPU)
        assert estimate.coverage == 1.0 and estimate.time_s > 0
        by_node = sum(db.lookup_time_s(CPU, "fp32", signature_of(n)) for n in graph.nodes if needs_profile(n))
        assert estimate.time_s == pytest.approx(by_node)
        saved = sum(n.saved_bytes for n in graph.nodes if n.phase == "forward")
        assert estimate.activation_source == "graph" and estimate.activation_bytes == saved
        assert estimate_step(graph, db, "NVIDIA H100 80GB HBM3").coverage == 0.0
        fc1 = next(n for n in graph.nodes if n.module_path == "layers.0.mlp.fc1" and n.op == "aten.addmm.default")
        assert node_time_s(db, CPU, graph, fc1) == db.lookup_time_s(CPU, "fp32", signature_of(fc1)) > 0
        sharded = node_time_s(db, CPU, graph, fc1, tp=2, tp_dim="N", microbatch=1)
        assert sharded is not None and sharded > 0  # profiled as a variant
        assert node_time_s(db, CPU, graph, fc1, tp=8, tp_dim="N", microbatch=4) is None  # not profiled
        gelu = next(n for n in graph.nodes if n.op == "aten.gelu.default")
        assert node_time_s(db, CPU, graph, gelu, tp=2) is None  # not matmul-class: no sharded profile
        view = next(n for n in graph.nodes if n.is_view)
        assert node_time_s(db, CPU, graph, view) == 0.0


# --- collectives -----------------------------------------------------------------------------------
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_alpha_beta_fit_recovers_known_values(collective):
    alpha, beta, n = 7e-6, 150e9, 8
    sizes = np.array(default_sizes(2**10, 2**30), dtype=float)
    c_alpha, c_beta = cost_coefficients(collective, n)
    exact = c_alpha * alpha + c_beta * sizes / beta
    fitted_alpha, fitted_beta, error = fit_alpha_beta(collective, n, sizes, exact)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6) and fitted_beta == pytest.approx(beta, rel=1e-6)
    assert error < 1e-9
    noisy = exact * (1 + 0.003 * np.random.default_rng(0).standard_normal(len(sizes)))
    fitted_alpha, fitted_beta, _ = fit_alpha_beta(collective, n, sizes, noisy)
    assert fitted_alpha == pytest.approx(alpha, rel=0.01) and fitted_beta == pytest.approx(beta, rel=0.01)


def test_group_layouts_follow_the_node_layout():
    assert group_layouts(2, 2) == {"intra_node": [[0, 1]]}
    layouts = group_layouts(8, 4)
    assert layouts["intra_node"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layouts["inter_node"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layouts["all"] == [list(range(8))]
    assert set(group_layouts(4, 1)) == {"inter_node"}


def test_collectives_without_torchrun_are_one_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AutoparError, match="torchrun"):
        require_torchrun_env()
    with pytest.raises(AutoparError, match="torchrun"):
        profile_collectives([1024, 4096])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _gloo_worker(rank: int, port: int, db_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from autopar.profiler.collectives import finish, profile_collectives
    from autopar.profiler.database import ProfileDB

    db = ProfileDB(db_path) if rank == 0 else None
    try:
        profile_collectives(default_sizes(2**12, 2**24, 16), warmup=1, repeats=5, backend="gloo", db=db)
    finally:
        finish()


def test_collective_profiler_on_gloo_with_two_processes(tmp_path):
    import torch.multiprocessing as mp

    db_path = tmp_path / "collectives.db"
    mp.spawn(_gloo_worker, args=(_free_port(), str(db_path)), nprocs=2, join=True)
    with ProfileDB(db_path, readonly=True) as db:
        fits = db.collective_fits()
        assert {f.collective for f in fits} == set(COLLECTIVES)
        for fit in fits:
            assert fit.level == "intra_node" and fit.backend == "gloo"
            assert fit.alpha_s > 0 and 0 < fit.beta_bytes_per_s < math.inf, fit
            assert len(fit.sizes_bytes) == len(fit.times_s) == 4
        assert db.lookup_collective(CPU, "all_reduce", "intra_node", group_size=2) is not None
        assert db.lookup_collective("NVIDIA H100 80GB HBM3", "all_reduce", "intra_node") is None


# --- the command -----------------------------------------------------------------------------------
def _run_cli(capsys, *argv):
    """autopar's own main, with `profile` registered when autopar/cli/commands.py does not do it yet."""
    original = autopar.cli.commands.build_parser

    def build():
        parser = original()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "profile" not in commands.choices:
            add_profile_command(commands)
        return parser

    autopar.cli.commands.build_parser = build
    try:
        code = autopar.cli.commands.main(list(argv))
    finally:
        autopar.cli.commands.build_parser = original
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line_error(code, err, *words):
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("tracing", "profiled"))]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    for word in words:
        assert word in lines[0]


def test_profile_command_on_cpu(capsys, tmp_path):
    db_path = tmp_path / "p.db"
    argv = ["profile", "--model", "gpt", "--model-config", f"layers=2,{TINY}", "--seq-len", str(SEQ), "--batch",
            str(BATCH), "--device", "cpu", "--precision", "fp32", "--db", str(db_path), "--tp", "1,2",
            "--microbatches", "1", "--repeats", "2", "--warmup", "0", "--max-ops", "10"]
    code, out, err = _run_cli(capsys, *argv)
    assert code == 0, err
    assert "measured 10" in out and CPU in out
    with ProfileDB(db_path, readonly=True) as db:
        assert len(db.op_records(CPU)) == 10
    code, out, _ = _run_cli(capsys, *argv)
    assert code == 0 and "reused 10" in out


def test_profile_command_bad_inputs(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    db_path = tmp_path / "p.db"
    code, _, err = _run_cli(capsys, "profile", "--model", "gpt", "--device", "cuda", "--db", str(db_path))
    _one_line_error(code, err, "--device cuda", "no usable CUDA GPU")
    assert not db_path.exists()
    db_path.write_bytes(b"garbage" * 100)
    code, _, err = _run_cli(capsys, "profile", "--model", "gpt", "--device", "cpu", "--db", str(db_path))
    _one_line_error(code, err, str(db_path))
    assert db_path.read_bytes() == b"garbage" * 100
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = _run_cli(capsys, "profile", "--collectives", "--db", str(tmp_path / "c.db"))
    _one_line_error(code, err, "torchrun")
    code, _, err = _run_cli(capsys, "profile", "--db", str(tmp_path / "c.db"))
    _one_line_error(code, err, "--model")
    code, _, err = _run_cli(capsys, "profile", "--model", "gpt", "--device", "cpu", "--tp", "2,x", "--db", "p.db")
    _one_line_error(code, err, "--tp")


# --- the GPU validation benchmark, CPU side ---------------------------------------------------------------
def test_validation_benchmark_runs_its_cpu_side(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_validation", REPO / "benchmarks" / "profile_validation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = dict(batch=BATCH, seq_len=SEQ, precision="fp32", device="cpu")
    profiled = bench.profiled_step("gpt", f"layers=2,{TINY}", **shape, db_path=str(tmp_path / "v.db"), warmup=0,
                                   repeats=2)
    measured = bench.measured_step("gpt", f"layers=2,{TINY}", **shape, warmup=1, repeats=2)
    ratios = bench.compare(profiled, measured)
    assert profiled["coverage"] == 1.0 and profiled["step_time_s"] > 0 and measured["step_time_s"] > 0
    assert 0 < ratios["time_ratio"] < math.inf and ratios["activation_ratio"] is None  # no GPU memory on CPU

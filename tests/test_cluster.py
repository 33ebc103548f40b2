"""Cluster presets carry datasheet figures; files and --gpus sizing load or fail with one clear line."""

import json
import sys
import types

import pytest
import yaml

from autopar.cluster import (
    CLUSTER_PRESETS,
    GPU_PRESETS,
    ClusterSpec,
    GpuSpec,
    LinkSpec,
    detect_local_cluster,
    list_presets,
    load_cluster,
    match_gpu,
)
from autopar.errors import AutoparError

GiB = 2**30


def _one_line_error(excinfo, *words):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("name", list(CLUSTER_PRESETS))
def test_every_preset_loads(name):
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.world_size == 8 and cluster.num_nodes == 1
    assert cluster.inter_node is not None and cluster.gpu.source


def test_list_presets_includes_local():
    assert list_presets() == ["dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "local"]


def test_datasheet_figures():
    h100 = load_cluster("dgx-h100")
    assert h100.gpu.peak_flops_per_s("bf16") == 989e12
    assert h100.gpu.peak_flops_per_s("torch.bfloat16") == 989e12
    assert h100.gpu.peak_flops_per_s("fp8") == 1979e12
    assert h100.gpu.peak_flops_per_s("tf32") == 494e12
    assert h100.gpu.hbm_bandwidth_bytes_per_s == 3.35e12
    assert h100.gpu.memory_bytes == 80 * GiB
    assert h100.intra_node.bandwidth_bytes_per_s == 450e9
    assert h100.inter_node.bandwidth_bytes_per_s == 50e9

    a100_80 = load_cluster("dgx-a100-80gb")
    assert a100_80.gpu.hbm_bandwidth_bytes_per_s == 2.039e12
    assert a100_80.gpu.memory_bytes == 85899345920
    assert a100_80.gpu.peak_flops_per_s("fp16") == 312e12
    assert a100_80.gpu.peak_flops_per_s("fp32") == 19.5e12
    assert a100_80.intra_node.bandwidth_bytes_per_s == 300e9
    assert a100_80.inter_node.bandwidth_bytes_per_s == 25e9
    # what NCCL's ring reaches of them (nccl-tests bus bandwidth; sources in autopar/cluster.py)
    assert a100_80.intra_node.effective_bandwidth_bytes_per_s == pytest.approx(210e9)
    assert a100_80.inter_node.effective_bandwidth_bytes_per_s == pytest.approx(24e9)
    assert h100.intra_node.effective_bandwidth_bytes_per_s == pytest.approx(369e9)
    assert h100.inter_node.effective_bandwidth_bytes_per_s == pytest.approx(47e9)  # 46-48 GB/s, nccl-tests #290

    a100_40 = load_cluster("dgx-a100-40gb")
    assert a100_40.gpu.memory_bytes == 42949672960
    assert a100_40.gpu.hbm_bandwidth_bytes_per_s == 1.555e12

    h200 = load_cluster("dgx-h200")
    assert h200.gpu.memory_bytes == 141e9
    assert h200.gpu.hbm_bandwidth_bytes_per_s == 4.8e12
    assert h200.gpu.peak_tflops == h100.gpu.peak_tflops


def test_missing_dtype_names_it_and_the_known_ones():
    with pytest.raises(AutoparError) as excinfo:
        GPU_PRESETS["A100-SXM4-80GB"].peak_flops_per_s("fp8")
    _one_line_error(excinfo, "'fp8'", "bf16", "fp32", "tf32")


@pytest.mark.parametrize("gpus, per_node, nodes", [(8, 8, 1), (64, 8, 8), (4, 4, 1), (1, 1, 1), (1024, 8, 128)])
def test_gpus_sizing(gpus, per_node, nodes):
    cluster = load_cluster("dgx-a100-80gb", gpus=gpus)
    assert (cluster.gpus_per_node, cluster.num_nodes, cluster.world_size) == (per_node, nodes, gpus)


@pytest.mark.parametrize("gpus, words", [(12, ["12", "multiple of 8", "8 or 16"]), (0, ["at least 1"])])
def test_gpus_sizing_errors(gpus, words):
    with pytest.raises(AutoparError) as excinfo:
        load_cluster("dgx-h100", gpus=gpus)
    _one_line_error(excinfo, *words)


@pytest.mark.parametrize("suffix, dump", [(".yaml", yaml.safe_dump), (".json", json.dumps)])
def test_full_spec_file_round_trips(tmp_path, suffix, dump):
    original = ClusterSpec.model_validate({**CLUSTER_PRESETS["dgx-h200"].model_dump(), "name": "mine", "num_nodes": 2})
    path = tmp_path / f"cluster{suffix}"
    path.write_text(dump(original.model_dump()))
    assert load_cluster(str(path)) == original


def test_override_file_on_a_preset(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("preset: dgx-h100\nnum_nodes: 4\n")
    cluster = load_cluster(str(path))
    assert cluster.world_size == 32 and cluster.gpu == GPU_PRESETS["H100-SXM5-80GB"]
    assert load_cluster(str(path), gpus=16).num_nodes == 2  # --gpus wins over the file's node count


def test_override_merges_nested_fields_and_names_gpu_and_links(tmp_path):
    path = tmp_path / "custom.yml"
    path.write_text(
        "preset: dgx-a100-80gb\n"
        "gpu: {memory_bytes: 80e9}\n"  # YAML reads 80e9 as text: still accepted as bytes
        "inter_node: ib-ndr\n"
    )
    cluster = load_cluster(str(path))
    assert cluster.gpu.memory_bytes == 80 * 10**9
    assert cluster.gpu.peak_flops_per_s("bf16") == 312e12
    assert cluster.inter_node.bandwidth_bytes_per_s == 50e9

    path.write_text(
        "name: lab\ngpu: h100-sxm5-80gb\ngpus_per_node: 4\nnum_nodes: 2\nintra_node: nvlink4\ninter_node: ib-hdr\n"
    )
    cluster = load_cluster(str(path))
    assert cluster.gpu.name == "H100-SXM5-80GB" and cluster.world_size == 8

    path.write_text("preset: dgx-h100\nintra_node: {name: measured, bandwidth_bytes_per_s: 3.6e11, latency_s: 3e-6}\n")
    measured = load_cluster(str(path)).intra_node  # a measured bus bandwidth: efficiency 1
    assert measured.effective_bandwidth_bytes_per_s == 3.6e11


@pytest.mark.parametrize(
    "filename, text, words",
    [
        ("c.yaml", "preset: dgx-h100\ngpu: B300\n", ["unknown GPU kind 'B300'", "H100-SXM5-80GB", "c.yaml"]),
        ("c.yaml", "preset: dgx-x\n", ["unknown preset 'dgx-x'", "dgx-h100"]),
        ("c.yaml", "name: x\ngpu: [unclosed\n", ["not valid YAML", "line 3", "c.yaml"]),
        ("c.json", '{"name": "x",\n "gpu": }', ["not valid JSON", "line 2", "c.json"]),
        ("c.yaml", "name: x\ngpu: H100-SXM5-80GB\nnum_nodes: 1\nintra_node: nvlink4\n", ["gpus_per_node", "missing"]),
        ("c.yaml", "preset: dgx-h100\nnum_node: 4\n", ["num_node", "unknown field"]),
        ("c.yaml", "preset: dgx-h100\nnum_nodes: 0\n", ["num_nodes", "greater than 0"]),
        ("c.yaml", "preset: dgx-h100\nnum_nodes: 2\ninter_node: null\n", ["inter_node"]),
        ("c.yaml", "preset: dgx-h100\ngpu: {peak_tflops: {bf_16: 1}}\n", ["gpu.peak_tflops", "unknown dtype 'bf_16'"]),
        ("c.yaml", "- a\n- b\n", ["must be a mapping", "list"]),
        ("c.yaml", "preset: dgx-h100\nintra_node: {name: l, bandwidth_bytes_per_s: 1e9, latency_s: 0, efficiency: 1.5}\n",
         ["efficiency", "less than or equal to 1"]),
        ("c.yaml", "", ["empty file"]),
    ],
)
def test_bad_files_fail_with_one_line(tmp_path, filename, text, words):
    path = tmp_path / filename
    path.write_text(text)
    with pytest.raises(AutoparError) as excinfo:
        load_cluster(str(path))
    _one_line_error(excinfo, *words)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(AutoparError) as excinfo:
        load_cluster("dgx-h1000")
    _one_line_error(excinfo, "unknown cluster preset 'dgx-h1000'", "dgx-h100", "local", "YAML/JSON")


def test_missing_file(tmp_path):
    with pytest.raises(AutoparError) as excinfo:
        load_cluster(str(tmp_path / "nope.yaml"))
    _one_line_error(excinfo, "nope.yaml", "not found")


@pytest.mark.parametrize(
    "device_name, memory_bytes, expected",
    [
        ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "A100-SXM4-40GB"),
        ("NVIDIA A100-SXM4-80GB", 85_198_045_184, "A100-SXM4-80GB"),
        ("NVIDIA H100 80GB HBM3", 85_045_051_392, "H100-SXM5-80GB"),
        ("NVIDIA H200", 150_754_820_096, "H200-SXM-141GB"),
        ("NVIDIA H100 PCIe", 85_045_051_392, None),  # other clocks: its peaks are not the SXM's
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10 * GiB, None),
        ("NVIDIA GH200 480GB", 102 * GiB, None),
        ("NVIDIA GeForce RTX 4090", 24 * GiB, None),
    ],
)
def test_match_gpu(device_name, memory_bytes, expected):
    matched = match_gpu(device_name, memory_bytes)
    assert (matched.name if matched else None) == expected


def _fake_cuda(monkeypatch, names, memory_bytes):
    """Stand-in for torch.cuda on a machine without GPUs: detection only reads these three calls."""
    properties = [types.SimpleNamespace(name=name, total_memory=memory_bytes) for name in names]
    cuda = types.SimpleNamespace(
        is_available=lambda: bool(names),
        device_count=lambda: len(names),
        get_device_properties=lambda index: properties[index],
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


def test_local_matches_gpus_and_keeps_their_real_memory(monkeypatch):
    import autopar.cluster as cluster_module

    _fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 4, 85_045_051_392)
    measured_link = LinkSpec(name="pcie-measured", bandwidth_bytes_per_s=24e9, latency_s=1e-5)
    monkeypatch.setattr(cluster_module, "_measured_host",  # the host's rates, measured on a real GPU only
                        lambda: {"host_link": measured_link, "host_optimizer_params_per_s": 2.5e9})
    cluster = load_cluster("local")
    assert cluster.host_link == measured_link and cluster.host_optimizer_params_per_s == 2.5e9
    assert (cluster.name, cluster.world_size, cluster.gpu.name) == ("local", 4, "H100-SXM5-80GB")
    assert cluster.gpu.memory_bytes == 85_045_051_392
    assert cluster.gpu.peak_flops_per_s("bf16") == 989e12
    assert load_cluster("local", gpus=2).world_size == 2
    with pytest.raises(AutoparError) as excinfo:
        load_cluster("local", gpus=8)
    _one_line_error(excinfo, "no inter_node", "cluster file")


def test_only_local_rank_zero_measures_the_host(monkeypatch):
    """Under torchrun the other local ranks neither touch GPU 0 nor measure (rank 0 plans)."""
    import autopar.cluster as cluster_module

    monkeypatch.setenv("LOCAL_RANK", "3")
    cluster_module._measured_host.cache_clear()
    try:
        assert cluster_module._measured_host() == {}
    finally:
        cluster_module._measured_host.cache_clear()


def test_local_unknown_gpu_asks_for_a_cluster_file(monkeypatch):
    _fake_cuda(monkeypatch, ["NVIDIA GeForce RTX 4090"], 24 * GiB)
    with pytest.raises(AutoparError) as excinfo:
        detect_local_cluster()
    _one_line_error(excinfo, "RTX 4090", "no known peak", "cluster file")


def test_local_without_cuda_is_one_nominal_cpu(monkeypatch):
    _fake_cuda(monkeypatch, [], 0)
    cluster = load_cluster("local")
    assert (cluster.gpu.name, cluster.world_size) == ("cpu", 1)
    assert "nominal" in cluster.gpu.source and cluster.gpu.memory_bytes > 0


def test_gpu_spec_rejects_nonpositive_figures():
    with pytest.raises(ValueError):
        GpuSpec(name="x", peak_tflops={"bf16": 0}, memory_bytes=1, hbm_bandwidth_bytes_per_s=1)

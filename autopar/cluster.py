"""What the planner knows about the hardware: GPUs, links between them, and how many of each.

Clusters are presets (datasheet figures) or YAML/JSON files, either full specs or overrides of a
preset. Peak FLOP/s and bandwidths come from vendor datasheets, the bandwidth NCCL reaches of them
from published nccl-tests runs, link latencies from NCCL's own tuning model; the profiler
replaces them with measured alpha-beta fits.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from autopar.errors import AutoparError
from autopar.validation import condense_validation_error, one_line

GiB = 2**30
KNOWN_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
_DTYPE_ALIASES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def _integral(value: Any) -> Any:
    """Accept 8.0e10 or the string "80e9" (YAML 1.1 reads exponents without a dot as text) as bytes."""
    if isinstance(value, bool):  # YAML's yes/true: not a size
        raise ValueError(f"a byte count must be a number, not {value}")
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Bytes = Annotated[int, BeforeValidator(_integral), Field(gt=0)]


class _Spec(BaseModel):
    """Specs are values: frozen, and a misspelt field in a file is an error, not silently ignored. Every
    number must be finite: YAML reads `.inf` and `.nan` as floats, and an infinite bandwidth or peak
    would be priced as free."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class GpuSpec(_Spec):
    """One accelerator: dense peak throughput per dtype, memory and memory bandwidth."""

    name: str = Field(min_length=1)
    peak_tflops: dict[str, float]
    memory_bytes: Bytes
    hbm_bandwidth_bytes_per_s: float = Field(gt=0)
    # Fractions of the dense peak that real kernels reach: the largest GEMMs (a shape search's
    # best), and a fused attention kernel on the work it does. None: the cost model's fallback.
    matmul_efficiency: float | None = Field(default=None, gt=0, le=1)
    attention_efficiency: float | None = Field(default=None, gt=0, le=1)
    source: str = ""

    @field_validator("peak_tflops")
    @classmethod
    def _known_positive(cls, peaks: dict[str, float]) -> dict[str, float]:
        if not peaks:
            raise ValueError(f"give at least one dtype's dense TFLOP/s, e.g. {{bf16: 989}} (dtypes: {', '.join(KNOWN_DTYPES)})")
        for dtype, tflops in peaks.items():
            if dtype not in KNOWN_DTYPES:
                raise ValueError(f"unknown dtype '{dtype}'; known dtypes: {', '.join(KNOWN_DTYPES)}")
            if not tflops > 0:
                raise ValueError(f"{dtype} peak must be positive, got {tflops}")
        return peaks

    def peak_flops_per_s(self, dtype: str) -> float:
        """Dense peak in FLOP/s; the cost model's MFU denominator."""
        key = _DTYPE_ALIASES.get(dtype.removeprefix("torch."), dtype)
        if key not in self.peak_tflops:
            known = ", ".join(sorted(self.peak_tflops))
            raise AutoparError(
                f"GPU {self.name} has no peak TFLOP/s for dtype '{dtype}' (it has: {known}); "
                f"choose one of those or add it to peak_tflops in a cluster file"
            )
        return self.peak_tflops[key] * 1e12


class LinkSpec(_Spec):
    """A link as one GPU sees it: unidirectional bandwidth per GPU and per-message latency.

    `bandwidth_bytes_per_s` is the line rate (datasheet); `efficiency` the fraction of it NCCL's
    ring collectives reach, their bus bandwidth (the figure nccl-tests prints, defined by the same
    ring formulas `cost_models.communication` uses). A measured link gives its bus bandwidth with
    efficiency 1."""

    name: str = Field(min_length=1)
    bandwidth_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    efficiency: float = Field(default=1.0, gt=0, le=1)
    source: str = ""

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


# The share of each device's usable memory (less the CUDA/NCCL reserve) the planner leaves
# unplanned, on top of the memory model's own allocator margin: the model is not yet validated on
# a GPU, and its target is to be within 5% of measured peak memory (issue #4), so a plan it
# predicts to fill the device can be 5% over. Searched plans sat at 77.5-77.7 of 78.0 GiB before
# this headroom (issue #18); now at most 74.1.
DEFAULT_MEMORY_HEADROOM = 0.05


class ClusterSpec(_Spec):
    """Identical nodes of identical GPUs: what the searcher partitions a model over."""

    name: str = Field(min_length=1)
    gpu: GpuSpec
    gpus_per_node: int = Field(gt=0, strict=True)  # strict: YAML's `true` is not 1
    num_nodes: int = Field(gt=0, strict=True)
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    # Write bandwidth from one node to checkpoint storage. Default: one 400 Gb/s link = 50 GB/s, the
    # DGX H100's storage link speed ("networking and storage @ 400 Gbps" with ConnectX-7, "2X faster"
    # than DGX A100: NVIDIA DGX SuperPOD H100 reference architecture, key components); the A100
    # presets take half. A line rate is an upper bound: what a shared file system sustains per node
    # is lower, so give a measured figure in a cluster file when you have one.
    node_storage_write_bytes_per_s: float = Field(default=50e9, gt=0, allow_inf_nan=False)
    # Fraction of each GPU's usable memory plans leave free (`DEFAULT_MEMORY_HEADROOM`'s reason);
    # a cluster file sets its own, e.g. `memory_headroom: 0.1`, or 0 once memory is validated.
    memory_headroom: float = Field(default=DEFAULT_MEMORY_HEADROOM, ge=0, lt=1)
    # Optimizer-state offload (`offload=optimizer`): each GPU's PCIe link to its host, one direction,
    # and the node's host memory and its bandwidth (what the CPU optimizer step reads and writes).
    # Defaults are the DGX A100's (`HOST_LINK_PRESETS`, `_DGX_HOSTS`); a cluster file may override
    # each, e.g. `host_link: {bandwidth_bytes_per_s: 20e9}` (taken as measured: efficiency 1).
    host_link: LinkSpec = Field(default_factory=lambda: HOST_LINK_PRESETS["pcie4-x16"])
    host_memory_bytes: Bytes = Field(default=2**40)
    host_memory_bandwidth_bytes_per_s: float = Field(default=409.6e9, gt=0)
    # Parameters per second the runtime's CPU AdamW (fused) steps on one node with all its cores,
    # measured (`autopar.host_rates`, which `--cluster local` runs); None: priced from the host
    # memory bandwidth (`cost_models.offload.cpu_adam_time_s`).
    host_optimizer_params_per_s: float | None = Field(default=None, gt=0)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @model_validator(mode="after")
    def _multi_node_needs_a_network(self) -> ClusterSpec:
        if self.num_nodes > 1 and self.inter_node is None:
            raise ValueError(f"{self.num_nodes} nodes need an inter_node link (e.g. inter_node: ib-ndr)")
        return self


# --- GPU presets: dense (no sparsity) tensor-core figures ----------------------------------------
_A100_PEAKS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}  # NVIDIA A100 datasheet (SXM)
# NVIDIA H100 datasheet (SXM5): it lists tensor-core figures with sparsity; dense is half of those.
_H100_PEAKS = {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0}

# Maximum achievable matmul FLOP/s, bf16, found by a shape search (S. Bekman, "Machine Learning
# Engineering", compute/accelerator/README.md, MAMF table): A100 SXM 271.2 of 312 TFLOP/s, H100
# SXM 794.5 of 989. Fused attention on the work it does: FlashAttention-2 reaches 50-73% of the A100's
# peak (Dao 2023, §4.1; we take 0.60) and 35% of the H100's (Shah et al., "FlashAttention-3", 2024, §1).
_A100_KERNELS = {"matmul_efficiency": 0.869, "attention_efficiency": 0.60}
_H100_KERNELS = {"matmul_efficiency": 0.803, "attention_efficiency": 0.35}
_KERNEL_SOURCES = "; matmul ceiling: MAMF table (Bekman, ml-engineering); attention: FlashAttention-2/-3 papers"

GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA A100 datasheet: 40 GB HBM2 at 1,555 GB/s; 40 GiB of physical HBM.
        GpuSpec(name="A100-SXM4-40GB", peak_tflops=_A100_PEAKS, memory_bytes=40 * GiB,
                hbm_bandwidth_bytes_per_s=1555e9, **_A100_KERNELS, source="NVIDIA A100 datasheet" + _KERNEL_SOURCES),
        # NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s; 80 GiB of physical HBM.
        GpuSpec(name="A100-SXM4-80GB", peak_tflops=_A100_PEAKS, memory_bytes=80 * GiB,
                hbm_bandwidth_bytes_per_s=2039e9, **_A100_KERNELS, source="NVIDIA A100 datasheet" + _KERNEL_SOURCES),
        # NVIDIA H100 datasheet: 80 GB HBM3 at 3.35 TB/s; 80 GiB of physical HBM.
        GpuSpec(name="H100-SXM5-80GB", peak_tflops=_H100_PEAKS, memory_bytes=80 * GiB,
                hbm_bandwidth_bytes_per_s=3350e9, **_H100_KERNELS, source="NVIDIA H100 datasheet" + _KERNEL_SOURCES),
        # NVIDIA H200 product brief: H100 compute, 141 GB HBM3e at 4.8 TB/s. We take 141e9 bytes,
        # the brief's decimal figure, rather than guess the GiB capacity: it can only under-state.
        # Its kernels are the H100's (the same chip; not measured on an H200 here).
        GpuSpec(name="H200-SXM-141GB", peak_tflops=_H100_PEAKS, memory_bytes=141 * 10**9,
                hbm_bandwidth_bytes_per_s=4800e9, **_H100_KERNELS, source="NVIDIA H200 product brief" + _KERNEL_SOURCES),
    )
}

# --- link presets: bandwidth per GPU, one direction ---------------------------------------------
# Latencies are a ring step's, as NCCL's tuning model prices them for the Simple protocol large
# messages use (NVIDIA/nccl src/graph/tuning.cc, `hwLat`): 3.4 us over NVLink, 14 us over the
# network (NCCL 2.18-2.21); `cost_models.communication` adds NCCL's per-call base latency and the
# tree algorithm. The profiler overrides them with measured alpha-beta fits.
LINK_PRESETS: dict[str, LinkSpec] = {
    spec.name: spec
    for spec in (
        # A100: 600 GB/s NVLink bidirectional per GPU (NVIDIA A100 datasheet) = 300 GB/s each way.
        # nccl-tests all_reduce_perf on 8 A100-SXM4 reports a bus bandwidth of about 200-210 GB/s
        # (NVIDIA/nccl-tests issues #149: ~200 GB/s; #178: 208 GB/s): 0.70 of the line rate.
        LinkSpec(name="nvlink3", bandwidth_bytes_per_s=300e9, latency_s=3.4e-6, efficiency=0.70,
                 source="NVIDIA A100 datasheet; NCCL bus bandwidth from nccl-tests #149, #178"),
        # H100/H200: 900 GB/s NVLink bidirectional per GPU (NVIDIA H100 datasheet) = 450 GB/s each way.
        # NCCL's ring reaches about 370 GB/s of it, protocol overhead ~20% (an NCCL maintainer in
        # NVIDIA/nccl-tests issue #212): 0.82.
        LinkSpec(name="nvlink4", bandwidth_bytes_per_s=450e9, latency_s=3.4e-6, efficiency=0.82,
                 source="NVIDIA H100 datasheet; NCCL ring bus bandwidth from nccl-tests #212"),
        # DGX A100: one 200 Gb/s HDR InfiniBand adapter per GPU = 25 GB/s; all_reduce_perf over 3
        # nodes of 8 A100 with 4 HDR adapters each peaks at 96 of 100 GB/s (nccl-tests #119): 0.96.
        LinkSpec(name="ib-hdr", bandwidth_bytes_per_s=25e9, latency_s=14e-6, efficiency=0.96,
                 source="HDR InfiniBand, 200 Gb/s per GPU; NCCL bus bandwidth from nccl-tests #119"),
        # DGX H100/H200: one 400 Gb/s NDR InfiniBand adapter per GPU = 50 GB/s; "for NDR @ 400Gbps
        # you should see 46-48GB/s per NIC" (an NCCL maintainer, NVIDIA/nccl-tests issue #290): 0.94.
        LinkSpec(name="ib-ndr", bandwidth_bytes_per_s=50e9, latency_s=14e-6, efficiency=0.94,
                 source="NDR InfiniBand, 400 Gb/s per GPU; NCCL bus bandwidth from nccl-tests #290"),
    )
}


# --- host links: PCIe between each GPU and its CPU, per GPU, one direction ----------------------
# Line rates from the PCIe specifications: Gen4 16 GT/s and Gen5 32 GT/s per lane, 128b/130b
# encoding, x16: 31.5 and 63.0 GB/s each way. Measured: an A100's Gen4 x16 peaks at 25 GB/s
# ("it is measured peak", the BaM authors in ZaidQureshi/bam issue #54): 0.79 of the line rate.
# An H100's Gen5 x16 moves 35.2 GB/s host-to-device and 52.8 GB/s device-to-host with nvbandwidth's
# memcpy_sm tests on a DGX H100 (NVIDIA/nvbandwidth issue #24); offload moves as many bytes each way
# per step, so we price both directions at their mean, 44 GB/s: 0.70. Latency: a copy launch
# (nominal 10 us; it is paid once per FSDP unit, negligible beside gigabytes).
HOST_LINK_PRESETS: dict[str, LinkSpec] = {
    spec.name: spec
    for spec in (
        LinkSpec(name="pcie4-x16", bandwidth_bytes_per_s=31.5e9, latency_s=10e-6, efficiency=0.79,
                 source="PCIe 4.0 x16 line rate; measured A100 peak 25 GB/s (ZaidQureshi/bam #54)"),
        LinkSpec(name="pcie5-x16", bandwidth_bytes_per_s=63.0e9, latency_s=10e-6, efficiency=0.70,
                 source="PCIe 5.0 x16 line rate; H100 memcpy 35.2/52.8 GB/s H2D/D2H (NVIDIA/nvbandwidth #24)"),
    )
}
# Host memory per node and its bandwidth (DDR channels x transfer rate x 8 bytes, both sockets):
# DGX A100: 2 AMD EPYC 7742, 8 channels DDR4-3200 each = 409.6 GB/s; 1 TB (320 GB model) or 2 TB
# (640 GB model) of system memory (NVIDIA DGX A100 datasheet). DGX H100/H200: 2 Intel Xeon Platinum
# 8480C, 8 channels DDR5-4800 each = 614.4 GB/s; 2 TB (NVIDIA DGX H100/H200 datasheets).
_DGX_HOSTS = {
    "a100-40gb": dict(host_link=HOST_LINK_PRESETS["pcie4-x16"], host_memory_bytes=10**12,
                      host_memory_bandwidth_bytes_per_s=409.6e9),
    "a100-80gb": dict(host_link=HOST_LINK_PRESETS["pcie4-x16"], host_memory_bytes=2 * 10**12,
                      host_memory_bandwidth_bytes_per_s=409.6e9),
    "h100": dict(host_link=HOST_LINK_PRESETS["pcie5-x16"], host_memory_bytes=2 * 10**12,
                 host_memory_bandwidth_bytes_per_s=614.4e9),
}


def _dgx(name: str, gpu: str, nvlink: str, network: str, host: str,
         storage_bytes_per_s: float = 50e9) -> ClusterSpec:
    return ClusterSpec(name=name, gpu=GPU_PRESETS[gpu], gpus_per_node=8, num_nodes=1,
                       intra_node=LINK_PRESETS[nvlink], inter_node=LINK_PRESETS[network],
                       node_storage_write_bytes_per_s=storage_bytes_per_s, **_DGX_HOSTS[host])


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    spec.name: spec
    for spec in (
        _dgx("dgx-a100-40gb", "A100-SXM4-40GB", "nvlink3", "ib-hdr", "a100-40gb", storage_bytes_per_s=25e9),
        _dgx("dgx-a100-80gb", "A100-SXM4-80GB", "nvlink3", "ib-hdr", "a100-80gb", storage_bytes_per_s=25e9),
        _dgx("dgx-h100", "H100-SXM5-80GB", "nvlink4", "ib-ndr", "h100"),
        _dgx("dgx-h200", "H200-SXM-141GB", "nvlink4", "ib-ndr", "h100"),
    )
}
LOCAL = "local"  # detected at load time, so it is not in CLUSTER_PRESETS


def list_presets() -> list[str]:
    """Cluster preset names `load_cluster` accepts, `local` included."""
    return [*CLUSTER_PRESETS, LOCAL]


# --- loading ------------------------------------------------------------------------------------
def load_cluster(spec: str, gpus: int | None = None) -> ClusterSpec:
    """A preset name or a YAML/JSON file, optionally sized to `gpus` GPUs in total."""
    if spec.lower() in CLUSTER_PRESETS or spec.lower() == LOCAL:
        cluster = detect_local_cluster() if spec.lower() == LOCAL else CLUSTER_PRESETS[spec.lower()]
    elif Path(spec).suffix.lower() in (".yaml", ".yml", ".json") or os.sep in spec or Path(spec).exists():
        cluster = _load_cluster_file(Path(spec))
    else:
        raise AutoparError(
            f"unknown cluster preset '{spec}'; known presets: {', '.join(list_presets())}, "
            f"or give a path to a YAML/JSON cluster file"
        )
    return cluster if gpus is None else size_cluster(cluster, gpus)


def size_cluster(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    """Up to one node: a partial node. Beyond: whole nodes, because nodes are identical."""
    per_node = cluster.gpus_per_node
    if gpus < 1:
        raise AutoparError(f"--gpus must be at least 1, got {gpus}")
    if gpus <= per_node:
        shape = {"gpus_per_node": gpus, "num_nodes": 1}
    elif gpus % per_node == 0:
        shape = {"gpus_per_node": per_node, "num_nodes": gpus // per_node}
    else:
        lower, upper = gpus // per_node * per_node, math.ceil(gpus / per_node) * per_node
        raise AutoparError(
            f"--gpus {gpus} is not a whole number of {cluster.name} nodes ({per_node} GPUs each); "
            f"use at most {per_node} or a multiple of {per_node}, e.g. {lower} or {upper}"
        )
    if shape["num_nodes"] > 1 and cluster.inter_node is None:
        raise AutoparError(
            f"--gpus {gpus} needs {shape['num_nodes']} nodes but cluster {cluster.name} has no inter_node "
            f"link (at most {per_node} GPUs); describe the network in a cluster file (inter_node: ib-ndr)"
        )
    return ClusterSpec.model_validate({**cluster.model_dump(), **shape})


def _load_cluster_file(path: Path) -> ClusterSpec:
    data = _read_mapping(path)
    base = data.pop("preset", None)
    if base is not None:
        if not isinstance(base, str) or base not in CLUSTER_PRESETS and base != LOCAL:
            raise AutoparError(
                f"cluster file {path}: unknown preset {base!r}; known presets: {', '.join(list_presets())}"
            )
        preset = detect_local_cluster() if base == LOCAL else CLUSTER_PRESETS[base]
        data = _resolve_names(data, path)
        data = _deep_merge(preset.model_dump(), data)
    else:
        data = _resolve_names(data, path)
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as error:
        raise AutoparError(f"cluster file {path}: {condense_validation_error(error)}; fix the file") from None


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise AutoparError(
            f"cluster file {path} {what}; give an existing YAML/JSON file or a preset ({', '.join(list_presets())})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AutoparError(f"cannot read cluster file {path}: {one_line(str(error))}; check the file") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise AutoparError(
                f"cluster file {path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}; fix the file"
            ) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error)
            raise AutoparError(f"cluster file {path} is not valid YAML: {one_line(problem)}{where}; fix the file") from None
    if not isinstance(data, dict):
        got = "nothing (empty file)" if data is None else type(data).__name__
        raise AutoparError(
            f"cluster file {path} must be a mapping (name, gpu, gpus_per_node, ...) or {{preset: NAME, ...}}, got {got}"
        )
    return data


def _resolve_names(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """`gpu: H100-SXM5-80GB` and `intra_node: nvlink4` name presets instead of spelling them out."""
    resolved = dict(data)
    if isinstance(resolved.get("gpu"), str):
        resolved["gpu"] = _lookup(GPU_PRESETS, resolved["gpu"], "GPU kind", path,
                                  "or give a full gpu mapping (name, peak_tflops, memory_bytes, hbm_bandwidth_bytes_per_s)")
    for key in ("intra_node", "inter_node", "host_link"):
        if isinstance(resolved.get(key), str):
            presets = HOST_LINK_PRESETS if key == "host_link" else LINK_PRESETS
            resolved[key] = _lookup(presets, resolved[key], "link", path,
                                    "or give a mapping (name, bandwidth_bytes_per_s, latency_s, optional efficiency)")
    return resolved


def _lookup(presets: dict[str, _Spec], name: str, kind: str, path: Path, alternative: str) -> dict[str, Any]:
    by_lower = {key.lower(): spec for key, spec in presets.items()}
    if name.lower() not in by_lower:
        raise AutoparError(f"cluster file {path}: unknown {kind} '{name}'; known: {', '.join(presets)}, {alternative}")
    return by_lower[name.lower()].model_dump()


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; nested mappings merge, so `gpu: {memory_bytes: ...}` keeps the rest of the GPU.
    A link given a bandwidth of its own is taken as measured: its efficiency is 1 unless given too."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
            if key in ("intra_node", "inter_node", "host_link") and "bandwidth_bytes_per_s" in value and "efficiency" not in value:
                merged[key]["efficiency"] = 1.0
        else:
            merged[key] = value
    return merged


# --- local detection ----------------------------------------------------------------------------
def detect_local_cluster() -> ClusterSpec:
    """This machine: its CUDA GPUs matched to a preset, or a nominal CPU device without CUDA."""
    import torch  # only here: specs are plain data, and importing torch costs seconds

    if not torch.cuda.is_available():
        return _cpu_cluster()
    count = torch.cuda.device_count()
    properties = [torch.cuda.get_device_properties(index) for index in range(count)]
    names = sorted({p.name for p in properties})
    if len(names) > 1:
        raise AutoparError(
            f"this machine mixes GPU kinds ({', '.join(names)}); autopar plans for identical GPUs: "
            f"set CUDA_VISIBLE_DEVICES to one kind or pass a cluster file"
        )
    memory_bytes = min(p.total_memory for p in properties)
    preset = match_gpu(names[0], memory_bytes)
    if preset is None:
        raise AutoparError(
            f"local GPU '{names[0]}' has no known peak FLOP/s figures (known kinds: {', '.join(GPU_PRESETS)}); "
            f"describe it in a cluster file (gpu: name, peak_tflops, memory_bytes, hbm_bandwidth_bytes_per_s) "
            f"and pass that file instead of local"
        )
    # The device's own capacity is what allocations will actually meet; the peaks are the preset's.
    gpu = GpuSpec.model_validate({**preset.model_dump(), "memory_bytes": memory_bytes})
    nvlink = "nvlink3" if preset.name.startswith("A100") else "nvlink4"
    host = {**_DGX_HOSTS["a100-80gb" if preset.name.startswith("A100") else "h100"], **_measured_host()}
    return ClusterSpec(name=LOCAL, gpu=gpu, gpus_per_node=count, num_nodes=1, intra_node=LINK_PRESETS[nvlink],
                       **{**host, "host_memory_bytes": _physical_memory_bytes()})


@functools.cache
def _measured_host() -> dict[str, Any]:
    """This host's CPU AdamW rate and its PCIe link to GPU 0, measured once per process
    (`autopar.host_rates`). Under torchrun only local rank 0 measures: the others would each open a
    context on GPU 0 and slow one another's measurement, and only rank 0 plans (`cli.run_plan`)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return {}
    import torch

    from autopar.host_rates import host_optimizer_params_per_s, pcie_bytes_per_s

    source = "measured on this machine by autopar.host_rates (pinned copies, the slower direction)"
    link = LinkSpec(name="pcie-measured", bandwidth_bytes_per_s=pcie_bytes_per_s(torch.device("cuda", 0)),
                    latency_s=HOST_LINK_PRESETS["pcie5-x16"].latency_s, efficiency=1.0, source=source)
    return {"host_link": link, "host_optimizer_params_per_s": host_optimizer_params_per_s()}


def match_gpu(device_name: str, memory_bytes: int) -> GpuSpec | None:
    """The SXM preset this CUDA device is, or None when its peaks would be a guess.

    PCIe, NVL and MIG variants run at other clocks or slices, so they never match an SXM preset.
    """
    upper = device_name.upper()
    if any(marker in upper for marker in ("PCIE", "NVL", "MIG")):
        return None
    candidates = [
        spec for key, spec in GPU_PRESETS.items()  # "H100" but not "GH100" or "H1000"
        if re.search(rf"(?<![A-Z0-9]){key.split('-')[0]}(?![0-9])", upper)
    ]
    for spec in sorted(candidates, key=lambda spec: abs(spec.memory_bytes - memory_bytes)):
        if abs(spec.memory_bytes - memory_bytes) <= 0.12 * spec.memory_bytes:
            return spec
    return None


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 * GiB


def _cpu_cluster() -> ClusterSpec:
    """One CPU "device" so that planning runs anywhere; its figures are nominal, not measured."""
    memory_bytes = _physical_memory_bytes()
    source = "nominal placeholder figures for a CPU, not measured: pass a cluster file for real numbers"
    cpu = GpuSpec(name="cpu", peak_tflops={"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, memory_bytes=memory_bytes,
                  hbm_bandwidth_bytes_per_s=50e9, source=source)
    memory_link = LinkSpec(name="cpu-memory", bandwidth_bytes_per_s=10e9, latency_s=1e-5, source=source)
    return ClusterSpec(name=LOCAL, gpu=cpu, gpus_per_node=1, num_nodes=1, intra_node=memory_link,
                       node_storage_write_bytes_per_s=1e9,  # nominal, like the rest: a local disk, not measured
                       host_link=memory_link, host_memory_bytes=memory_bytes, host_memory_bandwidth_bytes_per_s=50e9)

"""The op graph: what one training step computes, with the raw facts its costs are built from.

Plain data (pydantic), so it can be saved as JSON, inspected, and handed to the cost models and
the searcher without importing torch.
"""

from __future__ import annotations

from typing import Literal

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field

from autopar.graph.attention import AttentionCall
from autopar.graph.moe import MoELayer

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}


class TensorMeta(BaseModel):
    model_config = ConfigDict(frozen=True)

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


class OpNode(BaseModel):
    """One ATen operation of the joint forward+backward graph."""

    name: str
    op: str  # e.g. "aten.mm.default"
    phase: Literal["forward", "backward"]
    inputs: list[str] = Field(default_factory=list)  # names of producer nodes (placeholders included)
    input_meta: list[TensorMeta] = Field(default_factory=list)
    input_names: list[str] = Field(default_factory=list)  # producer of each input_meta entry, in argument order
    output_meta: list[TensorMeta] = Field(default_factory=list)
    flops: int = 0  # tensor-core work (matmul, convolution, attention) as torch's FLOP counter counts it
    vector_flops: int = 0  # approximate elementwise/reduction work: one per element touched
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0  # output bytes kept alive from forward until backward reads them
    is_view: bool = False  # aliases its input: no data moves
    params: list[str] = Field(default_factory=list)  # parameters this op reads (through views)
    module_path: str = ""  # e.g. "layers.3.attn.q_proj"; "" for the top level
    layer: str | None = None  # instance path of the repeated layer this op belongs to
    layer_type: str | None = None


class ParamInfo(BaseModel):
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    module_path: str
    aliases: list[str] = Field(default_factory=list)  # other names of a tied parameter
    trainable: bool = True  # requires_grad: a frozen parameter has no gradient to sync


class LayerType(BaseModel):
    """Structurally identical blocks: the searcher solves one instance and reuses the answer."""

    id: str
    class_name: str
    instances: list[str]
    params_per_instance: int
    nodes_per_instance: int
    forward_flops_per_instance: int
    backward_flops_per_instance: int


class StepMemory(BaseModel):
    """Bytes the optimizer step holds, summed over the whole (unsharded) model."""

    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int  # Adam moments, plus fp32 master weights under mixed precision
    master_weight_bytes: int


class OpGraph(BaseModel):
    model_name: str
    model_fingerprint: str
    precision: str
    batch: int
    seq_len: int | None
    inputs: list[TensorMeta]
    nodes: list[OpNode]
    params: list[ParamInfo]
    layer_types: list[LayerType]
    step_memory: StepMemory
    torch_version: str
    moe_layers: list[MoELayer] = Field(default_factory=list)  # mixture-of-experts layers (`autopar.graph.moe`)
    attention_calls: list[AttentionCall] = Field(default_factory=list)  # `autopar.graph.attention`
    # linear layers the runtime computes at a padded width under 16-bit precision: path ->
    # (out_features, padded width) (`autopar.graph.paddable`)
    padded_linears: dict[str, tuple[int, int]] = Field(default_factory=dict)

    # --- totals -------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def total_flops(self, phase: str | None = None) -> int:
        return sum(n.flops for n in self.nodes if phase is None or n.phase == phase)

    @property
    def forward_flops(self) -> int:
        return self.total_flops("forward")

    @property
    def backward_flops(self) -> int:
        return self.total_flops("backward")

    @property
    def tokens(self) -> int | None:
        return self.batch * self.seq_len if self.seq_len else None

    def layer_type(self, type_id: str) -> LayerType:
        for layer_type in self.layer_types:
            if layer_type.id == type_id:
                return layer_type
        raise KeyError(type_id)

    # --- views ---------------------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph keyed by node name, node attributes as in OpNode, edges producer → consumer."""
        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.name, **node.model_dump(exclude={"name", "inputs"}))
        for node in self.nodes:
            for source in node.inputs:
                graph.add_edge(source, node.name)
        return graph

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "OpGraph":
        return cls.model_validate_json(text)

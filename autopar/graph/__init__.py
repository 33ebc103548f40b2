"""Graph IR: capture a training step into an annotated op graph."""

from autopar.graph.capture import model_fingerprint, trace
from autopar.graph.ir import LayerType, OpGraph, OpNode, ParamInfo, StepMemory, TensorMeta

__all__ = ["trace", "model_fingerprint", "OpGraph", "OpNode", "ParamInfo", "LayerType", "StepMemory", "TensorMeta"]

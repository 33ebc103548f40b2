"""Which unit each op of the graph belongs to, and what a pipeline cut between units sends.

`facts.model_facts` builds its units from these walks over the op graph: ops are assigned to
layer instances and the runs of other ops between them; a unit's input is the activation entering
it from an earlier unit; a cut placed before a unit sends each tensor made before it and read
after it, except what every stage recomputes from the inputs and buffers alone.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autopar.graph.ir import DTYPE_BYTES, OpGraph, TensorMeta


class CutTensor(NamedTuple):
    """One tensor crossing a pipeline cut."""

    bytes: float  # per sample when `per_sample`, else per micro-batch
    grad: bool  # its gradient is sent back (a parameter flows into it and it is floating)
    # It grows with the batch: it depends on the model's inputs. A tensor made from weights and
    # positions alone (T5's relative position bias) is the same size for any micro-batch.
    per_sample: bool = True
    # `bytes` at autocast's dtypes (the residual stream stays fp32 over fp32 weights); None: as traced
    autocast_bytes: float | None = None

    def bytes_for(self, batch: int, autocast: bool | None = False) -> float:
        """Bytes for a micro-batch of `batch`; `autocast`: as the runtime sends it under autocast (ZeRO 0);
        None: the smaller of the two (a floor under either)."""
        size = self.bytes
        if self.autocast_bytes is not None and autocast is not False:
            size = self.autocast_bytes if autocast else min(self.bytes, self.autocast_bytes)
        return size * batch if self.per_sample else size


def assign_units(graph: OpGraph) -> dict[str, str]:
    """Layer ops go to their instance; other forward ops to the run they sit in; backward ops
    follow the forward unit of their module (the loss seed and other orphans: the last unit)."""
    unit_of: dict[str, str] = {}
    module_unit: dict[str, str] = {}
    runs = 0
    current = "pre"
    seen_layer = False
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        if node.layer is not None:
            unit_of[node.name] = node.layer
            seen_layer = True
            current = None  # the next non-layer op starts a new run
            continue
        if current is None:
            runs += 1
            current = f"between.{runs}"
        unit_of[node.name] = current if seen_layer or current == "pre" else "pre"
        module_unit.setdefault(node.module_path, unit_of[node.name])
    last_run = f"between.{runs}" if runs else "pre"
    renamed = {last_run: "post"} if runs else {}
    for node in graph.nodes:
        if node.phase == "forward":
            continue
        if node.layer is not None:
            unit_of[node.name] = node.layer
            continue
        path = node.module_path
        while path and path not in module_unit:
            path = path.rpartition(".")[0]
        unit_of[node.name] = module_unit.get(path, last_run) if path else last_run
    return {name: renamed.get(unit, unit) for name, unit in unit_of.items()}


def unit_input_bytes(graph: OpGraph, unit_of: dict[str, str], per_sample: float,
                     dtypes: dict[str, list[str]] | None = None) -> dict[str, float]:
    """Bytes of forward activations that enter each unit from an earlier unit; with `dtypes` (each
    node's output dtypes, `autocast.autocast_activations`), at those dtypes."""
    producer_unit = {n.name: unit_of[n.name] for n in graph.nodes}
    sizes: dict[str, float] = {}
    output_bytes = {n.name: sum(m.numel * DTYPE_BYTES.get(dtype, 4) for m, dtype in
                                zip(n.output_meta, (dtypes or {}).get(n.name) or [m.dtype for m in n.output_meta]))
                    for n in graph.nodes}
    for node in graph.nodes:
        if node.phase != "forward":
            continue
        unit = unit_of[node.name]
        for source in node.inputs:
            source_unit = producer_unit.get(source)
            if source_unit is not None and source_unit != unit:
                sizes.setdefault(unit, 0.0)
                sizes[unit] = max(sizes[unit], output_bytes[source] * per_sample)
    return sizes


_FLOATING = {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}


def _autocast_bytes(node, shape, dtype: str, dtypes: dict[str, list[str]]) -> float:
    """Bytes of `node`'s output of this shape and traced dtype at the dtype autocast gives it."""
    given = dtypes.get(node.name) or []
    for index, meta in enumerate(node.output_meta):
        if tuple(meta.shape) == tuple(shape) and meta.dtype == dtype and index < len(given):
            return math.prod(shape) * DTYPE_BYTES.get(given[index], 4)
    return TensorMeta(shape=shape, dtype=dtype).bytes


def cut_tensors(graph: OpGraph, unit_of: dict[str, str], order: list[str], per_sample: float,
                dtypes: dict[str, list[str]] | None = None) -> dict[str, tuple[CutTensor, ...]]:
    """Per unit: the forward tensors crossing a pipeline cut placed just before it (see `facts.Unit.cut`),
    in the order their producers ran; with `dtypes` (each node's output dtypes under autocast,
    `autocast.autocast_activations`), their bytes at those too. A tensor is recomputable when no
    parameter flows into it (the runtime's stages recompute those). Known gap: traced at batch 1, a
    tensor made from weights alone but expanded to the batch is priced as one sample's, whatever the
    micro-batch."""
    position = {unit: i for i, unit in enumerate(order)}
    forward = [node for node in graph.nodes if node.phase == "forward"]
    recomputable: set[str] = set()
    from_params: set[str] = set()
    from_inputs: set[str] = set()
    for node in forward:
        names = node.inputs
        if all(n in recomputable or n.startswith(("input:", "buffer:", "const:")) for n in names):
            recomputable.add(node.name)
        if any(n.startswith("param:") or n in from_params for n in names):
            from_params.add(node.name)
        if any(n.startswith("input:") or n in from_inputs for n in names):
            from_inputs.add(node.name)
    produced_at = {node.name: position[unit_of[node.name]] for node in forward}
    producers = {node.name: node for node in forward}
    last_read: dict[tuple, int] = {}  # (producer, shape, dtype) -> the last unit reading it
    for node in forward:
        reader = position[unit_of[node.name]]
        for name, meta in zip(node.input_names or node.inputs, node.input_meta):
            if name in produced_at and name not in recomputable and produced_at[name] < reader:
                key = (name, meta.shape, meta.dtype)
                last_read[key] = max(last_read.get(key, reader), reader)
    result: dict[str, list[CutTensor]] = {}
    for (name, shape, dtype), reader in sorted(last_read.items(), key=lambda item: produced_at[item[0][0]]):
        # Made from the inputs, or expanded to the batch (learned queries, decoder ids built to the
        # batch size): only a traced batch of 2 or more tells the latter from a weight-made tensor.
        batched = name in from_inputs or (graph.batch > 1 and bool(shape) and shape[0] == graph.batch)
        scale = per_sample if batched else 1.0
        size = TensorMeta(shape=shape, dtype=dtype).bytes * scale
        tensor = CutTensor(size, dtype in _FLOATING and name in from_params, batched,
                           _autocast_bytes(producers[name], shape, dtype, dtypes) * scale if dtypes else None)
        for cut in range(produced_at[name] + 1, reader + 1):
            result.setdefault(order[cut], []).append(tensor)
    return {unit: tuple(tensors) for unit, tensors in result.items()}

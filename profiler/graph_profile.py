"""From an op graph to a filled profile database, and from the database back to a step's time.

`profile_graph` measures what the database does not have yet (the graph's own signatures first,
then the sharded variants), storing each result as it comes so an interrupted run loses nothing.
`estimate_step` sums the profiled time of every node of one training step: the check that the
profile adds up to what an eager step really takes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from autopar.graph.ir import OpGraph, OpNode
from autopar.profiler.database import ProfileDB
from autopar.profiler.operators import ProgressFn, device_name, profile_signatures
from autopar.profiler.signatures import (
    DEFAULT_MICROBATCHES, DEFAULT_TP_DEGREES, needs_profile, scale_signature, signature_of, signatures_to_profile,
    unique_signatures,
)


@dataclass
class ProfileSummary:
    """What one `autopar profile` run did."""

    device_name: str
    dtype: str
    nodes: int
    graph_signatures: int  # distinct signatures of the graph itself
    total_signatures: int  # with the sharded variants
    measured: int = 0
    reused: int = 0  # already in the database for this device, dtype and torch version
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    not_run: int = 0  # left out by max_ops
    elapsed_s: float = 0.0


def profile_graph(
    graph: OpGraph, db: ProfileDB, device: str = "cpu", *, tp_degrees: Sequence[int] = DEFAULT_TP_DEGREES,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES, max_ops: int | None = None, warmup: int = 3,
    repeats: int = 10, memory_limit_bytes: int | None = None, force: bool = False,
    progress: ProgressFn | None = None,
) -> ProfileSummary:
    """Profile the graph's signatures and their sharded variants on `device` into `db`.

    Signatures already in `db` for this device, dtype and torch version (measured or skipped) are
    reused unless `force`; `max_ops` caps how many are measured in this run.
    """
    import torch

    started = time.perf_counter()
    name, dtype = device_name(device), graph.precision
    everything = signatures_to_profile(graph, tp_degrees=tp_degrees, microbatches=microbatches)
    summary = ProfileSummary(name, dtype, len(graph.nodes), len(unique_signatures(graph.nodes)), len(everything))
    todo = []
    for sig in everything:
        known = None if force else db.lookup(name, dtype, sig, torch_version=torch.__version__, include_skipped=True)
        if known is None:
            todo.append(sig)
        else:
            summary.reused += 1
    if max_ops is not None and len(todo) > max_ops:
        summary.not_run = len(todo) - max_ops
        todo = todo[:max_ops]
    skipped: Counter[str] = Counter()

    def store(sig, timing) -> None:
        db.record_op(name, dtype, timing)
        if timing.measured:
            summary.measured += 1
        else:
            skipped[timing.skipped.split(":")[0]] += 1

    profile_signatures(todo, device, warmup=warmup, repeats=repeats, memory_limit_bytes=memory_limit_bytes,
                       progress=progress, on_result=store)
    summary.skipped = dict(skipped)
    summary.elapsed_s = time.perf_counter() - started
    return summary


@dataclass
class StepEstimate:
    """One training step (forward + backward, no optimizer) priced from the profile database."""

    time_s: float  # sum of the profiled times of the nodes that have one
    nodes_timed: int
    nodes_missing: int  # nodes that need a time but have none in the database
    missing_ops: dict[str, int]  # op -> count of the missing ones
    activation_bytes: int  # forward output bytes kept for backward (see `activation_bytes`)
    activation_source: str  # "profiled" (GPU allocator deltas) or "graph" (shapes, when unmeasured)

    @property
    def coverage(self) -> float:
        total = self.nodes_timed + self.nodes_missing
        return self.nodes_timed / total if total else 1.0


def estimate_step(graph: OpGraph, db: ProfileDB, device_name: str, dtype: str | None = None) -> StepEstimate:
    """Sum each node's profiled time (looked up by its signature on `device_name`)."""
    dtype = dtype or graph.precision
    cache: dict[str, object] = {}
    total, timed, missing = 0.0, 0, Counter()
    activations, measured_memory = 0, True
    for node in graph.nodes:
        if not needs_profile(node):
            continue
        sig = signature_of(node)
        if sig.key not in cache:
            cache[sig.key] = db.lookup(device_name, dtype, sig)
        record = cache[sig.key]
        if record is None:
            missing[node.op] += 1
        else:
            total += record.time_s
            timed += 1
        if node.phase == "forward" and node.saved_bytes:
            delta = getattr(record, "mem_alloc_delta_bytes", None)
            if delta is None:
                measured_memory = False
                activations += node.saved_bytes
            else:  # the allocator's view of the outputs, scaled to the part kept for backward
                activations += int(delta * min(1.0, node.saved_bytes / max(node.bytes_written, 1)))
    return StepEstimate(total, timed, sum(missing.values()), dict(missing), activations,
                        "profiled" if measured_memory else "graph")


def node_time_s(
    db: ProfileDB, device_name: str, graph: OpGraph, node: OpNode, *, tp: int = 1, tp_dim: str | None = None,
    microbatch: int | None = None, token_dim: str | None = None,
) -> float | None:
    """Profiled time of one node as one rank runs it under `tp` along `tp_dim` at `microbatch`.

    0.0 for views and zero-work ops; None when the database has no measurement on this device or
    the op has no sharded form (non-matmul ops under tp or another micro-batch): price those otherwise.
    """
    if not needs_profile(node):
        return 0.0
    sig = scale_signature(signature_of(node), batch=graph.batch, seq_len=graph.seq_len, tp=tp, tp_dim=tp_dim,
                          microbatch=microbatch, token_dim=token_dim)
    return None if sig is None else db.lookup_time_s(device_name, graph.precision, sig)

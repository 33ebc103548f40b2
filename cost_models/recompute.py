"""Which layers recompute, and the fewest that make a plan fit.

Recompute trades time for memory one layer at a time: each layer left out of recompute keeps its
activations (more memory per in-flight micro-batch) and skips its second forward (less time). On
a pipeline, ranks hold different numbers of micro-batches in flight (1F1B: pp − rank), so each
stage gets its own count: its first k layers recompute, the rest do not (the block method of
Megatron-LM's --recompute-num-layers, Narayanan et al. SC'21 §3.5 / Korthikanti et al. 2022 §5,
with k per stage instead of one k for all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.plan_schema import Strategy, rank_stage_indices
from autopar.cost_models.facts import Unit


def stage_policies(units: Sequence[Unit], strategy: Strategy, stage_index: int) -> list[str]:
    """The recompute policy of each unit of stage `stage_index`: non-layer units never recompute."""
    s = strategy
    limit = None if s.recompute_layers is None else s.recompute_layers[stage_index]
    layers = sum(1 for u in units if u.layer_type is not None)
    if limit is not None and limit > layers:
        raise ValueError(f"recompute_layers asks stage {stage_index} to recompute {limit} layers but it holds {layers}")
    return first_layers_policies(units, s.recompute, layers if limit is None else limit)


def first_layers_policies(units: Sequence[Unit], policy: str, count: int) -> list[str]:
    """`policy` for the first `count` layers of `units`, "none" for the rest and for non-layer units."""
    policies = []
    seen = 0
    for unit in units:
        if unit.layer_type is None:
            policies.append("none")
            continue
        policies.append(policy if seen < count else "none")
        seen += 1
    return policies


def recomputed_units(stages: Sequence[Sequence[Unit]], strategy: Strategy) -> list[str]:
    """Names of the units that recompute, in stage order: the plan's `recompute_modules`."""
    if strategy.recompute == "none":
        return []
    return [unit.name for index, units in enumerate(stages)
            for unit, policy in zip(units, stage_policies(units, strategy, index)) if policy != "none"]


def fewest_recomputed_layers(
    *,
    strategy: Strategy,
    stages: Sequence[Sequence[Unit]],
    total_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    stage_activation_bytes: Sequence[float],
    margin_ratio: float,
    capacity_bytes: float,
    keeps_bytes,
    transient_bytes,
    head_bytes: Sequence[float] = (),
    backward_bytes: Callable[[int, int], float] | None = None,
    buffer_scale: float = 1.0,
) -> tuple[int, ...] | None:
    """Per stage, the fewest first layers that must recompute for every pipeline rank to fit,
    from an evaluation in which every layer recomputes (`strategy.recompute_layers` None).

    Per rank r: `total_bytes[r]` its peak memory, `activation_bytes[r]` the activation part of it
    (in-flight micro-batches plus the transient of the layer being recomputed); per stage
    `stage_activation_bytes` one micro-batch's saved activations. A layer taken out of recompute
    adds `keeps_bytes(unit)` per micro-batch held (the in-flight count is read off the evaluation:
    activations ∝ stage weights, exact for 1F1B and GPipe, close for interleaved); the rank's
    transient becomes the largest `transient_bytes(unit)` still recomputed. `margin_ratio` scales
    activation bytes to the peak (fragmentation margin). A rank's layers are spread over its chunks
    (`spread_layers`). Past its transient, a rank holds the larger of `head_bytes[r]` (the loss's
    gradients) and `backward_bytes(stage, k)` (the stage's backward with its first k layers recomputing:
    a unit's working set beside what recompute rebuilds for it), at `buffer_scale` device bytes per byte.
    Returns None when every layer must still recompute.
    """
    s = strategy
    pp, count = s.pp, len(stages)
    layers = [[u for u in units if u.layer_type is not None] for units in stages]
    counts = [len(stage_layers) for stage_layers in layers]
    for rank, chunks in enumerate(rank_stage_indices(pp, count, s.schedule)):
        sizes = [len(layers[c]) for c in chunks]
        transient_all = max((transient_bytes(u) for c in chunks for u in layers[c]), default=0.0)
        weight = sum(stage_activation_bytes[c] for c in chunks)
        held = (activation_bytes[rank] - transient_all) / weight if weight > 0 else 0.0
        base = total_bytes[rank] - margin_ratio * activation_bytes[rank]
        head = head_bytes[rank] if head_bytes else 0.0
        every = _beyond_transient(head, backward_bytes, chunks, sizes, transient_all)
        for total in range(sum(sizes) + 1):  # the first total that fits is the fewest: memory falls as it grows
            spread = spread_layers(total, sizes)
            kept = sum(keeps_bytes(u) for c, k in zip(chunks, spread) for u in layers[c][k:])
            transient = max((transient_bytes(u) for c, k in zip(chunks, spread) for u in layers[c][:k]), default=0.0)
            beyond = _beyond_transient(head, backward_bytes, chunks, spread, transient)
            if (base + margin_ratio * (held * (weight + kept) + transient)
                    + buffer_scale * (beyond - every) <= capacity_bytes):
                for c, k in zip(chunks, spread):
                    counts[c] = k
                break
    if all(k == len(stage_layers) for k, stage_layers in zip(counts, layers)):
        return None
    return tuple(counts)


def _beyond_transient(head: float, backward_bytes: Callable[[int, int], float] | None, chunks: Sequence[int],
                      spread: Sequence[int], transient: float) -> float:
    """A rank's backward past its transient (`evaluate.rank_memory`'s `loss_bytes`) with `spread` layers
    of its `chunks` recomputing."""
    if backward_bytes is None:
        return 0.0
    return max(0.0, max(head, *(backward_bytes(c, k) for c, k in zip(chunks, spread))) - transient)


def spread_layers(total: int, sizes: Sequence[int]) -> list[int]:
    """`total` recomputed layers over a rank's chunks (of `sizes` layers), one chunk after another
    in turn, so a rank's count moves one layer at a time and its chunks stay alike."""
    counts = [0] * len(sizes)
    for _ in range(min(total, sum(sizes))):
        open_chunks = [i for i, size in enumerate(sizes) if counts[i] < size]
        fewest = min(open_chunks, key=lambda i: (counts[i], i))
        counts[fewest] += 1
    return counts


def one_more_layer(counts: Sequence[int], layers: Sequence[int], pp: int, ranks: set[int],
                   schedule: str = "1f1b") -> tuple[int, ...]:
    """`counts` with one more recomputed layer on each of `ranks` (spread as `spread_layers` does);
    `layers`: how many layers each stage holds."""
    result = list(counts)
    held = rank_stage_indices(pp, len(layers), schedule)
    for rank in ranks:
        chunks = held[rank]
        sizes = [layers[c] for c in chunks]
        for c, k in zip(chunks, spread_layers(sum(counts[c] for c in chunks) + 1, sizes)):
            result[c] = k
    return tuple(result)

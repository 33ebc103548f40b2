"""Parallel strategies as users write them (`tp=8,pp=12,...`), and the rules that make one valid."""

from __future__ import annotations

from typing import Any

from autopar.cost_models.context import check_context
from autopar.errors import AutoparError
from autopar.plan_schema import Strategy

STRATEGY_KEYS = ("dp", "tp", "pp", "sp", "zero", "recompute", "recompute_layers", "microbatch", "schedule", "vp",
                 "attention", "dropout", "dp_overlap", "tp_overlap", "optimizer_state", "zero3_fetch", "offload", "ep",
                 "cp", "cp_kind", "optimizer_impl", "compile", "gemm_padding", "weight_passes", "sp_inputs")
_SWITCHES = ("sp", "dp_overlap", "tp_overlap", "compile", "gemm_padding", "weight_passes")
_CHOICES = {"recompute": ("none", "selective", "full"),
            "schedule": ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv"),
            "attention": ("fused", "math"), "optimizer_state": ("fp32", "bf16"), "zero3_fetch": ("unit", "parameter"),
            "offload": ("none", "optimizer"), "cp_kind": ("ring", "ulysses"), "optimizer_impl": ("fused", "foreach", "apex"),
            "sp_inputs": ("gathered", "regathered", "shards")}


def parse_strategy(text: str | None) -> dict[str, Any]:
    """`"tp=8,pp=12,recompute=full"` → the fixed keys; keys left out are for the planner to choose.
    The implementation keys (attention, dropout, dp_overlap, tp_overlap, optimizer_state, zero3_fetch;
    `cost_models.implementation`) price a run of other software as it ran; left out, they are
    autopar's runtime."""
    fixed: dict[str, Any] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in STRATEGY_KEYS:
            raise AutoparError(
                f"bad --strategy item {item!r}: use key=value with keys {', '.join(STRATEGY_KEYS)}, e.g. tp=8,pp=4"
            )
        if key in fixed:
            raise AutoparError(f"--strategy sets {key} twice")
        fixed[key] = _value(key, value)
    return fixed


def _value(key: str, value: str) -> Any:
    if key in _SWITCHES:
        if value.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise AutoparError(f"--strategy {key}={value}: use {key}=true or {key}=false")
        return value.lower() in ("true", "1", "on")
    if key == "dropout":
        try:
            probability = float(value)
        except ValueError:
            probability = -1.0
        if not 0 <= probability < 1:
            raise AutoparError(f"--strategy dropout={value}: give a probability in [0, 1), e.g. dropout=0.1")
        return probability
    if key == "recompute_layers":
        return _layer_counts(value)
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise AutoparError(f"--strategy {key}={value}: use one of {', '.join(_CHOICES[key])}")
        return value
    try:
        number = int(value)
    except ValueError:
        raise AutoparError(f"--strategy {key}={value}: {key} must be a whole number") from None
    low = 0 if key == "zero" else 1
    if number < low or (key == "zero" and number > 3):
        raise AutoparError(f"--strategy {key}={value}: {key} must be {'0 to 3' if key == 'zero' else 'at least 1'}")
    return number


def _layer_counts(value: str) -> int | tuple[int, ...] | str:
    """`3`: the first 3 layers of every stage recompute; `3/3/2/1`: a count per stage; `all`: every
    layer (as Megatron-LM's published runs did), not fitted to memory."""
    if value == "all":
        return value
    parts = value.split("/")
    try:
        counts = tuple(int(part) for part in parts)
    except ValueError:
        counts = ()
    if not counts or any(k < 0 for k in counts):
        raise AutoparError(f"--strategy recompute_layers={value}: give a whole number of layers per stage (e.g. 2), "
                           f"one per stage separated by / (e.g. 3/3/2/1), or all")
    return counts[0] if len(parts) == 1 else counts


def even_stage_layers(layers: int, stages: int) -> list[int]:
    """Layers per stage on the even split (extra layers to the middle stages): `evaluate.partition`'s rule.
    With one or two stages more than layers, the last stage (the head alone), then the first (the
    embedding alone) hold none: Llama 3 405B's 126 layers on 16 x 8 virtual stages (Dubey et al. 2024,
    §3.3.2, "the first model chunk on the first stage has only the embedding")."""
    if layers < stages <= layers + 2:
        return ([0] if stages == layers + 2 else []) + [1] * layers + [0]
    base, extra = divmod(layers, stages)
    sizes = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for k in range(extra):
        sizes[middle[k % len(middle)]] += 1
    return sizes


def check_strategy(
    strategy: Strategy, *, world_size: int, global_batch: int, layers: int,
    heads: int | None = None, kv_heads: int | None = None, experts: int | None = None, seq_len: int | None = None,
    end_units: int = 0,
) -> None:
    """Raise AutoparError naming the first rule the strategy breaks. `experts`: the fewest experts of
    the model's MoE layers (None: it has none); `seq_len`: the sequence cp cuts into chunks;
    `end_units`: how many of the code before the first layer and after the last may hold a stage
    alone (`standalone_ends`). Stages need not hold equal layer counts, interleaved ones neither."""
    s = strategy
    if s.ep > 1 and not experts:
        raise AutoparError(f"ep={s.ep} shards mixture-of-experts layers, and this model has none: leave ep out")
    if s.ep > 1 and experts % s.ep:
        raise AutoparError(f"ep={s.ep} does not divide the {experts} experts of a MoE layer: choose ep dividing "
                           f"{experts}")
    if s.dp * s.cp * s.tp * s.pp != world_size:
        product = s.dp * s.cp * s.tp * s.pp
        raise AutoparError(f"dp×cp×tp×pp = {s.dp}×{s.cp}×{s.tp}×{s.pp} = {product} but the cluster has {world_size} "
                           f"GPUs: the product must equal the world size")
    if heads is not None and heads % s.tp:
        raise AutoparError(f"tp={s.tp} does not divide the {heads} attention heads: choose tp dividing {heads}")
    if kv_heads is not None and kv_heads % s.tp and s.tp % kv_heads:
        raise AutoparError(f"tp={s.tp} and the {kv_heads} key/value heads must divide one another")
    check_context(s, seq_len, heads, kv_heads)
    if s.pp * s.vp > layers + end_units:
        alone = " (or the embedding or the head alone)" if end_units else ""
        raise AutoparError(f"pp×vp = {s.pp * s.vp} stages for {layers} layers: a stage needs at least one "
                           f"layer{alone}")
    if global_batch % (s.dp * s.microbatch):
        raise AutoparError(f"global batch {global_batch} is not divisible by dp×microbatch = {s.dp}×{s.microbatch}: "
                           f"choose a batch or micro-batch that divides evenly")
    if s.num_microbatches * s.dp * s.microbatch != global_batch:
        raise AutoparError(f"num_microbatches {s.num_microbatches} × dp {s.dp} × microbatch {s.microbatch} "
                           f"≠ global batch {global_batch}")
    if s.schedule in ("1f1b", "interleaved", "interleaved_zb", "zbv") and s.pp > 1 and s.num_microbatches < s.pp:
        raise AutoparError(f"{s.schedule} needs at least pp={s.pp} micro-batches, got {s.num_microbatches}: "
                           f"raise the global batch or lower the micro-batch size")
    if s.recompute_layers is not None and s.pp * s.vp <= layers + end_units:
        sizes = even_stage_layers(layers, s.pp * s.vp)
        over = [i for i, (k, size) in enumerate(zip(s.recompute_layers, sizes)) if k > size]
        if over:
            raise AutoparError(f"recompute_layers asks stage {over[0]} to recompute {s.recompute_layers[over[0]]} "
                               f"layers but it holds {sizes[over[0]]}: give at most {'/'.join(map(str, sizes))}")
    if s.schedule in ("interleaved", "interleaved_zb") and s.num_microbatches % s.pp:
        raise AutoparError(f"{s.schedule} needs the micro-batch count ({s.num_microbatches}) divisible by pp={s.pp}")


def standalone_ends(units) -> int:
    """How many ends of the unit sequence are code outside the layers (an embedding before them, a
    head after), each of which may hold a pipeline stage alone."""
    units = list(units)
    if not units:
        return 0
    return int(units[0].layer_type is None) + int(len(units) > 1 and units[-1].layer_type is None)


def check_fixed_degrees(fixed: dict[str, Any], world_size: int) -> None:
    """Fixed dp/cp/tp/pp degrees must multiply to (all four) or divide (some) the world size."""
    ep = fixed.get("ep", 1)
    if world_size % ep or ("dp" in fixed and fixed["dp"] % ep):
        where = f"dp={fixed['dp']}" if "dp" in fixed and not world_size % ep else f"the world size {world_size}"
        raise AutoparError(f"ep={ep} shares dp's ranks but does not divide {where}: choose ep dividing dp")
    if fixed.get("cp_kind", "ring") != "ring" and fixed.get("cp", 2) == 1:
        raise AutoparError(f"cp_kind={fixed['cp_kind']} splits sequences over cp > 1 ranks: drop cp=1 or cp_kind")
    degrees = {key: fixed[key] for key in ("dp", "cp", "tp", "pp") if key in fixed}
    product = 1
    for value in degrees.values():
        product *= value
    text = "×".join(f"{k}={v}" for k, v in degrees.items())
    if len(degrees) == 4 and product != world_size:
        raise AutoparError(f"dp×cp×tp×pp = {text} = {product} but the cluster has {world_size} GPUs: "
                           f"the product must equal the world size")
    if degrees and world_size % product:
        raise AutoparError(f"{text} = {product} does not divide the world size {world_size}: "
                           f"choose degrees whose product divides it")

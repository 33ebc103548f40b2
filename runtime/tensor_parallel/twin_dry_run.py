"""A tp dry run of a deep model, answered by dry runs of its shallow twins.

A dry run (`runtime.tensor_parallel.dry_run`) runs one rank's step on fake tensors: its time grows
with the depth of the model (Mixtral-8x7B's 32 MoE blocks through DTensor: about 12 s on this
project's 2-core VM, two per candidate the search refines). What it records grows by the same
collectives with every block of a stack of identical blocks.

So the twins of 2, 3 and 4 blocks (`autopar.graph.twin.shallow_twin`) are dry-run, and a twin of the
first block and the last two (`twin_of_blocks`). Each record is read without its block's number (a
block's module path `layers.7.attn` as `layers.*.attn`). The answer is built for the whole depth only
when every twin ran, the records grow by the same collectives from 2 blocks to 3 as from 3 to 4, and
the last two blocks send what blocks 1 and 2 send. Then each block past the fourth adds that growth,
named for its own block (a recomputed layer's records carry its exact path, as the ledger reads
them). Before any of it, the blocks after the first must hold the same settings (`_blocks_look_alike`:
a layer given a sliding window or another attention kind is set apart) and the same placements and
recompute. Anything else returns None, and the caller dry-runs the whole model, as before.

Not caught: a model whose own forward treats blocks by their position in the middle of the stack
(every sixth layer global, say, decided by the loop rather than by the block's settings). The
runtime probes asked of twins (`autopar.graph.twin`) assume the same.

Which module a backward collective is filed under follows torch's module tracker, which wanders, in
the whole model too (a 16-block GPT filed 26 of its backward all-reduces under one block's dropout).
The answer's counts of (phase, kind, bytes), its recomputed layers' records and its ledger are the
whole model's, and so is the plan priced from it (`tests/test_tp_dry_run.py` compares them): the
pricing adds a stage's tp collectives whichever of its layers carries them.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Callable

from torch import nn

from autopar.capabilities import TpCollective
from autopar.graph.twin import block_stack, shallow_twin, twin_of_blocks

TWIN_DEPTHS = (2, 3, 4)
MIN_BLOCKS = 16  # below this, three twins (9 blocks) save too little over the whole model


def dry_run_on_twins(model: nn.Module, spec, run: Callable) -> "DryRun | None":
    """The whole model's dry run of `spec`, from `run(twin, twin_spec)` on its shallow twins; None
    when the model is too shallow or the twins do not agree (see the module docstring)."""
    found = block_stack(model)
    if found is None or len(found[1]) < MIN_BLOCKS:
        return None
    stack = _Stack(found[0], list(found[1]._modules))
    if not _same_in_every_block(dict(spec.placements), stack) or not _recompute_is_all_or_none(spec.recompute, stack) \
            or not _blocks_look_alike(list(found[1].children())):
        return None
    records, specs = {}, {}
    for depth in TWIN_DEPTHS:
        kept = set(stack.keys[:depth])

        def in_twin(name: str) -> bool:
            found = stack.block(name)
            return found is None or found[0] in kept

        specs[depth] = dataclasses.replace(spec, placements=tuple(item for item in spec.placements if in_twin(item[0])),
                                           recompute=tuple(name for name in spec.recompute if in_twin(name)))
        outcome = run(shallow_twin(model, depth), specs[depth])
        if not outcome.ok:
            return None
        records[depth] = outcome.collectives
    # the last two blocks behind the first, as a twin of three: a block that acts on its own index
    # near the end of the stack (a last layer that differs) answers differently from blocks 1 and 2
    ends = twin_of_blocks(model, stack.path, [0, len(stack.keys) - 2, len(stack.keys) - 1])
    check = run(ends, specs[3])
    if not check.ok or _counted(check.collectives, stack) != _counted(records[3], stack):
        return None
    whole = _grown(records, stack)
    if whole is None:
        return None
    return dataclasses.replace(outcome, collectives=tuple(whole))


def _blocks_look_alike(blocks: list[nn.Module]) -> bool:
    """Every block after the first holds the same settings as the second: its modules' types and
    plain attributes (flags, strings, numbers; not the ones that number the layer). A model that
    gives some layers another attention kind (a sliding window, a local/global pattern) differs."""
    def settings(block: nn.Module) -> list:
        found = []
        for path, module in block.named_modules():
            plain = {name: value for name, value in vars(module).items()
                     if isinstance(value, (bool, int, float, str, type(None))) and not name.startswith("_")
                     and not _numbers_the_layer(name)}
            found.append((path, type(module).__qualname__, sorted(plain.items(), key=repr)))
        return found
    reference = settings(blocks[1])
    return all(settings(block) == reference for block in blocks[2:])


def _numbers_the_layer(name: str) -> bool:
    lowered = name.lower()
    return "idx" in lowered or "index" in lowered or lowered in ("layer_id", "layer_number", "layer_num", "block_id")


class _Stack:
    """The block stack's path and keys, and names inside it taken apart and put together."""

    def __init__(self, path: str, keys: list[str]) -> None:
        self.path, self.keys = path, keys
        self._prefix = f"{path}." if path else ""
        self._pattern = re.compile(re.escape(self._prefix) + r"([^.]+)(?:\.(.*))?$")
        self._known = set(keys)

    def block(self, name: str) -> tuple[str, str] | None:
        """(block key, the rest of the name after it) for a name inside the stack, else None."""
        match = self._pattern.match(name)
        if match is None or match.group(1) not in self._known:
            return None
        return match.group(1), match.group(2) or ""

    def name(self, key: str, rest: str) -> str:
        return self._prefix + key + (f".{rest}" if rest else "")


def _same_in_every_block(placements: dict[str, str], stack: _Stack) -> bool:
    """Blocks 1.. are placed alike (block 0 may differ: the twins keep it as it is)."""
    by_block: dict[str, dict[str, str]] = {key: {} for key in stack.keys}
    for name, placement in placements.items():
        found = stack.block(name)
        if found is not None:
            by_block[found[0]][found[1]] = placement
    return all(by_block[key] == by_block[stack.keys[1]] for key in stack.keys[1:])


def _recompute_is_all_or_none(recompute: tuple[str, ...], stack: _Stack) -> bool:
    return not recompute or set(recompute) == {stack.name(key, "") for key in stack.keys}


def _counted(collectives, stack: _Stack) -> Counter:
    return Counter(_canonical(record, stack) for record in collectives)


def _canonical(record: TpCollective, stack: _Stack) -> tuple:
    """A record without its block's number; in backward, without the module inside the block too
    (the tracker's attribution there wanders between a block's modules; the unit carrying the record
    is the block's layer either way, `cost_models.placed_collectives.dry_run_units`)."""
    found = stack.block(record.module)
    if found is None:
        return record.phase, record.kind, record.bytes, ("module", record.module)
    return record.phase, record.kind, record.bytes, ("block", "" if record.phase == "backward" else found[1])


def _group(item: tuple) -> tuple:
    """A canonical record without its size: (phase, kind, where)."""
    return item[:2] + item[3:]


def _grown(records: dict[int, tuple], stack: _Stack) -> list[TpCollective] | None:
    """The whole depth's records from the twins' (each depth's, in order), or None when the twins
    do not grow alike per block: by the same records, and outside the blocks also by records that
    keep their number and grow in size (the step's one all-reduce of every partial gradient)."""
    counts = {depth: _counted(records[depth], stack) for depth in TWIN_DEPTHS}
    extra = len(stack.keys) - TWIN_DEPTHS[0]
    resized = _resized(counts, extra)
    if resized is None:
        return None
    low, mid, high = (Counter({item: n for item, n in counts[depth].items() if _group(item) not in resized})
                      for depth in TWIN_DEPTHS)
    growth = mid - low
    if low - mid or mid - high or high - mid != growth:  # not monotone, or not the same growth per block
        return None
    deepest = TWIN_DEPTHS[-1]
    result = [record for record in records[deepest] if _group(_canonical(record, stack)) not in resized]
    inside = _modules_in_last_block(records[deepest], stack, deepest)
    for key in stack.keys[deepest:]:
        for (phase, kind, size, (where, rest)), count in sorted(growth.items(), key=repr):
            if where == "block" and phase == "backward":
                rest = inside.get((phase, kind, size), "")
            module = stack.name(key, rest) if where == "block" else rest
            result.extend([TpCollective(phase, kind, size, module)] * count)
    for (phase, kind, (_, module)), sizes in sorted(resized.items(), key=repr):
        result.extend(TpCollective(phase, kind, size, module) for size in sizes)
    return result


def _modules_in_last_block(records, stack: _Stack, depth: int) -> dict[tuple, str]:
    """(phase, kind, bytes) -> the module inside the twin's last block that sent such a record: the
    name a later block's backward record takes (the layer's unit carries it either way)."""
    last, found = stack.keys[depth - 1], {}
    for record in records:
        block = stack.block(record.module)
        if block is not None and block[0] == last:
            found.setdefault((record.phase, record.kind, record.bytes), block[1])
    return found


def _resized(counts: dict[int, Counter], extra: int) -> dict[tuple, list[int]] | None:
    """Groups (phase, kind, module outside the blocks) whose records change size with depth: each
    keeps its number of records at every depth, and the k-th largest grows by the same bytes per
    block; their sizes at the whole depth (the blocks past the first two: `extra`). None when such a
    group does not grow so, or lies inside the blocks."""
    low, mid, high = (counts[depth] for depth in TWIN_DEPTHS)
    # The one resized group today: the step's single all-reduce of every partial gradient
    # (`runtime.parallelize._sum_partial_gradients`). Were it ever split into buckets of a capped
    # size, the twins would see one record where the whole model sends several: the pairing below
    # would then need the cap.
    changed = {_group(item) for item in (low - mid) + (mid - high)}
    result = {}
    for group in changed:
        if group[2][0] != "module":
            return None
        sizes = [sorted(item[2] for item, n in counts[depth].items() for _ in range(n) if _group(item) == group)
                 for depth in TWIN_DEPTHS]
        if len({len(each) for each in sizes}) != 1:
            return None
        steps = [(m - l, h - m) for l, m, h in zip(*sizes)]
        if any(first != second or first < 0 for first, second in steps):
            return None
        result[group] = [l + extra * step for l, (step, _) in zip(sizes[0], steps)]
    return result

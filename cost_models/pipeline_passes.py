"""What a simulated pipeline schedule produces: its passes and the step's result.

Kept apart from `cost_models.pipeline` (the 1F1B family) so that `cost_models.zero_bubble` (the
split-backward schedules, which `pipeline` dispatches to) can build them without importing it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Pass:
    rank: int
    kind: str  # "F" or "B" (the whole backward; under a zero-bubble schedule its input-gradient part), or "W"
    stage: int  # virtual stage index: rank + chunk * pp
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    step_time_s: float
    rank_busy_s: tuple[float, ...]
    rank_end_s: tuple[float, ...]
    peak_in_flight: tuple[float, ...]  # per rank: peak Σ over held micro-batches of their stage weight
    timeline: tuple[Pass, ...]

    @property
    def bubble_s(self) -> float:
        return self.step_time_s - max(self.rank_busy_s)


def run_passes(orders: list[list[tuple[str, int, int]]], duration_s: Callable[[str, int], float],
               ready_s: Callable[[str, int, int, dict], float | None], weights: list[float], release: str,
               deadlock: str) -> PipelineResult:
    """Run each rank's passes (kind, virtual stage, micro-batch) in its order, each as soon as its rank
    is free and `ready_s` (given the end times so far) says its inputs are there. An F pass holds its
    stage's weight until the pass of kind `release` frees it ("B", or "W" under a split backward)."""
    ranks = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    position, free, busy, held, peak = [0] * ranks, [0.0] * ranks, [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
    timeline: list[Pass] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank in range(ranks):
            while position[rank] < len(orders[rank]):
                kind, stage, mb = orders[rank][position[rank]]
                ready = ready_s(kind, stage, mb, done)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + duration_s(kind, stage)
                done[(kind, stage, mb)] = free[rank] = end
                busy[rank] += end - start
                held[rank] += weights[stage] if kind == "F" else -weights[stage] if kind == release else 0.0
                peak[rank] = max(peak[rank], held[rank])
                timeline.append(Pass(rank, kind, stage, mb, start, end))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(deadlock)
    return PipelineResult(step_time_s=max(free), rank_busy_s=tuple(busy), rank_end_s=tuple(free),
                          peak_in_flight=tuple(peak), timeline=tuple(timeline))

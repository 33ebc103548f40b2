"""What a simulated pipeline schedule produces: its passes and the step's result.

Kept apart from `cost_models.pipeline` (the 1F1B family) so that `cost_models.zero_bubble` (the
split-backward schedules, which `pipeline` dispatches to) can build them without importing it back.
"""

from __future__ import annotations

from dataclasses import dataclass


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

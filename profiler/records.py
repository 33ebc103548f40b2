"""Plain results passed between the profiler's stages: the harness, the database and the cost models.

Kept free of torch so that a cost model can read a profile without importing the measuring code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpTiming:
    """One signature measured (or not) on one device.

    `skipped` holds the reason when nothing was measured (too large for the device, inputs that
    cannot be synthesized, no kernel for this device); then `time_s` is None. Memory is measured
    on GPUs only: `mem_alloc_delta_bytes` is what the op leaves allocated (its outputs, rounded by
    the caching allocator) and `mem_peak_bytes` the peak above the starting point (outputs plus
    workspace).
    """

    signature_key: str
    op: str
    time_s: float | None
    repeats: int = 0
    mem_alloc_delta_bytes: int | None = None
    mem_peak_bytes: int | None = None
    skipped: str | None = None

    @property
    def measured(self) -> bool:
        return self.time_s is not None


@dataclass(frozen=True)
class OpRecord:
    """A row of the profile database: an `OpTiming` plus where and when it was taken."""

    device_name: str
    dtype: str
    torch_version: str
    signature_key: str
    op: str
    time_s: float | None
    repeats: int
    mem_alloc_delta_bytes: int | None
    mem_peak_bytes: int | None
    measured_at: float  # unix time, seconds
    note: str | None = None  # the skip reason when time_s is None


@dataclass(frozen=True)
class CollectiveFit:
    """Latency and bandwidth of one collective on one link level, fitted to measured times.

    The model (per collective, see `profiler.collectives.cost_coefficients`) is
    t = c_α(n)·alpha_s + c_β(n)·S/beta_bytes_per_s, with S the full logical buffer in bytes.
    """

    device_name: str
    backend: str
    torch_version: str
    collective: str
    level: str  # "intra_node", "inter_node" or "all"
    group_size: int
    alpha_s: float
    beta_bytes_per_s: float
    rel_rms_error: float  # root-mean-square of (fit - measured) / measured over the samples
    sizes_bytes: tuple[int, ...] = ()
    times_s: tuple[float, ...] = ()
    measured_at: float = 0.0

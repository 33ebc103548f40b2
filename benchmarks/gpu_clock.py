"""The GPU's SM clock and power, sampled while a benchmark times kernels.

Why: the same GEMMs ran 15% faster inside a GPT-1.3B step than timed back to back on the H200, and
the cost model's GEMM efficiency (fitted on published runs) sits at the back-to-back speed
(README, eighth and ninth sessions). A guess is the power limit: a long run of GEMMs on random data
may hold the clock lower than a step whose memory-bound kernels let it rest. No clock was read, so
the guess is untested. `ClockSampler` reads `nvidia-smi` every 100 ms in a background process;
`gemm_shapes.py` and `gpu_diagnose.py` record what it saw next to their timings.

Where `nvidia-smi` is missing (a CPU machine), the sampler records why and nothing else.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

QUERY = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")
COMMAND = ["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits", "-lms", "100"]


def parse(line: str) -> dict[str, float] | None:
    """One `nvidia-smi` CSV line as numbers keyed by QUERY; None for a line that is not one (a
    field reads "[N/A]" on some GPUs: that field is left out)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != len(QUERY):
        return None
    values = {}
    for name, field in zip(QUERY, fields):
        try:
            values[name] = float(field)
        except ValueError:
            continue
    return values or None


class ClockSampler:
    """`with ClockSampler() as clock: ...`; then `clock.summary()` and `clock.between(t0, t1)`, both
    in `time.perf_counter()` seconds."""

    def __init__(self, command: list[str] | None = None):
        self.command = command or COMMAND
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.unavailable = None if shutil.which(self.command[0]) else f"{self.command[0]} not found"
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if self.unavailable is None:
            self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            values = parse(line)
            if values:
                self.samples.append((time.perf_counter(), values))

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._reader.join(timeout=5)

    def between(self, begin_s: float, end_s: float) -> dict:
        """Median, least and most of each field over the samples taken in [begin_s, end_s]."""
        return _summarize([values for at, values in self.samples if begin_s <= at <= end_s])

    def summary(self) -> dict:
        if self.unavailable:
            return {"unavailable": self.unavailable}
        return _summarize([values for _, values in self.samples])


def _summarize(rows: list[dict[str, float]]) -> dict:
    summary: dict = {"samples": len(rows)}
    for name in QUERY:
        values = [row[name] for row in rows if name in row]
        if values:
            summary[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary

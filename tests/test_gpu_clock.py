"""benchmarks/gpu_clock.py: nvidia-smi's CSV lines parsed, samples kept with their times, and a
machine without nvidia-smi recorded as such (the GPU run reads the clock; CPU checks the script)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest


@pytest.fixture
def gpu_clock(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_clock

    return gpu_clock


def test_a_line_parses_and_a_missing_field_is_left_out(gpu_clock):
    assert gpu_clock.parse("1980, 1980, 612.35, 700.00, 61") == {
        "clocks.sm": 1980.0, "clocks.max.sm": 1980.0, "power.draw": 612.35, "power.limit": 700.0,
        "temperature.gpu": 61.0}
    assert gpu_clock.parse("1755, 1980, [N/A], 700.00, 58") == {
        "clocks.sm": 1755.0, "clocks.max.sm": 1980.0, "power.limit": 700.0, "temperature.gpu": 58.0}
    assert gpu_clock.parse("No devices were found") is None


def test_samples_are_kept_with_their_times(gpu_clock):
    lines = ["1980, 1980, 400, 700, 50", "1700, 1980, 690, 700, 60", "1600, 1980, 700, 700, 65"]
    script = "import time\nfor line in %r:\n    print(line, flush=True)\n    time.sleep(0.05)\n" % lines
    begin = time.perf_counter()
    with gpu_clock.ClockSampler([sys.executable, "-c", script]) as clock:
        deadline = time.perf_counter() + 10
        while len(clock.samples) < 3 and time.perf_counter() < deadline:
            time.sleep(0.02)
    summary = clock.summary()
    assert summary["samples"] == 3
    assert summary["clocks.sm"] == {"median": 1700.0, "min": 1600.0, "max": 1980.0}
    assert summary["power.draw"]["max"] == 700.0
    first, last = clock.samples[0][0], clock.samples[-1][0]
    assert begin <= first <= last
    assert clock.between(last, last)["clocks.sm"]["median"] == 1600.0
    assert clock.between(begin - 2, begin - 1) == {"samples": 0}


def test_without_nvidia_smi_the_sampler_says_why(gpu_clock):
    with gpu_clock.ClockSampler(["no-such-tool-here", "--query"]) as clock:
        pass
    assert clock.summary() == {"unavailable": "no-such-tool-here not found"} and clock.samples == []

"""The GPU's SM clock and power draw while a benchmark phase runs, sampled through ``nvidia-smi``.

A long run of large matrix products can hold a GPU at its power limit, and then the SM clock
falls below the one a short measurement of the matrix rate saw: a throughput figure means more
with the clock it ran at beside it. ``ClockSampler`` runs ``nvidia-smi --query-gpu ... -lms``
beside the ``with`` block and summarises what it printed; where ``nvidia-smi`` is missing (no
NVIDIA driver) the summary says so and nothing else changes.

    with ClockSampler(device_index=0) as clocks:
        run_prefill()
    print(clocks.summary())   # "SM clock 1,320-1,980 MHz (median 1,455); power up to 708 W (limit 700 W)"
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from dataclasses import dataclass
from typing import Optional

QUERY = "clocks.sm,power.draw,power.limit"


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    power_w: float
    limit_w: float


def parse_samples(text: str) -> list[Sample]:
    """The samples in ``nvidia-smi --query-gpu=clocks.sm,power.draw,power.limit --format=csv,
    noheader,nounits`` output; lines that are not three numbers ("[N/A]", a warning) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            samples.append(Sample(*(float(field) for field in fields)))
        except ValueError:
            continue
    return samples


def summarise(samples: list[Sample]) -> str:
    """One line: the SM clock's range and median, the highest power draw and the limit."""
    if not samples:
        return "SM clock not sampled (no nvidia-smi output)"
    clocks = [sample.sm_mhz for sample in samples]
    return (f"SM clock {min(clocks):,.0f}-{max(clocks):,.0f} MHz (median {statistics.median(clocks):,.0f}); "
            f"power up to {max(sample.power_w for sample in samples):,.0f} W "
            f"(limit {samples[-1].limit_w:,.0f} W); {len(samples)} samples")


class ClockSampler:
    """Samples the SM clock and power of GPU ``device_index`` every ``interval_ms`` while the
    ``with`` block runs (``nvidia-smi`` in a process of its own)."""

    def __init__(self, device_index: int = 0, interval_ms: int = 100) -> None:
        self.device_index = device_index
        self.interval_ms = interval_ms
        self.samples: list[Sample] = []
        self._process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ClockSampler":
        program = shutil.which("nvidia-smi")
        if program is not None:
            self._process = subprocess.Popen(
                [program, "-i", str(self.device_index), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            output, _ = self._process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            output, _ = self._process.communicate()
        self.samples = parse_samples(output)

    def summary(self) -> str:
        return summarise(self.samples)

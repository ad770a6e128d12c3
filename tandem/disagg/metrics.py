"""Transfer metrics of one PD side: outcomes, bytes, sizes, durations and bandwidths.

Owner: each ``PDSide`` owns one ``TransferMetrics``; the side records every transfer's outcome,
and the engine's stats read a snapshot (cached until something changes).
"""
from __future__ import annotations

from typing import Optional

from tandem.protocol import HistogramSnapshot, TransferStats

SIZE_BUCKETS = tuple(float(1 << shift) for shift in range(12, 33, 2))  # 4 KiB .. 4 GiB
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# the phases of one request's transfer (PHASES), finer: they add up to what PD adds to TTFT
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BANDWIDTH_BUCKETS = (1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(bounds=list(self.bounds), counts=cumulative, total=self.total)


PHASES = {
    "prefill": {
        "compute": "the request's arrival to its first token sampled (the prompt's chunks; their pages stream "
                   "to the decode server once it named them)",
        "destination_wait": "the computed prompt waiting for the decode server's destination pages (0 when they "
                            "came first)",
        "last_write": "the first token and the destination both there to the last write landed (last pages, "
                      "metadata row, notification)",
    },
    "decode": {
        "admission_wait": "the request's arrival to its destination pages allocated and sent",
        "receive": "the destination sent to the completion notification handled (the prefill server's "
                   "compute and writes)",
    },
}


class TransferMetrics:
    """Counters and histograms of one side's transfers."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.outcomes: dict[str, int] = {"done": 0, "failed": 0, "aborted": 0}
        self.bytes_total = 0
        self.sizes = Histogram(SIZE_BUCKETS)
        self.durations = Histogram(DURATION_BUCKETS)
        self.bandwidths = Histogram(BANDWIDTH_BUCKETS)
        self.num_held_back = 0
        self.phases = {phase: Histogram(PHASE_BUCKETS) for phase in PHASES[role]}
        self._version = 0
        self._cache: Optional[tuple[int, tuple, TransferStats]] = None

    def record(self, outcome: str, num_bytes: int = 0, seconds: float = 0.0, bandwidth: bool = False) -> None:
        """Count a transfer's outcome; for a done one its bytes and duration, and (on the side
        that writes, timing its writes only) its bandwidth."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "done":
            self.bytes_total += num_bytes
            self.sizes.observe(num_bytes)
            self.durations.observe(seconds)
            if bandwidth and seconds > 0:
                self.bandwidths.observe(num_bytes / seconds)
        self._version += 1

    def record_phases(self, **seconds: float) -> None:
        """The phases of one transfer that completed (names from ``PHASES[role]``)."""
        for phase, value in seconds.items():
            self.phases[phase].observe(max(value, 0.0))
        self._version += 1

    def record_held_back(self) -> None:
        """A transfer waited for admission (counted once per transfer by the decode side)."""
        self.num_held_back += 1
        self._version += 1

    def stats(self, queues: dict[str, int], control_rejected: dict[str, int]) -> TransferStats:
        """A snapshot; ``control_rejected``: control messages dropped, by reason (the channel's)."""
        key = (tuple(sorted(queues.items())), tuple(sorted(control_rejected.items())))
        if self._cache is None or self._cache[:2] != (self._version, key):
            stats = TransferStats(role=self.role, outcomes=dict(self.outcomes), bytes_total=self.bytes_total,
                                  size_bytes=self.sizes.snapshot(), duration_seconds=self.durations.snapshot(),
                                  bandwidth_bytes_per_second=self.bandwidths.snapshot(), queues=queues,
                                  num_held_back=self.num_held_back, control_rejected=dict(control_rejected),
                                  phase_seconds={phase: histogram.snapshot()
                                                 for phase, histogram in self.phases.items()})
            self._cache = (self._version, key, stats)
        return self._cache[2]

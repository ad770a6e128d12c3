"""``benchmarks/offline.py --timeline``: decode-only steps grouped by batch size against the time
their bytes take, on hand-made steps with known costs."""
from __future__ import annotations

from benchmarks.common import Ceilings, ModelCost
from benchmarks.offline import StepTimeline


class _Engine:
    def step(self):
        return []


def test_decode_steps_by_batch_size_against_their_bytes(capsys):
    timeline = StepTimeline(_Engine())
    cost = ModelCost(weight_bytes=1000, flops_per_token=1.0, attention_flops_per_pair=1.0, state_bytes_per_token=10)
    ceilings = Ceilings(bandwidth=1e6, flops=1e9, device="test")
    # (prefilling, seconds, preemptions, batch, context tokens)
    timeline.steps = [
        (True, 0.5, 0, 4, 100),  # a prefill-phase step: not grouped
        (False, 0.004, 0, 3, 100),  # bytes 1000 + 1000 -> 2 ms at 1e6 B/s: half the step
        (False, 0.002, 0, 4, 100),  # the same bytes in 2 ms: all of it
        (False, 0.001, 0, 1, 0),  # one sequence: 1 ms of weights in 1 ms
        (False, 0.010, 1, 200, 9000),  # 1000 + 90,000 bytes -> 91 ms: more than the step took
    ]
    timeline.report(cost, ceilings)
    lines = {line.split()[0] + (" " + line.split()[1] if "sequence" in line else ""): line.split()
             for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert lines["3-4 sequences"][2:] == ["2", "0.01", "3.00", f"{4 / 6:.2f}"]  # 4 ms of bytes in 6 ms
    assert lines["1 sequence"][2:] == ["1", "0.00", "1.00", "1.00"]
    assert lines["129-256 sequences"][2:] == ["1", "0.01", "10.00", "9.10"]
    assert len(lines) == 3 and timeline.steps == []  # one row per group that has steps; the steps are cleared


class _Scheduler:
    def __init__(self):
        self.waiting, self.running, self.num_preemptions = [object()], [], 0


class _PrefillingEngine:
    """Every step is a prefill-phase step (a request waits)."""

    def __init__(self):
        self.scheduler = _Scheduler()

    def step(self):
        return []


def test_profiled_steps_come_from_the_last_timed_run():
    """With two timed runs the profiler waits for the second (a warm engine), then takes the
    phase's steps from the 4th prefill-phase step of that run."""
    engine = _PrefillingEngine()
    timeline = StepTimeline(engine, profile_steps=2, runs=2)
    timeline.start_run()
    for _ in range(6):
        engine.step()
    assert timeline._profiler is None and not timeline.profiles  # the first run is never profiled
    timeline.start_run()
    for step in range(6):
        engine.step()
        assert (timeline._profiler is not None) == (step in (3, 4))  # from its 4th step, two steps
    assert list(timeline.profiles) == [True] and timeline.profiles[True][0] == 2

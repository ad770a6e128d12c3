"""Step time against tokens in the step, learnt online, and the prefill budget it implies under
an inter-token-gap target (``max_itl_ms``: SLO-aware colocated scheduling).

A running decode waits one whole step for each of its tokens, so its inter-token gap is the step
time. A step's time grows with the tokens it computes, and most of them are prefill chunks: the
scheduler caps the prefill tokens of a step that has running decodes so that the predicted step
time stays under the target; prefill takes what is left. With no running decode, nothing waits on
the step: prefill takes the whole budget. Where the steps with prefill (once seen in two sizes)
predict that not even ``min_prefill_tokens`` (one page) of prompt beside the decodes fits within
the target, every step with prefill misses it
whatever its size: prefill then takes the whole budget (the fewest such steps miss it least
often; a page a step would miss it on every step and crawl), and a warning says the target is
out of reach.

The model is a straight line, seconds = intercept + slope x tokens, fitted by least squares to
one point per token-count bucket (powers of two), over the steps that held a prefill chunk (the
steps the cap shapes; every step's line stands in until those have two sizes). Each bucket holds an exponentially weighted
mean of the steps that fell in it, so a long run of decode-only steps refreshes the small
buckets without forgetting what prefill steps cost, and the fit follows drift (context growing,
batch mix changing). Until two buckets hold steps (or while the fitted slope is not positive),
there is no prediction and no cap.

Steps that ran long for a reason other than their size (a kernel compiled or a graph shape met
for the first time, a garbage collection, a page-out) must not teach the model that large steps
are slow: the cap would then keep every step small, the large buckets would never be measured
again, and prefill would crawl at one page a step. So a bucket's first ``SEED_STEPS`` steps keep
their fastest, a later step counts at most ``SPIKE_FACTOR`` times the bucket's mean, and a bucket
no step has fallen in for ``STALE_STEPS`` steps leaves the fit (with it gone the cap loosens, steps
of that size run again and are measured afresh) — unless two buckets would not remain: a long run
of decode-only steps, all of one size, must not leave a single point, no line, and so no cap.

Each step is timed where it ran. On a GPU the overlapped loop reads a step's tokens back only
after launching the next one, so the host's clock says little of a step (a host busy launching
an eager prompt chunk reads back a step the device finished long before, and two read-backs
microseconds apart would make a large step look free): the device times it between two events
(its beginning, its sampled tokens' copy), which counts any wait within the step for the host to
launch its kernels. Off a GPU a step has finished when its launch returns (``HostStepClock``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from tandem.protocol import InterTokenBudgetStats

logger = logging.getLogger(__name__)

# Weight of a new step in its bucket's running mean: about the last ten steps of that size count.
BUCKET_WEIGHT = 0.2
# A bucket's first steps: the fastest of them stands for the bucket (the first may have compiled).
SEED_STEPS = 3
# A later step counts at most this many times its bucket's mean.
SPIKE_FACTOR = 2.0
# A bucket with no step for this many steps leaves the fit.
STALE_STEPS = 256


@dataclass
class Bucket:
    """Running means of the steps whose token count falls in one power-of-two range."""
    tokens: float
    seconds: float
    last_step: int
    count: int = 1

    def add(self, tokens: int, seconds: float, step: int) -> None:
        self.count += 1
        self.last_step = step
        if self.count <= SEED_STEPS:
            if seconds < self.seconds:
                self.tokens, self.seconds = float(tokens), seconds
            return
        seconds = min(seconds, SPIKE_FACTOR * self.seconds)
        self.tokens += BUCKET_WEIGHT * (tokens - self.tokens)
        self.seconds += BUCKET_WEIGHT * (seconds - self.seconds)


class StepTimeModel:
    """An online fit of step seconds against scheduled tokens. Owned by the scheduler; fed by the
    engine core once per completed step (``observe``)."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}
        self.num_steps = 0

    def observe(self, num_tokens: int, seconds: float, step: Optional[int] = None) -> None:
        """A step's tokens and seconds; ``step``: the clock staleness is counted on (the
        engine's steps, where this model sees only some of them; default: its own count)."""
        if num_tokens <= 0 or seconds < 0:
            return
        self.num_steps = self.num_steps + 1 if step is None else step
        bucket = self.buckets.get(num_tokens.bit_length())
        if bucket is None:
            self.buckets[num_tokens.bit_length()] = Bucket(float(num_tokens), seconds, self.num_steps)
        else:
            bucket.add(num_tokens, seconds, self.num_steps)
        stale = [key for key, old in self.buckets.items() if self.num_steps - old.last_step > STALE_STEPS]
        for key in sorted(stale, key=lambda key: self.buckets[key].last_step)[:len(self.buckets) - 2]:
            del self.buckets[key]  # (the freshest two stay: with one point there is no line, and no cap)

    def line(self) -> Optional[tuple[float, float]]:
        """``(intercept, slope)`` in seconds and seconds per token; None while the buckets cannot
        determine a rising line."""
        points = list(self.buckets.values())
        if len(points) < 2:
            return None
        mean_tokens = sum(point.tokens for point in points) / len(points)
        mean_seconds = sum(point.seconds for point in points) / len(points)
        spread = sum((point.tokens - mean_tokens) ** 2 for point in points)
        if spread <= 0:
            return None
        slope = sum((point.tokens - mean_tokens) * (point.seconds - mean_seconds) for point in points) / spread
        if slope <= 0:
            return None
        return mean_seconds - slope * mean_tokens, slope

    def predict(self, num_tokens: int) -> Optional[float]:
        """Predicted seconds of a step of ``num_tokens`` tokens (None: no prediction yet)."""
        line = self.line()
        return None if line is None else line[0] + line[1] * num_tokens

    def max_tokens_within(self, seconds: float) -> Optional[int]:
        """The most tokens a step may hold to be predicted within ``seconds`` (None: no prediction;
        0 when even an empty step is predicted over)."""
        line = self.line()
        if line is None:
            return None
        intercept, slope = line
        return max(0, int((seconds - intercept) / slope))


class InterTokenBudget:
    """The prefill tokens a step may take so that its running decodes' next token comes within
    ``max_itl_seconds`` (the scheduler asks once per step)."""

    def __init__(self, max_itl_seconds: float, min_prefill_tokens: int) -> None:
        if not 0 < max_itl_seconds < float("inf"):
            raise ValueError("max_itl_ms: must be a finite number of milliseconds > 0, "
                             f"got {max_itl_seconds * 1e3:g}")
        self.max_itl_seconds = max_itl_seconds
        self.min_prefill_tokens = max(1, min_prefill_tokens)
        self.model = StepTimeModel()  # every step
        # Steps with a prefill chunk: the cap is about those, and they cost more than their
        # tokens say next to decode-only steps (those replay a captured graph, a prompt chunk
        # runs eagerly), so a line through both would promise mixed steps too fast.
        self.prefill_model = StepTimeModel()
        self.out_of_reach = False  # the last step's verdict: even a minimal prefill step is over the target
        self.steps = 0  # steps observed
        self.num_capped_steps = 0  # steps whose prefill the target held below what the budget left

    def observe(self, num_tokens: int, seconds: float, with_prefill: bool = False) -> None:
        self.steps += 1
        self.model.observe(num_tokens, seconds, self.steps)
        if with_prefill:  # (stale after STALE_STEPS of the engine's steps, not of its own)
            self.prefill_model.observe(num_tokens, seconds, self.steps)

    def count_capped_step(self) -> None:
        """A step's prompt tokens used up an allowance below what the budget left (the
        scheduler, for the metrics)."""
        self.num_capped_steps += 1

    def stats(self) -> InterTokenBudgetStats:
        line = self.prefill_model.line()
        return InterTokenBudgetStats(target_seconds=self.max_itl_seconds, num_capped_steps=self.num_capped_steps,
                                     out_of_reach=self.out_of_reach,
                                     intercept_seconds=None if line is None else line[0],
                                     seconds_per_token=None if line is None else line[1])

    def prefill_tokens(self, num_decode_tokens: int, token_budget: int) -> int:
        """Prefill tokens allowed in a step that also computes ``num_decode_tokens`` decode tokens
        (decodes and their draft tokens), within the step's ``token_budget``."""
        if num_decode_tokens == 0:
            return token_budget
        step_tokens = self.prefill_model.max_tokens_within(self.max_itl_seconds)
        if step_tokens is None:  # not two sizes of steps with prefill yet: a provisional line
            step_tokens = self._provisional_tokens()
            if step_tokens is None:
                return token_budget
            return min(token_budget, max(self.min_prefill_tokens, step_tokens - num_decode_tokens))
        if step_tokens < num_decode_tokens + self.min_prefill_tokens:
            # Even one page of prompt beside these decodes is predicted over the target: every
            # step with prefill misses it whatever its size, so the fewest, fullest such steps
            # miss it least often (one page a step would miss it on every step, and crawl).
            if not self.out_of_reach:
                logger.warning("max_itl_ms %g: a step with a prompt chunk beside %d decodes is predicted "
                               "to take %.1f ms; prefill runs uncapped while the target is out of reach",
                               self.max_itl_seconds * 1e3, num_decode_tokens,
                               1e3 * self.prefill_model.predict(num_decode_tokens + self.min_prefill_tokens))
            self.out_of_reach = True
            return token_budget
        self.out_of_reach = False
        return min(token_budget, step_tokens - num_decode_tokens)

    def _provisional_tokens(self) -> Optional[int]:
        """Step tokens within the target before steps with prefill give a line: in proportion to
        the latest of them (its seconds per token; a larger step is always allowed where that
        one came under the target, so the next size is measured and the line forms), else every
        step's line."""
        points = list(self.prefill_model.buckets.values())
        if points:
            latest = max(points, key=lambda point: point.last_step)
            return int(self.max_itl_seconds * latest.tokens / max(latest.seconds, 1e-9))
        return self.model.max_tokens_within(self.max_itl_seconds)


class HostStepClock:
    """Off a GPU a step has finished when its launch returns: its time, as its running decodes
    saw it, runs from its scheduling, or the previous step's read-back if that came later, to its
    read-back. (On a GPU the device times each step itself: ``HostSamplerOutput.device_seconds``.)"""

    def __init__(self) -> None:
        self.previous = 0.0

    def interval(self, started: float) -> float:
        """The seconds of a step scheduled at ``started`` and read back now."""
        now = time.perf_counter()
        seconds = now - max(started, self.previous)
        self.previous = now
        return seconds

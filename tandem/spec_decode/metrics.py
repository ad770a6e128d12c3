"""Speculative decoding's counters (engine stats, the server's ``/metrics``)."""
from __future__ import annotations

from tandem.protocol import SpeculationStats


class SpeculationMetrics:
    """Cumulative counts of one engine, owned by its speculator."""

    def __init__(self, method: str, num_speculative_tokens: int) -> None:
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.num_drafts = 0  # verifications of at least one draft token
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # of those, accepted

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    def stats(self) -> SpeculationStats:
        return SpeculationStats(method=self.method, num_speculative_tokens=self.num_speculative_tokens,
                                num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                                num_accepted_tokens=self.num_accepted_tokens)

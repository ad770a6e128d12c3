"""Bringing a step's matchers level with their sequences' outputs, on several threads.

Owner: the engine's ``StructuredOutputs`` (one per engine; ``close`` stops its threads).
xgrammar advances a matcher in C++ without the interpreter lock (tens of microseconds a token
with a 128k vocabulary, a few milliseconds for a batch of 64), so the rows are split over
``threads`` threads, the caller's own among them. Each matcher is advanced by one thread only:
rows are grouped by matcher first. Every pair is tried; the call returns once every share is done, the
first error (a ``GrammarViolation``) raised then, so no thread still touches a matcher when the
caller goes on.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from tandem.structured.matcher import RequestGrammar

# Fewer rows than this are synced on the caller's thread (handing work over costs more).
MIN_ROWS_PER_THREAD = 4


class BatchSync:
    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._executor = (ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="grammar-sync")
                          if self.threads > 1 else None)

    def sync(self, pairs: Sequence[tuple[RequestGrammar, Sequence[int]]], check_history: bool = False) -> None:
        """``grammar.sync(output_token_ids)`` for each ``(grammar, output_token_ids)`` pair."""
        unique = list({id(grammar): (grammar, output) for grammar, output in pairs}.values())
        shares = min(self.threads, len(unique) // MIN_ROWS_PER_THREAD)
        if self._executor is None or shares <= 1:
            _sync_share(unique, check_history)
            return
        futures = [self._executor.submit(_sync_share, unique[share::shares], check_history)
                   for share in range(1, shares)]
        error = None
        try:
            _sync_share(unique[0::shares], check_history)
        except Exception as raised:  # noqa: BLE001 - raised below, once every share is done
            error = raised
        for future in futures:
            raised = future.exception()
            error = error or raised
        if error is not None:
            raise error

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _sync_share(pairs, check_history: bool) -> None:
    """Sync every pair of the share; the first error is raised once all were tried."""
    error = None
    for grammar, output in pairs:
        try:
            grammar.sync(output, check_history)
        except Exception as raised:  # noqa: BLE001 - raised below
            error = error or raised
    if error is not None:
        raise error

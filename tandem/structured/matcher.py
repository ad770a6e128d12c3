"""A sequence's grammar matcher, kept level with the sequence's output tokens.

The matcher's state is a function of the compiled grammar and the output tokens alone, so it
needs no mover of its own: wherever the sequence goes (preempted by swap or recompute, moved
from a prefill to a decode server, forked for ``n > 1``), ``sync`` brings the matcher to the
sequence's output before each use — accepting the tokens it has not seen (the first token a
prefill server sampled; the tokens a verification accepted) and rolling back any it saw that
are no longer there. ``consumed`` records what it accepted, so a stale matcher is caught, not
used. A sync costs O(new tokens): outputs only grow between syncs, or are cut back and grown
again, so the matcher is level when its last accepted token is still in place; only when it is
not (or when ``check_history`` asks for it: sanitizer mode) is the whole history compared.

Owner: the sequence carries it (``Sequence.grammar``); the engine core creates it when the
request's grammar has compiled and syncs it before filling a mask.
"""
from __future__ import annotations

from typing import Sequence


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher."""


class RequestGrammar:
    def __init__(self, compiled) -> None:
        import xgrammar

        self.compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)  # (it keeps its whole history: rollback is unlimited)
        self.consumed: list[int] = []  # the output tokens accepted so far, in order

    def fork(self) -> "RequestGrammar":
        """A sibling's matcher, in the same state (its output so far is the same)."""
        child = RequestGrammar.__new__(RequestGrammar)
        child.compiled = self.compiled
        child._matcher = self._matcher.fork()
        child.consumed = list(self.consumed)
        return child

    @property
    def matcher(self):
        """The xgrammar matcher (for filling many rows at once); advance it only through this object."""
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def sync(self, output_token_ids: Sequence[int], check_history: bool = False) -> None:
        """Bring the matcher to ``output_token_ids`` (every one known: none pending).
        ``check_history``: compare every accepted token, not only the last one."""
        consumed = self.consumed
        level = len(consumed)
        if check_history or level > len(output_token_ids) or (level and output_token_ids[level - 1] != consumed[-1]):
            level = self._common_prefix(output_token_ids)
            self.rollback(len(consumed) - level)
        for token in output_token_ids[level:]:
            self.accept(token)

    def _common_prefix(self, output_token_ids: Sequence[int]) -> int:
        consumed = self.consumed
        common, limit = 0, min(len(consumed), len(output_token_ids))
        while common < limit and consumed[common] == output_token_ids[common]:
            common += 1
        return common

    def accept(self, token: int) -> None:
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            raise GrammarViolation(f"token {token} is not allowed by the grammar after {len(self.consumed)} "
                                   f"output tokens")
        self.consumed.append(int(token))

    def try_accept(self, token: int) -> bool:
        """Accept ``token`` if the grammar allows it (a draft); ``False`` leaves the state as is."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        self.consumed.append(int(token))
        return True

    def rollback(self, count: int) -> None:
        if count <= 0:
            return
        self._matcher.rollback(count)
        del self.consumed[len(self.consumed) - count:]

    def fill(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

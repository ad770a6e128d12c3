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

With ``after`` (the token ids that end a model's thinking) the grammar constrains only the
tokens after the first occurrence of ``after`` in the output; the tokens up to and including it
are free (``in_thinking``: no mask, end of sequence allowed) and kept in ``thinking``, so the
same sync compares them and cuts back across the boundary (a rejected draft, a shorter output)::

    output:   t0 t1 ... </think> | a0 a1 a2 ...
              '---- thinking ----' '-- consumed --'   (the matcher saw only ``consumed``)

Owner: the sequence carries it (``Sequence.grammar``); the engine core creates it when the
request's grammar has compiled and syncs it before filling a mask.
"""
from __future__ import annotations

from typing import Sequence


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher."""


class RequestGrammar:
    def __init__(self, compiled, after: Sequence[int] = ()) -> None:
        import xgrammar

        self.compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)  # (it keeps its whole history: rollback is unlimited)
        self.after: tuple[int, ...] = tuple(int(token) for token in after)
        self.thinking: list[int] = []  # the output tokens before the answer, ``after`` included once seen
        self.in_thinking = bool(self.after)  # ``after`` has not appeared yet: the output is free
        self.consumed: list[int] = []  # the answer's tokens accepted so far, in order

    def fork(self) -> "RequestGrammar":
        """A sibling's matcher, in the same state (its output so far is the same)."""
        child = RequestGrammar.__new__(RequestGrammar)
        child.compiled = self.compiled
        child._matcher = self._matcher.fork()
        child.after = self.after
        child.thinking = list(self.thinking)
        child.in_thinking = self.in_thinking
        child.consumed = list(self.consumed)
        return child

    @property
    def matcher(self):
        """The xgrammar matcher (for filling many rows at once); advance it only through this object."""
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        return not self.in_thinking and self._matcher.is_terminated()

    @property
    def constrains_next(self) -> bool:
        """The next token is masked: past the thinking, and the grammar has not ended."""
        return not self.in_thinking and not self._matcher.is_terminated()

    @property
    def num_seen(self) -> int:
        """Output tokens this object has seen: the thinking's and the answer's."""
        return len(self.thinking) + len(self.consumed)

    def sync(self, output_token_ids: Sequence[int], check_history: bool = False) -> None:
        """Bring the matcher to ``output_token_ids`` (every one known: none pending).
        ``check_history``: compare every seen token, not only the last one."""
        level = self.num_seen
        if check_history or level > len(output_token_ids) or (level and output_token_ids[level - 1] != self._last_seen()):
            level = self._common_prefix(output_token_ids)
            self.cut(level)
        for token in output_token_ids[level:]:
            self.accept(token)

    def _last_seen(self) -> int:
        return self.consumed[-1] if self.consumed else self.thinking[-1]

    def _common_prefix(self, output_token_ids: Sequence[int]) -> int:
        common, limit = 0, min(self.num_seen, len(output_token_ids))
        thinking, consumed = self.thinking, self.consumed
        while common < limit and (thinking[common] if common < len(thinking)
                                  else consumed[common - len(thinking)]) == output_token_ids[common]:
            common += 1
        return common

    def cut(self, level: int) -> None:
        """Forget every seen token from output position ``level`` on (a cut into the thinking
        or before its end marker's last token puts the matcher back to its start)."""
        if not self.in_thinking and level >= len(self.thinking):
            self.rollback(self.num_seen - level)
            return
        self.rollback(len(self.consumed))
        del self.thinking[level:]
        self.in_thinking = bool(self.after)

    def accept(self, token: int) -> None:
        if not self.try_accept(token):
            raise GrammarViolation(f"token {token} is not allowed by the grammar after {len(self.consumed)} "
                                   f"answer tokens")

    def try_accept(self, token: int) -> bool:
        """Accept ``token`` if the grammar allows it (a draft); ``False`` leaves the state as is.
        In the thinking every token is allowed; the last one of ``after`` ends the thinking."""
        token = int(token)
        if self.in_thinking:
            self.thinking.append(token)
            self.in_thinking = tuple(self.thinking[-len(self.after):]) != self.after
            return True
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        self.consumed.append(token)
        return True

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` seen tokens (answer tokens first, then thinking ones)."""
        if count <= 0:
            return
        answer = min(count, len(self.consumed))
        if answer:
            self._matcher.rollback(answer)
            del self.consumed[len(self.consumed) - answer:]
        if count > answer:
            self.cut(len(self.thinking) - (count - answer))

    def fill(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (in the thinking: left as it is,
        every token allowed)."""
        if not self.in_thinking:
            self._matcher.fill_next_token_bitmask(bitmask, row)

"""What speculative decoding remembers per sequence, between steps (``Sequence.speculation``).

Positions a draft has computed state for (its KV, indexer keys or recurrent state, in the same
pages as the target's) form a prefix ``[0, num_computed)``, kept level with the target's
computed tokens at the end of every step::

    token positions     0 ........................ C-1 | C ........ L-1 | drafts ...
    target state        computed                        | known, not computed yet
    draft state         computed (num_computed == C)    | written only by a speculative chain,
                                                          rewritten by the next step

An MTP layer's state at position ``p`` is computed from the target's hidden state at ``p`` and
the token at ``p + 1``. After a PD transfer the decode side recomputes the last prompt
position from the hidden state the metadata row carried (kept by rank 0's worker under the
sequence's key while ``carries_hidden``), which stands for position ``num_computed`` while
``num_computed`` is one behind the target's. The books hold no tensor: the hidden states a
draft reads are the worker's.

Owner: the speculator (``tandem/spec_decode``); the sequence only carries it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass
class SpeculationState:
    num_computed: int = 0  # draft state holds positions [0, num_computed)
    carries_hidden: bool = False  # rank 0's worker keeps the target's hidden state at position
    # num_computed (MTP, PD decode: the prefill server's)
    last_hidden: Optional[tuple[float, ...]] = None  # the target's at its last computed position (MTP,
    # PD prefill: the metadata row's)
    drafts_drawn: bool = False  # its drafts were drawn: rank 0's worker keeps their distributions (its
    # ``sampling.keep_draft_probs``), which their verification reads
    pending: bool = False  # propose before the next step (its state arrived from a prefill server)
    simulated_credit: float = 0.0  # TANDEM_SIMULATE_ACCEPT_LEN: accepted drafts owed

    def carries(self, position: int) -> bool:
        """Whether the carried hidden state stands in for the target's at ``position``."""
        return self.carries_hidden and self.num_computed == position

    def align(self, start: int) -> None:
        """Before a step's draft work for a chunk starting at ``start``: the draft's state must
        end where the target's did before the chunk. More (the sequence was preempted and
        recomputes from a prefix-cache hit) or less (the hit brought the draft's pages along)
        means it ends at ``start`` now; only a carried hidden state may stand one position
        behind."""
        if self.num_computed == start or (self.carries(start - 1) and start > 0):
            return
        self.num_computed = start
        self.carries_hidden = False

    def fork(self) -> "SpeculationState":
        """A forked sibling's copy (it shares the parent's pages; no drafts of its own yet)."""
        return replace(self, drafts_drawn=False, pending=False, last_hidden=None, carries_hidden=False)

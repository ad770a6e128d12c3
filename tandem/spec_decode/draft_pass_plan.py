"""The proposer's messages: the draft passes rank 0's worker runs, and the end of a proposal.

Speculation's proposer (``proposer.py``) keeps the books of a proposal — which sequences catch
up or chain, their positions and page tables (their own, or the copies set aside for a chain),
the pages the next verification needs, the grammars — and hands rank 0's worker one
``DraftPassPlan`` per forward pass of the draft (``Executor.draft_pass``). The worker
(``rank_drafts.py``) runs the pass and draws the next draft of every row that wants logits, with
the sampler and the per-sequence generators it owns; the drafts so far, their distributions and
the last output of each sequence's rows stay on its device, under the sequence's key, until the
proposal ends (``ProposalEnd``, ``Executor.end_proposal``): then the drafts come back as host ids
(one copy) and their distributions stay with the worker for the verification.

An MTP layer reads the target's hidden states beside the tokens: a row names the rows of the
last step's hidden states it reads (rank 0's worker kept them), and whether its first position
reads instead the hidden state the sequence carries (the one a prefill server sent, which the
worker keeps under the sequence's key from ``Executor.keep_carried_hidden`` until the proposal
that reads it ends, or the sequence does).

Everything here is host values: ints, lists, parameters, the grammar bitmask as a numpy array.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tandem.sampling_params import SamplingParams


@dataclass
class DraftPassRow:
    """A run of consecutive positions of one sequence in a draft pass."""
    key: int  # the sequence's key (its arrival order)
    token_ids: list[int]  # a chain step's one entry is a placeholder: the key's last draft, on the worker
    start: int  # position of the first token
    page_tables: list[list[int]]  # per state group (only the draft's groups are read)
    wants_logits: bool = False  # draw a draft from the last position's logits
    chained: bool = False  # a chain step: its token is the key's last draft (and, MTP, its hidden input
    # the key's last output)
    carried: bool = False  # MTP: the first position reads the key's carried hidden state
    target_rows: Optional[tuple[int, int]] = None  # MTP: [first, end) rows of the last step's hidden states
    keep_last_hidden: bool = False  # MTP, PD prefill: return the last position's hidden input (host)


@dataclass
class DraftPassPlan:
    """One forward pass of the draft over ``rows``; the rows that want logits draw, in row order,
    under their parameters (``params``/``seeds``: one per drawing row) and grammar masks."""
    rows: list[DraftPassRow]
    params: list[SamplingParams] = field(default_factory=list)
    seeds: list[Optional[int]] = field(default_factory=list)
    token_bitmask: Optional[np.ndarray] = None  # [drawing rows, words] int32; None: none constrained
    return_tokens: bool = False  # answer with the drawn ids (host): a grammar needs the drafts so far
    begins: bool = False  # the first pass of a proposal (what an earlier, failed one left goes)


@dataclass
class ProposalEnd:
    """The end of a proposal: ``keys`` in the order their drafts come back. Each key's drafts'
    distributions stay with the worker (replacing its earlier ones; none where its drafts were
    not drawn), and its carried hidden state goes."""
    keys: list[int]


@dataclass
class ProposalOutput:
    """Per key of ``ProposalEnd``: its drafts, and (rows that asked) the hidden input of the last
    position, as host floats (empty: none)."""
    token_ids: list[list[int]]
    last_hidden: list[tuple[float, ...]]

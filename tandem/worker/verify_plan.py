"""The verification message: which drafts of a speculating step rank 0's worker accepts.

Speculative decoding (``tandem/spec_decode/verify.py``) builds one ``VerifyPlan`` per speculating
step from the books (the sequences' drafts, parameters, keys and seeds, the penalties' token ids,
min_tokens' banned ids and the grammar's mask of every row) and hands it to the executor
(``Executor.verify``); rank 0's worker runs it on the logits of the forward pass it ran last
(``Worker.verify``, ``worker/rank_verification.py``), with the sampler and the per-sequence
generators it owns, and the draft distributions it keeps (``RankSampling.keep_draft_probs``).
The plan is host-only — ints, lists, parameters, the bitmask as a numpy array — and so is the
``VerifyOutput`` it gets back (one device-to-host copy).

Item ``i`` (one sequence) has ``1 + len(draft_token_ids[i])`` logits rows, from
``logits_rows[i]`` on: row ``j`` is the target's distribution after the item's first ``j``
drafts. Per-row lists run item by item, each item's rows in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tandem.sampling_params import SamplingParams
from tandem.worker.host_logprobs import HostLogprobs


@dataclass
class VerifyPlan:
    # -- per item -------------------------------------------------------------------------------
    keys: list[int]  # each item's sequence key (its generator's, its draft distributions')
    params: list[SamplingParams]
    seeds: list[Optional[int]]
    logits_rows: list[int]  # the item's first logits row (after its last known token)
    draft_token_ids: list[list[int]]
    drawn: list[bool]  # its drafts were drawn: the worker keeps their distributions q (else q = 1)
    # -- per row (penalties' token ids: empty lists when no row has penalties) ---------------------
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)  # the output, then the row's drafts
    banned_token_ids: list[list[int]] = field(default_factory=list)
    token_bitmask: Optional[np.ndarray] = None  # [rows, words] int32, after the row's drafts; None: unmasked
    # TANDEM_SIMULATE_ACCEPT_LEN (benchmarks): each item's accepted drafts, decided by the books
    simulated_accepted: Optional[list[int]] = None
    num_top_logprobs: int = 0  # the most top logprobs any item asks for
    wants_logprobs: bool = False  # some item asks for logprobs

    @property
    def num_items(self) -> int:
        return len(self.keys)


@dataclass
class VerifyOutput:
    """Per item: the accepted drafts then the target's token, how many drafts it accepted, and
    (``VerifyPlan.wants_logprobs``) the logprobs of those tokens under the target's raw
    distribution, with the plan's ``num_top_logprobs`` top ones."""
    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: Optional[list[HostLogprobs]] = None

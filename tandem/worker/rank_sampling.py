"""What the sampling rank keeps between steps: the sampler, the parameter tables, the
per-sequence generators, the distributions each sequence's drafts were drawn from, and the
grammar masks' upload buffers.

Owner: rank 0's worker (``engine/ranks/worker.py``), which samples each step's sampling message
and verifies each speculating step's verification message with it; speculative decoding's
proposer and PD decode reach the sampler and the generators through it too (the engine core's
step context names it ``sampling``), and the proposer leaves its drafts' distributions here for
the verification. It knows sequences only by key (the engine core's, unique for the engine's
lifetime) and the seed their generator starts from.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from tandem.parallel.vocab_choice import VocabChoice
from tandem.sampling_params import SamplingParams
from tandem.structured.bitmask_staging import BitmaskStaging
from tandem.worker.sampler import ParameterTables, Sampler, SamplerOutput, SamplingMetadata, takes_greedy_choice


class RankSampling:
    def __init__(self, seed: Optional[int], device: torch.device, bitmask_words: int) -> None:
        self.device = device
        self.sampler = Sampler(seed=seed, device=device)  # rows without a seed share its generator
        self.tables = ParameterTables()  # the sampled rows' parameters, reused across steps
        self._generators: dict[int, torch.Generator] = {}  # sequence key -> its own generator
        self._draft_probs: dict[int, torch.Tensor] = {}  # sequence key -> [drafts, vocab] its drafts' q
        self._bitmasks = BitmaskStaging(bitmask_words, device)

    # -- generators -----------------------------------------------------------------------------
    def generator(self, key: int, seed: Optional[int]) -> Optional[torch.Generator]:
        """The sequence's own generator (made from ``seed`` the first time ``key`` appears); None
        for a sequence without a seed (it draws from the sampler's shared generator)."""
        if seed is None:
            return None
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[key] = generator
        return generator

    def generators(self, keys: Sequence[int], seeds: Sequence[Optional[int]]) -> list[Optional[torch.Generator]]:
        if seeds.count(None) == len(seeds):  # (a batch without seeds: no lookups)
            return [None] * len(seeds)
        return [self.generator(key, seed) for key, seed in zip(keys, seeds)]

    def generators_of(self, sequences) -> list[Optional[torch.Generator]]:
        """The generators of scheduler sequences (by ``arrival_order``, from ``seed``)."""
        return [self.generator(sequence.arrival_order, sequence.seed) for sequence in sequences]

    def forget(self, keys: Sequence[int]) -> None:
        """Drop the generators (and drafts' distributions) of sequences that ended."""
        for key in keys:
            self._generators.pop(key, None)
            self._draft_probs.pop(key, None)

    def live_keys(self) -> set[int]:
        """The keys that have a generator or drafts' distributions (the sanitizer's check that
        none outlives its sequence)."""
        return set(self._generators) | set(self._draft_probs)

    # -- drafts' distributions (speculative decoding) ----------------------------------------------
    def keep_draft_probs(self, key: int, probs: Optional[torch.Tensor]) -> None:
        """The distributions the sequence's new drafts were drawn from ([drafts, vocab], on the
        device; None: its drafts were not drawn, or it has none), for their verification."""
        if probs is None:
            self._draft_probs.pop(key, None)
        else:
            self._draft_probs[key] = probs

    def draft_probs(self, key: int) -> Optional[torch.Tensor]:
        return self._draft_probs.get(key)

    # -- sampling ---------------------------------------------------------------------------------
    def bitmask_to_device(self, bitmask: Optional[np.ndarray]) -> Optional[torch.Tensor]:
        """A host bitmask on the device, through the upload ring (pinned on CUDA)."""
        if bitmask is None:
            return None
        view = self._bitmasks.take(bitmask.shape[0], allow_all=False)
        np.copyto(view.numpy(), bitmask)
        return self._bitmasks.to_device(view)

    def sample(self, logits: torch.Tensor, keys: Sequence[int], params: Sequence[SamplingParams],
               seeds: Sequence[Optional[int]], prompt_token_ids: Sequence[Sequence[int]],
               output_token_ids: Sequence[Sequence[int]], banned_token_ids: Sequence[Sequence[int]],
               bitmask: Optional[np.ndarray]) -> SamplerOutput:
        """One token per row of ``logits`` (on the device, not waited for)."""
        table = self.tables.get(params, self.device)
        metadata = SamplingMetadata.build(params, self.generators(keys, seeds), prompt_token_ids, output_token_ids,
                                          banned_token_ids, self.device, table,
                                          token_bitmask=self.bitmask_to_device(bitmask))
        return self.sampler(logits, metadata)

    @staticmethod
    def greedy_from_choice(choice: VocabChoice, params: Sequence[SamplingParams],
                           banned_token_ids: Sequence[Sequence[int]], bitmask: Optional[np.ndarray]) -> SamplerOutput:
        """One token per row of ``choice`` (what the ranks gathered for a step planned to choose
        per vocabulary shard, ``parallel/vocab_choice.py``; rows already in the sampled rows'
        order): the greedy choice, its logprob and rank, and the top logprobs the rows ask for.
        The step's plan promised rows that take nothing else (``takes_greedy_choice``); a
        sampling message that asks more is an engine error, raised rather than answered from
        the wrong distribution."""
        if not all(takes_greedy_choice(p) for p in params) or bitmask is not None or any(banned_token_ids):
            raise RuntimeError("a step planned to choose greedily per vocabulary shard got a sampling message "
                               "that asks for more (sampling, penalties, a grammar or banned ids)")
        greedy, top_ids, top_logprobs = choice.merge(max((p.logprobs or 0 for p in params), default=0))
        return SamplerOutput(greedy.token_ids, greedy.logprobs, greedy.ranks, top_ids, top_logprobs,
                             packed=greedy.packed)

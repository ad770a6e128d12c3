"""The scheduler: continuous batching with chunked prefill, prefix hits and preemption.

Each step has a token budget (``max_num_batched_tokens``). Running sequences are served first,
in admission order (decodes take one token, unfinished prefills take a chunk), then waiting
sequences are admitted in arrival order while budget and ``max_num_seqs`` allow.

Preemption: when a running sequence needs pages and none are free after evicting unlocked
prefix-cache pages, the most recently admitted running sequence is preempted — its pages are
released and it goes back to the front of the waiting queue. By swap (``preemption_mode="swap"``,
with a host tier): its whole state is copied to the host tier first and comes back into fresh
pages when it is admitted again, with exactly the computed-token count it had (nothing it did
not save is re-fed); by recompute (the default without a host tier, and the fallback when the
host tier is full): it recomputes its prompt and outputs later (prefix hits make that cheap). A sequence may preempt itself, which
ends that step's scheduling. The oldest running sequence is never preempted by a younger one,
and every sequence's prompt plus ``max_tokens`` fits in the pool (checked at admission), so the
oldest always progresses: no deadlock, no livelock.

Inter-token gap target (``max_itl_ms``, ``step_time.py``): in a step with running decodes, the
prefill chunks together take at most the tokens that keep the predicted step time within the
target (at least one page); decodes are never cut. The cap changes how prompts are chunked,
never what is computed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from tandem.kv.coordinator import StateCoordinator
from tandem.scheduler.sequence import Sequence, SequenceStatus
from tandem.scheduler.step_time import InterTokenBudget

if TYPE_CHECKING:
    from tandem.kv.tiers.hierarchy import TieredState


@dataclass
class ScheduledChunk:
    sequence: Sequence
    start: int  # first position computed in this step
    num_new_tokens: int
    samples: bool  # the chunk reaches the sequence's last known token: sample after it
    prompt_logprobs: bool  # compute logprobs for the prompt tokens this chunk covers
    # Speculative decoding: the sequence's first draft tokens appended after its known tokens
    # (only when it samples); they are verified, and only the accepted ones are kept.
    num_draft_tokens: int = 0

    @property
    def num_query_tokens(self) -> int:
        """Tokens this chunk puts through the forward pass: known ones, then drafts."""
        return self.num_new_tokens + self.num_draft_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_query_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, coordinator: StateCoordinator, *, max_num_seqs: int,
                 max_num_batched_tokens: int, preemption_mode: str = "recompute",
                 max_itl_ms: float | None = None, tiers: Optional["TieredState"] = None) -> None:
        self.coordinator = coordinator
        self.tiers = tiers  # the host and disk tiers (swap, their copies, hit counts), when configured
        self.swap = preemption_mode == "swap"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: list[Sequence] = []  # PD: waiting for remote state or a destination
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.inter_token_budget = None if max_itl_ms is None else InterTokenBudget(
            max_itl_ms / 1e3, min_prefill_tokens=coordinator.page_size)
        # Prefill tokens the step being scheduled may still take (None: no cap); set by schedule().
        self._prefill_tokens_left: int | None = None
        # The keys (``Sequence.arrival_order``) of sequences ended since ``take_finished_keys``:
        # the engine core tells the sampling worker, which drops their generators.
        self._finished_keys: list[int] = []

    # -- queues -----------------------------------------------------------------------------
    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def add_remote(self, sequence: Sequence) -> None:
        """PD: hold a sequence that must not be scheduled yet (its pages, if any, stay live)."""
        sequence.status = SequenceStatus.WAITING_FOR_REMOTE
        self.remote.append(sequence)

    def release_remote(self, sequence: Sequence, running: bool) -> None:
        """PD: the held sequence may run: straight into ``running`` when its state has arrived
        (decode; it holds its pages), else to the back of the waiting queue (prefill)."""
        self.remote.remove(sequence)
        if running:
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
        else:
            sequence.status = SequenceStatus.WAITING
            self.waiting.append(sequence)

    def live_sequences(self) -> list[Sequence]:
        return self.running + list(self.waiting) + self.remote

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.remote)

    def has_runnable(self) -> bool:
        return bool(self.running or self.waiting)

    def finish(self, sequence: Sequence, reason: str, release: bool = True) -> None:
        """End a sequence wherever it is and release its state at once (``release=False``: the
        caller releases it later, once no launched step computes for it)."""
        if sequence.is_finished:
            return
        sequence.status = SequenceStatus.FINISHED
        sequence.finish_reason = reason
        self._finished_keys.append(sequence.arrival_order)
        if release:
            self.coordinator.free(sequence.state)
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence in self.remote:
            self.remote.remove(sequence)

    def pending_finished_keys(self) -> list[int]:
        """The keys of the sequences ended since ``take_finished_keys`` (read-only)."""
        return list(self._finished_keys)

    def take_finished_keys(self) -> list[int]:
        """The keys of the sequences ended since the last call (each given once)."""
        keys, self._finished_keys = self._finished_keys, []
        return keys

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self, allow_preemption: bool = True) -> SchedulerOutput | None:
        """The next step's chunks. With ``allow_preemption=False`` (a step is still running on
        the device, so no running sequence's pages may be released), returns None where a
        preemption would be needed; pages allocated so far stay with their sequences."""
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._prefill_tokens_left = allowance = self._prefill_allowance(budget)
        budget = self._schedule_running(output, budget, allow_preemption)
        if budget is None:
            return None
        if not output.preempted:
            self._admit_waiting(output, budget)
        if allowance is not None and self._prefill_tokens_left == 0 and output.num_tokens < self.max_num_batched_tokens:
            self.inter_token_budget.count_capped_step()  # prefill used its allowance, the budget had room left
        return output

    def record_step(self, num_tokens: int, seconds: float, with_prefill: bool = False) -> None:
        """A completed step's tokens and duration (from its start, or the previous step's
        completion if later, to its tokens' read-back: what a running decode waited), and
        whether it held a prompt chunk."""
        if self.inter_token_budget is not None:
            self.inter_token_budget.observe(num_tokens, seconds, with_prefill)

    def _prefill_allowance(self, budget: int) -> int | None:
        """The prefill tokens this step may take under the inter-token gap target (None: no cap)."""
        if self.inter_token_budget is None:
            return None
        decode_tokens = sum(1 + len(sequence.draft_token_ids) for sequence in self.running
                            if self._is_decoding(sequence) and not sequence.awaits_final_token)
        return self.inter_token_budget.prefill_tokens(decode_tokens, budget)

    @staticmethod
    def _is_decoding(sequence: Sequence) -> bool:
        """Its next chunk is one token (a decode), not part of a prompt or of a recomputation."""
        return sequence.num_tokens - sequence.num_computed_tokens <= 1

    def _chunk(self, sequence: Sequence, budget: int) -> ScheduledChunk:
        start = sequence.num_computed_tokens
        if self._prefill_tokens_left is not None and not self._is_decoding(sequence):
            budget = min(budget, self._prefill_tokens_left)
        num_new = min(sequence.num_tokens - start, budget)
        samples = start + num_new == sequence.num_tokens
        return ScheduledChunk(sequence=sequence, start=start, num_new_tokens=num_new, samples=samples,
                              prompt_logprobs=sequence.wants_prompt_logprobs
                              and start < sequence.num_prompt_tokens,
                              num_draft_tokens=min(len(sequence.draft_token_ids), budget - num_new) if samples else 0)

    def _schedule_running(self, output: SchedulerOutput, budget: int, allow_preemption: bool = True) -> int | None:
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            index += 1
            if sequence.awaits_final_token:
                continue
            chunk = self._chunk(sequence, budget)
            if chunk.num_new_tokens == 0:
                continue  # a prompt chunk, and this step's prefill tokens are spent
            target = chunk.start + chunk.num_query_tokens
            while not self.coordinator.try_allocate(sequence.state, target):
                if not allow_preemption:
                    return None
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is sequence:
                    return budget
            output.chunks.append(chunk)
            budget -= chunk.num_query_tokens
            self._take_prefill(sequence, chunk)
        return budget

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and self._prefill_tokens_left != 0:
            sequence = self.waiting[0]
            swapped = sequence.state.swapped
            if swapped is not None:
                if not self.tiers.swap_in(sequence.state):
                    if not self.running:
                        if self._wait_for_tier_copies():
                            continue
                        if not self.coordinator.inflight.any():
                            raise RuntimeError("scheduler: a swapped sequence cannot fit an empty pool")
                    return
                sequence.num_computed_tokens = swapped.num_computed_tokens
            else:
                if self._prefix_loading(sequence):
                    return  # its prefix is coming from the disk store; the running ones step meanwhile
                self._match_prefix(sequence)
            chunk = self._chunk(sequence, budget)
            target = chunk.start + chunk.num_query_tokens
            if not self.coordinator.try_allocate(sequence.state, target):
                empty = not self.running and sequence.num_computed_tokens == 0
                self._release(sequence)
                if not self.running and self._wait_for_tier_copies():
                    continue  # pages held by tier copies come back once they complete
                if empty and not self.coordinator.inflight.any():  # (held pages come back: wait)
                    raise RuntimeError("scheduler: an admitted sequence cannot fit an empty pool")
                return
            self.waiting.popleft()
            if swapped is not None:
                self.tiers.commit_swap_in(sequence.state)
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            output.chunks.append(chunk)
            budget -= chunk.num_query_tokens
            self._take_prefill(sequence, chunk)

    def _take_prefill(self, sequence: Sequence, chunk: ScheduledChunk) -> None:
        """Count a scheduled chunk against the step's prefill cap (decodes do not count)."""
        if self._prefill_tokens_left is not None and not self._is_decoding(sequence):
            self._prefill_tokens_left = max(0, self._prefill_tokens_left - chunk.num_new_tokens)

    def _wait_for_tier_copies(self) -> bool:
        """With nothing running, pages still held by tier copies are the only ones that can
        come back: wait for the copies (True) — or there are none (False)."""
        tiers = self.tiers
        if tiers is None or not tiers.copies_in_flight:
            return False
        tiers.drain()
        return True

    def _prefix_loading(self, sequence: Sequence) -> bool:
        if any(sequence.state.page_tables) or sequence.wants_prompt_logprobs:
            return False
        return self.coordinator.prefix_hits.loading(sequence.state, sequence.token_ids, idle=not self.running)

    def _match_prefix(self, sequence: Sequence) -> None:
        if any(sequence.state.page_tables) or sequence.wants_prompt_logprobs:
            if sequence.num_cached_tokens < 0:
                sequence.num_cached_tokens = 0
            return
        hit = self.coordinator.prefix_hits.match(sequence.state, sequence.token_ids)
        sequence.num_computed_tokens = hit
        if sequence.num_cached_tokens < 0:
            sequence.num_cached_tokens = hit
            self.prefix_hit_tokens += hit
            if self.tiers is not None:
                self.tiers.count_hit(sequence.state.cache_path)
            self.prefix_query_tokens += sequence.num_prompt_tokens

    def _release(self, sequence: Sequence) -> None:
        """Release the sequence's device pages (a swapped-out copy stays for its next admission)."""
        self.coordinator.free(sequence.state, keep_swapped=True)
        sequence.num_computed_tokens = 0

    def _preempt(self, sequence: Sequence) -> None:
        swapped = self.swap and self.tiers is not None and self.tiers.swap_out(
            sequence.state, sequence.num_computed_tokens)
        self._release(sequence)
        sequence.status = SequenceStatus.WAITING
        sequence.num_preemptions += 1
        if not swapped and sequence.prompt_logprobs is not None \
                and len(sequence.prompt_logprobs) < sequence.num_prompt_tokens:
            sequence.prompt_logprobs = None
        self.num_preemptions += 1
        self.waiting.appendleft(sequence)

    # -- after the forward pass ------------------------------------------------------------------
    def on_computed(self, chunk: ScheduledChunk, num_computed: int | None = None) -> None:
        """Book the chunk as computed: its known tokens, or ``num_computed`` in all (speculative
        decoding: the accepted drafts too, or fewer where a group rolled back)."""
        sequence = chunk.sequence
        sequence.num_computed_tokens = chunk.start + chunk.num_new_tokens if num_computed is None else num_computed
        self.coordinator.prefix_hits.cache_computed_pages(sequence.state, sequence.token_ids,
                                                          sequence.num_computed_tokens)
        # After caching (the cache takes pages only while the sequence holds them all): release
        # pages no future step reads, e.g. those before a sliding window.
        self.coordinator.drop_unneeded_pages(sequence.state, sequence.num_computed_tokens)

    def place_fork(self, child: Sequence, forked: bool) -> None:
        """Queue a forked sibling: running if it got the parent's state and a seat is free."""
        if forked and len(self.running) < self.max_num_seqs:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.appendleft(child)


def holds_prompt_chunk(chunks) -> bool:
    """Whether a step's chunks include part of a prompt (or of a recomputation): more than one
    new token for a sequence, where a decode has one."""
    return any(chunk.num_new_tokens > 1 for chunk in chunks)

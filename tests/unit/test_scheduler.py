"""The scheduler on hand-built sequences (no model; a "step" books each chunk as computed and
appends a token a deterministic sampler picks): the token budget, chunked prefill, admission in
arrival order under the seat limit, preemption by recompute (newest first, the oldest always
progresses, outputs unchanged by it), prefix hits of whole pages, eviction before preemption,
and a step that may not preempt. The sanitizer's books are checked after every step, and every
page is free at the end."""
from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.scheduler.sequence import SequenceStatus
from tests.support.books import FULL, check_books, make_coordinator, make_scheduler, make_sequence

PAGE_SIZE = 4


def sampled_token(position: int) -> int:
    """The token "sampled" at ``position``: a function of the position alone, so a sequence
    recomputed after preemption must end with exactly the tokens of an undisturbed run."""
    return 1000 + position


def step(scheduler, allow_preemption: bool = True) -> dict[str, tuple[int, int]]:
    """Schedule and book one step; finish sequences at their ``max_tokens``. Returns request id
    -> (first position, tokens) for each chunk, after checking the books."""
    output = scheduler.schedule(allow_preemption)
    chunks = {}
    for chunk in output.chunks:
        sequence = chunk.sequence
        assert chunk.start == sequence.num_computed_tokens and chunk.num_new_tokens > 0
        assert chunk.start + chunk.num_new_tokens <= sequence.num_tokens
        assert chunk.samples == (chunk.start + chunk.num_new_tokens == sequence.num_tokens)
        scheduler.on_computed(chunk)
        chunks[sequence.request_id] = (chunk.start, chunk.num_new_tokens)
        if chunk.samples:
            sequence.token_ids.append(sampled_token(sequence.num_tokens))
            if sequence.num_output_tokens >= sequence.max_tokens:
                scheduler.finish(sequence, "length")
    assert output.num_tokens <= scheduler.max_num_batched_tokens
    check_books(scheduler.coordinator, [sequence.state for sequence in scheduler.live_sequences()])
    return chunks


def finish_all(scheduler) -> None:
    for sequence in scheduler.live_sequences():
        scheduler.finish(sequence, "abort")
    scheduler.coordinator.prefix_hits.reset()
    scheduler.coordinator.sanitizer.check_all_free(scheduler.coordinator)


def prompt(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


def test_budget_chunks_and_admission_in_arrival_order_under_the_seat_limit():
    coordinator = make_coordinator({"attention": FULL}, max_total_tokens=256)
    scheduler = make_scheduler(coordinator, max_num_seqs=2, max_num_batched_tokens=32)
    first, second, third = (make_sequence(coordinator, name, prompt(10, length), order, max_tokens=3)
                            for order, (name, length) in enumerate((("a", 50), ("b", 10), ("c", 5))))
    for sequence in (first, second, third):
        scheduler.add(sequence)

    assert step(scheduler) == {"a": (0, 32)}  # the budget cuts the first prompt into chunks
    assert step(scheduler) == {"a": (32, 18), "b": (0, 10)}  # running first, then admitted in order
    assert third.status is SequenceStatus.WAITING  # two seats, both taken
    assert step(scheduler) == {"a": (50, 1), "b": (10, 1)}  # decodes: one token each
    scheduler.finish(first, "abort")
    assert first.is_finished and not first.state.page_tables[0]  # its pages are released at once
    assert step(scheduler) == {"b": (11, 1), "c": (0, 5)}  # the seat is free again
    assert second.is_finished and second.output_token_ids == [sampled_token(n) for n in (10, 11, 12)]
    assert step(scheduler) == {"c": (5, 1)}
    assert step(scheduler) == {"c": (6, 1)} and third.is_finished and not scheduler.has_unfinished()
    assert scheduler.num_preemptions == 0
    finish_all(scheduler)


def test_preemption_by_recompute_takes_the_newest_and_leaves_outputs_unchanged():
    # 12 pages of 4 tokens for four sequences that each grow to 18 tokens (5 pages): preemption.
    coordinator = make_coordinator({"attention": FULL}, max_total_tokens=48)
    scheduler = make_scheduler(coordinator, max_num_seqs=8, max_num_batched_tokens=32)
    lengths = (10, 9, 11, 7)
    sequences = [make_sequence(coordinator, name, prompt(100 * order, length), order, max_tokens=8)
                 for order, (name, length) in enumerate(zip("abcd", lengths))]
    for sequence in sequences:
        scheduler.add(sequence)
    preempted = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        running_before = list(scheduler.running)
        step(scheduler)
        preempted_now = [sequence for sequence in running_before if sequence.status is SequenceStatus.WAITING]
        for sequence in preempted_now:
            assert sequence.num_computed_tokens == 0 and not any(sequence.state.page_tables)
            assert sequence in scheduler.waiting
        admitted = [sequence for sequence in scheduler.running if sequence not in running_before]
        assert not (preempted_now and admitted), "a step that preempted also admitted"
        preempted += [sequence.request_id for sequence in preempted_now]
    assert not scheduler.has_unfinished(), "no progress: livelock"
    assert scheduler.num_preemptions == len(preempted) > 0
    assert "a" not in preempted  # the oldest is never preempted by a younger one
    for sequence in sequences:  # recomputation changes nothing that was sampled
        expected = [sampled_token(position) for position in range(sequence.num_prompt_tokens,
                                                                  sequence.num_prompt_tokens + 8)]
        assert sequence.output_token_ids == expected and sequence.finish_reason == "length"
    finish_all(scheduler)


def test_prefix_hits_take_whole_pages_and_eviction_comes_before_preemption():
    coordinator = make_coordinator({"attention": FULL}, max_total_tokens=64, prefix_caching=True)
    scheduler = make_scheduler(coordinator, max_num_seqs=8, max_num_batched_tokens=64)
    shared = prompt(500, 20)  # five whole pages
    writer = make_sequence(coordinator, "writer", shared, 0, max_tokens=1)
    scheduler.add(writer)
    assert step(scheduler) == {"writer": (0, 20)} and writer.is_finished and writer.num_cached_tokens == 0
    assert coordinator.prefix_cache.num_nodes == 5

    # The same prompt hits four pages (one token is left to compute); a prompt sharing 10
    # tokens hits two; one that wants prompt logprobs computes everything.
    same = make_sequence(coordinator, "same", shared, 1, max_tokens=2)
    partial = make_sequence(coordinator, "partial", shared[:10] + prompt(900, 6), 2, max_tokens=2)
    logprobs = make_sequence(coordinator, "logprobs", shared, 3, max_tokens=2)
    logprobs.params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    for sequence in (same, partial, logprobs):
        scheduler.add(sequence)
    assert step(scheduler) == {"same": (16, 4), "partial": (8, 8), "logprobs": (0, 20)}
    assert (same.num_cached_tokens, partial.num_cached_tokens, logprobs.num_cached_tokens) == (16, 8, 0)
    assert scheduler.prefix_hit_tokens == 24 and scheduler.prefix_query_tokens == 20 + 20 + 16  # not the one wanting logprobs
    assert same.state.page_tables[0][:4] == [node.pages[0] for node in same.state.cache_path[:4]]
    while scheduler.has_unfinished():
        step(scheduler)

    # The pool is full of cached pages nobody holds: a long prompt evicts them, preempting nobody.
    free_before = coordinator.pools[0].num_free
    assert free_before < 16
    assert coordinator.prefix_hits.evictable_pages() == [coordinator.pools[0].num_usable - free_before]
    long = make_sequence(coordinator, "long", prompt(2000, 60), 4, max_tokens=1)
    scheduler.add(long)
    assert step(scheduler) == {"long": (0, 60)} and scheduler.num_preemptions == 0
    finish_all(scheduler)


def test_a_step_that_may_not_preempt_returns_none_and_keeps_pages():
    """While a launched step still computes (the overlapped loop), no running sequence's pages
    may be released: where the next step would need a preemption, scheduling stops instead."""
    coordinator = make_coordinator({"attention": FULL}, max_total_tokens=16)  # four pages
    scheduler = make_scheduler(coordinator, max_num_seqs=4, max_num_batched_tokens=32)
    older, newer = (make_sequence(coordinator, name, prompt(10 * order, 8), order, max_tokens=8)
                    for order, name in enumerate("ab"))
    scheduler.add(older)
    scheduler.add(newer)
    assert step(scheduler) == {"a": (0, 8), "b": (0, 8)}  # all four pages taken
    held = [list(sequence.state.page_tables[0]) for sequence in (older, newer)]
    assert scheduler.schedule(allow_preemption=False) is None  # "a" needs a fifth page
    assert [sequence.state.page_tables[0] for sequence in (older, newer)] == held
    assert newer.status is SequenceStatus.RUNNING and scheduler.num_preemptions == 0
    assert step(scheduler) == {"a": (8, 1)}  # allowed now: "b" goes back to waiting
    assert scheduler.num_preemptions == 1 and newer.status is SequenceStatus.WAITING
    finish_all(scheduler)

"""The greedy choice made per vocabulary shard (``tandem/parallel/vocab_choice.py``) against the
sampler's general path over the whole logits: two ranks as threads exchanging their parts, each
holding its slice of the vocabulary (the last one short, padded past the vocabulary as the LM
head pads it), with and without top logprobs (as many as the short slice's columns); and the LM
head's rule for when it gathers the logits instead."""
from __future__ import annotations

import threading

import pytest
import torch

from tandem.kernels.greedy_choice import PART_SIZE
from tandem.parallel.vocab_choice import shard_choice
from tandem.worker.sampler import compute_logprobs


class ThreadShard:
    """One of two ranks in threads: ``all_gather`` concatenates both ranks' tensors along the last
    dimension in rank order, as ``TensorShard.all_gather`` does."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.slots, self.barrier = rank, 2, slots, barrier

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = tensor
        self.barrier.wait()
        gathered = torch.cat(list(self.slots), dim=-1)
        self.barrier.wait()
        return gathered


def choose(logits: torch.Tensor, top: int, padding: float = 99.0):
    """Rank 0's ``VocabChoice`` of ``logits`` split over two ranks (the padding columns hold a
    logit that would win if they counted; ``top`` at most the second rank's columns)."""
    vocab = logits.shape[1]
    rows = -(-vocab // 2)
    padded = torch.cat([logits, torch.full((logits.shape[0], 2 * rows - vocab), padding)], dim=1)
    columns = [max(0, min(rows, vocab - rank * rows)) for rank in range(2)]
    slots, barrier, results = [None, None], threading.Barrier(2, timeout=60), [None, None]

    def rank(number: int) -> None:
        local = padded[:, number * rows:(number + 1) * rows]
        results[number] = shard_choice(local, number * rows, columns[number], top, ThreadShard(number, slots, barrier))

    threads = [threading.Thread(target=rank, args=(number,)) for number in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results[0]


@pytest.mark.parametrize("vocab,top", [(2 * PART_SIZE + 1001, 0), (2 * PART_SIZE + 1001, 5), (9, 4)])
def test_shard_choice_equals_the_whole_logits(vocab, top):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[0, [vocab - 2, 1]] = 30.0  # a tie across the slices: the first index wins
    logits[1, : vocab // 2] = float("-inf")
    choice = choose(logits, top)
    greedy, top_ids, top_logprobs = choice.merge(top)
    expected_ids = logits.argmax(dim=-1)
    assert torch.equal(greedy.token_ids, expected_ids) and greedy.token_ids[0].item() == 1
    logprobs, ranks, expected_top_ids, expected_top = compute_logprobs(logits, expected_ids, top)
    torch.testing.assert_close(greedy.logprobs, logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy.ranks, ranks)
    if top == 0:
        assert top_ids is None and top_logprobs is None
        return
    assert top_ids.shape == expected_top_ids.shape == (4, top)
    torch.testing.assert_close(top_logprobs, expected_top, rtol=1e-5, atol=1e-5)
    for row in range(4):  # (ties may come in either order)
        assert sorted(top_ids[row].tolist()) == sorted(expected_top_ids[row].tolist()), row
    with pytest.raises(ValueError, match="top logprobs asked"):
        choice.merge(top + 1)
    assert torch.equal(choice.rows([2, 0]).merge(top)[0].token_ids, expected_ids[[2, 0]])


def test_the_head_gathers_logits_for_more_tops_than_a_rank_has_columns():
    from tandem.parallel.layers import ParallelLMHead
    from tandem.parallel.shard import TensorShard

    head = ParallelLMHead(8, 9, TensorShard(1, 2))  # columns 5 and 4
    assert head.rank_columns == [5, 4] and head.first == 5
    assert head.chooses(4) and not head.chooses(5)


def test_rank_zero_refuses_a_sampling_message_asking_more_than_the_plan():
    """A step planned to choose per shard whose sampling message asks for sampling, penalties or
    banned ids raises (rather than answering from the wrong distribution); a greedy one with top
    logprobs within what was gathered is answered, its tops in the sampler's layout."""
    from tandem.sampling_params import SamplingParams
    from tandem.worker.rank_sampling import RankSampling
    from tandem.worker.sampler import takes_greedy_choice

    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    choice = choose(logits, 3)
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    output = RankSampling.greedy_from_choice(choice, [greedy, greedy], [[], []], None)
    assert torch.equal(output.token_ids, logits.argmax(-1)) and output.top_token_ids.shape == (2, 2)
    for params, banned in ((SamplingParams(temperature=0.7), []), (SamplingParams(temperature=0.0, min_tokens=2), [5]),
                           (SamplingParams(temperature=0.0, repetition_penalty=1.1), [])):
        assert not takes_greedy_choice(params)
        with pytest.raises(RuntimeError, match="asks for more"):
            RankSampling.greedy_from_choice(choice, [params, greedy], [banned, []], None)

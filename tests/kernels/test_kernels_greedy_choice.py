"""The greedy choice kernels (``tandem/kernels/greedy_choice.py``) against their reference and
the sampler's general path: interpreted on CPU (ties across and within parts, -inf logits, a
partial last part, float32 and bfloat16), and on a GPU (``-m gpu``) through the sampler at a
128k vocabulary, against the same sampler taking its general path."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.greedy_choice import (PART_SIZE, greedy_choice, greedy_choice_reference, greedy_summaries,
                                          merge_summaries)
from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import Sampler, SamplingMetadata, compute_logprobs, takes_greedy_kernels
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)


def tricky_logits(rows: int, vocab: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Random logits where the row's maximum appears twice (row 0: in two parts, row 1: twice in
    one part), sits in the partial last part (row 2) among -inf logits, or is alone (others)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4
    logits[0, [PART_SIZE + 5, 3]] = 30.0
    logits[1, [PART_SIZE - 7, PART_SIZE - 70]] = 25.0
    logits[2, : vocab // 2] = float("-inf")
    logits[2, vocab - 2] = 20.0
    return logits.to(dtype).to(device)


def assert_same_choice(actual, expected, tolerance):
    assert torch.equal(actual.token_ids, expected.token_ids)
    torch.testing.assert_close(actual.logprobs, expected.logprobs, rtol=tolerance, atol=tolerance)
    assert torch.equal(actual.ranks, torch.ones_like(expected.ranks)) and torch.equal(actual.ranks, expected.ranks)
    torch.testing.assert_close(actual.packed, expected.packed, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_choice_equals_reference(dtype):
    vocab = 2 * PART_SIZE + 1000  # two whole parts and a partial one
    logits = tricky_logits(4, vocab, dtype)
    expected = greedy_choice_reference(logits)
    actual = greedy_choice(logits, kernels=True)
    assert actual.token_ids.tolist()[:3] == [3, PART_SIZE - 70, vocab - 2]  # the first of a tie wins
    assert_same_choice(actual, expected, 1e-5)
    assert expected.logprobs[2] > expected.logprobs[3]  # the -inf logits carry no mass
    # The sampler's general path gives the same logprob and rank.
    chosen, ranks, _, _ = compute_logprobs(logits, actual.token_ids, 0)
    torch.testing.assert_close(actual.logprobs, chosen, rtol=1e-5, atol=1e-5)
    assert torch.equal(actual.ranks, ranks)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        greedy_choice(logits.t(), kernels=True)


@pytest.mark.parametrize("kernels,vocab", [(True, 2 * PART_SIZE + 1001), (False, 2 * PART_SIZE + 1001),
                                          (True, 2 * PART_SIZE + 1)])
def test_vocabulary_slices_summaries_merge_into_the_whole_choice(kernels, vocab):
    """Two ranks' slices of a vocabulary (the second padded past it, as the LM head's slices
    are), each summarised from its first index, merge into the whole vocabulary's choice; with
    the Triton kernels (interpreted) and with the plain-PyTorch path a CPU takes. The slices'
    summaries have one shape (the ranks gather them) even where the padding leaves the second
    with a part fewer of real columns (2 * PART_SIZE + 1: 4,097 columns and 4,096)."""
    logits = tricky_logits(4, vocab, torch.float32)
    half = -(-vocab // 2)
    padded = torch.cat([logits, torch.full((4, 2 * half - vocab), 99.0)], dim=1)  # would win if counted
    slices = [greedy_summaries(padded[:, rank * half:(rank + 1) * half].contiguous(), index_base=rank * half,
                               columns=min(half, vocab - rank * half), kernels=kernels) for rank in range(2)]
    assert slices[0].shape == slices[1].shape
    merged = merge_summaries(torch.cat(slices, dim=-1), kernels=kernels)
    assert merged.token_ids.tolist()[:3] == [3, PART_SIZE - 70, vocab - 2]
    assert_same_choice(merged, greedy_choice_reference(logits), 1e-5)


def metadata(rows: int, device, **params) -> SamplingMetadata:
    sampling = [SamplingParams(temperature=0.0, **params) for _ in range(rows)]
    return SamplingMetadata.build(sampling, [None] * rows, [[1, 2]] * rows, [[3]] * rows, [[]] * rows, device)


def test_sampler_takes_the_kernels_only_when_nothing_else_is_asked():
    logits = torch.zeros(2, 10)
    assert not takes_greedy_kernels(logits, metadata(2, "cpu"))  # CPU: the general path
    if torch.cuda.is_available():
        cuda_logits = logits.cuda()
        assert takes_greedy_kernels(cuda_logits, metadata(2, "cuda"))
        assert not takes_greedy_kernels(cuda_logits, metadata(2, "cuda", logprobs=2))
        assert not takes_greedy_kernels(cuda_logits, metadata(2, "cuda", repetition_penalty=1.2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_sampler_greedy_kernels_on_gpu(rows):
    logits = tricky_logits(max(rows, 4), 128256, torch.bfloat16, "cuda")[:rows]
    fast = Sampler(seed=0, device="cuda")(logits, metadata(rows, "cuda"))
    assert fast.packed is not None
    general = Sampler(seed=0, device="cuda")(logits, metadata(rows, "cuda", logprobs=1))
    assert general.packed is None
    assert torch.equal(fast.token_ids, general.token_ids) and torch.equal(fast.ranks, general.ranks)
    torch.testing.assert_close(fast.logprobs, general.logprobs, rtol=1e-5, atol=1e-5)
    host = fast.to_host()
    assert host.token_ids.tolist() == general.token_ids.tolist()
    torch.testing.assert_close(host.logprobs, general.logprobs.cpu(), rtol=1e-5, atol=1e-5)

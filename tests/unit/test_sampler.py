"""Sampler tests: every processing step against a plain per-row reference, and the sampler's
contracts (greedy, logprobs, per-request seeds, distribution, banned ids, dtypes)."""
import os

os.environ["TANDEM_SANITIZE"] = "1"

import random

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_banned_tokens,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
)

VOCAB_SIZE = 64
NEG_INF = float("-inf")


# ---------------------------------------------------------------- plain per-row references


def reference_penalties(row, prompt, output, presence, frequency, repetition):
    row = row.clone()
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


def reference_top_k(row, k):
    if k <= 0 or k >= row.numel():
        return row.clone()
    kth_largest = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth_largest, row, torch.full_like(row, NEG_INF))


def reference_top_p(row, p):
    if p >= 1:
        return row.clone()
    probs = torch.softmax(row, dim=-1).tolist()
    result = torch.full_like(row, NEG_INF)
    mass_before = 0.0
    for token in sorted(range(row.numel()), key=lambda t: -probs[t]):
        if mass_before >= p:
            break
        result[token] = row[token]
        mass_before += probs[token]
    return result


def reference_min_p(row, min_p):
    probs = torch.softmax(row, dim=-1)
    keep = probs >= min_p * probs.max()
    return torch.where(keep, row, torch.full_like(row, NEG_INF))


def reference_sample_row(row, params: SamplingParams, prompt, output, banned, noise):
    """The whole pipeline for one row; ``noise`` is the row's Exp(1) draw (unused if greedy)."""
    row = reference_penalties(row.float(), prompt, output, params.presence_penalty,
                              params.frequency_penalty, params.repetition_penalty)
    for token in banned:
        row[token] = NEG_INF
    if params.temperature == 0:
        return int(row.argmax())
    row = reference_top_p(reference_top_k(row / params.temperature, params.top_k), params.top_p)
    row = reference_min_p(row, params.min_p)
    return int((torch.softmax(row, dim=-1) / noise).argmax())


# ---------------------------------------------------------------- helpers


def random_params(rng: random.Random, **fixed) -> SamplingParams:
    values = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_p=rng.choice([1.0, 0.9, 0.6]),
        top_k=rng.choice([0, 1, 5, 20]),
        min_p=rng.choice([0.0, 0.05, 0.2]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.4]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
    )
    values.update(fixed)
    return SamplingParams(**values)


def random_ids(rng: random.Random, max_length: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(max_length + 1))]


def make_metadata(params, prompts=None, outputs=None, banned=None, generators=None) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(
        params,
        generators if generators is not None else [None] * rows,
        prompts if prompts is not None else [[] for _ in range(rows)],
        outputs if outputs is not None else [[] for _ in range(rows)],
        banned if banned is not None else [[] for _ in range(rows)],
        device="cpu",
    )


def random_logits(rows: int, seed: int, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- processing steps


def test_penalties_match_reference():
    rng = random.Random(1)
    params = [random_params(rng) for _ in range(8)]
    prompts = [random_ids(rng, 30) for _ in params]
    outputs = [random_ids(rng, 30) for _ in params]
    logits = random_logits(len(params), seed=1)
    metadata = make_metadata(params, prompts, outputs)
    result = apply_penalties(logits.clone(), metadata)
    for row, p in enumerate(params):
        expected = reference_penalties(logits[row], prompts[row], outputs[row], p.presence_penalty,
                                       p.frequency_penalty, p.repetition_penalty)
        torch.testing.assert_close(result[row], expected)


def test_penalties_ignore_ids_outside_logits():
    """Ids beyond the logits' width (e.g. added tokens of a padded vocabulary) are skipped."""
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)]
    logits = random_logits(1, seed=2)
    result = apply_penalties(logits.clone(), make_metadata(params, [[3, VOCAB_SIZE + 5]], [[VOCAB_SIZE]]))
    expected = reference_penalties(logits[0], [3], [], 0.0, 1.0, 2.0)
    torch.testing.assert_close(result[0], expected)


def test_banned_tokens_masked():
    logits = random_logits(3, seed=3)
    banned = [[0, 5, 5], [], [VOCAB_SIZE - 1]]
    result = apply_banned_tokens(logits.clone(), banned)
    for row, ids in enumerate(banned):
        expected = logits[row].clone()
        expected[ids] = NEG_INF
        torch.testing.assert_close(result[row], expected)


def test_temperature_divides_sampled_rows_only():
    logits = random_logits(3, seed=4)
    temperature = torch.tensor([0.0, 0.5, 2.0])
    result = apply_temperature(logits.clone(), temperature)
    torch.testing.assert_close(result[0], logits[0])
    torch.testing.assert_close(result[1], logits[1] / 0.5)
    torch.testing.assert_close(result[2], logits[2] / 2.0)


@pytest.mark.parametrize("top_p_values", [[1.0] * 6, [0.9, 0.5, 0.99, 0.2, 1.0, 0.7]])
def test_top_k_top_p_match_reference(top_p_values):
    top_k_values = [0, 1, 3, 17, VOCAB_SIZE, VOCAB_SIZE + 10]
    logits = random_logits(6, seed=5)
    result = apply_top_k_top_p(logits.clone(), torch.tensor(top_k_values), torch.tensor(top_p_values))
    for row, (k, p) in enumerate(zip(top_k_values, top_p_values)):
        expected = reference_top_p(reference_top_k(logits[row], k), p)
        torch.testing.assert_close(result[row], expected)


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    result = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(result[0]).tolist() == [False, True, False, True, False, False]


def test_top_p_always_keeps_top_token():
    logits = random_logits(4, seed=6)
    result = apply_top_k_top_p(logits.clone(), torch.zeros(4, dtype=torch.int64), torch.full((4,), 1e-6))
    assert (torch.isfinite(result).sum(dim=-1) == 1).all()
    assert torch.equal(result.argmax(dim=-1), logits.argmax(dim=-1))


def test_min_p_matches_reference():
    min_p_values = [0.0, 0.01, 0.1, 0.5, 1.0]
    logits = random_logits(len(min_p_values), seed=7)
    result = apply_min_p(logits.clone(), torch.tensor(min_p_values))
    for row, min_p in enumerate(min_p_values):
        torch.testing.assert_close(result[row], reference_min_p(logits[row], min_p))


# ---------------------------------------------------------------- the sampler


def test_sampler_matches_reference_pipeline():
    """Whole pipeline, seeded rows: the same draws give the reference's tokens."""
    rng = random.Random(8)
    params = [random_params(rng, seed=100 + row) for row in range(12)]
    prompts = [random_ids(rng, 20) for _ in params]
    outputs = [random_ids(rng, 20) for _ in params]
    banned = [random_ids(rng, 3) for _ in params]
    logits = random_logits(len(params), seed=8)
    generators = [torch.Generator().manual_seed(p.seed) for p in params]
    metadata = make_metadata(params, prompts, outputs, banned, generators)
    tokens = Sampler(seed=0)(logits, metadata).token_ids
    for row, p in enumerate(params):
        noise = torch.empty(VOCAB_SIZE).exponential_(generator=torch.Generator().manual_seed(p.seed))
        expected = reference_sample_row(logits[row], p, prompts[row], outputs[row], banned[row], noise)
        assert int(tokens[row]) == expected, f"row {row}: {p}"


def test_greedy_equals_argmax_without_sorting_or_draws(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy path must not sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    sampler = Sampler(seed=0)
    state = sampler.generator.get_state()
    logits = random_logits(5, seed=9)
    metadata = make_metadata([SamplingParams(temperature=0.0)] * 5)
    assert metadata.all_greedy
    output = sampler(logits, metadata)
    assert torch.equal(output.token_ids, logits.argmax(dim=-1))
    assert torch.equal(sampler.generator.get_state(), state)


def test_greedy_rows_take_argmax_of_penalised_logits():
    params = [SamplingParams(temperature=0.0, repetition_penalty=50.0)] * 2
    logits = random_logits(2, seed=10)
    top = logits.argmax(dim=-1).tolist()
    output = Sampler(seed=0)(logits, make_metadata(params, prompts=[[top[0]], []], outputs=[[], [top[1]]]))
    for row in range(2):
        expected = reference_penalties(logits[row], [top[0]] if row == 0 else [],
                                       [top[1]] if row == 1 else [], 0.0, 0.0, 50.0).argmax()
        assert int(output.token_ids[row]) == int(expected) != top[row]


def test_top_k_one_equals_greedy():
    rng = random.Random(11)
    penalties = [dict(presence_penalty=rng.choice([0.0, 1.0]), repetition_penalty=rng.choice([1.0, 1.5]))
                 for _ in range(6)]
    outputs = [random_ids(rng, 10) for _ in penalties]
    logits = random_logits(6, seed=11)
    sampled_params = [SamplingParams(temperature=1.3, top_k=1, **extra) for extra in penalties]
    greedy_params = [SamplingParams(temperature=0.0, **extra) for extra in penalties]
    sampled = Sampler(seed=1)(logits, make_metadata(sampled_params, outputs=outputs)).token_ids
    greedy = Sampler(seed=2)(logits, make_metadata(greedy_params, outputs=outputs)).token_ids
    assert torch.equal(sampled, greedy)


def assert_logprobs_match_reference(logits, token_ids, logprobs, ranks, top_ids, top_logprobs, num_top):
    reference = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(logprobs, reference.gather(1, token_ids.unsqueeze(1)).squeeze(1))
    order = reference.argsort(dim=-1, descending=True, stable=True)
    expected_ranks = (order == token_ids.unsqueeze(1)).int().argmax(dim=-1) + 1
    assert torch.equal(ranks, expected_ranks)
    if num_top == 0:
        assert top_ids is None and top_logprobs is None
        return
    assert torch.equal(top_ids, order[:, :num_top])
    torch.testing.assert_close(top_logprobs, reference.gather(1, order[:, :num_top]))


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_sampler_logprobs_match_log_softmax(num_logprobs):
    """Logprobs describe the raw distribution, whatever the penalties and truncation did."""
    rng = random.Random(12)
    params = [random_params(rng, logprobs=num_logprobs) for _ in range(7)]
    outputs = [random_ids(rng, 10) for _ in params]
    logits = random_logits(7, seed=12)
    output = Sampler(seed=3)(logits, make_metadata(params, outputs=outputs))
    assert output.logprobs.dtype == torch.float32 and output.ranks.dtype == torch.int64
    assert_logprobs_match_reference(logits, output.token_ids, output.logprobs, output.ranks,
                                    output.top_token_ids, output.top_logprobs, num_logprobs)


def test_compute_logprobs_for_prompt_positions():
    logits = random_logits(9, seed=13)
    token_ids = torch.randint(0, VOCAB_SIZE, (9,), generator=torch.Generator().manual_seed(13))
    results = compute_logprobs(logits, token_ids, 3)
    assert_logprobs_match_reference(logits, token_ids, *results, num_top=3)


def seeded_run(order: list[int], all_params, steps: int) -> dict[int, list[int]]:
    """Sample ``steps`` steps for the requests in ``order``; logits of a request at a step
    depend only on (request, step). Returns each request's tokens."""
    generators = {request: torch.Generator().manual_seed(all_params[request].seed)
                  for request in order if all_params[request].seed is not None}
    outputs = {request: [] for request in order}
    sampler = Sampler(seed=len(order))
    for step in range(steps):
        logits = torch.cat([random_logits(1, seed=1000 * request + step) for request in order])
        metadata = make_metadata([all_params[request] for request in order],
                                 prompts=[[request, 2 * request] for request in order],
                                 outputs=[outputs[request] for request in order],
                                 banned=[[step % VOCAB_SIZE] for _ in order],
                                 generators=[generators.get(request) for request in order])
        for request, token in zip(order, sampler(logits, metadata).token_ids.tolist()):
            outputs[request].append(token)
    return outputs


def test_seeded_rows_independent_of_batch():
    all_params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(temperature=1.2, top_k=10, min_p=0.05, frequency_penalty=0.5, seed=8),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.3, seed=9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=0.6, top_k=3, seed=None),
    ]
    steps = 20
    seeded = [0, 1, 2]
    alone = {request: seeded_run([request], all_params, steps)[request] for request in seeded}
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [3, 1, 4, 0, 6, 2, 5]):
        batched = seeded_run(order, all_params, steps)
        for request in seeded:
            assert batched[request] == alone[request], f"request {request} in order {order}"
    assert len({tuple(tokens) for tokens in alone.values()}) == len(seeded)


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (1.0, 3)])
def test_unseeded_sampling_follows_distribution(temperature, top_k):
    vocab_size, draws = 8, 20000
    logits = torch.linspace(-1.5, 1.5, vocab_size)
    scaled = logits / temperature
    if top_k:
        scaled = reference_top_k(scaled, top_k)
    expected = torch.softmax(scaled, dim=-1) * draws
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * draws
    tokens = Sampler(seed=14)(logits.expand(draws, -1), make_metadata(params)).token_ids
    counts = torch.bincount(tokens, minlength=vocab_size).float()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    chi_square = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    assert chi_square < 40, f"chi-square {chi_square:.1f} over {int(support.sum())} tokens"


def test_banned_ids_never_sampled():
    rows = 200
    logits = torch.zeros(rows, VOCAB_SIZE)
    logits[:, :4] = 20.0  # the banned ids would win almost every draw
    params = [SamplingParams(temperature=0.0 if row % 5 == 0 else 2.0, seed=row if row % 3 == 0 else None)
              for row in range(rows)]
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    banned = [[0, 1, 2, 3]] * rows
    tokens = Sampler(seed=15)(logits, make_metadata(params, banned=banned, generators=generators)).token_ids
    assert not torch.isin(tokens, torch.tensor([0, 1, 2, 3])).any()


def test_bfloat16_logits_accepted():
    rng = random.Random(16)
    params = [random_params(rng, logprobs=2) for _ in range(5)]
    logits = random_logits(5, seed=16).to(torch.bfloat16)
    output = Sampler(seed=4)(logits, make_metadata(params))
    assert output.token_ids.dtype == torch.int64 and output.logprobs.dtype == torch.float32
    assert output.top_logprobs.dtype == torch.float32
    reference = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(output.logprobs, reference.gather(1, output.token_ids.unsqueeze(1)).squeeze(1))


def test_caller_logits_not_modified():
    rng = random.Random(17)
    params = [random_params(rng, presence_penalty=1.0) for _ in range(4)]
    logits = random_logits(4, seed=17)
    before = logits.clone()
    Sampler(seed=5)(logits, make_metadata(params, outputs=[[1, 2]] * 4, banned=[[3]] * 4))
    assert torch.equal(logits, before)


def test_build_collects_rows_and_flags():
    params = [SamplingParams(temperature=0.0, top_k=-1, logprobs=3), SamplingParams(temperature=0.0)]
    metadata = make_metadata(params)
    assert metadata.all_greedy and metadata.no_penalties and metadata.no_top_k_top_p and metadata.no_min_p
    assert metadata.num_logprobs == 3 and metadata.top_k.tolist() == [0, 0]
    mixed = make_metadata([SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1, frequency_penalty=0.2)])
    assert not (mixed.all_greedy or mixed.no_penalties or mixed.no_top_k_top_p or mixed.no_min_p)
    assert mixed.num_logprobs == 0 and mixed.temperature.dtype == torch.float32
    with pytest.raises(ValueError):
        SamplingMetadata.build(params, [None], [[], []], [[], []], [[], []], "cpu")


def test_logits_rows_must_match_metadata():
    with pytest.raises(ValueError):
        Sampler()(random_logits(3, seed=18), make_metadata([SamplingParams()] * 2))


def test_sampling_row_follows_its_field_order():
    from tandem.sampling_params import SAMPLING_ROW_FIELDS

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.3,
                            frequency_penalty=-0.2, repetition_penalty=1.1)
    assert params.sampling_row == tuple(getattr(params, name) for name in SAMPLING_ROW_FIELDS)

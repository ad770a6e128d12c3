"""Teacher-forced comparison of FP8 products against the same checkpoint's dequantized weights.

Both engines score the *same* token sequences (``prompt_logprobs``), so a position's
comparison never depends on an earlier position's choice: free-running greedy decoding
diverges for good at the first near tie and then measures divergence, not kernel error.

What the comparison may allow follows from the FP8 activation quantization alone (the weights
are the same FP8 values on both sides): e4m3 keeps 3 mantissa bits, so each activation is
rounded by up to 2^-4 of itself (about 2^-4/sqrt(3) ~ 3.6% root mean square); a product over K
inputs with independent rounding errors is off by about that fraction of its own spread, and
the logits, a few layers on, by a few percent of theirs. The test models' logits have a
spread of ~3 (``OUTPUT_HEAD_GAIN``), so a token's logprob moves by ~0.1 typically and a few
tenths at the far tail, and the greedy choice can flip only where the reference's best two
tokens lie within about twice that of each other.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem import SamplingParams

TOP = 20  # prompt logprobs per position: the reference's top tokens, to measure the margin at a flip


@dataclass
class Comparison:
    """Per-position differences between two engines scoring the same sequences."""
    errors: list[float] = field(default_factory=list)  # |logprob difference| of the sequence's token
    flips: list[float] = field(default_factory=list)  # reference margin where the top-1 tokens differ
    positions: int = 0

    @property
    def agreement(self) -> float:
        return 1.0 - len(self.flips) / self.positions

    @property
    def mean_error(self) -> float:
        return sum(self.errors) / len(self.errors)

    def wide_flips(self, margin: float) -> float:
        """The fraction of positions whose top-1 tokens differ although the reference's margin
        exceeds ``margin`` (not a near tie)."""
        return sum(flip > margin for flip in self.flips) / self.positions

    def agreement_noise(self, other: "Comparison") -> float:
        """Three standard errors of the difference between two agreement fractions (each
        position a coin with this one's agreement): what sampling alone may move it by."""
        p = self.agreement
        return 3 * math.sqrt(max(p * (1 - p), 0.01) * (1 / self.positions + 1 / other.positions))

    def flip_noise(self, other: "Comparison", margin: float) -> float:
        """Three standard errors of the difference between two wide-flip fractions (each
        position a coin with this one's fraction of flips past ``margin``)."""
        p = self.wide_flips(margin)
        return 3 * math.sqrt(max(p * (1 - p), 0.0001) * (1 / self.positions + 1 / other.positions))

    def quantile(self, q: float) -> float:
        return float(torch.tensor(self.errors).quantile(q))

    def describe(self) -> str:
        worst_flip = max(self.flips, default=0.0)
        return (f"top-1 agreement {self.agreement:.4f} over {self.positions} positions ({len(self.flips)} flips, "
                f"largest reference margin at a flip {worst_flip:.3f}); |logprob error| mean "
                f"{self.mean_error:.4f}, p99 {self.quantile(0.99):.4f}, max {max(self.errors):.4f}")


def long_prompts(count: int, length: int, seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 7 * number)] for number in range(count)]


def score(llm, sequences: list[list[int]]) -> list[list[dict]]:
    """Each sequence's prompt logprobs (position 0 has none): ``{token: Logprob}`` per position."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP, ignore_eos=True)
    return [output.prompt_logprobs[1:] for output in llm.generate(sequences, params)]


def top_token(entry: dict) -> int:
    return next(token for token, logprob in entry.items() if logprob.rank == 1)


def compare(candidate: list[list[dict]], reference: list[list[dict]], sequences: list[list[int]],
            starts: Optional[list[int]] = None) -> Comparison:
    """Position by position from ``starts`` (per sequence; None: every scored position; ``len(prompt) - 1``:
    the positions that predict a continuation of ``prompt``): the sequence's token's
    logprob error, and where the two top-1 tokens differ, the reference's margin between its
    top-1 and the candidate's (infinite when the candidate's is not among the reference's top)."""
    result = Comparison()
    for number, (scored, expected, sequence) in enumerate(zip(candidate, reference, sequences)):
        for position in range(0 if starts is None else starts[number], len(sequence) - 1):
            token = sequence[position + 1]
            mine, theirs = scored[position], expected[position]
            result.errors.append(abs(mine[token].logprob - theirs[token].logprob))
            result.positions += 1
            chosen, best = top_token(mine), top_token(theirs)
            if chosen != best:
                margin = theirs[best].logprob - theirs[chosen].logprob if chosen in theirs else float("inf")
                result.flips.append(margin)
    return result


def compare_decoded(outputs, reference: list[list[dict]], prompts: list[list[int]]) -> Comparison:
    """Greedy outputs (``logprobs`` on) against the reference's scores of prompt + output: each
    generated token is the candidate's top-1 given that very prefix, so this is teacher-forced too."""
    result = Comparison()
    for output, expected, prompt in zip(outputs, reference, prompts):
        completion = output.outputs[0]
        for offset, token in enumerate(completion.token_ids):
            theirs = expected[len(prompt) - 1 + offset]
            result.errors.append(abs(completion.logprobs[offset][token].logprob - theirs[token].logprob))
            result.positions += 1
            best = top_token(theirs)
            if token != best:
                result.flips.append(theirs[best].logprob - theirs[token].logprob)
    return result


def assert_within_fp8_error(comparison: Comparison, context: str, *, agreement: float, mean_error: float,
                            tail_error: float, flip_margin: float) -> None:
    """The bounds of the module docstring: top-1 agreement at least ``agreement``; the mean
    logprob error at most ``mean_error`` and its 99th percentile at most ``tail_error``; every
    flip at a near tie (reference margin at most ``flip_margin``)."""
    assert comparison.positions > 0
    assert comparison.agreement >= agreement, f"{context}: {comparison.describe()}"
    assert comparison.mean_error <= mean_error, f"{context}: {comparison.describe()}"
    assert comparison.quantile(0.99) <= tail_error, f"{context}: {comparison.describe()}"
    assert max(comparison.flips, default=0.0) <= flip_margin, f"{context}: {comparison.describe()}"

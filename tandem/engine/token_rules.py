"""What a sampled token means for its request, from the request's parameters and the model
alone: whether it ends the sequence (``finish_reason``), which ids the next token may not take
(``banned_tokens``), and the logprobs each request asked to see (``reported_logprobs``). The
engine core and speculative decoding's verification read them; no state of their own."""
from __future__ import annotations

from typing import Optional

from tandem.protocol import PositionLogprobs
from tandem.scheduler.sequence import Sequence
from tandem.worker.model_runner import to_position_logprobs


class TokenRules:
    """Stop conditions and banned ids of one model's requests (its EOS ids, its context length)."""

    def __init__(self, eos_token_ids, max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def banned_tokens(self, sequence: Sequence, ahead: int = 0) -> list[int]:
        """Token ids the next token (``ahead`` tokens later: a draft's position) may not take."""
        params = sequence.params
        if sequence.num_output_tokens + ahead >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else list(self.eos_token_ids)
        return eos + list(params.stop_token_ids)

    def finish_reason(self, sequence: Sequence, token: int, num_output: int):
        """``(reason, stop_reason)`` if ``token``, the sequence's ``num_output``-th output token,
        ends it, else ``(None, None)``."""
        params = sequence.params
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if num_output >= sequence.max_tokens or sequence.num_prompt_tokens + num_output >= self.max_model_len:
            return "length", None
        return None, None


def reported_logprobs(sequences, sampled) -> list[Optional[PositionLogprobs]]:
    """Each sequence's sampled-token logprobs cut to the top entries it asked for (None where it
    asked for none)."""
    if all(s.params.logprobs is None for s in sequences):
        return [None] * len(sequences)
    entries = to_position_logprobs(sampled.token_ids, sampled.logprobs, sampled.ranks,
                                   sampled.top_token_ids, sampled.top_logprobs)
    result = []
    for sequence, entry in zip(sequences, entries):
        if sequence.params.logprobs is None:
            result.append(None)
            continue
        keep = sequence.params.logprobs
        result.append(PositionLogprobs(entry.token_ids[:1 + keep], entry.logprobs[:1 + keep], entry.rank))
    return result

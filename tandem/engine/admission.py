"""What a request must satisfy to be admitted at all: errors name the field at fault
("field: message"), and a request that fails here never touches the scheduler or the pool."""
from __future__ import annotations

from typing import Optional

from tandem.protocol import EngineRequest


def check_prompt(prompt: list[int], vocab_size: int) -> None:
    if not prompt:
        raise ValueError("prompt: must contain at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_transfer_leg(request: EngineRequest, role: Optional[str]) -> None:
    """A PD leg must reach an engine of its role (``role``: None when colocated) and use what PD
    supports."""
    leg = request.transfer.role
    if role != leg:
        raise ValueError(f"kv_transfer_params: a {leg} leg sent to a {role or 'colocated'} server")
    params = request.sampling_params
    if params.n != 1:
        raise ValueError("n: disaggregated prefill/decode serves n=1 only")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs: not available with disaggregated prefill/decode")


def resolve_max_tokens(prompt_length: int, max_tokens: Optional[int], max_model_len: int, capacity: int) -> int:
    """``max_tokens`` (all the room left within ``max_model_len`` when None), checked against
    the model's length and the state pool's ``capacity`` in tokens per request."""
    if max_tokens is None:
        max_tokens = max_model_len - prompt_length
        if max_tokens < 1:
            raise ValueError(f"prompt: {prompt_length} tokens leave no room to generate within "
                             f"max_model_len {max_model_len}")
    if prompt_length + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: prompt ({prompt_length} tokens) plus max_tokens ({max_tokens}) "
                         f"exceeds max_model_len ({max_model_len})")
    if prompt_length + max_tokens > capacity:
        raise ValueError(f"max_tokens: prompt ({prompt_length} tokens) plus max_tokens ({max_tokens}) "
                         f"can never fit the state pool ({capacity} tokens)")
    return max_tokens

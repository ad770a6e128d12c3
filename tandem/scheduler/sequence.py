"""A sequence: one of the ``n`` continuations of a request, as the scheduler tracks it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.protocol import PositionLogprobs
from tandem.kv.coordinator import RequestState
from tandem.sampling_params import SamplingParams


# Stands in ``token_ids`` for a token sampled by a step still running on the device (overlapped
# engine loop): the next step reads it on the device, the engine writes the value in when the
# step's results arrive.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    # PD: held outside the queues until its state arrives (decode) or its destination is known
    # (prefill); the scheduler never schedules it (see ``Scheduler.add_remote``).
    WAITING_FOR_REMOTE = "waiting_for_remote"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    token_ids: list[int]  # prompt then outputs; owned by this sequence
    num_prompt_tokens: int
    params: SamplingParams
    state: RequestState
    arrival_order: int
    max_tokens: int  # resolved against max_model_len
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first admission; -1 until admitted
    pending_forks: int = 0  # siblings to fork when the prompt has been computed
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    num_preemptions: int = 0
    sent_first_delta: bool = False
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    # Speculative decoding: proposed continuations of ``token_ids``, verified by the next step
    # (``tandem/spec_decode``), and that package's per-sequence state.
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: Optional[Any] = None
    # Structured outputs: the matcher of the request's grammar (``tandem/structured/matcher.py``),
    # kept level with ``output_token_ids``; None for an unconstrained sequence.
    grammar: Optional[Any] = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def seed(self) -> Optional[int]:
        """The seed of the sequence's own random stream (sequence ``i`` of a request: its seed +
        ``i``; the sampling worker's generator of this sequence starts from it); None without one."""
        seed = self.params.seed
        return None if seed is None else seed + self.index

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def awaits_final_token(self) -> bool:
        """Its last token is still pending and is the last it may generate: nothing is left to
        compute for it (it finishes when the token arrives)."""
        return self.token_ids[-1] == PENDING_TOKEN and self.num_output_tokens >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        if self.params.prompt_logprobs is None or self.index != 0:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens

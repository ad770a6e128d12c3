"""Results returned to users, shaped like vLLM's ``RequestOutput``/``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the chosen token and the top-k).
PositionLogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobDict]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    # Streaming helpers: what this step added (text and token ids) for this choice.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Optional[list[Optional[PositionLogprobDict]]] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None

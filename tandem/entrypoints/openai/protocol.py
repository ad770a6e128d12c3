"""Pydantic models of the OpenAI-compatible requests (responses are built as plain dicts).

Pydantic checks types (a non-integer ``max_tokens`` is a 400 naming the field); value ranges are
checked once, by ``SamplingParams``, whose ``ValueError("field: message")`` also becomes a 400.
Unknown fields are ignored, as OpenAI-compatible servers usually do.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from tandem.sampling_params import SamplingParams

ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""
    model: Optional[StrictStr] = None
    n: StrictInt = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: StrictBool = False
    user: Optional[str] = None
    # Prefill/decode disaggregation: set by ``tandem router`` on each leg ({"room", "role",
    # "prefill_address"}); clients never send it.
    kv_transfer_params: Optional[dict[str, Any]] = None

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int]) -> SamplingParams:
        """Build (and so validate) the engine's parameters; raises ``ValueError("field: ...")``."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


CompletionPrompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: Optional[StrictInt] = 16
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIBaseModel):
    role: ChatRole
    content: Optional[Union[StrictStr, list[TextContentPart]]] = None
    name: Optional[StrictStr] = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to one string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]

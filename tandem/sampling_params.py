"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Validation happens at construction: a bad value raises ``ValueError`` whose message starts
with the field's name, so the server can turn it into a 400 naming the field.
"""
from __future__ import annotations

import json as json_text
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from tandem.validation import require


# The parameters the sampler takes per row, in the order of ``SamplingParams.sampling_row``.
SAMPLING_ROW_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                       "repetition_penalty")


def _fits_64_bits(value: Any) -> bool:
    """Whether every integer inside ``value`` (nested dicts and lists) is one msgpack holds."""
    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, int) and not -2 ** 63 <= node <= 2 ** 64 - 1:
            return False
    return True


@dataclass
class StructuredOutputsParams:
    """What a request's output must match, shaped like vLLM's ``StructuredOutputsParams``.

    Exactly one of ``json`` (a JSON Schema, as a dict or its text), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, GBNF-style) is set.
    ``disable_any_whitespace`` keeps JSON whitespace bounded (the default: no model can loop in
    whitespace); ``False`` allows any whitespace between JSON tokens.

    ``after_token_ids``: the constraint applies only after the first occurrence of this token
    sequence in the output (the end of a model's thinking); until it appears the output is free,
    end of sequence included. ``None``: from the first token.
    """

    json: Union[None, str, dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = True
    after_token_ids: Optional[list[int]] = None

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        chosen = [name for name in self.KINDS if getattr(self, name) not in (None, False)]
        require(len(chosen) == 1, "structured_outputs",
                f"exactly one of {', '.join(self.KINDS)} must be set, got {chosen or 'none'}")
        if self.choice is not None:
            require(isinstance(self.choice, list) and len(self.choice) > 0
                    and all(isinstance(c, str) and c for c in self.choice),
                    "structured_outputs.choice", "must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value != ""),
                    f"structured_outputs.{name}", "must be a non-empty string")
        require(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json",
                "must be a JSON Schema (an object, or its JSON text)")
        if isinstance(self.json, dict) and not _fits_64_bits(self.json):
            # a request reaches the engine as msgpack, which holds no integer past 64 bits (JSON
            # Schema allows any: "maxLength": 2**70): such a schema travels as its JSON text
            self.json = json_text.dumps(self.json, ensure_ascii=False)
        if self.after_token_ids is not None:
            require(isinstance(self.after_token_ids, (list, tuple)) and len(self.after_token_ids) > 0
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.after_token_ids),
                    "structured_outputs.after_token_ids", "must be a non-empty list of token ids (integers >= 0)")
            self.after_token_ids = list(self.after_token_ids)

    @property
    def kind(self) -> str:
        """The one constraint set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(name for name in self.KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        require(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        require(-2 <= self.presence_penalty <= 2, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}")
        require(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}")
        require(self.repetition_penalty > 0, "repetition_penalty",
              f"must be > 0, got {self.repetition_penalty}")
        require(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        require(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"must be a non-negative integer, got {self.min_tokens!r}")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (is_int(value) and 0 <= value <= 20), name,
                  f"must be an integer in [0, 20], got {value!r}")
        require(self.seed is None or is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        require(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a non-empty string or a list of non-empty strings")
        require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")
        if self.structured_outputs is not None:
            # The grammar decides where the output ends (end of sequence only where it may end).
            require(not self.ignore_eos, "ignore_eos", "cannot be combined with structured outputs: the "
                                                       "grammar decides where the output ends")
            require(self.min_tokens == 0, "min_tokens", "cannot be combined with structured outputs: the "
                                                        "grammar decides where the output ends")

    @property
    def sampling_row(self) -> tuple[float, ...]:
        """The per-row sampler parameters, in ``SAMPLING_ROW_FIELDS`` order (spelled out: this
        runs for every row of every step)."""
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalty,
                self.frequency_penalty, self.repetition_penalty)

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the prompt and output token ids (penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

"""What every reasoning parser shares: splitting the thinking off the answer, exactly in streaming.

A model that thinks writes ``<think> ... </think>`` before its answer (the opening marker may
already be in the prompt: a template that starts the thinking for the model). ``split(text,
final)`` is a pure function of the text generated so far, and keeps the contract of the tool-call
parsers (``tool_parsers/base.py``): the reasoning and the content of a text are prefixes of those
of any longer text, so streamed deltas add up to the non-streamed message. A trailing partial end
marker is held back until it is decided.

``boundary`` is what a grammar needs so that a structured output constrains only the answer:
the token ids that end the thinking, and whether the output starts inside the thinking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from tandem.entrypoints.openai.text_markers import partial_marker_start


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: Optional[str]  # None: the output does not think
    content: str


@dataclass(frozen=True)
class ReasoningBoundary:
    """Where the thinking of one request's output ends, in tokens.

    A grammar constraining the answer leaves the output unconstrained while
    ``in_reasoning_at_start`` holds, until a token of ``end_token_ids`` is sampled, and constrains
    every token after it (with ``in_reasoning_at_start`` false, from the first token on).
    ``end_token_ids`` is empty when the end marker is not one token of the vocabulary.
    """
    end_token_ids: tuple[int, ...]
    in_reasoning_at_start: bool


class ReasoningParser:
    """``<think>...</think>`` reasoning. ``prompt_text`` is the rendered prompt: when it leaves a
    thinking block open (the template opened it), the output starts inside the thinking."""

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    # The model always thinks first, whether or not the prompt opened the block (DeepSeek-R1).
    always_thinks: ClassVar[bool] = False

    def __init__(self, prompt_text: str = ""):
        self.in_reasoning_at_start = self.always_thinks or self.prompt_opens_thinking(prompt_text)

    @classmethod
    def prompt_opens_thinking(cls, prompt_text: str) -> bool:
        return prompt_text.rfind(cls.start_marker) > prompt_text.rfind(cls.end_marker)

    def split(self, text: str, final: bool) -> ReasoningSplit:
        begin = self.thinking_begin(text, final)
        if begin is None:
            return ReasoningSplit(None, "")
        if begin < 0:
            return ReasoningSplit(None, text)
        end = text.find(self.end_marker, begin)
        if end < 0:
            reasoning = text[begin:]
            return ReasoningSplit(reasoning if final else reasoning[:partial_marker_start(reasoning, self.end_marker)],
                                  "")
        # the answer's leading whitespace only separates it from the thinking
        return ReasoningSplit(text[begin:end], text[end + len(self.end_marker):].lstrip())

    def thinking_begin(self, text: str, final: bool) -> Optional[int]:
        """Where the thinking starts (after an opening marker the output writes); -1: the output
        does not think; None: not decided yet (only whitespace or part of the opening marker)."""
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(self.start_marker):
            return lead + len(self.start_marker)
        if self.start_marker.startswith(rest) and not final:
            return None
        return 0 if self.in_reasoning_at_start else -1

    def boundary(self, tokenizer) -> ReasoningBoundary:
        return ReasoningBoundary(marker_token_ids(tokenizer, self.end_marker), self.in_reasoning_at_start)


def marker_token_ids(tokenizer, marker: str) -> tuple[int, ...]:
    """The id of ``marker`` when it is a single token of the vocabulary (else none)."""
    token_id = tokenizer.get_vocab().get(marker)
    return () if token_id is None else (int(token_id),)

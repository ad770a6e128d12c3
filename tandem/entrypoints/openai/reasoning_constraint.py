"""A structured output under a reasoning parser constrains only the answer after the thinking.

With ``--reasoning-parser`` set, a chat request whose output must match a grammar
(``response_format``, ``structured_outputs``, or a ``required``/named ``tool_choice``) and whose
rendered prompt leaves the model inside its thinking gets the constraint's ``after_token_ids``:
the token ids of the parser's end-of-thinking marker. The engine then leaves the thinking free
and constrains the tokens after the marker's first occurrence. A prompt that does not leave the
model thinking (a template that closed the block, or a parser whose model thinks only when it
opens the block itself) keeps the constraint from the first token.
"""
from __future__ import annotations

import dataclasses

from tandem.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser
from tandem.sampling_params import SamplingParams


def with_reasoning_boundary(reasoning_parser: str | None, end_token_ids: tuple[int, ...], params: SamplingParams,
                            prompt_text: str) -> SamplingParams:
    """``params`` with its constraint starting after ``end_token_ids`` when the prompt leaves the
    model thinking; ``params`` itself otherwise."""
    parser_class = REASONING_PARSERS.get(reasoning_parser or "")
    if parser_class is None or params.structured_outputs is None:
        return params
    if not parser_class(prompt_text).in_reasoning_at_start:
        return params
    constraint = dataclasses.replace(params.structured_outputs, after_token_ids=list(end_token_ids))
    return dataclasses.replace(params, structured_outputs=constraint)


def reasoning_end_token_ids(reasoning_parser: str, tokenizer) -> tuple[int, ...]:
    """The ids that end the thinking: the end marker's own token where the vocabulary has one
    (``ReasoningParser.boundary``), else the marker's text as the tokenizer encodes it (a model
    that spells the marker in other tokens then never ends its thinking for the grammar: the
    whole output stays unconstrained)."""
    parser_class: type[ReasoningParser] = REASONING_PARSERS[reasoning_parser]
    single = parser_class().boundary(tokenizer).end_token_ids
    if single:
        return single
    return tuple(int(token) for token in tokenizer.encode(parser_class.end_marker, add_special_tokens=False))

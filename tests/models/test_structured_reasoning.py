"""A structured output that constrains only the answer after the thinking (``after_token_ids``).

- the matcher: before the end-of-thinking tokens every token is allowed (the mask is left open,
  a token the grammar forbids is accepted); after them the matcher is level with the answer
  tokens alone, exactly as a fresh matcher fed only the answer; a cut back across the boundary
  (a shorter output, a rejected draft) puts it back in the thinking;
- draft verification: rows before a draft crosses the boundary are open, rows after it masked
  as after the answer's drafts, and the matcher ends where it started;
- the field is validated, naming it;
- end to end on a tiny llama (plain, and with an identical draft model whose drafts cross the
  boundary): the tokens up to the boundary are ``transformers``' unconstrained greedy tokens
  (logprobs too), the text after it matches the constraint, and the request stops there.
"""
from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.bitmask import bitmask_words
from tests.support.oracle import assert_position

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["count"]}


def sequence_with(structured, after=None, output=()):
    constraint = StructuredOutputsParams(json=SCHEMA, after_token_ids=after)
    sequence = SimpleNamespace(grammar=None, params=SimpleNamespace(structured_outputs=constraint),
                               output_token_ids=list(output), is_finished=False)
    structured.attach(sequence, structured.compile(constraint))
    return sequence


def allowed(structured, grammar) -> set[int]:
    mask = torch.full((1, bitmask_words(structured.vocab_size)), -1, dtype=torch.int32)
    grammar.fill(mask, 0)
    return {token for token in range(structured.vocab_size) if (int(mask[0, token // 32]) >> (token % 32)) & 1}


def allowed_row(structured, mask: torch.Tensor, row: int) -> set[int]:
    return {token for token in range(structured.vocab_size) if (int(mask[row, token // 32]) >> (token % 32)) & 1}


def answer_path(structured, length: int) -> list[int]:
    """``length`` tokens the grammar allows from its start (each the first allowed non-EOS one)."""
    grammar, tokens = sequence_with(structured).grammar, []
    for _ in range(length):
        token = min(allowed(structured, grammar) - set(structured.eos_token_ids))
        grammar.accept(token)
        tokens.append(token)
    return tokens


def forbidden_first(structured) -> int:
    return min(set(range(structured.vocab_size)) - allowed(structured, sequence_with(structured).grammar))


def test_free_before_the_boundary_constrained_after_and_rolled_back_across_it(structured):
    everything = set(range(structured.vocab_size))
    boundary = [5, 7]
    answer = answer_path(structured, 4)
    bad = forbidden_first(structured)  # the grammar forbids it as the first answer token
    thinking = [bad, 5, bad, 7, 5]  # half a boundary, then another token: still thinking
    grammar = sequence_with(structured, after=boundary).grammar
    grammar.sync(thinking)
    assert grammar.in_thinking and allowed(structured, grammar) == everything
    assert not grammar.is_terminated and not grammar.constrains_next

    grammar.sync(thinking + [7] + answer[:2])  # the boundary completes at the first [5, 7]
    fresh = sequence_with(structured).grammar
    fresh.sync(answer[:2])
    assert not grammar.in_thinking and grammar.consumed == answer[:2]
    assert grammar.thinking == thinking + [7]
    assert allowed(structured, grammar) == allowed(structured, fresh) != everything

    # A forbidden answer token is a violation (the grammar holds after the boundary).
    with pytest.raises(Exception, match="not allowed"):
        grammar.sync(thinking + [7, bad])
    grammar.sync(thinking + [7] + answer)  # (recovers: the output decides)
    assert grammar.consumed == answer

    # Cut back into the boundary: thinking again, nothing accepted; regrown: level again.
    grammar.sync(thinking)
    assert grammar.in_thinking and grammar.consumed == [] and allowed(structured, grammar) == everything
    grammar.sync(thinking + [7] + answer[:3])
    fresh = sequence_with(structured).grammar
    fresh.sync(answer[:3])
    assert grammar.consumed == answer[:3] and allowed(structured, grammar) == allowed(structured, fresh)

    # The same last token over another history: the whole-history check finds the cut.
    rewritten = [bad, 1] + [7] + answer[:3]  # no boundary: all thinking
    grammar.sync(rewritten, check_history=True)
    assert grammar.in_thinking and grammar.thinking == rewritten and grammar.consumed == []

    # A fork is its own matcher in the same state.
    grammar.sync(thinking + [7] + answer[:1])
    child = grammar.fork()
    child.sync(thinking + [7] + answer[:2])
    assert grammar.consumed == answer[:1] and child.consumed == answer[:2]


def test_draft_rows_open_before_the_boundary_masked_after_it(structured):
    everything = set(range(structured.vocab_size))
    boundary = [9]
    answer = answer_path(structured, 2)
    sequence = sequence_with(structured, after=boundary, output=[3, 4])
    # Verification rows: after the output, then after each longer prefix of the drafts
    # [3, 9, a0, a1]: two rows in the thinking, then the boundary crossed.
    drafts = [[], [3], [3, 9], [3, 9, answer[0]], [3, 9] + answer]
    mask = structured.bitmask([sequence] * len(drafts), drafts=drafts, count=False)
    rows = [allowed_row(structured, mask, row) for row in range(len(drafts))]
    assert rows[0] == rows[1] == everything
    for row, answered in ((2, []), (3, answer[:1]), (4, answer)):
        fresh = sequence_with(structured).grammar
        fresh.sync(answered)
        assert rows[row] == allowed(structured, fresh) != everything
    grammar = sequence.grammar
    assert grammar.in_thinking and grammar.thinking == [3, 4] and grammar.consumed == []  # where it started

    # The ordinary step of a sequence in its thinking: no mask at all; past the boundary, masked.
    assert structured.bitmask([sequence]) is None
    sequence.output_token_ids = [3, 4, 9]
    fresh = sequence_with(structured).grammar
    assert allowed_row(structured, structured.bitmask([sequence]), 0) == allowed(structured, fresh)


@pytest.mark.parametrize("value", [[], [-1], ["a"], [True], 3, "vocabulary"])
def test_after_token_ids_is_validated_naming_the_field(structured, value):
    with pytest.raises(ValueError, match="^structured_outputs.after_token_ids"):
        if value == "vocabulary":  # (only the engine knows its vocabulary)
            structured.compile(StructuredOutputsParams(json=SCHEMA, after_token_ids=[1, structured.vocab_size]))
        else:
            StructuredOutputsParams(json=SCHEMA, after_token_ids=value)


ENGINE = dict(page_size=16, max_total_tokens=4096, max_num_seqs=16, max_num_batched_tokens=512)
ANSWER = r"[0-9]{3}"
THINKING_LENGTH = 6  # the boundary is the greedy continuation's tokens [4, 6)


def thinking_workload(oracle, eos: int, count: int = 3):
    """Prompts whose greedy continuation's tokens [4, 6) occur there first (the boundary the
    output then reaches greedily), with no EOS before them."""
    rng = random.Random(24)
    cases = []
    while len(cases) < count:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))]
        reference = oracle.greedy(prompt, THINKING_LENGTH)
        tokens = reference.token_ids
        boundary = tokens[THINKING_LENGTH - 2:]
        first = next(index for index in range(len(tokens) - 1) if tokens[index:index + 2] == boundary)
        if eos not in tokens and first == THINKING_LENGTH - 2:
            cases.append((prompt, reference, boundary))
    return cases


@pytest.mark.parametrize("speculation", ["none", "identical draft"])
def test_thinking_is_the_oracles_greedy_text_and_the_answer_matches(model_dirs, oracles, speculation):
    extra = {} if speculation == "none" else dict(speculative_model=model_dirs["llama"], num_speculative_tokens=3)
    llm = LLM(model=model_dirs["llama"], **ENGINE, **extra)
    eos = llm.engine.model_info.eos_token_ids[0]
    cases = thinking_workload(oracles["llama"], eos)
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=5,
                             structured_outputs=StructuredOutputsParams(regex=ANSWER, after_token_ids=boundary))
              for _, _, boundary in cases]
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _, _ in cases], params, use_tqdm=False)
    for output, (_, reference, boundary) in zip(outputs, cases):
        choice = output.outputs[0]
        tokens = list(choice.token_ids)
        assert tokens[:THINKING_LENGTH] == reference.token_ids, (tokens, reference.token_ids)
        for position in range(THINKING_LENGTH):
            assert_position(choice.logprobs[position], reference.logprobs[position], 5, f"position {position}")
        answer = llm.tokenizer.decode(tokens[THINKING_LENGTH:], skip_special_tokens=True)
        assert re.fullmatch(ANSWER, answer), answer
        assert choice.finish_reason == "stop"
    # Unconstrained from the first token, the same prompt gives an answer that is not the greedy text.
    if speculation == "none":
        prompt, reference, _ = cases[0]
        plain = llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0.0, max_tokens=40,
                                            structured_outputs=StructuredOutputsParams(regex=ANSWER)),
                             use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(ANSWER, plain.text) and list(plain.token_ids[:2]) != reference.token_ids[:2]
    else:
        speculation_stats = llm.engine.stats().speculation
        assert speculation_stats.num_accepted_tokens > 0, speculation_stats
    llm.engine.check_all_free()

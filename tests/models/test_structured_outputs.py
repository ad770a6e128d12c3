"""Structured outputs offline (``LLM.generate`` with ``SamplingParams.structured_outputs``) on a
tiny random llama: a grammar's guarantees do not depend on the weights.

Hypothesis-generated JSON Schemas (many per generate call): every answer parses, validates
(``jsonschema``) and ends with ``stop``. JSON objects, regexes, choices and EBNF grammars match.
Where the grammar admits the unconstrained greedy continuation, tokens and logprobs equal
``transformers``'. The matcher is per-request state: n > 1 children, recompute and swap
preemption, the overlapped loop and speculative decoding give the outputs an unhindered run
gives. Bad constraints fail with an error naming the field.
"""
from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.bitmask import apply_bitmask_reference
from tests.support.oracle import assert_position

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ENGINE = dict(page_size=16, max_total_tokens=8192, max_num_seqs=64, max_num_batched_tokens=1024)
PROMPTS = ["The weather today", "Answer in JSON:", "1 2 3", "Name an animal."]


def constrained(max_tokens: int = 160, temperature: float = 0.0, seed=None, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model=model_dirs["llama"], **ENGINE)


# ---- schemas: every leaf bounded, so a random model's answer ends ------------------------------

def leaf_schemas():
    integer = st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
                        st.integers(-50, 50), st.integers(0, 200))
    string = st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6))
    pattern = st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"},
                               {"type": "string", "pattern": "^[0-9]{2}-[A-Z]$"}])
    enum = st.lists(st.text(alphabet="abcxyz é", min_size=1, max_size=4), min_size=1, max_size=3,
                    unique=True).map(lambda values: {"enum": values})
    return st.one_of(integer, string, pattern, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def object_of(children):
    keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=5)
    return st.dictionaries(keys, children, min_size=1, max_size=4).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {"type": "object", "properties": properties, "required": required}))


def schemas():
    nested = st.recursive(leaf_schemas(), lambda children: st.one_of(
        object_of(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))),
        max_leaves=4)
    return object_of(nested)


# No shrinking: each example is one generate call of many requests; a failure prints its schema.
@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(schemas(), min_size=24, max_size=24), temperatures=st.lists(st.sampled_from([0.0, 1.0]),
                                                                                  min_size=24, max_size=24))
def test_generated_schemas_parse_validate_and_stop(llm, batch, temperatures):
    params = [constrained(json=schema, temperature=temperature, seed=number if temperature else None, max_tokens=600)
              for number, (schema, temperature) in enumerate(zip(batch, temperatures))]
    prompts = [PROMPTS[number % len(PROMPTS)] for number in range(len(batch))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(batch, outputs):
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
        assert "\n" not in choice.text  # whitespace bounded by default
    llm.engine.check_all_free()


def test_json_object_regex_choice_and_grammar(llm):
    cases = [
        (dict(json_object=True, disable_any_whitespace=True),
         lambda text: isinstance(json.loads(text), dict)),
        (dict(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
              disable_any_whitespace=False),
         lambda text: isinstance(json.loads(text)["ok"], bool)),
        (dict(json=json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                               "minItems": 2, "maxItems": 4})),
         lambda text: 2 <= len(json.loads(text)) <= 4),
        (dict(regex=r"[a-c]{2,5}-[0-9]{1,3}"), lambda text: re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", text)),
        (dict(regex=r"(yes|no), because [a-z ]{0,12}\."),
         lambda text: re.fullmatch(r"(yes|no), because [a-z ]{0,12}\.", text)),
        (dict(choice=["red", "green", "blue \"sky\""]), lambda text: text in ("red", "green", "blue \"sky\"")),
        (dict(grammar='root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [0-9] | [1-9] [0-9]'),
         lambda text: re.fullmatch(r"\((\d{1,2}|\d{1,2}\+\d{1,2})\)", text)),
    ]
    params = [constrained(**constraint, temperature=temperature, seed=7)
              for constraint, _ in cases for temperature in (0.0, 1.0)]
    outputs = llm.generate([PROMPTS[number % 4] for number in range(len(params))], params, use_tqdm=False)
    for number, output in enumerate(outputs):
        constraint, valid = cases[number // 2]
        choice = output.outputs[0]
        assert choice.finish_reason == "stop" and valid(choice.text), (constraint, choice.text)
    stats = llm.engine.stats().structured_outputs
    assert stats.num_compiled >= len(cases) and stats.num_cache_hits >= len(cases)  # each twice: the second hits
    assert stats.num_constrained_steps > 0 and stats.num_constrained_rows >= stats.num_constrained_steps
    llm.engine.check_all_free()


def greedy_prefix_text(tokenizer, token_ids: list[int], eos_token_id: int):
    """``(length, text)``: the longest prefix (at least 4 tokens) of ``token_ids`` that decodes to
    whole characters, or None."""
    for length in range(len(token_ids), 3, -1):
        text = tokenizer.decode(token_ids[:length], clean_up_tokenization_spaces=False)
        if "\ufffd" not in text and eos_token_id not in token_ids[:length] and text.strip():
            return length, text
    return None


def test_equal_to_the_oracle_where_the_grammar_admits_the_greedy_choice(llm, oracles):
    """A choice whose only answers start with the unconstrained greedy text: the tokens are the
    oracle's, the logprobs (of the raw distribution) too, then the grammar ends it with EOS."""
    rng = random.Random(4)
    eos = llm.engine.model_info.eos_token_ids[0]
    prompts, params, expected = [], [], []
    while len(prompts) < 3:  # prompts whose greedy continuation is text a grammar can state
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))]
        reference = oracles["llama"].greedy(prompt, 10)
        found = greedy_prefix_text(llm.tokenizer, reference.token_ids, eos)
        if found is None:
            continue
        length, text = found
        prompts.append(prompt)
        expected.append((reference, length))
        params.append(SamplingParams(temperature=0.0, max_tokens=40, logprobs=5,
                                     structured_outputs=StructuredOutputsParams(choice=[text, text + "!"])))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, (reference, length) in zip(outputs, expected):
        choice = output.outputs[0]
        assert choice.token_ids[:length] == reference.token_ids[:length]
        for position, entry in enumerate(choice.logprobs[:length]):
            assert_position(entry, reference.logprobs[position], 5, f"position {position}")
        assert choice.finish_reason == "stop"
    llm.engine.check_all_free()


def test_bad_constraints_name_the_field(llm):
    cases = [(dict(json={"type": "nope"}), "structured_outputs"), (dict(regex="a(b"), "structured_outputs"),
             (dict(grammar="root ::= undefined_rule"), "structured_outputs"),
             (dict(json="{not json"), "structured_outputs")]
    for constraint, field in cases:
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.generate(["x"], constrained(**constraint), use_tqdm=False)
    for bad, field in ((dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens")):
        with pytest.raises(ValueError, match=f"^{field}: cannot be combined with structured outputs"):
            SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True), **bad)
    with pytest.raises(ValueError, match="^structured_outputs: exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    # Past the compile timeout the request is refused; nothing leaks, the engine goes on.
    structured, compile = llm.engine.structured, llm.engine.structured.pool._compile

    def slow_compile(source):
        time.sleep(0.3)
        return compile(source)

    structured.compile_timeout, structured.pool._compile = 0.05, slow_compile
    try:
        with pytest.raises(ValueError, match="^structured_outputs: the grammar did not compile within 0.05 s"):
            llm.generate(["x"], constrained(regex="[a-z]{1,7}timeout"), use_tqdm=False)
    finally:
        structured.compile_timeout, structured.pool._compile = 30.0, compile
    assert llm.generate(["x"], constrained(choice=["fine"]), use_tqdm=False)[0].outputs[0].text == "fine"
    llm.engine.check_all_free()


def test_bitmask_reference_equals_xgrammar(llm):
    import xgrammar

    generator = torch.Generator().manual_seed(0)
    for vocab, rows in ((512, 3), (100, 5), (70, 2)):
        logits = torch.randn(rows, vocab, generator=generator)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=generator, dtype=torch.int32)
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(apply_bitmask_reference(logits.clone(), bitmask), expected)
    # A mask narrower than the logits (an LM head wider than the tokenizer): the rest is masked.
    wide = apply_bitmask_reference(torch.zeros(1, 40), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 32:]).all() and not torch.isinf(wide[0, :32]).any()


# ---- per-request state: forks, preemption, the overlapped loop, speculation --------------------

STATE_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "kind": {"enum": ["cat", "dog", "emu"]}, "note": {"type": "string", "maxLength": 12}},
    "required": ["id", "tags", "kind", "note"]}


def state_workload(count: int = 8):
    """Constrained requests (greedy and seeded, JSON and regex) mixed with unconstrained ones."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in rng.choices(range(5, 60), k=count)]
    params = []
    for number in range(count):
        temperature, seed = (0.0, None) if number % 2 == 0 else (0.9, number)
        if number % 4 == 3:
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=20, ignore_eos=True))
        elif number % 4 == 1:
            params.append(constrained(regex=r"[a-f]{3,9}( [0-9]{1,4}){2,5}", temperature=temperature, seed=seed,
                                      max_tokens=100))
        else:
            params.append(constrained(json=STATE_SCHEMA, temperature=temperature, seed=seed, max_tokens=100))
    return [{"prompt_token_ids": prompt} for prompt in prompts], params


def results_of(outputs):
    return [[(choice.token_ids, choice.finish_reason) for choice in output.outputs] for output in outputs]


def check_valid(outputs, params) -> None:
    for output, param in zip(outputs, params):
        constraint = param.structured_outputs
        for choice in output.outputs:
            if constraint is None:
                continue
            assert choice.finish_reason == "stop", choice.text
            if constraint.json is not None:
                jsonschema.validate(json.loads(choice.text), constraint.json)
            else:
                assert re.fullmatch(constraint.regex, choice.text), choice.text


@pytest.fixture(scope="module")
def reference_results(llm):
    prompts, params = state_workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_valid(outputs, params)
    return results_of(outputs)


@pytest.mark.parametrize("variant", ["recompute", "swap", "overlapped"])
def test_matchers_survive_preemption_and_the_overlapped_loop(model_dirs, reference_results, variant):
    """Tight pools force preemption (the matcher is kept: it depends on the output alone, and is
    checked level with it before every mask); the overlapped loop reads the previous step's
    tokens back while the next forward pass runs. Outputs equal the roomy one-step run's."""
    options = {**ENGINE, "max_num_batched_tokens": 64, "page_size": 8}
    if variant == "overlapped":
        options.update(async_scheduling=True)
    else:
        options.update(max_total_tokens=256, preemption_mode=variant)
        if variant == "swap":
            options.update(host_cache_size=0.01)
    llm = LLM(model=model_dirs["llama"], **options)
    launch, early = llm.engine._launch, []

    def counting_launch(chunks, previous, *rest):  # steps whose masks waited for the previous step's tokens
        step = launch(chunks, previous, *rest)
        early.append(not isinstance(step, list) and bool(step.earlier_deltas))
        return step

    llm.engine._launch = counting_launch
    prompts, params = state_workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_valid(outputs, params)
    assert results_of(outputs) == reference_results
    stats = llm.engine.stats()
    assert any(early) == (variant == "overlapped")
    if variant != "overlapped":
        assert stats.num_preemptions > 0
    if variant == "swap":
        assert stats.tiers.swaps["out"] > 0
    llm.engine.check_all_free()


def test_n2_children_have_their_own_matchers(llm):
    params = [constrained(json=STATE_SCHEMA, temperature=1.0, seed=11).clone(n=3),
              constrained(regex=r"[a-z]{2,6}", temperature=1.0, seed=12).clone(n=2)]
    outputs = llm.generate(["Pets:", "Word:"], params, use_tqdm=False)
    check_valid(outputs, params)
    texts = [choice.text for choice in outputs[0].outputs]
    assert len(set(texts)) > 1, texts  # the children sampled apart, each within the grammar
    llm.engine.check_all_free()


@pytest.mark.parametrize("draft", ["identical", "random"])
def test_speculative_decoding_verifies_under_the_grammar(model_dirs, reference_results, tokenizer_dir,
                                                         tmp_path_factory, draft):
    """Greedy outputs equal the plain run's; an identical draft is (nearly) always accepted, so
    its drafts past the grammar's checks go through; a random draft's forbidden tokens are
    rejected and the matcher rolls back with them."""
    if draft == "identical":
        draft_dir = model_dirs["llama"]
    else:
        from tandem.tools.make_model import make_model

        draft_dir = str(make_model("llama", tmp_path_factory.mktemp("grammar_draft"), seed=5, hidden_size=32,
                                   num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                   tokenizer_dir=tokenizer_dir))
    llm = LLM(model=model_dirs["llama"], speculative_model=draft_dir, num_speculative_tokens=3, **ENGINE)
    prompts, params = state_workload()
    greedy = [(prompt, param) for prompt, param in zip(prompts, params) if param.temperature == 0.0]
    outputs = llm.generate([prompt for prompt, _ in greedy], [param for _, param in greedy], use_tqdm=False)
    check_valid(outputs, [param for _, param in greedy])
    expected = [result for result, param in zip(reference_results, params) if param.temperature == 0.0]
    assert results_of(outputs) == expected
    speculation = llm.engine.stats().speculation
    if draft == "identical":
        assert speculation.num_accepted_tokens >= speculation.num_draft_tokens - 3, speculation
    else:
        assert speculation.num_accepted_tokens < speculation.num_draft_tokens, speculation
    # Seeded sampling under the grammar stays valid too.
    sampled = [(prompt, param) for prompt, param in zip(prompts, params) if param.temperature > 0]
    outputs = llm.generate([prompt for prompt, _ in sampled], [param for _, param in sampled], use_tqdm=False)
    check_valid(outputs, [param for _, param in sampled])
    llm.engine.check_all_free()


def test_verification_masks_follow_the_drafts_and_roll_back(llm):
    """The masks of a verification's rows: row ``i`` after the first ``i`` drafts; a draft the
    grammar forbids leaves the rows after it unconstrained (verification rejects it at its own
    row, where it is masked out); the matcher ends where it started."""
    from types import SimpleNamespace

    structured = llm.engine.structured
    constraint = StructuredOutputsParams(choice=["ab", "ac"])
    structured.attach(sequence := SimpleNamespace(grammar=None, output_token_ids=[], is_finished=False,
                                                  params=SimpleNamespace(structured_outputs=constraint)),
                      structured.compile(constraint))
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)
    a, b, c, z = (encode(letter)[0] for letter in "abcz")
    ends = set(llm.engine.model_info.eos_token_ids)

    def allowed(mask_row) -> set[int]:
        return {token for token in range(llm.engine.model_info.vocab_size)
                if (int(mask_row[token // 32]) >> (token % 32)) & 1}

    masks = structured.bitmask([sequence] * 4, [[], [a], [a, z], [a, z, b]], count=False).cpu()
    assert a in allowed(masks[0]) and b not in allowed(masks[0])
    assert allowed(masks[1]) >= {b, c} and a not in allowed(masks[1]) and not ends & allowed(masks[1])
    assert len(allowed(masks[2])) == len(allowed(masks[3])) == llm.engine.model_info.vocab_size  # after z
    assert sequence.grammar.consumed == []
    masks = structured.bitmask([sequence] * 2, [[a], [a, c]], count=False).cpu()
    assert allowed(masks[1]) == ends  # "ac" is complete: only the end of sequence
    sequence.output_token_ids = [a, c]  # the verification accepted both: the matcher catches up
    assert allowed(structured.bitmask([sequence], count=False).cpu()[0]) == ends
    assert sequence.grammar.consumed == [a, c]

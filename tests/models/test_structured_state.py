"""The grammar's matcher moves with its request where the request's other state moves: from a
prefill to a decode engine (the prefill engine samples the first token under the grammar, the
decode engine's matcher catches up with it before its first step), across tensor-parallel ranks
(rank 0 owns the matchers and samples), and through MTP speculation. Outputs are valid and equal
those of a colocated single-rank engine; a first token the decode side's grammar forbids ends
the request with an error, never reaches the client as output."""
from __future__ import annotations

import json
import os
import random
import re

os.environ["TANDEM_SANITIZE"] = "1"

import jsonschema  # noqa: E402
import pytest  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.protocol import EngineRequest, TransferParams  # noqa: E402
from tandem.sampling_params import StructuredOutputsParams  # noqa: E402
from tandem.transfer.messages import new_room  # noqa: E402
from tests.support.pd import PDPair  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "w": {"enum": ["alpha", "beta", "gamma"]},
                                           "s": {"type": "string", "maxLength": 5}},
          "required": ["n", "w", "s"]}
REGEX = r"[a-e]{2,6}( [0-9]{1,3}){1,3}"
SMALL = dict(page_size=4, max_total_tokens=1024, max_num_seqs=8, max_num_batched_tokens=16)


def workload():
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 21, 9, 14)]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.9, seed=5, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0.8, seed=6, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    return prompts, params


def check_valid(text: str, params: SamplingParams) -> None:
    constraint = params.structured_outputs
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    else:
        assert re.fullmatch(constraint.regex, text), text


@pytest.fixture(scope="module")
def colocated(model_dirs):
    """The workload's tokens on one colocated single-rank engine."""
    prompts, params = workload()
    outputs = LLM(model=model_dirs["llama"], **SMALL).generate(prompts, params, use_tqdm=False)
    for output, param in zip(outputs, params):
        assert output.outputs[0].finish_reason == "stop"
        check_valid(output.outputs[0].text, param)
    return [output.outputs[0].token_ids for output in outputs]


def test_pd_decode_continues_under_the_grammar(model_dirs, colocated):
    pair = PDPair(model_dirs["llama"], **SMALL)
    try:
        prompts, params = workload()
        for number, (prompt, param) in enumerate(zip(prompts, params)):
            pair.submit(f"r{number}", prompt, param)
        pair.run_until(lambda: all(pair.finished(f"r{number}") for number in range(len(prompts))))
        for number, expected in enumerate(colocated):
            assert pair.error(f"r{number}") is None
            assert pair.tokens(f"r{number}") == expected, number
        stats = pair.prefill.stats().structured_outputs, pair.decode.stats().structured_outputs
        assert all(side.num_constrained_rows > 0 for side in stats), stats  # both sides masked
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_pd_first_token_the_grammar_forbids_is_an_error(model_dirs):
    """The prefill leg unconstrained, the decode leg constrained to a choice its first token
    cannot start: the decode side ends the request with an error naming structured_outputs."""
    pair = PDPair(model_dirs["llama"], **SMALL)
    try:
        prompt, room = [5, 6, 7, 8], new_room()
        free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        first = LLM(model=model_dirs["llama"], **SMALL).generate([prompt], free, use_tqdm=False)[0].outputs[0]
        forbidden = "zz" if not first.text.startswith("z") else "qq"
        strict = SamplingParams(temperature=0.0, max_tokens=4,
                                structured_outputs=StructuredOutputsParams(choice=[forbidden]))
        pair.prefill.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, sampling_params=free,
                                               transfer=TransferParams(room=room, role="prefill")))
        pair.decode.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, sampling_params=strict,
                                              transfer=TransferParams(room=room, role="decode",
                                                                      prefill_address=pair.address)))
        pair.run_until(lambda: pair.finished("x"))
        assert pair.tokens("x") == []
        assert pair.error("x").startswith("structured_outputs: token"), pair.error("x")
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_tp2_rank0_owns_the_matchers(model_dirs, colocated):
    llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, **SMALL)
    try:
        prompts, params = workload()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == colocated
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()


def test_mtp_speculation_under_the_grammar(model_dirs):
    """deepseek_v32's MTP layer proposes under the grammar; verification keeps the outputs those
    of a plain run."""
    options = dict(SMALL, indexer_cache_dtype="float32", max_total_tokens=2048)
    prompts, params = workload()
    plain = LLM(model=model_dirs["deepseek_v32"], **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model_dirs["deepseek_v32"], speculative_method="mtp", num_speculative_tokens=2, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, reference, param in zip(outputs, plain, params):
        check_valid(output.outputs[0].text, param)
        if param.temperature == 0.0:
            assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.engine.stats().speculation.num_draft_tokens > 0
    llm.engine.check_all_free()

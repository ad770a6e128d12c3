"""Sampling through the whole engine: seeds, stop conditions, n > 1, and request errors."""
from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tandem.protocol import EngineRequest


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model=model_dirs["qwen2"], page_size=16, max_total_tokens=2048, max_num_batched_tokens=128)


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def test_seeded_sampling_alone_equals_in_mixed_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True, frequency_penalty=0.3)
    target = prompts(1, seed=11)[0]
    (alone,) = llm.generate([target], seeded)
    others = prompts(7, seed=12)
    batch_params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in range(5, 12)]
    batch = llm.generate(others[:3] + [target] + others[3:], batch_params[:3] + [seeded] + batch_params[3:])
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate([target], seeded)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    llm.engine.check_all_free()


def test_n_seeded_children_equal_their_single_counterparts(llm):
    """Sequence i of a seeded n-request uses seed + i: forked state must equal a fresh prefill."""
    prompt = prompts(1, seed=21)[0] + list(range(3, 40))
    params = SamplingParams(n=3, temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    (forked,) = llm.generate([prompt], params)
    for index in range(3):
        (single,) = llm.generate([prompt], params.clone(n=1, seed=77 + index))
        assert forked.outputs[index].token_ids == single.outputs[0].token_ids
    llm.engine.check_all_free()


def test_max_tokens_stop_token_ids_and_ignore_eos(llm):
    prompt = prompts(1, seed=31)[0]
    (free_run,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens = free_run.outputs[0].token_ids
    assert len(tokens) == 20 and free_run.outputs[0].finish_reason == "length"
    stop_token = tokens[7]
    first = tokens.index(stop_token)
    (stopped,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                       stop_token_ids=[stop_token]))
    assert stopped.outputs[0].token_ids == tokens[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_token


def test_eos_ends_generation_unless_ignored(llm, model_dirs):
    eos = llm.engine.model_info.eos_token_ids[0]
    prompt = prompts(1, seed=41)[0]
    (free_run,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   min_tokens=12, stop_token_ids=[eos]))
    assert forced[0].outputs[0].token_ids == free_run.outputs[0].token_ids
    assert eos not in forced[0].outputs[0].token_ids[:-1]


def test_stop_strings_truncate_text(llm):
    prompt = prompts(1, seed=51)[0]
    (free_run,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free_run.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    (stopped,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert stopped.outputs[0].text == text[:text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    llm.engine.check_all_free()


@pytest.mark.parametrize("field, params", [
    ("temperature", dict(temperature=-1)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("n", dict(n=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=1.5)),
    ("logprobs", dict(logprobs=50)),
])
def test_invalid_sampling_params_name_the_field(field, params):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**params)


def test_requests_that_can_never_fit_fail_clearly(llm):
    engine = llm.engine
    capacity = engine.coordinator.max_tokens_per_request()
    cases = [
        ([], "prompt"),
        ([10 ** 6], "prompt"),
        (list(range(3, 100)), "max_tokens"),
    ]
    for prompt, field in cases:
        with pytest.raises(ValueError, match=f"^{field}:"):
            engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=prompt,
                                             sampling_params=SamplingParams(max_tokens=capacity)))
    assert not engine.has_unfinished_requests()
    engine.check_all_free()


def test_abort_frees_pages_at_once(llm):
    engine = llm.engine
    engine.add_request(EngineRequest(request_id="a", prompt_token_ids=list(range(3, 90)),
                                     sampling_params=SamplingParams(max_tokens=50, n=2)))
    for _ in range(3):
        engine.step()
    assert engine.coordinator.pages_used() > 0
    engine.abort_requests(["a"])
    assert not engine.has_unfinished_requests()
    engine.check_all_free()

"""Structured outputs on CUDA (``pytest -m gpu``): xgrammar's mask kernel equals the plain-PyTorch
reference, and constrained decoding with CUDA graphs and the overlapped loop (masks filled on
the host while the device runs the step's forward pass) gives valid outputs, token for token
those of the one-step loop, with speculative decoding too."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured.bitmask import apply_bitmask, apply_bitmask_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "note": {"type": "string", "maxLength": 10}},
          "required": ["id", "kind", "note"]}
REGEX = r"[a-f]{2,8}( [0-9]{1,3}){1,4}"


@pytest.mark.parametrize("vocab, rows", [(512, 3), (128256, 64), (151936, 7), (70, 1)])
def test_cuda_mask_kernel_equals_reference(vocab, rows):
    generator = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), device="cuda", generator=generator,
                            dtype=torch.int32)
    assert torch.equal(apply_bitmask(logits.clone(), bitmask), apply_bitmask_reference(logits.clone(), bitmask))


def workload():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 30, 77, 12, 50, 9)]
    params = []
    for number in range(len(prompts)):
        temperature, seed = (0.0, None) if number % 2 == 0 else (0.9, number)
        if number % 3 == 2:
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=24, ignore_eos=True))
        else:
            constraint = StructuredOutputsParams(json=SCHEMA) if number % 3 == 0 else StructuredOutputsParams(regex=REGEX)
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=120,
                                         structured_outputs=constraint))
    return prompts, params


@pytest.mark.parametrize("speculation", [{}, {"speculative_model": "same", "num_speculative_tokens": 3}],
                         ids=["plain", "draft"])
def test_cuda_constrained_outputs_equal_across_loops(model_dirs, speculation):
    import jsonschema

    if speculation:
        speculation = {**speculation, "speculative_model": model_dirs["llama"]}
    prompts, params = workload()
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model=model_dirs["llama"], device="cuda", dtype="float32", page_size=16, max_total_tokens=4096,
                  max_num_seqs=8, async_scheduling=async_scheduling, **speculation)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output, param in zip(outputs, params):
            choice = output.outputs[0]
            constraint = param.structured_outputs
            if constraint is None:
                continue
            assert choice.finish_reason == "stop", choice.text
            if constraint.json is not None:
                jsonschema.validate(json.loads(choice.text), SCHEMA)
            else:
                assert re.fullmatch(REGEX, choice.text), choice.text
        results.append([output.outputs[0].token_ids for output in outputs])
        assert llm.engine.stats().structured_outputs.num_constrained_steps > 0
        llm.engine.check_all_free()
        llm.engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("speculation", [{}, {"speculative_model": "same", "num_speculative_tokens": 3}],
                         ids=["plain", "draft"])
def test_cuda_thinking_free_then_the_answer_constrained(model_dirs, speculation):
    """``after_token_ids`` on CUDA (graphs, overlapped loop, a draft model): the tokens up to the
    boundary are the unconstrained greedy run's on the same device, the answer after it matches."""
    if speculation:
        speculation = {**speculation, "speculative_model": model_dirs["llama"]}
    llm = LLM(model=model_dirs["llama"], device="cuda", dtype="float32", page_size=16, max_total_tokens=4096,
              max_num_seqs=8, async_scheduling=True, **speculation)
    rng = random.Random(24)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 60))] for _ in range(24)]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    cases = []
    for prompt, output in zip(prompts, free):
        tokens = list(output.outputs[0].token_ids)
        first = next(index for index in range(5) if tokens[index:index + 2] == tokens[4:6])
        if first == 4 and not set(tokens) & set(llm.engine.model_info.eos_token_ids):
            cases.append((prompt, tokens))
    assert len(cases) >= 3, "too few prompts whose greedy tokens [4, 6) occur there first"
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        regex=REGEX, after_token_ids=tokens[4:6])) for _, tokens in cases]
    outputs = llm.generate([prompt for prompt, _ in cases], params, use_tqdm=False)
    for output, (_, tokens) in zip(outputs, cases):
        choice = output.outputs[0]
        assert list(choice.token_ids[:6]) == tokens
        answer = llm.tokenizer.decode(list(choice.token_ids[6:]), skip_special_tokens=True)
        assert re.fullmatch(REGEX, answer) and choice.finish_reason == "stop", answer
    llm.engine.check_all_free()
    llm.engine.shutdown()

"""Tensor parallelism on two GPUs (``pytest -m gpu``; NCCL between the ranks): TP=2 equals
TP=1 and transformers in float32 for every family it shards. Decode throughput of TP=2 against
TP=1 is ``benchmarks/offline.py --preset llama3-8b-b64 --skip-transformers --tensor-parallel-size 2``.
"""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.oracle import assert_matches
from tests.test_gpu import prompts_for_test

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next", "deepseek_v32"])
def test_cuda_tp2_equals_tp1_float32(arch, model_dirs, oracles, monkeypatch):
    import tests.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    prompts = prompts_for_test()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=1024, max_num_batched_tokens=128,
                   max_num_seqs=8, indexer_cache_dtype="float32")
    single = LLM(model=model_dirs[arch], **options)
    expected = single.generate(prompts, params, use_tqdm=False)
    single.engine.shutdown()
    llm = LLM(model=model_dirs[arch], tensor_parallel_size=2, **options)
    try:
        assert llm.engine.device == torch.device("cuda", 0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    for number, (output, reference, prompt) in enumerate(zip(outputs, expected, prompts)):
        context = f"{arch} TP=2 prompt {number}"
        assert list(output.outputs[0].token_ids) == list(reference.outputs[0].token_ids), context
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, MAX_TOKENS), context=context)

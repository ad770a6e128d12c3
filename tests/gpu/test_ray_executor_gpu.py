"""The Ray executor on two GPUs (``pytest -m gpu``; a local Ray cluster started here, NCCL between
the ranks): TP=2 through Ray equals the multiprocess executor's outputs (greedy tokens, top
logprobs) and transformers', with decode steps replaying CUDA graphs on both ranks; rank 0 (this
process) runs on the GPU Ray reserved for its bundle, rank 1's actor on the other. Throughput
against the multiprocess executor is ``benchmarks/offline.py --preset llama3-8b-b64
--skip-transformers --tensor-parallel-size 2 --distributed-executor-backend ray`` (and ``mp``).
"""
from __future__ import annotations

import os

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.support.oracle import assert_matches
from tests.gpu.test_gpu import prompts_for_test

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

MAX_TOKENS = 12
OPTIONS = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=1024, max_num_batched_tokens=128,
               max_num_seqs=8, indexer_cache_dtype="float32", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def local_ray():
    """A one-node Ray cluster with this machine's GPUs (this process is its driver). Rank 0 makes
    its bundle's GPU current: the device current before is restored for the tests after."""
    device = torch.cuda.current_device()
    ray.init(include_dashboard=False, log_to_driver=True, num_cpus=4, object_store_memory=256 * 2**20)
    try:
        yield
    finally:
        ray.shutdown()
        torch.cuda.set_device(device)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v32"])
def test_cuda_tp2_on_ray_equals_multiprocess(arch, local_ray, model_dirs, oracles, monkeypatch):
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    prompts = prompts_for_test()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    processes = LLM(model=model_dirs[arch], **OPTIONS)
    expected = processes.generate(prompts, params, use_tqdm=False)
    processes.engine.shutdown()
    llm = LLM(model=model_dirs[arch], distributed_executor_backend="ray", **OPTIONS)
    try:
        engine = llm.engine
        places = engine.executor.places
        gpus = [place.gpu_ids for place in places]
        assert len(gpus[0]) == len(gpus[1]) == 1 and gpus[0] != gpus[1], gpus
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        rank_zero_index = int(gpus[0][0]) if visible is None else visible.split(",").index(gpus[0][0])
        assert engine.device == torch.device("cuda", rank_zero_index)  # the GPU of rank 0's bundle
        assert engine.executor.graph_sizes == [1, 2, 4, 8]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert engine.runner.graphs.num_replays >= MAX_TOKENS // 2, "decode steps ran eagerly"
        assert engine.executor.collective_rpc("sanitizer_on") == [True, True]
        engine.check_all_free()
        engine.check_health()
    finally:
        llm.engine.shutdown()
    for number, (output, reference, prompt) in enumerate(zip(outputs, expected, prompts)):
        context = f"{arch} TP=2 on Ray prompt {number}"
        sequence, reference_sequence = output.outputs[0], reference.outputs[0]
        assert list(sequence.token_ids) == list(reference_sequence.token_ids), f"{context}: the multiprocess executor differs"
        for token, entry, reference_entry in zip(sequence.token_ids, sequence.logprobs, reference_sequence.logprobs):
            assert token in entry and token in reference_entry, context
            for token in entry.keys() & reference_entry.keys():  # (the top 5 may order a near tie apart)
                assert abs(entry[token].logprob - reference_entry[token].logprob) <= 1e-3, context
        assert_matches(sequence, oracles[arch].greedy(prompt, MAX_TOKENS), context=context)
